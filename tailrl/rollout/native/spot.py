"""Spot training: the drafter trained on a rollout worker whose shard is done, while others generate.

A spot job carries everything the trainer needs (the drafter's weights and optimizer state, the
buffer's responses in training order) and comes back with the new state, so no worker owns the
drafter: whichever worker is idle first trains it, and the trainer (the process running the RL
loop) keeps the state, checkpoints it and publishes each new version.

Preemption. Before every micro-step the trainer asks `preempted()` whether the rollout has
ended; a micro-step is one optimizer step on one packed row of `drafter_batch_tokens` entries,
so the rollout waits at most one micro-step (plus returning the state) for the trainer.

State travels only when it must: a job that ran no micro-step returns nothing, and a job for
the worker that produced the current state (or last received it) carries none, since that
worker trains on from what it holds: the weights and AdamW state are far larger than a job's
data, and shipping them both ways every step holds up the rollout's end (docs/workers.md).

One trainer, not data parallel. With as many workers as cores, at most one worker is idle at a
time while another still generates, so data-parallel idle workers would rarely have a second
member; and with more workers than cores, an idle worker's core is already busy with another
worker's decoding, so extra trainers would slow the tail they wait for. Hence one trainer per
step: the first worker to finish.

Knows: the drafter's loss and optimizer, packing, the stop check. Does not know: workers,
processes, Ray, the RL loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import Drafter
from tailrl.speculative.drafter.training import TrainSeq, drafter_optimizer, micro_step, pack


@dataclass(frozen=True)
class SpotConfig:
    """Spot training's data buffer: the responses idle workers train the drafter on (its
    optimizer settings are the [adapt] section's, shared with the other ways of adapting it)."""

    buffer_tokens: int = field(
        default=65536,
        metadata={"help": "data buffer bound, tokens incl. prompts (E x 4 bytes each: 2.3 KB for SmolLM2)"},
    )
    keep_long: float = field(
        default=0.25, metadata={"help": "share of a step's responses, longest first, kept for the next step's training"}
    )

    def __post_init__(self) -> None:
        if self.buffer_tokens < 1:
            raise ValueError(f"buffer_tokens must be >= 1, got {self.buffer_tokens}")
        if not 0.0 <= self.keep_long <= 1.0:
            raise ValueError(f"keep_long must be in [0, 1], got {self.keep_long}")


@dataclass
class DrafterState:
    """The trained drafter as the RL loop keeps and checkpoints it."""

    version: int  # 0 = the drafter loaded from --drafter; +1 per step that trained it
    weights: dict[str, torch.Tensor]  # fp32 state dict (the embedding is the target's, not here)
    optimizer: dict[str, Any] | None = None  # AdamW state; None before the first micro-step
    micro_steps: int = 0  # in total, over all versions


@dataclass
class SpotJob:
    job_id: int  # preempted() >= job_id means: stop
    # None: go on from the weights and optimizer this worker ended its last job with, which the
    # trainer knows to be the current drafter (then only the data travels, not the state).
    state: DrafterState | None
    seqs: list[TrainSeq]  # in training order
    cfg: AdaptConfig


@dataclass
class SpotResult:
    # New weights and optimizer state; None when no micro-step ran (nothing to send back).
    weights: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any] | None
    micro_steps: int
    seconds: float  # CPU seconds this thread spent training: idle time actually harvested
    loss: float | None  # mean micro-step loss


def run_spot(
    drafter: Drafter,
    job: SpotJob,
    start: DrafterState,  # the state to train from: job.state, or the one this worker holds
    target_head: torch.Tensor,  # (K, E) the target's LM-head rows of the draft vocabulary
    preempted: Callable[[], int],
    on_step: Callable[[int], None] | None = None,
) -> SpotResult:
    """Micro-steps over the packed job data (cyclically, from the start) until preempted."""
    # CPU time, not wall time: a trainer that got no CPU (a busy machine) harvested nothing.
    t0 = time.thread_time()
    if preempted() >= job.job_id:  # the rollout ended while the job travelled: skip the set-up
        return SpotResult(None, None, 0, time.thread_time() - t0, None)
    cfg = job.cfg
    drafter.load_state_dict(start.weights)
    drafter.train()
    params, opt = drafter_optimizer(drafter, cfg.drafter_lr)
    if start.optimizer is not None:
        opt.load_state_dict(start.optimizer)
    batches = pack(job.seqs, cfg.drafter_batch_tokens)
    losses: list[float] = []
    while batches and preempted() < job.job_id:
        stats = micro_step(drafter, opt, params, batches[len(losses) % len(batches)], target_head,
                           cfg.drafter_ce_weight)
        losses.append(stats.loss)
        if on_step is not None:
            on_step(len(losses))
    drafter.eval()
    n = len(losses)
    if not n:
        return SpotResult(None, None, 0, time.thread_time() - t0, None)
    weights = {k: v.detach().float().clone() for k, v in drafter.state_dict().items()}
    return SpotResult(weights, opt.state_dict(), n, time.thread_time() - t0, sum(losses) / n)
