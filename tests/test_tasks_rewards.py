"""Tasks and rewards: JSONL errors, math equivalence, reasoning-gym determinism and scoring,
and rewards that crash or hang costing one sample, not the run."""

import logging
import threading

import pytest

from tailrl.rl.rewards import (
    format_reward,
    from_reward_fn,
    load_reward,
    safe_rewards,
    task_reward,
)
from tailrl.rl.tasks import (
    DEFAULT_TASK,
    JsonlTask,
    Problem,
    ReasoningGymTask,
    extract_answer,
    format_prompt,
    make_task,
)


def _write(tmp_path, text, name="probs.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


# --- JSONL -------------------------------------------------------------------------------------


def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    path = _write(tmp_path, '{"prompt": "1+1?", "answer": "2"}\n\n{"prompt": "2+2?", "answer": \n')
    with pytest.raises(ValueError, match=r"probs\.jsonl, line 3: invalid JSON"):
        JsonlTask(path)


def test_jsonl_missing_answer_names_line(tmp_path):
    path = _write(tmp_path, '{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    with pytest.raises(ValueError, match=r"line 2: missing 'answer'"):
        JsonlTask(path)


def test_jsonl_missing_question_and_empty_file(tmp_path):
    with pytest.raises(ValueError, match=r"line 1: needs a 'prompt' or 'question'"):
        JsonlTask(_write(tmp_path, '{"answer": "2"}\n'))
    with pytest.raises(ValueError, match="no problems"):
        JsonlTask(_write(tmp_path, "\n", name="empty.jsonl"))


def test_jsonl_order_is_a_seeded_permutation_per_pass(tmp_path):
    lines = "".join(f'{{"prompt": "q{i}", "answer": {i}}}\n' for i in range(5))
    task = JsonlTask(_write(tmp_path, lines))
    first = [task.sample(7, i).question for i in range(5)]
    assert sorted(first) == [f"q{i}" for i in range(5)]  # each problem once per pass
    assert [JsonlTask(task.path).sample(7, i).question for i in range(5)] == first
    assert task.sample(7, 3).answer == first[3][1:]  # numeric answers become strings


def test_jsonl_scores_with_math_verify_and_string_fallback(tmp_path):
    lines = '{"prompt": "half?", "answer": "1/2"}\n{"prompt": "capital?", "answer": "Paris"}\n'
    task = JsonlTask(_write(tmp_path, lines))
    half, paris = task.problems
    assert task.score(half, "0.5") == 1.0
    assert task.score(half, "\\frac{1}{2}") == 1.0
    assert task.score(half, "0.25") == 0.0
    assert task.score(paris, " paris. ") == 1.0  # math_verify cannot parse it: normalised equality
    assert task.score(paris, "Rome") == 0.0


# --- reasoning-gym -----------------------------------------------------------------------------


def test_reasoning_gym_is_deterministic_and_scores_its_answer():
    task = ReasoningGymTask("chain_sum", min_terms=2, max_terms=3, max_digits=2)
    again = ReasoningGymTask("chain_sum", min_terms=2, max_terms=3, max_digits=2)
    for index in (0, 5, ReasoningGymTask.CHUNK + 1):
        p, q = task.sample(3, index), again.sample(3, index)
        assert (p.question, p.answer) == (q.question, q.answer)
        assert task.score(p, p.answer) == 1.0
        assert task.score(p, "not a number") == 0.0
    # Different seeds and neighbouring chunks give different streams.
    assert [task.sample(3, i).question for i in range(8)] != [task.sample(4, i).question for i in range(8)]
    assert task.sample(3, 0).question != task.sample(3, ReasoningGymTask.CHUNK).question


def test_default_task_scores_true_answers():
    task = make_task(DEFAULT_TASK)
    for i in range(20):
        p = task.sample(0, i)
        assert task.score(p, p.answer) == 1.0


def test_make_task_specs_and_errors(tmp_path):
    task = make_task("rg:chain_sum(max_terms=2, max_digits=1)")
    assert isinstance(task, ReasoningGymTask) and task.difficulty == {"max_terms": 2, "max_digits": 1}
    assert make_task("leg_counting", max_animals=3).difficulty == {"max_animals": 3}
    assert isinstance(make_task(str(_write(tmp_path, '{"prompt": "q", "answer": "a"}\n'))), JsonlTask)
    with pytest.raises(ValueError, match="chain_sum"):  # lists valid names, suggests the close one
        make_task("chain_sums")
    with pytest.raises(ValueError, match="max_terms"):  # lists the dataset's settings
        make_task("rg:chain_sum(max_termz=2)")
    with pytest.raises(ValueError, match="cannot generate"):  # weights must match operators
        make_task("rg:simple_equations(operators=('+', '-'))")
    with pytest.raises(ValueError, match="cannot parse"):
        make_task("rg:chain_sum(max_terms=")


# --- prompt format -----------------------------------------------------------------------------


def test_prompt_and_answer_format_round_trip():
    messages = format_prompt("What is 2 + 2?")
    assert messages[-1] == {"role": "user", "content": "What is 2 + 2?"}
    assert all(m["role"] in ("system", "user", "assistant") for m in messages)
    assert extract_answer("2 + 2 = 4.\n<answer> 4 </answer>") == "4"
    assert extract_answer("<answer>x</answer> then <answer>5</answer>") == "5"
    assert extract_answer("The answer is 4.") is None
    assert extract_answer("<answer>  </answer>") is None
    assert format_reward("so <answer>4</answer>") == 1.0 and format_reward("4") == 0.0


def test_task_reward_extracts_then_scores():
    task = ReasoningGymTask("chain_sum", max_terms=2, max_digits=1)
    p = task.sample(0, 0)
    reward = task_reward(task)
    assert reward(p, f"reasoning...\n<answer>{p.answer}</answer>") == 1.0
    assert reward(p, f"the answer is {p.answer}") == 0.0
    half_format = task_reward(task, format_weight=0.5)
    assert half_format(p, "<answer>not it</answer>") == 0.5


# --- user rewards and failures -----------------------------------------------------------------


def my_reward(prompt, completion, answer):
    return float(answer in completion)


NOT_CALLABLE = 3


def test_load_reward_and_its_errors():
    fn = load_reward(f"{__name__}:my_reward")
    assert from_reward_fn(fn)(Problem("q", "42"), "it is 42") == 1.0
    with pytest.raises(ValueError, match="not found"):
        load_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        load_reward(f"{__name__}:nope")
    with pytest.raises(ValueError, match="not a callable"):
        load_reward(f"{__name__}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="module:function"):
        load_reward("just_a_module")


def test_crashing_and_hanging_rewards_score_zero_and_are_counted(caplog):
    """Two batches, so that no call's outcome depends on the machine's speed: the quick calls
    under a timeout that only guards against a hang, and calls that block until the test
    releases them, which time out however short the timeout is."""
    release = threading.Event()

    def flaky(x):
        if x == 1:
            raise RuntimeError("boom")
        if x == 2:
            release.wait(60)  # until the test is done with the batch (60 s: only a guard against a hang)
        if x == 3:
            return float("nan")
        return x / 10

    with caplog.at_level(logging.WARNING, logger="tailrl.rl.rewards"):
        batch = safe_rewards(flaky, [(0,), (1,), (3,), (5,)], timeout_s=600)
        try:
            hung = safe_rewards(flaky, [(2,), (2,)], timeout_s=0.01)
        finally:
            release.set()
    assert batch.rewards == [0.0, 0.0, 0.0, 0.5] and (batch.failures, batch.timeouts) == (2, 0)
    assert hung.rewards == [0.0, 0.0] and (hung.failures, hung.timeouts) == (0, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per batch
    assert "boom" in warnings[0] and "2 of 4 rewards failed and 0 timed out" in warnings[0]
    assert "0 of 2 rewards failed and 2 timed out" in warnings[1]


def test_safe_rewards_all_good_logs_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="tailrl.rl.rewards"):
        batch = safe_rewards(my_reward, [("p", "it is 7", "7"), ("p", "no", "7")], timeout_s=5)
    assert batch.rewards == [1.0, 0.0] and (batch.failures, batch.timeouts) == (0, 0)
    assert not caplog.records
