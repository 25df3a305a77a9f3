"""The policy update's tensor plumbing: responses packed with their prompts into one row, their
log-probs, and the token-mean GRPO loss backpropagated over micro-batches.

Knows: a Transformer's forward with an attention mask, the GRPO loss (tailrl.rl.grpo).
Does not know: how samples were produced or scored, optimizers, the loop.

Shapes: L tokens in a packed row (prompts + responses), N response tokens in it, E hidden size,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tailrl.model import Transformer
from tailrl.rl.grpo import GRPOConfig, policy_loss, sequence_logprobs


@dataclass(frozen=True)
class Sample:
    """One response to train on."""

    prompt_ids: tuple[int, ...]
    token_ids: Sequence[int]
    advantage: float


def packed_logprobs(model: Transformer, samples: Sequence[Sample], temperature: float) -> torch.Tensor:
    """Each response token's log-prob under `model`, all samples packed in one row.  -> (1, N)

    Consecutive samples with the same prompt share one copy of it: the row reads prompt,
    response, response, ..., next prompt, .... A response token attends to its prompt and to
    its own earlier tokens, and positions restart after the prompt, so every token sees what
    it would see in a row of its own, while the prompt is computed once per pack instead of
    once per response (it is most of the tokens when responses are short).
    """
    device = model.lm_head.weight.device
    ids: list[int] = []
    positions: list[int] = []
    doc: list[int] = []  # which prompt a token belongs to
    seg: list[int] = []  # which response a token belongs to; -1 for prompt tokens
    pred: list[int] = []  # for each response token, the row index of the hidden state predicting it
    targets: list[int] = []
    prompt: tuple[int, ...] | None = None
    for k, s in enumerate(samples):
        if s.prompt_ids != prompt:
            prompt = s.prompt_ids
            ids += prompt
            positions += range(len(prompt))
            doc += [k] * len(prompt)
            seg += [-1] * len(prompt)
            prompt_last = len(ids) - 1
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
    h = model.hidden(
        torch.tensor([ids], device=device), torch.tensor([positions], device=device), mask=mask[None, None]
    )  # (1, L, E)
    logits = model.lm_head(h[:, torch.tensor(pred, device=device)])  # (1, N, V)
    return sequence_logprobs(logits, torch.tensor([targets], device=device), temperature)


@dataclass(frozen=True)
class UpdateStats:
    """Token means over the whole update batch (loss is the objective that was backpropagated)."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    ratio_mean: float = 0.0
    tokens: int = 0


def accumulate_gradients(
    policy: Transformer,
    samples: Sequence[Sample],
    cfg: GRPOConfig,
    temperature: float,
    ref: Transformer | None = None,
) -> UpdateStats:
    """Backpropagate the token-mean GRPO loss of `samples` into .grad, cfg.micro_batch
    responses per forward/backward (packed with their prompts, see packed_logprobs).

    Every micro-batch divides by the token count of the whole batch, so the accumulated gradient
    is that of one big batch (a per-micro-batch mean would overweight short micro-batches).
    Samples with the same prompt should be adjacent, so that packs share prompts.
    """
    total = sum(len(s.token_ids) for s in samples)
    if total == 0:
        return UpdateStats()
    sums = dict(loss=0.0, pg_loss=0.0, kl=0.0, clip_fraction=0.0, ratio_mean=0.0)
    for first in range(0, len(samples), cfg.micro_batch):
        pack = samples[first : first + cfg.micro_batch]
        logprobs = packed_logprobs(policy, pack, temperature)  # (1, N)
        ref_logprobs = None
        if ref is not None:
            with torch.no_grad():
                ref_logprobs = packed_logprobs(ref, pack, temperature)  # (1, N)
        adv = torch.tensor([[s.advantage for s in pack for _ in s.token_ids]], dtype=torch.float64)  # (1, N)
        out = policy_loss(
            logprobs, logprobs.detach(), adv.to(logprobs.device), torch.ones_like(logprobs, dtype=torch.bool),
            cfg.clip_low, cfg.clip_upper, ref_logprobs, cfg.kl_coef, num_tokens=total,
        )
        out.loss.backward()
        share = logprobs.shape[1] / total  # the diagnostics are token means over this pack
        sums["loss"] += out.loss.item()
        for name in ("pg_loss", "kl", "clip_fraction", "ratio_mean"):
            sums[name] += getattr(out, name) * share
    return UpdateStats(tokens=total, **sums)
