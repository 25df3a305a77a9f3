"""The default run: cold start -> drafter warm-up -> GRPO with the whole TLT system, phases cached.

Reasoning RL starts from a policy that already writes worked solutions, and TLT warms its
drafter up on that policy before RL. So a new `tailrl train` run that names no model first
fine-tunes the default model on the task's worked solutions (tailrl.rl.sft, cached by a hash of
base model, task and settings), and, with speculation on and no drafter named, warms a drafter
up on that policy's own samples (tailrl.warmup, cached by a hash of the
policy and the warm-up settings). A second run with the same inputs finds both in the cache.
Every phase is also a command of its own (`tailrl sft`, `tailrl drafter warmup`,
`tailrl train --model DIR --drafter DIR`); naming a model or a drafter skips its phase.

Knows: which phases exist, their configs and cache keys. Does not know: how a phase works inside.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from tailrl.cache_dir import cache_root
from tailrl.loading import model_fingerprint, resolve_model_dir
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.progress import Notice
from tailrl.rl.rewards import load_reward
from tailrl.rl.sft import EvalResult, SFTConfig, SFTProgress, sft, worked_task
from tailrl.rl.tasks import make_task
from tailrl.rl.train import RunConfig, TrainConfig
from tailrl.rollout import registry
from tailrl.warmup import WarmupConfig, WarmupProgress, warmup

# Warm-up sized for a CPU: a few minutes of sampling, then training until the drafter's held-out
# acceptance stops rising (tailrl.warmup's stopping rule: the rate drops on a plateau, then
# training stops), capped at WARMUP_STEPS. Worked solutions (teacher-forced, cheap) give the
# training more to fit than the few sampled responses; twice the responses and solutions bought
# nothing more. The budget is optimiser steps and held-out replays, never seconds, so that every
# machine warms up the same drafter. Measurements: docs/workload.md.
WARMUP_PROMPTS = 24
WARMUP_GROUP = 4
WARMUP_STEPS = 3000
WARMUP_SOLUTIONS = 256


# `tailrl train`'s configuration sections (flags and TOML tables), by name: the loop's, then every
# engine's (TrainConfig.engine picks the engine, tailrl.rollout.registry).
TRAIN_SECTIONS: dict[str, type] = {"train": TrainConfig, "grpo": GRPOConfig, **registry.train_sections()}


def run_config(sections: Mapping[str, object]) -> RunConfig:
    """A run's typed config from its sections by name (those left out take their defaults), on
    the engine the train section names, which refuses what it cannot run (the sections only other
    engines read among it: they would configure nothing)."""
    tc = sections.get("train") or TrainConfig()
    rollout = registry.rollout_config(tc.engine, sections, tc.sampling())
    return RunConfig(rollout, train=tc, grpo=sections.get("grpo") or GRPOConfig())


@dataclass(frozen=True)
class Phase:
    """A phase of the default run starting, with what it will do and roughly how long."""

    index: int
    total: int
    name: str
    detail: str


def phases(cfg: RunConfig) -> list[str]:
    """The phases a new run with this config goes through, in order."""
    tc = cfg.train
    out = ["cold start"] if tc.model is None and tc.cold_start else []
    if _warms_drafter(cfg):
        out.append("drafter warm-up")
    return [*out, "GRPO"]


def _warms_drafter(cfg: RunConfig) -> bool:
    """A run warms a drafter up when its engine speculates with a learned drafter and none is
    named (then the rollout drafts with the warm-up's and adapts it during RL)."""
    return cfg.rollout.needs_drafter() and cfg.train.warmup_drafter


# What the phases before GRPO emit (prepare's on_event).
PhaseEvent = Phase | Notice | SFTProgress | EvalResult


def prepare(cfg: RunConfig, on_event: Callable[[PhaseEvent], None],
            on_warmup: Callable[[WarmupProgress], None] | None = None) -> RunConfig:
    """Run (or find cached) the phases before GRPO; the config GRPO then runs with.

    on_event gets Phase and Notice events and tailrl.rl.sft's progress events.
    """
    check_inputs(cfg)
    tc, rollout = cfg.train, cfg.rollout
    names = phases(cfg)
    total = len(names)
    if "cold start" in names:
        try:
            worked_task(tc.task)
        except ValueError as e:  # a task without worked solutions starts RL from the base model
            on_event(Notice(f"no cold start: {e}; RL starts from the base model"))
            names.remove("cold start")
            total -= 1
    for index, name in enumerate(names, start=1):
        if name == "cold start":
            sft_cfg = cold_start_config(tc)
            on_event(Phase(index, total, name, f"fine-tuning the default model on {sft_cfg.steps} x "
                                               f"{sft_cfg.batch_size} worked solutions of {tc.task} (cached after "
                                               f"the first run)"))
            result = sft(sft_cfg, on_event=on_event)
            if result.interrupted:
                raise KeyboardInterrupt
            on_event(Notice(f"cold start {'reused from' if result.cached else 'written to'} {result.out_dir}"))
            tc = dataclasses.replace(tc, model=str(result.out_dir))
        elif name == "drafter warm-up":
            wcfg = warmup_config(tc)
            on_event(Phase(index, total, name,
                           f"sampling {wcfg.num_prompts} x {wcfg.group_size} responses from the policy"
                           + (f" and {wcfg.solutions} worked solutions" if wcfg.solutions else "")
                           + f", then training a drafter of {wcfg.drafter_layers} layer"
                           + ("s" if wcfg.drafter_layers > 1 else "")
                           + f" until its held-out acceptance stops rising (at most {wcfg.steps} steps; cached)"))
            drafter, reused = cached_warmup(wcfg, on_warmup)
            on_event(Notice(f"drafter {'reused from' if reused else 'written to'} {drafter}"))
            rollout = rollout.with_drafter(drafter)
        else:
            on_event(Phase(index, total, name, f"{tc.steps} steps of {tc.num_prompts} x {tc.group_size} responses, "
                                               + rollout.describe()))
    return dataclasses.replace(cfg, train=tc, rollout=rollout)


def check_inputs(cfg: RunConfig) -> None:
    """Raise ValueError (or ModelError) for a task, reward, model or drafter that a later phase
    would refuse, so bad input fails before minutes of cold start and warm-up, not after."""
    tc, rollout = cfg.train, cfg.rollout
    make_task(tc.task)
    if tc.reward is not None:
        load_reward(tc.reward)
    if tc.model is not None:
        resolve_model_dir(tc.model)
    rollout.check()


def cold_start_config(tc: TrainConfig) -> SFTConfig:
    """The cold start of the default run: tailrl sft's defaults on the run's task."""
    return SFTConfig(task=tc.task)


def warmup_config(tc: TrainConfig) -> WarmupConfig:
    """Warm-up on the policy's own answers to the task, at the rollout's temperature and length,
    and on the task's worked solutions where it has them."""
    try:
        worked_task(tc.task)
        solutions = WARMUP_SOLUTIONS
    except ValueError:
        solutions = 0
    return WarmupConfig(model=tc.model, task=tc.task, num_prompts=WARMUP_PROMPTS, group_size=WARMUP_GROUP,
                        holdout_prompts=4, max_new_tokens=tc.max_new_tokens, temperature=tc.temperature,
                        solutions=solutions, steps=WARMUP_STEPS, eval_greedy=False,
                        drafter_layers=tc.drafter_layers)


def warmup_cache_dir(cfg: WarmupConfig) -> Path:
    """Where the drafter warmed up by cfg is cached: keyed by the model's fingerprint and the settings."""
    h = hashlib.sha256(model_fingerprint(resolve_model_dir(cfg.model)).encode())
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"}
    if settings["drafter_layers"] == 1:  # one layer keeps the key it had before layers were a setting
        del settings["drafter_layers"]
    h.update(json.dumps(settings, sort_keys=True).encode())
    return cache_root() / "drafters" / h.hexdigest()[:16]


def cached_warmup(cfg: WarmupConfig, on_progress: Callable[[WarmupProgress], None] | None) -> tuple[Path, bool]:
    """The warmed-up drafter for cfg from the cache, or a new one written there atomically."""
    out = warmup_cache_dir(cfg)
    if out.is_dir():
        return out, True
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        warmup(cfg, tmp, on_progress=on_progress)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, False
