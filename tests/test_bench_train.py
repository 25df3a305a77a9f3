"""The two-run benches on a tiny model. `tailrl bench train`: both runs (SD off; TLT: auto,
learned drafter, spot training on 2 workers) do identical work in exact mode and the report
compares them step by step; `compare` flags a run whose tokens or rewards differ. `tailrl bench
drafter`: adaptive and frozen drafter, interleaved, same tokens, accept_len per step."""

import json
import sys

import pytest

from tailrl.bench.suite import _drafter, _train
from tailrl.bench.train import compare
from tailrl.cli import main
from tailrl.loading import load_model
from tailrl.speculative.drafter.model import Drafter, save_drafter

pytestmark = pytest.mark.usefixtures("no_plots")

REWARD = "conftest:high_chars_reward"


def record(step: int, digest: str, rewards: list[float], step_s: float, rollout_s: float | None = None,
           in_rollout: float = 0.0) -> dict:
    rollout_s = step_s / 2 if rollout_s is None else rollout_s
    return {"step": step, "step_s": step_s, "rollout_s": rollout_s, "train_s": step_s - rollout_s,
            "tokens_generated": 10, "reward_mean": sum(rewards) / len(rewards), "tokens_sha256": digest,
            "rewards": rewards, "update_in_rollout_s": in_rollout}


def test_compare_sums_step_times_and_flags_the_first_difference():
    base = [record(1, "a", [0.0, 1.0], 4.0), record(2, "b", [1.0, 1.0], 6.0)]
    overlap = [record(1, "a", [0.0, 1.0], 3.0, 2.0, in_rollout=1.0),
               record(2, "b", [1.0, 1.0], 4.0, 3.0, in_rollout=2.0)]
    tlt = [record(1, "a", [0.0, 1.0], 2.0), record(2, "c", [1.0, 0.5], 3.0)]
    report = compare({"baseline": base, "overlap_only": overlap, "tlt": tlt})
    assert report["speedup_e2e"] == 10.0 / 5.0 and report["speedup_rollout"] == 5.0 / 2.5
    assert report["speedup_step_range"] == [2.0, 2.0]
    o = report["runs"]["overlap_only"]
    assert o["speedup_e2e"] == 10.0 / 7.0 and o["speedup_step_range"] == [4.0 / 3.0, 6.0 / 4.0]
    assert o["identical"] and o["idle_policy_s"] == 1.5 and o["idle_drafter_s"] == 0.0
    assert [r["tlt_identical"] for r in report["steps"]] == [True, False]
    assert not report["runs"]["tlt"]["identical"]
    assert not report["identical_tokens"] and not report["identical_rewards"]


def test_bench_train_runs_tlt_and_baseline_on_identical_tokens(char_model_dir, task_file, tmp_path, capsys):
    target = load_model(char_model_dir, dtype="fp32")
    vocab = list(range(1, 128, 2)) + [2, 4]
    drafter = save_drafter(Drafter.from_target(target, vocab, "char", seed=0), tmp_path / "drafter")
    out = tmp_path / "bench"
    code = main(["bench", "train", "--model", str(char_model_dir), "--task", str(task_file), "--reward", REWARD,
                 "--drafter", str(drafter), "--out", str(out), "--steps", "2", "--num-prompts", "3",
                 "--group-size", "4", "--max-new-tokens", "16", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["step"] for r in report["steps"]] == [1, 2]
    assert report["identical_tokens"] and report["identical_rewards"]
    # Every run's resident peak is its steps' highest (Linux counts it: tailrl.memory).
    assert sys.platform != "linux" or all(
        report["peak_rss_gb"][name] == max(r[f"{name}_peak_rss_gb"] for r in report["steps"]) > 0
        for name in ("baseline", "sd_only", "overlap_only", "tlt"))
    runs = {name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("baseline", "sd_only", "overlap_only", "tlt")}
    # The runs differ in what TLT adds: speculation, the drafter and the overlapped update, never
    # in the samples or the update's bits.
    assert all(r["sd_fraction"] == 0 for name in ("baseline", "overlap_only") for r in runs[name])
    assert all(any(r["sd_fraction"] > 0 for r in runs[name]) for name in ("sd_only", "tlt"))
    assert all(r["groups_in_rollout"] == 0 for name in ("baseline", "sd_only") for r in runs[name])
    assert all([r["loss"] for r in runs[name]] == [r["loss"] for r in runs["baseline"]] for name in runs)
    assert all([r["grad_norm"] for r in runs[name]] == [r["grad_norm"] for r in runs["baseline"]] for name in runs)
    # The headline speed-ups are the TLT run's step and rollout times over the baseline's, as
    # their metrics files hold them.
    total = lambda name, key: sum(r[key] for r in runs[name])  # noqa: E731
    assert report["speedup_e2e"] == total("baseline", "step_s") / total("tlt", "step_s")
    assert report["speedup_rollout"] == total("baseline", "rollout_s") / total("tlt", "rollout_s")
    table = [line for line in _train(report) if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(table) == 2  # the results page's rendering of the report
    assert (out / "bench-train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_train_runs_only_the_runs_asked_and_refuses_a_comparison_without_baseline(char_model_dir, task_file,
                                                                                         tmp_path, capsys):
    target = load_model(char_model_dir, dtype="fp32")
    drafter = save_drafter(Drafter.from_target(target, list(range(1, 128, 2)) + [2, 4], "char", seed=0), tmp_path / "d")
    out = tmp_path / "bench"
    args = ["bench", "train", "--model", str(char_model_dir), "--task", str(task_file), "--reward", REWARD,
            "--drafter", str(drafter), "--out", str(out), "--steps", "1", "--num-prompts", "2", "--group-size", "2",
            "--max-new-tokens", "8", "--json"]
    assert main([*args, "--runs", "baseline,tlt"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["runs"]) == {"tlt"} and sorted(p.name for p in out.iterdir() if p.is_dir()) == ["baseline", "tlt"]
    assert report["identical_tokens"] and len([line for line in _train(report) if line.startswith("| 1 |")]) == 1
    assert main([*args, "--runs", "sd_only,tlt"]) == 2


def test_bench_drafter_compares_adaptive_and_frozen_drafters_step_by_step(char_model_dir, task_file, tmp_path,
                                                                          capsys):
    target = load_model(char_model_dir, dtype="fp32")
    drafter = save_drafter(Drafter.from_target(target, list(range(1, 128, 2)) + [2, 4], "char", seed=0),
                           tmp_path / "drafter")
    out = tmp_path / "bench"
    code = main(["bench", "drafter", "--model", str(char_model_dir), "--task", str(task_file), "--reward", REWARD,
                 "--drafter", str(drafter), "--out", str(out), "--steps", "2", "--spec", "on", "--num-prompts", "3",
                 "--group-size", "4", "--max-new-tokens", "16", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    adaptive = [json.loads(line) for line in (out / "adaptive" / "metrics.jsonl").read_text().splitlines()]
    frozen = [json.loads(line) for line in (out / "frozen" / "metrics.jsonl").read_text().splitlines()]
    # --spec on: every decode step verified a draft, so each response's tokens but its first
    # (sampled at its prefill) came from the drafter's verifies, 3 x 4 responses a step.
    for name, records in (("adaptive", adaptive), ("frozen", frozen)):
        assert report[f"accept_len_{name}"] == [(r["tokens_generated"] - 12) / r["spec_verify_steps"] for r in records]
    # Step 1 drafts with the same version 0 in both runs, so the same drafts are verified.
    assert report["accept_len_adaptive"][0] == report["accept_len_frozen"][0]
    # Responses of <= 16 tokens: every verify starts in the first position bucket.
    assert all(set(by) <= {"0-512"} for by in report["accept_len_by_position_adaptive"])
    assert report["accept_len_by_position_adaptive"][0] == report["accept_len_by_position_frozen"][0]
    assert report["overhead"] > 0 and len(report["drafter_micro_steps"]) == 2
    assert [r["tokens_sha256"] for r in adaptive] == [r["tokens_sha256"] for r in frozen]
    # Same tokens from the same target logits: the same ceiling, whichever drafter drafted.
    assert report["accept_len_ceiling"] == [r["accept_len_ceiling"] for r in frozen]
    # Replayed on the responses' top-1 flags: above 1 where a chain of the target's own argmax
    # would have been accepted somewhere in the step (1.0 exactly: no flag set).
    assert all(x > 1.0 for x in report["accept_len_ceiling"])
    assert sum(line.startswith("| ceiling") for line in _drafter(report)) == 1  # the results page's rendering
    assert all(r["drafter_version"] == 0 for r in frozen)
