"""Peak resident memory and seconds of the update of one GRPO group, by response length.

One group of `--group` responses of N tokens each (random tokens after a 200-token prompt, the
default model), its gradient computed as the RL step computes it (tailrl.rl.share.group_share),
each (N, settings) in a process of its own so that each peak is its own. Printed per case: the
resident peak above the policy, its gradient buffers' and AdamW's state (what any update holds
whatever the length), the seconds, and the per-token slope between consecutive lengths.

    .venv/bin/python scripts/update_memory.py --lengths 512 2048 8192 [--autocast fp32|bf16]
        [--old-too-up-to 2048]

`--old-too-up-to N` also runs the update as it was before memory-flat micro-batches (one pack
of all responses, whole logits, no checkpointing) for lengths up to N.

`--step METRICS.jsonl:N` measures instead a whole step's update as the default run computes it
after its rollout: the step's recorded response lengths (random tokens) after the default task's
prompts, one group per prompt, drained as after a rollout (tailrl.rl.update.BackgroundUpdate: one
group at a time on every torch thread), for each `--settings MICRO_BATCH_TOKENS,CHECKPOINT_TOKENS`
in turn, `--repeats` rounds of them interleaved, each in a process of its own. Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(tokens: int, group: int, autocast: str, flat: bool) -> dict:
    import torch

    from tailrl.loading import default_model_dir, load_model
    from tailrl.memory import Peak, fix_mmap_threshold
    from tailrl.rl.grpo import GRPOConfig
    from tailrl.rl.packing import ON_POLICY, Sample
    from tailrl.rl.share import group_share

    fix_mmap_threshold()  # as tailrl train does
    torch.manual_seed(0)
    policy = load_model(default_model_dir(), dtype="fp32").requires_grad_(True)
    params = [p for p in policy.parameters() if p.requires_grad]
    # What every update holds whatever the length: AdamW's two moments and the gradient sum.
    held = [torch.zeros_like(p) for p in params for _ in range(3)]
    prompt = tuple(torch.randint(100, 20000, (200,)).tolist())
    samples = [Sample(prompt, torch.randint(100, 20000, (tokens,)).tolist(), 1.0 if i % 2 else -1.0, ON_POLICY)
               for i in range(group)]
    cfg = GRPOConfig(autocast=autocast) if flat else GRPOConfig(
        autocast=autocast, micro_batch=group, micro_batch_tokens=10**9, logprob_chunk=10**9, checkpoint_tokens=10**9)
    peak = Peak().start()
    base = peak.gb
    t0 = time.perf_counter()
    share = group_share(policy, samples, cfg, 1.0)
    seconds = time.perf_counter() - t0
    assert len(share.grads) == 1 and len(held) == 3 * len(params)
    return {"tokens": tokens, "group": group, "autocast": autocast, "flat": flat,
            "peak_above_gb": round(peak.gb - base, 3), "seconds": round(seconds, 1)}


def step(metrics: str, micro_batch_tokens: int, checkpoint_tokens: int) -> dict:
    import torch

    from tailrl.loading import load_model, load_tokenizer, resolve_model_dir
    from tailrl.memory import Peak, fix_mmap_threshold
    from tailrl.pipeline import cold_start_config
    from tailrl.rl.grpo import GRPOConfig
    from tailrl.rl.packing import ON_POLICY, Sample
    from tailrl.rl.sft import sft
    from tailrl.rl.tasks import encode_question, make_task
    from tailrl.rl.train import TrainConfig
    from tailrl.rl.update import BackgroundUpdate, GroupGradients, group_key

    fix_mmap_threshold()
    path, number = metrics.rsplit(":", 1)
    record = next(r for r in map(json.loads, open(path)) if r["step"] == int(number))
    lens, G = record["response_lens"], 4
    model_dir = resolve_model_dir(str(sft(cold_start_config(TrainConfig())).out_dir))  # the cached cold start
    tokenizer, task = load_tokenizer(model_dir), make_task("sums")
    torch.manual_seed(0)
    policy = load_model(model_dir, dtype="fp32").requires_grad_(True)
    params = [p for p in policy.parameters() if p.requires_grad]
    held = [torch.zeros_like(p) for p in params for _ in range(2)]  # AdamW's two moments
    groups = []
    for g in range(len(lens) // G):
        prompt = encode_question(tokenizer, task.sample(0, g).question)
        groups.append([Sample(prompt, torch.randint(100, 20000, (n,)).tolist(), 1.0 if i % 2 else -1.0, ON_POLICY)
                       for i, n in enumerate(lens[g * G : (g + 1) * G])])
    cfg = GRPOConfig(autocast="fp32", micro_batch_tokens=micro_batch_tokens, checkpoint_tokens=checkpoint_tokens)
    peak = Peak().start()
    base = peak.gb
    t0 = time.perf_counter()
    grads = GroupGradients(policy, cfg, 1.0, len(groups))
    update = BackgroundUpdate(grads)
    for g, group in enumerate(groups):
        update.submit(g, group, group_key([s.token_ids for s in group]))
    update.drain()
    grads.finish()
    seconds = time.perf_counter() - t0
    assert len(held) == 2 * len(params)
    return {"step": record["step"], "micro_batch_tokens": micro_batch_tokens, "checkpoint_tokens": checkpoint_tokens,
            "tokens": sum(lens), "longest_group": max(sum(lens[g:g + G]) for g in range(0, len(lens), G)),
            "base_gb": round(base, 3), "peak_above_gb": round(peak.gb - base, 3), "seconds": round(seconds, 1)}


def steps(args: argparse.Namespace) -> None:
    for r in range(args.repeats):
        for setting in args.settings:
            cmd = [sys.executable, __file__, "--step", args.step, "--one-setting", setting]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(json.dumps({"setting": setting, "failed": out.returncode, "stderr": out.stderr[-300:]}))
                continue
            print(json.dumps({"round": r, **json.loads(out.stdout.strip().splitlines()[-1])}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--autocast", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--old-too-up-to", type=int, default=0)
    ap.add_argument("--step", metavar="METRICS.jsonl:N")
    ap.add_argument("--settings", nargs="+", default=["8192,2560"], metavar="MICRO_BATCH_TOKENS,CHECKPOINT_TOKENS")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--one-setting", help=argparse.SUPPRESS)
    ap.add_argument("--old", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_setting is not None:
        print(json.dumps(step(args.step, *map(int, args.one_setting.split(",")))))
        return
    if args.step is not None:
        steps(args)
        return
    if args.one is not None:
        print(json.dumps(one(args.one, args.group, args.autocast, not args.old)))
        return
    rows = []
    cases = [(n, False) for n in args.lengths if n <= args.old_too_up_to] + [(n, True) for n in args.lengths]
    for n, flat in cases:
        cmd = [sys.executable, __file__, "--one", str(n), "--group", str(args.group), "--autocast", args.autocast]
        out = subprocess.run(cmd + ([] if flat else ["--old"]), capture_output=True, text=True)
        if out.returncode != 0:
            print(json.dumps({"tokens": n, "flat": flat, "failed": out.returncode, "stderr": out.stderr[-300:]}))
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        prev = [r for r in rows if r["flat"] == flat]
        if prev:
            d_tokens = args.group * (n - prev[-1]["tokens"])
            row["slope_kb_per_token"] = round((row["peak_above_gb"] - prev[-1]["peak_above_gb"]) * 2**20 / d_tokens, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
