"""A rollout's learned drafter, adapted during RL on what the trainer's forwards computed.

TLT trains its drafter on time the long tail leaves idle. A rollout with idle workers of its own
does that itself (tailrl.rollout.native's spot training, with two workers or more); a rollout
without (one in-process native engine, vLLM engines) trains it here instead: it is the
rollout's DrafterFeed (Rollout.feed), and the rollout closes its step at publish:

- observe: the trainer's forwards of this step's responses (their policy hidden states, which
  the rollout need not compute again) are kept as the next step's training data; a rollout
  whose engine keeps the hidden states it sampled with hands every response over itself
  (`add_own`: the groups the update skips too, in the dtype the drafter drafts from) and the
  trainer's forwards are not needed;
- work_idle: micro-steps on the core the update lends while it has no group queued, in the
  rollout's tail (tailrl.rl.update, "Idle work");
- publish (end_step here): a step whose idle time ran fewer than `drafter_min_steps`
  micro-steps runs the rest now, on the step's own time (after_s: what adapting cost the
  step); a step that trained becomes a new drafter version, which the rollout drafts with next.

Training lags one step and resumes exactly (tailrl.speculative.drafter.learner).

`AdaptingRollout` is what every engine's Rollout shares around its decoding: the feed, the
publish of a drafter version (the engine hands over how a version reaches it), the rollback
watch's tallies, and the report's assembly from the parts that decoded.

Knows: the learner's step, the floor of micro-steps, the report's drafter fields, how a generate
call's parts make its report. Does not know: engines, how a version reaches one, RL.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tailrl.model import Transformer
from tailrl.records import Completion
from tailrl.rollout.protocol import DrafterFeed, PolicyForward, Rollback, RolloutReport, decoding_report
from tailrl.speculative.drafter.learner import AdaptConfig, DrafterLearner
from tailrl.speculative.drafter.training import TrainSeq
from tailrl.speculative.watch import Tallies, VersionWatch, WatchConfig, add_tallies
from tailrl.stats import EngineStats, merge_stats


@dataclass(frozen=True)
class AdaptStep:
    """What one step's drafter training did, as the rollout report's drafter fields, and which
    version the engine drafts with next (`changed`: load drafting_weights() into it)."""

    drafting: int  # the version the next rollout drafts with
    changed: bool  # it differs from the version this step's rollout drafted with
    micro_steps: int
    loss: float | None  # mean micro-step loss; None without micro-steps
    idle_s: float  # CPU seconds trained on the lent core while the update had nothing queued
    after_s: float  # wall seconds trained after the update, on the step's own time
    rollback: Rollback | None = None

    def report_fields(self) -> dict[str, Any]:
        return {"drafter_published": self.drafting, "drafter_micro_steps": self.micro_steps,
                "drafter_loss": self.loss, "drafter_after_s": self.after_s, "idle_seconds_harvested": self.idle_s,
                "drafter_rollback": self.rollback}


class AdaptiveDrafter:
    """A DrafterLearner scheduled by the Rollout protocol's calls (module doc): the rollout's
    DrafterFeed (tailrl.rollout.protocol). With rollback on, every version
    it publishes is watched (tailrl.speculative.watch): the engine records each rollout's
    first-token acceptance per draft shape (`record`), and a version that collapsed is rolled
    back at the next publish to the last version that drafted well, the learner with it (its
    training goes on from that version's weights); a version whose weights are not finite never
    drafts."""

    def __init__(self, learner: DrafterLearner, min_steps: int, rollback: WatchConfig | None = None,
                 state: dict[str, Any] | None = None, own_data: bool = False):
        self.learner, self.min_steps, self.rollback = learner, min_steps, rollback
        self.own_data = own_data  # the rollout hands over its own responses (add_own), not the trainer
        if state is not None and "learner" not in state:  # a checkpoint from before the watch: the learner's alone
            state = {"learner": state, "watch": None, "reference_weights": None}
        if state is not None:
            learner.load_state_dict(state["learner"])
        # The drafting version's weights are the learner's as of its last end_step (a snapshot
        # no one writes to); the reference's too until another version drafts.
        self._drafting_w = self._reference_w = learner.state_dict()["weights"]
        self.drafting = learner.version
        self.watch = VersionWatch(rollback or WatchConfig(), reference=self.drafting, current=self.drafting)
        if state is not None and state["watch"] is not None:
            self.watch.load_state_dict(state["watch"])
            self.drafting = self.watch.current
            if state["reference_weights"] is not None:
                self._reference_w = state["reference_weights"]

    @classmethod
    def open(cls, drafter: Path, target: Transformer, cfg: AdaptConfig,
             state: dict[str, Any] | None, own_data: bool = False) -> AdaptiveDrafter:
        """The drafter in `drafter` (tailrl's drafter files) for `target`, resuming `state`;
        own_data: the rollout hands over its responses itself (add_own)."""
        rollback = WatchConfig(ratio=cfg.drafter_rollback_ratio) if cfg.drafter_rollback else None
        return cls(DrafterLearner.load(drafter, target, cfg), cfg.drafter_min_steps, rollback, state, own_data)

    @property
    def version(self) -> int:
        """The version the rollout drafts with."""
        return self.drafting

    def observe(self, forwards: Sequence[PolicyForward]) -> None:
        if not self.own_data:
            self.learner.add([TrainSeq(f.tokens, f.hidden, f.prompt_len) for f in forwards])

    def add_own(self, seqs: Sequence[TrainSeq]) -> None:
        """Every response the rollout sampled this step, with the hidden states it sampled with,
        longest first: a step's micro-steps cover the start of its data, and the long responses
        hold the late positions where drafting is hardest."""
        self.learner.add(sorted(seqs, key=lambda s: s.prompt_len - s.tokens.shape[0]))

    def has_idle_work(self) -> bool:
        return self.learner.pending()

    def work_idle(self, stop: Callable[[], bool]) -> None:
        self.learner.work(stop)

    def record(self, tallies: Tallies) -> None:
        """A rollout's verifies by the drafting version, per draft shape (tailrl.speculative.watch)."""
        self.watch.record(self.drafting, tallies)

    def end_step(self, policy: Transformer) -> AdaptStep:
        """Judge the version that drafted this step (a collapsed one is rolled back), close the
        step (the floor of micro-steps first), then start the next on `policy`'s weights, the
        model whose forwards the next step observes."""
        before = self.drafting
        rollback = self._judge()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self.learner.work(lambda: self.learner.steps_this_step() >= self.min_steps)
        after_s, after_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        stats = self.learner.end_step()
        if stats.micro_steps:
            rollback = self._adopt(stats.version) or rollback
        self.learner.begin_step(policy)
        return AdaptStep(self.drafting, self.drafting != before, stats.micro_steps, stats.loss,
                         max(stats.seconds - after_cpu, 0.0), after_s, rollback)

    def publish(self, policy: Transformer, load: Callable[[AdaptStep, dict[str, torch.Tensor]], None]) -> AdaptStep:
        """The step closes on `policy` (end_step), and a version other than the one that drafted
        goes to `load(step, its fp32 weights)`, which puts it into the engine: the publish of a
        drafter version, whatever the engine."""
        step = self.end_step(policy)
        if step.changed:
            load(step, self.drafting_weights())
        return step

    def _judge(self) -> Rollback | None:
        """The drafting version's verdict: trusted, it becomes the reference; collapsed, the
        reference drafts again and the learner goes back to its weights."""
        verdict = self.watch.verdict()
        if verdict is None or self.rollback is None:
            return None
        if verdict.trusted:
            self.watch.promote()
            self._reference_w = self._drafting_w
        if not verdict.collapsed:
            return None
        bad = self.drafting
        self.learner.restore(self._reference_w)
        self._draft(self.watch.reference, self._reference_w)
        return Rollback(bad, self.drafting, "acceptance", verdict.verifies, verdict.rate, verdict.reference_rate)

    def _adopt(self, version: int) -> Rollback | None:
        """The learner's new version drafts next, unless its weights are not finite: then the
        learner goes back to the drafting version's, which goes on drafting."""
        weights = self.learner.state_dict()["weights"]
        if self.rollback is not None and not all(bool(torch.isfinite(w).all()) for w in weights.values()):
            self.learner.restore(self._drafting_w)
            self.learner.end_step()  # commits the restored weights (no micro-step since: no version)
            return Rollback(version, self.drafting, "non-finite")
        self._draft(version, weights)
        return None

    def _draft(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.watch.drafting(version)
        self.drafting, self._drafting_w = version, weights

    def drafting_weights(self) -> dict[str, torch.Tensor]:
        """The drafting version's fp32 state dict (not to be written to)."""
        return self._drafting_w

    def state_dict(self) -> dict[str, Any]:
        reference = None if self.watch.reference == self.drafting else self._reference_w
        return {"learner": self.learner.state_dict(), "watch": self.watch.state_dict(),
                "reference_weights": reference}


class AdaptingRollout:
    """What every engine's Rollout shares around its decoding (native, vLLM in process or on Ray):
    the adapting drafter as its feed (None: a rollout whose drafter adapts otherwise, or not at
    all), its step closed and a new version handed to the engine at publish (`publish_drafter`),
    each generate call's report assembled (`close_rollout`: the parts' stats merged, the drafting
    version's acceptance to its rollback watch, the drafter fields filled in), and `report`. An
    engine supplies decoding, and how a version reaches its engine (the `load` it hands over)."""

    adapt: AdaptiveDrafter | None
    _report: RolloutReport | None = None  # the last generate call's
    _adapted: AdaptStep | None = None  # what the last publish trained

    def feed(self) -> DrafterFeed | None:
        return self.adapt

    def publish_drafter(self, policy: Transformer,
                        load: Callable[[AdaptStep, dict[str, torch.Tensor]], None]) -> None:
        """After the policy's weights: the adapting drafter's publish (AdaptiveDrafter.publish),
        a new version into the engine by `load`."""
        if self.adapt is not None:
            self._adapted = self.adapt.publish(policy, load)

    def close_rollout(self, stats: Sequence[EngineStats], tallies: Sequence[Tallies],
                      completions: Sequence[Completion], ceiling_depth: int, bucket_edges: Sequence[int],
                      drafted_with: int, drafter_counts: tuple[int, int] | None = None,
                      seconds: float | None = None, **fields: Any) -> EngineStats:
        """A generate call's report from its parts (shards or engines that decoded side by side):
        their stats merged (returned; `seconds`, the call's wall time, where it is not the longest
        part's), their first-token tallies to the drafting version's watch; `drafted_with` the
        version it drafted with, `drafter_counts` that drafter's (emitted, verifies) (None: every
        draft was the drafter's), `fields` the engine's own report fields."""
        merged = merge_stats(stats)
        if seconds is not None:
            merged.seconds = seconds
        if self.adapt is not None:
            merged_tallies: Tallies = {}
            for t in tallies:
                add_tallies(merged_tallies, t)
            self.adapt.record(merged_tallies)
        emitted, verifies = drafter_counts or (merged.spec.emitted, merged.spec.verify_steps)
        report = decoding_report(merged, completions, ceiling_depth, bucket_edges, drafted_with,
                                 emitted / verifies if verifies else None)
        self._report = dataclasses.replace(report, **{"drafter_published": drafted_with, **fields})
        return merged

    def report(self) -> RolloutReport:
        """The last generate call's report, with what the publish after it trained (the idle
        time the engine did not use is then unknown: the update's idle core trained)."""
        if self._report is None:
            raise RuntimeError("no rollout has run yet")
        if self._adapted is None:
            return self._report
        return dataclasses.replace(self._report, idle_seconds_left=None, **self._adapted.report_fields())
