"""How a rollout decodes: `--spec off | on | auto` turned into the engine's step decoder.

off  -> plain decoding every step (the baseline and the reference path).
on   -> speculate every step with one arm: the learned drafter when `--drafter` is given, else
        the n-gram drafter.
auto -> the tuner picks per step among plain decoding and the available drafter arms, behind
        TLT's switch gate (SD considered once the running batch stays small).

Knows: the three modes, which arms exist, how to build proposers. Does not know: how any
arm drafts or verifies, rewards, training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from tailrl.engine import Engine, PlainDecoder
from tailrl.speculative.decoder import NgramProposer, Proposer, StepObserver, fixed, tuned
from tailrl.speculative.tree import max_tree_nodes
from tailrl.tuner import PLAIN, Arm, Tuner, TunerConfig

SPEC_MODES = ("off", "on", "auto")
# Why exact mode drafts chains only. A chain's verify lays out each node's keys as plain
# decoding does (the prefix, then its ancestors, contiguous); a tree node's ancestors sit among
# masked siblings, and the attention sums over them can round differently, enough to change a
# sampled token (docs/lossless.md).
EXACT_CHAINS = "a tree node's attention reads its ancestors across masked siblings, which rounds differently"
# Shapes the tuner chooses among in auto mode. Chains suit the n-gram drafter (its branches are
# rarely right); long n-gram chains pay on repetitive text. The learned drafter gets chains of
# 2, 4 and 6: on worked solutions at temperature 1 the target's own top-1 is the sampled token
# ~94% of the time, so depth pays, and a chain's verify is the cheapest per proposed token. (A
# wide tree paid on the earlier, high-entropy default; at 33+ running its 16-node verify costs
# more than its extra acceptance, and exact mode cannot use it.) Measurements: docs/performance.md.
NGRAM_ARMS = (Arm("ngram", 2, 1, 2), Arm("ngram", 4, 1, 4), Arm("ngram", 8, 1, 8))
DRAFTER_ARMS = (Arm("drafter", 2, 1, 2), Arm("drafter", 4, 1, 4), Arm("drafter", 6, 1, 6))


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding of rollouts."""

    spec: str = field(default="off", metadata={
        "help": "speculative decoding: off, on (every step) or auto (tuned)", "choices": SPEC_MODES})
    drafter: str | None = field(default=None, metadata={
        "help": "learned drafter directory (default: n-gram drafter only)"})
    draft_depth: int = field(default=6, metadata={"help": "--spec on: draft depth"})
    topk: int = field(default=1, metadata={
        "help": "--spec on: children expanded per draft node (1 with --exact: chains)"})
    num_draft_tokens: int = field(default=6, metadata={"help": "--spec on: draft nodes verified per step"})

    def __post_init__(self) -> None:
        if self.spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {', '.join(SPEC_MODES)}, got {self.spec!r}")
        if min(self.draft_depth, self.topk, self.num_draft_tokens) < 1:
            raise ValueError("draft_depth, topk and num_draft_tokens must be >= 1")
        if self.num_draft_tokens > max_tree_nodes(self.draft_depth, self.topk):
            raise ValueError(
                f"num_draft_tokens {self.num_draft_tokens} is more than a tree of depth {self.draft_depth} "
                f"and top-{self.topk} expansions can hold"
            )

    @property
    def arm(self) -> Arm:
        return Arm("drafter" if self.drafter else "ngram", self.draft_depth, self.topk, self.num_draft_tokens)


@dataclass(frozen=True)
class RolloutSpeculationConfig(SpeculationConfig):
    """Speculative decoding of RL rollouts: adaptive by default, as in TLT."""

    spec: str = field(default="auto", metadata={
        "help": "speculative decoding: auto (tuned, default), off (baseline) or on (every step)",
        "choices": SPEC_MODES})


def proposers(cfg: SpeculationConfig, engine: Engine) -> dict[str, Proposer]:
    """The n-gram proposer always; the learned one when a drafter directory is given."""
    out: dict[str, Proposer] = {"ngram": NgramProposer()}
    if cfg.drafter:
        from tailrl.speculative.drafter.model import DrafterProposer, load_drafter

        out["drafter"] = DrafterProposer(load_drafter(cfg.drafter, engine.model))
    return out


def install(engine: Engine, cfg: SpeculationConfig, tuner_cfg: TunerConfig | None = None, seed: int = 0,
            tuner_state: dict[str, Any] | None = None, observers: Sequence[StepObserver] = ()) -> Tuner | None:
    """Set the engine's step decoder for the mode; returns the tuner in auto mode (its state is
    the caller's to checkpoint), else None. `observers` see every step of a speculative mode."""
    if cfg.spec == "off":
        engine.decoder = PlainDecoder()
        return None
    if cfg.spec == "on" and engine.cfg.exact and cfg.topk > 1:
        raise ValueError(f"exact mode speculates with chains only (--topk 1), got --topk {cfg.topk}: {EXACT_CHAINS}")
    props = proposers(cfg, engine)
    if cfg.spec == "on":
        engine.decoder = fixed(cfg.arm, props[cfg.arm.kind], observers)
        return None
    arms = [PLAIN, *NGRAM_ARMS, *(DRAFTER_ARMS if "drafter" in props else ())]  # chains: exact mode's too
    tuner = Tuner(arms, tuner_cfg or TunerConfig(), seed=seed)
    if tuner_state is not None:
        tuner.load_state_dict(tuner_state)
    engine.decoder = tuned(tuner, props, observers)
    return tuner
