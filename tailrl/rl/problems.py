"""What every task is: a Problem, the Task contract, and the answer format a verifier reads.

The leaf both tailrl.rl.tasks (tasks by name, the prompt) and tailrl.rl.worked (tasks with
worked solutions) build on.

Knows: problems, the <answer></answer> format. Does not know: datasets, tokenizers, models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Problem:
    """One question, its reference answer, and what the task's scorer needs besides them."""

    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    name: str

    def sample(self, rng_seed: int, index: int) -> Problem:
        """The index-th problem of the stream for rng_seed; the same pair gives the same problem."""

    def score(self, problem: Problem, answer_text: str) -> float:
        """Score an extracted answer in [0, 1]."""


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_answer(completion: str) -> str | None:
    """The text inside the last <answer>...</answer> pair, stripped; None if there is none.

    The last pair wins because the model may quote the format before answering.
    """
    found = _ANSWER_TAG.findall(completion)
    if not found:
        return None
    answer = found[-1].strip()
    return answer or None
