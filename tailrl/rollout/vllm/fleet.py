"""vLLM engines on Ray (`--engine vllm --workers N`): one engine per actor, a step's requests
split across them, the policy and the drafter pushed to every engine, a dead or hung engine
replaced. Behind the Rollout protocol like the in-process engine (rollout.py), which each
actor runs (actor.py).

- generate: each engine decodes one contiguous share of the requests (siblings adjacent, as
  the native engine's workers). The trainer asks every engine to `advance` (decode for
  ADVANCE_S, hand back what finished) again and again, reports each finished sequence as it
  comes (on_finished, in the calling thread) and the engines' summed progress.
- publish: the policy's weights, put once into Ray's object store, into every engine, tagged
  with the publish count; then, when the drafter adapting on the trainer's side (the
  in-process engine's way, tailrl.rollout.adapt) made a new version, that version into every
  engine. An engine decodes only with the trainer's current tags (actor.py).
- Failures. An engine whose actor dies (Ray's errors), raises, or sends nothing for
  --worker-timeout-s is killed and a new actor started from the current weights, drafter
  version and its tuner's last state, so it holds them before it decodes; the requests it had
  not finished go to it again, from their start (their seeds give the same samples). At most
  --engine-restarts times per run; the next failure raises WorkerError, the step applies
  nothing and `--resume` continues from the last checkpoint. The report counts the step's
  restarts (engine_restarts); a replaced engine's decoding before it died is not counted.
- Each engine's tuner learns on its own steps (the native engine's workers share rewards;
  vLLM's are not shared yet); all their states are checkpointed, and a resume needs the same
  --workers.

Knows: Ray actors and errors, shards, tags, restarts. Does not know: vLLM's API (actor.py and
rollout.py), RL.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tailrl.model import Transformer
from tailrl.records import Completion, Progress, Request, Stop
from tailrl.rollout import ray_support
from tailrl.rollout.adapt import AdaptingRollout, AdaptiveDrafter, AdaptStep
from tailrl.rollout.protocol import DrafterVersionError, IdleCore, RolloutReport, RolloutState, WorkerError
from tailrl.rollout.ray_support import first_line, ray, to_numpy
from tailrl.rollout.vllm.actor import Advance, EngineActor, EngineSpec, Shard, Tags
from tailrl.rollout.vllm.checks import check_lengths, check_sampling, is_learned
from tailrl.rollout.vllm.weights import engine_weights
from tailrl.rollout.workers import WorkerConfig, shard_indices
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.learner import AdaptConfig

if ray is not None:
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

logger = logging.getLogger(__name__)  # a restart, on the log (Python's last-resort handler: stderr)

# Seconds an engine decodes per `advance` before handing back what finished: the latency of
# on_finished and progress, against one Ray round trip (~1 ms) per call.
ADVANCE_S = 0.5
# Seconds an engine may take to start (import vLLM, load the weights, allocate its cache: 10-20
# s for SmolLM2 on 2 CPU cores), apart from --worker-timeout-s, the silence of a running one.
START_TIMEOUT_S = 300.0


@dataclass
class VllmFleetState(RolloutState):
    """vLLM on Ray's checkpointed state: each engine's tuner and the adapting drafter's."""

    tuners: list[dict | None]
    adapt: dict | None


class VllmFleet(AdaptingRollout):
    """vLLM engines in Ray actors behind the Rollout protocol (see the module doc)."""

    def __init__(self, spec: EngineSpec, workers: WorkerConfig, max_restarts: int, adapt: AdaptiveDrafter | None,
                 tuners: list[dict | None], owns_ray: bool):
        self.spec, self.size, self.timeout_s = spec, workers.workers, workers.worker_timeout_s
        self.max_restarts, self.restarts, self.step_restarts = max_restarts, 0, 0
        self.adapt = adapt
        self.tuners = tuners  # each engine's tuner state as of its last finished call
        self.owns_ray = owns_ray
        self.max_len = spec.settings.max_model_len or spec.model.max_position_embeddings
        self.actor_class = ray.remote(num_cpus=spec.threads)(EngineActor)
        self.actors: list = []
        self.weights: ray.ObjectRef | None = None
        self.drafter: ray.ObjectRef | None = None  # the drafting version's weights; None: the directory's
        self.tags = Tags(0, adapt.version if adapt is not None else 0)

    @classmethod
    def start(cls, model: Transformer, seed: int, state: RolloutState | None, *, spec: EngineSpec,
              workers: WorkerConfig, max_restarts: int, adapt: AdaptConfig) -> VllmFleet:
        """`workers.workers` engines on `model`'s weights (spec: how each opens), resuming `state`."""
        if state is not None and not isinstance(state, VllmFleetState):
            raise ValueError(f"this checkpoint holds {type(state).__name__}, not vLLM engines on Ray's state: "
                             f"resume it with the --engine and --workers it was saved with")
        tuners = state.tuners if state is not None else [None] * workers.workers
        if len(tuners) != workers.workers:
            raise ValueError(f"the checkpoint holds {len(tuners)} engines' state; resume with --workers {len(tuners)}")
        adapting = None
        if spec.drafter is not None and is_learned(spec.drafter) and adapt.adapt_drafter:
            adapting = AdaptiveDrafter.open(spec.drafter, model, adapt, state.adapt if state is not None else None)
        fleet = cls(spec, workers, max_restarts, adapting, list(tuners), ray_support.start(workers.ray_address))
        try:
            fleet.weights = ray.put(to_numpy(engine_weights(model, spec.dtype)))
            if adapting is not None and adapting.version > 0:  # a resumed run drafts with its checkpoint's version
                fleet.drafter = ray.put(to_numpy(adapting.drafting_weights()))
            fleet.actors = [fleet._spawn(rank) for rank in range(fleet.size)]
            fleet._started(range(fleet.size))
        except BaseException:
            fleet.close()
            raise
        return fleet

    # ---- engines ----------------------------------------------------------------------------

    def _spawn(self, rank: int):
        """A new engine actor holding the current weights, drafter version and its tuner's state."""
        return self.actor_class.remote(self.spec, self.weights, self.tags, self.drafter, self.tuners[rank])

    def _started(self, ranks: Sequence[int]) -> None:
        """Wait for these engines to have started."""
        refs = {self.actors[rank].pid.remote(): rank for rank in ranks}
        deadline = time.monotonic() + START_TIMEOUT_S
        for ref, rank in refs.items():
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except GetTimeoutError:
                raise WorkerError(rank, f"(vLLM engine on Ray) did not start within {START_TIMEOUT_S:g} s") from None
            except RayError as e:
                raise WorkerError(rank, f"(vLLM engine on Ray) could not start: {first_line(e)}") from None

    def _replace(self, rank: int, reason: str, when: str) -> None:
        """Engine `rank` died or hung: a new one in its place, or WorkerError past the cap."""
        if self.restarts >= self.max_restarts:
            raise WorkerError(rank, f"(vLLM engine on Ray) {reason} {when}, after {self.restarts} restarts "
                                    f"(--engine-restarts {self.max_restarts})")
        self.restarts += 1
        self.step_restarts += 1
        logger.warning("vLLM engine %d %s %s: restarting it (%d of at most %d restarts)", rank, reason, when,
                       self.restarts, self.max_restarts)
        ray.kill(self.actors[rank])
        self.actors[rank] = self._spawn(rank)
        self._started([rank])

    def _on_every_engine(self, call: Callable[[object], ray.ObjectRef], when: str) -> None:
        """`call(actor)` on every engine, waited for; an engine that died is replaced (the new
        one starts from the current weights and drafter, which is what the call was to load)."""
        refs = [call(actor) for actor in self.actors]
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=self.timeout_s)
            except GetTimeoutError:
                self._replace(rank, f"did not answer within {self.timeout_s:g} s (hung)", when)
            except RayTaskError as e:
                if isinstance(e.cause, DrafterVersionError):
                    raise e.cause from None
                self._replace(rank, f"raised {first_line(e)}", when)
            except RayActorError as e:
                self._replace(rank, _died(e), when)

    # ---- a step's rollout ---------------------------------------------------------------------

    def generate(self, step: int, requests: Sequence[Request], params: SamplingParams, max_new_tokens: int,
                 on_progress: Callable[[Progress], None] | None = None,
                 on_finished: Callable[[int, Completion], None] | None = None,
                 core: IdleCore | None = None, stop: Stop | None = None) -> list[Completion]:
        """The completions of `requests`, in order (see the module doc). `core` is not consulted:
        the engines decode in their own processes (nothing of the caller's to lend) and have no
        background work. `stop` goes to every engine
        with its requests."""
        check_sampling(params)
        check_lengths(requests, max_new_tokens, self.max_len)
        self.step_restarts = 0
        t0 = time.perf_counter()
        run = _Run(self, step, requests, params, max_new_tokens, on_finished, stop)
        for rank, shard in enumerate(shard_indices(len(requests), self.size)):
            if shard:
                run.dispatch(rank, list(shard))
        while run.shards:
            run.poll()
            if on_progress is not None:
                on_progress(run.progress())
        out = run.completions()
        self.close_rollout([part.stats for part in run.parts], [part.tallies for part in run.parts], out,
                           self.spec.ceiling_depth, self.spec.tuner.bucket_edges, self.tags.drafter,
                           seconds=time.perf_counter() - t0)  # the step's, restarts included
        return out

    def report(self) -> RolloutReport:
        """The last generate's report, with the engines restarted in it and in the publish after
        it (an engine that died between rollouts is found when the weights are pushed)."""
        return dataclasses.replace(super().report(), engine_restarts=self.step_restarts)

    # ---- publishing ---------------------------------------------------------------------------

    def publish(self, policy: Transformer) -> None:
        """`policy`'s weights into every engine, then a new drafter version if the adapting
        drafter made one (module doc)."""
        self.tags = Tags(self.tags.weights + 1, self.tags.drafter)
        self.weights = ray.put(to_numpy(engine_weights(policy, self.spec.dtype)))
        tag, weights = self.tags.weights, self.weights
        self._on_every_engine(lambda actor: actor.load_weights.remote(tag, weights), "loading new weights")
        self.publish_drafter(policy, self._load_drafter)

    def _load_drafter(self, step: AdaptStep, weights: dict[str, torch.Tensor]) -> None:
        """A new drafter version, put once into Ray's object store, into every engine."""
        self.tags = Tags(self.tags.weights, step.drafting)
        self.drafter = drafter = ray.put(to_numpy(weights))
        self._on_every_engine(lambda actor: actor.load_drafter.remote(step.drafting, drafter),
                              f"loading drafter version {step.drafting}")

    # ---- state, shutdown ----------------------------------------------------------------------

    def state_dict(self) -> VllmFleetState:
        return VllmFleetState(list(self.tuners), self.adapt.state_dict() if self.adapt is not None else None)

    @property
    def pids(self) -> list[int]:
        return ray.get([actor.pid.remote() for actor in self.actors])

    def close(self) -> None:
        ray_support.stop(self.actors, self.owns_ray)
        self.actors, self.owns_ray = [], False


class _Run:
    """One generate call across the engines: which requests each decodes, what came back."""

    def __init__(self, fleet: VllmFleet, step: int, requests: Sequence[Request], params: SamplingParams,
                 max_new_tokens: int, on_finished: Callable[[int, Completion], None] | None, stop: Stop | None):
        self.fleet, self.step, self.requests = fleet, step, requests
        self.params, self.max_new_tokens, self.on_finished, self.stop = params, max_new_tokens, on_finished, stop
        self.out: list[Completion | None] = [None] * len(requests)
        self.shards: dict[int, list[int]] = {}  # rank -> the request indices its current call decodes
        self.calls: dict[ray.ObjectRef, int] = {}  # an outstanding advance -> rank
        self.sent: dict[int, float] = {}  # rank -> when its outstanding advance was sent
        self.latest: dict[int, Progress] = {}
        self.parts: list[Shard] = []

    def dispatch(self, rank: int, indices: list[int]) -> None:
        """Engine `rank` decodes these requests (a replaced engine's restarts with them). Not
        waited for: an actor runs its calls in order, so its next advance answers for it."""
        fleet = self.fleet
        self.shards[rank] = indices
        self.latest.pop(rank, None)
        fleet.actors[rank].begin.remote(fleet.tags, self.step, [self.requests[i] for i in indices], self.params,
                                        self.max_new_tokens, self.stop)

    def _lost(self, rank: int, reason: str) -> None:
        """Engine `rank` failed: a new one decodes its unfinished requests from their start."""
        self.fleet._replace(rank, reason, f"in step {self.step}")
        self.dispatch(rank, [i for i in self.shards[rank] if self.out[i] is None])

    def poll(self) -> None:
        """Ask every engine without an outstanding advance for one; take what came back within a
        moment; replace the engines that failed or went silent."""
        now = time.monotonic()
        for rank in set(self.shards) - set(self.calls.values()):
            self.calls[self.fleet.actors[rank].advance.remote(ADVANCE_S)] = rank
            self.sent[rank] = now
        ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=0.25)
        if ready:
            ready, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
        for ref in ready:
            rank = self.calls.pop(ref)
            try:
                self._take(rank, ray.get(ref))
            except RayActorError as e:
                self._lost(rank, _died(e))
            except RayTaskError as e:
                self._lost(rank, f"raised {first_line(e)}")
        now = time.monotonic()
        for ref, rank in list(self.calls.items()):
            if now - self.sent[rank] > self.fleet.timeout_s:
                del self.calls[ref]
                self._lost(rank, f"sent nothing for {self.fleet.timeout_s:g} s (hung)")

    def _take(self, rank: int, advance: Advance) -> None:
        indices = self.shards[rank]
        for local, completion in advance.finished:
            i = indices[local]
            self.out[i] = completion
            if self.on_finished is not None:
                self.on_finished(i, completion)
        self.latest[rank] = advance.progress
        if advance.done is not None:
            self.parts.append(advance.done)
            self.fleet.tuners[rank] = advance.done.tuner
            del self.shards[rank]

    def progress(self) -> Progress:
        """The call's progress: every engine's summed, the finished requests of all."""
        ps = self.latest.values()
        done = sum(c is not None for c in self.out)
        # The engines still decoding (a finished shard leaves `shards`); one not heard from yet: 0.
        fewest = min((self.latest[r].fewest_unfinished if r in self.latest else 0 for r in self.shards), default=0)
        return Progress(done, len(self.requests), sum(p.running for p in ps), sum(p.tokens for p in ps),
                        max((p.seconds for p in ps), default=0.0), fewest)

    def completions(self) -> list[Completion]:
        if any(c is None for c in self.out):
            raise RuntimeError("a generate call ended with unfinished requests")
        return self.out  # type: ignore[return-value]


def _died(e: BaseException) -> str:
    """An engine actor's death in a few words (Ray's own message runs to a paragraph, which Ray
    logs itself)."""
    return f"died (Ray: {type(e).__name__})"
