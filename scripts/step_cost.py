"""Plain decode-step cost by running batch and context: tailrl's native engine against vLLM.

Both engines in one process, on one model and dtype, alternating repetition by repetition. Each
case is `batch` prompts of random tokens whose lengths spread +-50% around `context` (the
native engine admits them longest first, as it admits any wave), decoded for `--steps` steps
with EOS ignored, so every step advances the whole batch; a case's time is the median of its
steps after the first (the prefill is not a decode step). Printed per case: each engine's
median over the repetitions, ms per step, and native's speed over vLLM's (vLLM's time / native's);
native runs twice, with its compiled decode attention and with it switched off (SDPA:
tailrl.decode_kernels.SWITCH), when the kernel is built on this machine.

    .venv/bin/python scripts/step_cost.py [--model DIR] [--batches 1 4 16 32 64]
        [--contexts 256 1024] [--steps 16] [--reps 3]

The table in docs/performance.md ("Plain-step cost by running batch") comes from this script.
Needs vLLM (the README's set-up installs it). Not part of the tests.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, as tailrl's vLLM rollout runs it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from vllm import LLM, SamplingParams as VllmParams, TokensPrompt

    from tailrl import decode_kernels
    from tailrl.engine import Engine, EngineConfig
    from tailrl.loading import load_model, resolve_dtype, resolve_model_dir
    from tailrl.records import Request
    from tailrl.sampling import SamplingParams

    path, dtype = resolve_model_dir(args.model), resolve_dtype(args.dtype)
    longest = max(args.contexts) * 3 // 2 + args.steps + 1
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
              enforce_eager=True, max_num_seqs=max(args.batches), enable_chunked_prefill=False, max_model_len=longest,
              max_num_batched_tokens=max(args.batches) * longest, kv_cache_memory_bytes=6 * 2**30, seed=0)
    torch.set_num_threads(os.cpu_count() or 1)
    native = Engine(load_model(path, dtype=dtype), EngineConfig(max_batch=max(args.batches), kv_budget_gb=6.0))
    native.eos = set()  # every step advances the whole batch
    vllm_engine = llm.llm_engine

    def vllm_ms(prompts: list[list[int]]) -> float:
        params = VllmParams(max_tokens=args.steps, ignore_eos=True, temperature=1.0)
        for i, p in enumerate(prompts):
            vllm_engine.add_request(f"{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=p), params)
        times = []
        while vllm_engine.has_unfinished_requests():
            t = time.perf_counter()
            vllm_engine.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:]) * 1e3  # times[0] is the prefill

    def native_ms(prompts: list[list[int]], kernel: bool) -> float:
        os.environ[decode_kernels.SWITCH] = "1" if kernel else "0"
        requests = [Request(tuple(p), seed=i, group=i) for i, p in enumerate(prompts)]
        native.generate(requests, SamplingParams(temperature=1.0), args.steps)
        return statistics.median(r.seconds for r in native.stats.timeline[1:]) * 1e3

    kernel = decode_kernels.library() is not None
    print(f"dtype {dtype}, {torch.get_num_threads()} threads; ms per plain decode step (median); decode kernel "
          f"{'built' if kernel else 'not built: native is SDPA only'}")
    print("| running | context | native ms | native SDPA ms | vLLM ms | native speed / vLLM's | SDPA's / vLLM's |")
    print("|---|---|---|---|---|---|---|")
    for context in args.contexts:
        for b in args.batches:
            rng = random.Random(b * 100003 + context)
            prompts = [[rng.randrange(100, 20000) for _ in range(rng.randint(context // 2, context * 3 // 2))]
                       for _ in range(b)]
            nat, sdpa, vll = [], [], []
            for _ in range(args.reps):
                nat.append(native_ms(prompts, kernel))
                sdpa.append(native_ms(prompts, False))
                vll.append(vllm_ms(prompts))
            n, sd, v = statistics.median(nat), statistics.median(sdpa), statistics.median(vll)
            print(f"| {b} | {context} | {n:.1f} | {sd:.1f} | {v:.1f} | {v / n:.2f}x | {v / sd:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
