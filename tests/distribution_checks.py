"""Whether responses are samples of the target at T = 1 (test_vllm_cpu_fix.py, test_trl.py): the
randomised probability integral transform of each token under the target, whose values are
i.i.d. U(0, 1) exactly when the tokens are the target's samples, and a Kolmogorov-Smirnov test of
them against U(0, 1) with a stated false-failure probability."""

from __future__ import annotations

import math

import torch

from tailrl.records import Completion

KS_CRIT = math.sqrt(math.log(2 / 0.001) / 2)  # sqrt(n) * KS distance exceeds it with probability 0.001


def pit(model, c: Completion, gen: torch.Generator) -> torch.Tensor:
    """Randomised probability integral transforms of a response at T = 1: with the vocabulary
    ranked by the target's probability (most likely first), u = P(tokens ranked before x) +
    V p(x), V ~ U(0, 1) of our own. Given everything before it, u is U(0, 1) exactly when x is a
    sample of p, so a response's u are i.i.d. U(0, 1) (no EOS: every response has its full
    length). A verifier that favours the draft (the argmax, for greedy drafts) moves mass
    towards u = 0; one that disfavours it, away."""
    ids = torch.tensor([list(c.prompt_ids) + c.token_ids[:-1]])
    with torch.no_grad():
        probs = torch.softmax(model(ids, torch.arange(ids.shape[1])[None])[0, len(c.prompt_ids) - 1:].double(), -1)
    ranked, order = probs.sort(-1, descending=True)
    rank = (order == torch.tensor(c.token_ids)[:, None]).double().argmax(-1)
    before = (ranked.cumsum(-1) - ranked).gather(-1, rank[:, None])[:, 0]
    p = probs.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
    return before + torch.rand(len(c.token_ids), generator=gen, dtype=torch.float64) * p


def ks_distance(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of the sample u from U(0, 1)."""
    u, n = u.sort().values, u.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - u).max().item(), (u - (i - 1) / n).max().item())
