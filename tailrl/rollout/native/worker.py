"""One rollout worker: its own engine on its own handle to the rollout model, a shard of the
requests, and spot training of the drafter when its shard is done.

The same class runs in the trainer's process (one worker), in a spawned process, or in a Ray
actor; the runtime (tailrl.rollout.native.runtimes, tailrl.rollout.native.ray_runtime) only moves calls and
replies. A call is a typed message (`WorkerCall`: a RolloutJob, a SpotJob or a SetDrafter) that
`handle` answers. Two hooks connect it to the runtime: `beat(payload)` (progress, also the
liveness signal a hang is detected by) and `preempted()` (the newest spot job id the trainer
asked to stop).

Replies are small: completions without hidden states; the drafter's training data (TrainSeq)
only when spot training wants it.

Knows: the engine, spec modes, the drafter's file and state dict, spot jobs. Does not know: the
RL loop, rewards, how calls travel.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from tailrl.engine import Engine, EngineConfig
from tailrl.linears import release_packed
from tailrl.model import Transformer
from tailrl.records import Completion, Progress, Request, Stop
from tailrl.rollout.native.buffer import train_seq
from tailrl.rollout.native.spot import DrafterState, SpotJob, SpotResult, run_spot
from tailrl.rollout.protocol import DrafterVersionError
from tailrl.sampling import SamplingParams
from tailrl.speculative.decoder import SpecDecoder, StepReport
from tailrl.speculative.drafter.model import Drafter
from tailrl.speculative.drafter.training import TrainSeq
from tailrl.speculative.modes import SpeculationConfig, install
from tailrl.speculative.watch import Tallies, Tally
from tailrl.stats import EngineStats
from tailrl.tuner import TunerConfig


@dataclass(frozen=True)
class WorkerSetup:
    """What every worker is built from (besides its model)."""

    engine: EngineConfig
    speculation: SpeculationConfig
    tuner: TunerConfig
    seed: int
    collect: bool  # keep hidden states and return TrainSeqs for the drafter's buffer
    threads: int | None = None  # torch threads in this worker (None: leave as is)


@dataclass
class RolloutJob:
    requests: list[Request]
    params: SamplingParams
    max_new_tokens: int
    # Tuner rewards the other workers observed since this worker's last rollout (Tuner.absorb).
    tuner_records: list = field(default_factory=list)
    report_finished: bool = False  # beat a Finished per sequence as it finishes
    stop: Stop | None = None  # the caller's own ending (pickled to a worker process)


@dataclass
class ShardResult:
    completions: list[Completion]  # in the shard's request order, hidden states dropped
    stats: EngineStats
    train_seqs: list[TrainSeq] = field(default_factory=list)
    drafter_verifies: int = 0  # verifies by the learned drafter's arms
    drafter_emitted: int = 0  # tokens they emitted
    drafter_tallies: Tallies = field(default_factory=dict)  # their first-token acceptance per arm
    tuner_state: dict | None = None  # the tuner's state after this rollout (--spec auto), for checkpoints
    tuner_new: list = field(default_factory=list)  # its rewards observed in this rollout (Tuner.take_new)


@dataclass(frozen=True)
class SetDrafter:
    """Draft with this learned drafter version from the next rollout on."""

    version: int
    weights: dict[str, torch.Tensor]  # fp32 state dict


WorkerCall = RolloutJob | SpotJob | SetDrafter
WorkerReply = ShardResult | SpotResult | None


@dataclass(frozen=True)
class Finished:
    """A beat: the shard's request `index` finished (hidden states dropped)."""

    index: int
    completion: Completion


@dataclass(frozen=True)
class SpotBeat:
    """A spot trainer's liveness signal: micro-steps done in the current job."""

    micro_steps: int


Beat = Progress | Finished | SpotBeat  # what a worker sends while it works


class DrafterSteps:
    """Counts the learned drafter's verifies and the tokens they emitted in one rollout (its own
    accept_len, apart from the n-gram drafter's), and per arm how many verifies accepted the first
    draft token (what the drafter's version is watched by: tailrl.speculative.watch); a
    StepObserver of the worker's decoder."""

    def __init__(self) -> None:
        self.verifies = self.emitted = 0
        self.tallies: Tallies = {}

    def begin(self) -> None:
        self.verifies = self.emitted = 0
        self.tallies = {}

    def observe(self, report: StepReport) -> None:
        if report.arm.kind == "drafter":
            self.verifies += report.batch_size
            self.emitted += report.tokens
            self.tallies.setdefault(report.arm.label, Tally()).add(report.batch_size, report.first_accepted)


class RolloutWorker:
    def __init__(self, rank: int, model: Transformer, setup: WorkerSetup, tuner_state: dict | None = None):
        if setup.threads is not None:
            torch.set_num_threads(setup.threads)
        self.rank, self.model, self.setup = rank, model, setup
        cfg = dataclasses.replace(setup.engine, capture_hidden=setup.engine.capture_hidden or setup.collect)
        self.engine = Engine(model, cfg)
        self.drafter_steps = DrafterSteps()
        self.tuner = install(self.engine, setup.speculation, setup.tuner, seed=setup.seed + rank,
                             tuner_state=tuner_state, observers=(self.drafter_steps,))
        self.beat: Callable[[Beat], None] = lambda payload: None
        self.preempted: Callable[[], int] = lambda: 0
        self.drafter_version = 0
        self._trainer: Drafter | None = None  # the drafter copy spot jobs train (fp32)
        self._spot_state: DrafterState | None = None  # what that copy ended its last job with
        self._spot_thread: ThreadPoolExecutor | None = None

    @property
    def in_use(self) -> Drafter | None:
        """The drafter the engine drafts with, if any."""
        decoder = self.engine.decoder
        proposer = decoder.proposers.get("drafter") if isinstance(decoder, SpecDecoder) else None
        return proposer.drafter if proposer is not None else None

    def handle(self, call: WorkerCall) -> WorkerReply:
        """Answer one call from the trainer."""
        if isinstance(call, RolloutJob):
            return self.rollout(call)
        if isinstance(call, SpotJob):
            return self.spot_train(call)
        if isinstance(call, SetDrafter):
            return self.set_drafter(call)
        raise TypeError(f"not a worker call: {type(call).__name__}")

    def rollout(self, job: RolloutJob) -> ShardResult:
        if self.tuner is not None:
            self.tuner.absorb(job.tuner_records)
        finished = None
        if job.report_finished:
            finished = lambda i, c: self.beat(Finished(i, dataclasses.replace(c, hidden=None, prompt_hidden=None)))  # noqa: E731
        out = self.engine.generate(job.requests, job.params, job.max_new_tokens, stop=job.stop, on_progress=self.beat,
                                   on_finished=finished)
        # The cache goes with the rollout: the update after it runs without it, and the next
        # rollout's fresh cache is resident only where its sequences write (tailrl.memory.lazy_zeros).
        # So do decoding's packed weights (a model's size): the update changes the weights before
        # the next rollout, which packs them again anyway (docs/memory.md).
        self.engine.cache = None
        for model in (self.model, self.in_use):
            if model is not None:
                release_packed(model)
        seqs = [train_seq(c) for c in out] if self.setup.collect else []
        for c in out:
            c.hidden = c.prompt_hidden = None
        tuner = self.tuner.state_dict() if self.tuner is not None else None
        new = self.tuner.take_new() if self.tuner is not None else []
        steps = self.drafter_steps
        return ShardResult(out, self.engine.stats, seqs, steps.verifies, steps.emitted, steps.tallies, tuner, new)

    def set_drafter(self, call: SetDrafter) -> None:
        drafter = self.in_use
        if drafter is None:
            raise ValueError("this worker drafts with no learned drafter (--spec on/auto with --drafter)")
        try:
            drafter.load_state_dict(call.weights)  # casts to the drafter's dtype
        except RuntimeError as e:  # missing, unexpected or misshapen tensors: torch says which, over lines
            raise DrafterVersionError(f"drafter version {call.version} cannot be loaded into the native engine: "
                                      f"{' '.join(str(e).split())}") from None
        self.drafter_version = call.version

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy new policy weights in (runtimes whose workers do not share the trainer's memory)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(weights[name])

    def spot_train(self, job: SpotJob) -> SpotResult:
        drafter = self.in_use
        if drafter is None:
            raise ValueError("spot training needs a learned drafter in use")
        if self._trainer is None:
            self._trainer = Drafter(drafter.cfg, self.model.model.embed_tokens.weight.detach())
        head = self.model.lm_head.weight.detach()[self._trainer.d2t].float()  # (K, E)
        if job.state is not None:
            self._spot_state = job.state
        start = self._spot_state
        if start is None:
            raise ValueError("a spot job without drafter state, and this worker holds none")
        if self._spot_thread is None:
            # OpenMP thread counts are per thread: the new one gets this thread's.
            threads = torch.get_num_threads()
            self._spot_thread = ThreadPoolExecutor(1, "spot", initializer=_spot_thread_init, initargs=(threads,))
        run = lambda: run_spot(self._trainer, job, start, head, self.preempted, lambda n: self.beat(SpotBeat(n)))  # noqa: E731
        result = self._spot_thread.submit(run).result()
        if result.micro_steps:
            # Version and step count are the trainer's to keep; only weights and optimizer matter here.
            self._spot_state = DrafterState(start.version, result.weights, result.optimizer)
        return result


def _spot_thread_init(threads: int) -> None:
    """Torch threads as the worker's, and nice 19 for the calling thread (Linux: per thread), so
    spot training only takes CPU time nobody else wants: at normal priority a trainer sharing a
    core with a tail worker slows the very tail the step waits for (docs/workers.md)."""
    torch.set_num_threads(threads)
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass  # not Linux: the thread runs at the process's priority
