"""The update group by group: the same gradient bits whatever order or thread groups finish on;
the importance ratio against the rollout engine's own log-probs, end to end."""

from __future__ import annotations

import random
import threading
import weakref

import pytest
import torch
from update_helpers import grads_of, groups_of, summed_in_order

from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model
from tailrl.records import Completion, Request
from tailrl.rl import gradients as gradients_mod, share as share_mod
from tailrl.rl.gradients import GradientSink
from tailrl.rl.grpo import GRPOConfig, chunked_logprobs, sequence_logprobs
from tailrl.rl.packing import ON_POLICY, Sample, pack_tokens, packed_logprobs, packs
from tailrl.rl.share import group_share
from tailrl.rl.update import BackgroundUpdate, GroupGradients, accumulate_gradients, by_prompt
from tailrl.sampling import SamplingParams


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return load_model(tiny_dir, dtype="fp32").requires_grad_(True)


@pytest.mark.parametrize("keys", [None, [3, 1, 2, 1, 0]])  # the summing order: by group, by key (group_key)
def test_any_finishing_order_gives_the_same_bits(policy, keys):
    groups = groups_of(policy.cfg.vocab_size)
    cfg = GRPOConfig(micro_batch=3)
    want = summed_in_order(policy, groups, cfg, range(len(groups)), keys)
    for seed in range(4):
        order = list(range(len(groups)))
        random.Random(seed).shuffle(order)
        got = summed_in_order(policy, groups, cfg, order, keys)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), order


def test_groups_computed_on_two_threads_give_the_same_bits(policy):
    groups = groups_of(policy.cfg.vocab_size, seed=1)
    cfg = GRPOConfig(micro_batch=2)
    want = summed_in_order(policy, groups, cfg, range(len(groups)))
    gg = GroupGradients(policy, cfg, 0.8, len(groups))

    def add(ids: list[int]) -> None:
        for g in ids:
            gg.add(g, groups[g], g)

    threads = [threading.Thread(target=add, args=(ids,)) for ids in ([4, 1, 0], [3, 2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gg.finish()
    assert all(torch.equal(a, b) for a, b in zip(grads_of(policy), want))


def test_the_group_sum_is_the_token_mean_gradient_of_the_batch(tiny_dir):
    # fp64, so only summation order separates the two: the batch's loss built in one graph with
    # every token divided by the batch's token count, against the groups' unnormalised sums
    # divided once at the end.
    from tailrl.rl.grpo import policy_loss

    policy = load_model(tiny_dir, dtype="fp32").double().requires_grad_(True)
    groups = groups_of(policy.cfg.vocab_size, seed=2)
    samples = [s for g in groups for s in g]
    total = sum(len(s.token_ids) for s in samples)
    policy.zero_grad()
    loss = 0.0
    for s in samples:
        lp = packed_logprobs(policy, [s], 0.8)
        behaviour = torch.tensor([s.behaviour_logprobs], dtype=lp.dtype)
        loss = loss + policy_loss(lp, behaviour, torch.full_like(lp, s.advantage),
                                  torch.ones_like(lp, dtype=torch.bool), num_tokens=total).loss
    loss.backward()
    want = grads_of(policy)
    stats = accumulate_gradients(policy, samples, GRPOConfig(micro_batch=3), 0.8)
    assert stats.tokens == total and stats.loss == pytest.approx(loss.item(), abs=1e-12)
    assert stats.clip_fraction > 0 and stats.capped_fraction > 0  # every branch of the loss is in the sum
    for a, b in zip(grads_of(policy), want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_overlapped_update_equals_the_synchronous_one(policy):
    groups = groups_of(policy.cfg.vocab_size, seed=3)
    cfg = GRPOConfig(micro_batch=3)
    sync = GroupGradients(policy, cfg, 0.8, len(groups))  # the step's groups, the skipped one too: the tree's leaves
    for g, group in enumerate(groups):
        sync.add(g, group, g)
    stats_sync = sync.finish()
    want = grads_of(policy)
    gg = GroupGradients(policy, cfg, 0.8, len(groups))
    update = BackgroundUpdate(gg)
    update.submit(3, groups[3], 3)
    update.submit(0, groups[0], 0)
    update.open_gate()  # the tail: the background thread computes what is queued
    update.submit(4, groups[4], 4)
    update.close_gate()  # a burst of admissions: it stops after its current group
    update.submit(2, groups[2], 2)
    update.submit(1, groups[1], 1)
    update.drain()  # the rollout is over: both threads finish the rest
    stats = gg.finish()
    assert stats == stats_sync
    assert all(torch.equal(a, b) for a, b in zip(grads_of(policy), want))


def test_errors_in_the_background_thread_reach_drain(policy):
    gg = GroupGradients(policy, GRPOConfig(), 0.8, 2)
    update = BackgroundUpdate(gg)
    update.open_gate()
    update.submit(5, [], 5)  # out of range
    update.submit(0, [], 0)
    with pytest.raises(ValueError, match="group 5 out of range"):
        update.drain()


def test_misuse_is_refused(policy):
    gg = GroupGradients(policy, GRPOConfig(), 0.8, 2)
    gg.add(0, [], 0)
    with pytest.raises(ValueError, match="put twice"):
        gg.add(0, [], 0)
    with pytest.raises(RuntimeError, match="not added"):
        gg.finish()
    gg.add(1, [], 1)
    assert gg.finish().tokens == 0 and all(p.grad is None for p in policy.parameters())


def test_by_prompt_splits_adjacent_runs():
    a, b = (1, 2), (3,)
    s = [Sample(a, [5], 1.0, ON_POLICY), Sample(a, [6], -1.0, ON_POLICY), Sample(b, [7], 0.5, ON_POLICY),
         Sample(a, [8], 0.1, ON_POLICY)]
    assert [len(g) for g in by_prompt(s)] == [2, 1, 1]


def test_a_sample_needs_one_behaviour_logprob_per_token_or_none():
    assert Sample((1,), [5, 6], 1.0, ON_POLICY).behaviour_logprobs == ()
    with pytest.raises(ValueError, match="behaviour_logprobs has 1 entries for 2 response tokens"):
        Sample((1,), [5, 6], 1.0, [-0.5])


def test_drop_truncated_keeps_the_groups_advantages_and_leaves_the_cut_response_out():
    """DAPO's overlong filtering, by hand: rewards (1, 0, 0, 0), the last response cut off at the
    length limit. Advantages come from all four, (r - 0.25) / std with std = 0.5 (unbiased), and
    only the three finished responses are trained on."""
    from tailrl.rl.phases import score_group
    from tailrl.rl.tasks import Problem

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "right" if ids[0] == 1 else "wrong"

    comps = [Completion((7,), [t, 5], [-0.5, -0.25], reason, 0, 0) for t, reason in
             [(1, "eos"), (2, "eos"), (2, "eos"), (2, "length")]]
    problem = Problem("q", "a")
    def score(problem, text):
        return float(text == "right")
    kept = score_group(problem, comps, Tok(), score, 5.0, drop_truncated=True)
    full = score_group(problem, comps, Tok(), score, 5.0)
    assert [s.advantage for s in full.samples] == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert [s.advantage for s in kept.samples] == [s.advantage for s in full.samples[:3]]
    assert kept.rewards.rewards == full.rewards.rewards == [1.0, 0.0, 0.0, 0.0]
    assert all(s.behaviour_logprobs == [-0.5, -0.25] for s in full.samples)  # the engine's, for the ratio


# ---- the importance ratio against the rollout engine's log-probs ---------------------------------

TEMPERATURE = 0.8


def _rollout(model) -> list[Completion]:
    """Four groups of four 12-token responses sampled by the engine on `model`, which records
    each token's log-prob (the behaviour policy's)."""
    rng = random.Random(0)
    requests = []
    for g in range(4):
        prompt = tuple(rng.randrange(3, 96) for _ in range(rng.randrange(3, 9)))
        requests += [Request(prompt, seed=100 * g + j, group=g) for j in range(4)]
    return Engine(model, EngineConfig(max_batch=16)).generate(requests, SamplingParams(temperature=TEMPERATURE), 12)


def _samples(completions: list[Completion], behaviour: bool = True) -> list[Sample]:
    """The responses with fixed advantages of both signs; their engine log-probs, or ON_POLICY."""
    rng = random.Random(1)
    return [Sample(c.prompt_ids, c.token_ids, rng.uniform(-1.5, 1.5), c.logprobs if behaviour else ON_POLICY)
            for c in completions]


def _flat_grad(policy) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in policy.parameters()])


def test_an_fp32_rollout_of_the_trainers_own_model_gives_ratio_one_and_the_on_policy_gradient(policy):
    """The engine samples with the trainer's own fp32 weights: its recorded log-probs differ from
    the trainer's recompute only by kernel rounding (KV-cached decode steps against one packed
    forward; ~1e-6 here), so every ratio is 1 to rounding and nothing is clipped or capped. Each
    token's gradient term is its on-policy term (ratio 1, today's loss) times its ratio, so the
    gradient moves by the ratio's rounding: 1e-5 relative leaves an order of magnitude of margin
    (measured: 2e-7) while a single clipped token would move it by percents."""
    cfg = GRPOConfig(micro_batch=4, autocast="fp32")
    completions = _rollout(policy)
    stats = accumulate_gradients(policy, _samples(completions), cfg, TEMPERATURE)
    got = _flat_grad(policy)
    on_policy = accumulate_gradients(policy, _samples(completions, behaviour=False), cfg, TEMPERATURE)
    want = _flat_grad(policy)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5) and abs(stats.ratio_max - 1.0) < 1e-5
    assert stats.clip_fraction == stats.capped_fraction == 0.0 and 0.0 <= stats.mismatch_kl < 1e-10
    assert on_policy.ratio_mean == on_policy.ratio_max == 1.0  # ON_POLICY: exactly 1 by definition
    assert stats.tokens == on_policy.tokens == 16 * 12
    assert (got - want).norm() / want.norm() < 1e-5


def test_the_clip_range_changes_the_update_only_where_rollout_and_trainer_differ(policy, tiny_dir):
    """A bf16 copy of the policy samples with log-probs a few 1e-3 off the fp32 trainer's; a clip
    range below that (0.001) clips some tokens and changes the gradient. The fp32 policy itself
    samples within rounding (~1e-6) of the trainer: neither range binds, and the gradient has the
    same bits whichever is set."""
    cases = {"bf16": load_model(tiny_dir, dtype="bf16"), "fp32": policy}
    for dtype, model in cases.items():
        samples = _samples(_rollout(model))
        stats, grads = {}, {}
        for clip in (0.2, 0.001):
            cfg = GRPOConfig(micro_batch=4, autocast="fp32", clip_low=clip)
            stats[clip] = accumulate_gradients(policy, samples, cfg, TEMPERATURE)
            grads[clip] = _flat_grad(policy)
        if dtype == "bf16":
            assert stats[0.001].clip_fraction > 0 and stats[0.2].clip_fraction == 0
            assert (grads[0.001] - grads[0.2]).abs().max() > 1e-4 * grads[0.2].abs().max()
        else:
            assert stats[0.001].clip_fraction == stats[0.2].clip_fraction == 0
            assert torch.equal(grads[0.001], grads[0.2])


def test_ratio_statistics_are_the_token_means_of_the_data(policy):
    """Behaviour log-probs = the trainer's own + scale * a fixed noise (scale 0: the trainer
    sampled). Each step's statistics must equal those computed by hand from the per-token log
    ratios, and grow with the mismatch: ratio 1 and nothing clipped at scale 0, more tokens
    clipped (A > 0 with ratio > 1.2, A < 0 with ratio < 0.8), capped (ratio > 2) and a larger
    KL estimate as the scale grows."""
    cfg = GRPOConfig(micro_batch=4, autocast="fp32")  # packs = the groups of four, as computed below
    base = _samples(_rollout(policy))
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        own = [packed_logprobs(policy, base[g : g + 4], TEMPERATURE)[0] for g in range(0, 16, 4)]  # 4 x (48,)
    own = torch.cat(own)  # (N,)
    e = torch.randn(own.shape, generator=noise)
    adv = torch.tensor([s.advantage for s in base for _ in s.token_ids])  # (N,)
    seen = []
    for scale in (0.0, 0.3, 1.0):
        behaviour = own + scale * e  # (N,)
        per_sample = torch.split(behaviour, [len(s.token_ids) for s in base])
        samples = [Sample(s.prompt_ids, s.token_ids, s.advantage, b.tolist()) for s, b in zip(base, per_sample)]
        stats = accumulate_gradients(policy, samples, cfg, TEMPERATURE)
        log_r = own - behaviour
        r = log_r.exp()
        clipped = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
        want = dict(ratio_mean=r.mean(), ratio_max=r.max(), clip_fraction=clipped.double().mean(),
                    capped_fraction=(r > 2.0).double().mean(), mismatch_kl=(r - 1 - log_r).mean())
        for name, value in want.items():
            assert getattr(stats, name) == pytest.approx(float(value), rel=1e-5, abs=1e-9), (scale, name)
        seen.append(stats)
    assert seen[0].ratio_mean == seen[0].ratio_max == 1.0 and seen[0].clip_fraction == seen[0].mismatch_kl == 0.0
    assert seen[0].clip_fraction < seen[1].clip_fraction < seen[2].clip_fraction
    assert seen[1].capped_fraction < seen[2].capped_fraction
    assert seen[0].mismatch_kl < seen[1].mismatch_kl < seen[2].mismatch_kl
    assert seen[1].ratio_max < seen[2].ratio_max


# ---- memory flat in response length ----------------------------------------------------------------


def test_packs_close_at_the_response_count_or_the_token_budget():
    a, b = (1, 2, 3), (4, 5)
    s = [Sample(a, [0] * 5, 0.0, ON_POLICY), Sample(a, [0] * 5, 0.0, ON_POLICY), Sample(a, [0] * 20, 0.0, ON_POLICY),
         Sample(b, [0] * 3, 0.0, ON_POLICY), Sample(b, [0] * 3, 0.0, ON_POLICY)]
    # Tokens: [a 5 5] = 3 + 10 = 13; + the 20-token response would be 33 > 20; it alone is 23 > 20
    # (its own pack); [b 3 3] = 2 + 6 = 8.
    assert [len(p) for p in packs(s, 4, 20)] == [2, 1, 2]
    assert [pack_tokens(p) for p in packs(s, 4, 20)] == [13, 23, 8]
    assert [len(p) for p in packs(s, 2, 1000)] == [2, 2, 1]
    assert [len(p) for p in packs(s, 4, 1000)] == [4, 1]


def test_chunked_logprobs_and_their_gradients_are_the_full_logits(tiny_dir):
    """fp64, so that only the rounding of two summation orders separates them: each logit is one
    dot product of E = 64 terms (relative error <= 64 u, u = 2^-53 ~ 1.1e-16, so ~7e-15), and the
    gradients sum such products over N rows and V columns; 1e-12 relative is 100x that headroom."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(37, 64, dtype=torch.float64, generator=gen, requires_grad=True)  # (N, E)
    w = torch.randn(96, 64, dtype=torch.float64, generator=gen, requires_grad=True)  # (V, E)
    t = torch.randint(0, 96, (37,), generator=gen)
    g = torch.randn(37, dtype=torch.float64, generator=gen)
    want = sequence_logprobs(torch.nn.functional.linear(h, w)[None], t[None], 0.7)[0]
    want_h, want_w = torch.autograd.grad((want * g).sum(), (h, w))
    for chunk in (1, 8, 37, 64):
        got = chunked_logprobs(h, w, t, 0.7, chunk)
        got_h, got_w = torch.autograd.grad((got * g).sum(), (h, w))
        for x, y in ((got, want), (got_h, want_h), (got_w, want_w)):
            assert torch.allclose(x, y, rtol=1e-12, atol=1e-12 * y.abs().max().item())


def test_a_chunked_and_checkpointed_update_is_the_ordinary_one(tiny_dir):
    """The whole update with every memory setting forced on (log-probs 3 tokens at a time, every
    pack checkpointed, packs of at most 24 tokens), against the ordinary update of the same
    micro-batches, in fp64 (bound as above); checkpointing alone recomputes each layer with the
    same shapes, so in fp32 it gives the same bits. autocast fp32: where bf16 is native, "auto"
    would run the products in bf16 and the two updates would differ by bf16 rounding."""
    groups = groups_of(96)
    plain = GRPOConfig(micro_batch=3, micro_batch_tokens=24, autocast="fp32")
    flat = GRPOConfig(micro_batch=3, micro_batch_tokens=24, logprob_chunk=3, checkpoint_tokens=1, autocast="fp32")
    policy64 = load_model(tiny_dir, dtype="fp32").double().requires_grad_(True)
    want, got = (summed_in_order(policy64, groups, cfg, range(len(groups))) for cfg in (plain, flat))
    assert all(torch.allclose(x, y, rtol=1e-12, atol=1e-12 * y.abs().max().item()) for x, y in zip(got, want))
    policy = load_model(tiny_dir, dtype="fp32").requires_grad_(True)
    checkpointed = GRPOConfig(micro_batch=3, micro_batch_tokens=24, checkpoint_tokens=1, autocast="fp32")
    want, got = (summed_in_order(policy, groups, cfg, range(len(groups))) for cfg in (plain, checkpointed))
    assert all(torch.equal(x, y) for x, y in zip(got, want))


class SavedForBackward:
    """Bytes of the tensors autograd keeps for the backward (saved_tensors_hooks), the peak of
    those alive at once: each storage counted once, the parameters left out (held anyway)."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.holders: dict[int, int] = {}  # storage -> saved tensors holding it
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        if not self.holders.get(key):
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.holders[key] = self.holders.get(key, 0) + 1
        # Released when the graph drops it: the finalizer runs as the backward frees the graph.
        held = _Held(t)
        weakref.finalize(held, self._release, key, t.untyped_storage().nbytes())
        return held

    def _release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            self.live -= nbytes

    def unpack(self, saved):
        return saved if isinstance(saved, torch.Tensor) else saved.tensor


class _Held:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_chunking_and_checkpointing_lower_what_the_update_keeps_for_its_backward(policy):
    """One group of 4 responses (115 tokens) in one pack, its update's peak of saved tensors:
    chunked log-probs keep no (tokens, vocabulary) tensor, of which the whole-logits path keeps one
    (its log-softmax); checkpointed layers keep only their inputs, which autograd does not save,
    where the plain layers' saved activations are most of the update's. Exact byte counts: the
    shapes alone decide them, so a skipped chunk or checkpoint fails whatever the machine."""
    rng = random.Random(0)
    prompt = tuple(rng.randrange(3, 96) for _ in range(6))
    group = [Sample(prompt, [rng.randrange(3, 96) for _ in range(k)], rng.uniform(-1, 1), ON_POLICY)
             for k in (30, 25, 40, 20)]
    tokens = sum(len(s.token_ids) for s in group)

    def peak(**memory) -> int:
        saved = SavedForBackward(policy.parameters())
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            group_share(policy, group, GRPOConfig(micro_batch=4, autocast="fp32", **memory), 1.0)
        assert saved.live == 0  # everything released with the graph: the peak is the update's
        return saved.peak

    plain = peak()
    assert plain - peak(logprob_chunk=8) >= tokens * policy.cfg.vocab_size * 4  # one fp32 (N, V) fewer
    assert peak(checkpoint_tokens=1) < plain / 4


@pytest.mark.parametrize("model", ["tiny_dir", "char_model_dir"])  # untied head, tied head (as SmolLM2)
def test_a_groups_micro_batches_are_added_as_their_backward_produces_them(model, request, monkeypatch):
    policy = load_model(request.getfixturevalue(model), dtype="fp32").requires_grad_(True)
    group = groups_of(policy.cfg.vocab_size, sizes=(7,), seed=3)[0]
    cfg = GRPOConfig(micro_batch=2, autocast="fp32")  # four micro-batches
    returned: list[tuple[torch.Tensor, ...]] = []
    grad = torch.autograd.grad

    def spy(*args, **kwargs):
        returned.append(grad(*args, **kwargs))
        return returned[-1]

    params = [p for p in policy.parameters() if p.requires_grad]
    monkeypatch.setattr(torch.autograd, "grad", spy)
    routed = GradientSink(params)  # a running sum: every micro-batch added into it
    assert group_share(policy, group, cfg, 0.8, into=routed).grads == []
    # Nothing autograd.grad returned holds a gradient: each went into the sum as it was produced.
    assert len(returned) == 4 and all(x.stride() == (0,) * x.dim() for out in returned for x in out)
    # Computed before its turn: one buffer per micro-batch, added later in the same order.
    separate = group_share(policy, group, cfg, 0.8).grads
    later = GradientSink(params)
    for buffers in separate:
        for i, b in enumerate(buffers):
            later.take_at(i, b)

    # The same bits as adding what autograd.grad returns, a micro-batch at a time (the update before).
    def whole(loss, params, sink):
        for p, x in zip(params, grad(loss, params, allow_unused=True)):
            sink.take(id(p), torch.zeros_like(p) if x is None else x)

    monkeypatch.setattr(share_mod, "differentiate", whole)
    plain = GradientSink(params)
    group_share(policy, group, cfg, 0.8, into=plain)
    assert len(separate) == 4 and all(torch.equal(a, b) for a, b in zip(routed.grads, plain.grads))
    assert all(torch.equal(a, b) for a, b in zip(later.grads, plain.grads))
    # No hook is left on the policy: a backward outside the update is autograd's own.
    assert not gradients_mod._hooks
