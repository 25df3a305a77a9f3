"""A rollout's learned drafter, adapted during RL on what the trainer's forwards computed.

TLT trains its drafter on time the long tail leaves idle. A rollout with idle workers of its own
does that itself (tailrl.rollout.native's spot training, with two workers or more); a rollout
without (one in-process native engine, an in-process vLLM engine) trains it here instead, with
the Rollout protocol's calls:

- observe: the trainer's forwards of this step's responses (their policy hidden states, which
  the rollout need not compute again) are kept as the next step's training data;
- work_idle: micro-steps on the core the update lends while it has no group queued, in the
  rollout's tail (tailrl.rl.update, "Idle work");
- publish (end_step here): a step whose idle time ran fewer than `drafter_min_steps`
  micro-steps runs the rest now, on the step's own time (after_s: what adapting cost the
  step); a step that trained becomes a new drafter version, which the rollout drafts with next.

Training lags one step and resumes exactly (tailrl.speculative.drafter.learner).

Knows: the learner's step, the floor of micro-steps, the report's drafter fields. Does not know:
engines, how a version reaches one, RL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tailrl.model import Transformer
from tailrl.rollout.protocol import PolicyForward
from tailrl.speculative.drafter.learner import AdaptConfig, DrafterLearner
from tailrl.speculative.drafter.training import TrainSeq


@dataclass(frozen=True)
class AdaptStep:
    """What one step's drafter training did, as the rollout report's drafter fields."""

    version: int  # after the step: a new one when it trained
    micro_steps: int
    loss: float | None  # mean micro-step loss; None without micro-steps
    idle_s: float  # CPU seconds trained on the lent core while the update had nothing queued
    after_s: float  # wall seconds trained after the update, on the step's own time

    def report_fields(self) -> dict[str, Any]:
        return {"drafter_published": self.version, "drafter_micro_steps": self.micro_steps,
                "drafter_loss": self.loss, "drafter_after_s": self.after_s, "idle_seconds_harvested": self.idle_s}


class AdaptiveDrafter:
    """A DrafterLearner scheduled by the Rollout protocol's calls (module doc); its idle work is
    what a rollout hands the update (tailrl.rl.update.IdleWork)."""

    def __init__(self, learner: DrafterLearner, min_steps: int):
        self.learner, self.min_steps = learner, min_steps

    @classmethod
    def open(cls, drafter: Path, target: Transformer, cfg: AdaptConfig,
             state: dict[str, Any] | None) -> AdaptiveDrafter:
        """The drafter in `drafter` (tailrl's drafter files) for `target`, resuming `state`."""
        learner = DrafterLearner.load(drafter, target, cfg)
        if state is not None:
            learner.load_state_dict(state)
        return cls(learner, cfg.drafter_min_steps)

    @property
    def version(self) -> int:
        return self.learner.version

    def observe(self, forwards: Sequence[PolicyForward]) -> None:
        self.learner.add([TrainSeq(f.tokens, f.hidden, f.prompt_len) for f in forwards])

    def has_idle_work(self) -> bool:
        return self.learner.pending()

    def work_idle(self, stop: Callable[[], bool]) -> None:
        self.learner.work(stop)

    def end_step(self, policy: Transformer) -> AdaptStep:
        """Close the step (the floor of micro-steps first), then start the next on `policy`'s
        weights, the model whose forwards the next step observes."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self.learner.work(lambda: self.learner.steps_this_step() >= self.min_steps)
        after_s, after_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        stats = self.learner.end_step()
        self.learner.begin_step(policy)
        return AdaptStep(stats.version, stats.micro_steps, stats.loss, max(stats.seconds - after_cpu, 0.0), after_s)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current version's fp32 state dict (a copy)."""
        return self.learner.weights()

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()


class AdaptingRollout:
    """The Rollout protocol's calls that hand the trainer's forwards and idle core to a rollout's
    adapting drafter (None: a rollout whose drafter adapts otherwise, or not at all), shared by
    the engines that have one."""

    adapt: AdaptiveDrafter | None

    def wants_forwards(self) -> bool:
        return self.adapt is not None

    def observe(self, forwards: Sequence[PolicyForward]) -> None:
        if self.adapt is not None:
            self.adapt.observe(forwards)

    def has_idle_work(self) -> bool:
        return self.adapt is not None and self.adapt.has_idle_work()

    def work_idle(self, stop: Callable[[], bool]) -> None:
        if self.adapt is not None:
            self.adapt.work_idle(stop)
