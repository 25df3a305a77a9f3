"""Tasks by name (reasoning-gym datasets, JSONL files, the procedural worked tasks) and the prompt.

A task turns (run seed, index) into a Problem deterministically, so the data order of a run is
a pure function of its seed and resumes exactly, and scores an extracted answer in [0, 1]
(the contract: tailrl.rl.problems).

Knows: reasoning-gym datasets and their scorers, JSONL problem files, math_verify, the chat
prompt and the answer format. Does not know: tokenizers, models, how completions were
produced, advantages.
"""

from __future__ import annotations

import ast
import difflib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from tailrl.rl.problems import Problem, Task, extract_answer
from tailrl.rl.worked import PROCEDURAL, jsonl_solution, rg_solution
from tailrl.sampling import derive_seed

__all__ = [
    "DEFAULT_TASK",
    "HELDOUT_STREAM",
    "JsonlTask",
    "Problem",
    "ReasoningGymTask",
    "Task",
    "extract_answer",
    "format_prompt",
    "make_task",
    "math_match",
]

# The task of `tailrl train` with no arguments: heavy-tailed running-total sums with worked
# solutions (tailrl.rl.worked; docs/workload.md says why and how it was sized).
DEFAULT_TASK = "sums"
# The stream of held-out problems: task.sample(seed + HELDOUT_STREAM, i). Apart from the RL run's
# stream (its run seed) and the cold start's training stream; a JSONL task has one pool of
# problems, so there they can overlap.
HELDOUT_STREAM = 1_000_003


# ---------------------------------------------------------------------------------------------
# Prompt template and answer format


SYSTEM_PROMPT = (
    "You are a helpful assistant. Think step by step, briefly. Then give the final answer "
    "inside <answer></answer> tags."
)
# One worked exchange before the question: a small model at temperature 1 rarely follows a format
# it is only told about, and one shown example makes it use the answer tags (docs/history.md).
EXAMPLE = [
    {"role": "user", "content": "What is 7 + 5?"},
    {"role": "assistant", "content": "7 + 5 = 12.\n<answer>12</answer>"},
]
def format_prompt(question: str) -> list[dict[str, str]]:
    """Chat messages: instructions, one worked example, then the question.

    The answer format is the last <answer>...</answer> pair (extract_answer), the convention
    reasoning-gym's own prompts use.
    """
    return [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": question}]


class Tokenizer(Protocol):
    """What tailrl asks of a model's tokenizer (a transformers tokenizer is one)."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = ...,
                            tokenize: bool = ...) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def encode_question(tokenizer: Tokenizer, question: str) -> tuple[int, ...]:
    """The chat prompt of a question (format_prompt), ending where the answer starts."""
    if not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template; tailrl prompts are chat messages")
    text = tokenizer.apply_chat_template(format_prompt(question), add_generation_prompt=True, tokenize=False)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------------------------
# reasoning-gym


def _reasoning_gym():
    # Imported on first use: it is slow to import and JSONL-only runs do not need it.
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    return reasoning_gym, DATASETS


class ReasoningGymTask:
    """A reasoning-gym dataset as an endless, seeded problem stream scored by its own verifier.

    Items come from datasets of CHUNK items whose seeds are hashed from (run seed, chunk), so
    sample() is O(1) after the first call per chunk and the streams of different run seeds do
    not overlap (reasoning-gym seeds item i with seed + i, so consecutive seeds would share
    items). Difficulty keyword arguments go to the dataset's config unchanged.
    """

    CHUNK = 1024
    CACHED_CHUNKS = 4

    def __init__(self, name: str, **difficulty: Any) -> None:
        _, datasets = _reasoning_gym()
        if name not in datasets:
            raise ValueError(_unknown_task_message(name, sorted(datasets)))
        self.name = name
        self.difficulty = dict(difficulty)
        self._chunks: OrderedDict[tuple[int, int], Any] = OrderedDict()
        # Built once up front so that bad settings fail here, not mid-run; score() uses it.
        self._scorer = self._build(seed=0)
        try:
            self._scorer[0]
        except Exception as e:  # some settings only fail when an item is generated
            raise ValueError(
                f"reasoning-gym task {name!r} cannot generate problems with {self.difficulty}: {e}"
            ) from e

    def _build(self, seed: int) -> Any:
        rg, datasets = _reasoning_gym()
        try:
            return rg.create_dataset(self.name, seed=seed, size=self.CHUNK, **self.difficulty)
        except (TypeError, AssertionError, ValueError) as e:
            config_fields = datasets[self.name][1].__dataclass_fields__
            fields = sorted(f for f in config_fields if f not in ("seed", "size"))
            raise ValueError(
                f"invalid settings {self.difficulty} for reasoning-gym task {self.name!r} ({e}); "
                f"its settings are: {', '.join(fields)}"
            ) from e

    def _chunk(self, rng_seed: int, chunk: int) -> Any:
        key = (rng_seed, chunk)
        if key in self._chunks:
            self._chunks.move_to_end(key)
        else:
            self._chunks[key] = self._build(seed=derive_seed(rng_seed, chunk) % 2**32)
            if len(self._chunks) > self.CACHED_CHUNKS:
                self._chunks.popitem(last=False)
        return self._chunks[key]

    def sample(self, rng_seed: int, index: int) -> Problem:
        if index < 0 or rng_seed < 0:
            raise ValueError(f"rng_seed and index must be >= 0, got {rng_seed} and {index}")
        chunk, offset = divmod(index, self.CHUNK)
        entry = self._chunk(rng_seed, chunk)[offset]
        return Problem(question=entry["question"], answer=str(entry["answer"]), meta={"entry": entry})

    def solution(self, problem: Problem) -> str:
        """The item's worked solution (tailrl.rl.worked.rg_solution); ValueError if it has none."""
        return rg_solution(problem.meta["entry"])

    def score(self, problem: Problem, answer_text: str) -> float:
        score = float(self._scorer.score_answer(answer_text, problem.meta["entry"]))
        return min(1.0, max(0.0, score))


# ---------------------------------------------------------------------------------------------
# JSONL files


def _normalise(text: str) -> str:
    return " ".join(text.strip().strip("$").strip().rstrip(".").lower().split())


def math_match(prediction: str, reference: str) -> float:
    """1.0 if prediction equals reference as math (math_verify), else by normalised string.

    math_verify's own timeouts use SIGALRM, which only works on the main thread; they are
    switched off here because rewards run in worker threads (rewards.safe_rewards bounds time).
    """
    from math_verify import parse, verify

    if _normalise(prediction) == _normalise(reference):
        return 1.0
    gold = parse(reference, parsing_timeout=None)
    pred = parse(prediction, parsing_timeout=None)
    if gold and pred:
        return float(verify(gold, pred, timeout_seconds=None))
    return 0.0


def _read_jsonl(path: Path) -> list[Problem]:
    problems = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            question = row.get("prompt", row.get("question"))
            if not isinstance(question, str):
                raise ValueError(f"{where}: needs a 'prompt' or 'question' string")
            if row.get("answer") is None:
                raise ValueError(f"{where}: missing 'answer' field")
            problems.append(Problem(question=question, answer=str(row["answer"]), meta=row))
    if not problems:
        raise ValueError(f"{path}: no problems found")
    return problems


class JsonlTask:
    """Problems from a JSONL file, reshuffled every pass by (run seed, pass), math_verify-scored."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"task file {self.path} does not exist")
        self.name = self.path.name
        self.problems = _read_jsonl(self.path)
        self._order_key: tuple[int, int] | None = None
        self._order = np.arange(0)

    def sample(self, rng_seed: int, index: int) -> Problem:
        if index < 0 or rng_seed < 0:
            raise ValueError(f"rng_seed and index must be >= 0, got {rng_seed} and {index}")
        epoch, offset = divmod(index, len(self.problems))
        if self._order_key != (rng_seed, epoch):
            self._order = np.random.default_rng([rng_seed, epoch]).permutation(len(self.problems))
            self._order_key = (rng_seed, epoch)
        return self.problems[int(self._order[offset])]

    def solution(self, problem: Problem) -> str:
        """The row's `solution` field (tailrl.rl.worked.jsonl_solution); ValueError if it has none."""
        return jsonl_solution(problem.meta, problem.answer)

    def score(self, problem: Problem, answer_text: str) -> float:
        return math_match(answer_text, problem.answer)


# ---------------------------------------------------------------------------------------------
# Task names


def _unknown_task_message(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    examples = ", ".join(["basic_arithmetic", "chain_sum", "leg_counting", "simple_equations"])
    return (
        f"unknown task {name!r}: {hint}use a reasoning-gym name ({len(valid)} available, e.g. "
        f"{examples}) or a path ending in .jsonl"
    )


def _parse_rg_name(text: str) -> tuple[str, dict[str, Any]]:
    """'name' or 'name(key=literal, ...)' -> (name, settings)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"cannot parse task name {text!r}; expected name or name(key=value, ...)") from e
    if isinstance(node, ast.Name):
        return node.id, {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
        try:
            settings = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError as e:
            raise ValueError(f"task settings in {text!r} must be Python literals") from e
        return node.func.id, settings
    raise ValueError(f"cannot parse task name {text!r}; expected name or name(key=value, ...)")


def make_task(name: str, **difficulty: Any) -> Task:
    """A task from its name.

    "sums" or "sums(max_terms=20)" names a procedural family with worked solutions
    (tailrl.rl.worked.PROCEDURAL); "rg:chain_sum", "chain_sum" or
    "rg:chain_sum(max_terms=3, max_digits=1)" name a reasoning-gym dataset and its settings
    (keyword arguments here override the name's); a path ending in .jsonl names a JsonlTask.
    """
    name = name.strip()
    if name.endswith(".jsonl"):
        if difficulty:
            raise ValueError(f"JSONL tasks take no settings, got {sorted(difficulty)}")
        return JsonlTask(name)
    dataset, settings = _parse_rg_name(name.removeprefix("rg:"))
    if not name.startswith("rg:") and dataset in PROCEDURAL:
        try:
            return PROCEDURAL[dataset](**{**settings, **difficulty})
        except TypeError as e:
            raise ValueError(f"invalid settings for task {dataset!r}: {e}") from e
    return ReasoningGymTask(dataset, **{**settings, **difficulty})
