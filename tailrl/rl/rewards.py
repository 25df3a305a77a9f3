"""Rewards: completion -> float, with user reward functions that may crash or hang.

A user reward is `fn(prompt, completion, answer) -> float` (prompt = the problem's question
text, answer = its reference answer). The default reward is problem-aware: it extracts the
answer from the completion and lets the task score it. `safe_rewards` runs any of them so that
a failure costs one sample's reward (scored 0, counted, logged), never the run.

Knows: tasks, the answer format, user reward functions. Does not know: tokens, models,
advantages.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tailrl.rl.tasks import Problem, Task, extract_answer

__all__ = [
    "ProblemReward",
    "RewardBatch",
    "RewardFn",
    "format_reward",
    "from_reward_fn",
    "load_reward",
    "safe_rewards",
    "task_reward",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str, str], float]  # (prompt, completion, answer) -> reward
ProblemReward = Callable[[Problem, str], float]  # (problem, completion) -> reward


def format_reward(completion: str) -> float:
    """1.0 if the completion carries a non-empty answer in the fixed format, else 0.0."""
    return 1.0 if extract_answer(completion) is not None else 0.0


def task_reward(task: Task, format_weight: float = 0.0) -> ProblemReward:
    """The default reward: task.score of the extracted answer (0 when the format is missing).

    With format_weight w the reward is (1 - w) * correctness + w * format_reward, a common
    warm-up for weak models that rarely use the format; w = 0 rewards correctness only.
    """
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")

    def reward(problem: Problem, completion: str) -> float:
        answer = extract_answer(completion)
        correct = 0.0 if answer is None else task.score(problem, answer)
        fmt = 0.0 if answer is None else 1.0
        return (1.0 - format_weight) * correct + format_weight * fmt

    return reward


def from_reward_fn(fn: RewardFn) -> ProblemReward:
    """Adapt a user reward (prompt, completion, answer) to the problem-aware form."""

    def reward(problem: Problem, completion: str) -> float:
        return fn(problem.question, completion, problem.answer)

    return reward


def load_reward(spec: str) -> RewardFn:
    """Import a user reward function from "package.module:function"."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward spec {spec!r} must look like 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"reward module {module_name!r} not found ({e}); is it on PYTHONPATH?") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


@dataclass(frozen=True)
class RewardBatch:
    rewards: list[float]
    failures: int  # raised, or returned something that is not a finite number
    timeouts: int


def _call_in_daemon(fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[str, Any]:
    """("ok", value) | ("error", exception) | ("timeout", None)."""
    box: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            box.append(("ok", fn(*args)))
        except BaseException as e:  # noqa: BLE001 - any failure of user code scores 0
            box.append(("error", e))

    worker = threading.Thread(target=run, name="tailrl-reward", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return box[0] if box else ("timeout", None)


def safe_rewards(fn: Callable[..., float], items: Sequence[tuple], timeout_s: float) -> RewardBatch:
    """fn(*item) for every item; a call that raises, returns a non-number or exceeds timeout_s
    scores 0 and is counted, and the batch logs one warning. Rewards are clamped to finite.

    Each call runs in its own daemon thread so a hang can be abandoned. Python cannot kill a
    thread: a hung call keeps running in the background (holding the GIL when it spins) until
    it returns or the process exits; being a daemon it never blocks exit. A reward that hangs
    routinely should be fixed, not tolerated.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    rewards: list[float] = []
    failures = timeouts = 0
    first_error: BaseException | None = None
    for item in items:
        status, value = _call_in_daemon(fn, tuple(item), timeout_s)
        if status == "ok":
            try:
                reward = float(value)
            except (TypeError, ValueError) as e:
                status, value = "error", TypeError(f"reward returned {value!r}, not a number ({e})")
            else:
                if reward != reward or reward in (float("inf"), float("-inf")):
                    status, value = "error", ValueError(f"reward returned {reward}")
        if status == "ok":
            rewards.append(reward)
            continue
        rewards.append(0.0)
        if status == "timeout":
            timeouts += 1
        else:
            failures += 1
            first_error = first_error or value
    if failures or timeouts:
        logger.warning(
            "%d of %d rewards failed and %d timed out after %.3g s; they scored 0. First error: %r",
            failures, len(rewards), timeouts, timeout_s, first_error,
            exc_info=first_error,
        )
    return RewardBatch(rewards=rewards, failures=failures, timeouts=timeouts)
