"""Coupled drafting, explored: would a drafter that drafts from the target's own random numbers
accept more than one that drafts its argmax?

tailrl's target samples position-keyed: token = the inverse CDF (token-id order) of its
probabilities at a uniform keyed by (seed, position) (tailrl.sampling), and a draft is accepted
when it equals that sample. A drafter knows the uniform of every position it drafts, so it could
draft the inverse CDF of its own distribution q at the same uniform; and were the target's sampler
Gumbel-max with position-keyed noise per token, the drafter could take argmax(log q + g) with the
same noise. Either stays lossless (the emitted tokens are the target's samples whatever is
drafted). This script measures, on held-out responses with the true context (teacher-forced),
the first draft token's acceptance probability under each rule, against the target's own argmax
(the ceiling of argmax drafting):

- argmax: p[argmax q];
- inverse-CDF coupled: the overlap of the two distributions' intervals in token-id order (exact);
- Gumbel coupled: P(argmax(log p + g) = argmax(log q + g)), Monte Carlo over `--draws` noises.

    .venv/bin/python scripts/coupled_drafting.py --data RECIPES.data.pt --drafter DIR --model COLD_START
        [--holdout 4] [--draws 16]

--data is scripts/warmup_recipes.py's sampled data (the held-out prompts are its last `holdout`).
The result: docs/performance.md, "Coupled drafting". Not part of the tests.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--holdout", type=int, default=4)
    ap.add_argument("--draws", type=int, default=16)
    args = ap.parse_args()

    from tailrl.loading import load_model
    from tailrl.speculative.drafter.model import load_drafter

    groups = torch.load(args.data, weights_only=False)["groups"]
    held = [s for g in groups[-args.holdout :] for s in g]
    target = load_model(args.model, dtype="fp32")
    drafter = load_drafter(args.drafter, target)
    head = target.lm_head.weight.detach().float()
    gen = torch.Generator().manual_seed(0)
    sums = dict(ceiling=0.0, argmax=0.0, inverse_cdf=0.0, gumbel=0.0)
    n = 0
    with torch.no_grad():
        for s in held:
            t, p0 = s.tokens.shape[0], s.prompt_len
            pred = drafter(s.hidden[None], s.tokens[1:t][None], torch.arange(t - 1)[None])[0]  # pred[i] ~ h_{i+1}
            i = torch.arange(max(p0 - 1, 0), t - 2)  # entries drafting x_{i+2}, a response token after the first
            p = torch.softmax(s.hidden[i + 1] @ head.T, -1)  # (N, V) the target's x_{i+2}
            q = torch.zeros_like(p).index_copy_(1, drafter.d2t, torch.softmax(drafter.logits(pred[i]).float(), -1))
            sums["ceiling"] += p.max(-1).values.sum().item()
            sums["argmax"] += p.gather(1, q.argmax(-1, keepdim=True)).sum().item()
            fp, fq = p.cumsum(-1), q.cumsum(-1)
            sums["inverse_cdf"] += (torch.minimum(fp, fq) - torch.maximum(fp - p, fq - q)).clamp(min=0).sum().item()
            lp, lq = p.clamp_min(1e-30).log(), q.clamp_min(1e-30).log()
            for _ in range(args.draws):
                g = -torch.log(-torch.log(torch.rand(p.shape, generator=gen).clamp(1e-12, 1 - 1e-12)))
                sums["gumbel"] += ((lp + g).argmax(-1) == (lq + g).argmax(-1)).float().sum().item() / args.draws
            n += len(i)
    rates = ", ".join(f"{k} {v / n:.4f}" for k, v in sums.items())
    print(f"{n} drafted positions; first draft token accepted: {rates}")


if __name__ == "__main__":
    main()
