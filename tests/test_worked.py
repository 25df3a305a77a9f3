"""Tasks with worked solutions: rendered solutions verify at every size, near-misses fail, and
the problem-size sampler follows its stated law."""

import json
import math
import re

import numpy as np
import pytest

from tailrl.rl.tasks import extract_answer, make_task
from tailrl.rl.worked import CollatzTask, RunningSumTask, WorkedTask, size_pmf

LINE = re.compile(r"(\d+) \+ (\d+) = (\d+)")


@pytest.mark.parametrize("max_value", [9, 20, 999])
def test_sums_solution_verifies_at_every_size(max_value):
    task = RunningSumTask(min_terms=2, max_terms=40, max_value=max_value)
    rng = np.random.default_rng(max_value)
    for n in range(2, 41):
        problem = task.problem([int(t) for t in rng.integers(1, max_value + 1, size=n)])
        text = task.solution(problem)
        lines = text.splitlines()
        assert len(lines) == n  # n - 1 additions and the answer
        total = problem.meta["terms"][0]
        for line, term in zip(lines[:-1], problem.meta["terms"][1:]):  # each line is right arithmetic
            a, b, c = map(int, LINE.fullmatch(line).groups())
            assert (a, b, c) == (total, term, total + term)
            total = c
        assert task.score(problem, extract_answer(text)) == 1.0


def test_sums_verifier_rejects_near_misses():
    task = RunningSumTask()
    problem = task.problem([40, 52])
    assert task.score(problem, "92") == 1.0 and task.score(problem, " 92 ") == 1.0
    for wrong in ["91", "93", "29", "920", "92.0", "92.5", "9 2", "92 apples", "about 92", "", "-92", "0x5c"]:
        assert task.score(problem, wrong) == 0.0, wrong


def test_size_pmf_matches_hand_computed_law():
    pmf = size_pmf(2, 4, 1.0)  # P(n >= k) = 2 / k: P(2) = 1 - 2/3, P(3) = 2/3 - 2/4, P(4) = 2/4
    assert np.allclose(pmf, [1 / 3, 1 / 6, 1 / 2]) and math.isclose(pmf.sum(), 1.0)


@pytest.mark.parametrize("min_terms,max_terms,alpha", [(2, 32, 1.0), (3, 12, 1.5)])
def test_problem_sizes_follow_the_stated_law(min_terms, max_terms, alpha):
    """The empirical CDF of n over N problems stays within eps of the stated one everywhere.

    DKW inequality: P(sup |F_N - F| > eps) <= 2 exp(-2 N eps^2), also for discrete laws; with
    N = 20,000 and eps = 0.0194 a correct sampler fails this with probability below 1e-6.
    """
    task = RunningSumTask(min_terms=min_terms, max_terms=max_terms, alpha=alpha)
    N = 20_000
    eps = math.sqrt(math.log(2 / 1e-6) / (2 * N))
    sizes = np.array([len(task.sample(7, i).meta["terms"]) for i in range(N)])
    assert sizes.min() >= min_terms and sizes.max() <= max_terms
    cdf = np.cumsum(size_pmf(min_terms, max_terms, alpha))
    empirical = np.array([(sizes <= k).mean() for k in range(min_terms, max_terms + 1)])
    assert np.abs(empirical - cdf).max() < eps


def test_sums_stream_is_deterministic_and_named():
    task = make_task("sums(max_terms=6, max_value=9)")
    assert isinstance(task, WorkedTask) and task.max_terms == 6
    assert task.sample(3, 11) == task.sample(3, 11) and task.sample(3, 11) != task.sample(4, 11)
    with pytest.raises(ValueError, match="invalid settings"):
        make_task("sums(max_termz=6)")
    with pytest.raises(ValueError, match="min_terms"):
        make_task("sums(max_terms=1)")


def test_collatz_solution_by_hand_and_the_known_stopping_times():
    task = make_task("collatz")
    assert isinstance(task, WorkedTask)
    p = task.problem(6)
    assert p.answer == "8"  # 6 3 10 5 16 8 4 2 1
    text = task.solution(p)
    assert text.splitlines()[:2] == ["1: 6 even, 3", "2: 3 odd, 10"]
    assert text.splitlines()[-2:] == ["8: 2 even, 1", "<answer>8</answer>"]
    assert task.score(p, extract_answer(text)) == 1.0 and task.score(p, "9") == 0.0 and task.score(p, "8.0") == 0.0
    assert task.problem(27).answer == "111" and task.problem(871).answer == "178"  # published stopping times


def test_collatz_starts_are_log_uniform():
    """log(start) is uniform on [log 3, log 501) before the floor: the share of starts up to 30,
    floor(exp(u)) <= 30 exactly when u < log 31, is log(31 / 3) / log(501 / 3) = 0.4563. Over N =
    20,000 starts the share's standard deviation is 0.0035; outside +-0.02 (5.7 sigma) a correct
    sampler fails with probability below 1e-7."""
    task = CollatzTask()
    starts = np.array([task.sample(5, i).meta["start"] for i in range(20_000)])
    assert starts.min() >= 3 and starts.max() <= 500
    assert abs((starts <= 30).mean() - math.log(31 / 3) / math.log(501 / 3)) < 0.02
    assert task.sample(5, 9) == task.sample(5, 9) and make_task("collatz(max_start=50)").max_start == 50
    with pytest.raises(ValueError, match="min_start"):
        make_task("collatz(max_start=1)")


def test_gsm_symbolic_solutions_verify_with_its_own_scorer():
    task = make_task("rg:gsm_symbolic")
    for i in range(5):
        problem = task.sample(0, i)
        text = task.solution(problem)
        assert "####" not in text and len(text.splitlines()) > 2  # natural-language steps
        answer = extract_answer(text)
        assert task.score(problem, answer) == 1.0
        assert task.score(problem, str(int(answer) + 1)) < 1.0


def test_rg_task_without_worked_solutions_says_so():
    task = make_task("rg:chain_sum(max_terms=2, max_digits=1)")
    with pytest.raises(ValueError, match="no worked solutions"):
        task.solution(task.sample(0, 0))


def test_jsonl_solution_field(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "2+3?", "answer": "5", "solution": "2 + 3 = 5"},
            {"prompt": "1+1?", "answer": "2", "solution": "1 + 1 = 2\n<answer>2</answer>"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_task(str(path))
    texts = {task.sample(0, i).question: task.solution(task.sample(0, i)) for i in range(2)}
    assert texts == {"2+3?": "2 + 3 = 5\n<answer>5</answer>", "1+1?": "1 + 1 = 2\n<answer>2</answer>"}
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"prompt": "2+3?", "answer": "5"}) + "\n")
    with pytest.raises(ValueError, match="no 'solution' field"):
        make_task(str(bare)).solution(make_task(str(bare)).sample(0, 0))
