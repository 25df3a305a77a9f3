"""The drafter's data buffer: finished responses with the target hidden states that produced them.

What it holds (TLT's "one-step offset", docs/architecture.md): the current step's finished
responses, in the order they arrived, and the longest responses of the previous step. The long
ones are kept because the current step's long responses finish last, often after the spot
trainer has stopped, so without them the drafter would rarely see the long tail it is meant to
speed up. `training_order` puts the current step first, so a short training window spends itself
on the freshest policy's data.

Memory: a TrainSeq keeps one hidden state (E floats) per token, prompt included: E x 4 bytes
per token in fp32, 2,304 bytes for SmolLM2-135M (E = 576); the default bound of 65,536 tokens is
about 150 MB. When over the bound, the previous step's responses are dropped first (shortest
first), then the current step's oldest.

Knows: TrainSeq, response lengths, token counts. Does not know: the drafter, training, workers.
"""

from __future__ import annotations

from typing import Any

import torch

from tailrl.records import Completion
from tailrl.speculative.drafter.training import TrainSeq


def train_seq(c: Completion) -> TrainSeq:
    """A response as drafter training data: prompt + response tokens, a hidden state for each but the last."""
    if c.hidden is None or c.prompt_hidden is None:
        raise ValueError("the completion carries no hidden states; the engine needs capture_hidden")
    tokens = torch.tensor([*c.prompt_ids, *c.token_ids])
    return TrainSeq(tokens, torch.cat([c.prompt_hidden, c.hidden]), len(c.prompt_ids))


def response_len(s: TrainSeq) -> int:
    return s.tokens.shape[0] - s.prompt_len


class DataBuffer:
    """Current-step responses plus the previous step's longest, bounded in tokens."""

    def __init__(self, max_tokens: int, keep_long: float):
        if max_tokens < 1 or not 0.0 <= keep_long <= 1.0:
            raise ValueError(f"need max_tokens >= 1 and keep_long in [0, 1], got {max_tokens} and {keep_long}")
        self.max_tokens, self.keep_long = max_tokens, keep_long
        self.current: list[TrainSeq] = []
        self.previous: list[TrainSeq] = []  # longest first

    @property
    def tokens(self) -> int:
        return sum(s.tokens.shape[0] for s in self.current + self.previous)

    def add(self, seqs: list[TrainSeq]) -> None:
        self.current.extend(seqs)
        self._bound()

    def training_order(self) -> list[TrainSeq]:
        return self.current + self.previous

    def end_step(self) -> None:
        """Keep the longest `keep_long` share of this step's responses for the next step."""
        keep = round(self.keep_long * len(self.current))
        self.previous = sorted(self.current, key=response_len, reverse=True)[:keep]
        self.current = []
        self._bound()

    def _bound(self) -> None:
        excess = self.tokens - self.max_tokens
        while excess > 0 and self.previous:
            excess -= self.previous.pop().tokens.shape[0]  # the shortest kept one
        while excess > 0 and self.current:
            excess -= self.current.pop(0).tokens.shape[0]

    def state_dict(self) -> dict[str, Any]:
        pack = lambda seqs: [(s.tokens, s.hidden, s.prompt_len, s.offset) for s in seqs]  # noqa: E731
        return {"current": pack(self.current), "previous": pack(self.previous)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current = [TrainSeq(*x) for x in state["current"]]
        self.previous = [TrainSeq(*x) for x in state["previous"]]
