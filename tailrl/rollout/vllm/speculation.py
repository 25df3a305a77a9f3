"""Speculation inside the vLLM engine: the learned drafter's pieces and the tuner's draft lengths.

- The learned drafter (tailrl's drafter files): written as the EAGLE-1 export vLLM loads
  (`write_learned_drafter`), drafting with its own draft-vocabulary head (`DraftVocabHead`,
  `install_draft_head`), each new version written into the running engine in place
  (`load_drafter_in_place`). The functions taking a worker run on the engine's worker, through
  LLMEngine.collective_rpc.
- `Schedule`: each engine step's draft length, chosen by tailrl's tuner; `Steering`: a generate
  call's steps steered by it and counted, the same way whoever runs the step loop (the vLLM
  rollout's own, tailrl.rollout.vllm.rollout; TRL's LLM.generate, tailrl.trl.steps).

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
from tailrl.rollout.protocol import DrafterVersionError
from tailrl.rollout.vllm import internals
from tailrl.rollout.vllm.outputs import StepCount, StepCounters
from tailrl.speculative.drafter.export import eagle_weights, write_eagle
from tailrl.speculative.drafter.model import DrafterConfig, check_target, read_drafter_config, read_drafter_weights
from tailrl.speculative.watch import Tallies, Tally
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


def load_drafter_version(engine: LLMEngine, version: int, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """A learned drafter version's weights (tailrl's names, fp32), cast to `dtype`, into the
    engine's EAGLE drafter in place (its fc, layer and draft head); DrafterVersionError for
    weights that do not fit its shapes."""
    try:
        eagle = {k: v.to(dtype) for k, v in eagle_weights(weights, "vllm").items()}
        engine.collective_rpc(load_drafter_in_place, args=(eagle, weights["head.weight"].to(dtype)))
    except (KeyError, ValueError, RuntimeError) as e:  # a missing or misshapen tensor
        raise DrafterVersionError(f"drafter version {version} cannot be loaded into the vLLM engine: "
                                  f"{type(e).__name__}: {' '.join(str(e).split())}") from None


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
    running batch size (`lookup`, internals.draft_length_lookup); before every step the whole
    lookup is set to the chosen arm's length (0 = plain). The drafts a step proposes are verified
    in the next step, so a step's time is the verify of the arm before it plus the drafting of the
    arm chosen for it. Only a step that drafts with the arm it verifies is an arm's own cost: its
    reward (tokens per second per sequence) goes to that arm. A step between two arms (a switch)
    tells the tuner nothing, and the step after a switch keeps the new arm so that it is measured.
    (Rewarding every step to the arm it verified charged a plain step that followed a drafting
    one, or preceded one, with a 6-token draft: the tuner saw plain steps at a third of their
    speed and kept drafting where plain decoding was faster; docs/vllm.md.)"""

    def __init__(self, lookup: list[int], lengths: Sequence[int], cfg: TunerConfig, state: dict[str, object] | None,
                 seed: int):
        self.lookup = lookup
        self.arms = {PLAIN: 0, **{Arm("drafter", k, 1, k): k for k in lengths}}
        self.tuner = Tuner(list(self.arms), cfg, seed=seed)
        if state:
            self.tuner.load_state_dict(state)
        self.proposed = PLAIN  # the arm whose drafts the next step verifies
        self._switched = False  # the last step drafted with another arm than it verified

    def new_rollout(self) -> None:
        self.tuner.new_rollout()
        self.proposed = PLAIN
        self._switched = False

    def before_step(self, running: int) -> tuple[Arm, bool]:
        """Set the lookup for the step about to run. Returns the arm its verifies belong to, and
        whether the step's time is that arm's own (it drafts with the same arm)."""
        verified = self.proposed
        if not running:
            self.proposed = PLAIN
        elif self._switched:  # keep the arm just switched to for one step: the gate still counts it
            self.proposed = verified if self.tuner.gate(running) else PLAIN
        else:
            self.proposed = self.tuner.step(running)
        self._switched = self.proposed != verified
        self.lookup[:] = [self.arms[self.proposed]] * len(self.lookup)
        return verified, not self._switched

    def after_step(self, batch: int, arm: Arm, tokens: int, seconds: float) -> None:
        if batch and seconds > 0:
            self.tuner.update(batch, arm, tokens / seconds / batch)


class Steering:
    """A generate call's engine steps, steered and counted: before each, the schedule sets its
    draft length (None: a fixed one); after it, the step's counters (`counters`, the engine's
    stat logger) are taken, its verifies and those that accepted the first draft token added to
    `tallies` under the arm that drafted them (the drafter's rollback watch), and the tuner told
    what a decode step cost (tokens per second per running sequence). `arm` labels a step that
    verified drafts with no schedule."""

    def __init__(self, schedule: Schedule | None, arm: str, counters: StepCounters):
        self.schedule, self.arm, self.counters = schedule, arm, counters
        self.tallies: Tallies = {}
        self._verified: Arm | None = None
        self._measured = False  # the step's time is its verified arm's own (Schedule.before_step)

    def begin(self) -> None:
        """A generate call starts: its tallies and counters from zero, the tuner's rollout anew."""
        self.tallies = {}
        self.counters.take()
        if self.schedule is not None:
            self.schedule.new_rollout()

    def before(self, running: int) -> None:
        """The step about to run, with `running` requests unfinished."""
        self._verified, self._measured = (self.schedule.before_step(running) if self.schedule is not None
                                          else (None, False))

    def after(self, seconds: float, batch: int | None = None, tokens: int | None = None,
              prefill: bool | None = None) -> tuple[str, StepCount]:
        """The step that ran, in `seconds`: its running `batch`, the `tokens` it emitted and
        whether it computed a prompt (each None: as vLLM counted them). Its arm's label and
        counters."""
        count = self.counters.take()
        label = self._verified.label if self._verified is not None else self.arm
        for spec in count.spec:
            first = spec.num_accepted_tokens_per_pos[0] if spec.num_accepted_tokens_per_pos else 0
            self.tallies.setdefault(label, Tally()).add(spec.num_drafts, first)
        batch = count.running if batch is None else batch
        tokens = count.tokens if tokens is None else tokens
        prefill = count.prompt_tokens > 0 if prefill is None else prefill
        if self._verified is not None and self._measured and not prefill and tokens:
            self.schedule.after_step(batch, self._verified, tokens, seconds)
        return label, count
