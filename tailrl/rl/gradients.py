"""A micro-batch's gradient added to a buffer parameter by parameter, as the backward produces
it (tailrl.rl.update.group_share): the update's running sum, or the micro-batch's own buffer.

`torch.autograd.grad(loss, params)` returns every parameter's gradient at once, so adding a
micro-batch's gradient to a buffer held two policy-sized buffers for a moment (0.54 GB in fp32
for SmolLM2-135M). Here a hook on each parameter hands its gradient, once autograd has summed
it, to the computing thread's `GradientSink`, which keeps it where it holds nothing yet and adds
it at once otherwise; autograd.grad gets back a zero-strided zero in its place. The same
additions in the same order as adding the returned tensors: the same bits
(tests/test_update.py). The hooks are shared by every thread computing a group (one per
parameter while any is: `routed`); CPU autograd runs a backward on the thread that asked for it,
so each finds its own sink, and a backward outside `differentiate` passes through.

Knows: autograd's hooks, threads. Does not know: the loss, groups, the order buffers are
summed in.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch


class GradientSink:
    """Where the gradients of the parameters a thread differentiates go, as autograd produces
    them (`routed`): the first gradient of each parameter is kept, a later one's is added to it
    at once and dropped, so a sink fed micro-batch after micro-batch (the update's running sum)
    holds one gradient-sized buffer, not a second one for the micro-batch being added."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.index = {id(p): i for i, p in enumerate(params)}
        self.grads: list[torch.Tensor | None] = [None] * len(params)
        self.seen: set[int] = set()  # parameters whose gradient came in this micro-batch

    def take(self, key: int, g: torch.Tensor) -> bool:
        i = self.index.get(key)
        if i is None:
            return False
        self.take_at(i, g)
        self.seen.add(i)
        return True

    def take_at(self, i: int, g: torch.Tensor) -> None:
        """Parameter i's gradient: kept if it is the first, else added to what is kept."""
        if self.grads[i] is None:
            self.grads[i] = g
        else:
            self.grads[i].add_(g)


_sinks = threading.local()  # .sink: the GradientSink of the micro-batch this thread differentiates
_hooks_lock = threading.Lock()
_hooks: dict[int, tuple[int, object]] = {}  # id(param) -> (users, hook handle)


def _route(key: int) -> Callable[[torch.Tensor], torch.Tensor | None]:
    def hook(g: torch.Tensor) -> torch.Tensor | None:
        sink = getattr(_sinks, "sink", None)
        if sink is None or not sink.take(key, g):
            return None  # not a share's backward (or not this share's parameter): autograd as usual
        return g.new_zeros(()).expand_as(g)  # what autograd.grad returns for it: no memory
    return hook


class routed:
    """While open, every trainable parameter has one hook (shared by the threads computing
    shares) that hands its gradient to the computing thread's GradientSink. CPU autograd runs a
    backward on the thread that asked for it, so the sink is found per thread."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = params

    def __enter__(self) -> None:
        with _hooks_lock:
            for p in self.params:
                users, handle = _hooks.get(id(p), (0, None))
                _hooks[id(p)] = (users + 1, handle or p.register_hook(_route(id(p))))

    def __exit__(self, *exc) -> None:
        with _hooks_lock:
            for p in self.params:
                users, handle = _hooks[id(p)]
                if users == 1:
                    del _hooks[id(p)]
                    handle.remove()
                else:
                    _hooks[id(p)] = (users - 1, handle)


def differentiate(loss: torch.Tensor, params: list[torch.Tensor], sink: GradientSink) -> None:
    """Add loss's gradient with respect to params into sink.grads (the first micro-batch's is kept
    as it is), each parameter's as soon as the backward has it: the same bits as adding the
    tensors torch.autograd.grad returns, one micro-batch at a time."""
    sink.seen.clear()
    _sinks.sink = sink
    try:
        out = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        _sinks.sink = None
    for i, (p, x) in enumerate(zip(params, out)):
        if i in sink.seen:
            continue
        # A gradient the hook did not route (autograd called it elsewhere) or none (the parameter is unused).
        sink.take(id(p), torch.zeros_like(p) if x is None else x)
