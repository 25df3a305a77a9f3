"""The learned drafter's chain: its loop, and the loop as CUDA graphs, one per bucket of shapes.

A chain of n drafts is the root forward (each row's missing entries caught up, then its root
entry: DrafterProposer) and n - 1 drafter forwards of one entry a row, each a layer and the draft
head (`draft_chain`). On a GPU those are small kernels launched from Python, costlier than their
arithmetic, as the target's steps were (tailrl.step_graphs, whose buckets this follows). The
root forward stays eager (its entry count varies); from its output on, `ChainGraphs` runs the
loop over static buffers of its bucket:

- rows padded to a power of two within the drafter cache's slots. A padded row starts from a
  zero output at length 0, so its entries go to positions 0..n-2 of a slot no running sequence
  holds; the proposer forgets that slot's entries;
- attended keys to a power of two (at least KEYS_MIN) within the cache's capacity, the rest masked;
- draft tokens exact.

Where `capture` is off (a CPU) the same buckets run eagerly: the suite's test of everything
but the capture.

Knows: the chain loop, its buckets, capture. Does not know: the root forward, trees, acceptance.

Shapes: B rows, E hidden size, K draft vocabulary, S attended keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from tailrl.kv_cache import CacheView, KVCache
from tailrl.step_graphs import KEYS_MIN, bucket, capture


class ChainDrafter(Protocol):
    """What the loop needs of a drafter (tailrl.speculative.drafter.model.Drafter has it)."""

    d2t: torch.Tensor  # (K,) draft index -> target id
    fc: torch.nn.Module

    def __call__(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                 view: CacheView | None = None) -> torch.Tensor: ...

    def logits(self, pred: torch.Tensor) -> torch.Tensor: ...


def top_drafts(drafter: ChainDrafter, out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft log-probs and their draft indices.  # (B, F, E) -> (B, F, k) each"""
    return torch.log_softmax(drafter.logits(out).float(), dim=-1).topk(k, dim=-1)


def draft_chain(drafter: ChainDrafter, cache: KVCache, out: torch.Tensor, lens: torch.Tensor, n: int, keys: int,
                one_group: bool = False) -> torch.Tensor:
    """A chain's n draft tokens from the root entries' outputs `out`: each the drafter's top-1
    after its parent. (build_tree would draft draft_depth >= n and keep the n best, which on a
    chain, where scores never rise along it and ties go to the earlier node, are the first n: so
    n - 1 forwards after the root's suffice.) Node s (s >= 1) is entry L_b - 1 + s at scratch
    index L_b + s - 1 and sees every key before its own: the prefix, the root entry and its
    ancestors, i.e. the same keys and cache writes as the tree's forwards. Every forward's view
    spans the first `keys` cache positions (at least max L_b + n - 1), the rest masked; `one_group`: in
    one attention call (a captured loop: tailrl.speculative.drafter.chain_graphs).
    # (B, 1, E), (B,) -> (B, n) target ids"""
    nodes = [drafter.d2t[top_drafts(drafter, out, 1)[1]][:, 0]]  # (B, 1) each
    positions = torch.arange(keys, device=lens.device)[None, None]  # (1, 1, S)
    for s in range(1, n):
        at = lens[:, None] + (s - 1)  # (B, 1) its scratch index, equal to its position L_b - 1 + s
        view = CacheView(cache, 0, at, keys, positions <= at[:, :, None], one_group=one_group)
        out = drafter(out, nodes[-1], at, view)
        nodes.append(drafter.d2t[top_drafts(drafter, out, 1)[1]][:, 0])
    return torch.cat(nodes, 1)


@dataclass
class _Loop:
    """One bucket's static inputs and, where captured, its graph and output."""

    out: torch.Tensor  # (B', 1, E) the root entries' outputs
    lens: torch.Tensor  # (B',) root positions L_b
    graph: torch.cuda.CUDAGraph | None = None
    nodes: torch.Tensor | None = None  # (B', n)


class ChainGraphs:
    """`draft_chain` over the bucket of (rows, draft tokens, keys), replayed as a CUDA graph where
    `capture`. Graphs are dropped when the drafter's cache is reallocated or its weights move."""

    def __init__(self, drafter: ChainDrafter, capture: bool):
        self.drafter, self.capture = drafter, capture
        self._loops: dict[tuple[int, int, int], _Loop] = {}
        self._owner: tuple[int, int] | None = None
        self._pool: tuple[int, int] | None = None
        self.captures, self.capture_seconds = 0, 0.0

    def draft(self, cache: KVCache, out: torch.Tensor, lens: torch.Tensor, keys: int,
              n: int) -> tuple[torch.Tensor, int]:
        """The chains' draft tokens, and the rows the bucket ran (padded rows' slots were written).
        keys: the positions the loop may attend (>= max L_b + n - 1).  # (B, 1, E), (B,) -> (B, n)"""
        b = out.shape[0]
        owner = (cache.layout, self.drafter.fc.weight.data_ptr())
        if owner != self._owner:
            self._loops.clear()
            self._owner, self._pool = owner, None
        key = (bucket(b, 1, cache.slots), n, bucket(keys, KEYS_MIN, cache.capacity))
        loop = self._loops.get(key)
        fresh = loop is None
        if fresh:
            loop = self._loops[key] = _Loop(out.new_zeros(key[0], 1, out.shape[-1]),
                                            lens.new_zeros(key[0]))
        loop.out[:b] = out
        loop.out[b:] = 0
        loop.lens[:b] = lens
        loop.lens[b:] = 0
        if not self.capture:
            return draft_chain(self.drafter, cache, loop.out, loop.lens, n, key[2], one_group=True)[:b], key[0]
        if fresh:
            t0 = time.perf_counter()
            run = lambda: draft_chain(self.drafter, cache, loop.out, loop.lens, n, key[2], one_group=True)  # noqa: E731
            loop.graph, loop.nodes, self._pool = capture(run, out.device, self._pool)
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        loop.graph.replay()
        return loop.nodes[:b].clone(), key[0]
