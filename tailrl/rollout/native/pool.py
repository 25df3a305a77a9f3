"""The rollout of one RL step across workers, with spot training of the drafter in the tail.

`WorkerPool` is tailrl's own engine behind the Rollout protocol (tailrl.rollout.protocol;
opened by tailrl.rollout.native.config). Its `generate`:
1. Publish the newest drafter version to every worker (if it changed).
2. Split the requests into one contiguous, equal-sized shard per worker (siblings are adjacent,
   so GRPO groups stay whole whenever the shard size allows; the sampling seeds make the tokens
   independent of the split).
3. Wait. When a worker's shard is done its completions come back and its responses' hidden
   states go into the data buffer; the first worker done while another still generates becomes
   the spot trainer (tailrl.rollout.native.spot) and trains the drafter on the buffer.
4. When the last shard is done, preempt the trainer; it stops after its current micro-step and
   returns the trained state, which becomes the next drafter version.
With one worker (the engine in the trainer's process, the default) no worker is ever idle while
another decodes, so the drafter adapts on the trainer's side instead (tailrl.rollout.adapt): on
the hidden states the engine sampled every response with (`add_own`), on the core the update
lends in the tail (`work_idle`), a new version at `publish`.
A worker that dies, raises, or sends nothing for `worker_timeout_s` ends the call with a
WorkerError naming its rank and the step; the RL loop applies nothing of that step.

Knows: shards, the buffer, drafter versions, which way the drafter adapts, spot scheduling,
timing of idle windows, the decoding report. Does not know: how workers run (runtimes), the
engine's internals, rewards or the policy update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tailrl.model import Transformer
from tailrl.records import Completion, Progress, Request, Stop
from tailrl.rollout.adapt import AdaptingRollout, AdaptiveDrafter, AdaptStep
from tailrl.rollout.native.buffer import DataBuffer
from tailrl.rollout.native.runtimes import Runtime
from tailrl.rollout.native.spot import DrafterState, SpotConfig, SpotJob, SpotResult
from tailrl.rollout.native.worker import Beat, Finished, RolloutJob, SetDrafter, ShardResult, WorkerCall, WorkerReply
from tailrl.rollout.protocol import IdleCore, RolloutState, WorkerError, check_state
from tailrl.rollout.workers import shard_indices
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.stats import EngineStats


@dataclass
class NativeRolloutState(RolloutState):
    """The native engine's checkpointed state: each worker's tuner as of its last rollout and the
    rewards it has yet to absorb, the drafter version the workers draft with (and its spot
    training's optimizer), the spot data buffer, and the trainer-side learner's state."""

    tuners: list[dict | None]
    tuner_pending: list[list]
    drafter: DrafterState | None
    buffer: dict
    adapt: dict | None = None


class WorkerPool(AdaptingRollout):
    """Rollouts across a runtime's workers; the drafter's state, buffer and versions (see module
    doc). Implements tailrl.rollout.protocol.Rollout."""

    def __init__(self, runtime: Runtime, spot: SpotConfig, adapt_cfg: AdaptConfig, drafter: DrafterState | None,
                 timeout_s: float, ceiling_depth: int, bucket_edges: Sequence[int],
                 tuners: list[dict | None] | None = None, tuner_pending: list[list] | None = None,
                 adapt: AdaptiveDrafter | None = None):
        self.runtime, self.spot, self.adapt_cfg, self.timeout_s = runtime, spot, adapt_cfg, timeout_s
        self.adapt = adapt  # the drafter adapting on the trainer's side (one in-process worker)
        self.ceiling_depth, self.bucket_edges = ceiling_depth, tuple(bucket_edges)
        # Each worker's tuner state as of its last finished rollout: what a checkpoint saves, so
        # saving never waits for (or interrupts) a rollout in flight.
        self.tuners: list[dict | None] = tuners or [None] * runtime.size
        # Per worker, the rewards the other workers' tuners observed since its last rollout: the
        # tuners learn together, so each arm is explored once for all workers (Tuner.absorb).
        self.tuner_pending: list[list] = tuner_pending or [[] for _ in range(runtime.size)]
        runtime.on_beat = self._on_beat
        # Spot training needs a learned drafter and a second worker to be idle while one generates.
        self.spot_on = drafter is not None and adapt_cfg.adapt_drafter and runtime.size >= 2
        self.drafter = drafter
        self.buffer = DataBuffer(spot.buffer_tokens, spot.keep_long)
        self.published = 0  # drafter version the workers draft with (0: the --drafter files)
        self._holders: set[int] = set()  # workers whose spot state is self.drafter (jobs to them carry none)
        self.stats = EngineStats()
        self._job = 0
        self._heard: dict[int, float] = {}
        self._progress: dict[int, Progress] = {}
        self._on_progress: Callable[[Progress], None] | None = None
        self._on_finished: Callable[[int, Completion], None] | None = None
        self._shards: list[range] = []
        self._reported: set[int] = set()  # request indices passed to _on_finished this call
        self._threads = torch.get_num_threads()  # the caller's, while a generate call runs
        self._core = IdleCore()  # the core the caller's update and this call share

    # ---- calls ----------------------------------------------------------------------------

    def _on_beat(self, rank: int, payload: Beat) -> None:
        self._heard[rank] = time.monotonic()
        if isinstance(payload, Finished):
            self._report_finished(self._shards[rank][payload.index], payload.completion)
        elif isinstance(payload, Progress):
            self._progress[rank] = payload
            if self._on_progress is not None:
                ps = self._progress.values()
                self._on_progress(Progress(sum(p.done for p in ps), sum(p.total for p in ps),
                                           sum(p.running for p in ps), sum(p.tokens for p in ps),
                                           max(p.seconds for p in ps), self._fewest_unfinished()))
            if self.runtime.in_process:  # a core the caller lent, or took back, in its callback
                self._core.apply(self._threads)

    def _fewest_unfinished(self) -> int:
        """Progress.fewest_unfinished over the workers: the least of those with a request
        unfinished (0 while one of them has not reported yet)."""
        unfinished = [rank for rank, idx in enumerate(self._shards) if any(i not in self._reported for i in idx)]
        if any(rank not in self._progress for rank in unfinished):
            return 0
        return min((self._progress[rank].fewest_unfinished for rank in unfinished), default=0)

    def _report_finished(self, index: int, completion: Completion) -> None:
        """on_finished once per request: from its Finished beat, or from its shard's result when
        the runtime delivered the beat late or not at all (Ray polls beats)."""
        if self._on_finished is not None and index not in self._reported:
            self._reported.add(index)
            self._on_finished(index, completion)

    def _start(self, rank: int, call: WorkerCall) -> None:
        self._heard[rank] = time.monotonic()
        self.runtime.start(rank, call)

    def _wait(self, waiting: set[int]) -> list[tuple[int, WorkerReply]]:
        replies = self.runtime.wait(0.25)
        now = time.monotonic()
        for rank, _ in replies:
            self._heard[rank] = now
        for rank in waiting - {r for r, _ in replies}:
            if now - self._heard[rank] > self.timeout_s:
                raise WorkerError(rank, f"sent nothing for {self.timeout_s:g} s (hung)")
        return replies

    def _call_all(self, call: WorkerCall) -> list[WorkerReply]:
        """Every worker handles `call`, in parallel; the replies in rank order."""
        for rank in range(self.runtime.size):
            self._start(rank, call)
        out: dict[int, WorkerReply] = {}
        while len(out) < self.runtime.size:
            out.update(self._wait(set(range(self.runtime.size)) - set(out)))
        return [out[r] for r in range(self.runtime.size)]

    # ---- a step's rollout -----------------------------------------------------------------

    def generate(self, step: int, requests: Sequence[Request], params: SamplingParams, max_new_tokens: int,
                 on_progress: Callable[[Progress], None] | None = None,
                 on_finished: Callable[[int, Completion], None] | None = None,
                 core: IdleCore | None = None, stop: Stop | None = None) -> list[Completion]:
        """The completions of `requests`, in order. on_progress(Progress) as the workers report
        it; on_finished(request index, completion) as each sequence finishes (in the trainer's
        thread that called generate). Idle time goes to the policy's update first: an in-process
        engine decodes on one torch thread fewer while `core` is lent (worker processes have
        cores of their own to keep), and spot training starts on an idle worker only while
        core.busy() is False. `stop` ends sequences on every worker."""
        self._on_finished = on_finished
        self._threads = torch.get_num_threads()
        self._core = core or IdleCore()
        try:
            return self._generate(requests, params, max_new_tokens, on_progress, stop)
        except WorkerError as e:
            raise WorkerError(e.rank, f"{e.reason} in step {step}") from None
        finally:
            self._on_finished = None
            torch.set_num_threads(self._threads)  # a core lent in the tail comes back

    def _generate(self, requests, params, max_new_tokens, on_progress, stop) -> list[Completion]:
        if self.drafter is not None and self.drafter.version != self.published:
            self._call_all(SetDrafter(self.drafter.version, self.drafter.weights))
            self.published = self.drafter.version
        self._on_progress, self._progress = on_progress, {}
        t0 = time.monotonic()
        shards = self._shards = shard_indices(len(requests), self.runtime.size)
        self._reported = set()
        busy = set()
        for rank, idx in enumerate(shards):
            if idx:
                job = RolloutJob([requests[i] for i in idx], params, max_new_tokens, self.tuner_pending[rank],
                                 report_finished=self._on_finished is not None, stop=stop)
                self._start(rank, job)
                self.tuner_pending[rank] = []
                busy.add(rank)
        results: dict[int, ShardResult] = {}
        done_at = {rank: t0 for rank, idx in enumerate(shards) if not idx}
        trainer: int | None = None
        spot: SpotResult | None = None
        preempt_at = stopped_at = None
        idle: list[int] = []  # workers done with their shard, in the order they finished
        while busy or trainer is not None:
            for rank, reply in self._wait(busy | ({trainer} if trainer is not None else set())):
                if isinstance(reply, ShardResult):
                    busy.discard(rank)
                    idle.append(rank)
                    results[rank], done_at[rank] = reply, time.monotonic()
                    self.tuners[rank] = reply.tuner_state
                    for other in range(self.runtime.size):
                        if other != rank:
                            self.tuner_pending[other].extend(reply.tuner_new)
                    if self.adapt is not None:
                        self.adapt.add_own(reply.train_seqs)
                    else:
                        self.buffer.add(reply.train_seqs)
                    for i, c in zip(shards[rank], reply.completions):
                        self._report_finished(i, c)
                else:
                    spot, stopped_at = reply, time.monotonic()
                    self._spot_done(trainer, reply)
                    trainer = None
            if self.spot_on and busy and idle and trainer is None and spot is None and not self._core.busy():
                trainer = idle[0]  # the first worker done: the longest idle
                self._job += 1
                state = None if trainer in self._holders else self.drafter
                self._start(trainer, SpotJob(self._job, state, self.buffer.training_order(), self.adapt_cfg))
            if not busy and trainer is not None and preempt_at is None:
                preempt_at = time.monotonic()
                self.runtime.preempt(trainer, self._job)
        self._on_progress = None
        out: list[Completion | None] = [None] * len(requests)
        for rank, result in results.items():
            for i, c in zip(shards[rank], result.completions):
                out[i] = c
        self._finish_step(out, results, done_at, spot, preempt_at, stopped_at)
        return out  # type: ignore[return-value]

    def _finish_step(self, completions: list[Completion | None], results: dict[int, ShardResult],
                     done_at: dict[int, float], spot: SpotResult | None, preempt_at: float | None,
                     stopped_at: float | None) -> None:
        """Merge the shards' stats; the step's report (tailrl.rollout.adapt.AdaptingRollout)."""
        end = max(done_at.values())
        idle = sum(end - t for t in done_at.values())
        harvested = min(spot.seconds, idle) if spot is not None else 0.0
        shards = [results[r] for r in sorted(results)]
        self.stats = self.close_rollout(
            [r.stats for r in shards], [r.drafter_tallies for r in shards], [c for c in completions if c is not None],
            self.ceiling_depth, self.bucket_edges, self.published,
            (sum(r.drafter_emitted for r in shards), sum(r.drafter_verifies for r in shards)),
            drafter_published=self.drafter.version if self.drafter is not None else 0,
            drafter_micro_steps=spot.micro_steps if spot is not None else 0,
            drafter_loss=spot.loss if spot is not None else None,
            idle_seconds_harvested=harvested,
            idle_seconds_left=idle - harvested,
            preempt_latency_s=stopped_at - preempt_at if preempt_at is not None and stopped_at is not None else 0.0,
            buffer_tokens=self.buffer.tokens,
        )
        self.buffer.end_step()

    def _spot_done(self, rank: int, spot: SpotResult) -> None:
        """A spot job's result: the next drafter version if it trained; who holds which state."""
        if not spot.micro_steps:
            self._holders.add(rank)  # it now holds self.drafter (sent, or held already)
            return
        d = self.drafter
        self.drafter = DrafterState(d.version + 1, spot.weights, spot.optimizer, d.micro_steps + spot.micro_steps)
        self._holders = {rank}

    # ---- publishing ---------------------------------------------------------------------------

    def publish(self, policy: Transformer) -> None:
        """The next rollout samples from `policy` and drafts with the newest drafter version
        (spot-trained in the last rollout, or trained now on the trainer's side)."""
        self.runtime.publish_weights(policy)
        self.publish_drafter(policy, self._adopt)

    def _adopt(self, step: AdaptStep, weights: dict[str, torch.Tensor]) -> None:
        """A version the trainer-side drafter made: the one every worker loads next generate."""
        self.drafter = DrafterState(step.drafting, weights, None, self.drafter.micro_steps + step.micro_steps)

    # ---- state, shutdown ----------------------------------------------------------------------

    def state_dict(self) -> NativeRolloutState:
        return NativeRolloutState(list(self.tuners), [list(p) for p in self.tuner_pending], self.drafter,
                                  self.buffer.state_dict(), self.adapt.state_dict() if self.adapt is not None else None)

    def load_state_dict(self, state: NativeRolloutState) -> None:
        """The drafter and buffer of a checkpoint (tuner states go to the runtime at start, the
        learner's to its opening)."""
        check_state(state, NativeRolloutState)
        if state.drafter is not None:
            self.drafter = state.drafter
        self.buffer.load_state_dict(state.buffer)

    def close(self) -> None:
        self.runtime.close()
