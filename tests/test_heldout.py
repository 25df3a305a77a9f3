"""The held-out gain's arithmetic (tailrl.rl.heldout.gain), by hand."""

from __future__ import annotations

import math

import pytest

from tailrl.rl.heldout import gain, standard_error


def record(step: int, rewards: list[float]) -> dict:
    return {"step": step, "heldout_reward": sum(rewards) / len(rewards), "heldout_reward_se": standard_error(rewards),
            "heldout_rewards": rewards, "heldout_problems": len(rewards)}


def test_standard_error_by_hand():
    # mean 0.5, sample variance (4 x 0.25) / 3 = 1/3, se = sqrt(1/3 / 4)
    assert standard_error([1.0, 0.0, 1.0, 0.0]) == pytest.approx(math.sqrt(1 / 12))
    assert standard_error([0.7]) == 0.0


def test_the_gain_is_paired_by_problem():
    # Differences 0, 1, 0, 0: mean 0.25, sample sd 0.5, se 0.25. Unpaired it would be
    # hypot(0.2887, 0.25) = 0.382: the paired error is smaller because a problem's difficulty cancels.
    g = gain([record(10, [1.0, 1.0, 1.0, 0.0]), record(0, [1.0, 0.0, 1.0, 0.0])])
    assert (g.first_step, g.last_step, g.before, g.after, g.problems) == (0, 10, 0.5, 0.75, 4)
    assert g.delta == pytest.approx(0.25) and g.se == pytest.approx(0.25)
    assert g.line() == ("held-out reward 0.500 at step 0 -> 0.750 at step 10: +0.250 +- 0.250 "
                        "(one standard error, 4 problems)")


def test_records_without_per_problem_rewards_fall_back_to_independent_means():
    a, b = record(0, [1.0, 0.0, 1.0, 0.0]), record(30, [1.0, 1.0, 1.0, 0.0])
    del a["heldout_rewards"]
    assert gain([a, b]).se == pytest.approx(math.hypot(math.sqrt(1 / 12), 0.25))


def test_no_gain_from_one_evaluation_or_different_problem_counts():
    assert gain([record(0, [1.0, 0.0])]) is None
    assert gain([record(0, [1.0, 0.0]), record(5, [1.0, 0.0, 1.0])]) is None
