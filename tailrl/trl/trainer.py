"""`TLTGRPOTrainer`: TRL's GRPOTrainer with TLT in its colocated vLLM engine.

    from tailrl.trl import TLTConfig, TLTGRPOTrainer
    trainer = TLTGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True,
                             vllm_mode="colocate", ...), tlt=TLTConfig(drafter="drafters/cold"))
    trainer.train()

Everything else is TRL's. What changes (docs/trl.md): the engine drafts with the learned drafter
(tailrl.trl.generation), the weights reach vLLM by its layerwise reload, the drafter trains on
the final-norm hidden states of TRL's own loss forward (tailrl.trl.policy: no second forward) for
`drafter_min_steps` micro-steps at each weight sync (the bounded cost per step), and TRL's logged
metrics gain `tlt/accept_len`, `tlt/drafter_version`, `tlt/drafter_micro_steps` and `tlt/generate_s`.

Knows: where GRPOTrainer builds its engine, runs its loss forward and keeps its metrics (trl 1.16).
Does not know: vLLM, the drafter's training.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from trl import GRPOTrainer

from tailrl.trl import internals
from tailrl.trl.generation import TLTConfig, TLTGeneration
from tailrl.trl.policy import HiddenCapture, policy_forwards


class TLTGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with TLT (module doc); `tlt` says which drafter and how it drafts."""

    def __init__(self, *args, tlt: TLTConfig, **kwargs):
        internals.check_supported()
        with internals.replaced(internals.GENERATION_CLASS, functools.partial(TLTGeneration, tlt=tlt)):
            super().__init__(*args, **kwargs)
        if not self.use_vllm:
            raise ValueError("TLT for TRL drafts inside TRL's vLLM engine: set use_vllm=True, vllm_mode='colocate'")
        self.vllm_generation: TLTGeneration
        self._capture = HiddenCapture(self.accelerator.unwrap_model(self.model))

    def _compute_loss(self, model, inputs):
        if self.vllm_generation.adapt is None:  # spec "off": no drafter to feed
            return super()._compute_loss(model, inputs)
        with self._capture.capturing() as chunks:
            loss = super()._compute_loss(model, inputs)
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        ids = torch.cat([prompt_ids, inputs["completion_ids"]], dim=1)
        mask = torch.cat([prompt_mask, inputs["completion_mask"]], dim=1)
        self.vllm_generation.observe(policy_forwards(chunks, ids, mask, prompt_mask))
        return loss

    def _generate_single_turn(self, *args, **kwargs):
        out = super()._generate_single_turn(*args, **kwargs)
        gen, metrics = self.vllm_generation, self._metrics["train" if self.model.training else "eval"]
        if gen.stats.accept_len is not None:
            metrics["tlt/accept_len"].append(gen.stats.accept_len)
        metrics["tlt/drafter_version"].append(float(gen.stats.drafter_version))
        metrics["tlt/generate_s"].append(gen.stats.seconds)
        if gen.last_adapt is not None:
            metrics["tlt/drafter_micro_steps"].append(float(gen.last_adapt.micro_steps))
        return out

    def save_drafter(self, path: str | Path) -> Path:
        """The adapted drafter (the version the engine drafts with) as tailrl drafter files, for
        `vllm serve` (tailrl drafter export) or a next run."""
        return self.vllm_generation.save_drafter(Path(path))
