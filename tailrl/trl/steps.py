"""Each step of the engine TRL's LLM.generate drives: TLT's tuner before it, its counters after it.

TRL generates a batch with one `LLM.generate` call, which runs the engine's steps itself. TLT's
adaptive engine chooses each step's draft length, so `EngineSteps` takes the place of the
engine's step method (rollout.vllm.internals.intercept_steps) and steers and counts each step as
tailrl's own vLLM rollout does in its loop, with the same parts (tailrl.rollout.vllm.speculation
`Steering` over the engine's `StepCounters`, a stat logger): the tuner's Schedule sets the step's
draft length and is told what the step cost (tokens per second per running sequence, decode
steps only); the step's speculative counters are added up for the call's accept_len and, by
draft shape, for the drafter's rollback watch.

Knows: how LLM.generate's steps are reached, the Steering's calls. Does not know: TRL, the
drafter's training.
"""

from __future__ import annotations

import time

from vllm.v1.engine.llm_engine import LLMEngine

from tailrl.rollout.vllm import internals
from tailrl.rollout.vllm.outputs import StepCounters
from tailrl.rollout.vllm.speculation import Schedule, Steering


class EngineSteps(Steering):
    """The engine's steps, steered by `schedule` (None: a fixed draft length) and counted."""

    def __init__(self, engine: LLMEngine, schedule: Schedule | None, arm: str):
        super().__init__(schedule, arm, StepCounters())
        self.engine = engine
        internals.add_stat_logger(engine, self.counters)
        self._own_step = internals.intercept_steps(engine, self.step)
        self.begin()

    def begin(self) -> None:
        """A generate call starts: its counters from zero, the tuner's rollout anew."""
        super().begin()
        self.drafts = self.accepted = 0

    def step(self) -> list:
        self.before(self.engine.get_num_unfinished_requests())
        t0 = time.perf_counter()
        outputs = self._own_step()
        _, count = self.after(time.perf_counter() - t0)  # vLLM's counts: LLM.generate's outputs are its
        self.drafts += count.drafts
        self.accepted += count.accepted
        return outputs

    @property
    def accept_len(self) -> float | None:
        """Tokens per verify over the call: the accepted draft tokens plus the target's own."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None
