"""Export a drafter as an EAGLE-1 checkpoint, the layout SGLang and vLLM EAGLE loaders read.

Why EAGLE-1 (not EAGLE-3). Our drafter is EAGLE-1's architecture: fc(concat(embed(x_{i+1}), h_i))
with h_i the target's *last* hidden state, one Llama decoder layer whose input norm is skipped,
no final norm, the output read by an LM head. EAGLE-3 differs in kind (fc over three target
layers' hidden states, a 2E-wide attention input with separate embedding/hidden norms, a final
norm), so an EAGLE-3 config would describe a different network.

What is written (directory):
- config.json: the target's Llama/Qwen2 config with num_hidden_layers 1 and
  architectures ["LlamaForCausalLMEagle"] (SGLang's EAGLE-1/2 class name; "Qwen2ForCausalLMEagle"
  for Qwen2 targets), plus draft_vocab_size and a "tailrl" block (target, version, file notes).
- model.safetensors, weight names as both loaders expect (they prefix "model." themselves):
    fc.weight                               <- Drafter.fc.weight            (E, 2E), [embed | hidden]
    fc.bias                                 <- zeros (E,): our fc has none; SGLang's fc has a bias
                                               (recent vLLM builds have none and skip it)
    layers.0.self_attn.{q,k,v,o}_proj.*     <- Drafter.layer.self_attn.*
    layers.0.mlp.{gate,up,down}_proj.weight <- Drafter.layer.mlp.*
    layers.0.post_attention_layernorm.weight<- Drafter.layer.post_attention_layernorm.weight
  No input_layernorm (both loaders replace it by the identity, as we do), no embed_tokens (shared
  with the target), no lm_head (both loaders take the target's).
- hot_token_ids.pt: the draft vocabulary as target ids (torch.save of a LongTensor), the file
  SGLang's FR-Spec option `--speculative-token-map` reads; SGLang then serves the target's LM-head
  rows of those tokens.
- draft_head.safetensors: our own head and the EAGLE-3 style maps, for tools that want them:
  lm_head.weight (K, E), d2t (K,) with target_id = draft_id + d2t[draft_id], t2d (V,) bool.

Faithfulness, honestly. SGLang (EAGLE, with the token map) reproduces this drafter exactly when
its head is the target's rows (warm-up with a frozen head); a trained head is not used there.
vLLM's EAGLE-1 class drafts with the target's full LM head, so its proposals range over the whole
vocabulary (same layer, same hidden-state prediction). The tests run neither engine (they need
a GPU): the layout follows their loader source (sglang/srt/models/llama_eagle.py, vllm
model_executor/models/llama_eagle.py). `load_exported` reads the checkpoint back into a Drafter,
which the tests use to check the export reproduces the drafter's outputs.

Knows: the drafter's parameters and the EAGLE-1 file layout. Does not know: training, engines.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailrl.model import Transformer
from tailrl.speculative.drafter.model import WEIGHTS_FILE, Drafter, DrafterConfig, DrafterError, check_target, read_drafter_config

ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
_LAYER = "layers.0."


def eagle_config(cfg: DrafterConfig) -> dict:
    """The HF-style config.json of the exported checkpoint."""
    c = cfg.layer
    if c.model_type not in ARCHITECTURES:
        raise DrafterError(f"no EAGLE-1 serving class for {c.model_type} layers (supported: {', '.join(ARCHITECTURES)})")
    rope = dict(c.rope_scaling) if c.rope_scaling else None
    return {
        "architectures": [ARCHITECTURES[c.model_type]],
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "attention_bias": c.attention_bias,
        "tie_word_embeddings": False,
        "eos_token_id": list(c.eos_token_ids),
        "torch_dtype": "bfloat16",
        "tailrl": {
            "target_name": cfg.target_name,
            "version": cfg.version,
            "fingerprint": list(cfg.fingerprint),
            "token_map": "hot_token_ids.pt",
            "head": "draft_head.safetensors",
        },
    }


def export(drafter_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the EAGLE-1 checkpoint of the drafter in drafter_dir (see the module doc)."""
    drafter_dir, out = Path(drafter_dir), Path(out_dir)
    cfg = read_drafter_config(drafter_dir)
    config = eagle_config(cfg)
    try:
        state = load_file(drafter_dir / WEIGHTS_FILE)
    except Exception as e:  # safetensors raises several types for missing/corrupt files
        raise DrafterError(f"cannot read drafter weights {drafter_dir / WEIGHTS_FILE}: {e}") from None
    weights = {"fc.weight": state["fc.weight"], "fc.bias": torch.zeros(cfg.hidden_size)}
    for name, w in state.items():
        if name.startswith("layer."):
            weights[_LAYER + name.removeprefix("layer.")] = w
    d2t = torch.tensor(cfg.draft_vocab, dtype=torch.long)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata=meta)
    head = {"lm_head.weight": state["head.weight"].to(dtype).contiguous(), "d2t": d2t - torch.arange(len(d2t))}
    head["t2d"] = t2d
    save_file(head, out / "draft_head.safetensors", metadata=meta)
    torch.save(d2t, out / "hot_token_ids.pt")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def load_exported(path: str | Path, target: Transformer) -> Drafter:
    """Read an exported checkpoint back into a Drafter for `target` (the inverse of `export`)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights = load_file(path / "model.safetensors")
    head = load_file(path / "draft_head.safetensors")
    d2t = head["d2t"] + torch.arange(head["d2t"].shape[0])
    layer_cfg = dataclasses.replace(target.cfg, num_layers=1)
    meta = config["tailrl"]
    vocab, fingerprint = tuple(d2t.tolist()), tuple(meta["fingerprint"])
    cfg = DrafterConfig(meta["target_name"], layer_cfg, vocab, fingerprint, meta["version"])
    check_target(cfg, target)
    if bool(weights["fc.bias"].any()):
        raise DrafterError(f"{path}: fc.bias is not zero; tailrl drafters have no fc bias")
    state = {"fc.weight": weights["fc.weight"], "head.weight": head["lm_head.weight"]}
    state.update({"layer." + k.removeprefix(_LAYER): v for k, v in weights.items() if k.startswith(_LAYER)})
    net = Drafter(cfg, target.model.embed_tokens.weight.detach())
    net.load_state_dict(state, strict=True)
    w = target.lm_head.weight
    return net.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
