"""What a generate call's decoding did, counted the same way by every engine: tokens and time,
each decode step's batch, arm and tokens, and speculation's counters. tailrl.speculative.report
turns them into a rollout's report.

Knows: counters. Does not know: how any engine decodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

# Response positions (tokens emitted before a verify) where acceptance is tallied apart: a drafter
# trained on short responses drafts worse along long ones (docs/results.md).
POSITION_EDGES = (512, 1024, 2048)


def position_bucket(position: int) -> int:
    """Index of the POSITION_EDGES bucket [edges[i-1], edges[i]) holding a response position."""
    return sum(position >= e for e in POSITION_EDGES)


def position_label(b: int) -> str:
    """Bucket b as text: "0-512", ..., "2048+"."""
    lo = POSITION_EDGES[b - 1] if b > 0 else 0
    return f"{lo}+" if b == len(POSITION_EDGES) else f"{lo}-{POSITION_EDGES[b]}"


@dataclass
class SpecStats:
    """Speculation counters for one generate call."""

    verify_steps: int = 0  # sequence-verifies (one per row per speculative step)
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens emitted by speculative steps (accepted + bonus)
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[d]: verifies accepting exactly d drafts
    depth_verifies: list[int] = field(default_factory=list)  # depth_verifies[d]: verifies of drafts d tokens deep
    spec_steps: int = 0  # batched speculative steps (each verifies every running row)
    draft_seconds: float = 0.0  # proposing trees
    verify_seconds: float = 0.0  # target forward, acceptance walk, cache compaction, emission
    # Per response-position bucket (POSITION_EDGES: where in its response a verify started):
    # sequence-verifies and the tokens they emitted. Fixed length, so shards add element-wise.
    position_verifies: list[int] = field(default_factory=lambda: [0] * (len(POSITION_EDGES) + 1))
    position_emitted: list[int] = field(default_factory=lambda: [0] * (len(POSITION_EDGES) + 1))
    plain_steps: int = 0  # plain steps taken by a speculative decoder (e.g. the tuner's plain arm)
    plain_tokens: int = 0
    plain_seconds: float = 0.0

    @property
    def accept_len(self) -> float:
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def count_depth(self, depth: int, verifies: int) -> None:
        self.depth_verifies.extend([0] * (depth + 1 - len(self.depth_verifies)))
        self.depth_verifies[depth] += verifies

    def accept_len_by_position(self) -> dict[str, float]:
        """accept_len per response-position bucket that saw a verify."""
        return {position_label(b): e / v for b, (v, e) in enumerate(zip(self.position_verifies, self.position_emitted))
                if v}



class StepRecord(NamedTuple):
    """One decode step of a generate call."""

    end: float  # seconds since the call started, at the step's end
    batch: int  # running sequences the step advanced
    arm: str  # label of the arm that decoded it ("plain" for plain decoding)
    tokens: int  # tokens it emitted (after EOS / stop / length cuts)
    seconds: float  # its wall time



@dataclass
class EngineStats:
    tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0
    preempted: int = 0  # sequences taken out of a full KV cache, their KV recomputed on readmission
    cache_resizes: int = 0  # times the KV cache grew (tailrl.engine `_make_room`)
    timeline: list[StepRecord] = field(default_factory=list)  # one per decode step
    spec: SpecStats = field(default_factory=SpecStats)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def merge_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """One EngineStats for shards that ran side by side: counts add up, wall seconds are the
    longest shard's, timelines and histograms are concatenated / added."""
    out = EngineStats()
    for part in parts:
        for f in dataclasses.fields(EngineStats):
            a, b = getattr(out, f.name), getattr(part, f.name)
            if f.name == "seconds":
                setattr(out, f.name, max(a, b))
            elif f.name == "spec":
                for g in dataclasses.fields(a):
                    x, y = getattr(a, g.name), getattr(b, g.name)
                    if isinstance(x, list):  # accept_hist: element-wise
                        x += [0] * (len(y) - len(x))
                        setattr(a, g.name, [u + (y[i] if i < len(y) else 0) for i, u in enumerate(x)])
                    else:
                        setattr(a, g.name, x + y)
            elif isinstance(a, list):
                setattr(out, f.name, a + list(b))
            else:
                setattr(out, f.name, a + b)
    return out


# What a generate call reports (its stats line), the same fields whichever engine decoded.
Summary = dict[str, float | list[int]]


def summary_line(tokens: int, seconds: float, speculating: bool, accept_len: float, proposed: int, accepted: int,
                 verify_steps: int, accept_hist: list[int]) -> Summary:
    """`tailrl generate`'s stats line: tokens and time, and with speculation its counters."""
    out: Summary = {"tokens": tokens, "seconds": round(seconds, 4),
                    "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0}
    if speculating:
        out.update(accept_len=round(accept_len, 3), proposed=proposed, accepted=accepted, verify_steps=verify_steps,
                   accept_hist=accept_hist)
    return out
