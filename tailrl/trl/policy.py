"""The TRL trainer's policy as tailrl's drafter sees it: its weights and its loss forward's hidden states.

tailrl's drafter learner reads a tailrl Transformer (its embedding, LM head and config) and
trains on final-norm hidden states. TRL trains a transformers model, so `policy_view` is a
Transformer on that model's own tensors (shared, not copied: the optimizer's in-place updates
are what it reads), and `HiddenCapture` keeps the final norm's outputs of the forwards TRL's loss
runs (no second forward), cut into one PolicyForward per sequence of the batch.

A LoRA-wrapped model (tailrl.trl.lora): the view is on the base model's tensors, whose
embedding and LM head are the policy's (LoRA on them is refused) while its adapted layers hold
the weights without the adapters, so the view is for the drafter's reading, not for forwards;
the hidden states are the base model's final norm's under the adapters, as the loss computes them.

Knows: transformers' parameter names (they are tailrl's), TRL's batch layout (left-padded
prompts, right-padded completions, one attention mask). Does not know: vLLM, the drafter's training.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from tailrl.model import ModelConfig, Transformer
from tailrl.rollout.protocol import PolicyForward
from tailrl.trl.internals import final_norm
from tailrl.trl.lora import base_model, base_state, is_peft


def policy_view(model: nn.Module) -> Transformer:
    """A Transformer whose tensors are `model`'s (a transformers causal LM of a family tailrl runs,
    or a LoRA wrapper of one: its base model's, module doc)."""
    cfg = ModelConfig.from_hf(model.config.to_dict())
    state = base_state(model) if is_peft(model) else {k: v.detach() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        view = Transformer(cfg)
    view.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        view.lm_head.weight = view.model.embed_tokens.weight
    return view.eval().requires_grad_(False)


class HiddenCapture:
    """The final norm's outputs of the forwards run inside `capturing()` (a forward hook that
    keeps nothing outside it: TRL's no-grad forwards of the same model, for old and reference
    log-probs, and a gradient checkpoint's recomputation are left alone). On a LoRA wrapper the
    hook is on its base model's final norm, whose input the adapted layers computed."""

    def __init__(self, model: nn.Module):
        self._chunks: list[torch.Tensor] | None = None
        final_norm(base_model(model)).register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if self._chunks is not None:
            self._chunks.append(output.detach())

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[torch.Tensor]]:
        """The forwards' outputs, one (rows, T, E) chunk per forward, in order."""
        self._chunks = chunks = []
        try:
            yield chunks
        finally:
            self._chunks = None


def policy_forwards(chunks: list[torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_mask: torch.Tensor) -> list[PolicyForward]:
    """One PolicyForward per row of a TRL batch: the row's tokens under its attention mask
    (prompt, then completion) and the hidden states at all of them but the last."""
    hidden = torch.cat(chunks)  # (B, T, E)
    if hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"captured hidden states {tuple(hidden.shape)} do not match the batch "
                         f"{tuple(input_ids.shape)}")
    out = []
    for ids, mask, h, prompt in zip(input_ids, attention_mask.bool(), hidden, prompt_mask.sum(1).tolist()):
        tokens = ids[mask]
        out.append(PolicyForward(tokens.cpu(), h[mask][:-1].float().cpu(), int(prompt)))
    return out
