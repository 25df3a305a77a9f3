"""Export a drafter as an EAGLE-1 checkpoint laid out for one serving engine: vLLM or SGLang.

Why EAGLE-1 (not EAGLE-3). Our drafter is EAGLE-1's architecture: fc(concat(embed(x_{i+1}), h_i))
with h_i the target's *last* hidden state, one Llama decoder layer whose input norm is skipped,
no final norm, the output read by an LM head. EAGLE-3 differs in kind (fc over three target
layers' hidden states, a 2E-wide attention input with separate embedding/hidden norms, a final
norm), so an EAGLE-3 config would describe a different network.

Why one layout per engine. Both engines load every *.safetensors file at the top of the
directory and refuse a tensor their module tree has no place for, and their trees differ:
vLLM's fc has no bias (vllm/model_executor/models/llama_eagle.py, LlamaModel.fc), SGLang's has
one that must be loaded (sglang/srt/models/llama_eagle.py, LlamaModel.fc is a torch Linear).
They also name the class differently: vLLM's `method="eagle"` prefixes "Eagle" to the config's
architecture (LlamaForCausalLM -> EagleLlamaForCausalLM), SGLang looks up LlamaForCausalLMEagle.

What is written (directory OUT; docs/serving.md names each file against the loader source):
- config.json: the target's Llama/Qwen2 config with the drafter's num_hidden_layers (1 unless
  warmed up with more) and the engine's class.
- model.safetensors, names as both loaders expect (they prefix "model." themselves):
    fc.weight                               <- Drafter.fc.weight            (E, 2E), [embed | hidden]
    fc.bias (SGLang only)                   <- zeros (E,): our fc has none
    layers.N.self_attn.{q,k,v,o}_proj.*     <- Drafter.layers[N].self_attn.*
    layers.N.mlp.{gate,up,down}_proj.weight <- Drafter.layers[N].mlp.*
    layers.N.post_attention_layernorm.weight<- Drafter.layers[N].post_attention_layernorm.weight
    layers.N.input_layernorm.weight (N > 0) <- Drafter.layers[N].input_layernorm.weight
  No input_layernorm in layer 0 (both loaders replace it by the identity, as we do), no
  embed_tokens and no lm_head (both engines take the target's).
- hot_token_ids.pt (SGLang only): the draft vocabulary as target ids, the file SGLang's FR-Spec
  option `--speculative-token-map` reads; SGLang then drafts over the target's LM-head rows of
  those tokens. Its weight loader reads *.pt files only when no *.safetensors file is present.
- tailrl/ (a subdirectory, which neither loader reads): draft_head.safetensors (our head
  lm_head.weight (K, E), d2t (K,) with target_id = draft_id + d2t[draft_id], t2d (V,) bool) and
  provenance.json (target name and embedding fingerprint, version, engine).

Faithfulness. SGLang with the token map reproduces this drafter exactly when its head is the
target's rows (warm-up with --no-train-head). vLLM's EAGLE-1 class drafts with the target's full
LM head, so its proposals range over the whole vocabulary (same layer, same hidden-state
prediction); a trained head is used by neither engine. `load_exported` reads either layout back
into a Drafter, which the tests use to check the export reproduces the drafter's outputs.

Knows: the drafter's parameters and the EAGLE-1 file layouts. Does not know: training, engines'
runtime behaviour beyond what their loaders read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailrl.model import Transformer
from tailrl.speculative.drafter.model import (
    Drafter,
    DrafterConfig,
    DrafterError,
    check_target,
    read_drafter_config,
    read_drafter_weights,
)

ENGINES = ("vllm", "sglang")
# The architecture each engine's EAGLE-1 loader resolves, per target family it has a class for.
ARCHITECTURES = {
    "vllm": {"llama": "EagleLlamaForCausalLM"},
    "sglang": {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"},
}
SIDE_DIR = "tailrl"  # below the top level: neither engine's weight loader looks there
MODEL_FILE = "model.safetensors"
HEAD_FILE = "draft_head.safetensors"
PROVENANCE_FILE = "provenance.json"
TOKEN_MAP_FILE = "hot_token_ids.pt"
_LAYERS = "layers."


def eagle_config(cfg: DrafterConfig, engine: str) -> dict:
    """The HF-style config.json that `engine`'s EAGLE-1 loader reads."""
    c = cfg.layer
    classes = ARCHITECTURES[engine]
    if c.model_type not in classes:
        raise DrafterError(f"{engine} has no EAGLE-1 class for {c.model_type} drafters (it has: {', '.join(classes)})")
    return {
        "architectures": [classes[c.model_type]],
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": c.attention_bias,
        "tie_word_embeddings": False,
        "eos_token_id": list(c.eos_token_ids),
        "torch_dtype": "bfloat16",
    }


def eagle_weights(state: dict[str, torch.Tensor], engine: str) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors from a drafter state dict (the module doc's table)."""
    weights = {"fc.weight": state["fc.weight"]}
    if engine == "sglang":
        weights["fc.bias"] = torch.zeros(state["fc.weight"].shape[0])
    weights.update({name: w for name, w in state.items() if name.startswith(_LAYERS)})
    return weights


def write_eagle(out: Path, cfg: DrafterConfig, state: dict[str, torch.Tensor], engine: str, dtype: torch.dtype) -> None:
    """The export of a drafter (its config and state dict) into the existing empty directory `out`."""
    meta = {"format": "pt"}
    weights = eagle_weights(state, engine)
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, out / MODEL_FILE, metadata=meta)
    (out / "config.json").write_text(json.dumps(eagle_config(cfg, engine), indent=1))
    d2t = torch.tensor(cfg.draft_vocab, dtype=torch.long)
    if engine == "sglang":
        torch.save(d2t, out / TOKEN_MAP_FILE)
    side = out / SIDE_DIR
    side.mkdir()
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    head = {"lm_head.weight": state["head.weight"].to(dtype).contiguous(), "d2t": d2t - torch.arange(len(d2t)),
            "t2d": t2d}
    save_file(head, side / HEAD_FILE, metadata=meta)
    provenance = {"engine": engine, "target_name": cfg.target_name, "version": cfg.version,
                  "fingerprint": list(cfg.fingerprint)}
    (side / PROVENANCE_FILE).write_text(json.dumps(provenance))


def export(drafter_dir: str | Path, out_dir: str | Path, engine: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the EAGLE-1 checkpoint of the drafter in drafter_dir for `engine` (see the module doc).

    Written to a temporary directory beside `out_dir`, then renamed into place; an existing
    `out_dir` is replaced only when it is an earlier export (it has tailrl/provenance.json).
    """
    if engine not in ENGINES:
        raise DrafterError(f"unknown serving engine {engine!r} (choose from {', '.join(ENGINES)})")
    drafter_dir, out = Path(drafter_dir), Path(out_dir)
    cfg = read_drafter_config(drafter_dir)
    eagle_config(cfg, engine)  # refuse an unsupported family before any file is written
    state = read_drafter_weights(drafter_dir)
    if out.exists() and any(out.iterdir()) and not (out / SIDE_DIR / PROVENANCE_FILE).is_file():
        raise DrafterError(f"{out} exists and is not a tailrl export; choose an empty or new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.with_name(f".tmp-{out.name}.{os.getpid()}"), out.with_name(f".old-{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_eagle(tmp, cfg, state, engine, dtype)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_exported(path: str | Path, target: Transformer) -> Drafter:
    """Read an exported checkpoint (either layout) back into a Drafter for `target`."""
    path = Path(path)
    weights = load_file(path / MODEL_FILE)
    head = load_file(path / SIDE_DIR / HEAD_FILE)
    meta = json.loads((path / SIDE_DIR / PROVENANCE_FILE).read_text())
    d2t = head["d2t"] + torch.arange(head["d2t"].shape[0])
    layers = {int(k.split(".")[1]) for k in weights if k.startswith(_LAYERS)}
    layer_cfg = dataclasses.replace(target.cfg, num_layers=len(layers))
    vocab, fingerprint = tuple(d2t.tolist()), tuple(meta["fingerprint"])
    cfg = DrafterConfig(meta["target_name"], layer_cfg, vocab, fingerprint, meta["version"])
    check_target(cfg, target)
    if "fc.bias" in weights and bool(weights["fc.bias"].any()):
        raise DrafterError(f"{path}: fc.bias is not zero; tailrl drafters have no fc bias")
    state = {"fc.weight": weights["fc.weight"], "head.weight": head["lm_head.weight"]}
    state.update({k: v for k, v in weights.items() if k.startswith(_LAYERS)})
    net = Drafter(cfg, target.model.embed_tokens.weight.detach())
    net.load_state_dict(state, strict=True)
    w = target.lm_head.weight
    return net.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
