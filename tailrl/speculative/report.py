"""What a rollout's decoding did: the adaptive engine's observability, one generate call at a time.

Summarises an EngineStats (its StepRecord timeline and SpecStats) into JSON-ready fields:
- sd_fraction: share of decode-step tokens emitted by speculative steps;
- plain_s / draft_s / verify_s: decode time in plain steps, proposing trees, verifying them;
- accept_hist: verifies that accepted exactly d drafts, d = 0, 1, ... (acceptance by depth);
- accept_len_by_position: accept_len by where in its response a verify started ("0-512", ...,
  "2048+"; the engines that count it: tailrl's own);
- by_bucket: per running-batch-size bucket (the tuner's) and arm: steps, tokens, seconds,
  accept_len (tokens emitted per sequence-step, the bonus token included; 1 for plain);
- arm_by_bucket: the arm that decoded most steps in each bucket;
- batch_timeline: [start, end, batch, arm] run-length segments of the steps, for plots;
- tail_s / tail_share: decode time with at most TAIL_BATCH sequences running, in seconds and
  as a share of the engine's time (prefill included): the long tail, where the batch is too
  small to use the hardware and speculation pays;
- chain_ceiling: the accept_len the target itself would reach as a chain drafter (headroom).

Knows: StepRecord, SpecStats, bucket edges. Does not know: how arms are chosen or executed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tailrl.stats import EngineStats, position_label
from tailrl.tuner import bucket_index, bucket_label

# Running sequences at or below which a decode step counts as the tail.
TAIL_BATCH = 8


@dataclass(frozen=True)
class Decoding:
    """The fields above for one generate call; tailrl.rollout.protocol.RolloutReport has them
    as its own (it extends this class)."""

    tail_s: float
    tail_share: float
    sd_fraction: float
    plain_s: float
    draft_s: float
    verify_s: float
    accept_hist: list[int]
    accept_len_by_position: dict[str, float]  # by where in its response a verify started (tailrl.stats)
    verifies_by_position: dict[str, int]  # the verifies behind each of those
    by_bucket: dict[str, dict[str, dict[str, float]]]
    arm_by_bucket: dict[str, str]
    batch_timeline: list[list[Any]]
    # Sequences the native engine took out of a full KV cache, their KV recomputed on readmission
    # (tailrl.engine); vLLM's scheduler preempts on its own and is not counted.
    kv_preempted: int


def rollout_report(stats: EngineStats, bucket_edges: Sequence[int]) -> Decoding:
    """The fields above for one generate call."""
    timeline = stats.timeline
    decode_tokens = sum(r.tokens for r in timeline)
    spec_tokens = sum(r.tokens for r in timeline if r.arm != "plain")
    cells: dict[int, dict[str, dict[str, float]]] = {}
    for r in timeline:
        cell = cells.setdefault(bucket_index(bucket_edges, r.batch), {}).setdefault(
            r.arm, {"steps": 0, "rows": 0, "tokens": 0, "seconds": 0.0}
        )
        cell["steps"] += 1
        cell["rows"] += r.batch
        cell["tokens"] += r.tokens
        cell["seconds"] += r.seconds
    by_bucket = {
        bucket_label(bucket_edges, b): {
            arm: {
                "steps": c["steps"],
                "tokens": c["tokens"],
                "seconds": c["seconds"],
                "accept_len": c["tokens"] / c["rows"],
            }
            for arm, c in sorted(arms.items())
        }
        for b, arms in sorted(cells.items())
    }
    busy = sum(r.seconds for r in timeline) + stats.prefill_seconds
    tail = sum(r.seconds for r in timeline if r.batch <= TAIL_BATCH)
    return Decoding(
        tail_s=tail,
        tail_share=tail / busy if busy else 0.0,
        sd_fraction=spec_tokens / decode_tokens if decode_tokens else 0.0,
        plain_s=sum(r.seconds for r in timeline if r.arm == "plain"),
        draft_s=stats.spec.draft_seconds,
        verify_s=stats.spec.verify_seconds,
        accept_hist=list(stats.spec.accept_hist),
        accept_len_by_position=stats.spec.accept_len_by_position(),
        verifies_by_position={position_label(b): v for b, v in enumerate(stats.spec.position_verifies) if v},
        by_bucket=by_bucket,
        arm_by_bucket={b: max(arms, key=lambda a: arms[a]["steps"]) for b, arms in by_bucket.items()},
        batch_timeline=segments(stats),
        kv_preempted=stats.preempted,
    )


def segments(stats: EngineStats) -> list[list[Any]]:
    """Consecutive steps with the same batch size and arm merged: [start_s, end_s, batch, arm],
    times rounded to the millisecond (a metrics line carries hundreds of them)."""
    out: list[list[Any]] = []
    for r in stats.timeline:
        if out and out[-1][2] == r.batch and out[-1][3] == r.arm:
            out[-1][1] = round(r.end, 3)
        else:
            out.append([round(r.end - r.seconds, 3), round(r.end, 3), r.batch, r.arm])
    return out


def chain_ceiling(top1: Sequence[Sequence[bool]], depth: int) -> float | None:
    """accept_len of the target itself as a depth-`depth` chain drafter, replayed on responses.

    That drafter proposes the target's own most likely tokens, so a draft is accepted where the
    sampled token was the top-1 one (Completion.top1). A chain draft token is accepted with the
    target's probability of it, which the top-1 token maximises: this is what the best chain
    drafter of that depth could reach on these responses (the greedy chain, not a proof of
    optimality over every chain). Replayed as the engine decodes: the first token comes from
    prefill, then each verify emits the accepted drafts plus one, cut at the response's end.
    None when no response has a second token.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    verifies = emitted = 0
    for flags in top1:
        n, t = len(flags), 1
        while t < n:
            accepted = 0
            while accepted < depth and t + accepted < n and flags[t + accepted]:
                accepted += 1
            emit = min(accepted + 1, n - t)
            verifies, emitted, t = verifies + 1, emitted + emit, t + emit
    return emitted / verifies if verifies else None
