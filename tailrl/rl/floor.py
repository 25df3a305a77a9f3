"""What an RL step holds at the run's limits, checked against the machine before the run starts.

Counted from shapes, beyond the models the trainer has loaded: AdamW's two moments and two
gradient-sized buffers (the policy's .grad and a group's share, tailrl.rl.update); the rollout's
KV caches and engine copies of the model (RolloutConfig.memory) for a step's sequences at
prompt + max_new_tokens; and the update's largest micro-batch with every response at
max_new_tokens: the tensors autograd keeps per layer and token (a checkpointed micro-batch keeps
a layer's input only, tailrl.rl.packing) and the logits of one log-prob chunk. The allocator's
slack and autograd's transients come on top (the activations measured about 2x this count,
docs/memory.md), so this is a floor: a run that passes may still not fit, a run that fails
cannot, and fails here in one line instead of in the kernel's OOM killer minutes later.

Knows: model shapes, the update's settings. Does not know: how an engine decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailrl.memory import parameters_gb
from tailrl.model import ModelConfig, Transformer
from tailrl.rl.grpo import GRPOConfig
from tailrl.rollout.protocol import HeldMemory


@dataclass(frozen=True)
class Floor:
    """GiB per part of a step, with the settings that change each."""

    parts: dict[str, HeldMemory]

    @property
    def gb(self) -> float:
        return sum(h.gb for h in self.parts.values())

    def check(self, available_gb: float | None, max_new_tokens: int) -> None:
        """ValueError naming the largest parts where the floor passes what is available."""
        if available_gb is None or self.gb <= available_gb:
            return
        parts = sorted(self.parts.items(), key=lambda kv: -kv[1].gb)
        raise ValueError(
            f"a step with responses of max_new_tokens={max_new_tokens} needs at least {self.gb:.1f} GiB more than "
            f"this process holds, and {available_gb:.1f} GiB is available: "
            + ", ".join(f"{name} {h.gb:.1f} GiB ({h.settings})" for name, h in parts)
        )


def kept_bytes_per_token(m: ModelConfig, bf16: bool, checkpointed: bool) -> int:
    """Bytes autograd keeps per token of a micro-batch for its backward, the logits aside."""
    act = 2 if bf16 else 4  # bytes of a matmul output under autocast
    # Per layer and token autograd keeps the block's input, both norms' outputs, q, k, v, the
    # attention output and the residual sum (~9 hidden-sized rows) and gate, up, their activation
    # and product (4 intermediate-sized rows).
    layer = (9 * m.hidden_size + 4 * m.intermediate_size) * act
    if checkpointed:  # inputs kept (the fp32 residual stream), one layer recomputed
        return m.num_layers * m.hidden_size * 4 + layer
    return m.num_layers * layer


def logits_bytes(m: ModelConfig, bf16: bool, tokens: int) -> int:
    """A chunk of `tokens` response tokens' logits and their fp32 log-softmax."""
    return tokens * m.vocab_size * (4 + (2 if bf16 else 4))


def update_gb(policy: Transformer, cfg: GRPOConfig, bf16: bool, group_size: int, response: int) -> float:
    """The update's largest micro-batch (one prompt, as many responses of `response` tokens as
    its settings put in one): kept activations and one chunk's logits, GiB."""
    m = policy.cfg
    n = max(1, min(cfg.micro_batch, group_size, cfg.micro_batch_tokens // response))
    tokens = n * response
    kept = tokens * kept_bytes_per_token(m, bf16, tokens > cfg.checkpoint_tokens)
    return (kept + logits_bytes(m, bf16, min(tokens, cfg.logprob_chunk))) / 2**30


def step_floor(policy: Transformer, cfg: GRPOConfig, bf16: bool, group_size: int, response: int,
               rollout: HeldMemory) -> Floor:
    """The floor of a step of `policy` (its optimizer and gradients not yet allocated)."""
    weights = parameters_gb(policy)
    return Floor({
        "optimizer and gradients": HeldMemory(4 * weights, "the model's size"),
        "rollout": rollout,
        "update": HeldMemory(update_gb(policy, cfg, bf16, group_size, response),
                       "--micro-batch-tokens, --checkpoint-tokens, --logprob-chunk"),
    })
