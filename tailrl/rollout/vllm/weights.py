"""The policy as vLLM reads it: a model directory written from the Transformer, and its weights.

vLLM opens a model from a directory (config.json + safetensors). The rollout is handed a
Transformer, not a directory, so it writes one: config.json from the Transformer's own
ModelConfig (`hf_config`; the fields tailrl's forward reads are exactly those written, so vLLM
runs the architecture tailrl computes, whatever else the original config.json held) and the
weights in the rollout's dtype. No tokenizer: the engine takes and returns token ids.
`engine_weights` is what `publish` pushes into the live engine afterwards.

Knows: ModelConfig's fields, Hugging Face config keys, state-dict names. Does not know: vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tailrl.model import ModelConfig, Transformer

# vLLM resolves a model class from config.json's `architectures`.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, object]:
    """The config.json describing `cfg` (ModelConfig.from_hf reads it back to `cfg`)."""
    rope: dict[str, object] = dict(cfg.rope_scaling) if cfg.rope_scaling else {"rope_type": "default"}
    rope["rope_theta"] = cfg.rope_theta
    out: dict[str, object] = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",  # tailrl's MLP (model.MLP)
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "eos_token_id": list(cfg.eos_token_ids),
        "dtype": VLLM_DTYPES[dtype],
    }
    if cfg.model_type == "llama":
        out["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "qwen2":
        out["use_sliding_window"] = False  # tailrl attends to the whole context
    return out


def engine_weights(model: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`model`'s state dict in `dtype` under Hugging Face names, a tied head left out (the
    config says it is tied). Tensors already in `dtype` are the model's own, not copies."""
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_model_dir(model: Transformer, dtype: torch.dtype, out: Path) -> None:
    """config.json and model.safetensors for `model` in `dtype`, in the existing directory `out`."""
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, dtype), indent=1))
    weights = {k: v.contiguous().cpu() for k, v in engine_weights(model, dtype).items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
