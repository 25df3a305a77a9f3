"""The tuner: arm validation, buckets, convergence, exploration rate, sliding window, gate, state.

Statistical tests state their false-failure probability for any seed; the seeds are fixed, so a
run is deterministic. Rewards are synthetic (no timing is measured).
"""

from __future__ import annotations

import json
import math
import random

import pytest

from tailrl.tuner import LOSER_RECENT, PLAIN, Arm, Tuner, TunerConfig, bucket_label, plain_step_line

DRAFTER = Arm("drafter", 3, 4, 8)
NGRAM = Arm("ngram", 2, 2, 4)


def binomial_interval(n: int, p: float, delta: float) -> tuple[int, int]:
    """[lo, hi] with P(X < lo) <= delta/2 and P(X > hi) <= delta/2, X ~ Binomial(n, p), exactly."""
    log_q = math.log1p(-p)
    log_choose = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in range(n + 1)]
    pmf = [math.exp(c + k * math.log(p) + (n - k) * log_q) for k, c in enumerate(log_choose)]
    lo, tail = 0, 0.0
    while tail + pmf[lo] <= delta / 2:
        tail += pmf[lo]
        lo += 1
    hi, tail = n, 0.0
    while tail + pmf[hi] <= delta / 2:
        tail += pmf[hi]
        hi -= 1
    return lo, hi


def test_arm_validation_and_labels():
    assert PLAIN.label == "plain" and DRAFTER.label == "drafter(3,4,8)" and NGRAM.label == "ngram(2,2,4)"
    assert Arm("drafter", 2, 2, 6).num_draft_tokens == 6  # 2 + 4 nodes: a full tree is allowed
    bad = [
        ("beam", 0, 0, 0),
        ("plain", 1, 0, 0),
        ("drafter", 0, 4, 8),
        ("drafter", 3, 0, 8),
        ("ngram", 3, 4, 0),
        ("drafter", 2, 2, 7),  # only 2 + 4 = 6 nodes exist
        ("drafter", 3.0, 4, 8),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            Arm(*args)


def test_config_and_tuner_validation():
    for kwargs in [
        {"epsilon": 1.5},
        {"loser_margin": -0.1},
        {"window": 0},
        {"bucket_edges": (1, 4, 4)},
        {"bucket_edges": (0, 2)},
        {"switch_patience": -1},
    ]:
        with pytest.raises(ValueError):
            TunerConfig(**kwargs)
    assert TunerConfig(bucket_edges=[2, 8]).bucket_edges == (2, 8)
    with pytest.raises(ValueError):
        Tuner([DRAFTER])  # no PLAIN to fall back to
    with pytest.raises(ValueError):
        Tuner([PLAIN, DRAFTER, DRAFTER])
    tuner = Tuner([PLAIN, DRAFTER])
    for call in (lambda: tuner.update(1, NGRAM, 1.0), lambda: tuner.update(1, PLAIN, -1.0),
                 lambda: tuner.update(1, PLAIN, math.nan), lambda: tuner.choose(0)):
        with pytest.raises(ValueError):
            call()


def test_bucket_ranges():
    tuner = Tuner([PLAIN])  # edges (1, 2, 4, 8, 16, 32)
    expected = {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 9: 4, 16: 4, 17: 5, 32: 5, 33: 6, 1000: 6}
    assert {b: tuner.bucket(b) for b in expected} == expected
    assert ([bucket_label(tuner.config.bucket_edges, i) for i in range(7)]
            == ["1", "2", "3-4", "5-8", "9-16", "17-32", "33+"])


def test_converges_to_best_arm_per_bucket():
    # Per bucket a different arm is best (tokens/s means, gap >= 10), gaussian noise sigma 3.
    # Bound, for any seed: each arm gets >= Binomial(N=4000, eps/k=1/30) exploration pulls per
    # bucket, mean 133; P(< 50) <= exp(-0.625^2 * 133 / 2) < 1e-11 (Chernoff). Each window then
    # holds >= 50 rewards and its median is off by >= 5 only if >= half of them are, which has
    # P <= P(Binomial(50, P(|Z| > 5/3) = 0.096) >= 25) < 4e-13; a union bound over the <= 4000
    # windows per arm, 3 arms, 3 buckets stays < 2e-8. Medians within 5 of gap-10 means order right.
    means = {
        1: {PLAIN: 20.0, DRAFTER: 40.0, NGRAM: 30.0},
        6: {PLAIN: 100.0, DRAFTER: 110.0, NGRAM: 120.0},
        64: {PLAIN: 365.0, DRAFTER: 300.0, NGRAM: 330.0},
    }
    # (loser_margin 1: every arm explored alike, as the bound assumes.)
    tuner = Tuner([PLAIN, DRAFTER, NGRAM], TunerConfig(epsilon=0.1, window=300, loser_margin=1.0), seed=0)
    noise = random.Random(1)
    for _ in range(4000):
        for batch, arm_means in means.items():  # interleaved: buckets share one generator
            arm = tuner.choose(batch)
            tuner.update(batch, arm, max(0.0, noise.gauss(arm_means[arm], 3.0)))
    best = {batch: tuner.best(batch) for batch in means}
    assert best == {batch: max(m, key=m.get) for batch, m in means.items()}
    assert len(set(best.values())) == 3
    assert tuner.summary()["33+"]["best"] == "plain"


def test_updates_in_one_bucket_leave_other_buckets_alone():
    tuner = Tuner([PLAIN, DRAFTER, NGRAM], TunerConfig(epsilon=0.0))
    for arm, reward in [(PLAIN, 300.0), (DRAFTER, 100.0), (NGRAM, 200.0)]:
        tuner.update(64, arm, reward)
    before = tuner.summary()["33+"]
    for _ in range(1000):
        for arm, reward in [(PLAIN, 1.0), (DRAFTER, 1000.0), (NGRAM, 500.0)]:
            tuner.update(1, arm, reward)
    assert tuner.choose(1) == DRAFTER
    assert tuner.choose(64) == PLAIN and tuner.choose(1000) == PLAIN
    assert tuner.summary()["33+"] == before
    # Untried-first is per bucket too: bucket 3-4 has seen nothing.
    assert tuner.best(3) is None and tuner.choose(3) == PLAIN
    tuner.update(3, PLAIN, 1.0)
    assert tuner.choose(4) == DRAFTER


def test_under_tried_arms_come_first_in_order():
    # Every arm gets min_pulls rewards, round robin in the order given, before the bandit ranks
    # them (epsilon 0: afterwards only the greedy arm).
    tuner = Tuner([DRAFTER, NGRAM, PLAIN], TunerConfig(epsilon=0.0, min_pulls=2))
    order = []
    for reward in (1.0, 3.0, 2.0, 1.0, 3.0, 2.0):
        arm = tuner.choose(5)
        order.append(arm)
        tuner.update(5, arm, reward)
    assert order == [DRAFTER, NGRAM, PLAIN] * 2
    assert tuner.choose(5) == NGRAM


def test_a_bucket_of_many_sequences_needs_fewer_tries_of_each_arm():
    # pulls_needed by hand: ceil(32 / the bucket's smallest batch), at most min_pulls (3), at
    # least 1: buckets 1, 2, 3-4, 5-8, 9-16 need 3; 17-32 needs 2; 33+ needs 1.
    tuner = Tuner([PLAIN, NGRAM, DRAFTER], TunerConfig(epsilon=0.0))
    assert [tuner.pulls_needed(b) for b in range(7)] == [3, 3, 3, 3, 3, 2, 1]
    assert Tuner([PLAIN, NGRAM], TunerConfig(min_pulls=1)).pulls_needed(0) == 1
    for batch, rounds in ((64, 1), (20, 2), (9, 3)):
        order = []
        for _ in range(3 * rounds + 1):  # every try, then one ranked pick
            arm = tuner.choose(batch)
            order.append(arm)
            tuner.update(batch, arm, {PLAIN: 2.0, NGRAM: 1.0, DRAFTER: 3.0}[arm])
        assert order == [PLAIN, NGRAM, DRAFTER] * rounds + [DRAFTER], batch


def test_exploration_rate_matches_epsilon():
    # Non-greedy picks ~ Binomial(n, eps * (k-1)/k); each other arm ~ Binomial(n, eps/k).
    # Four exact two-sided binomial intervals at delta = 2.5e-7 each: false failure < 1e-6.
    # (loser_margin 1: no arm is a clear loser; the next test has them.)
    eps, n, delta = 0.1, 20_000, 2.5e-7
    arms = [PLAIN, DRAFTER, NGRAM, Arm("drafter", 1, 8, 8)]
    tuner = Tuner(arms, TunerConfig(epsilon=eps, min_pulls=1, loser_margin=1.0), seed=3)
    for reward in (1.0, 2.0, 3.0, 4.0):  # warm-up: every arm tried once, the last is greedy
        tuner.update(1, tuner.choose(1), reward)
    greedy = tuner.best(1)
    assert greedy == arms[-1]
    counts = dict.fromkeys(arms, 0)
    for _ in range(n):
        counts[tuner.choose(1)] += 1
    k = len(arms)
    lo, hi = binomial_interval(n, eps * (k - 1) / k, delta)
    assert lo <= n - counts[greedy] <= hi
    lo, hi = binomial_interval(n, eps / k, delta)
    for arm in arms[:-1]:
        assert lo <= counts[arm] <= hi


def test_clear_losers_are_explored_ten_times_less():
    # Best median 10; the upper quartile of DRAFTER's rewards (9, 7, 7) is 9, within the 15%
    # margin (a median of 7 would condemn it), NGRAM's 5 and X's 1 are clear losers. Per pick:
    # DRAFTER ~ eps/k, each loser ~ eps/k/10 (drawn, then kept one time in 10). Three exact
    # binomial intervals at delta = 2.5e-7 each: false failure < 1e-6.
    eps, n, delta = 0.1, 40_000, 2.5e-7
    x = Arm("drafter", 1, 8, 8)
    arms = [PLAIN, DRAFTER, NGRAM, x]
    tuner = Tuner(arms, TunerConfig(epsilon=eps, min_pulls=1), seed=7)
    for arm, rewards in zip(arms, ((10.0,), (9.0, 7.0, 7.0), (5.0,), (1.0,))):
        for reward in rewards:
            tuner.update(1, arm, reward)
    counts = dict.fromkeys(arms, 0)
    for _ in range(n):
        counts[tuner.choose(1)] += 1
    k = len(arms)
    lo, hi = binomial_interval(n, eps / k, delta)
    assert lo <= counts[DRAFTER] <= hi
    lo, hi = binomial_interval(n, eps / k / 10, delta)
    assert lo <= counts[NGRAM] <= hi and lo <= counts[x] <= hi


def test_a_loser_is_judged_by_its_recent_upper_quartile():
    # Best median 10, margin 15%: a clear loser's upper quartile of its last LOSER_RECENT rewards
    # is below 8.5. Hand-computed on sorted(last 12)[9], the third best.
    assert LOSER_RECENT == 12
    tuner = Tuner([PLAIN, DRAFTER, NGRAM], TunerConfig(min_pulls=1), seed=0)
    tuner.update(1, PLAIN, 10.0)
    for reward in [5.0] * 10 + [9.5, 9.5]:  # two lucky steps do not clear an arm at half speed
        tuner.update(1, NGRAM, reward)
    assert tuner._loses(tuner.bucket(1), NGRAM)
    tuner.update(1, NGRAM, 9.0)  # a third good step among the last 12 does
    assert not tuner._loses(tuner.bucket(1), NGRAM)
    for reward in [5.0] * 200 + [9.0] * 3 + [5.0] * 9:  # only the newest 12 count, however many are older
        tuner.update(1, DRAFTER, reward)
    assert not tuner._loses(0, DRAFTER)
    tuner.update(1, DRAFTER, 5.0)  # the oldest good one of the three leaves the last 12
    assert tuner._loses(0, DRAFTER)


def test_epsilon_zero_never_explores():
    tuner = Tuner([PLAIN, DRAFTER], TunerConfig(epsilon=0.0, min_pulls=1), seed=5)
    tuner.update(2, PLAIN, 10.0)
    tuner.update(2, DRAFTER, 11.0)
    assert {tuner.choose(2) for _ in range(1000)} == {DRAFTER}


@pytest.mark.parametrize("window", [1, 5, 20, 21])
def test_sliding_window_abandons_an_arm_whose_reward_dropped(window):
    # The drafter earned 10 for a full window, plain earns 5. After the drop the drafter earns 1;
    # its median falls below 5 once the new rewards are a majority: window // 2 + 1 pulls.
    tuner = Tuner([PLAIN, DRAFTER], TunerConfig(epsilon=0.0, window=window, min_pulls=1))
    for _ in range(window):
        tuner.update(1, DRAFTER, 10.0)
    tuner.update(1, PLAIN, 5.0)
    pulls_after_drop = 0
    while (arm := tuner.choose(1)) == DRAFTER:
        tuner.update(1, arm, 1.0)
        pulls_after_drop += 1
        assert pulls_after_drop <= window
    assert arm == PLAIN and pulls_after_drop == window // 2 + 1


def test_gate_opens_after_patience_and_closes_above_switch_batch():
    config = TunerConfig(epsilon=1.0, switch_batch=32, switch_patience=10, min_pulls=1)
    tuner = Tuner([DRAFTER, PLAIN], config, seed=0)
    for arm in (DRAFTER, PLAIN):  # everything tried: an open gate would explore
        for batch in (20, 32, 64):
            tuner.update(batch, arm, 1.0)
    rng_before = tuner.state_dict()["rng"]
    assert [tuner.gate(64) for _ in range(5)] == [False] * 5
    assert [tuner.gate(32) for _ in range(10)] == [False] * 9 + [True]
    assert tuner.gate(1) is True
    assert tuner.gate(33) is False  # one large step closes it and restarts the count
    assert [tuner.gate(20) for _ in range(10)] == [False] * 9 + [True]
    tuner.new_rollout()  # a new rollout starts closed, even at a batch <= switch_batch
    assert [tuner.gate(20) for _ in range(10)] == [False] * 9 + [True]
    assert tuner.state_dict()["rng"] == rng_before  # gate() draws nothing
    # step(): a closed gate returns PLAIN without exploring (no randomness drawn).
    tuner.gate(64)
    assert [tuner.step(20) for _ in range(9)] == [PLAIN] * 9
    assert tuner.state_dict()["rng"] == rng_before
    picks = [tuner.step(20) for _ in range(200)]  # open, epsilon 1: uniform over both arms
    assert tuner.state_dict()["rng"] != rng_before
    assert set(picks) == {DRAFTER, PLAIN}  # P(one arm missing) = 2 * 2^-200


def test_gate_patience_zero_is_always_open():
    tuner = Tuner([DRAFTER, PLAIN], TunerConfig(switch_patience=0))
    assert all(tuner.gate(b) for b in (1000, 1, 64, 33))
    assert tuner.step(1000) == DRAFTER  # untried first, even at large batch


def test_summary_hand_computed():
    tuner = Tuner([PLAIN, DRAFTER, NGRAM])
    for reward in (10.0, 30.0, 20.0):
        tuner.update(3, PLAIN, reward)
    tuner.update(4, DRAFTER, 50.0)
    assert tuner.summary() == {
        "3-4": {
            "best": "drafter(3,4,8)",
            "pulls": {"plain": 3, "drafter(3,4,8)": 1, "ngram(2,2,4)": 0},
            "median": {"plain": 20.0, "drafter(3,4,8)": 50.0},
        }
    }


def _drive(tuner: Tuner, batches: list[int], noise: random.Random) -> list[Arm]:
    """One step()/update() per batch size: plain steps take 20 + b ms, the others gain less the
    more sequences run."""
    gain = {PLAIN: 0.0, DRAFTER: 0.6, NGRAM: 0.4}
    picks = []
    for batch in batches:
        arm = tuner.step(batch)
        mean = (1 + gain[arm] * (1 - batch / 64)) / (0.02 + 0.001 * batch)
        tuner.update(batch, arm, max(0.0, noise.gauss(mean, 2.0)))
        picks.append(arm)
    return picks


def test_state_round_trip_gives_identical_choices():
    arms = [PLAIN, DRAFTER, NGRAM]
    config = TunerConfig(epsilon=0.3, window=7, switch_batch=32)
    schedule = [64] * 20 + [b for b in range(40, 0, -1) for _ in range(4)] + [48] * 3 + [30] * 20 + [2] * 50
    cut = 20 + 4 * 8 + 5  # five steps at <= 32: the gate is half-way when the state is saved
    a = Tuner(arms, config, seed=11)
    _drive(a, schedule[:cut], random.Random(0))
    state = json.loads(json.dumps(a.state_dict()))
    assert state["gate_run"] == 5
    b = Tuner(arms, config, seed=999)  # a different seed: the loaded rng state must win
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    assert _drive(a, schedule[cut:], random.Random(1)) == _drive(b, schedule[cut:], random.Random(1))
    assert a.summary() == b.summary()
    assert len(a.summary()) >= 5  # several buckets were exercised
    # The line and the weighted rewards a tuner keeps up to date step by step (windows of 7, so
    # rewards left them) equal those a tuner computes afresh from the same windows.
    fresh = Tuner(arms, config)
    fresh.load_state_dict(a.state_dict())
    assert a.plain_cost() == fresh.plain_cost() and a.plain_cost()[1] > 0
    assert all(a._weighted_rewards(k) == fresh._weighted_rewards(k) for k in range(len(config.bucket_edges) + 1))

    with pytest.raises(ValueError):
        Tuner([PLAIN, DRAFTER], config).load_state_dict(state)
    with pytest.raises(ValueError):
        Tuner([PLAIN, NGRAM, DRAFTER], config).load_state_dict(state)  # order is part of identity
    with pytest.raises(ValueError):
        Tuner(arms, TunerConfig(bucket_edges=(4, 32))).load_state_dict(state)
    small = Tuner(arms, TunerConfig(window=2))
    small.load_state_dict(state)  # a smaller window keeps each arm's newest rewards
    assert small.state_dict()["rewards"] == [[w[-2:] for w in bucket] for bucket in state["rewards"]]


def test_the_tuned_decoder_rewards_tokens_per_second_per_running_sequence():
    # 12 tokens in 2 s from 3 running sequences: 2 tokens/s each, whether the step ran at the top
    # or the bottom of its bucket.
    from tailrl.speculative.decoder import StepReport, tuned

    tuner = Tuner([PLAIN], TunerConfig(switch_patience=0))
    decoder = tuned(tuner, {})
    for observer in decoder.observers:
        observer.observe(StepReport(PLAIN, batch_size=3, tokens=12, draft_seconds=0.0, verify_seconds=2.0))
    assert tuner.summary()["3-4"]["median"] == {"plain": 2.0}


def test_tuners_learn_together_through_take_new_and_absorb():
    config = TunerConfig(min_pulls=1, epsilon=0.0, switch_patience=0)
    a, b = Tuner([PLAIN, DRAFTER], config, seed=0), Tuner([PLAIN, DRAFTER], config, seed=1)
    a.update(3, PLAIN, 1.0)
    a.update(3, DRAFTER, 2.0)
    b.update(40, PLAIN, 5.0)
    rng_before = b.state_dict()["rng"]
    b.absorb(a.take_new())
    assert b.state_dict()["rng"] == rng_before
    assert a.take_new() == []  # each record is passed on once
    assert b.summary()["3-4"] == a.summary()["3-4"] and b.step(3) == DRAFTER  # explored by a, exploited by b
    assert b.take_new() == [(b.bucket(40), 0, 5.0, 40)]  # its own only: absorbed rewards are not passed on again
    b.absorb([(b.bucket(3), 0, 2.0)])  # a checkpoint's pending record from before batch sizes were kept
    assert b.state_dict()["rewards"][b.bucket(3)][0][-1] == [3, 2.0]  # its bucket's smallest size


def test_plain_step_line_hand_computed():
    assert plain_step_line({10: 0.03, 20: 0.05}) == pytest.approx((0.01, 0.002))
    assert plain_step_line({10: 0.03, 20: 0.05, 30: 0.07}) == pytest.approx((0.01, 0.002))
    # A negative intercept: through the origin, beta = sum(b s) / sum(b^2) = 0.7 / 500.
    assert plain_step_line({10: 0.01, 20: 0.03}) == pytest.approx((0.0, 0.0014))
    # One size, or a time that falls with the size: every size alike.
    assert plain_step_line({}) == plain_step_line({5: 0.01}) == plain_step_line({10: 0.05, 20: 0.03}) == (1.0, 0.0)


@pytest.mark.parametrize("drafter_faster", [False, True])
def test_arms_are_ranked_at_equal_batch_sizes(drafter_faster):
    # A plain step of b sequences takes 23 + 1.24 b ms (the Zen 4's line in the 33+ bucket), so
    # its reward per sequence is 1.6x higher at 33 than at 64. The drafter decodes 0.95x (or
    # 1.10x) plain's rate at whatever size it runs. Measured at the other end of the bucket from
    # plain, per-sequence medians would rank the two the wrong way round (the first assertion
    # says so); at equal sizes the faster one wins.
    def plain_rate(b: int) -> float:
        return 1.0 / (0.023 + 0.00124 * b)

    speed, plain_sizes, drafter_sizes = (1.10, [33, 36, 40], [64, 62]) if drafter_faster else (0.95, [64, 60], [34, 36])
    tuner = Tuner([PLAIN, DRAFTER], TunerConfig(epsilon=0.0, min_pulls=1))
    for b in plain_sizes:
        tuner.update(b, PLAIN, plain_rate(b))
    for b in drafter_sizes:
        tuner.update(b, DRAFTER, speed * plain_rate(b))
    raw = {arm: tuner.summary()["33+"]["median"][arm.label] for arm in (PLAIN, DRAFTER)}
    assert (raw[DRAFTER] > raw[PLAIN]) != drafter_faster  # the per-sequence rule would pick the slower
    assert tuner.plain_cost() == pytest.approx((0.023, 0.00124))
    assert tuner.best(48) == (DRAFTER if drafter_faster else PLAIN)


def test_state_from_before_batch_sizes_were_kept_loads():
    # Bare rewards (an older checkpoint) take their bucket's smallest size.
    tuner = Tuner([PLAIN, DRAFTER], TunerConfig(bucket_edges=(1, 2, 4)))
    state = tuner.state_dict()
    state["rewards"] = [[[2.0], []], [[1.0, 3.0], [4.0]], [[], []], [[5.0], []]]
    tuner.load_state_dict(state)
    assert tuner.state_dict()["rewards"] == [[[[1, 2.0]], []], [[[2, 1.0], [2, 3.0]], [[2, 4.0]]], [[], []],
                                             [[[5, 5.0]], []]]
