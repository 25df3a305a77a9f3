"""The run's memory budget: the update's micro-batches sized to fit it, checked before the run starts.

A step holds, whatever the update's settings, the loaded models, AdamW's two moments and the
rollout's KV caches and model copies (`fixed`, GiB); the update holds the finished groups'
gradient buffers waiting to be added, the gradient sum among them (at most `waiting_gradients`,
tailrl.rl.update), and the one group it computes at a time (tailrl.rl.update.BackgroundUpdate):
that group's gradient buffer and what its largest micro-batch keeps for the backward
(`computing_group_gb`; a group next in the summing order adds into the sum and holds no buffer
of its own, so for it the estimate is one buffer high). What is left of the budget after the
fixed part and the waiting buffers sizes:

- `checkpoint_tokens`: the most tokens a micro-batch may keep every layer's activations for; a
  longer one is checkpointed (tailrl.rl.packing: its layers' inputs only, ~1.3x the compute);
- `micro_batch_tokens`: the most tokens even a checkpointed micro-batch may hold;
- `waiting_gradients`, last, and only where a checkpointed response would not fit otherwise
  (down to 1, the gradient sum alone: groups are then computed in the summing order only).

Each only ever lowers what the config asks for, so a budget that holds the config's settings
changes nothing, and a resumed run, whose config holds the settings it was sized to, keeps them.
A budget that cannot hold one response at max_new_tokens in a checkpointed micro-batch beside
the gradient sum stops the run before it starts (ValueError, one line, naming the budget it
needs). Kept tensors are counted
from shapes (tailrl.rl.floor) times SLACK, the allocator's and autograd's transients on top of
them, as measured (docs/memory.md): an estimate, not a floor.

Knows: model shapes, the update's settings and concurrency. Does not know: what the rollout
holds beyond what it reports (RolloutConfig.memory), how the machine's memory is read
(tailrl.memory).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tailrl.model import ModelConfig
from tailrl.rl.floor import kept_bytes_per_token, logits_bytes
from tailrl.rl.grpo import GRPOConfig

# What the allocator and autograd's transients add to the tensors a micro-batch keeps for its
# backward: measured 1.14-1.22x in fp32 at 505-1,985 tokens (docs/memory.md), rounded up.
SLACK = 1.25
# The interpreter, torch's libraries and the tokenizer: ~0.45 GiB resident before any model.
RUNTIME_GB = 0.5
# Default budget: this share of the machine's memory (the rest: the OS, the user's other work).
MACHINE_SHARE = 0.5


@dataclass(frozen=True)
class Budget:
    """GiB a run may hold, what the parts beyond the update take, and what is left for the group
    being computed."""

    gb: float
    fixed: dict[str, float]  # by part: models, optimizer, rollout, runtime

    def computing_gb(self, waiting_gb: float = 0.0) -> float:
        """What the group being computed may hold: the budget left after the fixed parts and the
        gradient buffers waiting (waiting_gb)."""
        return self.gb - sum(self.fixed.values()) - waiting_gb


def default_budget_gb(machine_gb: float | None) -> float | None:
    """The budget a run takes when the user names none: a share of the machine's memory."""
    return None if machine_gb is None else MACHINE_SHARE * machine_gb


def computing_group_gb(m: ModelConfig, weights_gb: float, tokens: int, checkpointed: bool, bf16: bool,
                       logprob_chunk: int) -> float:
    """The group being computed, GiB: its gradient buffer (the size of the trainable weights) and
    a micro-batch of `tokens` tokens' kept tensors, times SLACK."""
    kept = tokens * kept_bytes_per_token(m, bf16, checkpointed) + logits_bytes(m, bf16, min(tokens, logprob_chunk))
    return weights_gb + SLACK * kept / 2**30


def _most_tokens(m: ModelConfig, weights_gb: float, room_gb: float, checkpointed: bool, bf16: bool,
                 logprob_chunk: int) -> int:
    """The most tokens a micro-batch may hold within room_gb (0 where none fit)."""

    def fits(tokens: int) -> bool:
        return computing_group_gb(m, weights_gb, tokens, checkpointed, bf16, logprob_chunk) <= room_gb

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # the estimate grows with tokens: bisect for the last that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def size_update(cfg: GRPOConfig, budget: Budget, m: ModelConfig, weights_gb: float, bf16: bool,
                longest_response: int) -> GRPOConfig:
    """cfg with checkpoint_tokens, micro_batch_tokens and (last) waiting_gradients lowered to what
    `budget` holds; ValueError where even one response of `longest_response` tokens (its prompt
    included) in a checkpointed micro-batch does not fit beside the gradient sum alone."""
    waiting = cfg.waiting_gradients
    while True:
        room = budget.computing_gb(waiting * weights_gb)
        checkpointed = _most_tokens(m, weights_gb, room, True, bf16, cfg.logprob_chunk)
        if checkpointed >= longest_response or waiting <= 1:
            break
        waiting -= 1
    if checkpointed < longest_response:
        need = (sum(budget.fixed.values()) + waiting * weights_gb + computing_group_gb(
            m, weights_gb, longest_response, True, bf16, cfg.logprob_chunk))
        fixed = ", ".join(f"{k} {v:.1f}" for k, v in budget.fixed.items())
        raise ValueError(
            f"a memory budget of {budget.gb:.1f} GiB cannot hold this run: it needs at least {need:.1f} GiB "
            f"({fixed}, the gradient sum {waiting * weights_gb:.1f}, "
            f"and the group being computed with a checkpointed response of {longest_response} tokens); "
            f"raise --memory-gb or lower --max-new-tokens, --kv-budget-gb")
    whole = _most_tokens(m, weights_gb, room, False, bf16, cfg.logprob_chunk)
    return dataclasses.replace(cfg, checkpoint_tokens=max(1, min(cfg.checkpoint_tokens, whole)),
                               micro_batch_tokens=min(cfg.micro_batch_tokens, checkpointed),
                               waiting_gradients=waiting)
