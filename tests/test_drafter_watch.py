"""A drafter version that does not pay is noticed and undone (tailrl.speculative.watch,
tailrl.rollout.adapt): the collapse test's bound, hand-computed; its false alarms and its power
in seeded simulations; and on both engines, a deliberately broken version (randomised weights)
rolled back after one rollout, decoding going on with the previous version's acceptance; a
version with non-finite weights never drafting; one that does not fit the engine failing in one
line; the step line and the rollback line a person sees."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import VLLM_TINY, build_hf

from tailrl.engine import EngineConfig
from tailrl.loading import load_model
from tailrl.records import Request
from tailrl.rl.packing import Sample, packed_logprobs_and_hidden
from tailrl.rl.phases import policy_forwards
from tailrl.rl.progress import rollback_line, summary_line
from tailrl.rollout.native.config import NativeRolloutConfig
from tailrl.rollout.protocol import DrafterVersionError, Rollback, Rollout, RolloutReport
from tailrl.rollout.workers import WorkerConfig
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import Drafter, save_drafter
from tailrl.speculative.modes import RolloutSpeculationConfig
from tailrl.speculative.watch import Tally, Verdict, VersionWatch, WatchConfig, judge
from tailrl.tuner import TunerConfig

L = math.log(1e6)  # ln(1 / alpha) at the default alpha


# ---- the test's bound --------------------------------------------------------------------------


def test_the_collapse_bound_as_computed_by_hand():
    # Reference 600 of 1000; the version's 200 verifies on the same shape. The reference rate at
    # the bottom of its margin: 0.6 - sqrt(L / 2000) = 0.51689; the threshold:
    # 0.5 * 200 * 0.51689 - sqrt(200 * L / 2) = 51.689 - 37.170 = 14.52.
    reference = {"drafter(3,1,3)": Tally(1000, 600)}
    threshold = 0.5 * 200 * (0.6 - math.sqrt(L / 2000)) - math.sqrt(200 * L / 2)
    assert threshold == pytest.approx(14.52, abs=0.01)
    for k, collapsed in ((0, True), (14, True), (15, False), (120, False)):
        v = judge({"drafter(3,1,3)": Tally(200, k)}, reference)
        assert (v.collapsed, v.trusted, v.verifies, v.rate, v.reference_rate) == \
            (collapsed, not collapsed, 200, k / 200, 0.6)
    # Fewer verifies than min_verifies: not trusted yet, and 0 of 50 is not yet sure either
    # (0.5 * 50 * 0.51689 - sqrt(50 * L / 2) = 12.92 - 18.58 < 0).
    assert judge({"drafter(3,1,3)": Tally(50, 0)}, reference) == Verdict(False, False, 50, 0.0, 0.6)


def test_the_version_is_judged_on_the_shapes_both_drafted_with():
    # The reference accepts 90% on shape a and 10% on shape b; a version that drafted only on b,
    # at b's rate, is as good as the reference there, though its overall rate is far below the
    # reference's overall 50%.
    reference = {"a": Tally(1000, 900), "b": Tally(1000, 100)}
    v = judge({"b": Tally(400, 40), "c": Tally(500, 0)}, reference)
    assert not v.collapsed and v.trusted and v.verifies == 400 and v.reference_rate == 0.1
    # Shapes the reference never drafted with say nothing.
    assert judge({"c": Tally(500, 0)}, reference) == judge({}, reference)
    assert not judge({"c": Tally(500, 0)}, reference).collapsed


def simulate(rates: dict[str, float], ref_verifies: int, verifies: int, factor: float, cfg: WatchConfig,
             trials: int, seed: int) -> float:
    """The share of trials whose version was called collapsed: the reference's verifies and the
    version's, each an independent Bernoulli at `rates` (the version's times `factor`)."""
    rng = random.Random(seed)
    alarms = 0
    for _ in range(trials):
        ref = {s: Tally(ref_verifies, sum(rng.random() < p for _ in range(ref_verifies))) for s, p in rates.items()}
        new = {s: Tally(verifies, sum(rng.random() < p * factor for _ in range(verifies))) for s, p in rates.items()}
        alarms += judge(new, ref, cfg).collapsed
    return alarms / trials


def test_false_alarms_stay_under_the_bound_and_a_collapse_is_caught():
    """Seeded simulations, each check one that a correct watch fails for a negligible share of
    seeds (the probabilities below). At alpha 0.05 the bound is testable: a version exactly at
    ratio times the reference's rates on 2 shapes is called collapsed with probability <= 3 *
    0.05; the simulation stays far below it (no alarm in 20,000 trials, measured: more than 60
    alarms in 400 would need a rate near 0.15). At the default alpha a drafter whose first token
    is never accepted, against a reference accepting 60% of 500 verifies, is caught within 160
    verifies (module doc), and one at 90% of the reference's rates never is (an alarm in 200
    trials: probability <= 200 * 3e-6 by the bound)."""
    at_the_boundary = simulate({"a": 0.6, "b": 0.3}, 300, 150, 0.5, WatchConfig(alpha=0.05), trials=400, seed=0)
    assert at_the_boundary <= 3 * 0.05
    # With no draft accepted, the version is called collapsed unless the reference's estimate
    # sits low: 0 < 0.5 * 160 * (r - sqrt(L / 1000)) - sqrt(160 * L / 2) needs r > 0.5331, more
    # than 266 of its 500 verifies. A miss is Binomial(500, 0.6) <= 266: p = 0.00119 per trial,
    # so about 1 seed in 17 misses once in 50 trials. Allowing 3 misses, a correct watch fails
    # this with probability P(Binomial(50, 0.00119) >= 4) = 4.9e-9; one that caught only 9 in
    # 10 would fail it with probability 0.75.
    assert simulate({"a": 0.6}, 500, 160, 0.0, WatchConfig(), trials=50, seed=1) >= 1.0 - 3 / 50
    # Not yet sure at 60 verifies: an alarm needs more than 398 of the reference's 500 (p = 2.5e-21).
    assert simulate({"a": 0.6}, 500, 60, 0.0, WatchConfig(), trials=50, seed=1) == 0.0
    assert simulate({"a": 0.6, "b": 0.3}, 300, 200, 0.9, WatchConfig(), trials=200, seed=2) == 0.0


def test_a_watch_promotes_trusted_versions_and_resumes_from_its_state():
    watch = VersionWatch(WatchConfig(min_verifies=100))
    watch.record(0, {"s": Tally(500, 300)})
    assert watch.verdict() is None  # the reference itself drafts
    watch.drafting(1)
    watch.record(1, {"s": Tally(60, 40)})
    assert not watch.verdict().trusted  # 60 < min_verifies
    watch.record(1, {"s": Tally(60, 40)})
    assert watch.verdict().trusted and not watch.verdict().collapsed
    watch.promote()
    assert (watch.reference, watch.current, watch.reference_tallies) == (1, 1, {"s": Tally(120, 80)})
    watch.drafting(2)
    with pytest.raises(ValueError, match="version 1, but version 2 is drafting"):
        watch.record(1, {"s": Tally(1, 1)})
    watch.record(2, {"s": Tally(300, 3)})
    assert watch.verdict().collapsed
    again = VersionWatch()
    again.load_state_dict(watch.state_dict())
    assert again == watch


# ---- on the engines ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repeater(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama (vLLM-sized heads) whose tied head is sharp enough that greedy decoding
    repeats, and a learned drafter fresh from it (it predicts the next hidden state as the
    current one, so it proposes the last token again): its first draft token is accepted at
    nearly every verify, a randomised drafter's almost never."""
    path = tmp_path_factory.mktemp("repeater")
    hf = build_hf("llama", seed=1, tie_word_embeddings=True, **VLLM_TINY)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(4.0)
    hf.save_pretrained(path / "target")
    drafter = save_drafter(Drafter.from_target(load_model(path / "target", "fp32"), list(range(96)), "target"),
                           path / "drafter")
    return path / "target", drafter


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(8)
    prompts = [tuple(torch.randint(2, 96, (8,), generator=g).tolist()) for _ in range(8)]
    return [Request(prompts[i // 2], seed=1000 + i, group=i // 2) for i in range(16)]


SPEC = dict(spec="on", draft_depth=3, num_draft_tokens=3)  # a fixed arm: the tallies are a function of the tokens
ADAPT = AdaptConfig(drafter_min_steps=2)


def run_steps(rollout: Rollout, model, steps: int, before_publish: Callable[[int], None]) -> list[RolloutReport]:
    """Steps of greedy rollouts, each handing the rollout the policy's forwards and publishing
    (the policy does not change); before_publish(step) may break the drafter being trained."""
    rollout.publish(model)
    reports = []
    for step in range(1, steps + 1):
        out = rollout.generate(step, requests(), SamplingParams(temperature=0.0), 32)
        samples = [Sample(c.prompt_ids, c.token_ids, 1.0, c.logprobs) for c in out]
        with torch.no_grad():
            rollout.feed().observe(policy_forwards(samples, packed_logprobs_and_hidden(model, samples, 1.0)[1]))
        before_publish(step)
        rollout.publish(model)
        reports.append(rollout.report())
    return reports


def randomise(rollout, step: int, at: int) -> None:
    """Randomise the learner's drafter before step `at`'s publish: the version it trains there is broken."""
    if step == at:
        gen = torch.Generator().manual_seed(at)
        with torch.no_grad():
            for p in rollout.adapt.learner.drafter.parameters():
                p.normal_(0.0, 1.0, generator=gen)


def check_rolled_back(reports: list[RolloutReport]) -> None:
    """Versions 0 and 1 draft well; version 2 (broken at step 2's publish) drafts step 3 and is
    rolled back to version 1 at step 3's publish; version 3, trained from version 1's weights,
    drafts step 4 with version 1's acceptance."""
    assert [(r.drafter_version, r.drafter_published) for r in reports] == [(0, 0), (0, 1), (1, 2), (2, 3), (3, 4)]
    good, broken, after = reports[2].drafter_accept_len, reports[3].drafter_accept_len, reports[4].drafter_accept_len
    assert good > 3.0 and broken < 1.2 and after == pytest.approx(good, rel=0.05)
    assert [r.drafter_rollback for r in reports[:3]] + [reports[4].drafter_rollback] == [None] * 4
    rollback = reports[3].drafter_rollback
    assert (rollback.version, rollback.to, rollback.reason) == (2, 1, "acceptance")
    assert rollback.rate < 0.1 and rollback.reference_rate > 0.9 and rollback.verifies > 100


def run_native(repeater: tuple[Path, Path], steps: int, breaks: Callable[[Rollout, int], None],
               adapt: AdaptConfig = ADAPT) -> tuple[list[RolloutReport], Rollout]:
    """run_steps on the native engine (one in-process worker); breaks(rollout, step) before each publish."""
    target, drafter = repeater
    model = load_model(target, "fp32")
    speculation = RolloutSpeculationConfig(drafter=str(drafter), **SPEC)
    rollout = NativeRolloutConfig(EngineConfig(max_batch=16), speculation, TunerConfig(), adapt,
                                  WorkerConfig()).open(model, 0)
    try:
        return run_steps(rollout, model, steps, lambda step: breaks(rollout, step)), rollout
    finally:
        rollout.close()


def test_a_broken_version_is_rolled_back_on_the_native_engine(repeater):
    reports, _ = run_native(repeater, 5, lambda rollout, step: randomise(rollout, step, at=3))
    check_rolled_back(reports)
    # Without the watch the broken version keeps drafting, and its successors train on from it.
    unwatched, _ = run_native(repeater, 5, lambda rollout, step: randomise(rollout, step, at=3),
                              AdaptConfig(drafter_min_steps=2, drafter_rollback=False))
    assert unwatched[4].drafter_accept_len < 1.2 and all(r.drafter_rollback is None for r in unwatched)


def test_a_version_with_non_finite_weights_never_drafts(repeater):
    def poison(rollout, step: int) -> None:
        if step == 2:
            with torch.no_grad():
                next(rollout.adapt.learner.drafter.fc.parameters()).fill_(float("nan"))

    reports, rollout = run_native(repeater, 3, poison)
    # Step 2's publish trained version 1 (the first: training lags a step) from the poisoned
    # weights: discarded; version 0 drafts on, and the learner went back to its weights, so step
    # 3's publish trains version 2 from them.
    assert reports[1].drafter_rollback == Rollback(1, 0, "non-finite")
    assert [(r.drafter_version, r.drafter_published) for r in reports] == [(0, 0), (0, 0), (0, 2)]
    assert reports[2].drafter_accept_len == pytest.approx(reports[1].drafter_accept_len, rel=0.05)
    assert all(torch.isfinite(w).all() for w in rollout.adapt.drafting_weights().values())


def test_a_version_that_does_not_fit_the_engine_fails_in_one_line(repeater):
    def misshape(rollout, step: int) -> None:
        if step == 2:
            fc = rollout.adapt.learner.drafter.fc  # a bug's drafter: an fc with a bias the engine's has not
            rollout.adapt.learner.drafter.fc = torch.nn.Linear(fc.in_features, fc.out_features, bias=True)

    with pytest.raises(DrafterVersionError) as e:
        run_native(repeater, 3, misshape)
    assert str(e.value).startswith("drafter version 1 cannot be loaded into the native engine: ")
    assert "fc.bias" in str(e.value) and "\n" not in str(e.value)


def test_a_broken_version_is_rolled_back_on_the_vllm_engine(repeater):
    pytest.importorskip("vllm")
    from tailrl.rollout.vllm.config import VllmRolloutConfig
    from tailrl.rollout.vllm.settings import VllmSettings

    target, drafter = repeater
    model = load_model(target, "fp32")
    speculation = RolloutSpeculationConfig(drafter=str(drafter), **SPEC)
    # Greedy drafts: the acceptance is then a function of the tokens (docs/vllm.md).
    rollout = VllmRolloutConfig(VllmSettings(kv_cache_gb=1 / 16, max_num_seqs=16, draft_sampling="greedy"),
                                speculation, adapt=ADAPT).open(model, seed=0)
    try:
        reports = run_steps(rollout, model, 5, lambda step: randomise(rollout, step, at=3))
    finally:
        rollout.close()
    check_rolled_back(reports)


# ---- what a person sees ------------------------------------------------------------------------


def test_the_step_line_shows_the_drafter_and_a_rollback_has_a_line_of_its_own():
    m = {"step": 7, "reward_mean": 0.5, "reward_std": 0.1, "format_rate": 1.0, "response_len_mean": 100,
         "response_len_p90": 200, "response_len_max": 300, "rollout_s": 10.0, "reward_s": 0.1, "train_s": 2.0,
         "step_s": 12.0, "rollout_tok_s": 200.0, "loss": 0.01, "kl": 0.0, "grad_norm": 1.0, "reward_failures": 0,
         "reward_timeouts": 0, "drafter_version": 6, "drafter_accept_len": 1.04, "drafter_published": 5,
         "drafter_rollback": {"version": 6, "to": 5, "reason": "acceptance", "verifies": 412, "rate": 0.02,
                              "reference_rate": 0.61}}
    assert summary_line(m, 30).endswith(" | drafter v6 accept_len 1.04")
    assert rollback_line(m) == ("step 7: drafter v6 rolled back to v5: its first draft token accepted in 2% of 412 "
                                "verifies, v5's in 61% on the same draft shapes")
    m["drafter_rollback"] = {"version": 6, "to": 5, "reason": "non-finite", "verifies": 0, "rate": None,
                             "reference_rate": None}
    assert rollback_line(m) == "step 7: drafter v6 discarded (weights not finite); v5 drafts on"
    assert rollback_line({**m, "drafter_rollback": None}) is None
