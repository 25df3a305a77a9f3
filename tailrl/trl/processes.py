"""TLT across the processes of a data-parallel TRL run (`accelerate launch --num_processes N`).

Each process runs its own colocated engine on its share of the prompts; one drafter serves them
all. Process 0 adapts it: it receives what every process observed (`to_first`), trains, and hands
each version it publishes to the others (`from_first`), so every engine drafts with the same
version, the same weights. `across` is a small value of every process, for metrics over all
engines. With one process each is the identity, without a collective.

They run on the default process group (gloo on CPU, what accelerate starts), and are collectives:
every process calls each of them at the same point of the step, as TRL's own gathers.

Knows: torch.distributed's object collectives. Does not know: TRL, vLLM, the drafter.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def _spread() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's index (0: the one that adapts the drafter)."""
    return dist.get_rank() if _spread() else 0


def to_first(obj: T) -> list[T] | None:
    """`obj` of every process, in process order, on process 0; None on the others."""
    if not _spread():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def from_first(obj: T | None) -> T:
    """Process 0's `obj` on every process (the others pass None)."""
    if not _spread():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def across(obj: T) -> list[T]:
    """`obj` of every process, in process order, on every process."""
    if not _spread():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
