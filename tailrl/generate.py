"""`tailrl generate`: prompt files, chat templates, stop strings, seeds, samples, on any engine.

The engines work on token ids; this module turns user prompts (strings or chat messages) into
requests, derives each sample's seed from (seed, prompt_index, sample_index), decodes them
through the chosen engine's Rollout (tailrl.rollout.registry), as a training run's rollout
does, and turns completions back into text.

Knows: tokenizers, prompt file format, stop strings. Does not know: how tokens are produced.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tailrl.model import Transformer
from tailrl.records import Completion, Progress, Request, Stop
from tailrl.rollout import registry
from tailrl.sampling import SamplingParams, derive_seed
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.stats import Summary, summary_line

Prompt = str | list[dict[str, str]]  # plain text, or chat messages [{"role", "content"}]


@dataclass
class GenerateConfig:
    """What `tailrl generate` samples and with which model."""

    model: str | None = field(default=None, metadata={"help": "model directory (default: SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations (auto: bf16 where the hardware has it)", "choices": ["auto", "bf16", "fp32"]})
    n: int = field(default=1, metadata={"help": "samples per prompt"})
    max_new_tokens: int = field(default=256, metadata={"help": "most tokens generated per sample"})
    seed: int = field(default=0, metadata={"help": "run seed; sample seeds derive from (seed, prompt, sample)"})
    chat: bool = field(default=True, metadata={"help": "wrap prompts in the model's chat template"})
    engine: str = field(default=registry.DEFAULT, metadata={
        "help": "native (tailrl's engine) or vllm (an in-process vLLM engine, the [vllm] section; docs/vllm.md)",
        "choices": registry.NAMES})

    def __post_init__(self) -> None:
        if self.engine not in registry.NAMES:
            raise ValueError(f"engine must be one of {', '.join(registry.NAMES)}, got {self.engine!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file: one object per line with "prompt" (str) or "messages" (list)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"prompts file {path} is not UTF-8 text") from None
    prompts: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and _is_messages(obj.get("messages")):
            prompts.append(obj["messages"])
        else:
            raise ValueError(f'{path}:{n}: expected {{"prompt": str}} or {{"messages": [{{"role", "content"}}, ...]}}')
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts")
    return prompts


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)
    )


def encode_prompt(tokenizer, prompt: Prompt, chat: bool = True) -> tuple[int, ...]:
    """Token ids of one prompt; with `chat`, through the model's chat template."""
    if isinstance(prompt, list) and not chat:
        raise ValueError("chat messages need the chat template; drop --no-chat")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model has no chat template; use --no-chat")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    return tuple(tokenizer.encode(prompt))


def make_requests(prompt_ids: Sequence[tuple[int, ...]], n: int, seed: int) -> list[Request]:
    """n requests per prompt, prompt-major; sample seeds from (seed, prompt_index, sample_index)."""
    return [
        Request(ids, derive_seed(seed, p, s), group=p) for p, ids in enumerate(prompt_ids) for s in range(n)
    ]


def generate(engine: str, sections: Mapping[str, object], model: Transformer, requests: list[Request],
             sampling: SamplingParams, max_new_tokens: int, seed: int, stop: Stop | None,
             progress: Callable[[Progress], None] | None) -> tuple[list[Completion], Summary]:
    """`requests` decoded by engine `engine`'s Rollout, opened from its generate `sections` on
    `model` as a run opens it (refused in one line before it starts, as a run's would be), its
    learned drafter, if any, not adapting: there is no training here. The stats line counts the
    call's tokens, its time, and its speculation where it verified drafts."""
    config = registry.rollout_config(engine, {**sections, "adapt": AdaptConfig(adapt_drafter=False)}, sampling)
    rollout = config.open(model, seed)
    try:
        t0 = time.perf_counter()
        out = rollout.generate(0, requests, sampling, max_new_tokens, on_progress=progress, stop=stop)
        seconds, r = time.perf_counter() - t0, rollout.report()
    finally:
        rollout.close()
    tokens = sum(len(c.token_ids) for c in out)
    return out, summary_line(tokens, seconds, r.spec_verify_steps > 0, r.spec_accept_len, r.spec_proposed,
                             r.spec_accepted, r.spec_verify_steps, r.accept_hist)


@dataclass(frozen=True)
class StopStrings:
    """A Stop (tailrl.records): whether generated tokens end in one of `stops`, decoding only the
    tail. A class, not a closure, so that it pickles to a worker process."""

    tokenizer: Any
    stops: tuple[str, ...]

    def __call__(self, tokens: list[int]) -> bool:
        # A stop string spans at most len(s) tokens (every token decodes to >= 1 char), plus one
        # token of slack for a partial character at the tail start.
        tail = max(len(s) for s in self.stops) + 1
        text = self.tokenizer.decode(tokens[-tail:], skip_special_tokens=True)
        return any(s in text for s in self.stops)


def stop_checker(tokenizer, stops: Sequence[str]) -> Stop | None:
    """Where generated tokens end in a stop string; None for no stop strings."""
    return StopStrings(tokenizer, tuple(stops)) if stops else None


def completion_text(tokenizer, completion: Completion, stops: Sequence[str] = ()) -> str:
    """The sample's text without special tokens, cut before the first stop string."""
    text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    if completion.finish_reason == "stop":
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        text = text[:cut]
    return text
