"""The tuner's draft lengths inside vLLM (tailrl.rollout.vllm.speculation): which step's time an
arm is rewarded with.

vLLM verifies a step's drafts in the next step, so a step's time is the verify of the arm chosen
before it plus the drafting for the arm chosen for it. Hand-made costs stand in for the engine
(Steering takes a step's seconds, rows and tokens as given): verifying K drafts of 4 rows takes
10 + K ms and emits 4 (1 + K / 2) tokens; drafting K tokens takes 5 K ms.
"""

from __future__ import annotations

import pytest

from tailrl.rollout.vllm.outputs import StepCounters
from tailrl.rollout.vllm.speculation import Schedule, Steering
from tailrl.tuner import PLAIN, Arm, TunerConfig


def test_an_arm_is_rewarded_only_with_steps_that_draft_with_the_arm_they_verify():
    lookup = [0] * 8  # the engine's draft length by running batch size
    schedule = Schedule(lookup, [2, 6], TunerConfig(switch_patience=0), None, seed=0)
    steering = Steering(schedule, "eagle", StepCounters())
    steering.begin()
    rows, drafted, switches = 4, 0, 0  # drafted: the K the step before drafted
    for _ in range(400):
        steering.before(rows)
        k = lookup[0]
        switches += k != drafted
        steering.after((10 + drafted + 5 * k) / 1e3, rows, rows * (1 + drafted // 2), False)
        drafted = k
    assert switches >= 10  # the tuner explored, so steps between two arms happened
    # Every reward is an arm's own cost: its verify and its own drafting, never another arm's.
    own = {arm: rows * (1 + k // 2) / ((10 + k + 5 * k) / 1e3) / rows
           for arm, k in ((PLAIN, 0), (Arm("drafter", 2, 1, 2), 2), (Arm("drafter", 6, 1, 6), 6))}
    tuner = schedule.tuner
    windows = tuner.state_dict()["rewards"][tuner.bucket(rows)]  # per arm, in the tuner's order
    for arm, window in zip(tuner.arms, windows):
        got = [reward for _, reward in window]  # (batch size, reward) pairs
        assert len(got) >= 3 and got == pytest.approx([own[arm]] * len(got), rel=1e-12), arm.label
    assert tuner.best(rows) == PLAIN  # 100 tokens/s a row against 90.9 and 87.0
