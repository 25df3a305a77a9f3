"""One GRPO group's share of the policy update: the gradient of its unnormalised loss, micro-batch
by micro-batch, and its token-weighted statistics (tailrl.rl.update sums the shares).

A group's gradient is the gradient of the sum over its tokens of the per-token PPO-clip loss
against the log-probs the rollout sampled with (tailrl.rl.grpo.policy_loss with num_tokens=1),
taken with torch.autograd.grad a micro-batch at a time (tailrl.rl.packing.packs): nothing is
accumulated into shared `.grad`. Each micro-batch's gradient goes, parameter by parameter as
the backward produces it (tailrl.rl.gradients), into the caller's running sum when the group is
next in the summing order, or into a buffer of its own the caller adds later in the same order.

Knows: the loss, packing, autograd. Does not know: the order shares are summed in, threads, the
rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from tailrl.loading import resolve_dtype
from tailrl.model import Transformer
from tailrl.rl.gradients import GradientSink, differentiate, routed
from tailrl.rl.grpo import GRPOConfig, policy_loss
from tailrl.rl.packing import PackMemory, Sample, packed_behaviour, packed_logprobs, packed_logprobs_and_hidden, packs

# Token means (policy_loss's LossTerms of the same names), added up as token-weighted sums.
STAT_NAMES = ("loss", "pg_loss", "kl", "clip_fraction", "ratio_mean", "capped_fraction", "mismatch_kl")



@dataclass
class GroupShare:
    """One group's unnormalised share: gradient buffers, token-weighted stat sums, the max ratio."""

    # The gradient still to add, per micro-batch in order, one tensor per trainable parameter
    # each; a group computed into the sum (`into`) has already added its own: none left.
    grads: list[list[torch.Tensor]]
    sums: dict[str, float]
    tokens: int
    ratio_max: float = 0.0
    # With keep_hidden: the group's samples and each one's hidden states (packing.packed_logprobs_and_hidden).
    samples: list[Sample] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)


def empty_share() -> GroupShare:
    return GroupShare([], dict.fromkeys(STAT_NAMES, 0.0), 0)


def group_share(policy: Transformer, samples: Sequence[Sample], cfg: GRPOConfig, temperature: float,
                ref: Transformer | None = None, keep_hidden: bool = False,
                into: GradientSink | None = None) -> GroupShare:
    """The gradient of sum-over-tokens of the GRPO loss of `samples`, micro-batches of at most
    cfg.micro_batch responses and (where responses allow) cfg.micro_batch_tokens tokens per
    forward/backward; with keep_hidden, each sample's hidden states from the same forwards. Each
    micro-batch's gradient is added to `into` (the running sum) parameter by parameter as its
    backward produces it (tailrl.rl.gradients), or, without `into`, kept as a buffer of its own
    (GroupShare.grads) to be added to the sum later in the same order: the same bits. Long
    micro-batches keep memory flat (packing.PackMemory); the reference model's pass keeps no
    autograd state."""
    params = [p for p in policy.parameters() if p.requires_grad]
    share = empty_share()
    device_type = params[0].device.type
    bf16 = resolve_dtype(cfg.autocast, params[0].device) == "bf16"
    memory = PackMemory(cfg.logprob_chunk, cfg.checkpoint_tokens)
    with routed(params):
        for pack in packs(samples, cfg.micro_batch, cfg.micro_batch_tokens):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
                if keep_hidden:
                    logprobs, hidden = packed_logprobs_and_hidden(policy, pack, temperature, memory)  # (1, N)
                    share.samples += pack
                    share.hidden += hidden
                else:
                    logprobs = packed_logprobs(policy, pack, temperature, memory)  # (1, N)
            ref_logprobs = None
            if ref is not None:
                with torch.no_grad():
                    ref_logprobs = packed_logprobs(ref, pack, temperature, memory)  # (1, N)
            adv = torch.tensor([[s.advantage for s in pack for _ in s.token_ids]], dtype=torch.float64)  # (1, N)
            out = policy_loss(
                logprobs, packed_behaviour(pack, logprobs), adv.to(logprobs.device),
                torch.ones_like(logprobs, dtype=torch.bool), cfg.clip_low, cfg.clip_upper, cfg.is_cap, ref_logprobs,
                cfg.kl_coef, num_tokens=1,
            )
            sink = into if into is not None else GradientSink(params)
            differentiate(out.loss, params, sink)
            if into is None:
                share.grads.append(sink.grads)  # type: ignore[arg-type]  # differentiate filled every parameter
            n = logprobs.shape[1]
            share.tokens += n
            share.sums["loss"] += out.loss.item()  # already a sum over the pack's tokens
            for name in STAT_NAMES[1:]:
                share.sums[name] += getattr(out, name) * n  # token means over the pack -> sums
            share.ratio_max = max(share.ratio_max, out.ratio_max)
    return share


def micro_batches(samples: Sequence[Sample], cfg: GRPOConfig) -> int:
    """How many micro-batches group_share differentiates for `samples`: the buffers a group
    computed out of the summing order holds until its turn."""
    return sum(1 for _ in packs(samples, cfg.micro_batch, cfg.micro_batch_tokens))
