"""`TLTGRPOTrainer`: TRL's GRPOTrainer with TLT in its colocated vLLM engine.

    from tailrl.trl import TLTConfig, TLTGRPOTrainer
    trainer = TLTGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True,
                             vllm_mode="colocate", ...), tlt=TLTConfig(drafter="drafters/cold"))
    trainer.train()

Everything else is TRL's. What changes (docs/trl.md): the engine drafts with the learned drafter
(tailrl.trl.generation), the weights reach vLLM by its layerwise reload, the drafter trains on
the final-norm hidden states of TRL's own loss forward (tailrl.trl.policy: no second forward) for
`drafter_min_steps` micro-steps at the end of each optimizer step (the bounded cost per step),
and TRL's logged metrics gain `tlt/accept_len`, `tlt/drafter_version`, `tlt/drafter_micro_steps`
and `tlt/generate_s`.

Checkpoints: the drafter's step closes with TRL's optimizer step (a callback's on_step_end),
before TRL saves, so the checkpoint TRL writes can hold TLT's state as the next step starts
from it (`TLT_STATE`: the adapting drafter, its learner's optimizer and data, the rollback
watch, the tuner); resuming loads it, as TRL resumes its own optimizer (the hooks TRL's
GRPOTrainer uses for its entropy controller's state).

Several processes (`accelerate launch --num_processes N`): each process's engine drafts with the
version process 0 publishes, trained on the forwards of every process (tailrl.trl.generation);
a checkpoint holds process 0's state in `TLT_STATE` and each other process's tuner beside it.

Knows: where GRPOTrainer builds its engine, runs its loss forward, keeps its metrics and writes
and reads its checkpoints (trl 1.16). Does not know: vLLM, the drafter's training.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from tailrl.trl import internals
from tailrl.trl.generation import TLTConfig, TLTGeneration
from tailrl.trl.policy import HiddenCapture, policy_forwards

TLT_STATE = "tlt_state.pt"  # TLT's state, in each of TRL's checkpoint folders (process 0's)


def tuner_file(process: int) -> str:
    """The checkpoint file of process `process`'s tuner, for a process other than 0."""
    return f"tlt_state_{process}.pt"


class _DrafterStepEnd(TrainerCallback):
    """The adapting drafter's step closes with each optimizer step, before TRL logs and saves."""

    def __init__(self, trainer: TLTGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._end_drafter_step()


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
        self.add_callback(_DrafterStepEnd(self))

    def _compute_loss(self, model, inputs):
        if not self.vllm_generation.drafts:  # spec "off": no drafter to feed
            return super()._compute_loss(model, inputs)
        with self._capture.capturing() as chunks:
            loss = super()._compute_loss(model, inputs)
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        ids = torch.cat([prompt_ids, inputs["completion_ids"]], dim=1)
        mask = torch.cat([prompt_mask, inputs["completion_mask"]], dim=1)
        self.vllm_generation.observe(policy_forwards(chunks, ids, mask, prompt_mask))
        return loss

    def _end_drafter_step(self) -> None:
        """The drafter's step closes on the policy the optimizer step left (its micro-steps logged
        with this step); the next weight sync pushes a new version into the engine."""
        step = self.vllm_generation.end_drafter_step()
        if step is not None:
            self._metrics["train"]["tlt/drafter_micro_steps"].append(float(step.micro_steps))

    def _generate_single_turn(self, *args, **kwargs):
        out = super()._generate_single_turn(*args, **kwargs)
        gen, metrics = self.vllm_generation, self._metrics["train" if self.model.training else "eval"]
        if gen.stats.accept_len is not None:
            metrics["tlt/accept_len"].append(gen.stats.accept_len)
        metrics["tlt/drafter_version"].append(float(gen.stats.drafter_version))
        metrics["tlt/generate_s"].append(gen.stats.seconds)
        return out

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        state = self.vllm_generation.state_dict()
        if state is None:
            return
        # Process 0's state (the adapting drafter and its tuner) where TRL saves; every other
        # process's tuner beside it, as each process's random generators (process_index).
        process = self.accelerator.process_index
        if process == 0 and not self.args.should_save:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / (TLT_STATE if process == 0 else tuner_file(process)))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not self.vllm_generation.drafts:
            return
        path = Path(checkpoint) / TLT_STATE
        if not path.is_file():  # a checkpoint of TRL's own trainer, or of a run without a drafter
            warnings.warn(f"{checkpoint} holds no {TLT_STATE}: the drafter starts again from "
                          f"{self.vllm_generation.tlt.drafter}, the tuner from nothing", stacklevel=2)
            return
        # Every process reads process 0's drafter; a process's own tuner, or process 0's where
        # the checkpoint has none for it (a run saved with fewer processes).
        state = torch.load(path, weights_only=True)
        own = Path(checkpoint) / tuner_file(self.accelerator.process_index)
        if self.accelerator.process_index > 0 and own.is_file():
            state["tuner"] = torch.load(own, weights_only=True)["tuner"]
        self.vllm_generation.load_state_dict(state)

    def save_drafter(self, path: str | Path) -> Path:
        """The adapted drafter (the version the engine drafts with next) as tailrl drafter files,
        for `vllm serve` (tailrl drafter export) or a next run; written by process 0, as TRL's
        save_model, and the path returned on every process."""
        path = Path(path)
        if self.vllm_generation.adapt is not None or not self.vllm_generation.drafts:
            path = self.vllm_generation.save_drafter(path)
        self.accelerator.wait_for_everyone()
        return path
