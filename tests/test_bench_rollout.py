"""`tailrl bench rollout` on the real model cut to two layers (conftest.smollm2_shallow_dir), tiny:
the report's shape and that every mode emits plain decoding's tokens (--exact: fp32 row-invariant
forwards, tailrl.model). The bench's code path does not depend on the model's depth."""

import json
import os
import sys

import pytest

from tailrl.bench.rollout import ModeResult, oracle
from tailrl.bench.suite import _rollout
from tailrl.cli import main


def test_bench_rollout_reports_every_mode_with_identical_tokens(smollm2_shallow_dir, tmp_path, capsys):
    plot = tmp_path / "rollout.png"
    code = main(["bench", "rollout", "--model", str(smollm2_shallow_dir), "--dtype", "fp32", "--num-prompts", "2",
                 "--group-size", "2", "--max-new-tokens", "12", "--reps", "1", "--batches", "2", "--modes",
                 "off,ngram,auto", "--exact", "--plot", str(plot), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["modes"]) == set(report["speedup"]) == {"off", "ngram", "auto"}
    assert report["speedup"]["off"] == 1.0 and report["ideal_seconds"] > 0
    tokens = {m["tokens"] for m in report["modes"].values()}
    assert len(tokens) == 1 and all(m["differing_sequences"] == 0 for m in report["modes"].values())
    # The bench's accept_len (each batch's verifies and emitted tokens) is what the engine's
    # position counters give: responses of <= 12 tokens start every verify in the first bucket.
    ngram = report["modes"]["ngram"]
    assert ngram["accept_len"] == ngram["accept_len_by_position"]["0-512"] and ngram["sd_fraction"] == 1.0
    # Beside it, the ceiling at the depths it drafted (n-gram chains of at most 8); plain has none.
    assert (report["modes"]["off"]["accept_ceiling"], report["modes"]["off"]["draft_depth"]) == (None, 0.0)
    assert ngram["accept_ceiling"] is not None and 1.0 <= ngram["draft_depth"] <= 8.0
    rows = [line for line in _rollout(report) if line.startswith("| ")][1:]  # the results page's rendering
    assert [line.split(" | ")[0] for line in rows[:3]] == ["| off", "| ngram", "| auto"]
    # The oracle read the modes that ran, and only them: native ones, so the best over every
    # engine is the native engine's and no other engine has an oracle time.
    oracle = report["oracle"]
    assert (report["batches"] == 2 and oracle["native_seconds"] == oracle["any_seconds"]
            and oracle["vllm_seconds"] is None)
    assert {name.split(" ")[0] for b in oracle["buckets"].values() for name in b["rates"]} <= set(report["modes"])
    assert 0 < oracle["auto_efficiency"] < float("inf")
    assert any(line.startswith("Oracle time") for line in _rollout(report))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each mode's resident peak, in GiB within the machine's memory. (Not within the process's
    # ru_maxrss: each mode's reset of the high-water mark (tailrl.memory) resets that too, so an
    # earlier mode's peak can exceed it.)
    total_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert sys.platform != "linux" or all(0.0 < m["peak_rss_gb"] <= total_gb for m in report["modes"].values())


def test_the_oracle_decodes_each_buckets_work_at_its_best_measured_rate():
    """Hand-computed: off decodes 100 tokens at batch 64 in 2 s and 10 at batch 1 in 1 s (two
    repetitions: twice that), after 0.5 s of prefill; the drafter mode decodes batch 1 at 30
    tok/s (and an arm measured over too few steps to count at 90), vLLM's off batch 64 at 100
    tok/s. Native oracle: 0.5 + 100/50 + 10/30; over both engines: 0.5 + 100/100 + 10/30. auto
    sampled other tokens: 30 per repetition, all at batch 1 (at 10 and 20 tok/s), after 0.5 s of
    prefill, in 3 s: its own work at the best rates takes 0.5 + 30/30 s, efficiency 1.5 / 3."""
    off, drafter, vllm_off = ModeResult(prefill=[0.5, 0.5]), ModeResult(seconds=[2.0, 2.0]), ModeResult(prefill=[0.2])
    off.cells = {">32": {"plain": [200.0, 4.0, 10]}, "1": {"plain": [20.0, 2.0, 20]}}
    drafter.cells = {"1": {"drafter(6,1,6)": [60.0, 2.0, 8], "ngram(2,1,2)": [90.0, 1.0, 4]}}  # 4 steps: too few
    vllm_off.cells = {">32": {"plain": [100.0, 1.0, 5]}}
    auto = ModeResult(seconds=[3.0, 3.0], prefill=[0.4, 0.6])
    auto.cells = {"1": {"plain": [20.0, 2.0, 20], "ngram(2,1,2)": [40.0, 2.0, 10]}}
    o = oracle({"off": off, "drafter": drafter, "vllm-off": vllm_off, "auto": auto}, reps=2)
    assert o["native_seconds"] == pytest.approx(0.5 + 2.0 + 1 / 3)
    assert o["any_seconds"] == pytest.approx(0.5 + 1.0 + 1 / 3)
    assert o["vllm_seconds"] == pytest.approx(0.2 + 0.5)  # vLLM's own work per repetition: 100 / 2 at 100 tok/s
    assert o["buckets"]["1"]["best"] == "drafter drafter(6,1,6)" and o["buckets"][">32"]["best"] == "vllm-off plain"
    assert o["auto_efficiency"] == pytest.approx((0.5 + 1.0) / 3.0)


@pytest.mark.slow  # two vLLM engines on the two-layer SmolLM2: ~25 s on a 2-core AVX2 EPYC
def test_bench_rollout_runs_the_vllm_modes_beside_the_native_ones(smollm2_shallow_dir, tmp_path, capsys):
    """The vLLM modes (two of three: vllm-off is the plain engine test_vllm.py covers; a cold
    tuner, so no third engine warms one): each decodes the whole batch (its own samples, so no
    token comparison: differing_sequences is None), vllm-drafter verifies the learned drafter's
    drafts every step, and the results page renders them."""
    pytest.importorskip("vllm")
    from tailrl.loading import load_model
    from tailrl.speculative.drafter.model import Drafter, save_drafter

    drafter = save_drafter(Drafter.from_target(load_model(smollm2_shallow_dir, "fp32"), list(range(512)), "shallow"),
                           tmp_path / "drafter")
    code = main(["bench", "rollout", "--model", str(smollm2_shallow_dir), "--dtype", "fp32", "--num-prompts", "2",
                 "--group-size", "2", "--max-new-tokens", "12", "--reps", "1", "--drafter", str(drafter),
                 "--modes", "off,vllm-drafter,vllm-auto", "--cold-tuner", "--kv-cache-gb", "0.0625",
                 "--draft-depth", "3", "--plot", "", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    modes = report["modes"]
    assert set(modes) == {"off", "vllm-drafter", "vllm-auto"}
    assert all(m["tokens"] > 0 and m["seconds_median"] > 0 for m in modes.values())
    assert [modes[m]["differing_sequences"] for m in ("off", "vllm-drafter", "vllm-auto")] == [0, None, None]
    assert modes["vllm-drafter"]["sd_fraction"] == 1.0
    rows = [line for line in _rollout(report) if line.startswith("| ")][1:]
    assert rows[1].startswith("| vllm-drafter ") and rows[1].endswith("| n/a (vLLM) |")
