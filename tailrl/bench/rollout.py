"""`tailrl bench rollout`: long-tailed GRPO rollout batches, decoded plain and speculatively.

The batches are the first `batches` RL steps of the configured run (the task's problems in the
order of its stream, group_size seeded samples each, the policy before any update); a mode's
time is the sum over them. They are generated in each mode: off (plain decoding), ngram (n-gram
drafter every step), drafter (the learned drafter every step, when one is given) and auto (the
tuner, TLT's switch gate in front) on the native engine; and on every other engine of the
registry: ENGINE-off, ENGINE-drafter (the learned drafter as that engine drafts with it, every
step) and ENGINE-auto (the same drafter, tailrl's tuner choosing each step's draft length),
whose tokens are that engine's samples and not compared with the native engine's. Every mode
decodes the same way: through the Rollout seam, on a rollout opened through the registry
(tailrl.rollout.registry) for the repetition (start-up and a two-request warm-up untimed), each
batch timed around all of Rollout.generate (its cache planning included). Modes run interleaved
within each repetition, so slow phases of a shared machine hit every mode alike; each mode starts
each repetition from a fresh decoder (an empty n-gram history: a repetition must not draft from
its own previous answers). The tuner starts from the state it reached on one untimed rollout of
another batch (the step before the first one's problems and seeds), as in training from the
second step on, and carries its state from batch to batch; `--cold-tuner` starts it empty
instead. Tokens are compared with the off run of the same repetition. Each mode's resident
peak (the process's, from the start of its repetition: the model, the caches, the transients) is
reported beside its time.

The long-tail picture: the running batch size over time per mode (the first batch), and the
ideal time, i.e. the off run's prefill plus all its decode tokens at the throughput of its
steps in the full batch's running-batch bucket: what the rollouts would take if no sequence were
longer than the others.

The oracle: every decode step falls in a running-batch-size bucket (the tuner's), and every
mode measures, per bucket and arm, how many tokens per second it decoded there. Decoding the
off run's tokens of each bucket at the best rate any arm reached in that bucket, after the off
run's prefill, takes the oracle time: the best schedule of the measured arms on this batch. It
is reported per engine (each engine's arms after its own off run's prefill) and over all,
beside each mode. The tuner's efficiency is the oracle time of auto's own work
(its own tokens per bucket, which outside exact mode are not off's) over auto's time.

Knows: how to build a step's requests (tailrl.rl.train), each mode's sections, open any engine's
rollout (tailrl.rollout.registry) and read its report.
Does not know: rewards, training.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tailrl.engine import EngineConfig
from tailrl.loading import DEVICES, load_model, load_tokenizer, resolve_device, resolve_model_dir
from tailrl.memory import Peak
from tailrl.model import Transformer
from tailrl.records import Request
from tailrl.rl.plots import log_counts
from tailrl.rl.run_dir import atomic_file
from tailrl.rl.tasks import DEFAULT_TASK, make_task
from tailrl.rl.train import TrainConfig, rollout_requests
from tailrl.rollout import registry
from tailrl.rollout.protocol import Rollout, RolloutReport, RolloutState
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.modes import SpeculationConfig
from tailrl.tuner import TunerConfig, bucket_index, bucket_label

NATIVE_MODES = ("off", "ngram", "drafter", "auto")
# Another engine's modes, "ENGINE-off" and so on: the spec each asks for.
OTHER_SPECS = {"off": "off", "drafter": "on", "auto": "auto"}


def mode_name(engine: str, mode: str) -> str:
    """The bench's name of `mode` on `engine`: "auto" on the native engine, "ENGINE-auto" elsewhere."""
    return mode if engine == registry.DEFAULT else f"{engine}-{mode}"


OTHER_MODES = {mode_name(name, mode): (name, spec) for name in registry.NAMES if name != registry.DEFAULT
               for mode, spec in OTHER_SPECS.items()}
MODES = NATIVE_MODES + tuple(OTHER_MODES)
ORACLE_STEPS = 5  # decode steps an arm needs in a bucket for the oracle to count its rate there


@dataclass
class BenchRolloutConfig:
    model: str | None = field(default=None, metadata={
        "help": "target model directory (default: SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={"help": "rollout dtype", "choices": ["auto", "bf16", "fp32"]})
    device: str = field(default="auto", metadata={
        "help": "the native engine's device: auto = cuda when present, else cpu", "choices": DEVICES})
    drafter: str | None = field(default=None, metadata={
        "help": "learned drafter directory (adds the drafter mode; auto uses it too)"})
    task: str = field(default=DEFAULT_TASK, metadata={"help": "reasoning-gym name or .jsonl file"})
    num_prompts: int = field(default=16, metadata={"help": "prompts in the batch (the default run's step)"})
    group_size: int = field(default=4, metadata={"help": "samples per prompt"})
    max_new_tokens: int = field(default=512, metadata={"help": "longest response"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    seed: int = field(default=0, metadata={"help": "run seed (problems and sampling)"})
    batches: int = field(default=1, metadata={"help": "rollout batches: steps 1..N of the run's problem stream"})
    reps: int = field(default=3, metadata={"help": "repetitions of every mode"})
    modes: tuple[str, ...] = field(default=("off", "ngram", "drafter", "auto"), metadata={
        "help": "comma-separated modes to run: off, ngram, drafter, auto on the native engine; ENGINE-off, "
                "ENGINE-drafter, ENGINE-auto on another (vllm-off, ...: tailrl[vllm]); the drafter modes and the "
                "other engines' auto only with --drafter"})
    draft_depth: int = field(default=6, metadata={
        "help": "draft tokens per verify of the drafter modes (a chain; vLLM's "
                "num_speculative_tokens)"})
    kv_cache_gb: float = field(default=2.0, metadata={"help": "the other engines' modes (vllm-*): KV cache, GiB"})
    exact: bool = field(default=False, metadata={
        "help": "bit-exact speculative decoding (slower steps, see tailrl.model)"})
    cold_tuner: bool = field(default=False, metadata={
        "help": "the auto modes start with an empty tuner (default: warmed on one other batch)"})
    plot: str | None = field(default=None, metadata={
        "help": "PNG of the running batch over time and the times (default: "
                "runs/bench-rollout-<time>/rollout.png; empty: none)"})

    def __post_init__(self) -> None:
        self.modes = tuple(self.modes)
        unknown = set(self.modes) - set(MODES)
        if unknown or "off" not in self.modes:
            raise ValueError(f"modes must include off and be among {', '.join(MODES)}, got {', '.join(self.modes)}")
        if self.reps < 1 or self.draft_depth < 1 or self.batches < 1:
            raise ValueError(f"reps, batches and draft_depth must be >= 1, got {self.reps}, {self.batches} and "
                             f"{self.draft_depth}")


@dataclass
class ModeResult:
    seconds: list[float] = field(default_factory=list)  # one per repetition, summed over the batches
    prefill: list[float] = field(default_factory=list)  # its prefill share, the same way
    tokens: int = 0
    emitted: int = 0  # tokens emitted by speculative steps, first repetition
    verifies: int = 0  # sequence-verifies, first repetition
    ceiling_sum: float = 0.0  # spec_accept_ceiling x verifies, first repetition (engines that report it)
    ceiling_verifies: int = 0
    depth_sum: float = 0.0  # spec_draft_depth x verifies, first repetition
    spec_tokens: int = 0  # decode-step tokens from speculative steps, first repetition
    decode_tokens: int = 0
    # Sequences whose tokens differ from the off run's, summed over repetitions (None: another engine).
    differing: int | None = 0
    timeline: list[list[Any]] = field(default_factory=list)  # the first repetition's first batch's segments
    # bucket -> arm -> [tokens, seconds, steps], all reps
    cells: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    peaks: list[float] = field(default_factory=list)  # resident peak of each repetition, GiB (where the kernel tells)
    # Verifies and their tokens by response position (tailrl.stats.POSITION_EDGES), first
    # repetition; where the engine counts them (the native engine).
    position_verifies: dict[str, int] = field(default_factory=dict)
    position_emitted: dict[str, int] = field(default_factory=dict)

    def add(self, report: RolloutReport, tokens: int, first: bool) -> None:
        """One batch's rollout (its report): its cells always, its counts in the first repetition."""
        decode = 0.0
        for bucket, arms in report.by_bucket.items():
            for arm, c in arms.items():
                cell = self.cells.setdefault(bucket, {}).setdefault(arm, [0.0, 0.0, 0])
                cell[0] += c["tokens"]
                cell[1] += c["seconds"]
                cell[2] += c["steps"]
                decode += c["tokens"]
        if first:
            self.timeline = self.timeline or report.batch_timeline
            self.tokens += tokens
            self.emitted += round(report.spec_accept_len * report.spec_verify_steps)
            self.verifies += report.spec_verify_steps
            self.depth_sum += report.spec_draft_depth * report.spec_verify_steps
            if report.spec_accept_ceiling is not None:
                self.ceiling_sum += report.spec_accept_ceiling * report.spec_verify_steps
                self.ceiling_verifies += report.spec_verify_steps
            self.decode_tokens += int(decode)
            self.spec_tokens += round(report.sd_fraction * decode)
            for position, v in report.verifies_by_position.items():
                self.position_verifies[position] = self.position_verifies.get(position, 0) + v
                self.position_emitted[position] = (self.position_emitted.get(position, 0)
                                                   + round(report.accept_len_by_position[position] * v))

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds_median": statistics.median(self.seconds),
            "seconds_min": min(self.seconds),
            "seconds_max": max(self.seconds),
            "prefill_median": statistics.median(self.prefill),
            "tokens": self.tokens,
            "accept_len": self.emitted / self.verifies if self.verifies else 0.0,
            # The target's own chain at the depths drafted, on the same responses (RolloutReport).
            "accept_ceiling": self.ceiling_sum / self.ceiling_verifies if self.ceiling_verifies else None,
            "draft_depth": self.depth_sum / self.verifies if self.verifies else 0.0,
            "sd_fraction": self.spec_tokens / self.decode_tokens if self.decode_tokens else 0.0,
            "differing_sequences": self.differing,
            "peak_rss_gb": max(self.peaks) if self.peaks else None,
            "accept_len_by_position": {p: self.position_emitted[p] / v for p, v in
                                       sorted(self.position_verifies.items(), key=lambda pv: _position_start(pv[0]))},
        }


def _position_start(label: str) -> int:
    """Where a response-position bucket starts ("512-1024": 512, "2048+": 2048)."""
    return int(label.split("-")[0].rstrip("+"))


def _spec_config(mode: str, drafter: str | None, depth: int) -> SpeculationConfig:
    if mode == "off":
        return SpeculationConfig(spec="off")
    if mode == "ngram":
        return SpeculationConfig(spec="on")
    if mode == "drafter":
        return SpeculationConfig(spec="on", drafter=drafter, draft_depth=depth, num_draft_tokens=depth)
    return SpeculationConfig(spec="auto", drafter=drafter)


def engine_of(mode: str) -> str:
    """The registry name of the engine `mode` decodes on."""
    return OTHER_MODES[mode][0] if mode in OTHER_MODES else registry.DEFAULT


def _open(cfg: BenchRolloutConfig, mode: str, model: Transformer, requests: list[Request],
          state: RolloutState | None = None) -> Rollout:
    """`mode`'s rollout, opened through the registry as a run opens one and holding the batch,
    its kernels warmed on two requests, its tuner resuming `state`; its drafter does not adapt
    (a rollout, not an RL step)."""
    name = engine_of(mode)
    if name == registry.DEFAULT:
        sections: dict[str, object] = {"speculation": _spec_config(mode, cfg.drafter, cfg.draft_depth),
                                       "engine": EngineConfig(exact=cfg.exact)}
        kv_gb = None
    else:
        sections = {"speculation": SpeculationConfig(spec=OTHER_MODES[mode][1], drafter=cfg.drafter,
                                                     draft_depth=cfg.draft_depth, num_draft_tokens=cfg.draft_depth)}
        kv_gb = cfg.kv_cache_gb
    sections = registry.engine(name).capacity({**sections, "adapt": AdaptConfig(adapt_drafter=False)}, len(requests),
                                              kv_gb)
    rollout = registry.rollout_config(name, sections, SamplingParams(cfg.temperature)).open(model, seed=cfg.seed,
                                                                                          state=state)
    rollout.generate(0, requests[:2], SamplingParams(cfg.temperature), 2)
    return rollout


def _warm_tuner(cfg: BenchRolloutConfig, mode: str, model: Transformer, other: list[Request]) -> RolloutState:
    """An auto mode's rollout state (its tuner) after one untimed rollout of another batch: where
    every repetition of the mode starts, so none pays the tuner's first exploration."""
    rollout = _open(cfg, mode, model, other)
    try:
        rollout.generate(0, other, SamplingParams(cfg.temperature), cfg.max_new_tokens)
        return rollout.state_dict()
    finally:
        rollout.close()


def _repetition(cfg: BenchRolloutConfig, mode: str, model: Transformer, batches: list[list[Request]],
                state: RolloutState | None, r: ModeResult, reference: list[list[list[int]]],
                ideal: list[float] | None, first: bool) -> tuple[float, int, float]:
    """One timed pass of `mode` over the batches on a rollout opened for it (a fresh decoder: an
    empty n-gram history; its tuner carries from batch to batch), each batch timed around all of
    Rollout.generate, into `r`; its seconds, tokens and accept_len. On the native engine the off
    mode (ideal given) records each batch's tokens as the reference and its ideal time, and the
    other modes count the sequences that differ from it; another engine samples its own tokens
    (the same distribution, other responses), so they are not compared (differing is None)."""
    rollout = _open(cfg, mode, model, batches[0], state)
    compared = engine_of(mode) == registry.DEFAULT
    seconds = prefill = 0.0
    tokens = emitted = verifies = 0
    try:
        for b, requests in enumerate(batches):
            t0 = time.perf_counter()
            out = rollout.generate(b + 1, requests, SamplingParams(cfg.temperature), cfg.max_new_tokens)
            seconds += time.perf_counter() - t0
            rep = rollout.report()
            n = sum(len(c.token_ids) for c in out)
            r.add(rep, n, first)
            tokens, prefill = tokens + n, prefill + rep.prefill_s
            emitted += round(rep.spec_accept_len * rep.spec_verify_steps)
            verifies += rep.spec_verify_steps
            got = [c.token_ids for c in out]
            if ideal is not None:
                reference.append(got)
                ideal.append(ideal_seconds(rep))
            if compared and r.differing is not None:
                r.differing += sum(x != y for x, y in zip(got, reference[b]))
    finally:
        rollout.close()
    r.seconds.append(seconds)
    r.prefill.append(prefill)
    if not compared:
        r.differing = None
    return seconds, tokens, emitted / verifies if verifies else 0.0


def run(cfg: BenchRolloutConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every mode `reps` times over the batches; the JSON object described in the CLI help."""
    # off first: each repetition's other modes are compared with its tokens.
    needs_drafter = {"drafter"} | {m for m, (_, spec) in OTHER_MODES.items() if spec != "off"}
    modes = ["off"] + [m for m in cfg.modes if m != "off" and (m not in needs_drafter or cfg.drafter)]
    for m in set(cfg.modes) - set(modes):
        log(f"{m} mode skipped: no --drafter given")
    for name in {engine_of(m) for m in modes} - {registry.DEFAULT}:  # refused before the model loads
        registry.engine(name).check({}, SamplingParams(cfg.temperature))
    path = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype=cfg.dtype, device=resolve_device(cfg.device))
    tc = TrainConfig(task=cfg.task, num_prompts=cfg.num_prompts, group_size=cfg.group_size,
                     max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    task, context = make_task(cfg.task), model.cfg.max_position_embeddings

    def batch(step: int) -> list[Request]:  # the run's step `step` (0: the one before the first)
        return rollout_requests(task, tokenizer, tc, step, max(step - 1, 0) * cfg.num_prompts, context)[1]

    batches = [batch(step) for step in range(1, cfg.batches + 1)]
    states: dict[str, RolloutState] = {}  # each auto mode's, its tuner warmed
    for mode in [m for m in modes if m in autos() and not cfg.cold_tuner]:
        t0 = time.perf_counter()
        states[mode] = _warm_tuner(cfg, mode, model, batch(0))
        log(f"{mode}'s tuner warmed on another batch of {len(batches[0])} requests in "
            f"{time.perf_counter() - t0:.1f} s")
    results = {m: ModeResult() for m in modes}
    ideal: list[float] = []
    for rep in range(cfg.reps):
        reference: list[list[list[int]]] = []
        for mode in modes:
            r, peak = results[mode], Peak().start()
            seconds, tokens, accept_len = _repetition(cfg, mode, model, batches, states.get(mode), r, reference,
                                                      ideal if mode == "off" else None, first=rep == 0)
            detail = f", {r.differing} sequences differ from off" if r.differing else ""
            if mode in OTHER_MODES:
                detail = f", accept_len {accept_len:4.2f}"
            if peak.gb is not None:
                r.peaks.append(peak.gb)
                detail += f", peak {peak.gb:.2f} GiB"
            log(f"rep {rep + 1}/{cfg.reps} {mode:>12}: {seconds:7.1f} s, {tokens} tokens, "
                f"{tokens / seconds:6.1f} tok/s{detail}")
    report = _report(cfg, results, ideal, len(batches[0]))
    log_summary(report, log)
    path = cfg.plot if cfg.plot is not None else f"runs/bench-rollout-{time.strftime('%Y%m%d-%H%M%S')}/rollout.png"
    if path:  # a run directory unless the user names a file: never the checkout
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        plot(results, report, Path(path))
        log(f"plot: {path}")
    return report


def _report(cfg: BenchRolloutConfig, results: dict[str, ModeResult], ideal: list[float],
            requests: int) -> dict[str, Any]:
    base = statistics.median(results["off"].seconds)
    return {
        "modes": {m: r.to_json() for m, r in results.items()},
        "speedup": {m: base / statistics.median(r.seconds) for m, r in results.items()},
        "ideal_seconds": sum(ideal) / cfg.reps,
        "oracle": oracle(results, cfg.reps),
        "requests": requests,
        "batches": cfg.batches,
        "max_new_tokens": cfg.max_new_tokens,
    }


def oracle(results: dict[str, ModeResult], reps: int) -> dict[str, Any]:
    """The oracle times (module doc): per engine and over all, each tuner's efficiency against
    its engine's, and per bucket every mode's rate (tokens per second) with the best arm."""
    rates: dict[str, dict[str, float]] = {}  # bucket -> "mode arm" -> tokens per second
    for mode, r in results.items():
        for bucket, arms in r.cells.items():
            for arm, (tokens, seconds, steps) in arms.items():
                # An arm's rate over a handful of steps is mostly noise, and the best of many noisy
                # rates is biased upwards: an oracle counts arms measured over ORACLE_STEPS or more.
                if seconds > 0 and steps >= ORACLE_STEPS:
                    rates.setdefault(bucket, {})[f"{mode} {arm}"] = tokens / seconds

    def oracle_seconds(mode: str, engines: set[str]) -> float | None:
        """`mode`'s own prefill and decode work, each bucket's at the best rate measured there."""
        if mode not in results:
            return None
        total = statistics.median(results[mode].prefill)
        for bucket, arms in results[mode].cells.items():
            work = sum(tokens for tokens, _, _ in arms.values()) / reps
            best = max((v for k, v in rates.get(bucket, {}).items() if engine_of(k.split(" ", 1)[0]) in engines),
                       default=None)
            total += work / best if best else 0.0
        return total

    out: dict[str, Any] = {f"{name}_seconds": oracle_seconds(mode_name(name, "off"), {name}) for name in registry.NAMES}
    out["any_seconds"] = oracle_seconds("off", set(registry.NAMES))
    out["buckets"] = {b: {"best": max(v, key=v.get), "rates": v} for b, v in rates.items()}
    # Outside exact mode a mode's samples are not off's (a verify rounds otherwise than a plain
    # step), so its rollout is other work: one long response more or less moves its time by more
    # than any choice of arms (measured: 0.81x and 0.99x off in two runs of one tuner). The tuner is
    # judged on the work it had: its own tokens, bucket by bucket, at the best measured rates.
    for name in registry.NAMES:
        auto = mode_name(name, "auto")
        if auto in results and (best := oracle_seconds(auto, {name})) is not None:
            out[f"{auto}_efficiency"] = best / statistics.median(results[auto].seconds)
    return out


def autos() -> list[str]:
    """Every engine's auto mode."""
    return [mode_name(name, "auto") for name in registry.NAMES]


def log_summary(report: dict[str, Any], log: Callable[[str], None]) -> None:
    log(f"ideal (all tokens at full-batch throughput): {report['ideal_seconds']:.1f} s")
    o = report["oracle"]
    log("oracle (each bucket at its best measured arm): " + ", ".join(
        f"{name} {o[f'{name}_seconds']:.1f} s" for name in (*registry.NAMES, "any") if o[f"{name}_seconds"] is not None)
        + "".join(f"; {m} efficiency {o[f'{m}_efficiency']:.2f}" for m in autos() if f"{m}_efficiency" in o))
    for m, j in report["modes"].items():
        positions = ", ".join(f"{pos} {a:.2f}" for pos, a in j["accept_len_by_position"].items())
        log(f"{m:>12}: median {j['seconds_median']:7.1f} s [{j['seconds_min']:.1f}-{j['seconds_max']:.1f}], "
            f"speedup vs off {report['speedup'][m]:4.2f}x, {j['tokens'] / j['seconds_median']:6.1f} tok/s, "
            f"accept_len {j['accept_len']:4.2f}"
            + (f" of {j['accept_ceiling']:4.2f} at depth {j['draft_depth']:.3g}"
               if j["accept_ceiling"] is not None else "")
            + f", SD share {j['sd_fraction']:4.2f}"
            + (f", peak {j['peak_rss_gb']:.2f} GiB" if j["peak_rss_gb"] is not None else "")
            + (f"; accept_len by response position: {positions}" if positions else ""))


def ideal_seconds(report: RolloutReport) -> float:
    """Prefill plus every decode token at the throughput of the decode steps in the full batch's
    running-batch bucket (the tuner's buckets, as the report counts them)."""
    edges, full = TunerConfig().bucket_edges, max(batch for _, _, batch, _ in report.batch_timeline)
    cells = report.by_bucket[bucket_label(edges, bucket_index(edges, full))]
    rate = sum(c["tokens"] for c in cells.values()) / sum(c["seconds"] for c in cells.values())
    decode = sum(c["tokens"] for arms in report.by_bucket.values() for c in arms.values())
    return report.prefill_s + decode / rate


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
    batch.set(xlabel="seconds into the rollout", ylabel="running sequences",
              title="Running batch over time (first repetition)")
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
