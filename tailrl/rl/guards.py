"""Guards around the RL update: deterministic kernels, and Ctrl-C held until a step is whole.

Knows: torch's determinism switch, SIGINT. Does not know: models, losses, the loop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import torch


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels for the update on CPU: with several threads the backward pass can
    give other bits on every call with the same inputs, so two runs that sampled the same tokens
    would drift apart from the first update on. With the flag the gradients are the same bits
    call after call (tests/test_train.py checks it; its cost: docs/performance.md). Not on CUDA,
    where it also needs CUBLAS_WORKSPACE_CONFIG set by the user."""
    if device.type != "cpu" or torch.are_deterministic_algorithms_enabled():
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, so an interrupt never leaves a half-applied update."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
