#!/usr/bin/env bash
# tailrl's native engine on a lent GPU machine (python3 with torch and transformers; no vLLM, Ray
# or network), in one call: the engine's checks and step costs on the device (gpu_check.py), then
# `bench generate` (tailrl against transformers) and `bench rollout` (plain, n-gram, auto) on
# CUDA. No model can be downloaded there and the default model's files exceed what a call carries,
# so the models are random ones of SmolLM2-135M's and a ~1B Llama's shapes, with SmolLM2's
# tokenizer from TOKENIZER_DIR (its config.json, tokenizer.json, tokenizer_config.json,
# chat_template.jinja): speeds are real, acceptance is not (a random model's samples at T = 1
# leave an n-gram drafter nothing to accept, the regime where auto must cost nothing).
#
#     OUT=$(mktemp -d) bash scripts/gpu_run.sh .gpu        # results: $OUT/*.json, *.log
#     OUT=... bash scripts/gpu_run.sh .gpu passes,rollout  # some parts only (a lent machine's minutes are few)
#
# The engine's plain and verify forwards run as CUDA graphs there (tailrl.step_graphs, EngineConfig
# graphs = auto); gpu_check.py costs both ways. `static` (last, at most 200 s) runs bench generate
# against transformers with its static cache, which it compiles on CUDA.
set -u
TOKENIZER_DIR=${1:?usage: gpu_run.sh TOKENIZER_DIR [check,passes,generate,rollout]}
PARTS=,${2:-check,passes,generate,rollout,static},
OUT=${OUT:?set OUT to a results folder}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH=$PWD
MODELS=$(mktemp -d)  # the random models, outside $OUT (its files come back from a lent machine)

nvidia-smi -L; lscpu | grep -m1 "Model name"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
[[ $PARTS == *,check,* ]] && timeout 240 python3 scripts/gpu_check.py --device "$DEVICE" --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"

python3 - "$TOKENIZER_DIR" "$MODELS" <<'PY'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, root = Path(sys.argv[1]), Path(sys.argv[2])
shapes = {"smollm2-135m": {}, "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8)}
for name, shape in shapes.items():
    cfg = AutoConfig.from_pretrained(src, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(root / name)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, root / name / f)
    print("random model", name, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PY
# Plain decodes of 32 requests x 64 tokens timed, a first and a repeated pass over new prompts,
# and one profiled: SDPA's cuDNN backend made a first pass ~7x slower on the H200 (a plan per new
# attention shape), so the engine decodes without it (model._DECODE_BACKENDS); this shows it stays so.
[[ $PARTS == *,passes,* ]] && python3 - "$MODELS/smollm2-135m" "$OUT" "$DEVICE" <<'PY' 2>&1 | tee "$OUT/plain_profile.log"
import sys, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
from tailrl.bench.generate import _prompts
from tailrl.engine import Engine, EngineConfig
from tailrl.generate import make_requests
from tailrl.loading import load_model, load_tokenizer
from tailrl.sampling import SamplingParams
path, out, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
model, tok = load_model(path, device=device), load_tokenizer(path)
prompts = _prompts(tok, 96)
engine = Engine(model, EngineConfig(max_batch=32))
engine.generate(make_requests(prompts[:2], 1, 0), SamplingParams(1.0), 4)
# A call over new prompts meets attention shapes (rows x keys) not seen before, its repeat none.
for part in (0, 1):
    requests = make_requests(prompts[32 * part:32 * part + 32], 1, 0)
    for t in (1.0, 1.0, 0.0):
        t0 = time.perf_counter()
        engine.generate(requests, SamplingParams(t), 64)
        g = engine.graphs
        print(f"prompts {part}, T = {t}: {time.perf_counter() - t0:.2f} s for {engine.stats.tokens} tokens; graphs "
              f"captured so far {g.captures} in {g.capture_seconds:.2f} s" if g else "", flush=True)
# Inside auto a plain step cost ~45 ms against ~32 ms in off on the H200 (docs/performance.md): the
# plain decoder against a speculative one that always picks plain (auto's arms, so auto's cache
# reservation), same requests, alternated.
from tailrl.engine import PlainDecoder
from tailrl.speculative.decoder import NgramProposer, SpecDecoder
from tailrl.tuner import PLAIN, Arm
# A third decoder alternates plain and ngram(2,1,2) steps: its plain steps' own cost, after verifies
# (random weights accept nothing and rarely end a sample, so every step runs the same 32 rows).
requests = make_requests(prompts[:32], 1, 0)
arms = [PLAIN, Arm("ngram", 2, 1, 2), Arm("ngram", 8, 1, 8)]
for rep in range(2):
    for name in ("plain decoder", "spec decoder, always plain", "spec decoder, plain and n-gram alternating"):
        steps = iter(range(10**9))
        choose = (lambda running: PLAIN) if "always" in name else (lambda running: arms[next(steps) % 2])
        engine.decoder = PlainDecoder() if name == "plain decoder" else SpecDecoder({"ngram": NgramProposer()}, choose, arms)
        t0 = time.perf_counter()
        engine.generate(requests, SamplingParams(1.0), 64)
        sp = engine.stats.spec
        plain = f", plain steps {sp.plain_seconds / sp.plain_steps * 1e3:.1f} ms" if sp.plain_steps else ""
        print(f"{name}: {time.perf_counter() - t0:.2f} s for {engine.stats.tokens} tokens{plain}", flush=True)
engine.decoder = PlainDecoder()
requests = make_requests(prompts[64:], 1, 0)
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
with profile(activities=activities) as prof:
    engine.generate(requests, SamplingParams(1.0), 16)
key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
PY
python3 - "$MODELS" "$OUT" "$DEVICE" "$PARTS" <<'PY' 2>&1 | tee "$OUT/bench.log"
import json, sys
from pathlib import Path
from tailrl.bench import generate, rollout
models, out, device, parts = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
for name in ("smollm2-135m", "llama-1b") if ",generate," in parts else ():
    print(f"bench generate, {name} (random weights), {device}", flush=True)
    cfg = generate.BenchGenerateConfig(model=str(models / name), device=device, batch_sizes=(1, 8, 64), max_new_tokens=128,
                                       repeats=2)
    (out / f"generate-{name}.json").write_text(json.dumps(generate.report(cfg, log=lambda line: print(line, flush=True))))
if ",rollout," not in parts:
    sys.exit()
print(f"bench rollout, smollm2-135m (random weights), {device}", flush=True)
# Every repetition opens a new engine, so its graphs are captured inside the timed rollout (~0.1 s
# each); three batches a repetition, as an RL run's steps reuse its engine, so that they amortise.
cfg = rollout.BenchRolloutConfig(model=str(models / "smollm2-135m"), device=device, modes=("off", "ngram", "auto"),
                                 reps=2, batches=3, num_prompts=16, max_new_tokens=256, plot=str(out / "rollout.png"))
(out / "rollout.json").write_text(json.dumps(rollout.run(cfg, log=lambda line: print(line, flush=True))))
PY
[[ $PARTS == *,static,* ]] && timeout 200 python3 - "$MODELS" "$OUT" "$DEVICE" <<'PY' 2>&1 | tee "$OUT/static.log"
import json, sys
from pathlib import Path
from tailrl.bench import generate
models, out, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
print(f"bench generate, smollm2-135m (random weights), {device}, transformers with its static cache", flush=True)
cfg = generate.BenchGenerateConfig(model=str(models / "smollm2-135m"), device=device, batch_sizes=(8, 64),
                                   max_new_tokens=128, repeats=2, hf_cache="static")
(out / "generate-static-smollm2-135m.json").write_text(json.dumps(generate.report(cfg, log=lambda line: print(line, flush=True))))
PY
true
