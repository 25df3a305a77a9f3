"""Every TRL and transformers internal tailrl's TRL integration reaches, in one place.

TRL's GRPOTrainer builds its vLLM engine itself and offers no seam for a speculative config, a
drafter or another weight sync, so TLT reaches two of TRL's module names, each replaced only
while the call that reads it runs (`replaced`):

- `trl.trainer.grpo_trainer.VLLMGeneration`, the class GRPOTrainer.__init__ instantiates: the
  TLT trainer builds its own subclass in its place (`GENERATION_CLASS`);
- `trl.generation.vllm_generation.LLM`, the engine class VLLMGeneration._init_vllm calls: the
  TLT generation adds its speculative settings to TRL's own arguments (`LLM_CLASS`).

They are pinned to the TRL line this was built against (`SUPPORTED`, checked by
`check_supported` before a trainer starts). From transformers, the final norm of a causal LM
(`final_norm`): its output is the hidden state the drafter trains on.

Knows: where those names live. Does not know: vLLM, drafters, RL.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

from torch import nn

SUPPORTED = "trl 1.16"
_VERSIONS = ("1.16.",)
GENERATION_CLASS = ("trl.trainer.grpo_trainer", "VLLMGeneration")
LLM_CLASS = ("trl.generation.vllm_generation", "LLM")


def check_supported() -> None:
    """ValueError, one line, unless the installed TRL is the supported line and has both names."""
    import trl

    if not trl.__version__.startswith(_VERSIONS):
        raise ValueError(f"TRL {trl.__version__} is installed; tailrl's TLT for TRL reaches internals of {SUPPORTED} "
                         "only (pip install 'tailrl[trl]')")
    for module, name in (GENERATION_CLASS, LLM_CLASS):
        if not hasattr(importlib.import_module(module), name):
            raise ValueError(f"TRL {trl.__version__} has no {module}.{name}; supported: {SUPPORTED}")


@contextlib.contextmanager
def replaced(where: tuple[str, str], value: object) -> Iterator[None]:
    """`module.name` is `value` inside the block, and what it was after it."""
    module = importlib.import_module(where[0])
    before = getattr(module, where[1])
    setattr(module, where[1], value)
    try:
        yield
    finally:
        setattr(module, where[1], before)


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm of a Llama, Qwen2 or Qwen3 causal LM of transformers (`model.norm`: its
    output is the LM head's input); ValueError for another model (of a PEFT wrapper, pass its
    base model: tailrl.trl.lora.base_model)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    if not isinstance(model, (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)):
        raise ValueError(f"TLT for TRL supports the Llama, Qwen2 and Qwen3 causal LMs of transformers (or LoRA "
                         f"wrappers of them); got {type(model).__name__}")
    return model.model.norm
