"""What both engines' Ray actors need: Ray itself (an optional dependency, imported only here
and by the modules that start actors), weights through the object store, a model built from
them in the actor, and Ray's errors in one line.

Weights travel as numpy arrays, put once into Ray's object store and read in place by actors on
the same node, so a remote node needs no copy of the model directory.

Knows: Ray's start, its errors, numpy's dtypes. Does not know: engines, rollouts.
"""

from __future__ import annotations

import numpy as np
import torch

from tailrl.model import ModelConfig, Transformer

try:
    import ray
except ImportError:  # pragma: no cover - start() says what to install
    ray = None


def start(address: str | None) -> bool:
    """Ray running in this process (joining `address`, or a local one); whether this call
    started it (its caller then shuts it down). ValueError without the ray package."""
    if ray is None:
        raise ValueError("Ray actors need the ray package: pip install 'tailrl[ray]'")
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    return True


def stop(actors: list, owns_ray: bool) -> None:
    """Kill `actors` (their processes end, their memory with them) and shut Ray down if this
    process started it (start() said so)."""
    for actor in actors:
        ray.kill(actor)
    if owns_ray:
        ray.shutdown()


def to_numpy(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """numpy has no bf16: such tensors travel as their int16 bit patterns."""
    return {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy() for k, v in weights.items()}


def from_numpy(arrays: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for k, a in arrays.items():
        t = torch.from_numpy(np.array(a))  # a copy: object-store arrays are read-only
        out[k] = t.view(torch.bfloat16) if dtype == torch.bfloat16 and t.dtype == torch.int16 else t
    return out


def build_model(cfg: ModelConfig, dtype: torch.dtype, weights: dict[str, np.ndarray]) -> Transformer:
    """The model `weights` (its parameters by name, a tied head left out) describe, for decoding."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(from_numpy(weights, dtype), strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def first_line(e: BaseException) -> str:
    """The line of a Ray error that says what went wrong (its last non-empty one)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
