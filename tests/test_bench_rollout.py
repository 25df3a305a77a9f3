"""`tailrl bench rollout` on the real model cut to two layers (conftest.smollm2_shallow_dir), tiny:
the report's shape and that every mode emits plain decoding's tokens (--exact: fp32 row-invariant
forwards, tailrl.model). The bench's code path does not depend on the model's depth."""

import json

from tailrl.bench.suite import _rollout
from tailrl.cli import main


def test_bench_rollout_reports_every_mode_with_identical_tokens(smollm2_shallow_dir, tmp_path, capsys):
    plot = tmp_path / "rollout.png"
    code = main(["bench", "rollout", "--model", str(smollm2_shallow_dir), "--dtype", "fp32", "--num-prompts", "2",
                 "--group-size", "2", "--max-new-tokens", "12", "--reps", "2", "--modes", "off,ngram,auto", "--exact",
                 "--plot", str(plot), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["modes"]) == set(report["speedup"]) == {"off", "ngram", "auto"}
    assert report["speedup"]["off"] == 1.0 and report["ideal_seconds"] > 0
    tokens = {m["tokens"] for m in report["modes"].values()}
    assert len(tokens) == 1 and all(m["differing_sequences"] == 0 for m in report["modes"].values())
    assert report["modes"]["ngram"]["accept_len"] >= 1.0 and report["modes"]["ngram"]["sd_fraction"] == 1.0
    rows = [line for line in _rollout(report) if line.startswith("| ")][1:]  # the results page's rendering
    assert [line.split(" | ")[0] for line in rows] == ["| off", "| ngram", "| auto"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
