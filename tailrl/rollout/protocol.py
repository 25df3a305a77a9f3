"""The seam between RL and the engines: what the RL loop may ask of a rollout, and what it gets back.

The RL loop (tailrl.rl) knows generation only through `Rollout`: generate one step's requests
(with a callback per finished sequence, so finished GRPO groups can be scored and trained on
while the tail still decodes), publish the policy's new weights and a new drafter version, lend
a core to the update while the tail leaves one idle, report what the rollout did, save and
restore its state, close. `RolloutConfig` opens one. An engine plugs in behind both:
tailrl.rollout.native is tailrl's own engine across its rollout workers, tailrl.rollout.vllm
a vLLM engine in the trainer's process.

The records that cross the seam are the engine's plain data types (Request, Completion,
Progress, SamplingParams, re-exported here so that the RL side imports nothing else) and
`RolloutReport`, the typed account of one rollout that becomes part of a step's metrics.

Knows: what a rollout is asked and answers. Does not know: how any engine produces tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from tailrl.engine import Completion, Progress, Request
from tailrl.model import Transformer
from tailrl.sampling import SamplingParams

__all__ = ["Completion", "DrafterVersion", "Progress", "Request", "Rollout", "RolloutConfig", "RolloutReport",
           "SamplingParams", "WorkerError"]


class WorkerError(RuntimeError):
    """A rollout worker died, hung or raised; `rank` says which. The step that raised it applied
    nothing, so a run can be resumed from its last checkpoint."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"worker {rank} {reason}")
        self.rank, self.reason = rank, reason


@dataclass(frozen=True)
class DrafterVersion:
    """A learned drafter's weights (its fp32 state dict; the target's embedding and head are
    not in it) and the version number they are published as."""

    version: int
    weights: dict[str, torch.Tensor]


@dataclass(frozen=True)
class RolloutReport:
    """What one rollout did (the last `generate`), as fields of a step's metrics record.

    Decoding: throughput, prefill, decode steps; the speculative share and acceptance
    (accept_len: tokens per verify, the bonus included); the tail (decode time with few
    sequences running) as a share of the rollout; per running-batch-size bucket and arm, what
    decoded and how fast; the headroom (accept_len_ceiling: the accept_len the target itself
    would reach as a chain drafter of the configured depth on these responses). Drafter: the
    version drafted with, its own accept_len, and what spot training harvested of idle time.
    """

    rollout_tok_s: float
    prefill_s: float
    decode_steps: int
    spec_verify_steps: int
    spec_accept_len: float
    accept_len_ceiling: float | None
    tail_s: float
    tail_share: float
    sd_fraction: float
    plain_s: float
    draft_s: float
    verify_s: float
    accept_hist: list[int]
    by_bucket: dict[str, dict[str, dict[str, float]]]
    arm_by_bucket: dict[str, str]
    batch_timeline: list[list[float | int | str]]
    drafter_version: int
    drafter_micro_steps: int
    drafter_loss: float | None
    drafter_accept_len: float | None
    idle_seconds_harvested: float
    idle_seconds_left: float
    preempt_latency_s: float
    buffer_tokens: int

    def metrics(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class Rollout(Protocol):
    """An engine generating a step's responses for the RL loop (see the module doc)."""

    def generate(self, step: int, requests: Sequence[Request], params: SamplingParams, max_new_tokens: int,
                 on_progress: Callable[[Progress], None] | None = None,
                 on_finished: Callable[[int, Completion], None] | None = None,
                 policy_busy: Callable[[], bool] = lambda: False) -> list[Completion]:
        """The completions of `requests`, in request order, sampled from the last published
        policy. on_progress as the rollout advances; on_finished(request index, completion) once
        per request as it finishes, in the thread that called generate. Idle time inside the
        rollout goes to the policy's update first: the engine does its own background work
        (drafter training) only while policy_busy() is False. Raises WorkerError when a worker
        fails (naming `step`)."""
        ...

    def lend_core(self, lend: bool) -> None:
        """While lent (between lend_core(True) and lend_core(False), or the end of generate),
        the rollout leaves one of the caller's cores to the caller's update; called from
        generate's callbacks. A rollout that decodes outside the caller's process has nothing
        to lend and ignores it."""
        ...

    def report(self) -> RolloutReport:
        """What the last generate did."""
        ...

    def publish_weights(self, policy: Transformer) -> None:
        """The next generate samples from `policy`'s current weights (cast to the rollout's dtype)."""
        ...

    def publish_drafter(self, drafter: DrafterVersion) -> None:
        """The next generate drafts with this learned drafter version."""
        ...

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint must hold for a resumed run to roll out as the uninterrupted one."""
        ...

    def close(self) -> None:
        ...


class RolloutConfig(Protocol):
    """How to open a Rollout: the engine's own configuration sections (flags and TOML tables)."""

    def open(self, model: Transformer, seed: int, state: dict[str, object] | None = None) -> Rollout:
        """A rollout decoding with `model`'s architecture and dtype, starting from its weights,
        its sampling and tuning seeded by `seed`, resuming `state` (a Rollout.state_dict())."""
        ...

    def for_evaluation(self) -> RolloutConfig:
        """An engine decoding plainly in this process, in the same dtype: held-out evaluations,
        which must not touch the training rollout's state (tuners, drafter, data buffer). The
        same engine, unless it cannot run twice in one process (vLLM: the native engine)."""
        ...

    def sections(self) -> dict[str, object]:
        """The configuration sections (dataclasses) by name, as a run directory saves them."""
        ...

    def learned_drafter(self) -> Path | None:
        """The learned drafter directory (tailrl.speculative.drafter's files) this rollout
        drafts with and whose later versions it expects from the RL loop (trained there on the
        policy's hidden states, handed over by Rollout.publish_drafter); None when it drafts
        with no learned drafter or trains its own (the native engine's spot training)."""
        ...
