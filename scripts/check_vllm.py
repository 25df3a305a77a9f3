"""Load a `tailrl drafter export --for vllm` checkpoint in vLLM and compare acceptance with tailrl.

Two halves, run by scripts/check_vllm.sh in two processes of the project's .venv:
  tailrl: exports the drafter, decodes greedily the default task's prompts with tailrl's own
          engine speculating with that drafter (chains of depth k), and writes the prompts' token
          ids, the target directory and tailrl's mean acceptance length to a JSON file.
  vllm:   reads that file, loads the target in vLLM with speculative_config
          {"method": "eagle", "model": <export>, "num_speculative_tokens": k}, decodes the same
          token ids greedily, and prints vLLM's mean acceptance length next to tailrl's.
Acceptance length counts the bonus token in both (vLLM: 1 + accepted / drafts; tailrl: emitted
tokens / verify steps). The vllm half imports nothing from tailrl.

Knows: both engines' public generate calls and vLLM's spec-decode counters. Does not know: how
either drafts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


def tailrl_half(args: argparse.Namespace) -> None:
    from tailrl.engine import Engine
    from tailrl.generate import encode_prompt, make_requests
    from tailrl.loading import load_model, load_tokenizer, resolve_model_dir
    from tailrl.rl.tasks import DEFAULT_TASK, format_prompt, make_task
    from tailrl.sampling import SamplingParams
    from tailrl.speculative.drafter.export import export
    from tailrl.speculative.modes import SpeculationConfig, install

    model_dir = resolve_model_dir(args.model)
    export(args.drafter, args.export, "vllm")
    tok = load_tokenizer(model_dir)
    task = make_task(DEFAULT_TASK)
    # Seed 1: not the prompts a default warm-up (seed 0) trained on.
    prompts = [encode_prompt(tok, format_prompt(task.sample(1, i).question)) for i in range(args.num_prompts)]
    engine = Engine(load_model(model_dir, dtype="bf16"))
    spec = SpeculationConfig(spec="on", drafter=args.drafter, draft_depth=args.k, topk=1, num_draft_tokens=args.k)
    install(engine, spec)
    out = engine.generate(make_requests(prompts, 1, 0), SamplingParams(temperature=0.0), args.max_new_tokens)
    s = engine.stats.spec
    result = {"model_dir": str(model_dir), "export": str(args.export), "k": args.k,
              "max_new_tokens": args.max_new_tokens, "prompts": [list(p) for p in prompts],
              "tailrl_accept_len": s.accept_len,
              "tailrl_verify_steps": s.verify_steps, "tailrl_tokens": [c.token_ids for c in out]}
    Path(args.result).write_text(json.dumps(result))
    print(f"tailrl: mean acceptance length {s.accept_len:.3f} over {s.verify_steps} verifies", file=sys.stderr)


def _target_for_vllm(model_dir: Path, scratch: Path) -> Path:
    """The target as vLLM reads it: its config must name an architecture, which a config
    converted from GGUF leaves null; a copy with the family's class is made then."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    families = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    config["architectures"] = [families[config["model_type"]]]
    copy = scratch / model_dir.name
    shutil.copytree(model_dir, copy)
    (copy / "config.json").write_text(json.dumps(config, indent=1))
    return copy


def _counter(metrics, name: str) -> float:
    return sum(m.value for m in metrics if m.name == name)


def vllm_half(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.loads(Path(args.result).read_text())
    with tempfile.TemporaryDirectory() as scratch:
        target = _target_for_vllm(Path(data["model_dir"]), Path(scratch))
        # On CPU this fraction of the machine's memory is reserved (weights and KV cache): a small
        # model needs little, and other processes may hold the rest.
        llm = LLM(model=str(target), dtype="bfloat16", max_model_len=2048, disable_log_stats=False, seed=0,
                  gpu_memory_utilization=args.memory_fraction,
                  speculative_config={"method": "eagle", "model": data["export"],
                                      "num_speculative_tokens": data["k"]})
        prompts = [TokensPrompt(prompt_token_ids=p) for p in data["prompts"]]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=data["max_new_tokens"]))
        metrics = llm.get_metrics()
    drafts = _counter(metrics, "vllm:spec_decode_num_drafts")
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
    vllm_len = 1 + accepted / drafts if drafts else float("nan")
    same = sum(list(o.outputs[0].token_ids) == t for o, t in zip(outs, data["tailrl_tokens"]))
    ratio = vllm_len / data["tailrl_accept_len"]
    print(json.dumps({"k": data["k"], "prompts": len(prompts), "max_new_tokens": data["max_new_tokens"],
                      "vllm_accept_len": round(vllm_len, 3), "vllm_drafts": int(drafts),
                      "tailrl_accept_len": round(data["tailrl_accept_len"], 3),
                      "tailrl_verify_steps": data["tailrl_verify_steps"], "ratio": round(ratio, 3),
                      "identical_outputs": same}))
    print(f"mean acceptance length: vLLM {vllm_len:.3f} | tailrl {data['tailrl_accept_len']:.3f} | "
          f"ratio {ratio:.3f} ({'within' if abs(ratio - 1) <= 0.10 else 'NOT within'} 10%); "
          f"{same}/{len(prompts)} outputs identical")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="half", required=True)
    t = sub.add_parser("tailrl", help="export, decode with tailrl, write the shared JSON")
    t.add_argument("--drafter", required=True, help="drafter directory (tailrl drafter warmup --out)")
    t.add_argument("--export", required=True, help="where the vLLM checkpoint is written")
    t.add_argument("--model", default=None, help="target model directory (default: SmolLM2-135M-Instruct)")
    t.add_argument("--num-prompts", type=int, default=8)
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("-k", type=int, default=3, help="draft tokens per step (chain depth)")
    t.add_argument("--result", required=True, help="the shared JSON file")
    v = sub.add_parser("vllm", help="load the export in vLLM, decode the same prompts, compare")
    v.add_argument("--result", required=True, help="the JSON file the tailrl half wrote")
    v.add_argument("--memory-fraction", type=float, default=0.2, help="share of memory vLLM reserves")
    args = p.parse_args()
    tailrl_half(args) if args.half == "tailrl" else vllm_half(args)


if __name__ == "__main__":  # vLLM's engine process re-imports the main module
    main()
