"""Where workers run: in the trainer's process (one worker) or in spawned local processes.

A runtime starts calls on workers and hands back their replies; it knows nothing of what the
calls mean. `Runtime` is the contract; tailrl.rollout.native.ray_runtime implements it for Ray actors.

Local processes share the rollout model: its tensors live in shared memory, every worker's
engine reads them, and publishing copies the policy into them while the workers are idle
between rollouts (no pipe traffic, no disk). Other tensors (completions' data, the drafter's
state) travel through the pipes as shared-memory handles (torch.multiprocessing). A worker that
dies shows up as a closed pipe or a dead process: WorkerError with its rank.

Knows: processes, pipes, shared memory. Does not know: rollouts, the drafter, RL.
"""

from __future__ import annotations

import copy
import multiprocessing.connection
import signal
import time
from typing import Callable, Protocol

import torch
import torch.multiprocessing as mp

from tailrl.model import Transformer
from tailrl.records import Progress
from tailrl.rollout.native.worker import Beat, Finished, RolloutWorker, WorkerCall, WorkerReply, WorkerSetup
from tailrl.rollout.protocol import WorkerError

# Seconds between beats a process worker sends (liveness and the progress line); hang detection
# waits far longer than this.
BEAT_EVERY_S = 0.5


class Runtime(Protocol):
    """Where a pool's workers run, and how calls reach them."""

    size: int  # workers
    in_process: bool  # worker 0 decodes in the caller's thread (its torch threads are the caller's)
    on_beat: Callable[[int, Beat], None]  # (rank, payload) for each beat a worker sends

    def start(self, rank: int, call: WorkerCall) -> None:
        """Begin worker[rank].handle(call)."""
        ...

    def wait(self, timeout: float) -> list[tuple[int, WorkerReply]]:
        """The replies that arrived within `timeout` seconds, delivering beats meanwhile."""
        ...

    def preempt(self, rank: int, job_id: int) -> None:
        """Ask worker[rank]'s spot job `job_id` to stop after its current micro-step."""
        ...

    def publish_weights(self, policy: Transformer) -> None:
        """The next rollouts sample from `policy`."""
        ...

    def close(self) -> None:
        ...


@torch.no_grad()
def copy_weights(src: Transformer, dst: Transformer) -> None:
    """Copy src's parameters into dst (casting to its dtype); a no-op when they are one model."""
    if dst is src:
        return
    for d, s in zip(dst.parameters(), src.parameters(), strict=True):
        d.copy_(s)


class InProcessRuntime:
    """One worker, called directly: today's single-engine rollout, beats delivered synchronously."""

    size = 1
    in_process = True  # the engine decodes in the caller's thread

    def __init__(self, model: Transformer, setup: WorkerSetup, tuner_states: list | None = None):
        self.model = model
        self.worker = RolloutWorker(0, model, setup, (tuner_states or [None])[0])
        self.on_beat: Callable[[int, Beat], None] = lambda rank, payload: None
        self.worker.beat = lambda payload: self.on_beat(0, payload)
        self._replies: list[tuple[int, WorkerReply]] = []

    def start(self, rank: int, call: WorkerCall) -> None:
        self._replies.append((rank, self.worker.handle(call)))

    def wait(self, timeout: float) -> list[tuple[int, WorkerReply]]:
        out, self._replies = self._replies, []
        return out

    def preempt(self, rank: int, job_id: int) -> None:
        pass  # a single worker is never idle while another generates: it never spot-trains

    def publish_weights(self, policy: Transformer) -> None:
        copy_weights(policy, self.model)

    def close(self) -> None:
        pass


def _serve(rank: int, conn, preempted, model: Transformer, setup: WorkerSetup, tuner_state: dict | None) -> None:
    """A worker process's loop: a WorkerCall in, ("reply" | "beat" | "error", payload) out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle (it closes us)
    try:
        worker = RolloutWorker(rank, model, setup, tuner_state)
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which stops the run
        conn.send(("error", f"could not start: {type(e).__name__}: {e}"))
        return
    last = [0.0]

    def beat(payload: Beat) -> None:
        now = time.monotonic()
        final = isinstance(payload, Progress) and payload.done == payload.total
        if isinstance(payload, Finished):  # not a liveness signal: every one is data
            conn.send(("beat", payload))
        elif final or now - last[0] >= BEAT_EVERY_S:
            last[0] = now
            conn.send(("beat", payload))

    worker.beat = beat
    worker.preempted = lambda: preempted.value
    conn.send(("reply", None))  # ready
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        try:
            result = worker.handle(msg)
        except Exception as e:  # noqa: BLE001 - the trainer decides; this process stays usable
            conn.send(("error", f"raised {type(e).__name__}: {e}"))
            continue
        conn.send(("reply", result))


class ProcessRuntime:
    """`size` spawned processes, each a RolloutWorker on the shared rollout model."""

    in_process = False

    def __init__(self, size: int, model: Transformer, setup: WorkerSetup, tuner_states: list | None = None,
                 start_timeout_s: float = 300.0):
        ctx = mp.get_context("spawn")
        # One shared copy for all workers; the trainer's own model (maybe the policy, with
        # gradients) stays private.
        self.model = copy.deepcopy(model).requires_grad_(False).share_memory()
        self.size = size
        self.on_beat: Callable[[int, Beat], None] = lambda rank, payload: None
        self.procs, self.conns, self.flags = [], [], []
        self.busy: set[int] = set()
        states = tuner_states or [None] * size
        for rank in range(size):
            parent, child = ctx.Pipe()
            flag = ctx.Value("q", 0, lock=False)
            p = ctx.Process(target=_serve, args=(rank, child, flag, self.model, setup, states[rank]),
                            name=f"tailrl-worker-{rank}", daemon=True)
            p.start()
            child.close()  # else a dead worker's pipe would never report EOF here
            self.procs.append(p)
            self.conns.append(parent)
            self.flags.append(flag)
        self.busy = set(range(size))
        deadline = time.monotonic() + start_timeout_s
        try:
            while self.busy:
                self.wait(1.0)
                if time.monotonic() > deadline:
                    raise WorkerError(min(self.busy), f"did not start within {start_timeout_s:.0f} s")
        except BaseException:
            self.close()
            raise

    def start(self, rank: int, call: WorkerCall) -> None:
        self.busy.add(rank)
        try:
            self.conns[rank].send(call)
        except (BrokenPipeError, OSError):
            raise WorkerError(rank, f"died (exit code {self.procs[rank].exitcode})") from None

    def wait(self, timeout: float) -> list[tuple[int, WorkerReply]]:
        ranks = {self.conns[r]: r for r in self.busy}
        replies = []
        for conn in multiprocessing.connection.wait(list(ranks), timeout):
            rank = ranks[conn]
            try:
                while rank in self.busy and conn.poll():
                    kind, payload = conn.recv()
                    if kind == "beat":
                        self.on_beat(rank, payload)
                        continue
                    self.busy.discard(rank)
                    if kind == "error":
                        raise WorkerError(rank, payload)
                    replies.append((rank, payload))
            except (EOFError, OSError):
                self.procs[rank].join(1.0)
                raise WorkerError(rank, f"died (exit code {self.procs[rank].exitcode})") from None
        for rank in self.busy:
            if not self.procs[rank].is_alive():
                raise WorkerError(rank, f"died (exit code {self.procs[rank].exitcode})")
        return replies

    def preempt(self, rank: int, job_id: int) -> None:
        self.flags[rank].value = job_id

    def publish_weights(self, policy: Transformer) -> None:
        copy_weights(policy, self.model)  # the workers are idle: no rollout reads it now

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()  # also ends a stopped (SIGSTOP) or hung worker
                p.join(2.0)
        for conn in self.conns:
            conn.close()
