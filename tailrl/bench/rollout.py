"""`tailrl bench rollout`: one long-tailed GRPO rollout batch, decoded plain and speculatively.

The batch is the first RL step of the configured run (the task's problems at the start of its
stream, group_size seeded samples each, the policy before any update). It is generated in each
mode: off (plain decoding), ngram (n-gram drafter every step), drafter (the learned drafter every
step, when one is given) and auto (the tuner, TLT's switch gate in front). Modes run interleaved
within each repetition, so slow phases of a shared machine hit every mode alike; each mode starts
from a fresh decoder every time (an empty n-gram history: a repetition must not draft from its
own previous answers). The tuner starts from the state it reached on one untimed rollout of
another batch (the previous step's problems and seeds), as in training from the second step on,
where the tuner's state carries over; `--cold-tuner` starts it empty instead. Tokens are compared
with the off run of the same repetition.

The long-tail picture: the running batch size over time per mode, and the ideal time, i.e. the
off run's prefill plus all its decode tokens at the throughput of its full-batch steps: what the
rollout would take if no sequence were longer than the others.

Knows: how to build a step's requests (tailrl.rl.train) and install a mode (tailrl.speculative.modes).
Does not know: rewards, training.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model, load_tokenizer, resolve_model_dir
from tailrl.rl.plots import log_counts
from tailrl.rl.run_dir import atomic_file
from tailrl.rl.tasks import DEFAULT_TASK, make_task
from tailrl.rl.train import TrainConfig, rollout_requests
from tailrl.sampling import SamplingParams
from tailrl.speculative.modes import SpeculationConfig, install
from tailrl.speculative.report import rollout_report
from tailrl.tuner import TunerConfig

MODES = ("off", "ngram", "drafter", "auto")


@dataclass
class BenchRolloutConfig:
    model: str | None = field(default=None, metadata={"help": "target model directory (default: SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={"help": "rollout dtype", "choices": ["auto", "bf16", "fp32"]})
    drafter: str | None = field(default=None, metadata={"help": "learned drafter directory (adds the drafter mode; auto uses it too)"})
    task: str = field(default=DEFAULT_TASK, metadata={"help": "reasoning-gym name or .jsonl file"})
    num_prompts: int = field(default=16, metadata={"help": "prompts in the batch (the default run's step)"})
    group_size: int = field(default=4, metadata={"help": "samples per prompt"})
    max_new_tokens: int = field(default=512, metadata={"help": "longest response"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    seed: int = field(default=0, metadata={"help": "run seed (problems and sampling)"})
    reps: int = field(default=3, metadata={"help": "repetitions of every mode"})
    modes: tuple[str, ...] = field(default=("off", "ngram", "drafter", "auto"), metadata={"help": "comma-separated modes to run (drafter only with --drafter)"})
    exact: bool = field(default=False, metadata={"help": "bit-exact speculative decoding (slower steps, see tailrl.model)"})
    cold_tuner: bool = field(default=False, metadata={"help": "auto starts with an empty tuner (default: warmed on one other batch)"})
    plot: str | None = field(default="bench-rollout.png", metadata={"help": "PNG of the running batch over time and the times (empty: none)"})

    def __post_init__(self) -> None:
        self.modes = tuple(self.modes)
        unknown = set(self.modes) - set(MODES)
        if unknown or "off" not in self.modes:
            raise ValueError(f"modes must include off and be among {', '.join(MODES)}, got {', '.join(self.modes)}")
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")


@dataclass
class ModeResult:
    seconds: list[float] = field(default_factory=list)  # one per repetition
    tokens: int = 0
    accept_len: float = 0.0  # tokens per sequence-verify of speculative steps (0: none)
    sd_fraction: float = 0.0  # share of decode tokens from speculative steps
    differing: int = 0  # sequences whose tokens differ from the off run's, summed over repetitions
    timeline: list[list[Any]] = field(default_factory=list)  # the first repetition's batch segments

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds_median": statistics.median(self.seconds),
            "seconds_min": min(self.seconds),
            "seconds_max": max(self.seconds),
            "tokens": self.tokens,
            "accept_len": self.accept_len,
            "sd_fraction": self.sd_fraction,
            "differing_sequences": self.differing,
        }


def _spec_config(mode: str, drafter: str | None) -> SpeculationConfig:
    if mode == "off":
        return SpeculationConfig(spec="off")
    if mode == "ngram":
        return SpeculationConfig(spec="on")
    if mode == "drafter":
        return SpeculationConfig(spec="on", drafter=drafter)
    return SpeculationConfig(spec="auto", drafter=drafter)


def run(cfg: BenchRolloutConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every mode `reps` times; the JSON object described in the CLI help."""
    # off first: each repetition's other modes are compared with its tokens.
    modes = ["off"] + [m for m in cfg.modes if m != "off" and (m != "drafter" or cfg.drafter)]
    if "drafter" in cfg.modes and not cfg.drafter:
        log("drafter mode skipped: no --drafter given")
    path = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype=cfg.dtype)
    engine = Engine(model, EngineConfig(max_batch=cfg.num_prompts * cfg.group_size, exact=cfg.exact))
    tc = TrainConfig(task=cfg.task, num_prompts=cfg.num_prompts, group_size=cfg.group_size,
                     max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    _, requests = rollout_requests(make_task(cfg.task), tokenizer, tc, 1, 0, model.cfg.max_position_embeddings)
    params = SamplingParams(cfg.temperature)
    engine.generate(requests[:2], params, 2)  # allocate the cache, warm the kernels: untimed
    tuner_state = None
    if "auto" in modes and not cfg.cold_tuner:
        _, other = rollout_requests(make_task(cfg.task), tokenizer, tc, 0, cfg.num_prompts, model.cfg.max_position_embeddings)
        tuner = install(engine, _spec_config("auto", cfg.drafter), TunerConfig(), seed=cfg.seed)
        engine.generate(other, params, cfg.max_new_tokens)
        tuner_state = tuner.state_dict()
        log(f"tuner warmed on another batch of {len(other)} requests in {engine.stats.seconds:.1f} s")
    results = {m: ModeResult() for m in modes}
    ideal: list[float] = []
    for rep in range(cfg.reps):
        reference = None
        for mode in modes:
            install(engine, _spec_config(mode, cfg.drafter), TunerConfig(), seed=cfg.seed, tuner_state=tuner_state)
            out = engine.generate(requests, params, cfg.max_new_tokens)
            tokens = [c.token_ids for c in out]
            st, r = engine.stats, results[mode]
            r.seconds.append(st.seconds)
            if mode == "off":
                reference = tokens
                ideal.append(ideal_seconds(st))
            r.differing += sum(a != b for a, b in zip(tokens, reference))
            if rep == 0:
                decoding = rollout_report(st, TunerConfig().bucket_edges)
                r.tokens, r.accept_len = st.tokens, st.spec.accept_len
                r.timeline, r.sd_fraction = decoding["batch_timeline"], decoding["sd_fraction"]
            log(f"rep {rep + 1}/{cfg.reps} {mode:>7}: {st.seconds:7.1f} s, {st.tokens} tokens, "
                f"{st.tokens_per_s:6.1f} tok/s, accept_len {st.spec.accept_len:4.2f}"
                + (f", {r.differing} sequences differ from off" if r.differing else ""))
    base = statistics.median(results["off"].seconds)
    report = {
        "modes": {m: r.to_json() for m, r in results.items()},
        "speedup": {m: base / statistics.median(r.seconds) for m, r in results.items()},
        "ideal_seconds": statistics.median(ideal),
        "requests": len(requests),
        "max_new_tokens": cfg.max_new_tokens,
    }
    log_summary(report, log)
    if cfg.plot:
        plot(results, report, Path(cfg.plot))
        log(f"plot: {cfg.plot}")
    return report


def log_summary(report: dict[str, Any], log: Callable[[str], None]) -> None:
    log(f"ideal (all tokens at full-batch throughput): {report['ideal_seconds']:.1f} s")
    for m, j in report["modes"].items():
        log(f"{m:>7}: median {j['seconds_median']:7.1f} s [{j['seconds_min']:.1f}-{j['seconds_max']:.1f}], "
            f"speedup vs off {report['speedup'][m]:4.2f}x, {j['tokens'] / j['seconds_median']:6.1f} tok/s, "
            f"accept_len {j['accept_len']:4.2f}, SD share {j['sd_fraction']:4.2f}")


def ideal_seconds(stats) -> float:
    """Prefill plus every decode token at the throughput of the full-batch decode steps."""
    full = max(r.batch for r in stats.timeline)
    at_full = [r for r in stats.timeline if r.batch == full]
    rate = sum(r.tokens for r in at_full) / sum(r.seconds for r in at_full)
    return stats.prefill_seconds + sum(r.tokens for r in stats.timeline) / rate


def plot(results: dict[str, ModeResult], report: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.12, top=0.9, wspace=0.25)
    FigureCanvasAgg(fig)
    batch, times = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, (mode, r) in enumerate(results.items()):
        xs = [x for seg in r.timeline for x in seg[:2]]
        ys = [seg[2] for seg in r.timeline for _ in range(2)]
        batch.plot(xs, ys, color=f"C{i}", label=mode)
    log_counts(batch)
    batch.set(xlabel="seconds into the rollout", ylabel="running sequences", title="Running batch over time (first repetition)")
    batch.grid(alpha=0.3)
    batch.legend(fontsize=8)
    names = list(results)
    med = [report["modes"][m]["seconds_median"] for m in names]
    lo = [med[i] - report["modes"][m]["seconds_min"] for i, m in enumerate(names)]
    hi = [report["modes"][m]["seconds_max"] - med[i] for i, m in enumerate(names)]
    times.bar(names, med, yerr=[lo, hi], color=[f"C{i}" for i in range(len(names))], capsize=4)
    times.axhline(report["ideal_seconds"], color="k", ls="--", lw=1, label="ideal (no long tail)")
    for i, m in enumerate(names):
        times.text(i, med[i], f"{report['speedup'][m]:.2f}x", ha="center", va="bottom", fontsize=9)
    times.set(ylabel="seconds (median, min-max)", title=f"Rollout time, {report['requests']} requests")
    times.legend(fontsize=8)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
