"""Helpers the update's tests share (test_update.py, test_update_schedule.py): groups of samples
drawn around the tiny model's log-probs, and a gradient summed group by group in a given order.
Plain functions, so no test module imports another."""

from __future__ import annotations

import random

import torch

from tailrl.rl.packing import Sample
from tailrl.rl.update import GroupGradients


def groups_of(vocab: int, sizes=(4, 4, 4, 4, 4), seed: int = 0) -> list[list[Sample]]:
    """Five groups of ragged responses, one empty (a skipped group: no reward spread). Their
    behaviour log-probs are drawn around the tiny model's (~ -log 96 = -4.6), so ratios spread
    over ~0.4-2.7: some tokens clip, some are capped."""
    rng = random.Random(seed)
    out = []
    for g, n in enumerate(sizes):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9)))
        if g == 2:
            out.append([])
            continue
        lengths = [rng.randrange(1, 12) for _ in range(n)]
        out.append([Sample(prompt, [rng.randrange(3, vocab) for _ in range(k)], rng.uniform(-1.5, 1.5),
                           [rng.uniform(-5.5, -3.5) for _ in range(k)]) for k in lengths])
    return out


def grads_of(policy) -> list[torch.Tensor]:
    return [p.grad.clone() for p in policy.parameters()]


def summed_in_order(policy, groups, cfg, order, keys=None) -> list[torch.Tensor]:
    """The gradient of `groups` added in `order`, summed by `keys` (None: by group)."""
    keys = keys or range(len(groups))
    gg = GroupGradients(policy, cfg, 0.8, len(groups))
    for g in order:
        gg.add(g, groups[g], keys[g])
    gg.finish()
    return grads_of(policy)
