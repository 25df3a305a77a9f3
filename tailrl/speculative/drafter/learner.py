"""The learned drafter trained on hidden states its owner hands over, in micro-steps its owner
schedules: how a rollout without idle workers of its own (one in-process native engine, an
in-process vLLM engine) adapts its drafter during RL, on what the trainer's forwards computed.

A step's life. `begin_step(target)` attaches the drafter to the target's current weights and
makes what `add` received during the previous step the data to train on (packed once, in the
order it arrived); during the step `work(stop)` runs micro-steps over it, cyclically, asking
stop() before each one, while `add` collects this step's data for the next; `end_step()` closes
the step: a new version (its weights: `weights()`) when it trained.

Training data lags one step: a step trains on the previous step's data, which is complete (the
longest responses finish last, so a step's own data would miss them while there is still time to
train), fixed while it trains (no lock against `add`), and one target update older than the data
of the step it runs in. The cross-entropy target of each data set is the target's head at the
time that data was produced (snapshotted by begin_step), so hidden states and head belong to one
model.

One micro-step is training.micro_step on one packed row of `drafter_batch_tokens` entries, as
spot training (tailrl.rollout.native.spot) runs it: same loss, optimizer and clipping, and the
same settings (`AdaptConfig`, one section for both engines and both ways of training).

Checkpoints. state_dict() is the state at the last end_step (or load), whatever happened since,
so a checkpoint written after an interrupted step resumes as the uninterrupted run would.

Knows: the drafter, its loss, optimizer and packing, versions. Does not know: RL, rollouts, when
it is asked to work or stop (its caller's scheduling).
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tailrl.model import Transformer
from tailrl.speculative.drafter.model import Drafter, load_drafter
from tailrl.speculative.drafter.training import (
    CONTINUE_BATCH_TOKENS,
    CONTINUE_LR,
    Packed,
    TrainSeq,
    drafter_optimizer,
    micro_step,
    pack,
)


@dataclass(frozen=True)
class AdaptConfig:
    """The learned drafter's training during RL (TLT's adaptive drafter), on either engine."""

    adapt_drafter: bool = field(default=True, metadata={"help": (
        "train the learned drafter during RL on the policy's responses: on idle workers (spot training, "
        "--workers >= 2), else on the core the update leaves idle in the rollout's tail; each step that "
        "trained publishes a new version")})
    drafter_lr: float = field(default=CONTINUE_LR, metadata={"help": "drafter training: AdamW learning rate"})
    drafter_batch_tokens: int = field(default=CONTINUE_BATCH_TOKENS, metadata={
        "help": "drafter training: entries per micro-step (what the rollout or the update waits at most)"})
    drafter_ce_weight: float = field(default=0.1, metadata={
        "help": "weight of the drafter's cross-entropy term (TLT: 0.1)"})
    drafter_min_steps: int = field(default=8, metadata={"help": (
        "drafter micro-steps per RL step when it trains on the update's idle core: those the idle time "
        "did not run, run after the update, on the step's time (drafter_after_s); 0 = idle time only")})
    drafter_rollback: bool = field(default=True, metadata={"help": (
        "watch each adapted drafter version's acceptance against the last good version's and roll a "
        "collapsed one back to it (docs/workers.md, 'A drafter version that does not pay')")})
    drafter_rollback_ratio: float = field(default=0.5, metadata={"help": (
        "a version collapsed when its first-token acceptance is surely below this share of the last good "
        "version's on the same draft shapes (false alarms <= 1e-6 per shape and step, verifies independent)")})

    def __post_init__(self) -> None:
        if not self.drafter_lr > 0 or self.drafter_batch_tokens < 1 or self.drafter_min_steps < 0:
            raise ValueError(f"drafter_lr must be > 0, drafter_batch_tokens >= 1 and drafter_min_steps >= 0, got "
                             f"{self.drafter_lr}, {self.drafter_batch_tokens} and {self.drafter_min_steps}")
        if not 0.0 < self.drafter_rollback_ratio <= 1.0:
            raise ValueError(f"drafter_rollback_ratio must be in (0, 1], got {self.drafter_rollback_ratio}")


@dataclass(frozen=True)
class LearnerStats:
    """What one step's training did."""

    micro_steps: int
    loss: float | None  # mean micro-step loss; None without micro-steps
    seconds: float  # CPU seconds of the thread(s) that trained
    version: int  # after the step: bumped when it trained
    seqs: int  # sequences trained on (the previous step's)


class DrafterLearner:
    """An fp32 drafter, its AdamW state and data, trained in micro-steps (module doc)."""

    def __init__(self, drafter: Drafter, target: Transformer, cfg: AdaptConfig = AdaptConfig()):
        self.cfg = cfg
        self.drafter = drafter.float().train().requires_grad_(True)
        self.params, self.opt = drafter_optimizer(self.drafter, cfg.drafter_lr)
        self.version = 0  # 0: the drafter loaded; +1 per step that trained it
        self.micro_steps = 0  # in total
        self._lock = threading.Lock()  # add() runs on the caller's update threads
        self._incoming: list[TrainSeq] = []  # this step's data: the next step's training data
        self._incoming_head = self._head_of(target)
        self._batches: list[Packed] = []
        self._head: torch.Tensor | None = None  # (K, E) the head of the model that produced the data
        self._seqs, self._done = 0, 0  # this step's sequences, micro-steps
        self._losses: list[float] = []
        self._seconds = 0.0
        self._restored = False  # restore() ran since the last end_step
        self.drafter.attach(target)
        self._committed = self._snapshot(None)

    @classmethod
    def load(cls, path: str | Path, target: Transformer, cfg: AdaptConfig = AdaptConfig()) -> DrafterLearner:
        """The drafter in `path` (tailrl's drafter files), for `target`, on the CPU in fp32."""
        return cls(load_drafter(path, target, dtype=torch.float32, device="cpu"), target, cfg)

    def _head_of(self, target: Transformer) -> torch.Tensor:
        """The target's LM-head rows of the draft vocabulary, a copy on the CPU.  (K, E)"""
        return target.lm_head.weight.detach()[self.drafter.d2t.to(target.lm_head.weight.device)].float().cpu().clone()

    # ---- a step ----------------------------------------------------------------------------

    def begin_step(self, target: Transformer) -> None:
        """Attach to `target` (as it is now: the model this step's data comes from) and train,
        this step, on the previous step's data."""
        self.drafter.attach(target)
        with self._lock:
            data, self._incoming = self._incoming, []
            self._head, self._incoming_head = self._incoming_head, self._head_of(target)
        self._batches = pack(data, self.cfg.drafter_batch_tokens) if data else []
        self._seqs, self._done, self._losses, self._seconds = len(data), 0, [], 0.0

    def add(self, seqs: list[TrainSeq]) -> None:
        """This step's sequences (hidden states of the model begin_step attached to), trained on next step."""
        seqs = [TrainSeq(s.tokens.cpu(), s.hidden.detach().float().cpu(), s.prompt_len, s.offset) for s in seqs]
        with self._lock:
            self._incoming += seqs

    def steps_this_step(self) -> int:
        """Micro-steps run since begin_step."""
        return self._done

    def pending(self) -> bool:
        """Whether there is data to train on this step."""
        return bool(self._batches)

    def work(self, stop: Callable[[], bool]) -> None:
        """Micro-steps over this step's packed data, cyclically, while stop() is False (asked
        before each: a stop waits for at most one micro-step)."""
        t0 = time.thread_time()  # CPU time: a thread that got no CPU harvested nothing
        try:
            while self._batches and not stop():
                batch = self._batches[self._done % len(self._batches)]
                stats = micro_step(self.drafter, self.opt, self.params, batch, self._head, self.cfg.drafter_ce_weight)
                self._done += 1
                self.micro_steps += 1
                self._losses.append(stats.loss)
        finally:
            self._seconds += time.thread_time() - t0

    def end_step(self) -> LearnerStats:
        """Close the step: a new version when it trained; its data is dropped."""
        n = self._done
        if n:
            self.version += 1
        self._batches = []
        with self._lock:
            self._committed = self._snapshot(None if n or self._restored else self._committed)
            self._restored = False
        return LearnerStats(n, sum(self._losses) / n if n else None, self._seconds, self.version, self._seqs)

    def restore(self, weights: dict[str, torch.Tensor]) -> None:
        """Go back to `weights` (a version that drafted well, whose optimizer moments are not
        kept): fresh AdamW moments, and this step's micro-steps so far undone, so that what
        end_step commits, and the floor it trains, start from these weights."""
        self.drafter.load_state_dict(weights)
        self.opt.state.clear()
        self._done, self._losses = 0, []
        with self._lock:
            self._restored = True

    def weights(self) -> dict[str, torch.Tensor]:
        """The drafter's fp32 state dict (a copy; the embedding is the target's, not in it)."""
        return {k: v.detach().float().clone() for k, v in self.drafter.state_dict().items()}

    # ---- checkpoints -----------------------------------------------------------------------

    def _snapshot(self, unchanged: dict[str, Any] | None) -> dict[str, Any]:
        """The state to checkpoint: weights and optimizer copied, or taken from `unchanged`, the
        last snapshot, when no micro-step ran since."""
        return {
            "version": self.version,
            "micro_steps": self.micro_steps,
            "weights": unchanged["weights"] if unchanged else self.weights(),
            "optimizer": unchanged["optimizer"] if unchanged else copy.deepcopy(self.opt.state_dict()),
            "incoming": [(s.tokens, s.hidden, s.prompt_len, s.offset) for s in self._incoming],
            "incoming_head": self._incoming_head,
        }

    def state_dict(self) -> dict[str, Any]:
        """The state at the last end_step (module doc, "Checkpoints")."""
        with self._lock:
            return dict(self._committed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["weights"])
        self.opt.load_state_dict(state["optimizer"])
        self.version, self.micro_steps = int(state["version"]), int(state["micro_steps"])
        with self._lock:
            self._incoming = [TrainSeq(*x) for x in state["incoming"]]
            self._incoming_head = state["incoming_head"]
            self._committed = dict(state)
        self._batches = []
