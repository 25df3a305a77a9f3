"""`tailrl bench rollout`: one long-tailed GRPO rollout batch, decoded plain and speculatively.

The batch is the first RL step of the configured run (the task's problems at the start of its
stream, group_size seeded samples each, the policy before any update). It is generated in each
mode: off (plain decoding), ngram (n-gram drafter every step), drafter (the learned drafter every
step, when one is given) and auto (the tuner, TLT's switch gate in front); and on vLLM (in
process, tailrl.rollout.vllm): vllm-off, vllm-drafter (the learned drafter as vLLM's EAGLE
drafter every step) and vllm-auto (the same drafter, tailrl's tuner choosing each step's draft
length), each from an engine started for the repetition (start-up untimed, the tuner empty),
whose tokens are vLLM's samples and not compared with the native engine's. Modes run interleaved
within each repetition, so slow phases of a shared machine hit every mode alike; each mode starts
from a fresh decoder every time (an empty n-gram history: a repetition must not draft from its
own previous answers). The tuner starts from the state it reached on one untimed rollout of
another batch (the previous step's problems and seeds), as in training from the second step on,
where the tuner's state carries over; `--cold-tuner` starts it empty instead. Tokens are compared
with the off run of the same repetition.

The long-tail picture: the running batch size over time per mode, and the ideal time, i.e. the
off run's prefill plus all its decode tokens at the throughput of its full-batch steps: what the
rollout would take if no sequence were longer than the others.

Knows: how to build a step's requests (tailrl.rl.train), install a mode (tailrl.speculative.modes), open
a vLLM rollout.
Does not know: rewards, training.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model, load_tokenizer, resolve_model_dir
from tailrl.model import Transformer
from tailrl.rl.plots import log_counts
from tailrl.rl.run_dir import atomic_file
from tailrl.rl.tasks import DEFAULT_TASK, make_task
from tailrl.rl.train import TrainConfig, rollout_requests
from tailrl.rollout.protocol import Request, Rollout, RolloutState
from tailrl.rollout.vllm.checks import check_installed
from tailrl.sampling import SamplingParams
from tailrl.speculative.modes import SpeculationConfig, install
from tailrl.speculative.report import rollout_report
from tailrl.tuner import TunerConfig

MODES = ("off", "ngram", "drafter", "auto", "vllm-off", "vllm-drafter", "vllm-auto")


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
    modes: tuple[str, ...] = field(default=("off", "ngram", "drafter", "auto"), metadata={"help": "comma-separated modes to run (drafter, auto, vllm-drafter, vllm-auto only with --drafter); vllm-* decode on vLLM (tailrl[vllm])"})
    draft_depth: int = field(default=6, metadata={"help": "draft tokens per verify of the drafter modes (a chain; vLLM's num_speculative_tokens)"})
    kv_cache_gb: float = field(default=2.0, metadata={"help": "vLLM modes: KV cache, GiB"})
    exact: bool = field(default=False, metadata={"help": "bit-exact speculative decoding (slower steps, see tailrl.model)"})
    cold_tuner: bool = field(default=False, metadata={"help": "auto and vllm-auto start with an empty tuner (default: warmed on one other batch)"})
    plot: str | None = field(default="bench-rollout.png", metadata={"help": "PNG of the running batch over time and the times (empty: none)"})

    def __post_init__(self) -> None:
        self.modes = tuple(self.modes)
        unknown = set(self.modes) - set(MODES)
        if unknown or "off" not in self.modes:
            raise ValueError(f"modes must include off and be among {', '.join(MODES)}, got {', '.join(self.modes)}")
        if self.reps < 1 or self.draft_depth < 1:
            raise ValueError(f"reps and draft_depth must be >= 1, got {self.reps} and {self.draft_depth}")


@dataclass
class ModeResult:
    seconds: list[float] = field(default_factory=list)  # one per repetition
    tokens: int = 0
    accept_len: float = 0.0  # tokens per sequence-verify of speculative steps (0: none)
    sd_fraction: float = 0.0  # share of decode tokens from speculative steps
    differing: int | None = 0  # sequences whose tokens differ from the off run's, summed over repetitions (None: vLLM)
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


def _spec_config(mode: str, drafter: str | None, depth: int) -> SpeculationConfig:
    if mode == "off":
        return SpeculationConfig(spec="off")
    if mode == "ngram":
        return SpeculationConfig(spec="on")
    if mode == "drafter":
        return SpeculationConfig(spec="on", drafter=drafter, draft_depth=depth, num_draft_tokens=depth)
    return SpeculationConfig(spec="auto", drafter=drafter)


def _vllm_rollout(cfg: BenchRolloutConfig, mode: str, model: Transformer, requests: list[Request],
                  state: RolloutState | None = None) -> Rollout:
    """A vLLM engine for `mode` (tailrl.rollout.vllm), its kernels warmed on two requests, its
    tuner resuming `state`; its drafter does not adapt (a rollout, not an RL step)."""
    from tailrl.rollout.vllm.config import VllmRolloutConfig
    from tailrl.rollout.vllm.settings import VllmSettings
    from tailrl.speculative.drafter.learner import AdaptConfig

    spec = {"vllm-off": "off", "vllm-drafter": "on", "vllm-auto": "auto"}[mode]
    settings = VllmSettings(kv_cache_gb=cfg.kv_cache_gb, max_num_seqs=len(requests))
    speculation = SpeculationConfig(spec=spec, drafter=cfg.drafter, draft_depth=cfg.draft_depth,
                                           num_draft_tokens=cfg.draft_depth)
    rollout = VllmRolloutConfig(settings, speculation, adapt=AdaptConfig(adapt_drafter=False)).open(
        model, seed=cfg.seed, state=state)
    rollout.generate(0, requests[:2], SamplingParams(cfg.temperature), 2)
    return rollout


def _warm_vllm_tuner(cfg: BenchRolloutConfig, model: Transformer, other: list[Request]) -> RolloutState:
    """vllm-auto's rollout state (its tuner) after one untimed rollout of another batch."""
    rollout = _vllm_rollout(cfg, "vllm-auto", model, other)
    try:
        rollout.generate(0, other, SamplingParams(cfg.temperature), cfg.max_new_tokens)
        return rollout.state_dict()
    finally:
        rollout.close()


def _vllm_repetition(cfg: BenchRolloutConfig, mode: str, model: Transformer, requests: list[Request],
                     state: RolloutState | None, r: ModeResult, first: bool) -> tuple[float, int, float]:
    """One timed rollout of `mode` on a fresh engine, into `r` (the first repetition's report
    too); its seconds, tokens and accept_len. vLLM samples its own tokens (the same distribution
    as the native engine's, other responses), so they are not compared (differing is None)."""
    rollout = _vllm_rollout(cfg, mode, model, requests, state)
    try:
        t0 = time.perf_counter()
        out = rollout.generate(1, requests, SamplingParams(cfg.temperature), cfg.max_new_tokens)
        seconds, report = time.perf_counter() - t0, rollout.report()
    finally:
        rollout.close()
    tokens = sum(len(c.token_ids) for c in out)
    r.seconds.append(seconds)
    r.differing = None
    if first:
        r.tokens, r.accept_len, r.sd_fraction = tokens, report.spec_accept_len, report.sd_fraction
        r.timeline = report.batch_timeline
    return seconds, tokens, report.spec_accept_len


def run(cfg: BenchRolloutConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every mode `reps` times; the JSON object described in the CLI help."""
    # off first: each repetition's other modes are compared with its tokens.
    modes = ["off"] + [m for m in cfg.modes if m != "off" and (m in ("ngram", "auto", "vllm-off") or cfg.drafter)]
    for m in set(cfg.modes) - set(modes):
        log(f"{m} mode skipped: no --drafter given")
    if any(m.startswith("vllm") for m in modes):
        check_installed()
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
        tuner = install(engine, _spec_config("auto", cfg.drafter, cfg.draft_depth), TunerConfig(), seed=cfg.seed)
        engine.generate(other, params, cfg.max_new_tokens)
        tuner_state = tuner.state_dict()
        log(f"tuner warmed on another batch of {len(other)} requests in {engine.stats.seconds:.1f} s")
    vllm_state = None
    if "vllm-auto" in modes and not cfg.cold_tuner:
        _, other = rollout_requests(make_task(cfg.task), tokenizer, tc, 0, cfg.num_prompts, model.cfg.max_position_embeddings)
        vllm_state = _warm_vllm_tuner(cfg, model, other)
        log(f"vLLM's tuner warmed on another batch of {len(other)} requests")
    results = {m: ModeResult() for m in modes}
    ideal: list[float] = []
    for rep in range(cfg.reps):
        reference = None
        for mode in modes:
            r = results[mode]
            if mode.startswith("vllm"):
                state = vllm_state if mode == "vllm-auto" else None
                seconds, tokens, accept_len = _vllm_repetition(cfg, mode, model, requests, state, r, first=rep == 0)
                log(f"rep {rep + 1}/{cfg.reps} {mode:>12}: {seconds:7.1f} s, {tokens} tokens, "
                    f"{tokens / seconds:6.1f} tok/s, accept_len {accept_len:4.2f}")
                continue
            install(engine, _spec_config(mode, cfg.drafter, cfg.draft_depth), TunerConfig(), seed=cfg.seed,
                    tuner_state=tuner_state)
            out = engine.generate(requests, params, cfg.max_new_tokens)
            tokens = [c.token_ids for c in out]
            st = engine.stats
            r.seconds.append(st.seconds)
            if mode == "off":
                reference = tokens
                ideal.append(ideal_seconds(st))
            r.differing += sum(a != b for a, b in zip(tokens, reference))
            if rep == 0:
                decoding = rollout_report(st, TunerConfig().bucket_edges)
                r.tokens, r.accept_len = st.tokens, st.spec.accept_len
                r.timeline, r.sd_fraction = decoding["batch_timeline"], decoding["sd_fraction"]
            log(f"rep {rep + 1}/{cfg.reps} {mode:>12}: {st.seconds:7.1f} s, {st.tokens} tokens, "
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
        log(f"{m:>12}: median {j['seconds_median']:7.1f} s [{j['seconds_min']:.1f}-{j['seconds_max']:.1f}], "
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
