"""The default run's phases (tailrl.pipeline): cold start and drafter warm-up run once, are
found in the cache by the next run, and hand GRPO the model and drafter they wrote; the regime
plot is drawn from metrics records."""

import dataclasses
import hashlib
import json

import pytest

from tailrl import pipeline
from tailrl.loading import model_fingerprint
from tailrl.pipeline import TRAIN_SECTIONS, run_config
from tailrl.rl.plots import write_plots
from tailrl.rl.progress import Notice
from tailrl.rl.sft import SFTConfig
from tailrl.rl.train import TrainConfig
from tailrl.speculative.modes import RolloutSpeculationConfig
from tailrl.warmup import WarmupConfig


@pytest.fixture
def tiny_phases(char_model_dir, tmp_path, monkeypatch):
    """Phases sized for a tiny model, in a cache of their own; counts the phases really run."""
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "cold_start_config", lambda tc: SFTConfig(
        model=str(char_model_dir), task=tc.task, steps=2, batch_size=2, micro_batch=2, autocast="fp32",
        eval_problems=2, eval_max_new_tokens=4))
    monkeypatch.setattr(pipeline, "warmup_config", lambda tc: WarmupConfig(
        model=tc.model, task=tc.task, num_prompts=3, group_size=2, holdout_prompts=1, max_new_tokens=8,
        solutions=2, seconds=0, steps=2, batch_tokens=16, draft_vocab_size=32, eval_greedy=False))
    runs = {"sft": 0, "warmup": 0}
    real_sft, real_warmup = pipeline.sft, pipeline.warmup

    def sft(*args, **kwargs):
        result = real_sft(*args, **kwargs)
        runs["sft"] += not result.cached  # sft answers from its own cache
        return result

    def warmup(*args, **kwargs):
        runs["warmup"] += 1
        return real_warmup(*args, **kwargs)

    monkeypatch.setattr(pipeline, "sft", sft)
    monkeypatch.setattr(pipeline, "warmup", warmup)
    return runs


def default_configs(**train):
    configs = {name: cls() for name, cls in TRAIN_SECTIONS.items()}
    configs["train"] = TrainConfig(**{"task": "sums(max_terms=3, max_value=9)", **train})
    return configs


def test_phases_run_once_then_come_from_the_cache(tiny_phases):
    events = []
    first = pipeline.prepare(run_config(default_configs()), events.append)
    phases = [(e.index, e.total, e.name) for e in events if isinstance(e, pipeline.Phase)]
    assert phases == [(1, 3, "cold start"), (2, 3, "drafter warm-up"), (3, 3, "GRPO")]
    model, drafter = first.train.model, first.rollout.speculation.drafter
    assert model and drafter and "sft" in model and "drafters" in drafter
    again = []
    second = pipeline.prepare(run_config(default_configs()), again.append)
    assert (second.train.model, second.rollout.speculation.drafter) == (model, drafter)
    assert tiny_phases == {"sft": 1, "warmup": 1}  # the second run trained nothing
    assert sum("reused" in e.text for e in again if isinstance(e, Notice)) == 2


def test_named_model_and_spec_off_skip_their_phases(tiny_phases, char_model_dir):
    configs = default_configs(model=str(char_model_dir))
    configs["speculation"] = RolloutSpeculationConfig(spec="off")
    assert pipeline.phases(run_config(configs)) == ["GRPO"]
    out = pipeline.prepare(run_config(configs), lambda e: None)
    assert out.train.model == str(char_model_dir) and out.rollout.speculation.drafter is None
    assert tiny_phases == {"sft": 0, "warmup": 0}


def test_task_without_solutions_starts_from_the_base_model(tiny_phases):
    configs = default_configs(task="rg:chain_sum(max_terms=2, max_digits=1)")
    configs["speculation"] = RolloutSpeculationConfig(spec="off")
    events = []
    out = pipeline.prepare(run_config(configs), events.append)
    assert out.train.model is None and tiny_phases["sft"] == 0
    assert any("no cold start" in e.text for e in events if isinstance(e, Notice))


@pytest.mark.parametrize("flags,message", [
    (["--task", "nosuchtask"], "unknown task 'nosuchtask'"),
    (["--reward", "nosuchmodule:f"], "nosuchmodule"),
    (["--model", "/nonexistent/model"], "model directory not found"),
    (["--drafter", "/nonexistent/drafter"], "drafter directory not found"),
    (["--engine", "vllm", "--exact"], "--exact is the native engine's"),
    (["--engine", "vllm", "--top-p", "0.9"], "use --top-k 0 --top-p 1 with --engine vllm"),
    (["--engine", "vllm", "--max-batch", "4"], "[engine] configures the native engine"),
    (["--engine", "vllm", "--workers", "2", "--engine-restarts", "-1"], "engine_restarts must be >= 0, got -1"),
    (["--kv-cache-gb", "1"], "[vllm] configures the vllm engine"),
    (["--engine", "vllm", "--drafter", "/nonexistent/eagle"], "nor a readable config.json"),
    (["--engine", "vllm", "--topk", "2"], "the vllm engine drafts chains (--topk 1)"),
    (["--engine", "vllm", "--speculative-per-batch", "2-8:4"], "must start at batch 1"),
])
def test_bad_input_fails_before_any_phase_starts(tiny_phases, tmp_path, capsys, flags, message):
    from tailrl.cli import main

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailrl: error: ") and message in err and err.count("\n") == 1  # one line, no phase
    assert not out.exists() and tiny_phases == {"sft": 0, "warmup": 0}


def test_the_vllm_engine_drafts_with_the_warmed_up_drafter(tiny_phases):
    """--engine vllm warms a drafter up as the native engine does, and drafts with it (a learned
    drafter, which the rollout adapts); --no-warmup-drafter, --spec off or a named --drafter
    skip it: one --drafter for both engines."""
    first = pipeline.prepare(run_config(default_configs(engine="vllm")), lambda e: None)
    drafter = first.rollout.drafter()
    assert drafter is not None and "drafters" in str(drafter) and first.rollout.speculation.drafter == str(drafter)
    assert tiny_phases == {"sft": 1, "warmup": 1}
    assert pipeline.phases(run_config(default_configs(engine="vllm", warmup_drafter=False))) == ["cold start", "GRPO"]
    off = default_configs(engine="vllm")
    off["speculation"] = RolloutSpeculationConfig(spec="off")
    assert pipeline.phases(run_config(off)) == ["cold start", "GRPO"] and run_config(off).rollout.drafting() is None
    named = default_configs(engine="vllm")
    named["speculation"] = RolloutSpeculationConfig(drafter=str(drafter))
    assert pipeline.phases(run_config(named)) == ["cold start", "GRPO"]


def test_the_vllm_engine_without_vllm_names_its_install(tiny_phases, tmp_path, capsys, monkeypatch):
    import importlib.util

    from tailrl.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    assert main(["train", "--out", str(tmp_path / "run"), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'tailrl[vllm]'" in err and err.count("\n") == 1 and tiny_phases == {"sft": 0, "warmup": 0}


def test_regime_plot_is_drawn(tmp_path):
    record = dict(step=1, reward_mean=0.3, format_rate=1.0, response_lens=[10, 12, 80], max_new_tokens=128,
                  rollout_s=8.0, reward_s=0.1, train_s=1.9, step_s=10.0, rollout_share=0.8, tail_share=0.5,
                  response_len_max=80, response_len_p50=12.0, accept_len_ceiling=4.5)
    written = write_plots([record, dict(record, step=2)], tmp_path)
    assert tmp_path / "regime.png" in written and (tmp_path / "regime.png").stat().st_size > 0


def test_the_default_warmup_adds_worked_solutions_only_where_the_task_has_them(tmp_path):
    assert pipeline.warmup_config(TrainConfig()).solutions == pipeline.WARMUP_SOLUTIONS
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "1+1=", "answer": 2}\n')
    assert pipeline.warmup_config(TrainConfig(task=str(plain))).solutions == 0


def test_the_default_warmup_is_a_number_of_steps_not_seconds(tmp_path):
    """The same command trains the same drafter on any machine: the default run's warm-up and
    `tailrl drafter warmup` stop at a number of optimiser steps, never at a time budget: a cap,
    or earlier where the held-out replays (a function of the weights, every eval_every steps)
    stop rising (tests/test_warmup.py)."""
    cfg = pipeline.warmup_config(TrainConfig())
    assert (cfg.steps, cfg.seconds) == (pipeline.WARMUP_STEPS, 0.0) and cfg.eval_every > 0
    assert WarmupConfig().seconds == 0.0 and WarmupConfig().steps > 0 and WarmupConfig().eval_every > 0


def test_the_drafters_layers_are_a_run_setting_and_a_one_layer_drafter_keeps_its_cache(char_model_dir, tmp_path,
                                                                                        monkeypatch):
    """drafter_layers reaches the warm-up and its cache key; a one-layer drafter's key is the one
    it had before the setting existed (every setting but the model, hashed after the model's
    fingerprint), so drafters already cached stay found."""
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path))
    two = pipeline.warmup_config(TrainConfig(model=str(char_model_dir), drafter_layers=2))
    one = dataclasses.replace(two, drafter_layers=1)
    assert two.drafter_layers == 2 and pipeline.warmup_config(TrainConfig()).drafter_layers == 1
    before = {k: v for k, v in dataclasses.asdict(one).items() if k not in ("model", "drafter_layers")}
    h = hashlib.sha256(model_fingerprint(char_model_dir).encode())
    h.update(json.dumps(before, sort_keys=True).encode())
    assert pipeline.warmup_cache_dir(one) == tmp_path / "drafters" / h.hexdigest()[:16]
    assert pipeline.warmup_cache_dir(two).parent == tmp_path / "drafters" != pipeline.warmup_cache_dir(one)
    with pytest.raises(ValueError, match="drafter_layers must be >= 1"):
        TrainConfig(drafter_layers=0)


def test_warmup_progress_estimates_the_time_left(capsys):
    """Each warm-up phase shows an estimate: by the rate so far (a count), by the rest of the
    time budget, the smaller of the two when both bound it, none before anything is done."""
    from tailrl.cli import warmup_printer
    from tailrl.warmup import WarmupProgress

    assert WarmupProgress("sample", 24, 96, 30.0).seconds_left == 90.0
    assert WarmupProgress("train", 100, 0, 60.0, 0.5, budget_s=240.0).seconds_left == 180.0
    assert WarmupProgress("train", 100, 150, 60.0, 0.5, budget_s=240.0).seconds_left == 30.0
    assert WarmupProgress("sample", 0, 96, 5.0).seconds_left is None
    warmup_printer()(WarmupProgress("sample", 24, 96, 30.0))
    assert "warmup sample: 24/96 (30 s, ~90 s left)" in capsys.readouterr().err
