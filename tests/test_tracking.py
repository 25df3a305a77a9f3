"""Experiment tracking: records split into scalars and histograms as documented, and
`tailrl train --report-to tensorboard` event files that TensorBoard's own reader loads with the
same scalars as metrics.jsonl (values compared after TensorBoard's float32 rounding)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tailrl.cli import main
from tailrl.tracking import TensorBoardReporter, split_record


def test_a_record_splits_into_scalars_nested_scalars_and_histograms():
    record = {"step": 3, "loss": 0.5, "exact": True, "tokens_sha256": "ab", "response_lens": [4, 1, 4],
              "accept_hist": [2, 0, 1], "by_bucket": {"1-4": {"plain": {"steps": 7, "seconds": 0.25}}},
              "batch_timeline": [[0.0, 0.1, 4, "plain"]], "arm_by_bucket": {"1-4": "plain"}}
    scalars, hists = split_record(record)
    assert scalars == {"step": 3.0, "loss": 0.5, "exact": 1.0, "by_bucket/1-4/plain/steps": 7.0,
                       "by_bucket/1-4/plain/seconds": 0.25}
    assert set(hists) == {"response_lens", "accept_hist"}
    assert hists["response_lens"].tolist() == [4.0, 1.0, 4.0]
    assert hists["accept_hist"].tolist() == [0.0, 0.0, 2.0]  # two verifies accepted 0 drafts, one 2


def _accumulator(path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = ea_mod.EventAccumulator(str(path), size_guidance={ea_mod.SCALARS: 0, ea_mod.HISTOGRAMS: 0})
    ea.Reload()
    return ea


def test_train_report_to_tensorboard_has_the_metrics_jsonl_scalars(tmp_path, char_model_dir, task_file, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setattr("tailrl.rl.train.write_plots", lambda *args: [])
    out = tmp_path / "run"
    rc = main(["train", "--out", str(out), "--report-to", "tensorboard", "--model", str(char_model_dir),
               "--dtype", "fp32", "--task", str(task_file), "--reward", "conftest:high_chars_reward",
               "--num-prompts", "2", "--group-size", "3", "--max-new-tokens", "8", "--steps", "2", "--seed", "5",
               "--spec", "off", "--eval-problems", "4"])
    assert rc == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    ea = _accumulator(out / "tensorboard")
    for key in records[0]:
        if isinstance(records[0][key], (int, float)):
            events = ea.Scalars(key)
            assert [e.step for e in events] == [1, 2], key
            assert [e.value for e in events] == [float(np.float32(r[key])) for r in records], key
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]  # before the first step and after the last
    for key in evals[0]:
        if key != "step" and isinstance(evals[0][key], (int, float)):
            assert ([(e.step, e.value) for e in ea.Scalars(key)]
                    == [(r["step"], float(np.float32(r[key]))) for r in evals])
    assert [h.step for h in ea.Histograms("heldout_rewards")] == [0, 2]  # per problem
    for r, h in zip(records, ea.Histograms("response_lens")):
        v = h.histogram_value
        assert (v.num, v.min, v.max, v.sum) == (len(r["response_lens"]), min(r["response_lens"]),
                                                max(r["response_lens"]), sum(r["response_lens"]))


def test_a_resumed_session_replaces_the_steps_it_reruns(tmp_path):
    pytest.importorskip("tensorboard")
    first = TensorBoardReporter(tmp_path)
    for step in (1, 2, 3):
        first.log(step, {"x": float(step)}, {})
    first.close()
    second = TensorBoardReporter(tmp_path)  # resumed from the step-1 checkpoint: steps 2.. again
    for step in (2, 3):
        second.log(step, {"x": 10.0 * step}, {})
    second.close()
    assert [(e.step, e.value) for e in _accumulator(tmp_path).Scalars("x")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_missing_backend_is_one_clear_error(monkeypatch, tmp_path, capsys):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    rc = main(["drafter", "warmup", "--out", str(tmp_path / "d"), "--report-to", "wandb"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (
        "tailrl: error: --report-to wandb needs the wandb package: pip install 'tailrl[wandb]'")
    assert not (tmp_path / "d").exists()


class _Recorder:
    """A Reporter that keeps what it is given."""

    def __init__(self):
        self.logged = []

    def log(self, step, scalars, histograms):
        self.logged.append((step, scalars, {k: v.tolist() for k, v in histograms.items()}))

    def close(self):
        pass


def test_warmup_tracking_logs_each_step_loss_then_the_report():
    from tailrl.tracking import WarmupTracking
    from tailrl.warmup import WarmupProgress, WarmupReport

    rec = _Recorder()
    tracking = WarmupTracking(rec)
    for event in (WarmupProgress("sample", 3, 8, 1.0), WarmupProgress("train", 1, 0, 2.0, 0.75),
                  WarmupProgress("train", 2, 0, 3.0, 0.5), WarmupProgress("eval", 0, 1, 4.0)):
        tracking(event)
    report = WarmupReport(1.0, 2.0, 2, 10, 300, 4, 0.9, {"after": {"loss": 0.4}},
                          {"greedy": {"drafter(4,1,4)": {"accept_len": 2.5, "verify_steps": 8, "accept_hist": [1, 3]}}},
                          best_step=1, replays=[[1, 0.5, 2.25, 1.0], [2, 1.0, 2.125, 0.25]])
    tracking.finish(report)
    assert rec.logged[:2] == [(1, {"train/loss": 0.75}, {}), (2, {"train/loss": 0.5}, {})]
    assert rec.logged[2:4] == [(1, {"heldout/accept_len": 2.25}, {}), (2, {"heldout/accept_len": 2.125}, {})]
    step, scalars, hists = rec.logged[4]
    assert step == 2 and scalars["report/heldout/after/loss"] == 0.4 and scalars["report/vocab_coverage"] == 0.9
    assert scalars["report/best_step"] == 1 and not any("replays" in k for k in [*scalars, *hists])
    assert scalars["report/accept/greedy/drafter(4,1,4)/accept_len"] == 2.5
    assert hists == {"report/accept/greedy/drafter(4,1,4)/accept_hist": [0.0, 1.0, 1.0, 1.0]}
