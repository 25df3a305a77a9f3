"""One vLLM engine in a Ray actor's process: the body of the actors tailrl.rollout.vllm.fleet
drives (`--engine vllm --workers N`).

The actor opens the same in-process engine as `--workers 1` (tailrl.rollout.vllm.rollout, its
learned drafter frozen: the drafter adapts on the trainer's side and arrives as versions) on
the weights it is built with, and holds the tags of the policy weights and drafter version it
decodes with. A call is driven from the trainer: `begin` puts a shard's requests in, each
`advance` decodes for up to a given time and hands back what finished, so the trainer hears
from a live engine at least that often (a silent one is hung) and reports each finished
sequence as it finishes. One call runs at a time in the actor (Ray runs an actor's methods one
after another), so no state is shared between threads. `begin` refuses weights or a drafter
other than the trainer's current ones: a stale engine never decodes.

vLLM is imported when the actor is built, in the actor's process: the trainer's process, which
imports this module to start actors, never imports it.

Knows: what an engine actor holds and answers. Does not know: Ray (fleet.py starts and calls
it), RL, the other engines.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from tailrl.model import ModelConfig
from tailrl.records import Completion, Progress, Request, Stop
from tailrl.rollout.ray_support import build_model, from_numpy
from tailrl.rollout.vllm.checks import prepare_process
from tailrl.rollout.vllm.settings import Drafting, VllmSettings
from tailrl.sampling import SamplingParams
from tailrl.speculative.watch import Tallies
from tailrl.stats import EngineStats
from tailrl.tuner import TunerConfig

if TYPE_CHECKING:
    from tailrl.rollout.vllm.rollout import VllmCall


@dataclass(frozen=True)
class EngineSpec:
    """What every engine of a fleet is opened with: the model's shape and dtype, the [vllm]
    section, the drafter directory and how it drafts (None: plainly), the tuner's section, the
    depth of a plain run's accept_len ceiling, the seed, torch threads."""

    model: ModelConfig
    dtype: torch.dtype
    settings: VllmSettings
    drafter: Path | None
    drafting: Drafting | None
    tuner: TunerConfig
    draft_depth: int
    seed: int
    threads: int

    @property
    def ceiling_depth(self) -> int:
        """The chain depth of the report's accept_len ceiling: the drafts' when it drafts."""
        return self.drafting.num_speculative_tokens if self.drafting is not None else self.draft_depth


@dataclass(frozen=True)
class Tags:
    """Which policy weights (their publish count) and drafter version an engine holds."""

    weights: int
    drafter: int


@dataclass(frozen=True)
class Shard:
    """A finished call's account: its decoding (EngineStats), the drafter's first-token
    acceptance per arm, the engine's tuner state after it."""

    stats: EngineStats
    tallies: Tallies
    tuner: dict | None


@dataclass(frozen=True)
class Advance:
    """What one `advance` decoded: the requests it finished (by their index in the shard), the
    call's progress, and, once the call is done, its account."""

    finished: list[tuple[int, Completion]]
    progress: Progress
    done: Shard | None


class EngineActor:
    """One engine (module doc); Ray's actor class is made from this one (fleet.py)."""

    def __init__(self, spec: EngineSpec, weights: dict[str, np.ndarray], tags: Tags,
                 drafter: dict[str, np.ndarray] | None, tuner: dict | None):
        """An engine on `weights` (engine_weights' names, the spec's dtype), drafting with
        drafter version `tags.drafter`: the directory's (0) or `drafter`'s weights; its tuner
        resumed from `tuner`."""
        prepare_process()  # before vLLM is imported
        from tailrl.rollout.vllm.rollout import VllmRollout, VllmRolloutState
        from tailrl.speculative.drafter.learner import AdaptConfig

        torch.set_num_threads(spec.threads)
        model = build_model(spec.model, spec.dtype, weights)
        self.rollout: VllmRollout = VllmRollout.start(
            model, spec.seed, VllmRolloutState(tuner, None), settings=spec.settings, drafter=spec.drafter,
            drafting=spec.drafting, tuner=spec.tuner, adapt=AdaptConfig(adapt_drafter=False),
            draft_depth=spec.draft_depth)
        if drafter is not None:
            self.rollout.load_drafter(tags.drafter, from_numpy(drafter, torch.float32))
        self.tags = tags
        self.call: VllmCall | None = None

    def pid(self) -> int:
        return os.getpid()

    def begin(self, tags: Tags, step: int, requests: Sequence[Request], params: SamplingParams,
              max_new_tokens: int, stop: Stop | None) -> None:
        """`requests` into the engine, to be decoded by `advance`; RuntimeError unless the engine
        holds the weights and drafter `tags` names (the trainer's current ones)."""
        if tags != self.tags:
            raise RuntimeError(f"the engine holds {self.tags}, the trainer publishes {tags}")
        if self.call is not None:
            self.call.abort()
        self.call = self.rollout.begin(step, requests, params, max_new_tokens, stop)

    def advance(self, seconds: float) -> Advance:
        """Decode for about `seconds` (whole engine steps, at least one), or until the call is done."""
        call = self.call
        if call is None:
            raise RuntimeError("advance without a call: its begin failed (the actor's log says why)")
        finished: list[tuple[int, Completion]] = []
        deadline = time.monotonic() + seconds
        while call.running:
            finished += call.step()
            if time.monotonic() >= deadline:
                break
        if call.running:
            return Advance(finished, call.progress(), None)
        self.call = None
        tuner = self.rollout.state_dict().tuner
        return Advance(finished, call.progress(), Shard(call.stats, call.tallies, tuner))

    def load_weights(self, tag: int, weights: dict[str, np.ndarray]) -> None:
        self.rollout.load_weights(from_numpy(weights, self.rollout.dtype))
        self.tags = Tags(tag, self.tags.drafter)

    def load_drafter(self, version: int, weights: dict[str, np.ndarray]) -> None:
        self.rollout.load_drafter(version, from_numpy(weights, torch.float32))
        self.tags = Tags(self.tags.weights, version)

    def close(self) -> None:
        self.rollout.close()
