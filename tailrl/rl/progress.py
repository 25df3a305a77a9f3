"""What a person watching a run sees: progress events from the training loop, and a printer.

The loop emits RolloutProgress many times per step, StepDone once per step, EvalProgress while a
held-out evaluation decodes, EvalDone after it and Notice for one-off messages (resumed, saved,
interrupted); any callable taking an event can display them.
ConsolePrinter redraws one live line on a terminal and prints one summary line per step.

Knows: the events and the metrics record's fields. Does not know: how they were computed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from tailrl.records import Progress


@dataclass(frozen=True)
class RolloutProgress:
    """After every decode step of a rollout."""

    step: int
    steps: int
    progress: Progress


@dataclass(frozen=True)
class StepDone:
    """After a step's metrics are written (and its checkpoint, when one is due)."""

    steps: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class EvalProgress:
    """While a held-out evaluation decodes (tailrl.rl.heldout), after the policy's `step`."""

    step: int
    progress: Progress


@dataclass(frozen=True)
class EvalDone:
    """After a held-out evaluation (tailrl.rl.heldout): its eval.jsonl record."""

    record: dict[str, Any]


@dataclass(frozen=True)
class Notice:
    text: str


# What the training loop emits (tailrl.rl.train's on_event).
TrainEvent = RolloutProgress | StepDone | EvalProgress | EvalDone | Notice


def eval_line(e: dict[str, Any]) -> str:
    se = f" +- {e['heldout_reward_se']:.3f}" if "heldout_reward_se" in e else ""
    return (f"held-out after step {e['step']}: reward {e['heldout_reward']:.3f}{se} "
            f"on {e['heldout_problems']} problems, format {e['heldout_format_rate']:.2f}, "
            f"mean length {e['heldout_len_mean']:.0f} ({e['heldout_s']:.0f} s)")


def seconds_left(p: Progress) -> float | None:
    """A rough estimate of a generation's remaining time from the share of sequences done (the
    long tail finishes last, so it errs short); None before the first one finishes."""
    return p.seconds * (p.total - p.done) / p.done if p.done else None


def eval_progress_line(e: EvalProgress) -> str:
    p = e.progress
    left = seconds_left(p)
    eta = f", ~{left / 60:.1f} min left" if left is not None else ""
    return (f"held-out evaluation after step {e.step}: {p.done}/{p.total} done, running {p.running}, "
            f"{p.tokens} tokens, {p.seconds:.0f} s{eta}")


def summary_line(m: dict[str, Any], steps: int) -> str:
    """One line per step: reward, lengths, where the time went, throughput, loss."""
    return (
        f"step {m['step']}/{steps} | reward {m['reward_mean']:.3f} +-{m['reward_std']:.2f} "
        f"fmt {m['format_rate']:.2f} | len mean {m['response_len_mean']:.0f} p90 {m['response_len_p90']:.0f} "
        f"max {m['response_len_max']} | rollout {m['rollout_s']:.1f}s reward {m['reward_s']:.1f}s "
        f"train {m['train_s']:.1f}s step {m['step_s']:.1f}s | {m['rollout_tok_s']:.0f} tok/s "
        f"| loss {m['loss']:+.4f} kl {m['kl']:.4f} gnorm {m['grad_norm']:.2f}"
        + (f" | rollout share {m['rollout_share']:.2f} tail share {m['tail_share']:.2f}"
           if "rollout_share" in m and "tail_share" in m else "")
        + (f" ceiling {m['accept_len_ceiling']:.2f}" if m.get("accept_len_ceiling") is not None else "")
        + _drafter_part(m)
        + _spec_part(m)
        + (f" | peak {m['peak_rss_gb']:.1f} GiB (update {m['update_peak_rss_gb']:.1f})"
           if m.get("peak_rss_gb") is not None and m.get("update_peak_rss_gb") is not None else "")
        + (f" of {m['memory_budget_gb']:.1f} budget" if m.get("memory_budget_gb") is not None else "")
        + (f", {m['held_rss_gb']:.1f} held" if m.get("held_rss_gb") is not None else "")
        + (f", {m['kv_preempted']} sequences preempted for KV room" if m.get("kv_preempted") else "")
        + (f" | reward failures {m['reward_failures']} timeouts {m['reward_timeouts']}"
           if m["reward_failures"] or m["reward_timeouts"] else "")
    )


def _drafter_part(m: dict[str, Any]) -> str:
    """The learned drafter's version this rollout drafted with, and its accept_len (tokens per
    verify of its own arms), when there is one."""
    if m.get("drafter_accept_len") is not None:
        return f" | drafter v{m['drafter_version']} accept_len {m['drafter_accept_len']:.2f}"
    return f" | drafter v{m['drafter_version']}" if m.get("drafter_version") or m.get("drafter_published") else ""


def _spec_part(m: dict[str, Any]) -> str:
    """Speculation's accept_len beside its ceiling at the depths it drafted (how much of the
    possible speed-up the drafts delivered), when the rollout speculated."""
    if not m.get("spec_verify_steps") or m.get("spec_accept_ceiling") is None:
        return ""
    return (f" | accept {m['spec_accept_len']:.2f} of {m['spec_accept_ceiling']:.2f} at depth "
            f"{m['spec_draft_depth']:.3g}")


def rollback_line(m: dict[str, Any]) -> str | None:
    """A drafter version taken out of use at this step's publish (tailrl.rollout.protocol.Rollback)."""
    r = m.get("drafter_rollback")
    if not r:
        return None
    if r["reason"] == "non-finite":
        return f"step {m['step']}: drafter v{r['version']} discarded (weights not finite); v{r['to']} drafts on"
    return (f"step {m['step']}: drafter v{r['version']} rolled back to v{r['to']}: its first draft token accepted in "
            f"{r['rate']:.0%} of {r['verifies']} verifies, v{r['to']}'s in {r['reference_rate']:.0%} on the same "
            f"draft shapes")


def rollout_line(e: RolloutProgress) -> str:
    p = e.progress
    rate = p.tokens / p.seconds if p.seconds else 0.0
    return (f"step {e.step}/{e.steps} rollout: {p.done}/{p.total} done, running {p.running}, "
            f"{p.tokens} tokens, {rate:.0f} tok/s")


class ConsolePrinter:
    """A live rollout or evaluation line (redrawn in place on a terminal, otherwise written at most
    every `every_s` seconds per kind) and one summary line per step."""

    def __init__(self, stream: TextIO = sys.stderr, every_s: float = 30.0):
        self.stream = stream
        self.live = stream.isatty()
        self.every_s = every_s
        self._last: dict[type, float] = {}  # when the last live line of each kind was written

    def __call__(self, event: object) -> None:
        if isinstance(event, (RolloutProgress, EvalProgress)):
            now = time.monotonic()
            # No clock origin is assumed: monotonic() may be near zero on a machine just booted.
            last = self._last.get(type(event))
            if not self.live and last is not None and now - last < self.every_s:
                return
            self._last[type(event)] = now
            line = rollout_line(event) if isinstance(event, RolloutProgress) else eval_progress_line(event)
            self.stream.write(f"\r\033[K{line}" if self.live else line + "\n")
        elif isinstance(event, StepDone):
            self.stream.write(("\r\033[K" if self.live else "") + summary_line(event.metrics, event.steps) + "\n")
            if (line := rollback_line(event.metrics)) is not None:
                self.stream.write(line + "\n")
        elif isinstance(event, Notice):
            self.stream.write(("\r\033[K" if self.live else "") + event.text + "\n")
        elif isinstance(event, EvalDone):
            self.stream.write(("\r\033[K" if self.live else "") + eval_line(event.record) + "\n")
        self.stream.flush()
