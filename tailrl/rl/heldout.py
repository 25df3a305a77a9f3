"""Held-out evaluation during RL: the policy's mean reward on a fixed set of problems.

A step's mean reward is measured on that step's new problems, so with a task whose difficulty
varies (the default `sums` draws its sizes from a heavy-tailed law) it swings by about 0.1 from
step to step whatever the policy does (docs/workload.md). The same problems, sampled with the
same seeds before and after training, show what the policy learned. Here: the first
`eval_problems` problems of the task's held-out stream (the one `tailrl sft` evaluates on, so
at step 0 with seed 0 the two see the same problems), one response each at the rollout's
sampling settings, scored by the run's reward, decoded plainly in this process on a copy of the
policy in the rollout dtype. Nothing here touches a random state the run reads: sampling is
keyed by (run seed, held-out stream, problem), so a run with evaluations samples the same
training tokens as one without.

Knows: tasks, the engine's generate, the run's reward. Does not know: the update, workers,
speculation.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tailrl.engine import Engine, EngineConfig, Progress, Request
from tailrl.model import Transformer
from tailrl.rl.rewards import ProblemReward, safe_rewards
from tailrl.rl.tasks import HELDOUT_STREAM, Problem, Task, extract_answer
from tailrl.sampling import SamplingParams, derive_seed
from tailrl.workers.runtimes import copy_weights


@dataclass(frozen=True)
class HeldOut:
    """The fixed problems and their encoded prompts."""

    problems: list[Problem]
    prompts: list[tuple[int, ...]]


def heldout_set(task: Task, seed: int, n: int, encode: Callable[[str], tuple[int, ...]]) -> HeldOut:
    problems = [task.sample(seed + HELDOUT_STREAM, i) for i in range(n)]
    return HeldOut(problems, [encode(p.question) for p in problems])


def evaluate(policy: Transformer, like: Transformer, heldout: HeldOut, seed: int, params: SamplingParams,
             max_new_tokens: int, engine_cfg: EngineConfig, tokenizer: Any, score: ProblemReward,
             timeout_s: float, on_progress: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """One response per held-out problem from `policy`'s weights, decoded on a copy of `like`
    (the rollout model: its dtype, and the engine's kernels); the record of eval.jsonl.
    on_progress: the engine's progress while it decodes."""
    t0 = time.perf_counter()
    model = copy.deepcopy(like)
    copy_weights(policy, model)  # `like` may be a worker's stale copy (Ray); the policy is current
    requests = [Request(p, derive_seed(seed, HELDOUT_STREAM, i), group=i) for i, p in enumerate(heldout.prompts)]
    out = Engine(model, engine_cfg).generate(requests, params, max_new_tokens, on_progress=on_progress)
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out]
    rewards = safe_rewards(score, list(zip(heldout.problems, texts)), timeout_s)
    n = len(out)
    return {
        "heldout_reward": sum(rewards.rewards) / n,
        "heldout_format_rate": sum(extract_answer(t) is not None for t in texts) / n,
        "heldout_len_mean": sum(len(c.token_ids) for c in out) / n,
        "heldout_truncated": sum(c.finish_reason == "length" for c in out),
        "heldout_problems": n,
        "heldout_s": time.perf_counter() - t0,
    }


def due(step: int, every: int, last: int) -> bool:
    """Whether the policy after `step` is evaluated: before the first step, every `every`
    steps, and after the last (`every` 0: never)."""
    return every > 0 and (step % every == 0 or step == last)


def missing(records: Sequence[dict[str, Any]], step: int) -> bool:
    return all(r.get("step") != step for r in records)
