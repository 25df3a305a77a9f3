"""`tailrl bench spec`: plain vs speculative tokens/s per batch size and arm, same requests.

For each batch size, the same requests (the default task's prompts, sampled at temperature 1
with position-keyed seeds) run once with plain decoding and once per arm, all in one process;
the arms' tokens are compared with plain decoding's (`identical` per row). They are equal bit
for bit only in exact mode (tailrl.model); without it a uniform within rounding of a CDF
boundary flips a token now and then (docs/lossless.md), and this shows it.

Knows: how to time the engine in each mode. Does not know: training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tailrl.engine import Engine, EngineConfig, PlainDecoder
from tailrl.generate import encode_prompt, make_requests
from tailrl.loading import load_model, load_tokenizer, resolve_model_dir
from tailrl.rl.tasks import DEFAULT_TASK, format_prompt, make_task
from tailrl.sampling import SamplingParams
from tailrl.speculative.decoder import fixed
from tailrl.speculative.modes import SpeculationConfig, proposers
from tailrl.tuner import Arm


@dataclass
class BenchSpeculativeConfig:
    model: str | None = field(default=None, metadata={"help": "target model directory (default: SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={"help": "target dtype", "choices": ["auto", "bf16", "fp32"]})
    drafter: str | None = field(default=None, metadata={"help": "learned drafter directory (none: n-gram arms only)"})
    batch_sizes: tuple[int, ...] = field(default=(1, 4, 16, 64), metadata={"help": "comma-separated batch sizes"})
    max_new_tokens: int = field(default=96, metadata={"help": "tokens per sequence"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})


@dataclass
class SpecRow:
    batch_size: int
    arm: str
    plain_tok_s: float
    spec_tok_s: float
    speedup: float
    accept_len: float
    identical: bool


def arms_for(has_drafter: bool) -> list[Arm]:
    ngram = [Arm("ngram", 6, 1, 6)]
    learned = [Arm("drafter", 4, 1, 4), Arm("drafter", 6, 1, 6), Arm("drafter", 4, 2, 8)]
    return (learned if has_drafter else []) + ngram


def run(cfg: BenchSpeculativeConfig, log=print) -> list[SpecRow]:
    path = resolve_model_dir(cfg.model)
    tok = load_tokenizer(path)
    model = load_model(path, dtype=cfg.dtype)
    engine = Engine(model, EngineConfig(max_batch=max(cfg.batch_sizes)))
    props = proposers(SpeculationConfig(drafter=cfg.drafter), engine)
    task = make_task(DEFAULT_TASK)
    params = SamplingParams(temperature=cfg.temperature)
    rows = []
    for b in cfg.batch_sizes:
        prompts = [encode_prompt(tok, format_prompt(task.sample(1, i).question)) for i in range(b)]
        reqs = make_requests(prompts, 1, seed=b)
        engine.decoder = PlainDecoder()
        engine.generate(reqs[:1], params, 2)  # allocate the cache outside the timed runs
        plain = engine.generate(reqs, params, cfg.max_new_tokens)
        plain_rate = engine.stats.tokens_per_s
        for arm in arms_for(cfg.drafter is not None):
            engine.decoder = fixed(arm, props[arm.kind])
            out = engine.generate(reqs, params, cfg.max_new_tokens)
            same = [c.token_ids for c in out] == [c.token_ids for c in plain]
            st = engine.stats
            row = SpecRow(b, arm.label, plain_rate, st.tokens_per_s, st.tokens_per_s / plain_rate, st.spec.accept_len, same)
            log(f"batch {b:3d} {arm.label:>18}: plain {plain_rate:6.1f} tok/s | spec {row.spec_tok_s:6.1f} tok/s | "
                f"speedup {row.speedup:4.2f}x | accept_len {row.accept_len:4.2f}" + ("" if same else " | TOKENS DIFFER"))
            rows.append(row)
    return rows


def report(cfg: BenchSpeculativeConfig, log=print) -> dict[str, Any]:
    """`run` as the JSON object of `--json`; "identical" per row: the arm's tokens are plain decoding's."""
    return {"results": [asdict(r) for r in run(cfg, log)]}
