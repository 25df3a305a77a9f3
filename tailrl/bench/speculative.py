"""`tailrl bench spec`: plain vs speculative tokens/s per batch size and arm, same requests.

For each batch size, the same requests (the default task's prompts, sampled at temperature 1
with position-keyed seeds) run once with plain decoding and once per arm, all in one process;
the arms' tokens are compared with plain decoding's (`identical` per row). They are equal bit
for bit only in exact mode (tailrl.model); without it a uniform within rounding of a CDF
boundary flips a token now and then (docs/lossless.md), and this shows it.

Verify cost. A speculative step of b rows and N draft nodes feeds b x (N + 1) tokens to the
target, the arithmetic of a plain step of b x (N + 1) rows, plus the drafting. Each row also
reports the arm's drafting and verify time per step (verify: the forward, the acceptance walk,
compaction and emission) beside a plain step of b rows and one of b x (N + 1) rows (a short
plain run of that many requests; up to WIDE_ROWS rows).

Knows: how to time the engine in each mode. Does not know: training.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from tailrl.engine import Engine, EngineConfig, PlainDecoder
from tailrl.generate import encode_prompt, make_requests
from tailrl.loading import load_model, load_tokenizer, resolve_model_dir
from tailrl.rl.tasks import DEFAULT_TASK, format_prompt, make_task
from tailrl.sampling import SamplingParams
from tailrl.speculative.decoder import fixed
from tailrl.speculative.modes import SpeculationConfig, proposers
from tailrl.stats import StepRecord
from tailrl.tuner import Arm


@dataclass
class BenchSpeculativeConfig:
    model: str | None = field(default=None, metadata={
        "help": "target model directory (default: SmolLM2-135M-Instruct)"})
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
    draft_ms: float  # the arm's drafting, per speculative step
    verify_ms: float  # its verify forward, acceptance walk, compaction and emission, per step
    plain_ms: float | None  # a plain step of batch_size rows (median)
    wide_plain_ms: float | None  # a plain step of batch_size x (num_draft_tokens + 1) rows: the verify's arithmetic


WIDE_ROWS = 256  # the widest plain step measured for the verify's arithmetic
WIDE_STEPS = 8  # plain steps decoded at that width


def plain_ms(timeline: list[StepRecord], rows: int) -> float | None:
    """Median milliseconds of the plain steps that advanced `rows` sequences, if any did."""
    times = [r.seconds for r in timeline if r.batch == rows and r.arm == "plain"]
    return statistics.median(times) * 1e3 if times else None


def arms_for(has_drafter: bool) -> list[Arm]:
    ngram = [Arm("ngram", 6, 1, 6)]
    learned = [Arm("drafter", 4, 1, 4), Arm("drafter", 6, 1, 6), Arm("drafter", 4, 2, 8)]
    return (learned if has_drafter else []) + ngram


def run(cfg: BenchSpeculativeConfig, log=print) -> list[SpecRow]:
    path = resolve_model_dir(cfg.model)
    tok = load_tokenizer(path)
    model = load_model(path, dtype=cfg.dtype)
    arms = arms_for(cfg.drafter is not None)
    # Measured before any batch's own run, so a width that is also a batch size has its value in time.
    widths = {w for b in cfg.batch_sizes for a in arms if (w := b * (a.num_draft_tokens + 1)) <= WIDE_ROWS}
    engine = Engine(model, EngineConfig(max_batch=max([*cfg.batch_sizes, *widths])))
    props = proposers(SpeculationConfig(drafter=cfg.drafter), engine)
    task = make_task(DEFAULT_TASK)
    params = SamplingParams(temperature=cfg.temperature)
    prompts = [encode_prompt(tok, format_prompt(task.sample(1, i).question))
               for i in range(max([*cfg.batch_sizes, *widths]))]
    step_ms: dict[int, float | None] = {}
    engine.decoder = PlainDecoder()
    # Allocate the cache at its widest outside the timed runs (a first run at a new size page-faults).
    engine.generate(make_requests(prompts, 1, seed=0), params, 2)
    for w in sorted(widths):
        engine.generate(make_requests(prompts[:w], 1, seed=w), params, WIDE_STEPS)
        step_ms[w] = plain_ms(engine.stats.timeline, w)
    rows = []
    for b in cfg.batch_sizes:
        reqs = make_requests(prompts[:b], 1, seed=b)
        engine.decoder = PlainDecoder()
        plain = engine.generate(reqs, params, cfg.max_new_tokens)
        plain_rate = engine.stats.tokens_per_s
        step_ms.setdefault(b, plain_ms(engine.stats.timeline, b))
        for arm in arms:
            engine.decoder = fixed(arm, props[arm.kind])
            out = engine.generate(reqs, params, cfg.max_new_tokens)
            same = [c.token_ids for c in out] == [c.token_ids for c in plain]
            st = engine.stats
            per_step = 1e3 / max(st.spec.spec_steps, 1)
            row = SpecRow(b, arm.label, plain_rate, st.tokens_per_s, st.tokens_per_s / plain_rate, st.spec.accept_len,
                          same, st.spec.draft_seconds * per_step, st.spec.verify_seconds * per_step, step_ms[b],
                          step_ms.get(b * (arm.num_draft_tokens + 1)))
            log(f"batch {b:3d} {arm.label:>18}: plain {plain_rate:6.1f} tok/s | spec {row.spec_tok_s:6.1f} tok/s | "
                f"speedup {row.speedup:4.2f}x | accept_len {row.accept_len:4.2f} | step: draft {row.draft_ms:.1f} + "
                f"verify {row.verify_ms:.1f} ms; plain step {_ms(row.plain_ms)} at {b} rows, "
                f"{_ms(row.wide_plain_ms)} at {b * (arm.num_draft_tokens + 1)}" + ("" if same else " | TOKENS DIFFER"))
            rows.append(row)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def report(cfg: BenchSpeculativeConfig, log=print) -> dict[str, Any]:
    """`run` as the JSON object of `--json`; "identical" per row: the arm's tokens are plain decoding's."""
    return {"results": [asdict(r) for r in run(cfg, log)]}
