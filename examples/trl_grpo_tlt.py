"""TRL's GRPOTrainer on SmolLM2 and the `sums` task, with TLT on or off (docs/trl.md).

    python examples/trl_grpo_tlt.py --model MODEL --drafter DRAFTER --tlt auto --steps 5
    python examples/trl_grpo_tlt.py --model MODEL --tlt off --steps 5

MODEL: a model directory (`tailrl sft` writes SmolLM2's cold start; the default is SmolLM2 itself);
DRAFTER: a tailrl learned drafter for it (`tailrl drafter warmup --model MODEL --out DRAFTER`).
Both runs generate with TRL's colocated vLLM engine on this machine's CPU (fp32; --dtype to
change) and print one JSON line per step (step seconds, generation seconds, reward, the
responses' mean and longest length, accept_len, drafter version) and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # TRL's colocate mode drives the engine in this process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="tailrl drafter directory (needed unless --tlt off)")
    p.add_argument("--tlt", choices=("off", "on", "auto"), default="auto",
                   help="off: no drafter; on: 4 draft tokens every step; auto: TLT's tuner per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per loss forward (divides the batch)")
    p.add_argument("--dtype", default="float32", help="the engine's dtype (vLLM's choice would be bf16)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="vLLM's KV cache")
    p.add_argument("--compile", action="store_true",
                   help="let vLLM torch.compile the engine (minutes at start on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settled-from", type=int, default=2,
                   help="the first step the summary's medians count (the tuner settles after a few rollouts)")
    p.add_argument("--save-drafter", default=None, help="write the adapted drafter here at the end (TLT on)")
    args = p.parse_args(argv)
    if args.tlt != "off" and args.drafter is None:
        print("error: --drafter is needed unless --tlt off", file=sys.stderr)
        return 2
    if (args.num_prompts * args.group_size) % args.micro_batch:
        print("error: --micro-batch must divide --num-prompts x --group-size", file=sys.stderr)
        return 2

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig

    from tailrl.loading import resolve_model_dir
    from tailrl.rl.rewards import task_reward
    from tailrl.rl.tasks import format_prompt, make_task
    from tailrl.trl import TLTConfig, TLTGRPOTrainer

    task = make_task("sums")
    score = task_reward(task)
    problems = [task.sample(args.seed, i) for i in range(args.steps * args.num_prompts)]
    data = Dataset.from_list([{"prompt": format_prompt(q.question), "problem": i} for i, q in enumerate(problems)])

    def reward(completions: list, problem: list[int], **_: object) -> list[float]:
        return [score(problems[i], c[-1]["content"]) for i, c in zip(problem, completions)]

    model_dir = resolve_model_dir(args.model)
    batch = args.num_prompts * args.group_size
    out = Path(tempfile.mkdtemp(prefix="trl-tlt-"))
    config = GRPOConfig(
        # One generation of the whole batch per optimizer step, its loss in micro-batches (the
        # logits of 32 x 300 tokens over a 49k vocabulary would hold gigabytes at once).
        output_dir=str(out), use_cpu=True, bf16=False, seed=args.seed, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=batch // args.micro_batch, num_generations=args.group_size, max_steps=args.steps,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-5,
        beta=0.0, loss_type="dapo", use_vllm=True, vllm_mode="colocate", gradient_checkpointing=False,
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)
    ends: list[float] = []
    logged: list[dict] = []  # TRL's log of each step

    class Clock(TrainerCallback):
        """Each step's line as the step ends (TRL logs a step after its on_step_end), so a long
        run shows its progress and an interrupted one keeps the steps it ran."""

        def on_train_begin(self, *a: object, **k: object) -> None:
            ends.append(time.perf_counter())

        def on_step_end(self, *a: object, **k: object) -> None:
            ends.append(time.perf_counter())

        def on_log(self, *a: object, logs: dict | None = None, **k: object) -> None:
            if not logs or "loss" not in logs:
                return
            h, step = logs, len(ends) - 1
            logged.append(dict(h))
            # The responses' lengths: two runs sample different responses, so generation time
            # alone compares them only up to how long each run's longest response was.
            print(json.dumps({"step": step, "step_s": round(ends[-1] - ends[-2], 2),
                              "generate_s": round(h["tlt/generate_s"], 2), "reward": h.get("reward"),
                              "mean_length": h.get("completions/mean_length"),
                              "max_length": h.get("completions/max_length"),
                              "accept_len": h.get("tlt/accept_len"), "drafter_version": h.get("tlt/drafter_version")}),
                  flush=True)


    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    common = dict(model=model, reward_funcs=reward, args=config, train_dataset=data,
                  processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    # --tlt off is TRL's own generation with only the weight sync TLT brings (TRL's fails on CPU)
    # and the same engine dtype: the baseline TLT is measured against.
    drafter = Path(args.drafter) if args.tlt != "off" else None
    tlt = TLTConfig(drafter=drafter, spec=args.tlt, dtype=args.dtype, enforce_eager=not args.compile,
                    kv_cache_gb=args.kv_cache_gb)
    trainer = TLTGRPOTrainer(**common, tlt=tlt)
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; this prints one line per step
    trainer.train()
    # The summary's medians from --settled-from on: the first step warms the engine, and the
    # tuner tries every draft length in its first rollouts.
    steps = [b - a for a, b in zip(ends, ends[1:])]
    first = min(args.settled_from, len(steps)) - 1
    accept = [h["tlt/accept_len"] for h in logged[first:] if h.get("tlt/accept_len") is not None]
    print(json.dumps({"tlt": args.tlt, "steps": len(steps), "settled_from": first + 1,
                      "median_step_s": round(statistics.median(steps[first:]), 2),
                      "median_generate_s": round(statistics.median(h["tlt/generate_s"] for h in logged[first:]), 2),
                      "accept_len_mean": round(statistics.mean(accept), 3) if accept else None}))
    if args.save_drafter and args.tlt != "off":
        trainer.save_drafter(args.save_drafter)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
