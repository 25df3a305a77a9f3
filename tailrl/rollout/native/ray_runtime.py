"""Workers as Ray actors: the same RolloutWorker, the same runtime interface as
tailrl.rollout.native.runtimes (start / wait / preempt / publish_weights / close).

Each actor builds its rollout model from the model's config and weights put once into Ray's
object store (numpy arrays, read in place by actors on the same node), so a remote node needs no
copy of the model directory; publishing new policy weights is the same put and an in-place copy
in every actor. Actors are threaded (two threads): one runs the worker's call (rollout or spot
training), the other answers `beats` (progress, liveness) and `preempt`, so the trainer can stop
a spot job mid-way. Ray is an optional dependency (tailrl.rollout.ray_support).

Knows: Ray actors, object refs, Ray's errors. Does not know: rollouts, the drafter, RL.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch

from tailrl.model import ModelConfig, Transformer
from tailrl.rollout import ray_support
from tailrl.rollout.native.worker import Beat, Finished, RolloutWorker, WorkerCall, WorkerReply, WorkerSetup
from tailrl.rollout.protocol import WorkerError
from tailrl.rollout.ray_support import first_line, from_numpy, ray, to_numpy

if ray is not None:
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError


def _weights(model: Transformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in model.named_parameters()}


class _Actor:
    """The actor body: a RolloutWorker, its beats queued for the trainer to collect."""

    def __init__(self, rank: int, cfg: ModelConfig, dtype: torch.dtype, weights: dict[str, np.ndarray],
                 setup: WorkerSetup, tuner_state: dict | None):
        self.dtype = dtype
        self.worker = RolloutWorker(rank, ray_support.build_model(cfg, dtype, weights), setup, tuner_state)
        self._beats: list[Beat] = []
        self._preempted = 0
        self.worker.beat = self._beats.append
        self.worker.preempted = lambda: self._preempted

    def call(self, call: WorkerCall) -> WorkerReply:
        return self.worker.handle(call)

    def pid(self) -> int:
        return os.getpid()

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.worker.load_weights(from_numpy(weights, self.dtype))

    def beats(self) -> list[Beat]:
        out, self._beats = self._beats, []
        # Finished beats are data, each one kept; of the others the latest says all.
        data = [b for b in out if isinstance(b, Finished)]
        rest = [b for b in out if not isinstance(b, Finished)]
        return data + rest[-1:]

    def preempt(self, job_id: int) -> None:
        self._preempted = job_id


class RayRuntime:
    in_process = False

    def __init__(self, size: int, address: str | None, model: Transformer, setup: WorkerSetup,
                 tuner_states: list | None = None, start_timeout_s: float = 300.0):
        self.owns_ray = ray_support.start(address)
        self.size, self.dtype = size, model.lm_head.weight.dtype
        self.on_beat: Callable[[int, Beat], None] = lambda rank, payload: None
        weights = ray.put(to_numpy(_weights(model)))
        states = tuner_states or [None] * size
        actor = ray.remote(num_cpus=setup.threads or 1, max_concurrency=2)(_Actor)
        self.actors = [actor.remote(r, model.cfg, self.dtype, weights, setup, states[r]) for r in range(size)]
        self.calls: dict[ray.ObjectRef, int] = {}  # pending call ref -> rank
        self.beat_calls: dict[ray.ObjectRef, int] = {}
        try:
            ray.get([a.beats.remote() for a in self.actors], timeout=start_timeout_s)  # constructed
        except GetTimeoutError:
            self.close()
            raise WorkerError(0, f"(Ray actor) did not start within {start_timeout_s:.0f} s") from None
        except (RayActorError, RayTaskError) as e:
            self.close()
            raise WorkerError(0, f"(Ray actor) could not start: {first_line(e)}") from None

    def start(self, rank: int, call: WorkerCall) -> None:
        self.calls[self.actors[rank].call.remote(call)] = rank

    def wait(self, timeout: float) -> list[tuple[int, WorkerReply]]:
        self._collect_beats()
        replies = []
        if self.calls:
            ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=timeout)
            if ready:
                ready, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
            for ref in ready:
                rank = self.calls.pop(ref)
                replies.append((rank, self._get(rank, ref)))
        else:
            time.sleep(timeout)
        return replies

    def _collect_beats(self) -> None:
        """Ask busy actors for beats, one outstanding request each (a hung actor gets no pile-up)."""
        busy = set(self.calls.values())
        asked = set(self.beat_calls.values())
        for rank in busy - asked:
            self.beat_calls[self.actors[rank].beats.remote()] = rank
        ready, _ = ray.wait(list(self.beat_calls), num_returns=len(self.beat_calls), timeout=0)
        for ref in ready:
            rank = self.beat_calls.pop(ref)
            for payload in self._get(rank, ref):
                self.on_beat(rank, payload)

    def _get(self, rank: int, ref: ray.ObjectRef) -> object:
        try:
            return ray.get(ref)
        except RayActorError as e:
            raise WorkerError(rank, f"died (Ray actor: {first_line(e)})") from None
        except RayTaskError as e:
            raise WorkerError(rank, f"raised {first_line(e)}") from None

    def preempt(self, rank: int, job_id: int) -> None:
        self.actors[rank].preempt.remote(job_id)

    def publish_weights(self, policy: Transformer) -> None:
        weights = {k: v.to(self.dtype) for k, v in _weights(policy).items()}
        ref = ray.put(to_numpy(weights))
        for rank, r in enumerate([a.load_weights.remote(ref) for a in self.actors]):
            self._get(rank, r)

    @property
    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        ray_support.stop(self.actors, self.owns_ray)
        self.actors, self.owns_ray = [], False

