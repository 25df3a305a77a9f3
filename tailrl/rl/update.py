"""The policy update one GRPO group at a time, so that it can start while the rollout's tail runs.

A group whose responses are all finished has its rewards and advantages; its share of the update
(trainer log-probs, loss, backward) needs nothing else. `GroupGradients` computes that share per
group and combines the shares so the result does not depend on when, or on which thread, each
group was computed:

- A group's share (tailrl.rl.share) is the gradient of its *unnormalised* loss, taken micro-batch
  by micro-batch: nothing is accumulated into shared `.grad`.
- Micro-batch gradients are added to one running sum in a fixed order (tailrl.rl.fold.OrderedFold):
  a left-to-right fold over the groups by their longest response's length (`group_key`), ties
  by group index, each group's micro-batches in turn. Floating-point addition is not
  associative, so a fixed association is what makes the sum's bits independent of the order
  groups finish in, and the lengths are the tokens' own, so the order is the same in every
  schedule. A group that is next in the order adds each micro-batch's gradient to the sum
  parameter by parameter as its backward produces it (tailrl.rl.gradients): it holds no buffer
  of its own. A group computed before its turn keeps one buffer per micro-batch, which wait
  until the groups before it are in. The rollout finishes a group about when its longest
  response ends, so the order is about the one groups finish in, and a finished group need not
  wait for the rollout's end to know it is next: every response still decoding has at least the
  tokens it has so far (`floor`, from the rollout's progress; `bound`, a group's finished
  responses), and a group whose key is below every unfinished group's bound is next
  (docs/memory.md). The stats and the hidden states are folded in group order (they are small).
- At most `waiting_gradients` buffers wait (tailrl.rl.grpo.GRPOConfig, the gradient sum among
  them): a group whose buffer would wait beyond them stays queued until it would not (only when
  it is computed changes: the same bits).
- At the end the sum is divided by the batch's token count (known only then): the token-mean over
  the whole batch: unnormalised sums accumulated, divided once.

`BackgroundUpdate` runs `GroupGradients.add` on a background thread as groups arrive, with one
torch thread, while the rollout decodes. It computes only while the rollout leaves a core to it
(`open_gate` / `close_gate`, driven by the running batch size) and, once the rollout is over,
the rest on every torch thread, one group at a time: two groups at once (the trainer's thread
helping) held two groups' activations in two malloc arenas and, each picked as if the other
were not there, let more buffers wait than the cap allows (docs/memory.md). The synchronous
update is the same object fed all groups after the rollout, so both give the same bits by
construction. After each group malloc's free pages go back to the kernel (tailrl.memory.trim):
its freed activations, kept in the arena, would otherwise sit resident under the next group's
(docs/memory.md). Deterministic kernels
(tailrl.rl.guards) are the caller's to switch on: the switch is process-wide.

Hidden states. Asked (`on_hidden`), a group's forward also hands out each sample's final-normed
hidden states (tailrl.rl.packing.packed_logprobs_and_hidden), in group order, for a drafter to
learn from; the gradient is the same bits either way. Groups that sit out (no reward spread) are
not forwarded, so they hand out nothing.

Idle work. Given a `DrafterFeed` (the rollout's drafter, which trains on a lent core), the
background thread runs it while the gate is open and no group may be computed: policy work
first, the idle work stopping between its units as soon as a group may be, the gate closes or
the rollout ends.

Knows: the summing order, what waits, threads. Does not know: the loss (tailrl.rl.share), how
tokens were produced, rewards, workers, the optimizer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tailrl.memory import trim
from tailrl.model import Transformer
from tailrl.rl.fold import OrderedFold
from tailrl.rl.gradients import GradientSink
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.packing import Sample
from tailrl.rl.share import STAT_NAMES, GroupShare, empty_share, group_share, micro_batches
from tailrl.rollout.protocol import DrafterFeed


@dataclass(frozen=True)
class UpdateStats:
    """Token means over the whole update batch (loss is the objective that was backpropagated),
    and ratio_max, the largest importance ratio in it (tailrl.rl.grpo.LossTerms)."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    ratio_mean: float = 0.0
    capped_fraction: float = 0.0
    mismatch_kl: float = 0.0
    ratio_max: float = 0.0
    tokens: int = 0


class GroupGradients:
    """Gradient shares of `num_groups` groups, summed into the policy's .grad in a fixed order.

    Groups may be added in any order, from any thread (one group at a time per thread), each
    with its key (its longest response's length, `group_key`), and a group without samples
    (skipped: no reward spread) is added as empty. `reveal`, `floor` and `bound` tell the order
    what is known before a group is added (tailrl.rl.fold). `finish` waits for nothing: call it
    once every group is in. on_hidden(samples, hidden) receives each computed group's samples
    and their hidden states, in group order (as the group is folded).
    """

    def __init__(self, policy: Transformer, cfg: GRPOConfig, temperature: float, num_groups: int,
                 ref: Transformer | None = None,
                 on_hidden: Callable[[Sequence[Sample], list[torch.Tensor]], None] | None = None):
        self.policy, self.cfg, self.temperature, self.ref = policy, cfg, temperature, ref
        self.on_hidden = on_hidden
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.num_groups = num_groups
        self._ready: dict[int, GroupShare] = {}
        self._next = 0  # the first group whose stats are not yet folded
        self._sums = dict.fromkeys(STAT_NAMES, 0.0)
        self._tokens = 0
        self._ratio_max = 0.0
        self._start()

    def _start(self) -> None:
        # The order, and which buffers wait: under _shape_lock, read by the scheduler (held_after)
        # on the rollout's thread, which must not wait for an addition of gradient buffers. The
        # buffers themselves are added under _lock, in the order the shape added their groups.
        self._shape = OrderedFold(self.num_groups)
        self._shape_lock = threading.Lock()
        self._order: list[int] = []  # groups in the fold's order, as the shape adds them
        self._lock = threading.Lock()
        self._buffers: dict[int, list[list[torch.Tensor]]] = {}  # computed, not yet in the sum
        self._summed = 0  # how many of _order are in the sum
        self._sum = GradientSink(self.params)  # the running sum: its grads, None until a group adds to it

    def reveal(self, group: int, key: int) -> None:
        with self._shape_lock:
            self._shape.reveal(group, key)

    def floor(self, at_least: int) -> None:
        """Every group not yet revealed has a key of at least `at_least`."""
        with self._shape_lock:
            self._shape.floor(at_least)

    def bound(self, group: int, at_least: int) -> None:
        with self._shape_lock:
            self._shape.bound(group, at_least)

    def add(self, group: int, samples: Sequence[Sample], key: int) -> None:
        """Compute the group's share and sum it in its turn. A group that is next in the summing
        order adds its micro-batches to the sum as its backwards produce them, holding no buffer
        of its own (no other group is added before it is in); any other keeps one buffer per
        micro-batch until its turn, then adds them in the same order: the same bits."""
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group {group} out of range for {self.num_groups} groups")
        with self._lock:  # groups that became next since they were put (bounds rose) go in first
            with self._shape_lock:
                self._shape.reveal(group, key)
                self._order += self._shape.settle()
            self._sum_in_order()
            with self._shape_lock:  # next, with every group before it in the sum already
                into = self._shape.is_next(group) and self._summed == len(self._order)
        share = (group_share(self.policy, samples, self.cfg, self.temperature, self.ref, self.on_hidden is not None,
                             self._sum if into else None)
                 if samples else empty_share())
        with self._shape_lock:
            self._order += self._shape.put(group, key, len(share.grads), in_sum=into and share.tokens > 0)
        with self._lock:
            self._buffers[group] = share.grads
            share.grads = []  # the sum holds them now, or will
            self._sum_in_order()
            self._ready[group] = share
            while self._next in self._ready:
                self._fold(self._ready.pop(self._next))
                self._next += 1

    def _sum_in_order(self) -> None:
        """Add the buffers of the groups the shape has added, in its order, as far as they are
        here (a group still being computed on another thread stops it; that thread goes on).
        Caller holds _lock."""
        with self._shape_lock:
            order = self._order[self._summed:]
        for g in order:
            if g not in self._buffers:
                break
            for buffers in self._buffers.pop(g):
                for i, b in enumerate(buffers):
                    self._sum.take_at(i, b)
            self._summed += 1

    def _fold(self, share: GroupShare) -> None:
        for name in STAT_NAMES:
            self._sums[name] += share.sums[name]
        self._tokens += share.tokens
        self._ratio_max = max(self._ratio_max, share.ratio_max)
        if share.samples and self.on_hidden is not None:
            self.on_hidden(share.samples, share.hidden)

    @property
    def held_buffers(self) -> int:
        """Gradient buffers of finished groups waiting to be added, the gradient sum among them."""
        with self._shape_lock:
            return self._shape.held

    def held_after(self, group: int, samples: Sequence[Sample]) -> int:
        """held_buffers once `group` (revealed; with these samples: none, no buffer) is added, if
        nothing else is (0 for a group out of range: `add` refuses it)."""
        if not 0 <= group < self.num_groups:
            return 0
        with self._shape_lock:
            if self._shape.is_next(group):
                return self._shape.held_after(group, 0, into_sum=bool(samples))
            return self._shape.held_after(group, micro_batches(samples, self.cfg) if samples else 0)

    @property
    def done(self) -> bool:
        return self._next == self.num_groups

    def finish(self) -> UpdateStats:
        """Write the token-mean gradient into .grad (None when no group had tokens); the stats."""
        if not self.done:
            raise RuntimeError(f"finish() with groups {self._next}.. of {self.num_groups} not added")
        total = self._sum.grads
        self._start()
        if self._tokens == 0:
            for p in self.params:
                p.grad = None
            return UpdateStats()
        for p, g in zip(self.params, total):
            p.grad = g.div_(self._tokens)  # type: ignore[union-attr]  # every parameter was differentiated
        t = self._tokens
        return UpdateStats(tokens=t, ratio_max=self._ratio_max, **{name: v / t for name, v in self._sums.items()})


def group_key(responses: Sequence[Sequence[int]]) -> int:
    """A group's key in the summing order (tailrl.rl.fold): its longest response's length, the
    group's own and every sibling's (a response the update leaves out too). The rollout finishes
    a group about when its longest response ends, so the groups are summed about in the order
    they finish and few buffers wait; a response still decoding bounds its group's key from below
    by the tokens it has, which is what lets a finished group in before the rollout ends."""
    return max((len(r) for r in responses), default=0)


def by_prompt(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Runs of adjacent samples with one prompt: the groups of a batch whose siblings are adjacent."""
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].prompt_ids == s.prompt_ids:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def accumulate_gradients(policy: Transformer, samples: Sequence[Sample], cfg: GRPOConfig, temperature: float,
                         ref: Transformer | None = None) -> UpdateStats:
    """The synchronous update: write the token-mean GRPO gradient of `samples` into .grad, group
    by group (adjacent samples with one prompt) in order, cfg.micro_batch responses per
    forward/backward within a group."""
    groups = by_prompt(samples)
    grads = GroupGradients(policy, cfg, temperature, len(groups), ref)
    for g, group in enumerate(groups):
        grads.add(g, group, group_key([s.token_ids for s in group]))
    return grads.finish()


_IDLE = object()  # _take's answer: no group to compute, run the idle work


class BackgroundUpdate:
    """Feeds GroupGradients from a background thread while the rollout runs.

    `submit` queues a finished group; the background thread computes queued groups while the
    gate is open (the rollout decodes on fewer cores in its tail) and waits at the gate between
    groups otherwise; with the gate open and no group it may compute (`_pick`: none queued, or
    none whose buffer may wait) it runs `idle` (if any) until one may be computed, the gate
    closes or the rollout ends. `drain` (after the rollout) has the background thread compute
    what is left, one group at a time on the caller's torch threads (OpenMP thread counts are
    per thread), and returns once every group is added. Errors raised in the background thread
    re-raise in `drain`.
    """

    def __init__(self, grads: GroupGradients, idle: DrafterFeed | None = None):
        self.grads = grads
        self.idle = idle
        self._queue: deque[tuple[int, Sequence[Sample], int]] = deque()
        self._cond = threading.Condition()
        self._gate = False
        self._closed = False
        self._busy = 0
        self._drain_threads = 1  # torch threads once the rollout is over: drain's caller's
        self._seconds = 0.0  # compute time of the groups added so far
        self._added = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tailrl-update", daemon=True)
        self._thread.start()

    def submit(self, group: int, samples: Sequence[Sample], key: int) -> None:
        """A finished group, with its key in the summing order (group_key)."""
        if 0 <= group < self.grads.num_groups:  # one out of range: add refuses it, in drain
            self.grads.reveal(group, key)
        with self._cond:
            self._queue.append((group, samples, key))
            self._cond.notify_all()

    def floor(self, at_least: int) -> None:
        """Every group not yet submitted has a key of at least `at_least` (its responses still
        decoding have that many tokens): groups before it in the summing order may be computed."""
        self.grads.floor(at_least)
        with self._cond:
            self._cond.notify_all()

    def bound(self, group: int, at_least: int) -> None:
        """Group `group`, not yet submitted, has a key of at least `at_least` (a finished response)."""
        self.grads.bound(group, at_least)
        with self._cond:
            self._cond.notify_all()

    def open_gate(self) -> None:
        with self._cond:
            self._gate = True
            self._cond.notify_all()

    def close_gate(self) -> None:
        with self._cond:
            self._gate = False

    @property
    def has_work(self) -> bool:
        """A group may be computed now (_pick) or is being computed."""
        with self._cond:
            return self._busy > 0 or self._pick() is not None

    @property
    def active(self) -> bool:
        """The gate is open and a group may be computed or is being computed: it is using a core."""
        with self._cond:
            return self._gate and (self._busy > 0 or self._pick() is not None)

    def seconds_so_far(self) -> tuple[float, int]:
        """(compute seconds, groups) of the groups added so far."""
        with self._cond:
            return self._seconds, self._added

    def abort(self) -> None:
        """Drop queued groups and stop the background thread (after its current group)."""
        with self._cond:
            self._queue.clear()
            self._gate = self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _pick(self) -> tuple[int, Sequence[Sample], int] | None:
        """The queued group to compute next; None: none now (caller holds _cond). While the
        rollout runs, a group whose buffer would leave more than cfg.waiting_gradients waiting
        to be added (tailrl.rl.fold) stays queued: it is computed once the groups it would wait
        for are in; of those that fit, the one that leaves the fewest waiting, then the first in
        the summing order: a group computed out of order holds its buffer, and under a cap of 1
        blocks every other group until the groups before it are in (docs/memory.md). After the
        rollout every group is in and one is computed at a time, in the summing order."""
        if self._closed:
            return min(self._queue, key=lambda q: (q[2], q[0])) if self._queue else None
        cap = self.grads.cfg.waiting_gradients
        held = [(self.grads.held_after(q[0], q[1]), q[2], q[0], q) for q in self._queue]
        fitting = [h for h in held if h[0] <= cap]
        return min(fitting, key=lambda h: h[:3])[3] if fitting else None

    def _take(self) -> tuple[int, Sequence[Sample], int] | object | None:
        with self._cond:
            while True:
                if self._closed and not self._queue:
                    return None
                item = self._pick() if self._gate else None
                if item is not None:
                    self._busy += 1
                    self._queue.remove(item)
                    return item
                if self._gate and not self._closed and self.idle is not None and self.idle.has_idle_work():
                    return _IDLE
                self._cond.wait()

    def _stop_idle(self) -> bool:
        """Policy work first: the idle work stops once a group may be computed, the gate closes or the rollout ends."""
        with self._cond:
            return self._pick() is not None or not self._gate or self._closed

    def _run_idle(self) -> None:
        try:
            self.idle.work_idle(self._stop_idle)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread in drain()
            with self._cond:
                self._error = self._error or e
                self.idle = None  # no second try this step

    def _compute(self, item: tuple[int, Sequence[Sample], int]) -> None:
        t0 = time.perf_counter()
        try:
            self.grads.add(*item)
            trim()  # the group's freed activations go back to the kernel before the next group's (docs/memory.md)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread in drain()
            with self._cond:
                self._error = self._error or e
        finally:
            with self._cond:
                self._busy -= 1
                self._seconds += time.perf_counter() - t0
                self._added += 1
                self._cond.notify_all()

    def _run(self) -> None:
        torch.set_num_threads(1)  # while the rollout runs: the core its tail leaves
        while (item := self._take()) is not None:
            if item is _IDLE:
                self._run_idle()
                continue
            if self._closed and torch.get_num_threads() != self._drain_threads:
                torch.set_num_threads(self._drain_threads)  # after the rollout: every core
            self._compute(item)

    def drain(self) -> None:
        """Have the background thread compute what is left, one group at a time in the summing
        order, on this thread's torch threads, and wait for it. One thread computes the whole
        update so that one malloc arena holds its tensors: the activations it freed during the
        rollout are the ones its next groups reuse, where another thread's arena would grow
        beside them (tailrl.memory.trim)."""
        with self._cond:
            self._gate = self._closed = True
            self._drain_threads = torch.get_num_threads()
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            raise self._error
