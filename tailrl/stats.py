"""What a generate call's decoding did, counted the same way by every engine: tokens and time,
each decode step's batch, arm and tokens, and speculation's counters. tailrl.speculative.report
turns them into a rollout's report.

Knows: counters. Does not know: how any engine decodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class SpecStats:
    """Speculation counters for one generate call."""

    verify_steps: int = 0  # sequence-verifies (one per row per speculative step)
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens emitted by speculative steps (accepted + bonus)
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[d]: verifies accepting exactly d drafts
    spec_steps: int = 0  # batched speculative steps (each verifies every running row)
    draft_seconds: float = 0.0  # proposing trees
    verify_seconds: float = 0.0  # target forward, acceptance walk, cache compaction, emission
    plain_steps: int = 0  # plain steps taken by a speculative decoder (e.g. the tuner's plain arm)
    plain_tokens: int = 0
    plain_seconds: float = 0.0

    @property
    def accept_len(self) -> float:
        return self.emitted / self.verify_steps if self.verify_steps else 0.0



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

