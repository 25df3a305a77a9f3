"""Cold start: supervised fine-tuning of a model directory on a task's worked solutions.

Each example is a task problem's chat prompt (the prompt RL samples from, tailrl.rl.tasks'
encode_question) followed by the task's worked solution and the end-of-turn token. Only the
solution tokens are in the loss; examples are packed into one row per micro-batch without
padding (tailrl.rl.packing.packed_logprobs, the GRPO update's packing), and the loss is the token
mean over the whole optimizer batch, accumulated over micro-batches. AdamW with linear warm-up
and cosine decay; on CPUs with native bf16 the forward/backward runs under bf16 autocast with
fp32 master weights. Held-out loss and accuracy (greedy and at the rollout temperature, sampled
by tailrl's Engine and scored by the task's verifier) are reported as it goes.

The output is a Hugging Face model directory (config, safetensors, tokenizer, chat template)
written atomically. Without an explicit output it lands in the tailrl cache under a hash of
(base model files, task, settings), so a second run with the same inputs reuses it at once.
Ctrl-C writes what was trained so far (marked as interrupted; the cache never reuses it).

Knows: tasks with worked solutions, tokenizers, the packed log-prob forward, AdamW, files.
Does not know: how the engine decodes, RL.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import save_file

from tailrl.cache_dir import cache_root
from tailrl.engine import Engine, EngineConfig
from tailrl.loading import DTYPES, load_model, load_tokenizer, model_fingerprint, resolve_dtype, resolve_model_dir
from tailrl.model import Transformer
from tailrl.records import Request
from tailrl.rl.guards import sigint_deferred
from tailrl.rl.packing import ON_POLICY, Sample, packed_logprobs
from tailrl.rl.run_dir import policy_weights
from tailrl.rl.tasks import DEFAULT_TASK, HELDOUT_STREAM, Problem, encode_question, extract_answer, make_task
from tailrl.rl.worked import WorkedTask
from tailrl.sampling import SamplingParams, derive_seed

SFT_FILE = "sft.json"  # settings, hash, and how the run ended, inside the output directory
# Training problems come from a seed stream of their own, apart from the held-out stream
# (tailrl.rl.tasks.HELDOUT_STREAM) and the RL run's (its run seed).
_TRAIN = 2_000_003


@dataclass(frozen=True)
class SFTConfig:
    """Cold-start fine-tuning: data, optimiser, evaluation."""

    model: str | None = field(default=None, metadata={"help": "base model directory (None = SmolLM2-135M-Instruct)"})
    task: str = field(default=DEFAULT_TASK, metadata={"help": "task with worked solutions ('sums', "
                                                           "'collatz', 'rg:gsm_symbolic', a .jsonl with 'solution')"})
    steps: int = field(default=40, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=8, metadata={"help": "examples per optimizer step"})
    micro_batch: int = field(default=4, metadata={"help": "examples per packed forward/backward"})
    lr: float = field(default=3e-4, metadata={"help": "peak AdamW learning rate"})
    warmup: float = field(default=0.1, metadata={"help": "share of the steps spent warming the lr up"})
    min_lr: float = field(default=0.1, metadata={"help": "final lr as a share of the peak (cosine decay)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    autocast: str = field(default="auto", metadata={
        "help": "forward/backward compute dtype (auto: bf16 where it is fast; master weights stay fp32)",
        "choices": ("auto", "bf16", "fp32")})
    seed: int = field(default=0, metadata={"help": "data order and evaluation sampling"})
    eval_every: int = field(default=20, metadata={"help": "evaluate every N steps (0 = only at the end)"})
    eval_problems: int = field(default=24, metadata={"help": "held-out problems per evaluation"})
    eval_max_new_tokens: int = field(default=512, metadata={"help": "longest sampled answer in evaluation"})
    eval_temperature: float = field(default=1.0, metadata={"help": "rollout temperature evaluated beside greedy"})

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "micro_batch", "eval_problems", "eval_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.warmup < 1 or not 0 <= self.min_lr <= 1:
            raise ValueError("need lr > 0, 0 <= warmup < 1 and 0 <= min_lr <= 1")
        if self.eval_every < 0 or self.seed < 0 or not self.eval_temperature > 0:
            raise ValueError("need eval_every >= 0, seed >= 0 and eval_temperature > 0")


# Settings that do not change the trained weights, so the cache key leaves them out.
_NOT_IN_KEY = ("eval_every", "eval_problems", "eval_max_new_tokens", "eval_temperature")


@dataclass(frozen=True)
class EvalResult:
    step: int
    loss: float  # held-out token-mean NLL of the worked solutions
    accuracy: dict[str, float]  # "greedy" / "T=1.0" -> share of held-out problems solved
    format_rate: dict[str, float]  # same keys: share of answers in the answer format
    mean_len: dict[str, float]  # same keys: mean response tokens


@dataclass(frozen=True)
class SFTProgress:
    step: int
    steps: int
    loss: float
    lr: float
    seconds: float


@dataclass(frozen=True)
class SFTResult:
    out_dir: Path
    cached: bool  # reused from an earlier run
    steps: int  # optimizer steps in the output
    interrupted: bool
    evals: tuple[EvalResult, ...] = ()


# ---- data ---------------------------------------------------------------------------------------


def worked_task(name: str) -> WorkedTask:
    task = make_task(name)
    if not isinstance(task, WorkedTask):
        raise ValueError(f"task {name!r} has no worked solutions to fine-tune on")
    task.solution(task.sample(0, 0))  # raises ValueError (with the reason) where items carry none
    return task


def stop_token(tokenizer: Any, model: Transformer) -> int:
    """The token a worked solution ends with: the chat template's end of turn, which must be what
    the engine stops at."""
    stop_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    if stop_id not in model.cfg.eos_token_ids:
        raise ValueError(f"the tokenizer's end token {tokenizer.eos_token!r} is not among the model's EOS ids "
                         f"{list(model.cfg.eos_token_ids)}; generation would not stop where solutions end")
    return stop_id


def example(task: WorkedTask, tokenizer: Any, problem: Problem, stop_id: int) -> Sample:
    """One training example: the RL chat prompt, then the solution's tokens and end of turn (no
    policy sampled it: ON_POLICY; SFT's loss has no importance ratio anyway)."""
    response = tokenizer.encode(task.solution(problem), add_special_tokens=False) + [stop_id]
    return Sample(encode_question(tokenizer, problem.question), response, 0.0, ON_POLICY)


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warm-up over the first `warmup` share of the steps, then cosine decay to min_lr."""
    warm = max(1, round(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr + (1 - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))


def nll_sums(model: Transformer, samples: Sequence[Sample], micro_batch: int, compute: torch.dtype,
             backward_total: int | None = None) -> float:
    """Summed negative log-likelihood of the samples' response tokens, micro_batch per packed
    forward. With backward_total, also backpropagates sum / backward_total (a token mean over
    that many tokens, so micro-batches accumulate into one batch's gradient)."""
    device = model.lm_head.weight.device
    total = 0.0
    for first in range(0, len(samples), micro_batch):
        with torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32):
            nll = -packed_logprobs(model, samples[first : first + micro_batch], 1.0).sum()
        if backward_total is not None:
            (nll / backward_total).backward()
        total += float(nll.detach())
    return total


# ---- evaluation ---------------------------------------------------------------------------------


def evaluate(model: Transformer, task: WorkedTask, tokenizer: Any, cfg: SFTConfig, step: int,
             heldout: Sequence[Sample], problems: Sequence[Problem], compute: torch.dtype) -> EvalResult:
    """Held-out loss, and accuracy of answers sampled greedily and at the rollout temperature."""
    with torch.no_grad():
        tokens = sum(len(s.token_ids) for s in heldout)
        loss = nll_sums(model, heldout, cfg.micro_batch, compute) / tokens
    rollout = copy.deepcopy(model).to(torch.bfloat16 if compute == torch.bfloat16 else torch.float32)
    engine = Engine(rollout, EngineConfig())
    prompts = [s.prompt_ids for s in heldout]
    accuracy, formats, lens = {}, {}, {}
    for label, temperature in (("greedy", 0.0), (f"T={cfg.eval_temperature:g}", cfg.eval_temperature)):
        requests = [Request(p, derive_seed(cfg.seed, HELDOUT_STREAM, i), group=i) for i, p in enumerate(prompts)]
        out = engine.generate(requests, SamplingParams(temperature), cfg.eval_max_new_tokens)
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out]
        answers = [extract_answer(t) for t in texts]
        accuracy[label] = sum(a is not None and task.score(p, a) == 1.0 for p, a in zip(problems, answers)) / len(out)
        formats[label] = sum(a is not None for a in answers) / len(out)
        lens[label] = sum(len(c.token_ids) for c in out) / len(out)
    return EvalResult(step, loss, accuracy, formats, lens)


# ---- output -------------------------------------------------------------------------------------


def cache_key(cfg: SFTConfig, model_dir: Path) -> str:
    """Hash of the base model's files (names, sizes, config), the task and the settings that
    shape the weights."""
    h = hashlib.sha256(model_fingerprint(model_dir).encode())
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_IN_KEY and k != "model"}
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def default_out_dir(cfg: SFTConfig, model_dir: Path) -> Path:
    return cache_root() / "sft" / cache_key(cfg, model_dir)


def cached(out: Path, key: str) -> bool:
    """Whether `out` holds a finished run with this cache key."""
    try:
        meta = json.loads((out / SFT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return meta.get("key") == key and not meta.get("interrupted", True)


def save_model(model: Transformer, base_dir: Path, tokenizer: Any, out: Path, meta: dict[str, Any]) -> None:
    """Write a Hugging Face model directory atomically: a temporary sibling, then a rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        config = json.loads((base_dir / "config.json").read_text())
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        weights = {k: v.to(torch.float32) for k, v in policy_weights(model).items()}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / SFT_FILE).write_text(json.dumps(meta, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- the run ------------------------------------------------------------------------------------


def sft(cfg: SFTConfig, out: str | Path | None = None,
        on_event: Callable[[SFTProgress | EvalResult], None] | None = None) -> SFTResult:
    """Fine-tune cfg.model on cfg.task's worked solutions; returns where the model is.

    Events passed to on_event: SFTProgress after every step, EvalResult after every evaluation.
    """
    emit = on_event or (lambda event: None)
    model_dir = resolve_model_dir(cfg.model)
    key = cache_key(cfg, model_dir)
    out_dir = Path(out) if out is not None else default_out_dir(cfg, model_dir)
    if cached(out_dir, key):
        meta = json.loads((out_dir / SFT_FILE).read_text())
        return SFTResult(out_dir, True, meta["steps"], False)
    task = worked_task(cfg.task)
    tokenizer = load_tokenizer(model_dir)
    compute = DTYPES[resolve_dtype(cfg.autocast)]
    torch.manual_seed(cfg.seed)
    model = load_model(model_dir, "fp32").requires_grad_(True)
    stop_id = stop_token(tokenizer, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    problems = [task.sample(cfg.seed + HELDOUT_STREAM, i) for i in range(cfg.eval_problems)]
    heldout = [example(task, tokenizer, p, stop_id) for p in problems]
    evals: list[EvalResult] = []
    start, step, interrupted = time.perf_counter(), 0, False
    try:
        while step < cfg.steps:
            first = step * cfg.batch_size
            problems_now = [task.sample(cfg.seed + _TRAIN, first + i) for i in range(cfg.batch_size)]
            batch = [example(task, tokenizer, p, stop_id) for p in problems_now]
            tokens = sum(len(s.token_ids) for s in batch)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            optimizer.zero_grad(set_to_none=True)
            loss = nll_sums(model, batch, cfg.micro_batch, compute, backward_total=tokens) / tokens
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            emit(SFTProgress(step, cfg.steps, loss, lr_at(step - 1, cfg), time.perf_counter() - start))
            if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                evals.append(evaluate(model, task, tokenizer, cfg, step, heldout, problems, compute))
                emit(evals[-1])
    except KeyboardInterrupt:
        interrupted = True
    meta = {"key": key, "base_model": str(model_dir), "steps": step, "interrupted": interrupted,
            "seconds": time.perf_counter() - start, "config": dataclasses.asdict(cfg),
            "evals": [dataclasses.asdict(e) for e in evals]}
    with sigint_deferred():  # a second Ctrl-C must not leave the output half-replaced
        save_model(model, model_dir, tokenizer, out_dir, meta)
    return SFTResult(out_dir, False, step, interrupted, tuple(evals))
