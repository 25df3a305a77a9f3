"""The update group by group: the same gradient bits whatever order or thread groups finish on."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tailrl.loading import load_model
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.packing import Sample
from tailrl.rl.stream import GroupGradients, OverlappedUpdate, accumulate_gradients, by_prompt


def _groups(vocab: int, sizes=(4, 4, 4, 4, 4), seed: int = 0) -> list[list[Sample]]:
    """Five groups of ragged responses, one empty (a skipped group: no reward spread)."""
    rng = random.Random(seed)
    out = []
    for g, n in enumerate(sizes):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9)))
        if g == 2:
            out.append([])
            continue
        out.append([Sample(prompt, [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))], rng.uniform(-1.5, 1.5))
                    for _ in range(n)])
    return out


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return load_model(tiny_dir, dtype="fp32").requires_grad_(True)


def _grads(policy) -> list[torch.Tensor]:
    return [p.grad.clone() for p in policy.parameters()]


def _in_order(policy, groups, cfg, order) -> list[torch.Tensor]:
    gg = GroupGradients(policy, cfg, 0.8, len(groups))
    for g in order:
        gg.add(g, groups[g])
    gg.finish()
    return _grads(policy)


def test_any_finishing_order_gives_the_same_bits(policy):
    groups = _groups(policy.cfg.vocab_size)
    cfg = GRPOConfig(micro_batch=3)
    want = _in_order(policy, groups, cfg, range(len(groups)))
    for seed in range(4):
        order = list(range(len(groups)))
        random.Random(seed).shuffle(order)
        got = _in_order(policy, groups, cfg, order)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), order


def test_groups_computed_on_two_threads_give_the_same_bits(policy):
    groups = _groups(policy.cfg.vocab_size, seed=1)
    cfg = GRPOConfig(micro_batch=2)
    want = _in_order(policy, groups, cfg, range(len(groups)))
    gg = GroupGradients(policy, cfg, 0.8, len(groups))
    threads = [threading.Thread(target=lambda ids=ids: [gg.add(g, groups[g]) for g in ids]) for ids in ([4, 1, 0], [3, 2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gg.finish()
    assert all(torch.equal(a, b) for a, b in zip(_grads(policy), want))


def test_the_group_sum_is_the_token_mean_gradient_of_the_batch(tiny_dir):
    # fp64, so only summation order separates the two: the batch's loss built in one graph with
    # every token divided by the batch's token count, against the groups' unnormalised sums
    # divided once at the end.
    from tailrl.rl.grpo import policy_loss
    from tailrl.rl.packing import packed_logprobs

    policy = load_model(tiny_dir, dtype="fp32").double().requires_grad_(True)
    groups = _groups(policy.cfg.vocab_size, seed=2)
    samples = [s for g in groups for s in g]
    total = sum(len(s.token_ids) for s in samples)
    policy.zero_grad()
    loss = 0.0
    for s in samples:
        lp = packed_logprobs(policy, [s], 0.8)
        loss = loss + policy_loss(lp, lp.detach(), torch.full_like(lp, s.advantage), torch.ones_like(lp, dtype=torch.bool),
                                  num_tokens=total).loss
    loss.backward()
    want = _grads(policy)
    stats = accumulate_gradients(policy, samples, GRPOConfig(micro_batch=3), 0.8)
    assert stats.tokens == total and stats.loss == pytest.approx(loss.item(), abs=1e-12)
    for a, b in zip(_grads(policy), want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_overlapped_update_equals_the_synchronous_one(policy):
    groups = _groups(policy.cfg.vocab_size, seed=3)
    cfg = GRPOConfig(micro_batch=3)
    stats_sync = accumulate_gradients(policy, [s for g in groups for s in g], cfg, 0.8)
    want = _grads(policy)
    gg = GroupGradients(policy, cfg, 0.8, len(groups))
    update = OverlappedUpdate(gg)
    update.submit(3, groups[3])
    update.submit(0, groups[0])
    update.open_gate()  # the tail: the background thread computes what is queued
    update.submit(4, groups[4])
    update.close_gate()  # a burst of admissions: it stops after its current group
    update.submit(2, groups[2])
    update.submit(1, groups[1])
    update.drain()  # the rollout is over: both threads finish the rest
    stats = gg.finish()
    assert stats == stats_sync
    assert all(torch.equal(a, b) for a, b in zip(_grads(policy), want))


def test_errors_in_the_background_thread_reach_drain(policy):
    gg = GroupGradients(policy, GRPOConfig(), 0.8, 2)
    update = OverlappedUpdate(gg)
    update.open_gate()
    update.submit(5, [])  # out of range
    update.submit(0, [])
    with pytest.raises(ValueError, match="group 5 out of range"):
        update.drain()


def test_misuse_is_refused(policy):
    gg = GroupGradients(policy, GRPOConfig(), 0.8, 2)
    gg.add(0, [])
    with pytest.raises(ValueError, match="added twice"):
        gg.add(0, [])
    with pytest.raises(RuntimeError, match="not added"):
        gg.finish()
    gg.add(1, [])
    assert gg.finish().tokens == 0 and all(p.grad is None for p in policy.parameters())


def test_by_prompt_splits_adjacent_runs():
    a, b = (1, 2), (3,)
    s = [Sample(a, [5], 1.0), Sample(a, [6], -1.0), Sample(b, [7], 0.5), Sample(a, [8], 0.1)]
    assert [len(g) for g in by_prompt(s)] == [2, 1, 1]


def test_drop_truncated_keeps_the_groups_advantages_and_leaves_the_cut_response_out():
    """DAPO's overlong filtering, by hand: rewards (1, 0, 0, 0), the last response cut off at the
    length limit. Advantages come from all four, (r - 0.25) / std with std = 0.5 (unbiased), and
    only the three finished responses are trained on."""
    from tailrl.engine import Completion
    from tailrl.rl.phases import score_group
    from tailrl.rl.tasks import Problem

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "right" if ids[0] == 1 else "wrong"

    comps = [Completion((7,), [t, 5], [0.0, 0.0], reason, 0, 0) for t, reason in
             [(1, "eos"), (2, "eos"), (2, "eos"), (2, "length")]]
    problem = Problem("q", "a")
    def score(problem, text):
        return float(text == "right")
    kept = score_group(problem, comps, Tok(), score, 5.0, drop_truncated=True)
    full = score_group(problem, comps, Tok(), score, 5.0)
    assert [s.advantage for s in full.samples] == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert [s.advantage for s in kept.samples] == [s.advantage for s in full.samples[:3]]
    assert kept.rewards.rewards == full.rewards.rewards == [1.0, 0.0, 0.0, 0.0]
