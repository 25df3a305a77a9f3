"""Speculation inside the vLLM engine: the learned drafter's pieces and the tuner's draft lengths.

- The learned drafter (tailrl's drafter files): written as the EAGLE-1 export vLLM loads
  (`write_learned_drafter`), drafting with its own draft-vocabulary head (`DraftVocabHead`,
  `install_draft_head`), each new version written into the running engine in place
  (`load_drafter_in_place`). The functions taking a worker run on the engine's worker, through
  LLMEngine.collective_rpc.
- `Schedule`: each engine step's draft length, chosen by tailrl's tuner.

Knows: tailrl's drafter files and tuner, what the draft head computes. Does not know: vLLM's
internals (tailrl.rollout.vllm.internals reaches them), the step loop, RL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.worker.worker_base import WorkerBase

from tailrl.model import Transformer
from tailrl.rollout.vllm import internals
from tailrl.speculative.drafter.export import write_eagle
from tailrl.speculative.drafter.model import DrafterConfig, check_target, read_drafter_config, read_drafter_weights
from tailrl.tuner import PLAIN, Arm, Tuner, TunerConfig


class DraftVocabHead(nn.Module):
    """A learned drafter's own head over its draft vocabulary, as the logits of vLLM's EAGLE
    drafter: vLLM's EAGLE-1 class drafts with the target's whole LM head (its EAGLE-3 class has a
    draft vocabulary, but not this architecture), which on a 135M model with a 49k vocabulary
    costs a quarter of a target forward per draft token. The drafter's own head (K rows, the
    draft vocabulary `vocab` as target ids) costs a twelfth of that and drafts what the native
    engine's drafter drafts. Logits outside the draft vocabulary are -inf, so a greedy draft is
    the draft head's argmax and a sampled one never leaves the draft vocabulary (lossless either
    way: the verifier takes q from these logits)."""

    def __init__(self, weight: torch.Tensor, vocab: torch.Tensor, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (K, E)
        self.register_buffer("vocab", vocab)  # (K,) target ids
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, E) -> (N, V)"""
        out = hidden.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.vocab, F.linear(hidden, self.weight))


def install_draft_head(worker: WorkerBase, weight: torch.Tensor, vocab: torch.Tensor) -> None:
    """On the engine's worker: the drafter model's logits from a DraftVocabHead."""
    internals.set_drafter_logits(worker, DraftVocabHead(weight, vocab, internals.drafter_vocab_size(worker)))


def load_drafter_in_place(worker: WorkerBase, weights: dict[str, torch.Tensor], head: torch.Tensor) -> None:
    """On the engine's worker: the EAGLE drafter's own weights (fc and its layer) and its draft
    head's replaced in place; the embedding it shares with the target stays."""
    internals.reload_weights(worker, weights, drafter=True)
    internals.drafter_logits(worker).weight.copy_(head)


def write_learned_drafter(drafter: Path, model: Transformer, dtype: torch.dtype,
                         out: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A tailrl drafter for `model` as the EAGLE-1 export vLLM loads, written into `out`; its
    config and weights."""
    cfg = read_drafter_config(drafter)
    check_target(cfg, model)
    state = read_drafter_weights(drafter)
    out.mkdir()
    write_eagle(out, cfg, state, "vllm", dtype)
    return cfg, state


class Schedule:
    """Each engine step's draft length, chosen by tailrl's tuner (TLT's adaptive engine).

    vLLM's scheduler drafts K(batch) tokens per sequence in a step, read from a dense lookup by
    running batch size (internals.draft_length_lookup); before every step the whole lookup is
    set to the chosen arm's length (0 = plain). The drafts a step proposes are verified in the
    next step, so a step's reward (tokens per second per sequence) goes to the arm chosen before
    the step that proposed them (PLAIN when the step verified none)."""

    def __init__(self, engine: LLMEngine, lengths: Sequence[int], cfg: TunerConfig, state: dict[str, object] | None,
                 seed: int):
        self.lookup = internals.draft_length_lookup(engine)
        self.arms = {PLAIN: 0, **{Arm("drafter", k, 1, k): k for k in lengths}}
        self.tuner = Tuner(list(self.arms), cfg, seed=seed)
        if state:
            self.tuner.load_state_dict(state)
        self.proposed = PLAIN  # the arm whose drafts the next step verifies

    def new_rollout(self) -> None:
        self.tuner.new_rollout()
        self.proposed = PLAIN

    def before_step(self, running: int) -> Arm:
        """Set the lookup for the step about to run; returns the arm its verifies belong to."""
        verified, self.proposed = self.proposed, self.tuner.step(running) if running else PLAIN
        self.lookup[:] = [self.arms[self.proposed]] * len(self.lookup)
        return verified

    def after_step(self, batch: int, arm: Arm, tokens: int, seconds: float) -> None:
        if batch and seconds > 0:
            self.tuner.update(batch, arm, tokens / seconds / batch)
