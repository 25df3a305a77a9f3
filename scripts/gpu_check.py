"""What tailrl's native engine does on a GPU, and what TLT's rollout speed-up there would be.

For a machine with one GPU, torch (CUDA) and nothing else of tailrl's dependencies installed
(no vLLM, no Ray, no network): it imports only the modules that need torch alone (model,
engine, sampling, speculative decoding) from this checkout. Within minutes:

1. Checks: on the device, the engine's greedy tokens equal a full forward's argmax chain, and
   speculative decoding (the n-gram drafter every step) emits exactly plain decoding's tokens at
   T = 1 in exact mode, on a tiny random Llama built in place.
2. Costs: a plain decode step and a verify step of a chain of K drafts (K + 1 rows per
   sequence), per running batch size, for a SmolLM2-135M-shaped and a ~1B Llama-shaped model
   (random weights, bf16 on CUDA, the rollout dtype elsewhere), over a ~400-token context.
   The learned drafter's chain loop (a random one-layer drafter of the same shape, 6-chains at
   1, 8 and 32 rows), eager and as graphs (tailrl.speculative.drafter.chain_graphs).
3. Projection: the default batch's response lengths and the learned drafter's acceptance, as
   measured on CPU (`--inputs`, JSON: "batches", each a rollout's response lengths, "accept_len"
   and the chain depth it was measured at), decoded in simulation: each step's running batch takes plain decoding or the
   chain depth whose measured cost per emitted token is lowest (an oracle over the measured
   arms); per-token acceptance is fitted to the measured accept_len (accept_len(K) =
   (1 - a^(K+1)) / (1 - a)), drafting costs one drafter layer per draft token (a target
   layer's measured cost). Printed: the projected rollout speed-up over plain decoding.

Without a GPU it runs the same on the CPU (`--device cpu`), which is how it was tested.

    PYTHONPATH=. python scripts/gpu_check.py --inputs docs/results/gpu/inputs.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from tailrl.engine import Engine, EngineConfig
from tailrl.kv_cache import CacheView, KVCache
from tailrl.model import ModelConfig, Transformer
from tailrl.records import Request
from tailrl.sampling import SamplingParams
from tailrl.speculative.decoder import fixed
from tailrl.speculative.drafter.chain_graphs import ChainGraphs, draft_chain
from tailrl.speculative.drafter.model import Drafter, DrafterProposer
from tailrl.speculative.modes import SpeculationConfig, install
from tailrl.step_graphs import StepGraphs
from tailrl.tuner import Arm

SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
                      attention_bias=False, qk_norm=False, eos_token_ids=(2,))
LLAMA_1B = replace(SMOLLM2, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                   num_kv_heads=8, rope_theta=500000.0)
TINY = replace(SMOLLM2, vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_ids=(1,))
MODELS = {"smollm2-135m": SMOLLM2, "llama-1b": LLAMA_1B}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEPTHS = (1, 2, 4, 8, 16)  # draft tokens a verify checks (a chain: K + 1 rows per sequence)
CONTEXT = 400


def model_on(cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.to(device=device, dtype=dtype).eval()


def checks(device: str) -> None:
    model = model_on(TINY, device, torch.float32)
    g = torch.Generator().manual_seed(1)
    reqs = [Request(tuple(torch.randint(2, 96, (6,), generator=g).tolist()), seed=i, group=i) for i in range(8)]
    greedy = Engine(model, EngineConfig(max_batch=8)).generate(reqs, SamplingParams(temperature=0.0), 16)
    with torch.no_grad():
        for r, c in zip(reqs, greedy):
            ids = list(r.prompt_ids)
            for tok in c.token_ids:
                logits = model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None])
                assert int(logits[0, -1].argmax()) == tok, "greedy decoding differs from the full forward"
                ids.append(tok)
    plain = Engine(model, EngineConfig(max_batch=8, exact=True)).generate(reqs, SamplingParams(1.0), 24)
    spec = Engine(model, EngineConfig(max_batch=8, exact=True))
    install(spec, SpeculationConfig(spec="on", draft_depth=3, num_draft_tokens=3))
    out = spec.generate(reqs, SamplingParams(1.0), 24)
    same = sum(a.token_ids == b.token_ids for a, b in zip(plain, out))
    eager = Engine(model, EngineConfig(max_batch=8, exact=True, graphs="off")).generate(reqs, SamplingParams(1.0), 24)
    learned = Engine(model, EngineConfig(max_batch=8, exact=True))  # a random drafter's 4-chains, its loop graphed
    random_drafter = Drafter.from_target(model, list(range(96)), "tiny")
    learned.decoder = fixed(Arm("drafter", 4, 1, 4), DrafterProposer(random_drafter))
    drafted = sum(a.token_ids == b.token_ids for a, b in zip(plain, learned.generate(reqs, SamplingParams(1.0), 24)))
    graphed = sum(a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(plain, eager))
    # Exact mode's row invariance is measured on CPU kernels (docs/lossless.md); on another device
    # this line is the measurement.
    print(f"checks on {device}: greedy = full forward; speculative (n-gram) = plain in exact mode for {same}/8 "
          f"sequences, {spec.stats.spec.verify_steps} verifies; step graphs (auto) = eager forwards in exact mode "
          f"(tokens and log-probs) for {graphed}/8; a learned drafter's chains = plain for {drafted}/8", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_cost(model: Transformer, graphs: StepGraphs | None, device: str, batch: int, rows: int,
              repeats: int = 5) -> float:
    """Seconds of one forward of `rows` new tokens per sequence over a CONTEXT-token cache: the
    model's own forward, or its bucket's graph (`graphs`, with the copies in and out a step makes)."""
    cache = KVCache(model.cfg, batch, CONTEXT + 128, model.lm_head.weight.dtype, device)
    for kv in (*cache.k, *cache.v):  # a context's keys and values; left uninitialised, denormals slow a CPU 100x
        kv.normal_(0.0, 1.0)
    ids = torch.randint(2, 1000, (batch, rows), device=device)
    write = CONTEXT + torch.arange(rows, device=device)[None].expand(batch, rows)
    mask = torch.arange(CONTEXT + rows, device=device)[None, None] <= write[:, :, None]
    view = CacheView(cache, 0, write, CONTEXT + rows, mask)

    def forward() -> None:
        if graphs is None:
            model(ids, write, view, return_hidden=True)
        else:
            graphs.forward(ids, write, view)

    with torch.inference_mode():
        forward()
        sync(device)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward()
            sync(device)
            best = min(best, time.perf_counter() - t0)
    return best


def costs(cfg: ModelConfig, device: str, dtype: torch.dtype) -> dict[str, dict[str, dict[int, float]]]:
    """Plain and verify step costs per batch size, eager and as graphs (captured on CUDA)."""
    model = model_on(cfg, device, dtype)
    out = {}
    for label, graphs in (("eager", None), ("graphs", StepGraphs(model, False, capture=device.startswith("cuda")))):
        table: dict[str, dict[int, float]] = {"plain": {}, **{f"verify{k}": {} for k in DEPTHS}}
        for b in BATCHES:
            table["plain"][b] = step_cost(model, graphs, device, b, 1)
            for k in DEPTHS:
                table[f"verify{k}"][b] = step_cost(model, graphs, device, b, k + 1)
            print(f"  {label:6s} batch {b:3d}: plain {table['plain'][b] * 1e3:6.2f} ms, verify " + ", ".join(
                f"K={k} {table[f'verify{k}'][b] * 1e3:6.2f}" for k in DEPTHS) + " ms", flush=True)
        out[label] = table
    del model
    return out


def chain_costs(cfg: ModelConfig, device: str, dtype: torch.dtype, n: int = 6) -> dict[str, dict[int, float]]:
    """Seconds of a learned drafter's chain loop (n - 1 forwards of one layer and a 4,096-token
    head after the root's) over a CONTEXT-token drafter cache, eager and as graphs."""
    target = model_on(cfg, device, dtype)
    drafter = Drafter.from_target(target, list(range(4096)), "random").to(device=device, dtype=dtype).eval()
    drafter.attach(target)
    graphs = ChainGraphs(drafter, capture=device.startswith("cuda"))
    out: dict[str, dict[int, float]] = {"eager": {}, "graphs": {}}
    for b in (1, 8, 32):
        cache = KVCache(drafter.cfg.layer, b, CONTEXT + 128, dtype, device)
        root = torch.randn(b, 1, cfg.hidden_size, device=device, dtype=dtype)
        lens = torch.full((b,), CONTEXT, device=device)
        runs = {"eager": lambda: draft_chain(drafter, cache, root, lens, n, CONTEXT + n - 1),
                "graphs": lambda: graphs.draft(cache, root, lens, CONTEXT + n - 1, n)}
        with torch.inference_mode():
            for kind, run in runs.items():
                run()
                sync(device)
                best = math.inf
                for _ in range(5):
                    t0 = time.perf_counter()
                    run()
                    sync(device)
                    best = min(best, time.perf_counter() - t0)
                out[kind][b] = best
        print(f"  drafter {n}-chain loop, batch {b:3d}: eager {out['eager'][b] * 1e3:6.2f} ms, "
              f"graphs {out['graphs'][b] * 1e3:6.2f} ms", flush=True)
    return out


def per_token_acceptance(accept_len: float, depth: int) -> float:
    """a with (1 - a^(depth+1)) / (1 - a) = accept_len, by bisection."""
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(100):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if (1 - a ** (depth + 1)) / (1 - a) < accept_len else (lo, a)
    return (lo + hi) / 2


def project(table: dict[str, dict[int, float]], num_layers: int, lens: list[int], a: float) -> tuple[float, float]:
    """Seconds of the rollout decoded plain, and with each step's best measured arm."""
    def at(name: str, b: int) -> float:
        sizes = sorted(table[name])
        return table[name][min(sizes, key=lambda s: (abs(s - b), s))]  # the nearest measured batch size

    left = sorted(lens)
    plain_s = spec_s = 0.0
    remaining = list(left)
    while remaining:  # plain: one token per running sequence per step
        b = len(remaining)
        plain_s += at("plain", b)
        remaining = [n - 1 for n in remaining if n > 1]
    remaining = list(left)
    while remaining:
        b = len(remaining)
        best_cost, best_tokens = at("plain", b), 1.0
        for k in DEPTHS:
            emitted = (1 - a ** (k + 1)) / (1 - a)
            draft = k * at("plain", b) / num_layers  # k drafter steps, one layer each
            if (at(f"verify{k}", b) + draft) / emitted < best_cost / best_tokens:
                best_cost, best_tokens = at(f"verify{k}", b) + draft, emitted
        spec_s += best_cost
        remaining = [n - best_tokens for n in remaining if n > best_tokens]
    return plain_s, spec_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--inputs", default="docs/results/gpu/inputs.json", help="CPU-measured lengths and acceptance")
    ap.add_argument("--models", default="smollm2-135m,llama-1b", help="which model shapes to cost, comma-separated")
    ap.add_argument("--out", help="write the costs and projections as JSON here")
    args = ap.parse_args()
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    device = args.device
    dtype = (torch.bfloat16 if device.startswith("cuda") or torch.ops.mkldnn._is_mkldnn_bf16_supported()
             else torch.float32)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    print(f"device {device} ({name}), torch {torch.__version__}, {dtype}", flush=True)
    t0 = time.perf_counter()
    checks(device)
    inputs = json.loads(Path(args.inputs).read_text())
    a = per_token_acceptance(inputs["accept_len"], inputs["depth"])
    report = {"device": name, "dtype": str(dtype), "inputs": inputs, "per_token_acceptance": a, "models": {}}
    for label in args.models.split(","):
        cfg = MODELS[label]
        print(f"{label}: step costs over a {CONTEXT}-token context", flush=True)
        tables = costs(cfg, device, dtype)
        entry: dict = {"costs_s": tables}
        for kind, table in tables.items():
            # The acceptance line: a verify of up to 8 draft tokens at <= 32 rows against a plain step.
            worst = max(table[f"verify{k}"][b] / table["plain"][b]
                        for k in DEPTHS if k <= 8 for b in BATCHES if b <= 32)
            projections = [project(table, cfg.num_layers, lens, a) for lens in inputs["batches"]]
            plain_s, spec_s = sum(p for p, _ in projections), sum(s for _, s in projections)
            print(f"{label}, {kind}: verify (<= 8 drafts, <= 32 rows) / plain at most {worst:.2f}x; projected rollout "
                  f"of the CPU-measured batches: plain {plain_s:.2f} s, best arms {spec_s:.2f} s, "
                  f"speed-up {plain_s / spec_s:.2f}x", flush=True)
            entry[kind] = {"worst_verify_over_plain": worst, "plain_s": plain_s, "spec_s": spec_s,
                           "speedup": plain_s / spec_s}
        eager, graphs = tables["eager"]["plain"], tables["graphs"]["plain"]
        print(f"{label}: plain step eager / graphs " + ", ".join(f"{b}: {eager[b] / graphs[b]:.1f}x" for b in BATCHES),
              flush=True)
        entry["drafter_chain_s"] = chain_costs(cfg, device, dtype)
        report["models"][label] = entry
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
