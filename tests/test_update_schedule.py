"""When the update computes each group: in the rollout's tail only while its buffers fit the cap,
the groups next in the summing order first and into the sum, as the rollout's progress shows
them next; after the rollout one group at a time on the caller's torch threads; the same
gradient bits whatever the schedule."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from update_helpers import grads_of, groups_of, summed_in_order

from tailrl.loading import load_model
from tailrl.rl import update as update_mod
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.update import BackgroundUpdate, GroupGradients


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return load_model(tiny_dir, dtype="fp32").requires_grad_(True)


class _Watched(GroupGradients):
    """GroupGradients that records the buffers waiting after every group it adds, and for every
    group the groups being computed beside it, the thread and its torch thread count."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting: list[int] = []
        self.added_groups: list[int] = []
        self.computing, self.most_computing = 0, 0
        self.where: list[tuple[threading.Thread, int]] = []
        self._count = threading.Lock()

    def add(self, group, samples, key):
        with self._count:
            self.computing += 1
            self.most_computing = max(self.most_computing, self.computing)
            self.where.append((threading.current_thread(), torch.get_num_threads()))
        try:
            super().add(group, samples, key)
        finally:
            with self._count:
                self.computing -= 1
        self.waiting.append(self.held_buffers)
        self.added_groups.append(group)


def _settle(update: BackgroundUpdate) -> None:
    """Wait until the background thread may compute nothing more now."""
    deadline = time.monotonic() + 120  # guards a hang only
    while update.has_work:
        assert time.monotonic() < deadline, "the background thread did not settle"
        time.sleep(0.01)


@pytest.mark.parametrize("cap", [0, 1, 2])
def test_groups_whose_buffers_would_wait_past_the_cap_are_computed_later_with_the_same_bits(policy, cap):
    groups = groups_of(policy.cfg.vocab_size, sizes=(2,) * 8, seed=4)  # group 2 has no samples
    cfg = GRPOConfig(micro_batch=2, waiting_gradients=cap)
    want = summed_in_order(policy, groups, cfg, range(len(groups)))
    gg = _Watched(policy, cfg, 0.8, len(groups))
    update = BackgroundUpdate(gg)
    update.open_gate()  # the tail: every group is computed as it finishes, if it may be
    for g in (7, 5, 6, 3, 4, 1):  # the worst order for the tree: every buffer waits for group 0
        update.submit(g, groups[g], g)
        _settle(update)
    # While the rollout runs no more than `cap` buffers wait: the rest stay queued.
    assert max(gg.waiting, default=0) <= cap and len(gg.waiting) < 6
    deferred = 6 - len(gg.waiting)
    update.submit(0, groups[0], 0)  # the group every other one waits for
    update.submit(2, groups[2], 2)
    update.drain()
    gg.finish()
    assert all(torch.equal(a, b) for a, b in zip(grads_of(policy), want))
    assert len(gg.waiting) == 8 and deferred > 0


def test_after_the_rollout_one_thread_computes_one_group_at_a_time_on_the_callers_torch_threads(policy):
    # Two groups at once held two groups' activations in two malloc arenas, and each, picked as
    # if the other were not there, let the buffers waiting pass the cap (docs/memory.md). One at
    # a time in the summing order (distinct keys: a left fold), only the running sum waits.
    groups = groups_of(policy.cfg.vocab_size, sizes=(2,) * 8, seed=5)
    cfg = GRPOConfig(micro_batch=2, waiting_gradients=2)
    keys = [3, 1, 4, 0, 6, 2, 7, 5]
    want = summed_in_order(policy, groups, cfg, range(len(groups)), keys)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gg = _Watched(policy, cfg, 0.8, len(groups))
        update = BackgroundUpdate(gg)
        update.open_gate()  # the tail: the background thread computes on one torch thread
        update.submit(6, groups[6], keys[6])
        _settle(update)
        update.close_gate()
        for g in (7, 5, 3, 4, 1, 0, 2):  # left to the drain
            update.submit(g, groups[g], keys[g])
        update.drain()
    finally:
        torch.set_num_threads(threads)
    gg.finish()
    assert all(torch.equal(a, b) for a, b in zip(grads_of(policy), want))
    assert gg.most_computing == 1 and max(gg.waiting) <= 2
    (thread,) = {t for t, _ in gg.where}
    assert thread is not threading.current_thread() and [n for _, n in gg.where] == [1] + [2] * 7


def test_bounds_from_the_rollout_let_its_tail_compute_each_group_as_it_finishes(policy):
    # Groups finishing in the summing order (by their longest response): told that every
    # response still decoding is longer than the group just finished (the rollout's progress),
    # the tail computes each group as it finishes, and only the running sum waits. Not told, a
    # finished group could still be preceded by any unfinished one, so with a cap of 1 the tail
    # computes one group (and the empty group 2, which holds no buffer) until the last group's
    # key is known. The same bits either way.
    groups = groups_of(policy.cfg.vocab_size, sizes=(2,) * 6, seed=6)
    keys = [50, 10, 40, 20, 60, 30]
    cfg = GRPOConfig(micro_batch=2, waiting_gradients=1)
    want = summed_in_order(policy, groups, cfg, range(len(groups)), keys)
    computed = {}
    for told in (False, True):
        gg = _Watched(policy, cfg, 0.8, len(groups))
        update = BackgroundUpdate(gg)
        update.open_gate()
        computed[told] = []
        for g in sorted(range(len(groups)), key=keys.__getitem__):
            update.submit(g, groups[g], keys[g])
            if told:
                update.floor(keys[g] + 1)
            _settle(update)
            computed[told].append(len(gg.waiting))
        update.drain()
        gg.finish()
        assert all(torch.equal(a, b) for a, b in zip(grads_of(policy), want))
        assert max(gg.waiting) <= 1
    assert computed == {False: [1, 1, 1, 2, 2, 6], True: [1, 2, 3, 4, 5, 6]}


def test_the_tail_computes_the_groups_next_in_the_summing_order_before_a_costlier_one(policy, monkeypatch):
    # Finished groups queued while the rollout kept its cores (keys 10-40; group 4, key 60, the
    # most tokens), then the tail: every group still decoding is longer than 45. Under a cap of 1
    # the next groups in the order go first, each added to the sum as its backward produces it
    # (no buffer of its own); group 4 would wait for group 0 (key 50, still decoding), so it
    # stays queued. Taken first for its cost, it would have waited and blocked the rest.
    groups = groups_of(policy.cfg.vocab_size, sizes=(2, 2, 2, 2, 8, 2), seed=7)
    keys = [50, 10, 40, 20, 60, 30]
    tokens = [sum(len(s.prompt_ids) + len(s.token_ids) for s in g) for g in groups]
    assert max(range(6), key=tokens.__getitem__) == 4
    cfg = GRPOConfig(micro_batch=2, waiting_gradients=1)
    want = summed_in_order(policy, groups, cfg, range(len(groups)), keys)
    into_sum = []
    share = update_mod.group_share

    def spy(policy, samples, *args):
        into_sum.append(args[-1] is not None)
        return share(policy, samples, *args)

    monkeypatch.setattr(update_mod, "group_share", spy)
    gg = _Watched(policy, cfg, 0.8, len(groups))
    update = BackgroundUpdate(gg)
    for g in (4, 1, 3, 5, 2):
        update.submit(g, groups[g], keys[g])
    update.floor(45)
    update.open_gate()
    _settle(update)
    assert gg.added_groups == [2, 1, 3, 5] and gg.waiting == [0, 1, 1, 1]  # the empty group first: it holds nothing
    assert into_sum == [True] * 3
    update.submit(0, groups[0], keys[0])
    update.drain()
    gg.finish()
    assert all(torch.equal(a, b) for a, b in zip(grads_of(policy), want))
    assert into_sum == [True] * 5  # after the rollout, in the order: every group into the sum
