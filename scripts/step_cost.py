"""Plain decode-step cost by running rows and context length: tailrl's native engine against vLLM,
and where each engine's step time goes.

Both engines in one process, on one model and dtype, alternating repetition by repetition. A
case is `rows` running sequences whose context lengths mix around `context`: row i's length is
context x f(u_i) with u_i uniform and fixed per row, so a row is longer in every longer case:
`--mix spread` f(u) = 0.5 + u (within +-50%), `--mix tail` f(u) = 0.25 + 1.75 u^3 (most rows
short, a few near 2x: a long rollout's tail). Rows are laid out longest first, as the native
engine admits a wave.

- native: the engine's cache is laid out as its own planning would (rows x the longest row's
  positions) and filled with random keys and values (a step's cost does not depend on them); a
  repetition is `--steps` calls of `Engine.plain_step`, each timed. Run twice where the decode
  kernel is built: with it and without (`native-sdpa`: tailrl.decode_kernels.SWITCH).
- vllm: row i's prompt is a prefix of one random token sequence of row i's, and prefix caching
  is on, so only the first (longest) case is prefilled: every other case's prompts are cached
  blocks. A repetition decodes `--steps` tokens a row with EOS ignored, each `step()` timed; the
  first two (the rest of the prefill) are not decode steps.

A case's time is the median of its decode steps over the repetitions, in ms. `--profile` adds,
per engine and case, where a step's time goes (torch.profiler over one more repetition, each
op's own time summed by kind): linears, attention (native: the decode kernel's call, which also
applies RoPE and writes the cache; vLLM: its attention op), RoPE and cache writes (vLLM's own
ops), norms, sampling, other ops, and the rest of the step's wall time (Python, dispatch).

    .venv/bin/python scripts/step_cost.py [--model DIR] [--rows 16 32 64]
        [--contexts 512 1024 2048] [--mix spread|tail] [--steps 8] [--reps 3] [--profile]
        [--engines native native-sdpa vllm] [--json FILE]

The tables in docs/performance.md ("Plain-step cost by running batch", "Long contexts") come
from this script. Needs vLLM (the README's set-up installs it). Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import defaultdict

# Op name fragments -> the kind of work (first match wins), for --profile.
KINDS = [
    ("linears", ("linear", "addmm", "aten::mm", "aten::bmm", "matmul", "onednn", "mkldnn", "dnnl", "gemm")),
    ("attention", ("tailrl::decode_step", "scaled_dot_product", "attention", "attn", "paged")),
    ("rope, cache writes", ("rotary", "rope", "reshape_and_cache", "cache")),
    ("norms", ("rms_norm", "layer_norm", "tailrl::add_rms_norm")),
    ("sampling", ("tailrl::sample", "sampler", "topk", "top_k", "exponential", "argmax", "log_softmax",
                  "_softmax", "multinomial", "gather")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KINDS if any(p in low for p in parts)), "other ops")


def row_lengths(rows: int, context: int, mix: str) -> list[int]:
    """Each row's context length, longest first (u_i fixed per row: module doc)."""
    rng = random.Random(12345)
    u = [rng.random() for _ in range(rows)]
    f = (lambda x: 0.5 + x) if mix == "spread" else (lambda x: 0.25 + 1.75 * x**3)
    return sorted((max(16, int(context * f(x))) for x in u), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--mix", default="spread", choices=["spread", "tail"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="where each engine's step time goes")
    ap.add_argument("--engines", nargs="+", default=["native", "native-sdpa", "vllm"],
                    choices=["native", "native-sdpa", "vllm"])
    ap.add_argument("--json", default=None, help="also write the cases (times and profiles) to this file")
    args = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, as tailrl's vLLM rollout runs it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from torch.profiler import profile, record_function

    from tailrl import decode_kernels, engine as engine_module
    from tailrl.engine import Engine, EngineConfig, GenerateCall, Seq
    from tailrl.kv_cache import KVCache, whole_chunks
    from tailrl.loading import load_model, resolve_dtype, resolve_model_dir
    from tailrl.records import Request
    from tailrl.sampling import SamplingParams

    path, dtype = resolve_model_dir(args.model), resolve_dtype(args.dtype)
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model(path, dtype=dtype)
    native = Engine(model, EngineConfig(max_batch=max(args.rows)))
    kernel = decode_kernels.library() is not None
    engines = [e for e in args.engines if e != "native-sdpa" or kernel]

    # Named ranges for the profile: the kernels are ctypes calls, which the profiler does not see.
    def named(name, fn):
        def wrapped(*a, **kw):
            with record_function(name):
                return fn(*a, **kw)
        return wrapped

    decode_kernels.decode_step = named("tailrl::decode_step", decode_kernels.decode_step)
    decode_kernels.add_rms_norm = named("tailrl::add_rms_norm", decode_kernels.add_rms_norm)
    decode_kernels.linear = named("tailrl::linear", decode_kernels.linear)
    engine_module.sample = named("tailrl::sample", engine_module.sample)
    engine_module.is_top1 = named("tailrl::sample", engine_module.is_top1)

    cases = [(c, r) for c in args.contexts for r in args.rows]
    # Row i of the largest case is at least as long as row i of any other (module doc).
    widest = row_lengths(max(args.rows), max(args.contexts), args.mix)
    token_rng = random.Random(7)
    base = [[token_rng.randrange(100, 20000) for _ in range(widest[0] + 1)] for _ in widest]

    llm = None
    if "vllm" in engines:
        from vllm import LLM, SamplingParams as VllmParams, TokensPrompt

        most = max(sum(row_lengths(r, c, args.mix)) + r * (args.steps + 16) for c, r in cases)
        per_token = KVCache.bytes_per_token(model.cfg, native.dtype)
        llm = LLM(model=str(path), skip_tokenizer_init=True, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                  enforce_eager=True, max_num_seqs=max(args.rows), enable_chunked_prefill=True,
                  enable_prefix_caching=True, max_model_len=widest[0] + args.steps + 16,
                  max_num_batched_tokens=8192, kv_cache_memory_bytes=int(most * per_token * 1.2) + 2**28, seed=0)
        vllm_engine = llm.llm_engine

    def vllm_rep(lens: list[int], prof) -> list[float]:
        params = VllmParams(max_tokens=args.steps, ignore_eos=True, temperature=1.0)
        for i, n in enumerate(lens):
            vllm_engine.add_request(f"{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=base[i][:n]), params)
        times = []
        while vllm_engine.has_unfinished_requests():
            if prof is not None and len(times) == 2:
                prof.start()
            t = time.perf_counter()
            vllm_engine.step()
            times.append(time.perf_counter() - t)
        if prof is not None:
            prof.stop()
        return times[2:]

    def native_rep(lens: list[int], kernel_on: bool, prof) -> list[float]:
        os.environ[decode_kernels.SWITCH] = "1" if kernel_on else "0"
        running = [Seq(i, Request((1,), seed=i, group=i), length=n, pending=base[i][n]) for i, n in enumerate(lens)]
        call = GenerateCall(SamplingParams(temperature=1.0), 10**6)
        times = []
        with torch.inference_mode():
            if prof is not None:
                prof.start()
            for _ in range(args.steps):
                t = time.perf_counter()
                native.plain_step(running, call)
                times.append(time.perf_counter() - t)
            if prof is not None:
                prof.stop()
        return times

    def run(name: str, lens: list[int], prof=None) -> list[float]:
        if name == "vllm":
            return vllm_rep(lens, prof)
        return native_rep(lens, name == "native", prof)

    def breakdown(name: str, lens: list[int]) -> dict[str, float]:
        """ms per step by kind of work (module doc)."""
        prof = profile()
        times = run(name, lens, prof)
        spent, others = defaultdict(float), defaultdict(float)
        for e in prof.key_averages():
            kind = kind_of(e.key)
            spent[kind] += e.self_cpu_time_total / 1e3
            if kind == "other ops":
                others[e.key] += e.self_cpu_time_total / 1e3
        steps = len(times)
        out = {k: v / steps for k, v in spent.items()}
        out["python, dispatch"] = max(0.0, sum(times) * 1e3 / steps - sum(out.values()))
        top = sorted(others.items(), key=lambda kv: -kv[1])[:4]
        return {"ms": out, "top_other_ops": {k: v / steps for k, v in top}}

    if llm is not None:  # prefill every row once, at its longest (module doc)
        vllm_rep(widest, None)
    print(f"dtype {dtype}, {torch.get_num_threads()} threads, lengths '{args.mix}'; ms per plain decode step "
          f"(median); decode kernel {'built' if kernel else 'not built: native is SDPA only'}")
    head = " | ".join(f"{e} ms" for e in engines)
    ratios = [e for e in engines if e != "vllm"] if "vllm" in engines else []
    print(f"| rows | context | mean length | {head} |" + "".join(f" {e} / vLLM speed |" for e in ratios))
    print("|---|---|---|" + "---|" * (len(engines) + len(ratios)))
    results = []
    for context, rows in cases:
        lens = row_lengths(rows, context, args.mix)
        capacity = whole_chunks(lens[0] + args.steps + 1)
        native.cache = None  # the last case's cache goes before this one's is allocated
        native.cache = KVCache(model.cfg, rows, capacity, native.dtype, native.device)
        for t in (*native.cache.k, *native.cache.v):
            t.uniform_(-1, 1)
        samples = {e: [] for e in engines}
        for _ in range(args.reps):
            for e in engines:
                samples[e] += run(e, lens)
        ms = {e: statistics.median(s) * 1e3 for e, s in samples.items()}
        case = {"rows": rows, "context": context, "mean_length": sum(lens) / rows, "ms": ms}
        if args.profile:
            case["profile_ms"] = {e: breakdown(e, lens) for e in engines}
        results.append(case)
        cells = " | ".join(f"{ms[e]:.1f}" for e in engines)
        speed = "".join(f" {ms['vllm'] / ms[e]:.2f}x |" for e in ratios)
        print(f"| {rows} | {context} | {case['mean_length']:.0f} | {cells} |{speed}", flush=True)
    if args.profile:
        kinds = [k for k, _ in KINDS] + ["other ops", "python, dispatch"]
        print("\nWhere a step's time goes, ms (one profiled repetition; `other ops` and the rest of the wall time "
              "last)")
        print("| rows | context | engine | " + " | ".join(kinds) + " |")
        print("|---|---|---|" + "---|" * len(kinds))
        for case in results:
            for e, parts in case["profile_ms"].items():
                cells = " | ".join(f"{parts['ms'].get(k, 0.0):.1f}" for k in kinds)
                print(f"| {case['rows']} | {case['context']} | {e} | {cells} |")
        print("\nThe largest `other ops`, ms a step:")
        for case in results:
            for e, parts in case["profile_ms"].items():
                ops = ", ".join(f"{k} {v:.1f}" for k, v in parts["top_other_ops"].items())
                print(f"- {case['rows']} rows, {case['context']}, {e}: {ops}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": dtype, "threads": torch.get_num_threads(), "mix": args.mix, "steps": args.steps,
                       "reps": args.reps, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
