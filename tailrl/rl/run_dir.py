"""The run directory: resolved config, per-step metrics, atomic checkpoints, and resuming.

Layout of a run directory:

    config.toml                 the resolved config (tailrl.config.dump_toml)
    metrics.jsonl               one JSON object per completed step
    eval.jsonl                  one JSON object per held-out evaluation (tailrl.rl.heldout)
    plots/*.png                 written by tailrl.rl.plots
    checkpoints/step_000012/    model.safetensors + config.json + tokenizer files (a model
                                directory tailrl.loading.load_model reads), optimizer.pt,
                                state.pt (step, data cursor, RNG states, other components' state)

Everything a reader or a resume may look at is written under a temporary name, flushed to disk
and renamed into place (os.replace is atomic on POSIX): after a SIGKILL at any moment a file is
either its old or its new version, and a checkpoint directory is complete once its name exists.

Knows: files, TOML, JSON, safetensors, torch.save, RNG states. Does not know: what the model,
optimizer or metrics mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from tailrl.config import ConfigError, dump_toml, read_toml, resolve
from tailrl.model import Transformer
from tailrl.rollout.protocol import RolloutState

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
CHECKPOINTS = "checkpoints"
_STEP_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"
# Weight files of the source model directory; everything else (config, tokenizer) is copied.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".gguf")


class RunDirError(ValueError):
    """A run directory that cannot be created, resumed or written; the message says why."""


def default_out_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


@dataclass
class TrainState:
    """What a checkpoint restores besides weights and optimizer state."""

    step: int = 0  # completed RL steps
    data_cursor: int = 0  # index of the next problem in the task's stream
    rng: dict[str, Any] = field(default_factory=dict)
    rollout: RolloutState | None = None  # the rollout's own (its tuners, drafter, data)


def capture_rng() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success flush it and rename it to `path`."""
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_text(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def _append_record(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _read_records(path: Path) -> list[dict[str, Any]]:
    """Complete records in order; a torn last line (a kill mid-write) is skipped."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class RunDir:
    """One training run's directory. Use `create` for a new run and `open` to resume one."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.metrics_path = self.path / METRICS_FILE
        self.evals_path = self.path / EVAL_FILE
        self.plots_dir = self.path / "plots"
        self.checkpoints_dir = self.path / CHECKPOINTS

    # ---- creating and reopening -----------------------------------------------------------

    @classmethod
    def create(cls, path: str | Path, configs: dict[str, Any]) -> "RunDir":
        """A fresh run directory holding the resolved config; refuses to overwrite a run."""
        run = cls(Path(path))
        if (run.path / CONFIG_FILE).exists() or run.metrics_path.exists():
            raise RunDirError(f"{run.path} already holds a run; resume it with --resume {run.path} "
                              f"or pick another --out")
        try:
            for d in (run.path, run.plots_dir, run.checkpoints_dir):
                d.mkdir(parents=True, exist_ok=True)
            _write_text(run.path / CONFIG_FILE, dump_toml(configs))
            run.metrics_path.touch()
        except OSError as e:
            raise RunDirError(f"cannot write the output directory {run.path}: {e.strerror or e}") from None
        return run

    @classmethod
    def open(cls, path: str | Path, configs: dict[str, Any], may_change: tuple[str, ...] = ()) -> "RunDir":
        """An existing run to resume. `configs` must equal the saved ones except the fields named
        in `may_change` (those that cannot alter results, e.g. the number of steps)."""
        run = cls(Path(path))
        config_path = run.path / CONFIG_FILE
        if not config_path.is_file():
            raise RunDirError(f"{run.path} is not a run directory (no {CONFIG_FILE})")
        saved = resolve({name: type(obj) for name, obj in configs.items()}, toml=read_toml(config_path))
        changed = [
            f"{section}.{f.name}: {getattr(saved[section], f.name)!r} -> {getattr(obj, f.name)!r}"
            for section, obj in configs.items()
            for f in dataclasses.fields(obj)
            if f.name not in may_change and getattr(saved[section], f.name) != getattr(obj, f.name)
        ]
        if changed:
            raise ConfigError(
                f"resuming {run.path} with a different config would not reproduce the run; changed: "
                + "; ".join(changed)
            )
        if run.latest_checkpoint() is None:
            raise RunDirError(f"{run.path} has no checkpoint to resume from")
        try:
            for stale in run.checkpoints_dir.glob(_TMP_PREFIX + "*"):  # left by a kill mid-save
                shutil.rmtree(stale, ignore_errors=True)
            run.plots_dir.mkdir(exist_ok=True)
            _write_text(config_path, dump_toml(configs))
        except OSError as e:
            raise RunDirError(f"cannot write the run directory {run.path}: {e.strerror or e}") from None
        return run

    # ---- metrics --------------------------------------------------------------------------

    def append_metrics(self, record: dict[str, Any]) -> None:
        _append_record(self.metrics_path, record)

    def read_metrics(self) -> list[dict[str, Any]]:
        return _read_records(self.metrics_path)

    def append_eval(self, record: dict[str, Any]) -> None:
        _append_record(self.evals_path, record)

    def read_evals(self) -> list[dict[str, Any]]:
        return _read_records(self.evals_path)

    def truncate_metrics(self, step: int) -> None:
        """Keep the records of steps <= `step` (metrics and evaluations): those after a
        checkpoint are recomputed on resume."""
        for path in (self.metrics_path, self.evals_path):
            if path.exists():
                kept = [r for r in _read_records(path) if r.get("step", 0) <= step]
                _write_text(path, "".join(json.dumps(r) + "\n" for r in kept))

    # ---- checkpoints ----------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = [p for p in self.checkpoints_dir.glob(_STEP_PREFIX + "*") if p.is_dir()]
        return sorted(found, key=lambda p: int(p.name.removeprefix(_STEP_PREFIX)))

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save_checkpoint(
        self,
        weights: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any],
        state: TrainState,
        model_dir: Path,
        keep: int = 1,
    ) -> Path:
        """Write checkpoint `state.step` atomically, then delete all but the newest `keep`.

        `weights` is a state dict safetensors can hold (no shared tensors); config and tokenizer
        files are copied from `model_dir`, so the checkpoint is itself a loadable model directory.
        """
        final = self.checkpoints_dir / f"{_STEP_PREFIX}{state.step:06d}"
        if final.exists():  # the same step's state is already on disk
            return final
        tmp = self.checkpoints_dir / f"{_TMP_PREFIX}{final.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for src in model_dir.iterdir():
                if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(src, tmp / src.name)
            save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
            torch.save(optimizer_state, tmp / "optimizer.pt")
            # Fields one level deep: asdict would turn the rollout's typed state into dicts.
            torch.save({f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, tmp / "state.pt")
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.checkpoints_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for old in self.checkpoints()[: -max(keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def load_checkpoint(path: Path) -> tuple[dict[str, Any], TrainState]:
        """(optimizer state, train state) of a checkpoint; its weights load with load_model(path)."""
        optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
        raw = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        return optimizer_state, TrainState(**raw)


def policy_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """The state dict to save: contiguous tensors, a tied LM head left out (the config says so)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state
