"""Drafter warm-up recipes compared on the same sampled data: acceptance against its ceiling, per minute.

Samples once (the warm-up's own sampling: `prompts` x `group` responses of the policy at the
run's temperature and length, the last `holdout` prompts' responses held out, and `solutions`
worked solutions teacher-forced), then trains one fresh drafter per recipe on a share of that
data, in one process, one after another, and replays each on the same held-out responses:
chains of depth 2, 4 and 6 beside the ceiling at that depth (the target itself as the chain
drafter), the seconds of training, the step whose weights were kept, and the curve of the
stopping rule's replays (accept_len over training seconds: what a minute of warm-up buys).
Each recipe's drafter is saved beside the JSON (OUT without .json / RECIPE), for `bench rollout
--drafter`; the sampled data too (OUT.data.pt), so a rerun with the same settings samples nothing.

    .venv/bin/python scripts/warmup_recipes.py --model COLD_START_DIR [--task sums]
        [--max-new-tokens 512] [--prompts 48] [--holdout 4] [--solutions 512]
        [--recipes v0 plateau plateau-data] [--max-steps N] [--out warmup-recipes.json]

Recipes (name: train prompts, solutions, rule):
- v0: the warm-up before the stopping rule: 20 prompts' responses and 256 solutions, 1,000
  steps at a constant rate;
- plateau: the same data under the stopping rule (WarmupConfig's defaults);
- plateau-data: every non-held-out prompt's responses and every solution, under the rule;
- plateau-unroll: plateau, trained one draft step deeper too (`unroll`: the drafter reads its
  own prediction, as a chain's later tokens do);
- plateau-ce1: plateau with the cross-entropy term weighted 1.0 (the default 0.1): acceptance is
  the draft's argmax agreeing with the target's, which the feature loss serves only indirectly;
- plateau-ce003, plateau-ce001: the other way, the cross-entropy term weighted 0.03 and 0.01;
- plateau-2layers: plateau with a drafter of two decoder layers (a draft step costs two);
- plateau-data-2layers: plateau-data with two layers.
Not part of the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

RECIPES = {
    "v0": (20, 256, dict(steps=1000, eval_every=0)),
    "plateau": (20, 256, {}),
    "plateau-data": (None, None, {}),
    "plateau-unroll": (20, 256, dict(unroll=True)),
    "plateau-ce1": (20, 256, dict(ce_weight=1.0)),
    "plateau-ce003": (20, 256, dict(ce_weight=0.03)),
    "plateau-ce001": (20, 256, dict(ce_weight=0.01)),
    "plateau-2layers": (20, 256, dict(drafter_layers=2)),
    "plateau-data-2layers": (None, None, dict(drafter_layers=2)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the policy (a cold start directory; default: the base model)")
    ap.add_argument("--task", default="sums")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--holdout", type=int, default=4)
    ap.add_argument("--solutions", type=int, default=512)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--max-steps", type=int, default=0, help="cap every recipe's steps (a smoke test)")
    ap.add_argument("--out", default="warmup-recipes.json")
    args = ap.parse_args()

    from tailrl.loading import load_model, load_tokenizer, resolve_model_dir
    from tailrl.speculative.drafter.model import Drafter, save_drafter
    from tailrl.speculative.drafter.training import top1_flags
    from tailrl.warmup import (
        WarmupConfig,
        _train,
        build_draft_vocab,
        evaluate_accept,
        prompt_ids,
        sample_data,
        solution_data,
    )

    base = WarmupConfig(model=args.model, task=args.task, num_prompts=args.prompts, group_size=args.group,
                        holdout_prompts=args.holdout, max_new_tokens=args.max_new_tokens, solutions=args.solutions,
                        eval_greedy=False)
    torch.manual_seed(base.seed)
    target = load_model(args.model, dtype=base.dtype)
    tokenizer = load_tokenizer(args.model)
    data = Path(args.out).with_suffix(".data.pt")  # the sampled data, reused by a rerun with the same settings
    key = [args.model, args.task, args.max_new_tokens, args.prompts, args.group, args.solutions]
    cached = torch.load(data, weights_only=False) if data.is_file() else None
    if cached is not None and cached["key"] == key:
        groups, solutions, sample_s, solution_s = (cached["groups"], cached["solutions"], cached["sample_s"],
                                                   cached["solution_s"])
    else:
        t0 = time.perf_counter()
        groups = sample_data(target, prompt_ids(base, tokenizer), base)
        sample_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        solutions = solution_data(target, tokenizer, base)
        solution_s = time.perf_counter() - t0
        torch.save(dict(key=key, groups=groups, solutions=solutions, sample_s=sample_s, solution_s=solution_s), data)
    train_groups, held = groups[: -args.holdout], [s for g in groups[-args.holdout :] for s in g]
    flags = top1_flags(held, target.lm_head.weight.detach())
    out = {"model": args.model, "task": args.task, "max_new_tokens": args.max_new_tokens,
           "dtype": str(target.lm_head.weight.dtype), "sample_s": round(sample_s, 1),
           "solution_s": round(solution_s, 1), "held_responses": len(held),
           "held_tokens": sum(len(f) for f in flags), "recipes": {}}
    print(f"sampled {len(groups)} x {args.group} responses in {sample_s:.0f} s, {len(solutions)} solutions in "
          f"{solution_s:.0f} s", flush=True)
    for name in args.recipes:
        n_prompts, n_solutions, rule = RECIPES[name]
        train = [s for g in train_groups[:n_prompts] for s in g] + solutions[:n_solutions]
        cfg = dataclasses.replace(base, **rule)
        if args.max_steps:
            cfg = dataclasses.replace(cfg, steps=min(cfg.steps, args.max_steps))
        vocab = build_draft_vocab(train, cfg.draft_vocab_size, target.cfg.vocab_size, target.cfg.eos_token_ids)
        drafter = Drafter.from_target(target, vocab, resolve_model_dir(args.model).name, seed=cfg.seed,
                                      num_layers=cfg.drafter_layers)
        t0 = time.perf_counter()
        run = _train(drafter, target, train, held, cfg, on_progress=None)
        train_s = time.perf_counter() - t0
        accept = evaluate_accept(drafter, held, cfg, flags)
        save_drafter(drafter, Path(args.out).with_suffix("") / name)
        out["recipes"][name] = {"train_sequences": len(train), "steps": len(run.history), "best_step": run.best_step,
                                "train_s": round(train_s, 1), "accept": accept, "replays": run.replays}
        chains = ", ".join(f"{k} {v['accept_len']:.2f} of {v['ceiling']:.2f}" for k, v in accept.items()
                           if "ceiling" in v)
        print(f"{name}: {len(run.history)} steps (kept {run.best_step}) in {train_s:.0f} s; {chains}", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
