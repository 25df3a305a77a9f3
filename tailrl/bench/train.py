"""`tailrl bench train`: K RL steps of the full TLT configuration against the same run with SD off.

Four GRPO runs from the same start (the default model, the same seed, data and settings):
- baseline: speculative decoding off, no drafter training, the update after the whole rollout
  (what veRL and TRL do);
- sd_only: `--spec auto` with a warmed-up learned drafter and the n-gram drafter, the drafter
  adapting during RL (spot-trained on idle workers, or with one worker on the update's idle
  core and after the update), a new version published every step that trained it; the update
  still after the rollout;
- overlap_only: SD off, finished groups' gradients computed in the rollout's tail
  (tailrl.rl.phases);
- tlt: both.
All use the same workers, so the differences are what each part adds. The runs are interleaved step by
step (step k of one, then step k of the other, each continuing its run directory through
resume, which reproduces an uninterrupted run), so the drift of a shared machine hits both
alike; the per-step ratios show the spread.

Identical work. Speculative decoding is lossless: in exact mode (the engine's row-invariant
forwards, default here) both runs sample the same tokens bit for bit, so they compute the same
rewards, the same updates and the same policies. Every step's tokens digest and rewards are
compared; without exact mode a near-tie may flip a token (docs/lossless.md) and the runs drift
apart from there, which the report then shows as not identical.

Engines. Every run decodes on `--engine` (native, or vllm: an in-process vLLM engine, whose
speculation is lossless in distribution only, so its runs sample other tokens than each other);
`--baseline-engine vllm` puts the baseline alone on vLLM: tailrl with TLT against what users run.
Where the runs sample other tokens, the fair ratio is tokens per second (speedup_tok_s).

Reported: per step every run's step / rollout / train seconds, tokens, reward_mean and whether
tokens and rewards agree with the baseline's; per run its speedup over the baseline end to end
(sum of step times), of the rollout phase, in tokens per second of step and of rollout time, the
per-step ratios' range, how the idle time of the rollout's tail was spent (policy gradient,
drafter training, unused) and every run's resident peak (the highest of its steps') beside the
memory budget its update was sized to; speedup_e2e / speedup_rollout / speedup_step_range / speedup_tok_s
are the tlt run's; a PNG.

Knows: how to configure the two runs and read their metrics. Does not know: how either runs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tailrl.engine import EngineConfig
from tailrl.rl.tasks import DEFAULT_TASK
from tailrl.rl.train import RunConfig, TrainConfig
from tailrl.rollout import registry
from tailrl.rollout.protocol import RolloutConfig
from tailrl.rollout.workers import WorkerConfig
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.modes import RolloutSpeculationConfig, SpeculationConfig

RUNS = ("baseline", "sd_only", "overlap_only", "tlt")
SPECULATE = {"sd_only", "tlt"}
OVERLAP = {"overlap_only", "tlt"}


@dataclass(frozen=True)
class TwoRunsConfig:
    """Two GRPO runs of the same model, task and seeds on the same workers (bench train, bench drafter)."""

    model: str | None = field(default=None, metadata={"help": "model directory (default: SmolLM2-135M-Instruct)"})
    task: str = field(default=DEFAULT_TASK, metadata={"help": "reasoning-gym name 'name(key=value)' or a .jsonl file"})
    reward: str | None = field(default=None, metadata={"help": "user reward 'module:function' (default: the task's)"})
    steps: int = field(default=5, metadata={"help": "RL steps per run"})
    drafter: str | None = field(
        default=None, metadata={"help": "warmed-up drafter directory (default: warm one up first, ~5 min)"}
    )
    out: str | None = field(default=None, metadata={
        "help": "directory for both runs and the PNG (default: runs/bench-<name>-<time>)"})
    workers: int = field(default=1, metadata={"help": "rollout workers of every run (1: the default run's; spot "
                                                      "training needs >= 2)"})
    num_prompts: int = field(default=16, metadata={"help": "prompts per step"})
    group_size: int = field(default=4, metadata={"help": "responses per prompt"})
    max_new_tokens: int = field(default=512, metadata={"help": "longest response"})
    seed: int = field(default=0, metadata={"help": "run seed of both runs"})
    exact: bool = field(default=True, metadata={
        "help": "row-invariant forwards in both runs, so both sample the same tokens bit for bit (slower "
                "small-batch steps, see tailrl.model; the native engine's)"})
    engine: str = field(default=registry.DEFAULT, metadata={"help": "rollout engine of every run: native or vllm (an "
                                                            "in-process vLLM engine; lossless in distribution only, "
                                                            "so with --no-exact)", "choices": registry.NAMES})

    def __post_init__(self) -> None:
        if self.steps < 1 or self.workers < 1:
            raise ValueError(f"need steps >= 1 and workers >= 1, got {self.steps} and {self.workers}")
        _check("--engine", self.engine, self.exact, self.workers)

    def rollout(self, speculation: SpeculationConfig, adapt: AdaptConfig) -> RolloutConfig:
        """Every run's engine, speculating and adapting its drafter as given and holding the whole
        batch; each engine reads the sections it has of these."""
        sections = {"engine": EngineConfig(exact=self.exact), "workers": WorkerConfig(workers=self.workers),
                    "speculation": speculation, "adapt": adapt}
        engine = registry.engine(self.engine)
        sections = engine.capacity(sections, self.num_prompts * self.group_size, None)
        return engine.config({name: value for name, value in sections.items() if name in engine.sections})


def _check(flag: str, engine: str, exact: bool, workers: int) -> None:
    """ValueError for exact mode or several workers on an engine (`flag`'s) without them."""
    entry = registry.engine(engine)
    if exact and not entry.exact:
        raise ValueError(f"{flag} {engine} has no exact mode (bit-identical tokens with speculation on and off): "
                         f"use it with --no-exact")
    if workers != 1 and "workers" not in entry.sections:
        raise ValueError(f"{flag} {engine} runs one in-process engine: use it with --workers 1")


@dataclass(frozen=True)
class BenchTrainConfig(TwoRunsConfig):
    """The baseline, SD only, overlap only and the full TLT configuration (one worker: no spot
    training, the default run's setting)."""

    baseline_engine: str | None = field(default=None, metadata={
        "help": "the baseline's engine, when not --engine's: vllm compares tailrl with TLT against what users run "
                "(vLLM, speculation off, the update after the rollout)", "choices": registry.NAMES})
    # Long responses make every step minutes long, and the parts' runs are there to explain TLT's.
    runs: tuple[str, ...] = field(default=RUNS, metadata={
        "help": "comma-separated runs: baseline (always), sd_only, overlap_only, tlt"})

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "runs", tuple(self.runs))
        if "baseline" not in self.runs or len(self.runs) < 2 or set(self.runs) - set(RUNS):
            raise ValueError(f"runs must include baseline, another run, and be among {', '.join(RUNS)}, got "
                             f"{', '.join(self.runs)}")
        if self.baseline_engine not in (None, *registry.NAMES):
            raise ValueError(f"baseline_engine must be one of {', '.join(registry.NAMES)}, got "
                             f"{self.baseline_engine!r}")
        if self.baseline_engine is not None:
            _check("--baseline-engine", self.baseline_engine, self.exact, self.workers)


def configs(cfg: BenchTrainConfig, run: str, drafter: str | None, steps: int) -> RunConfig:
    """The train() config of one run, stopping after `steps` steps."""

    sd = run in SPECULATE
    engine = cfg.baseline_engine if run == "baseline" and cfg.baseline_engine else cfg.engine
    train = TrainConfig(model=cfg.model, task=cfg.task, reward=cfg.reward, num_prompts=cfg.num_prompts,
                        group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens, steps=steps, seed=cfg.seed,
                        overlap_batch=TrainConfig.overlap_batch if run in OVERLAP else 0, eval_every=0, engine=engine)
    speculation = RolloutSpeculationConfig(spec="auto", drafter=drafter) if sd else RolloutSpeculationConfig(spec="off")
    return RunConfig(dataclasses.replace(cfg, engine=engine).rollout(speculation, AdaptConfig(adapt_drafter=sd)),
                     train=train)


def compare(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The report of the runs' metrics records (one per step, in step order); records["baseline"]
    is what every other run is compared with."""
    base = records["baseline"]
    others = [name for name in records if name != "baseline"]
    rows = []
    for k, b in enumerate(base):
        row = {"step": b["step"], "tokens": b["tokens_generated"], "reward_mean": b["reward_mean"]}
        for name, recs in records.items():
            r = recs[k]
            row |= {f"{name}_step_s": r["step_s"], f"{name}_rollout_s": r["rollout_s"], f"{name}_train_s": r["train_s"],
                    f"{name}_sd_fraction": r.get("sd_fraction"), f"{name}_accept_len": r.get("spec_accept_len"),
                    f"{name}_peak_rss_gb": r.get("peak_rss_gb")}
        for name in others:
            r = records[name][k]
            row |= {f"{name}_speedup_step": b["step_s"] / r["step_s"],
                    f"{name}_identical": b["tokens_sha256"] == r["tokens_sha256"] and b["rewards"] == r["rewards"]}
        rows.append(row)
    runs = {}
    for name in others:
        recs = records[name]
        ratios = [r[f"{name}_speedup_step"] for r in rows]
        mean = lambda key: sum(r.get(key) or 0.0 for r in recs) / len(recs)  # noqa: E731
        runs[name] = {
            "speedup_e2e": sum(r["step_s"] for r in base) / sum(r["step_s"] for r in recs),
            "speedup_rollout": sum(r["rollout_s"] for r in base) / sum(r["rollout_s"] for r in recs),
            # Tokens per second of step (and of rollout) time: the same ratios when both sampled the
            # same tokens, the fair one when they did not (another engine samples other tokens).
            "speedup_tok_s": _rate(recs, "step_s") / _rate(base, "step_s"),
            "speedup_rollout_tok_s": _rate(recs, "rollout_s") / _rate(base, "rollout_s"),
            "speedup_step_range": [min(ratios), max(ratios)],
            "identical": all(r[f"{name}_identical"] for r in rows),
            # How the tail's idle time went, seconds per step: the policy's gradient (computed
            # before the rollout ended), drafter training on idle workers, idle workers unused.
            "idle_policy_s": mean("update_in_rollout_s"),
            "idle_drafter_s": mean("idle_seconds_harvested"),
            "idle_unused_s": mean("idle_seconds_left"),
        }
    # The runs share a process; a step's peak counts from its start.
    peaks = {name: [r["peak_rss_gb"] for r in recs if r.get("peak_rss_gb") is not None]
             for name, recs in records.items()}
    tlt = runs.get("tlt") or runs[others[-1]]
    return {
        "speedup_e2e": tlt["speedup_e2e"],
        "speedup_rollout": tlt["speedup_rollout"],
        "speedup_step_range": tlt["speedup_step_range"],
        "speedup_tok_s": tlt["speedup_tok_s"],
        "identical_tokens": all(r["tokens_sha256"] == b["tokens_sha256"] for name in others
                                for r, b in zip(records[name], base)),
        "identical_rewards": all(r["rewards"] == b["rewards"] for name in others for r, b in zip(records[name], base)),
        "runs": runs,
        "peak_rss_gb": {name: max(p) if p else None for name, p in peaks.items()},
        # The budget each run's update was sized to (tailrl.rl.budget), beside its peak.
        "memory_budget_gb": {name: recs[-1].get("memory_budget_gb") if recs else None
                             for name, recs in records.items()},
        "steps": rows,
    }


def _rate(records: list[dict[str, Any]], seconds: str) -> float:
    return sum(r["tokens_generated"] for r in records) / sum(r[seconds] for r in records)


def warm_drafter(cfg: Any, out: Path, log: Callable[[str], None]) -> str:
    """cfg.drafter, or a drafter warmed up for cfg's model and task into out/warm-drafter."""
    if cfg.drafter is not None:
        return cfg.drafter
    from tailrl.warmup import WarmupConfig, warmup

    drafter = str(out / "warm-drafter")
    log(f"warming up a drafter into {drafter}")
    warmup(WarmupConfig(model=cfg.model, task=cfg.task, seed=cfg.seed), Path(drafter))
    return drafter


def interleaved(out: Path, runs: dict[str, Callable[[int], RunConfig]], steps: int,
                describe: Callable[[dict[str, Any]], str], log: Callable[[str], None]) -> dict[str, list[dict]]:
    """Step k of every run, then step k + 1 of every run, ...: runs[name](k) gives the train()
    config stopping after k steps, and each run continues its directory out/name through
    resume. Returns each run's metrics records.

    The order alternates per step (A B, B A, A B, ...): all runs share this process, and going
    first costs (the first update in a process page-faults more: docs/performance.md), so a
    fixed order would bill one run for it.
    """
    from tailrl.rl.run_dir import RunDir
    from tailrl.rl.train import train

    for step in range(1, steps + 1):
        order = list(runs.items()) if step % 2 else list(reversed(runs.items()))
        for name, sections in order:
            train(sections(step), out / name, resume=step > 1)
            log(f"step {step} {name:8s}: {describe(RunDir(out / name).read_metrics()[-1])}")
    return {name: RunDir(out / name).read_metrics() for name in runs}


def run(cfg: BenchTrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    out = Path(cfg.out or f"runs/bench-train-{time.strftime('%Y%m%d-%H%M%S')}")
    drafter = warm_drafter(cfg, out, log)
    runs = {name: (lambda step, name=name: configs(cfg, name, drafter, step)) for name in RUNS if name in cfg.runs}
    records = interleaved(out, runs, cfg.steps, lambda m: (
        f"step {m['step_s']:6.1f} s (rollout {m['rollout_s']:6.1f} s, train {m['train_s']:5.1f} s), "
        f"{m['tokens_generated']} tokens, reward {m['reward_mean']:.3f}"
        + (f", peak {m['peak_rss_gb']:.1f} GiB" if m.get("peak_rss_gb") is not None else "")), log)
    report = compare(records)
    report["config"] = dataclasses.asdict(cfg) | {"drafter": drafter}
    report["png"] = str(plot(report["steps"], out / "bench-train.png"))
    return report


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("baseline", "s--"), ("sd_only", "^:"), ("overlap_only", "v:"), ("tlt", "o-")):
        if f"{name}_step_s" not in rows[0]:
            continue
        ax.plot(steps, [r[f"{name}_step_s"] for r in rows], style, label=f"{name}: step")
        ax.plot(steps, [r[f"{name}_rollout_s"] for r in rows], style, alpha=0.4, label=f"{name}: rollout")
    ax.set_xlabel("RL step")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title("GRPO step time: TLT and its parts vs the baseline")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
