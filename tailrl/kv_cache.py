"""The KV cache of tailrl's decoder (tailrl.model) and what one forward reads of it.

`KVCache`: preallocated keys and values, C slots x M positions, a tensor per layer, M in whole
KV_CHUNKs (exact mode's attention reads keys in chunks of that many). `CacheView`: the rows one
forward reads and writes, where its new tokens go and which keys each may attend, with what
every layer's attention derives from that once per forward: the row groups the non-exact
attention calls SDPA on (`row_segments`: fewer keys read against more calls), and each token's
key count for the decode kernel.

Knows: the cache layout (slot, kv head, position, dim), masks, the cost of an attention call in
key rows. Does not know: the architecture past its sizes, the engines that own a cache, sampling.

Shapes: B batch rows, T new tokens, S key positions, K kv heads, D head dim, C cache slots,
M cache capacity (tokens).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from tailrl import memory

KV_CHUNK = 128  # keys per attention matmul in exact mode, see tailrl.model's chunked_qk and chunked_pv
_LAYOUTS = itertools.count()  # tags KVCache.layout
# What one more attention call costs, in key rows read (one row's keys for every kv head): an
# SDPA call's fixed cost over its cost per key row, measured in docs/performance.md.
SEGMENT_COST_KEYS = 160


class CacheShape(Protocol):
    """What the cache needs of a model's config (tailrl.model.ModelConfig has it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVCache:
    """Preallocated keys/values: C slots x M positions, one tensor per layer.  k[l], v[l]: (C, K, M, D)

    A sequence owns one slot; the engine keeps running sequences in slots 0..B-1 so a batch's
    cache is a view, never a gather. A tensor per layer, so that `resize` holds the old and the
    new cache together for one layer at a time, not whole.
    """

    def __init__(self, cfg: CacheShape, slots: int, capacity: int, dtype: torch.dtype, device: torch.device | str):
        self.slots, self.capacity = slots, whole_chunks(capacity)
        # Unique to this cache's tensors, new at every resize: what holds their addresses (a CUDA
        # graph, tailrl.step_graphs) checks it. An object's id and a tensor's address can recur.
        self.layout = next(_LAYOUTS)
        self.k = [self._empty(cfg, dtype, device) for _ in range(cfg.num_layers)]
        self.v = [self._empty(cfg, dtype, device) for _ in range(cfg.num_layers)]

    def _empty(self, cfg: CacheShape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        # Zeros (exact mode's chunked_pv multiplies unwritten positions by 0), resident as written.
        return memory.lazy_zeros((self.slots, cfg.num_kv_heads, self.capacity, cfg.head_dim), dtype, device)

    @staticmethod
    def bytes_per_token(cfg: CacheShape, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for kv in (*self.k, *self.v):
            kv[dst, :, :length] = kv[src, :, :length]

    def resize(self, slots: int, capacity: int, keep: int, length: int) -> None:
        """Reallocate to `slots` x `capacity` (whole chunks, lazily zeroed as the first cache: resident
        where kept or written), keeping the first `length` positions of slots 0..keep-1."""
        capacity = whole_chunks(capacity)
        if keep > slots or length > capacity:
            raise ValueError(f"cannot keep {keep} slots x {length} positions in {slots} x {capacity}")
        for kvs in (self.k, self.v):
            for layer, old in enumerate(kvs):
                new = memory.lazy_zeros((slots, old.shape[1], capacity, old.shape[3]), old.dtype, old.device)
                new[:keep, :, :length] = old[:keep, :, :length]
                kvs[layer] = new  # the old layer's memory goes before the next layer's is allocated
        self.slots, self.capacity, self.layout = slots, capacity, next(_LAYOUTS)


def row_segments(keys: Sequence[int], cost: int) -> list[tuple[int, int, int]]:
    """Split rows 0..B-1 into consecutive ranges [i, j), each attending the first max(keys[i:j])
    keys, to minimise sum((j - i) * max(keys[i:j]) + cost): the key rows read (masked ones
    included) plus `cost` key rows' worth per extra attention call. Exact dynamic programme over
    the cut points (a numpy pass per row: B is at most a few hundred).  -> [(i, j, keys)]"""
    k = np.asarray(keys, dtype=np.int64)
    best = np.zeros(len(k) + 1, dtype=np.int64)
    cut = np.zeros(len(k) + 1, dtype=np.int64)
    for j in range(1, len(k) + 1):
        longest = np.maximum.accumulate(k[j - 1 :: -1])  # max(keys[i:j]) for i = j-1 .. 0
        total = best[j - 1 :: -1] + cost + np.arange(1, j + 1) * longest
        at = int(total.argmin())
        best[j], cut[j] = total[at], j - 1 - at
    out, j = [], len(k)
    while j > 0:
        i = int(cut[j])
        out.append((i, j, int(k[i:j].max())))
        j = i
    return out[::-1]


def whole_chunks(positions: int) -> int:
    """Positions rounded up to whole KV_CHUNKs, so chunked_pv never copies the values to pad them."""
    return -(-positions // KV_CHUNK) * KV_CHUNK


@dataclass
class CacheView:
    """What one forward reads and writes: rows `first..first+B` of the cache.

    write_pos (B, T): cache index each new token's K/V goes to. kv_len: keys attended (S).
    mask (B, T, S): True where a query may attend a key.
    The derived tensors below are built once per forward and shared by every layer.
    """

    cache: KVCache
    first: int
    write_pos: torch.Tensor  # (B, T)
    kv_len: int
    mask: torch.Tensor  # (B, T, S)
    # Every row in one attention call over kv_len keys, decided without reading the mask on the
    # host (a captured forward, tailrl.step_graphs, cannot).
    one_group: bool = False

    @cached_property
    def hidden_keys(self) -> torch.Tensor:
        """Where a query may not attend, shaped to broadcast over scores.  # (B, 1, 1, T, S)"""
        return ~self.mask[:, None, None]

    @cached_property
    def segments(self) -> list[tuple[int, int, int, torch.Tensor | None]]:
        """The non-exact attention's groups of consecutive rows (`row_segments`): (first row, end
        row, keys S' (the group's longest row), mask (B', T, S') or None where every query
        attends every key)."""
        if self.one_group:
            return [(0, self.mask.shape[0], self.kv_len, self.mask)]
        keys = (self.kv_len - self.mask.any(1).flip(-1).int().argmax(-1)).tolist()  # (B,) last attended key + 1
        out = []
        for i, j, s in row_segments(keys, SEGMENT_COST_KEYS):
            m = self.mask[i:j, :, :s]
            out.append((i, j, s, None if bool(m.all()) else m))
        return out

    @cached_property
    def token_keys(self) -> torch.Tensor | None:
        """Where every new token's mask is a prefix of the keys (a plain step's, a chain verify's):
        each token's key count, for the decode kernel (tailrl.decode_kernels); else None (a
        tree's verify, a padded prefill).  # (B, T) int32"""
        count = self.mask.sum(-1)  # (B, T)
        last = self.kv_len - self.mask.flip(-1).int().argmax(-1)  # last attended key + 1
        return count.to(torch.int32) if bool((count == last).all()) else None

    @cached_property
    def rows(self) -> torch.Tensor:
        """Each new token's row in the view, beside write_pos for indexing the cache.  # (B, T)"""
        b, t = self.write_pos.shape
        return torch.arange(b, device=self.write_pos.device).unsqueeze(1).expand(b, t)
