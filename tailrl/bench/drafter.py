"""`tailrl bench drafter`: the adaptive drafter (trained during RL) against the same warmed-up
drafter kept frozen, over K RL steps of the default run.

Two GRPO runs from the same start and seeds, on the same workers, speculating with the same
drafter; in one it adapts (tailrl.rollout: spot-trained on idle workers with two or more, else
on the update's idle core and after the update) and each step drafts with the newest version;
in the other it never changes. Speculative decoding is lossless, so both runs sample
the same tokens and train the same policy (bit for bit in exact mode, the default here): they
differ only in how well the drafter keeps up with the policy, which is what accept_len (tokens
per verify of the learned drafter's arms, bonus included) shows per step.

Reported: accept_len per step of both runs (and by where in the responses the verifies
started: accept_len_by_position_*), accept_ratio (adaptive over frozen, mean of the
last 5 steps), the ceiling per step (accept_len_ceiling: the target itself as a chain drafter of
the `--spec on` depth, on the same responses; ceiling_ratio is about the most accept_ratio could
be), overhead (mean step time with drafter training over without; this includes the adaptive
drafter's own speed-up, so also reported: train_share, the drafter's training on the step's own
time (after the update, or the rollout's wait for a spot trainer) as a share of step time; and
overhead_median, the median of per-step ratios, which a one-off such as the process's first
update does not move), and a PNG.

Knows: how to configure two training runs and read their metrics. Does not know: how either runs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tailrl.bench.train import TwoRunsConfig
from tailrl.rl.train import RunConfig, TrainConfig
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.modes import RolloutSpeculationConfig

LAST = 5  # steps averaged for accept_ratio


@dataclass(frozen=True)
class BenchDrafterConfig(TwoRunsConfig):
    """Adaptive vs frozen drafter; both runs speculate as `spec` says."""

    steps: int = field(default=20, metadata={"help": "RL steps per run"})
    spec: str = field(default="auto", metadata={"help": "speculation mode of both runs", "choices": ("on", "auto")})


def _configs(cfg: BenchDrafterConfig, drafter: str, adaptive: bool, steps: int) -> RunConfig:
    """The train() config of one run, stopping after `steps` steps."""
    train = TrainConfig(model=cfg.model, task=cfg.task, reward=cfg.reward, num_prompts=cfg.num_prompts,
                        group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens, steps=steps, seed=cfg.seed,
                        eval_every=0, engine=cfg.engine)
    return RunConfig(cfg.rollout(RolloutSpeculationConfig(spec=cfg.spec, drafter=drafter),
                                 AdaptConfig(adapt_drafter=adaptive)), train=train)


def accept_len(record: dict[str, Any]) -> float | None:
    """The learned drafter's accept_len in a step: its own where the engine reports it (the
    native engine, whose tuner also runs the n-gram drafter), else the step's (vLLM drafts with
    the learned drafter only)."""
    own = record["drafter_accept_len"]
    return own if own is not None else (record["spec_accept_len"] if record["spec_verify_steps"] else None)


def _mean(xs: list[float | None]) -> float:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else math.nan


def run(cfg: BenchDrafterConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    from tailrl.bench.train import interleaved, warm_drafter

    out = Path(cfg.out or f"runs/bench-drafter-{time.strftime('%Y%m%d-%H%M%S')}")
    drafter = warm_drafter(cfg, out, log)
    runs = {name: (lambda step, adaptive=adaptive: _configs(cfg, drafter, adaptive, step))
            for name, adaptive in (("adaptive", True), ("frozen", False))}
    records = interleaved(out, runs, cfg.steps, lambda m: (
        f"accept_len {accept_len(m)} step {m['step_s']:.1f}s micro-steps {m['drafter_micro_steps']} "
        f"version {m['drafter_version']}"), log)
    a, s = records["adaptive"], records["frozen"]
    acc_a = [accept_len(r) for r in a]
    acc_s = [accept_len(r) for r in s]
    ceiling = [r["accept_len_ceiling"] for r in a]
    step_a, step_s = _mean([r["step_s"] for r in a]), _mean([r["step_s"] for r in s])
    result = {
        "accept_len_adaptive": acc_a,
        "accept_len_frozen": acc_s,
        "accept_len_ceiling": ceiling,
        # Per step, by where in its response a verify started (the drafter's and n-gram's together).
        "accept_len_by_position_adaptive": [r["accept_len_by_position"] for r in a],
        "accept_len_by_position_frozen": [r["accept_len_by_position"] for r in s],
        "accept_ratio": _mean(acc_a[-LAST:]) / _mean(acc_s[-LAST:]),
        "ceiling_ratio": _mean(ceiling[-LAST:]) / _mean(acc_s[-LAST:]),
        "overhead": step_a / step_s,
        "overhead_median": statistics.median(ra["step_s"] / rs["step_s"] for ra, rs in zip(a, s)),
        "train_share": sum(r["preempt_latency_s"] + r["drafter_after_s"] for r in a) / sum(r["step_s"] for r in a),
        "step_s_adaptive": step_a,
        "step_s_frozen": step_s,
        "drafter_micro_steps": [r["drafter_micro_steps"] for r in a],
        "idle_seconds_harvested": [r["idle_seconds_harvested"] for r in a],
        "idle_seconds_left": [r["idle_seconds_left"] for r in a],
        "config": dataclasses.asdict(cfg) | {"drafter": drafter},
        "png": str(plot(acc_a, acc_s, ceiling, out / "accept_len.png")),
    }
    return result


def plot(adaptive: list[float | None], frozen: list[float | None], ceiling: list[float | None], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(adaptive) + 1)
    nan = lambda xs: [math.nan if x is None else x for x in xs]  # noqa: E731 - a step without drafter verifies
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, nan(adaptive), "o-", label="adaptive (trained during RL)")
    ax.plot(steps, nan(frozen), "s--", label="frozen (warm-up, not trained in RL)")
    ax.plot(steps, nan(ceiling), ":", color="gray", label="ceiling (the target's own chain)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("accept_len (tokens per verify)")
    ax.set_title("learned drafter as the policy trains")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
