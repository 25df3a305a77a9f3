"""The update's input: responses with their advantages and the log-probs they were sampled with,
and their log-probs under a model with each group's prompt computed once.

Knows: token ids, positions, attention masks, the model's forward. Does not know: losses,
optimizers, how the responses were produced (only the log-probs their sampler recorded).

Shapes: L tokens in a packed row (prompts + responses), N response tokens in it, E hidden size,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Sequence

import torch

from tailrl.model import Transformer
from tailrl.rl.grpo import chunked_logprobs, sequence_logprobs

# A sample with no behaviour policy of its own (a worked solution, a test's fixed response): it
# counts as sampled by the trainer's policy, so its importance ratio is 1 by definition.
ON_POLICY: tuple[float, ...] = ()


@dataclass(frozen=True)
class Sample:
    """One response to train on.

    behaviour_logprobs: each response token's log-prob under the policy that sampled it, as the
    rollout engine recorded it (tailrl.sampling.token_logprobs, the quantity the trainer
    recomputes); the update's importance ratio is taken against them. ON_POLICY (empty) when
    nothing sampled the response: the trainer's own log-probs stand in.
    """

    prompt_ids: tuple[int, ...]
    token_ids: Sequence[int]
    advantage: float
    behaviour_logprobs: Sequence[float]

    def __post_init__(self) -> None:
        if self.behaviour_logprobs and len(self.behaviour_logprobs) != len(self.token_ids):
            raise ValueError(f"behaviour_logprobs has {len(self.behaviour_logprobs)} entries for "
                             f"{len(self.token_ids)} response tokens")


@dataclass(frozen=True)
class PackMemory:
    """How a packed forward keeps its memory flat in the pack's length (the update's settings,
    tailrl.rl.grpo.GRPOConfig): log-probs `logprob_chunk` response tokens at a time past that
    many (tailrl.rl.grpo.chunked_logprobs), layers checkpointed past `checkpoint_tokens` tokens."""

    logprob_chunk: int | None = None  # None: the whole (N, V) logits at once
    checkpoint_tokens: int | None = None  # None: never checkpoint


def pack_tokens(samples: Sequence[Sample]) -> int:
    """Tokens in the packed row of `samples` (each run of one prompt holds it once)."""
    prompts = sum(len(prompt) for prompt, _ in groupby(s.prompt_ids for s in samples))
    return prompts + sum(len(s.token_ids) for s in samples)


def packs(samples: Sequence[Sample], responses: int, tokens: int) -> list[Sequence[Sample]]:
    """Consecutive micro-batches of at most `responses` samples and, where the samples allow,
    `tokens` packed tokens: a pack closes before a sample that would pass either (a sample over
    the token budget on its own gets a pack of its own)."""
    out: list[Sequence[Sample]] = []
    first = 0
    for k in range(1, len(samples) + 1):
        if k == len(samples) or k - first == responses or pack_tokens(samples[first : k + 1]) > tokens:
            out.append(samples[first:k])
            first = k
    return out


def packed_logprobs(model: Transformer, samples: Sequence[Sample], temperature: float,
                    memory: PackMemory = PackMemory()) -> torch.Tensor:
    """Each response token's log-prob under `model`, all samples packed in one row.  -> (1, N)

    Consecutive samples with the same prompt share one copy of it: the row reads prompt,
    response, response, ..., next prompt, .... A response token attends to its prompt and to
    its own earlier tokens, and positions restart after the prompt, so every token sees what
    it would see in a row of its own, while the prompt is computed once per pack instead of
    once per response (it is most of the tokens when responses are short).
    """
    return _packed(model, samples, temperature, memory, keep_hidden=False)[0]


def packed_logprobs_and_hidden(model: Transformer, samples: Sequence[Sample], temperature: float,
                               memory: PackMemory = PackMemory()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """packed_logprobs, and from the same forward each sample's final-normed hidden states (the
    LM head's input), detached, in fp32: one row per prompt + response token but the last (the
    row at position q produced token q + 1), as a drafter trains on them.  -> (1, N), [(P + n - 1, E)]"""
    return _packed(model, samples, temperature, memory, keep_hidden=True)


def _packed(model: Transformer, samples: Sequence[Sample], temperature: float, memory: PackMemory,
            keep_hidden: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    device = model.lm_head.weight.device
    ids: list[int] = []
    positions: list[int] = []
    doc: list[int] = []  # which prompt a token belongs to
    seg: list[int] = []  # which response a token belongs to; -1 for prompt tokens
    pred: list[int] = []  # for each response token, the row index of the hidden state predicting it
    targets: list[int] = []
    prompt_rows: list[range] = []  # for each sample, the rows of its prompt
    prompt: tuple[int, ...] | None = None
    for k, s in enumerate(samples):
        if s.prompt_ids != prompt:
            prompt = s.prompt_ids
            first = len(ids)
            ids += prompt
            positions += range(len(prompt))
            doc += [k] * len(prompt)
            seg += [-1] * len(prompt)
            prompt_last = len(ids) - 1
        prompt_rows.append(range(first, prompt_last + 1))
        start, n = len(ids), len(s.token_ids)
        pred += [prompt_last] + list(range(start, start + n - 1))
        ids += s.token_ids
        targets += s.token_ids
        positions += range(len(prompt), len(prompt) + n)
        doc += [doc[prompt_last]] * n
        seg += [k] * n
    row = torch.arange(len(ids), device=device)
    d, g = torch.tensor(doc, device=device), torch.tensor(seg, device=device)
    # (L, L): causal, within one prompt's block, and never into a sibling response.
    mask = (row[None] <= row[:, None]) & (d[None] == d[:, None]) & ((g[None] == -1) | (g[None] == g[:, None]))
    checkpoint = memory.checkpoint_tokens is not None and len(ids) > memory.checkpoint_tokens
    h = model.hidden(
        torch.tensor([ids], device=device), torch.tensor([positions], device=device), mask=mask[None, None],
        checkpoint=checkpoint and torch.is_grad_enabled(),
    )  # (1, L, E)
    at = torch.tensor(pred, device=device)
    target = torch.tensor(targets, device=device)
    hidden: list[torch.Tensor] = []
    if keep_hidden:
        flat = h[0].detach().float()  # (L, E)
        first = 0
        for rows, s in zip(prompt_rows, samples):
            n = len(s.token_ids)
            # The prompt's rows, then the rows that predicted response tokens 2..n: pred[first + 1 :].
            hidden.append(torch.cat([flat[rows.start : rows.stop], flat[at[first + 1 : first + n]]]))
            first += n
    if memory.logprob_chunk is not None and len(targets) > memory.logprob_chunk:
        logprobs = chunked_logprobs(h[0, at], model.lm_head.weight, target, temperature, memory.logprob_chunk)[None]
    else:
        logprobs = sequence_logprobs(model.lm_head(h[:, at]), target[None], temperature)  # (1, N, V) logits
    return logprobs, hidden


def packed_behaviour(samples: Sequence[Sample], own: torch.Tensor) -> torch.Tensor:
    """The samples' behaviour log-probs in packed_logprobs' token order.  (1, N) -> (1, N)

    `own` is packed_logprobs of the same samples under the trainer's policy: an ON_POLICY
    sample's tokens take their values from it, detached, so its ratio is exactly 1.
    """
    parts, first = [], 0
    for s in samples:
        n = len(s.token_ids)
        parts.append(torch.tensor(s.behaviour_logprobs, dtype=own.dtype, device=own.device) if s.behaviour_logprobs
                     else own[0, first : first + n].detach())
        first += n
    return torch.cat(parts)[None]
