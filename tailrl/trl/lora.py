"""A LoRA-wrapped policy (PEFT) as the engine and the drafter see it: merged weights, the base model.

TRL trains a PEFT model's adapters; the engine decodes one set of weights. `merged_weights`
computes each adapted linear layer's weight with its active adapters' deltas added (W + B A *
scaling, PEFT's merge) into new tensors, and leaves the model unmerged: the adapters go on
training, and the base weights stay bit for bit what they were (a merge in place followed by an
unmerge, TRL's own sync, rounds them each time, and hands the engine tensors that the unmerge
changes again). `base_model` is the transformers model under the wrapper, LoRA's layers inside
it: its final norm's output is the wrapped model's LM-head input, the hidden state the drafter
trains on. `base_state` is that model's tensors under transformers' names, the adapters' factors
left out: the embedding and LM head the drafter reads.

Supported: plain LoRA (`peft.LoraConfig`, rsLoRA and fan_in_fan_out included) on linear layers
other than the LM head, unmerged. Anything else the merge or the drafter would get wrong is a
ValueError in one line: LoRA's variants (DoRA and others), a LoRA bias, adapters on the
embedding or the LM head (the drafter reads both), `modules_to_save` or trainable tokens, and
PEFT's other methods.

Knows: PEFT's LoRA layers (peft 0.21). Does not know: TRL, vLLM, the drafter.
"""

from __future__ import annotations

import torch
from torch import nn

_HEAD_AND_EMBEDDING = ("lm_head", "model.embed_tokens")


def is_peft(model: nn.Module) -> bool:
    """Whether `model` is a PEFT wrapper (peft need not be installed when it is not)."""
    from accelerate.utils import is_peft_model

    return is_peft_model(model)


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper, or `model` itself."""
    return model.get_base_model() if is_peft(model) else model


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """A PEFT model's adapted layers by their names in the base model; ValueError for a wrapper
    whose weights `merged_weights` or whose embedding and head `base_state` would get wrong."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper

    for name, cfg in model.peft_config.items():
        if not isinstance(cfg, LoraConfig):
            raise ValueError(f"TLT for TRL supports LoRA adapters; adapter {name!r} is {type(cfg).__name__}")
    layers = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            raise ValueError(f"TLT for TRL merges LoRA adapters only; {name} is trained whole "
                             "(modules_to_save or trainable tokens)")
        if not isinstance(module, BaseTunerLayer):
            continue
        if not isinstance(module, Linear) or name in _HEAD_AND_EMBEDDING:
            raise ValueError(f"TLT for TRL supports LoRA on linear layers other than the LM head (the drafter "
                             f"reads the head and the embedding); {name} is a {type(module).__name__}")
        if module.merged:
            raise ValueError(f"{name} has merged adapters: unmerge them (model.unmerge_adapter())")
        for adapter in module.active_adapters:
            if adapter in module.lora_variant or module.lora_bias.get(adapter):
                raise ValueError(f"TLT for TRL merges plain LoRA; adapter {adapter!r} of {name} is a variant "
                                 "(DoRA or another) or has a bias")
        layers[name] = module
    return layers


def _base_names(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors of a base model under LoRA by transformers' names: each adapted layer's own
    (`x.base_layer.weight` as `x.weight`), the adapters' factors (`x.lora_A...`) left out."""
    return {name.replace(".base_layer.", "."): t.detach() for name, t in named.items() if ".lora_" not in name}


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A PEFT model's base state dict under transformers' names (its tensors, shared)."""
    lora_layers(model)
    return _base_names(model.get_base_model().state_dict())


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights a PEFT model's forward computes with, under transformers' parameter names:
    each adapted layer's weight with its active adapters' deltas added, in new tensors (module doc)."""
    layers = lora_layers(model)
    weights = _base_names(dict(model.get_base_model().named_parameters()))
    for name, layer in layers.items():
        if layer.disable_adapters:
            continue
        merged = layer.get_base_layer().weight.detach().clone()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                merged += layer.get_delta_weight(adapter).to(merged.dtype)
        weights[f"{name}.weight"] = merged
    return weights
