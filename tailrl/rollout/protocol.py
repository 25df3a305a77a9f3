"""The seam between RL and the engines: what the RL loop may ask of a rollout, and what it gets back.

The RL loop (tailrl.rl) knows generation only through `Rollout`, one step as one sequence of
calls whatever the engine:

  generate  the step's requests (on_finished per sequence, so finished GRPO groups are scored and
            their gradient computed while the tail still decodes; an `IdleCore` the caller's
            update and the rollout share: the caller lends a core through it, and it tells the
            rollout when the update is using one; the rollout's `feed`, if it has one, is handed
            what the update's forwards computed and works on the lent core while the update has
            nothing queued)
  publish   the policy's new weights after the optimizer step; whatever the rollout learned this
            step (its drafter) goes live with them
  report    what the rollout did, typed (decoding, speculation, the tail, drafter training)

plus state_dict / close. Each engine keeps its own drafter up to date behind these calls: which
drafter, what it trains on and when it publishes are the engine's business, and the loop never
names one. `RolloutConfig` opens a rollout and answers what the run's set-up asks of it.
Engines behind it: tailrl.rollout.native (tailrl's own engine, across its workers),
tailrl.rollout.vllm (vLLM engines, in the trainer's process or on Ray).

The records only the seam defines live here: PolicyForward, DrafterFeed, IdleCore, RolloutReport,
RolloutState, Rollback, HeldMemory, EngineEntry (how an engine describes itself to the registry,
tailrl.rollout.registry) and the rollout's errors. Those that the decoding engine below the seam
(tailrl.engine) uses too live lower, so that it imports nothing of the seam: a generate call's
Request, Stop, Completion and Progress (tailrl.records) and SamplingParams (tailrl.sampling). Callers
import them from there, not from here: each name has one home, and what the RL loop takes from
below the seam is plain data, never a way to generate.

Knows: what a rollout is asked and answers. Does not know: how any engine produces tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

import torch

from tailrl.model import Transformer
from tailrl.records import Completion, Progress, Request, Stop
from tailrl.sampling import SamplingParams
from tailrl.speculative.report import Decoding, chain_ceiling, rollout_report
from tailrl.stats import EngineStats


@dataclass(frozen=True)
class PolicyForward:
    """One sampled sequence as the trainer's forward computed it: its tokens (prompt, then
    response) and the policy's final-norm hidden states (the LM head's input) at every position
    but the last, the row at position q having produced token q + 1. What a drafter learns
    from, handed to the rollout instead of computed twice."""

    tokens: torch.Tensor  # (P + N,)
    hidden: torch.Tensor  # (P + N - 1, E) fp32, on the CPU
    prompt_len: int  # P


class DrafterFeed(Protocol):
    """A rollout's drafter fed on the trainer's side (tailrl.rollout.adapt): what the update's
    forwards computed, and the update's core while it has nothing queued."""

    def observe(self, forwards: Sequence[PolicyForward]) -> None:
        """What the trainer's forwards computed for this step's responses (any thread, as groups
        are computed), kept as training data."""
        ...

    def has_idle_work(self) -> bool:
        """Whether there is work for a core the caller lends (drafter training)."""
        ...

    def work_idle(self, stop: Callable[[], bool]) -> None:
        """That work, on the calling thread (one torch thread), in short units, until stop(),
        asked before each unit, is True: a caller waits at most one unit for its core back."""
        ...


@dataclass
class IdleCore:
    """The core a generate call and the caller's update share in the rollout's tail, both ways in
    one object: the caller sets `lent` while its update takes one of the rollout's cores (a rollout
    decoding on the caller's torch threads decodes on one fewer from its next progress report on;
    one decoding in other processes has none of the caller's to lend), and `busy()` tells the
    rollout whether the update is using a core now (background work of the rollout's own, spot
    training on idle workers, starts only while it is not). What the update runs on a lent core
    while it has nothing queued is the rollout's feed (Rollout.feed)."""

    busy: Callable[[], bool] = lambda: False
    lent: bool = False

    def apply(self, own: int) -> None:
        """For a rollout decoding on `own` of the caller's torch threads: it decodes on one fewer
        while lent, on all of them otherwise."""
        threads = own - 1 if self.lent and own > 1 else own
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


class WorkerError(RuntimeError):
    """A rollout worker died, hung or raised; `rank` says which. The step that raised it applied
    nothing, so a run can be resumed from its last checkpoint."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"worker {rank} {reason}")
        self.rank, self.reason = rank, reason


class DrafterVersionError(RuntimeError):
    """A drafter version the rollout made cannot be loaded into its engine (its weights do not
    fit the drafter's shapes): a bug, not a slow drafter; the run stops at its last checkpoint."""


@dataclass(frozen=True)
class Rollback:
    """A drafter version taken out of use and the version drafting again instead: `reason` is
    "acceptance" (it collapsed: its first-token acceptance `rate` over `verifies` verifies against
    the good version's `reference_rate` on the same draft shapes, tailrl.speculative.watch) or
    "non-finite" (its weights hold NaN or inf: it never drafted)."""

    version: int
    to: int
    reason: str
    verifies: int = 0
    rate: float | None = None
    reference_rate: float | None = None


@dataclass(frozen=True)
class RolloutReport(Decoding):
    """What one step's rollout did (the last generate and publish), as fields of a step's metrics.

    Decoding: throughput, prefill, decode steps; the speculative share and acceptance
    (accept_len: tokens per verify, the bonus included); the tail (decode time with few
    sequences running) as a share of the rollout; per running-batch-size bucket and arm, what
    decoded and how fast; the headroom (accept_len_ceiling: the accept_len the target itself
    would reach as a chain drafter of the configured depth on these responses). Drafter: the
    version drafted with and its own accept_len; its training this step (on idle workers or the
    update's idle core, and on the step's own time after the update: drafter_after_s, what
    adapting the drafter cost the step), the version published for the next rollout, and a
    rollback of a version that collapsed.
    """

    rollout_tok_s: float
    prefill_s: float
    decode_steps: int
    spec_verify_steps: int
    spec_accept_len: float
    spec_proposed: int  # draft tokens proposed
    spec_accepted: int  # draft tokens accepted
    accept_len_ceiling: float | None
    # The same headroom at the depths speculation drafted: each verify's ceiling is the target's
    # own chain of that verify's draft depth, averaged over the verifies (spec_accept_len's peer).
    spec_accept_ceiling: float | None
    spec_draft_depth: float  # the verifies' mean draft depth (0: none)
    drafter_version: int
    drafter_accept_len: float | None
    drafter_published: int = 0
    drafter_micro_steps: int = 0
    drafter_loss: float | None = None
    drafter_after_s: float = 0.0
    idle_seconds_harvested: float = 0.0
    idle_seconds_left: float | None = None  # None where the engine cannot tell
    preempt_latency_s: float = 0.0
    buffer_tokens: int = 0
    drafter_rollback: Rollback | None = None  # at this step's publish
    engine_restarts: int = 0  # engines that died or hung in this step (rollout or publish), restarted (vLLM on Ray)

    def metrics(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def decoding_report(stats: EngineStats, completions: Sequence[Completion], ceiling_depth: int,
                    bucket_edges: Sequence[int], drafter_version: int, drafter_accept_len: float | None
                    ) -> RolloutReport:
    """One generate call's report as every engine counts it: its decoding from `stats`
    (tailrl.speculative.report), the headroom from the completions' top-1 flags, the drafter
    version it drafted with and that drafter's accept_len. The fields of what the rollout
    trained and published are left at their defaults for the engine to fill in."""
    decoding = rollout_report(stats, bucket_edges)
    top1, depths = [c.top1 for c in completions], stats.spec.depth_verifies
    return RolloutReport(
        # The decoding fields are RolloutReport's own by inheritance: the same names, typed once.
        **{f.name: getattr(decoding, f.name) for f in dataclasses.fields(Decoding)},
        rollout_tok_s=stats.tokens_per_s, prefill_s=stats.prefill_seconds, decode_steps=stats.steps,
        spec_verify_steps=stats.spec.verify_steps, spec_accept_len=stats.spec.accept_len,
        spec_proposed=stats.spec.proposed, spec_accepted=stats.spec.accepted,
        accept_len_ceiling=chain_ceiling(top1, ceiling_depth),
        spec_accept_ceiling=_mean_over(depths, lambda d: chain_ceiling(top1, d)),
        spec_draft_depth=_mean_over(depths, float) or 0.0,
        drafter_version=drafter_version, drafter_accept_len=drafter_accept_len,
    )


def _mean_over(counts: Sequence[int], value: Callable[[int], float | None]) -> float | None:
    """The mean of value(d) weighted by counts[d]; None without counts or where a value is None."""
    pairs = [(n, value(d)) for d, n in enumerate(counts) if n]
    if not pairs or any(v is None for _, v in pairs):
        return None
    return sum(n * v for n, v in pairs) / sum(n for n, _ in pairs)


@dataclass
class RolloutState:
    """What a checkpoint holds of a rollout, for a resumed run to roll out as the uninterrupted
    one would: each engine's subclass has its fields (tuners, drafter, its data). An engine
    opened with another engine's state refuses it (`check_state`)."""


def check_state(state: RolloutState | None, own: type[RolloutState]) -> None:
    """ValueError unless `state` is None or `own`'s."""
    if state is not None and not isinstance(state, own):
        raise ValueError(f"this checkpoint holds another engine's rollout state ({type(state).__name__}); resume it "
                         f"with that engine")


class Rollout(Protocol):
    """An engine generating a step's responses for the RL loop (see the module doc)."""

    def generate(self, step: int, requests: Sequence[Request], params: SamplingParams, max_new_tokens: int,
                 on_progress: Callable[[Progress], None] | None = None,
                 on_finished: Callable[[int, Completion], None] | None = None,
                 core: IdleCore | None = None, stop: Stop | None = None) -> list[Completion]:
        """The completions of `requests`, in request order, sampled from the last published
        policy. on_progress as the rollout advances; on_finished(request index, completion) once
        per request as it finishes, in the thread that called generate. Idle time inside the
        rollout goes to the policy's update first (`core`, IdleCore: a core the caller lends is
        left to it until it takes it back or generate returns; the rollout's own background work
        runs only while core.busy() is False). `stop` ends a sequence where it says
        (finish_reason "stop"), besides EOS and the length limit. Raises WorkerError when a
        worker fails (naming `step`)."""
        ...

    def feed(self) -> DrafterFeed | None:
        """What the rollout's drafter learns from on the trainer's side (the update's forwards,
        its idle core); None: nothing (the update then computes no hidden states for it)."""
        ...

    def publish(self, policy: Transformer) -> None:
        """After the optimizer step: the next generate samples from `policy`'s current weights
        (cast to the rollout's dtype), and drafts with what the rollout learned this step."""
        ...

    def report(self) -> RolloutReport:
        """What the last generate and publish did."""
        ...

    def state_dict(self) -> RolloutState:
        """What a checkpoint must hold for a resumed run to roll out as the uninterrupted one, as
        of the last publish."""
        ...

    def close(self) -> None:
        ...


class HeldMemory(NamedTuple):
    """Memory a rollout will hold, and the settings that change it (as a user types them)."""

    gb: float
    settings: str


class RolloutConfig(Protocol):
    """How to open a Rollout (the engine's own configuration sections, flags and TOML tables),
    and what a run's set-up asks of it before it opens."""

    def open(self, model: Transformer, seed: int, state: RolloutState | None = None) -> Rollout:
        """A rollout decoding with `model`'s architecture and dtype, starting from its weights,
        its sampling and tuning seeded by `seed`, resuming `state` (a Rollout.state_dict())."""
        ...

    def for_evaluation(self, default: EngineEntry) -> RolloutConfig:
        """An engine decoding plainly in this process, in the same dtype: held-out evaluations,
        which must not touch the training rollout's state (tuners, drafter, data). The same
        engine, unless it cannot run twice in one process (vLLM): then `default`, the registry's
        default engine, sized as this one (its `capacity`)."""
        ...

    def sections(self) -> dict[str, object]:
        """The configuration sections (dataclasses) by name, as a run directory saves them."""
        ...

    def needs_drafter(self) -> bool:
        """It speculates with a learned drafter but names none: the run's set-up warms one up."""
        ...

    def with_drafter(self, drafter: Path) -> RolloutConfig:
        """The same, drafting with the learned drafter in `drafter`."""
        ...

    def memory(self, model: Transformer, sequences: int, tokens: int) -> HeldMemory:
        """GiB the opened rollout holds beyond `model` (which its caller holds) for a step of
        `sequences` sequences of up to `tokens` tokens each: its KV caches and any copies of the
        model its engine or workers load. A floor, counted from shapes (tailrl.rl.floor)."""
        ...

    def check(self) -> None:
        """ValueError for what opening would refuse (a missing engine, an unreadable drafter),
        so bad input fails before minutes of set-up."""
        ...

    def describe(self) -> str:
        """How it decodes, in a few words, for the run's announcement."""
        ...


@dataclass(frozen=True)
class EngineEntry:
    """One rollout engine as a run chooses it: what its package's config module hands the
    registry (tailrl.rollout.registry), which finds it by `name`."""

    name: str
    # `tailrl train`'s configuration sections (flags and TOML tables) it reads, by name.
    sections: Mapping[str, type]
    # `tailrl generate`'s, by name.
    generate_sections: Mapping[str, type]
    # ValueError for what a run's sections and sampling ask that it cannot do.
    check: Callable[[Mapping[str, object], SamplingParams], None]
    # Its RolloutConfig from its own sections by name (those left out take their defaults).
    config: Callable[[Mapping[str, object]], RolloutConfig]
    # `sections` with its own set to hold `sequences` at once, with `kv_gb` GiB of KV cache (None:
    # its default): how a benchmark sizes every engine alike.
    capacity: Callable[[Mapping[str, object], int, float | None], dict[str, object]]
    # Whether it has exact mode: bit-identical tokens with speculation on and off.
    exact: bool
