"""Tasks with worked solutions: the cold-start target, and procedural families with a long tail.

A worked task renders a correct step-by-step solution for any of its problems, ending in the
answer format the verifier reads (tailrl.rl.problems.extract_answer). `tailrl sft` trains on these
solutions; RL then samples the policy's own and the verifier scores only the final answer.

`CollatzTask` ("collatz") is a second family, also long-tailed (its class says how).

`RunningSumTask` ("sums") is the default family: add n whole numbers, one line per addition
with the running total ("30 + 58 = 88"), so a solution has n - 1 lines and its length grows
linearly with n. The number of terms n is drawn from a truncated discrete Pareto law:

    P(n >= k) = (min_terms / k) ** alpha   for min_terms <= k <= max_terms,

and n = max_terms takes the remaining mass. With alpha near 1 most problems are short and a few
are many times the median, as the difficulty (and so the solution length) of real reasoning
problems is; every line is one more chance of a carry error, so accuracy falls with n and
errors, not format, separate good answers from bad.

Knows: problem generation, solution rendering, exact integer verification, the size law.
Does not know: tokenizers, models, how answers were produced.
"""

from __future__ import annotations

import math
import re
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tailrl.rl.problems import Problem, Task, extract_answer
from tailrl.sampling import derive_seed

__all__ = ["PROCEDURAL", "CollatzTask", "RunningSumTask", "WorkedTask", "answer_line", "jsonl_solution", "rg_solution",
           "size_pmf"]


@runtime_checkable
class WorkedTask(Task, Protocol):
    def solution(self, problem: Problem) -> str:
        """A correct worked solution ending in the answer format; ValueError if the task has none."""


def answer_line(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def size_pmf(min_terms: int, max_terms: int, alpha: float) -> np.ndarray:
    """P(n = k) for k = min_terms..max_terms under the truncated discrete Pareto law above."""
    k = np.arange(min_terms, max_terms + 2, dtype=np.float64)
    tail = (min_terms / k) ** alpha  # P(n >= k)
    tail[-1] = 0.0  # nothing beyond max_terms: its bin keeps the rest of the mass
    return tail[:-1] - tail[1:]


_INT = re.compile(r"-?\d+")


class RunningSumTask:
    """Sums of n terms in [1, max_value], n heavy-tailed (see the module docstring)."""

    def __init__(self, min_terms: int = 2, max_terms: int = 32, alpha: float = 1.0, max_value: int = 20) -> None:
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms} and {max_terms}")
        if not alpha > 0:
            raise ValueError(f"alpha must be positive, got {alpha}")
        if max_value < 1:
            raise ValueError(f"max_value must be >= 1, got {max_value}")
        self.min_terms, self.max_terms, self.alpha, self.max_value = min_terms, max_terms, alpha, max_value
        self.name = f"sums(min_terms={min_terms}, max_terms={max_terms}, alpha={alpha}, max_value={max_value})"

    def num_terms(self, rng: np.random.Generator) -> int:
        # Inverse CDF: n >= k exactly when u <= (min_terms / k) ** alpha.
        u = 1.0 - rng.random()  # (0, 1]
        return min(self.max_terms, math.floor(self.min_terms * u ** (-1.0 / self.alpha)))

    def sample(self, rng_seed: int, index: int) -> Problem:
        if index < 0 or rng_seed < 0:
            raise ValueError(f"rng_seed and index must be >= 0, got {rng_seed} and {index}")
        rng = np.random.default_rng(derive_seed(rng_seed, index))
        n = self.num_terms(rng)
        return self.problem([int(t) for t in rng.integers(1, self.max_value + 1, size=n)])

    def problem(self, terms: list[int]) -> Problem:
        question = f"What is {' + '.join(map(str, terms))}?"
        return Problem(question=question, answer=str(sum(terms)), meta={"terms": terms})

    def solution(self, problem: Problem) -> str:
        terms = problem.meta["terms"]
        lines, total = [], terms[0]
        for t in terms[1:]:
            lines.append(f"{total} + {t} = {total + t}")
            total += t
        return "\n".join([*lines, answer_line(str(total))])

    def score(self, problem: Problem, answer_text: str) -> float:
        # Exactly one integer and nothing else: "92" scores, "92.5", "about 92" and "9 2" do not.
        return float(_INT.fullmatch(answer_text.strip()) is not None and int(answer_text) == int(problem.answer))


class CollatzTask:
    """Steps of the Collatz map from a start n to 1: halve an even number, take 3n + 1 of an odd one.

    A second long-tail family unlike the sums: each line decides parity, then multiplies or
    halves, and the length (the start's stopping time) is not chosen but follows from n. Starts are
    drawn log-uniformly from [min_start, max_start], so most are small and quick: for the defaults
    the stopping time's median is 18 lines, its 90th percentile 106 and its maximum 143 (n = 327);
    a solution's median is ~210 SmolLM2 tokens, its 90th percentile ~1,500 and its longest ~1,950
    (numbers are a token per digit). The numbered lines make the answer the last line's number.
    """

    def __init__(self, min_start: int = 3, max_start: int = 500) -> None:
        if not 2 <= min_start <= max_start:
            raise ValueError(f"need 2 <= min_start <= max_start, got {min_start} and {max_start}")
        self.min_start, self.max_start = min_start, max_start
        self.name = f"collatz(min_start={min_start}, max_start={max_start})"

    def sample(self, rng_seed: int, index: int) -> Problem:
        if index < 0 or rng_seed < 0:
            raise ValueError(f"rng_seed and index must be >= 0, got {rng_seed} and {index}")
        rng = np.random.default_rng(derive_seed(rng_seed, index))
        n = math.floor(math.exp(rng.uniform(math.log(self.min_start), math.log(self.max_start + 1))))
        return self.problem(min(self.max_start, n))

    def problem(self, start: int) -> Problem:
        question = (f"Start from {start}. If the number is even, halve it; if it is odd, multiply it by 3 and "
                    f"add 1. How many steps does it take to reach 1?")
        return Problem(question=question, answer=str(len(collatz_path(start)) - 1), meta={"start": start})

    def solution(self, problem: Problem) -> str:
        path = collatz_path(problem.meta["start"])
        steps = enumerate(zip(path, path[1:]), start=1)  # step i takes n to m
        lines = [f"{i}: {n} {'even' if n % 2 == 0 else 'odd'}, {m}" for i, (n, m) in steps]
        return "\n".join([*lines, answer_line(str(len(path) - 1))])

    def score(self, problem: Problem, answer_text: str) -> float:
        return float(_INT.fullmatch(answer_text.strip()) is not None and int(answer_text) == int(problem.answer))


def collatz_path(n: int) -> list[int]:
    """n, its Collatz successors, ..., 1."""
    path = [n]
    while path[-1] != 1:
        m = path[-1]
        path.append(m // 2 if m % 2 == 0 else 3 * m + 1)
    return path


# Procedural families by name, for tailrl.rl.tasks.make_task ("sums" or "sums(max_terms=20)").
PROCEDURAL: dict[str, type] = {"sums": RunningSumTask, "collatz": CollatzTask}


def rg_solution(entry: dict[str, Any]) -> str:
    """A reasoning-gym item's worked solution (metadata["answer_cot"], e.g. gsm_symbolic's), its
    closing "#### N" line replaced by the answer format; ValueError for items without one."""
    cot = entry.get("metadata", {}).get("answer_cot")
    if not isinstance(cot, str) or not cot.strip():
        raise ValueError("this reasoning-gym dataset has no worked solutions (metadata['answer_cot'])")
    body = re.sub(r"\n?####.*\Z", "", cot.strip(), flags=re.DOTALL).rstrip()
    return f"{body}\n{answer_line(str(entry['answer']))}"


def jsonl_solution(row: dict[str, Any], answer: str) -> str:
    """A JSONL row's `solution` field, with the answer format appended when it lacks one."""
    text = row.get("solution")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("this JSONL task has no 'solution' field to train on")
    return text if extract_answer(text) is not None else f"{text.rstrip()}\n{answer_line(answer)}"
