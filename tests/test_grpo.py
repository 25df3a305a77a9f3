"""GRPO math: advantages, the PPO-clip loss against the behaviour policy with its truncated
importance weight and the k3 KL against hand-computed numbers, micro-batch x accumulation
equivalence, and one update moving a tiny policy the right way."""

import math

import pytest
import torch

from tailrl.rl.grpo import GRPOConfig, group_advantages, policy_loss, sequence_logprobs


def test_group_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards)
    # Row 0: mean 0.5, unbiased std sqrt(1/3) = 0.5773503 -> +-0.5 / (0.5773503 + 1e-6).
    # Row 1: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5 -> -0.25 / 0.500001, 0.75 / 0.500001.
    # Row 2: no spread, no signal.
    expected = torch.tensor(
        [
            [0.8660239, -0.8660239, -0.8660239, 0.8660239],
            [-0.4999990, -0.4999990, -0.4999990, 1.4999970],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    assert adv.shape == rewards.shape and adv.dtype == torch.float32


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(8))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4, 1))


def test_sequence_logprobs_hand_computed():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(3.0), 0.0]]])  # (1, 2, 2)
    tokens = torch.tensor([[1, 1]])
    want = torch.tensor([[math.log(0.75), math.log(0.25)]])
    torch.testing.assert_close(sequence_logprobs(logits, tokens, 1.0), want)
    torch.testing.assert_close(sequence_logprobs(logits, tokens, 0.0), want)  # greedy -> T=1
    # Temperature 2 halves the logits: [0, 2 ln 3] / 2 = [0, ln 3].
    torch.testing.assert_close(sequence_logprobs(logits * 2.0, tokens, 2.0), want)


def _two_by_three():
    """Ratios [[1, 1.1, 1.5], [0.5, 1.3, pad]], advantages [+1, -2]."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
    log_ratio = torch.tensor(
        [[0.0, math.log(1.1), math.log(1.5)], [math.log(0.5), math.log(1.3), 7.0]], dtype=torch.float64
    )
    lp = (old + log_ratio).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return lp, old, adv, mask


def test_policy_loss_hand_computed_with_clipped_tokens():
    lp, old, adv, mask = _two_by_three()
    out = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # Row 0 (A=+1): -min(r, clip(r)) = -1, -1.1, -1.2 (ratio 1.5 clipped to 1.2).
    # Row 1 (A=-2): r=0.5 -> -min(-1, -1.6) = 1.6 (clipped at 0.8); r=1.3 -> -min(-2.6, -2.4) = 2.6.
    # Sum 0.9 over 5 valid tokens.
    assert out.loss.item() == pytest.approx(0.18, abs=1e-12)
    assert out.pg_loss == pytest.approx(0.18, abs=1e-12)
    assert out.clip_fraction == pytest.approx(2 / 5)
    assert out.ratio_mean == pytest.approx((1.0 + 1.1 + 1.5 + 0.5 + 1.3) / 5)
    assert out.kl == 0.0
    out.loss.backward()
    # d/d lp of -A * r / N is -A * r / N where unclipped; clipped tokens and padding get zero.
    want = torch.tensor([[-1.0, -1.1, 0.0], [0.0, 2.0 * 1.3, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(lp.grad, want, rtol=0, atol=1e-12)


def test_policy_loss_against_behaviour_logprobs_hand_computed():
    """Seven tokens with chosen ratios pi_theta / pi_behaviour, clip 0.2 and is_cap 2, plus a
    padding token whose behaviour log-prob is -inf. Per token (A, ratio) -> pg, d pg / d lp:
      (+1, 1.1) unclipped            -> -1.1, -1.1
      (+1, 1.5) above 1.2: clipped   -> -1.2,  0
      (-1, 0.5) below 0.8: clipped   ->  0.8,  0
      (-1, 1.5) unclipped            ->  1.5,  1.5
      (-1, 3.0) capped at 2          ->  2.0,  2.0   (the weight is 2, the direction kept)
      (+1, 3.0) capped, then clipped -> -1.2,  0
      (+1, 0.5) unclipped            -> -0.5, -0.5
    Sum 0.3 over 7 tokens; clipped 3/7, capped 2/7."""
    ratios = [1.1, 1.5, 0.5, 1.5, 3.0, 3.0, 0.5]
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)  # (1, 8)
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -0.7, -3.0, -1.2, float("-inf")]], dtype=torch.float64)
    log_r = torch.tensor([[math.log(r) for r in ratios] + [0.0]], dtype=torch.float64)
    lp = (torch.where(torch.isinf(behaviour), -2.0, behaviour) + log_r).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    out = policy_loss(lp, behaviour, adv, mask, clip_low=0.2, clip_high=0.2, is_cap=2.0)
    assert out.loss.item() == pytest.approx(0.3 / 7, abs=1e-12)
    assert out.pg_loss == pytest.approx(0.3 / 7, abs=1e-12)
    assert out.clip_fraction == pytest.approx(3 / 7) and out.capped_fraction == pytest.approx(2 / 7)
    assert out.ratio_mean == pytest.approx(sum(ratios) / 7) and out.ratio_max == pytest.approx(3.0)
    assert out.mismatch_kl == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 7)
    out.loss.backward()
    want = torch.tensor([[-1.1, 0.0, 0.0, 1.5, 2.0, 0.0, -0.5, 0.0]], dtype=torch.float64) / 7
    torch.testing.assert_close(lp.grad, want, rtol=0, atol=1e-12)

    # No cap: the (-1, 3.0) token keeps weight 3 (pg 3, gradient 3); nothing else moves.
    lp.grad = None
    out = policy_loss(lp, behaviour, adv, mask, clip_low=0.2, clip_high=0.2, is_cap=math.inf)
    assert out.loss.item() == pytest.approx(1.3 / 7, abs=1e-12) and out.capped_fraction == 0.0
    out.loss.backward()
    torch.testing.assert_close(lp.grad, want + torch.tensor([[0, 0, 0, 0, 1.0, 0, 0, 0]], dtype=torch.float64) / 7,
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="is_cap"):
        policy_loss(lp, behaviour, adv, mask, clip_high=0.28, is_cap=1.28)


def test_is_cap_is_validated():
    assert GRPOConfig(is_cap=math.inf).is_cap == math.inf
    for bad in (dict(is_cap=1.2), dict(clip_high=0.5, is_cap=1.4), dict(is_cap=math.nan)):
        with pytest.raises(ValueError, match="is_cap must be > 1 \\+ clip_high"):
            GRPOConfig(**bad)


def test_policy_loss_clip_higher_is_asymmetric():
    lp, old, adv, mask = _two_by_three()
    out = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # Only the ratio-1.5 token changes: clipped at 1.28 instead of 1.2 -> sum 0.9 - 0.08.
    assert out.loss.item() == pytest.approx(0.82 / 5, abs=1e-12)


def test_policy_loss_k3_kl_hand_computed():
    lp, old, adv, mask = _two_by_three()
    d = torch.tensor([[math.log(2.0), 0.0, -1.0], [0.0, math.log(2.0), 5.0]], dtype=torch.float64)
    ref = lp.detach() + d
    out = policy_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    # k3(d) = e^d - d - 1: d=ln2 -> 1 - ln2 = 0.3068528; d=0 -> 0; d=-1 -> e^-1 = 0.3678794.
    kl_mean = (0.3068528 + 0.0 + 0.3678794 + 0.0 + 0.3068528) / 5
    assert out.kl == pytest.approx(kl_mean, abs=1e-7)
    assert out.loss.item() == pytest.approx(0.18 + 0.1 * kl_mean, abs=1e-7)
    assert out.pg_loss == pytest.approx(0.18, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, old, adv, mask, kl_coef=0.1)


def test_padding_with_infinite_logprobs_stays_finite():
    lp, old, adv, mask = _two_by_three()
    old = old.clone()
    old[1, 2] = float("-inf")
    out = policy_loss(lp, old, adv, mask, ref_logprobs=old.clone(), kl_coef=0.1)
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and torch.isfinite(lp.grad).all()


def _tiny_policy_batch(dtype):
    g = torch.Generator().manual_seed(0)
    B, T, D, V = 8, 6, 4, 7
    feats = torch.randn(B, T, D, generator=g, dtype=dtype)  # (B, T, D)
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 1])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (B, T)
    adv = torch.randn(B, generator=g, dtype=dtype)
    policy = torch.nn.Linear(D, V).to(dtype)
    with torch.no_grad():
        lp0 = sequence_logprobs(policy(feats), tokens, 1.0)
        # Old/ref log-probs off by up to +-0.5 so that some ratios fall outside the clip range.
        old = lp0 + (torch.rand(B, T, generator=g, dtype=dtype) - 0.5)
        ref = lp0 + (torch.rand(B, T, generator=g, dtype=dtype) - 0.5)
    return policy, feats, tokens, mask, adv, old, ref


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_micro_batches_equal_full_batch(dtype, atol):
    policy, feats, tokens, mask, adv, old, ref = _tiny_policy_batch(dtype)
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05)

    def loss_of(rows, num_tokens):
        lp = sequence_logprobs(policy(feats[rows]), tokens[rows], 1.0)
        return policy_loss(
            lp, old[rows], adv[rows], mask[rows], ref_logprobs=ref[rows], num_tokens=num_tokens, **kw
        )

    policy.zero_grad()
    full = loss_of(slice(None), None)
    assert full.clip_fraction > 0  # the test must exercise the clipped branch
    full.loss.backward()
    full_grads = [p.grad.clone() for p in policy.parameters()]

    policy.zero_grad()
    total_tokens = int(mask.sum())
    accumulated = 0.0
    for i in range(feats.shape[0]):
        micro = loss_of(slice(i, i + 1), total_tokens)
        micro.loss.backward()
        accumulated += micro.loss.item()
    assert accumulated == pytest.approx(full.loss.item(), abs=atol)
    for p, want in zip(policy.parameters(), full_grads):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=atol)

    # Averaging per-micro-batch means instead is a different objective on ragged lengths.
    policy.zero_grad()
    naive = sum(loss_of(slice(i, i + 1), None).loss for i in range(feats.shape[0])) / feats.shape[0]
    assert abs(naive.item() - full.loss.item()) > 1e-3


def test_one_step_moves_policy_towards_rewarded_token():
    # A bias-only policy over a 5-token vocabulary; each response is 4 i.i.d. tokens and the
    # reward is the share of token 3. Seeded, so deterministic (no false-failure probability).
    g = torch.Generator().manual_seed(1)
    V, P, G, T = 5, 4, 8, 4
    bias = torch.nn.Parameter(torch.zeros(V))
    with torch.no_grad():
        probs = torch.softmax(bias, -1)
        tokens = torch.multinomial(probs.expand(P * G * T, V), 1, generator=g).view(P * G, T)
    rewards = (tokens == 3).double().mean(-1).view(P, G)  # (P, G)
    adv = group_advantages(rewards).reshape(-1)  # (B,)
    mask = torch.ones(P * G, T)
    opt = torch.optim.SGD([bias], lr=0.5)
    logits = bias.expand(P * G, T, V)
    lp = sequence_logprobs(logits, tokens, 1.0)
    out = policy_loss(lp, lp.detach(), adv.float(), mask)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    p_after = torch.softmax(bias.detach(), -1)
    assert p_after[3] > probs[3] + 0.01
    assert int((p_after - probs).argmax()) == 3  # token 3 gained the most mass


def test_lr_warmup_ramp_hand_computed():
    assert [GRPOConfig(lr=1e-4).lr_at(s) for s in (1, 2)] == [1e-4, 1e-4]
    ramp = GRPOConfig(lr=1e-4, lr_warmup_steps=3)
    assert [ramp.lr_at(s) for s in (1, 2, 3, 4, 9)] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4], rel=1e-12)
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        GRPOConfig(lr_warmup_steps=-1)
