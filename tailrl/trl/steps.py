"""Each step of the engine TRL's LLM.generate drives: TLT's tuner before it, its counters after it.

TRL generates a batch with one `LLM.generate` call, which runs the engine's steps itself. TLT's
adaptive engine chooses each step's draft length, so `EngineSteps` takes the place of the
engine's step method (rollout.vllm.internals.intercept_steps) and does around each step what
tailrl's own vLLM rollout does in its loop (tailrl.rollout.vllm.rollout.Decoding): the tuner's
Schedule sets the step's draft length and is told what the step cost (tokens per second per
running sequence, decode steps only); the step's speculative counters (a stat logger, `StepLog`)
are added up per arm for the call's accept_len and, by draft shape, for the drafter's
rollback watch.

Knows: vLLM's per-step stats, the Schedule's calls. Does not know: TRL, the drafter's training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from tailrl.rollout.vllm import internals
from tailrl.rollout.vllm.speculation import Schedule
from tailrl.speculative.watch import Tallies, Tally


@dataclass
class StepRecord:
    """One engine step's counters."""

    prompt_tokens: int = 0
    tokens: int = 0  # generated
    running: int = 0
    drafts: int = 0  # verifies of a draft
    accepted: int = 0  # draft tokens accepted
    first: int = 0  # verifies that accepted the first draft token


class StepLog(StatLoggerBase):
    """The last step's counters, as vLLM hands them to its stat loggers inside step()."""

    def __init__(self) -> None:
        self.last = StepRecord()

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: MultiModalCacheStats | None = None, engine_idx: int = 0) -> None:
        r = StepRecord()
        if iteration_stats is not None:
            r.prompt_tokens, r.tokens = iteration_stats.num_prompt_tokens, iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            r.running = scheduler_stats.num_running_reqs
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None and spec.num_drafts:
                r.drafts, r.accepted = spec.num_drafts, spec.num_accepted_tokens
                r.first = spec.num_accepted_tokens_per_pos[0] if spec.num_accepted_tokens_per_pos else 0
        self.last = r

    def log_engine_initialized(self) -> None:
        pass

    def take(self) -> StepRecord:
        out, self.last = self.last, StepRecord()
        return out


class EngineSteps:
    """The engine's steps, steered by `schedule` (None: a fixed draft length) and counted."""

    def __init__(self, engine: LLMEngine, schedule: Schedule | None, arm: str):
        self.engine, self.schedule, self.arm = engine, schedule, arm
        self.log = StepLog()
        internals.add_stat_logger(engine, self.log)
        self._own_step = internals.intercept_steps(engine, self.step)
        self.begin()

    def begin(self) -> None:
        """A generate call starts: its counters from zero, the tuner's rollout anew."""
        self.tallies: Tallies = {}
        self.drafts = self.accepted = 0
        if self.schedule is not None:
            self.schedule.new_rollout()

    def step(self) -> list:
        schedule = self.schedule
        verified = schedule.before_step(self.engine.get_num_unfinished_requests()) if schedule is not None else None
        t0 = time.perf_counter()
        outputs = self._own_step()
        seconds = time.perf_counter() - t0
        r = self.log.take()
        if r.drafts:
            self.drafts += r.drafts
            self.accepted += r.accepted
            label = verified.label if verified is not None else self.arm
            self.tallies.setdefault(label, Tally()).add(r.drafts, r.first)
        if verified is not None and not r.prompt_tokens and r.tokens:
            schedule.after_step(r.running, verified, r.tokens, seconds)
        return outputs

    @property
    def accept_len(self) -> float | None:
        """Tokens per verify over the call: the accepted draft tokens plus the target's own."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None
