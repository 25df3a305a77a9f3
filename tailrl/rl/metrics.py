"""A step's metrics record (one line of metrics.jsonl): its rewards, responses, the rollout's
report, the update's statistics, where its time and memory went.

Knows: what a step produced (tailrl.rl.phases.StepWork), the rollout's report. Does not know: how
the step ran, where the record is written (tailrl.rl.run_dir).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from tailrl.records import Completion
from tailrl.rl.phases import StepWork
from tailrl.rl.tasks import extract_answer
from tailrl.rollout.protocol import RolloutReport


def tokens_digest(completions: Sequence[Completion]) -> str:
    """A fingerprint of a rollout's token ids in request order: two runs sampled the same tokens
    iff their digests match (what `tailrl bench train` compares)."""
    h = hashlib.sha256()
    for c in completions:
        h.update(np.asarray(c.token_ids, dtype=np.int64).tobytes())
        h.update(b"|")  # a boundary, so [1, 2] [3] differs from [1] [2, 3]
    return h.hexdigest()


def step_metrics(step: int, max_new_tokens: int, work: StepWork, grad_norm: float, times: dict[str, float],
                 rollout: RolloutReport, lr: float) -> dict[str, object]:
    """The metrics record of one step (one line of metrics.jsonl)."""
    completions, rewards, stats = work.completions, work.rewards, work.stats
    lens = np.array([len(c.token_ids) for c in completions])
    r = np.array(rewards.rewards)
    return {
        "step": step,
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "format_rate": float(np.mean([extract_answer(t) is not None for t in work.texts])),
        "groups_skipped": work.skipped,
        "reward_failures": rewards.failures,
        "reward_timeouts": rewards.timeouts,
        "response_len_mean": float(lens.mean()),
        "response_len_p50": float(np.percentile(lens, 50)),
        "response_len_p90": float(np.percentile(lens, 90)),
        "response_len_max": int(lens.max()),
        "truncated": sum(c.finish_reason == "length" for c in completions),
        "max_new_tokens": max_new_tokens,
        "tokens_generated": int(lens.sum()),
        **rollout.metrics(),  # decoding, speculation, the tail, the drafter and spot training
        **times,
        "rollout_share": times["rollout_s"] / times["step_s"] if times["step_s"] else 0.0,
        "loss": stats.loss,
        "pg_loss": stats.pg_loss,
        "kl": stats.kl,
        "clip_fraction": stats.clip_fraction,
        "ratio_mean": stats.ratio_mean,
        "ratio_max": stats.ratio_max,
        "capped_fraction": stats.capped_fraction,
        "mismatch_kl": stats.mismatch_kl,
        "grad_norm": grad_norm,
        "train_tokens": stats.tokens,
        "lr": lr,
        "response_lens": lens.tolist(),
        "rewards": r.tolist(),
        "tokens_sha256": tokens_digest(completions),
    }


def step_times(work: StepWork, step_s: float) -> dict[str, float]:
    """Where a step's time went: rollout (decoding), rewards, the update's part after the
    rollout (gradient left, optimizer step, publishing), and the gradient computed during it."""
    w = work.times
    return {"rollout_s": w["rollout_s"], "reward_s": w["reward_s"],
            "train_s": step_s - w["rollout_s"] - w["reward_s"], "step_s": step_s,
            "update_in_rollout_s": w["update_in_rollout_s"], "groups_in_rollout": w["groups_in_rollout"]}


def memory_metrics(rollout_gb: float | None, update_gb: float | None, end_gb: float | None,
                   held_gb: float | None, budget_gb: float | None) -> dict[str, float | None]:
    """The step's resident peak (its rollout's, its update's and its publish's: GiB, None where
    the kernel cannot tell, tailrl.memory), the rollout's and the update's (from the rollout's end
    to the optimizer step) on their own, what stays resident at the step's end (after the update's
    memory is handed back and the policy published: what the run holds from one step to the next,
    where a leak would show) and the budget the run was sized to. The kernel's high-water mark
    includes the resident size at the time it is read, so a later read can be a few pages lower."""
    known = [x for x in (rollout_gb, update_gb, end_gb) if x is not None]
    return {"peak_rss_gb": max(known) if known else None, "rollout_peak_rss_gb": rollout_gb,
            "update_peak_rss_gb": update_gb, "held_rss_gb": held_gb, "memory_budget_gb": budget_gb}
