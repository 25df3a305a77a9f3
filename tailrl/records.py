"""The records of one generate call, on either engine: what it is asked (`Request`, and `Stop`:
where a caller's own ending falls), what it returns per request (`Completion`) and how far it is
(`Progress`).

They live below the engine and the seam: tailrl.engine decodes Requests into Completions, and
tailrl.rollout.protocol's `Rollout.generate` takes and returns the same records, so both import
them from here and neither imports a layer above its own.

Knows: the fields. Does not know: how tokens are produced, rollouts, RL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# A caller's own ending (`tailrl generate --stop`: text, decoded by the caller): called with a
# sequence's generated tokens so far after each token is appended; True ends the sequence there,
# that token kept, finish_reason "stop". It travels to wherever the sequence decodes (a worker
# process or a Ray actor), so it must pickle.
Stop = Callable[[list[int]], bool]


@dataclass(frozen=True)
class Request:
    """One sequence to generate. Requests with equal `group` share `prompt_ids` (prefilled once)."""

    prompt_ids: tuple[int, ...]
    seed: int
    group: int = 0


@dataclass
class Completion:
    """What a rollout returns per request, in request order. hidden and prompt_hidden are the
    native engine's own capture for spot training on its workers; other engines leave them None."""

    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "eos" | "stop" | "length"
    seed: int
    group: int
    # (n, E) hidden state that produced each generated token (the LM head's input), when captured.
    hidden: torch.Tensor | None = None
    # (P-1, E) the prompt's hidden states but the last (which is hidden[0]), when captured; siblings
    # share one tensor.
    prompt_hidden: torch.Tensor | None = None
    # Per token: was it the target's most likely one (sampling.is_top1)? What a chain drafter
    # proposing the target's own argmax would have had accepted (tailrl.speculative.report.chain_ceiling).
    top1: list[bool] = field(default_factory=list)


@dataclass
class Progress:
    """How far a generate call is: finished requests of all, sequences decoding now, tokens and
    seconds so far, and the fewest tokens any unfinished request has so far (0 while one has not
    started, or where the engine does not say): a lower bound on every unfinished response's
    final length, which lets the update sum finished groups before the rollout ends
    (tailrl.rl.update)."""

    done: int
    total: int
    running: int
    tokens: int
    seconds: float
    fewest_unfinished: int = 0
