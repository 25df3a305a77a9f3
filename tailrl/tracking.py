"""Experiment tracking: a command's per-step records sent to TensorBoard and/or Weights & Biases.

A record is what a command already writes per step (a line of metrics.jsonl, a warm-up step's
loss, a final report). `log_record` splits it for a `Reporter`: every number (bools as 0/1) is a
scalar, nested dicts of numbers become scalars tagged by their path ("by_bucket/1-4/plain/
accept_len": the decoding timeline's summary per batch bucket and arm), lists of numbers are
histograms of their values (response_lens, rewards), and COUNT_LISTS are histograms of the bins
they count (accept_hist[d] = verifies that accepted d drafts). Strings and the raw timeline
segments are left out: they are no series.

Consumers of progress events: `TrainTracking` (tailrl.rl.train's StepDone) and
`WarmupTracking` (tailrl.warmup's WarmupProgress and its report). Another
command feeds a Reporter through `log_record` from its own events the same way.

Knows: record shapes, the two backends' writer calls, where they write. Does not know: how any
metric was computed.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

BACKENDS = ("tensorboard", "wandb")
# Lists whose entry i counts occurrences of the value i (not samples of a value).
COUNT_LISTS = frozenset({"accept_hist"})
TENSORBOARD_DIR = "tensorboard"


class Reporter(Protocol):
    """Where tracked values go: one call per record, steps never decreasing."""

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, np.ndarray]) -> None: ...

    def close(self) -> None: ...


def _missing(backend: str, package: str) -> ValueError:
    return ValueError(f"--report-to {backend} needs the {package} package: pip install 'tailrl[{backend}]'")


class TensorBoardReporter:
    """Event files in `log_dir` (torch's SummaryWriter). The writer opens at the first step
    logged, purging later steps an earlier session wrote: a resumed run re-runs them."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None
        self._writer_cls, self.log_dir, self._writer = SummaryWriter, Path(log_dir), None

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, np.ndarray]) -> None:
        if self._writer is None:
            self._writer = self._writer_cls(str(self.log_dir), purge_step=step)
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        for tag, values in histograms.items():
            if values.size:
                self._writer.add_histogram(tag, values, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbReporter:
    """A Weights & Biases run, started at the first step logged (a command that fails before
    then leaves none); offline (files under `directory`/wandb, `wandb sync` uploads them) unless
    the user configured wandb through WANDB_MODE or WANDB_API_KEY."""

    def __init__(self, directory: str | Path, name: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb") from None
        self._wandb, self._run = wandb, None
        configured = "WANDB_MODE" in os.environ or "WANDB_API_KEY" in os.environ
        self._init = dict(project=os.environ.get("WANDB_PROJECT", "tailrl"), name=name, dir=str(directory),
                          config=config, mode=None if configured else "offline")

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, np.ndarray]) -> None:
        if self._run is None:
            self._run = self._wandb.init(**self._init)
        data: dict[str, Any] = dict(scalars)
        data.update({tag: self._wandb.Histogram(v) for tag, v in histograms.items() if v.size})
        self._run.log(data, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


class Reporters:
    """Several reporters as one (what `--report-to a --report-to b` opens)."""

    def __init__(self, reporters: Sequence[Reporter]):
        self.reporters = list(reporters)

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, np.ndarray]) -> None:
        for r in self.reporters:
            r.log(step, scalars, histograms)

    def close(self) -> None:
        for r in self.reporters:
            r.close()


def open_reporters(backends: Sequence[str], directory: str | Path, name: str, config: dict[str, Any]) -> Reporters:
    """The reporters named by --report-to, writing under `directory` (a run or drafter directory)."""
    out = []
    for b in dict.fromkeys(backends):  # each once, in the order given
        if b == "tensorboard":
            out.append(TensorBoardReporter(Path(directory) / TENSORBOARD_DIR))
        elif b == "wandb":
            out.append(WandbReporter(directory, name, config))
        else:
            raise ValueError(f"unknown --report-to {b!r} (choose from {', '.join(BACKENDS)})")
    return Reporters(out)


def split_record(record: dict[str, Any], prefix: str = "") -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """A record's scalars and histograms, tagged by key path (the module doc's rules)."""
    scalars: dict[str, float] = {}
    histograms: dict[str, np.ndarray] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, (bool, int, float, np.number)):
            scalars[tag] = float(value)
        elif isinstance(value, dict):
            s, h = split_record(value, tag + "/")
            scalars.update(s)
            histograms.update(h)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
            values = np.asarray(value, dtype=np.float64)
            if key in COUNT_LISTS:
                values = np.repeat(np.arange(len(value), dtype=np.float64), np.asarray(value, dtype=np.int64))
            histograms[tag] = values
    return scalars, histograms


def log_record(reporter: Reporter, step: int, record: dict[str, Any], prefix: str = "") -> None:
    scalars, histograms = split_record(record, prefix)
    reporter.log(step, scalars, histograms)


def tee(*consumers: Callable[[Any], None]) -> Callable[[Any], None]:
    """One event callback that hands each event to every consumer, in order."""

    def call(event: Any) -> None:
        for c in consumers:
            c(event)

    return call


class TrainTracking:
    """Consumes tailrl.rl.train's events: each StepDone's metrics record, and each EvalDone's
    held-out record, at its step."""

    def __init__(self, reporter: Reporter):
        self.reporter = reporter

    def __call__(self, event: Any) -> None:
        from tailrl.rl.progress import EvalDone, StepDone

        if isinstance(event, StepDone):
            log_record(self.reporter, int(event.metrics["step"]), event.metrics)
        elif isinstance(event, EvalDone):
            step = int(event.record["step"])
            log_record(self.reporter, step, {k: v for k, v in event.record.items() if k != "step"})


class WarmupTracking:
    """Consumes drafter warm-up progress: each optimiser step's loss (tag train/loss); `finish`
    logs the held-out replays' curve and the report (held-out losses, accept lengths beside their
    ceilings, coverage) at the last step."""

    def __init__(self, reporter: Reporter):
        self.reporter = reporter

    def __call__(self, event: Any) -> None:
        from tailrl.warmup import WarmupProgress

        if isinstance(event, WarmupProgress) and event.phase == "train" and event.loss is not None:
            self.reporter.log(event.done, {"train/loss": event.loss}, {})

    def finish(self, report: Any) -> None:
        """The stopping rule's held-out replays as a curve (heldout/accept_len at each replay's
        step), then the rest of the report at the last step."""
        for step, _, accept_len, _ in report.replays:
            self.reporter.log(int(step), {"heldout/accept_len": accept_len}, {})
        record = {k: v for k, v in dataclasses.asdict(report).items() if k != "replays"}
        log_record(self.reporter, max(report.steps, 1), record, prefix="report/")
