"""`tailrl bench all`: runs the selected benches, keeps their JSON, and rewrites exactly the
results page's generated section (text around it stays), refusing a page without markers."""

import json
from pathlib import Path

import pytest

from tailrl.bench.suite import END, START, BenchAllConfig, update_results_md
from tailrl.cache_dir import shown_path
from tailrl.cli import main
from tailrl.config import read_toml


def test_bench_all_writes_json_and_rewrites_only_the_results_section(smollm2_shallow_dir, tmp_path, capsys):
    config = tmp_path / "bench.toml"
    config.write_text(f'[generate]\nmodel = "{smollm2_shallow_dir}"\ndtype = "fp32"\n'
                      'batch_sizes = [1, 2]\nmax_new_tokens = 3\n')
    page = tmp_path / "results.md"
    page.write_text(f"# title\n\nbefore\n{START}\nold numbers\n{END}\nafter\n")
    results = tmp_path / "results"
    args = ["bench", "all", "--config", str(config), "--only", "generate", "--results", str(results),
            "--results-md", str(page), "--json"]
    for _ in range(2):  # a second run replaces the section, never appends
        assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"generate": str(results / "generate.json")}
    record = json.loads((results / "generate.json").read_text())
    assert record["config"]["batch_sizes"] == [1, 2] and record["meta"]["cores"] >= 1
    assert [r["batch_size"] for r in record["report"]["results"]] == [1, 2]
    text = page.read_text()
    assert text.startswith("# title\n\nbefore\n" + START) and text.endswith(END + "\nafter\n")
    assert text.count(START) == 1 and "old numbers" not in text
    section = text.split(START)[1].split(END)[0]
    assert "#### `tailrl bench generate`" in section
    rows = [line for line in section.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and all(line.endswith("x |") for line in rows)


def test_bench_all_refuses_a_page_without_markers_and_unknown_benches(tmp_path, capsys):
    page = tmp_path / "results.md"
    page.write_text("# no markers\n")
    assert main(["bench", "all", "--only", "nosuch", "--results-md", str(page)]) == 2
    assert "unknown bench(es) nosuch" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no results markers"):
        update_results_md(page, "x")
    assert page.read_text() == "# no markers\n"


def test_bench_all_writes_into_a_run_directory_by_default_and_refuses_the_old_flag(capsys):
    # Never into the checkout unless named (docs/results/bench.toml names the repository's page).
    assert (BenchAllConfig().results, BenchAllConfig().results_md) == (None, None)
    assert read_toml(Path(__file__).parent.parent / "docs/results/bench.toml")["all"] == {
        "results": "docs/results", "results_md": "docs/results.md"}
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "all", "--readme", "README.md"])
    assert exit_info.value.code == 2 and "--readme was renamed --results-md" in capsys.readouterr().err


def test_a_two_run_bench_train_report_still_renders():
    # docs/results/train.json was measured by the two-run bench train (baseline and TLT only).
    from pathlib import Path

    from tailrl.bench.suite import _train

    report = json.loads((Path(__file__).parent.parent / "docs/results/train.json").read_text())["report"]
    rows = [line for line in _train(report) if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(report["steps"]) and "TLT 0.95x" in _train(report)[0]


def test_records_show_paths_under_the_cache_or_the_working_directory(tmp_path, monkeypatch):
    """Results files are committed and read on other machines: a path under the cache shows as
    the cache's documented name, one under the working directory (the repository) relative to
    it; others as given."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TAILRL_CACHE", raising=False)
    assert shown_path(str(tmp_path / "home/.cache/tailrl/sft/ab12")) == "~/.cache/tailrl/sft/ab12"
    assert shown_path(str(tmp_path / "runs/bench/bench-train.png")) == "runs/bench/bench-train.png"
    assert shown_path("/elsewhere/drafter") == "/elsewhere/drafter"
    assert shown_path("drafters/smol") == "drafters/smol"
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path / "cache"))
    assert shown_path(str(tmp_path / "cache/drafters/cd34")) == "$TAILRL_CACHE/drafters/cd34"
