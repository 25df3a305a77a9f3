"""The engine's cached forwards (plain steps, verifies) as CUDA graphs, one per bucket of shapes.

On a GPU a decode step of a small model is launch-bound: ~15 kernels a layer, each launched from
Python, cost more than the arithmetic (docs/performance.md, "On a GPU"). A CUDA graph replays a
whole forward's kernels in one launch, but it fixes every shape and address it captured. So a
forward's inputs are copied into static buffers of its bucket and the forward runs over those:

- rows padded up to a power of two, at most the cache's slots. A padded row feeds token 0 at
  position 0, attends only its slot's first key and writes its K/V at position 0 of a slot no
  running sequence holds (the engine keeps running sequences in slots 0..B-1), so it touches
  nothing a sequence reads; its outputs are dropped;
- attended keys padded up to a power of two (at least KEYS_MIN, at most the cache's capacity),
  the padding masked;
- new tokens a row (1 for a plain step, the tree's nodes + 1 for a verify) exact: padded tokens
  would write past the positions the engine reserves.

Every row runs in one attention call (CacheView.one_group: grouping rows by length reads the
lengths on the host, which a graph cannot). Graphs are captured lazily, the first time a bucket
is met, into one memory pool, and dropped when the cache or the weights move (their addresses are
in the graph). Where `capture` is off (a CPU) the same buckets and buffers run eagerly: that is
how the CPU suite tests everything but the capture.

Knows: buckets, static buffers, capture. Does not know: sampling, drafting, what the rows hold.

Shapes: B rows, T new tokens a row, S attended keys, V vocabulary, E hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from tailrl.kv_cache import CacheView, KVCache
from tailrl.model import Transformer

KEYS_MIN = 256  # smallest key bucket: below it a graph per doubling buys nothing measurable
T = TypeVar("T")


def bucket(n: int, least: int, most: int) -> int:
    """The smallest power-of-two multiple of `least` that holds n, capped at `most` (>= n)."""
    b = least
    while b < n:
        b *= 2
    return min(b, most)


@dataclass
class _Step:
    """One bucket's static inputs, and its outputs (the graph's, where captured)."""

    ids: torch.Tensor  # (B', T)
    positions: torch.Tensor  # (B', T)
    write_pos: torch.Tensor  # (B', T)
    mask: torch.Tensor  # (B', T, S')
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # (B', T, V)
    hidden: torch.Tensor | None = None  # (B', T, E)


class StepGraphs:
    """`forward(ids, positions, view)` as `Transformer.forward(..., return_hidden=True)` computes it,
    over the view's bucket (rows, tokens, keys), replayed as a CUDA graph where `capture`."""

    def __init__(self, model: Transformer, exact: bool, capture: bool):
        self.model, self.exact, self.capture = model, exact, capture
        self._steps: dict[tuple[int, int, int], _Step] = {}
        self._owner: tuple[int, int] | None = None  # the cache layout and weights the graphs' addresses are of
        self._pool: tuple[int, int] | None = None
        self.captures, self.capture_seconds = 0, 0.0  # graphs captured so far, and the time it took

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and hidden states of rows 0..B-1 of the cache.  # (B, T) x2 -> (B, T, V), (B, T, E)"""
        if view.first != 0:
            raise ValueError("step graphs run over the cache's first rows (the running batch)")
        cache, (b, t) = view.cache, ids.shape
        owner = (cache.layout, self.model.lm_head.weight.data_ptr())
        if owner != self._owner:
            # A new pool too: the old one goes with its last graph, and capturing into it then fails.
            self._steps.clear()
            self._owner, self._pool = owner, None
        key = (bucket(b, 1, cache.slots), t, bucket(view.kv_len, KEYS_MIN, cache.capacity))
        step = self._steps.get(key)
        fresh = step is None
        if fresh:
            step = self._steps[key] = self._buffers(*key)
        step.ids[:b] = ids
        step.positions[:b] = positions
        step.write_pos[:b] = view.write_pos
        step.write_pos[b:] = 0
        step.mask.zero_()
        step.mask[:b, :, : view.kv_len] = view.mask
        step.mask[b:, :, 0] = True
        if not self.capture:
            step.logits, step.hidden = self._run(step, cache)
            return step.logits[:b], step.hidden[:b]
        if fresh:
            self._capture(step, cache)
        step.graph.replay()
        # Copies: the next replay overwrites the graph's outputs, and callers keep hidden states.
        return step.logits[:b].clone(), step.hidden[:b].clone()

    def _buffers(self, rows: int, t: int, keys: int) -> _Step:
        device = self.model.lm_head.weight.device
        zeros = torch.zeros(rows, t, dtype=torch.long, device=device)
        return _Step(zeros, zeros.clone(), zeros.clone(), torch.zeros(rows, t, keys, dtype=torch.bool, device=device))

    def _run(self, step: _Step, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        view = CacheView(cache, 0, step.write_pos, step.mask.shape[-1], step.mask, one_group=True)
        return self.model(step.ids, step.positions, view, return_hidden=True, exact=self.exact)

    def _capture(self, step: _Step, cache: KVCache) -> None:
        t0 = time.perf_counter()
        step.graph, (step.logits, step.hidden), self._pool = capture(lambda: self._run(step, cache), step.ids.device,
                                                                     self._pool)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0


def capture(run: Callable[[], T], device: torch.device,
            pool: tuple[int, int] | None) -> tuple[torch.cuda.CUDAGraph, T, tuple[int, int]]:
    """`run` captured as a CUDA graph on `device` into `pool` (None: a new one); the graph, what `run`
    returned during the capture (the graph's outputs, rewritten by every replay) and the pool.
    `run` first runs once on a side stream: lazy initialisations must not be captured. That
    run is the captured work itself, so it must be one whose repetition changes nothing (a
    forward writing the same K/V at the same positions)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out, graph.pool()
