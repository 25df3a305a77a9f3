"""GRPO as pure tensor functions: group advantages, token log-probs, the PPO-clip policy loss.

Knows: rewards, log-probabilities, masks, the clipped surrogate against the sampling
(behaviour) policy with a truncated importance weight, the k3 KL estimator, and the update's
settings (GRPOConfig). Does not know: models, tokenizers, how tokens were produced (only the
behaviour log-probs they were recorded with); it names the optimizer's settings but never
builds one.

Shapes: P prompts, G responses per prompt (group_size), B = P * G rows, T response tokens
(right-padded; `mask` marks real tokens), V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ADV_EPS = 1e-6


@dataclass(frozen=True)
class GRPOConfig:
    """How the policy is updated from one rollout batch (one optimizer step per RL step)."""

    lr: float = field(default=1e-5, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    lr_warmup_steps: int = field(
        default=0, metadata={"help": "RL steps over which the lr ramps linearly up to lr (0 = none)"}
    )
    micro_batch: int = field(
        default=4,
        metadata={"help": "responses per forward/backward (packed with their shared prompt); gradients accumulate"},
    )
    # 512: a packed micro-batch's attention grows with the square of its tokens, so two of ~1,000
    # tokens cost less than one of ~2,000 though each holds the prompt; at 512 a whole step's
    # update takes the time it takes at 1,024 and holds ~0.4 GB less at its peak (docs/memory.md).
    micro_batch_tokens: int = field(default=512, metadata={"help": (
        "most tokens (prompts and responses) per forward/backward: a micro-batch closes before a response "
        "that would pass it (a longer response gets one of its own); lowered where the memory budget needs")})
    logprob_chunk: int = field(default=2048, metadata={"help": (
        "response tokens whose (tokens, vocabulary) logits are held at once: a longer micro-batch computes "
        "its log-probs chunk by chunk and recomputes the logits in the backward")})
    # As micro_batch_tokens: a micro-batch past it is one response too long to share one, and its
    # kept activations (~2.5 MB a token in fp32) would set the run's peak (docs/memory.md,
    # "configs/long.toml").
    checkpoint_tokens: int = field(default=1024, metadata={"help": (
        "a micro-batch of more tokens recomputes each layer's activations in the backward (activation "
        "checkpointing) instead of keeping them: memory per token ~30x smaller, ~1.3x the compute; lowered where "
        "the memory budget needs")})
    # 1: only the gradient sum waits, so the rollout's tail computes groups in the summing order
    # alone: a policy-sized buffer less at the update's peak, for more of the update left until
    # after the rollout (docs/memory.md, "Only the gradient sum waits").
    waiting_gradients: int = field(default=1, metadata={"help": (
        "most gradient buffers (each the policy's size, the gradient sum among them) held waiting to be added in "
        "the fixed order that keeps the update's bits (tailrl.rl.fold): a group whose buffer would wait beyond them "
        "is computed once it would not (order only: the same bits); lowered where the memory budget needs")})
    grad_clip: float = field(default=1.0, metadata={"help": "max global gradient norm (0 = no clipping)"})
    clip_low: float = field(default=0.2, metadata={"help": "PPO clip range below 1 of the ratio pi_theta / pi_rollout "
                                                                   "(ratio >= 1 - clip_low)"})
    clip_high: float | None = field(
        default=None, metadata={"help": "PPO clip range above 1; None = clip_low (DAPO clip-higher: 0.28)"}
    )
    # 2: a weight above it is a token the trainer finds over twice as likely as the engine did, far
    # past what computing one policy in bf16 instead of fp32 moves a log-prob, so the cap binds on
    # real mismatch only and no token's gradient weighs more than twice its own; ms-swift's TIS
    # threshold defaults to 2 as well.
    is_cap: float = field(
        default=2.0, metadata={"help": "truncation of the importance weight pi_theta / pi_rollout (TIS): a token "
                                       "the trainer finds more than is_cap times likelier than the rollout engine "
                                       "did keeps its gradient at weight is_cap; > 1 + clip_high; inf = off"}
    )
    kl_coef: float = field(
        default=0.0, metadata={"help": "weight of the k3 KL to the initial policy (0 = no reference model)"}
    )
    drop_truncated: bool = field(
        default=False, metadata={"help": "leave responses cut off at max_new_tokens out of the loss (DAPO's overlong "
                                         "filtering); their group's advantages still count them"}
    )
    autocast: str = field(
        default="auto", metadata={"help": "compute dtype of the update's forward and backward (master weights and "
                                          "optimizer stay in the policy's dtype); auto: bf16 where bf16 matmuls are "
                                          "native (CUDA, CPUs with avx512_bf16 or AMX), else fp32",
                                  "choices": ("auto", "bf16", "fp32")}
    )

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        for name in ("micro_batch", "micro_batch_tokens", "logprob_chunk", "checkpoint_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.autocast not in ("auto", "bf16", "fp32"):
            raise ValueError(f"autocast must be auto, bf16 or fp32, got {self.autocast!r}")
        for name in ("lr_warmup_steps", "weight_decay", "grad_clip", "clip_low", "kl_coef", "waiting_gradients"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.clip_high is not None and self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if not self.is_cap > 1.0 + self.clip_upper:
            raise ValueError(f"is_cap must be > 1 + clip_high ({1.0 + self.clip_upper}) so that the truncation never "
                             f"undoes a clip, got {self.is_cap}")

    def lr_at(self, step: int) -> float:
        """The learning rate of RL step `step` (1-based). A ramp, because Adam's first updates
        move every weight by about lr whatever its gradient (the second-moment estimate starts
        from one sample)."""
        return self.lr * min(1.0, step / (self.lr_warmup_steps + 1))

    @property
    def clip_upper(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-6), one group per row.  # (P, G) -> (P, G)

    The std is the unbiased one (torch.std, divisor G - 1), as TRL's GRPOTrainer computes it,
    so advantages match that reference. A group whose rewards are all equal gets zeros: it
    carries no learning signal. G = 1 has no spread to normalise by, so it is rejected.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape (num_prompts, group_size), got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError("group_size must be >= 2 for group-relative advantages")
    r = rewards.double()
    mean = r.mean(dim=1, keepdim=True)  # (P, 1)
    std = r.std(dim=1, keepdim=True)  # (P, 1), unbiased
    return ((r - mean) / (std + ADV_EPS)).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def sequence_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), per position.  # (B, T, V), (B, T) -> (B, T)

    `logits[:, t]` must be the prediction for `tokens[:, t]` (the caller shifts by one).
    Temperature 0 (greedy rollouts) is scored at temperature 1: greedy has no density of its
    own, and the raw policy is what the update moves. Computed in at least fp32 (bf16 models
    are upcast; fp64 stays fp64).
    """
    scale = 1.0 if temperature == 0.0 else float(temperature)
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(x / scale, dim=-1)  # (B, T, V)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)


class _ChunkedLogprobs(torch.autograd.Function):
    """sequence_logprobs of hidden @ weight.T, `chunk` rows at a time, the logits recomputed in
    the backward: no (N, V) tensor beyond a chunk's is ever held (module doc of chunked_logprobs)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale: float, chunk: int, dtype: torch.dtype):  # noqa: D102
        ctx.save_for_backward(hidden, weight, targets)
        ctx.scale, ctx.chunk, ctx.dtype = scale, chunk, dtype
        w = weight.to(dtype)  # (V, E)
        ctx.softmax_dtype = softmax_dtype = torch.promote_types(dtype, torch.float32)  # as sequence_logprobs
        out = torch.empty(hidden.shape[0], dtype=softmax_dtype, device=hidden.device)  # (N,)
        for s in range(0, hidden.shape[0], chunk):
            logits = torch.nn.functional.linear(hidden[s : s + chunk].to(dtype), w).to(softmax_dtype)  # (C, V)
            logp = torch.log_softmax(logits.div_(scale), dim=-1)
            del logits
            out[s : s + chunk] = logp.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        hidden, weight, targets = ctx.saved_tensors
        w = weight.to(ctx.dtype)  # (V, E)
        grad_h = torch.empty_like(hidden)  # (N, E)
        grad_w = torch.zeros(weight.shape, dtype=ctx.softmax_dtype, device=weight.device)  # (V, E)
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk].to(ctx.dtype)  # (C, E)
            logits = torch.nn.functional.linear(h, w).to(ctx.softmax_dtype).div_(ctx.scale)  # (C, V)
            g = grad[s : s + ctx.chunk, None]  # (C, 1)
            # d log p(t) / d logit_v = (1[v = t] - p_v) / scale, in place: one (C, V) tensor at a time
            d = torch.softmax(logits, dim=-1)
            del logits
            d.mul_(-g).scatter_add_(-1, targets[s : s + ctx.chunk, None], g).div_(ctx.scale)  # (C, V)
            d = d.to(ctx.dtype)
            grad_h[s : s + ctx.chunk] = (d @ w).to(hidden.dtype)
            grad_w += d.T @ h
        return grad_h, grad_w.to(weight.dtype), None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     chunk: int) -> torch.Tensor:
    """log p(target) under softmax(hidden @ weight.T / temperature), per row: sequence_logprobs
    of the LM head's logits, computed `chunk` rows at a time.  # (N, E), (V, E), (N,) -> (N,)

    For responses of thousands of tokens the (N, V) logits (and autograd's copies of them) are
    the update's largest tensors: 4 x 2,048 tokens x a 49k vocabulary is 1.6 GB per fp32 copy.
    Here the forward keeps only each row's log-prob and the backward recomputes each chunk's
    logits (one more LM-head product per token) to form the gradient (1[v = t] - p) / T. Under
    autocast the products run in autocast's dtype, as the unchunked path's would; the softmax is
    in at least fp32 either way. Against sequence_logprobs over the whole (N, V) at once the
    values differ only by the matmul's rounding: the same kernel on fewer rows may sum in another
    order (tests/test_update.py bounds it)."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    scale = 1.0 if temperature == 0.0 else float(temperature)
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLogprobs.apply(hidden, weight, targets, scale, chunk, dtype)


@dataclass(frozen=True)
class LossTerms:
    """The loss to backpropagate and detached diagnostics (token means over this micro-batch,
    but ratio_max: the largest ratio in it)."""

    loss: torch.Tensor  # scalar, carries the graph
    pg_loss: float
    kl: float
    clip_fraction: float  # tokens whose clipped branch won the min (they get no gradient)
    ratio_mean: float  # of pi_theta / pi_behaviour, before truncation
    ratio_max: float
    capped_fraction: float  # tokens whose importance weight is_cap truncated
    mismatch_kl: float  # k3 estimate of KL(pi_behaviour || pi_theta) per token


def truncated_weight(log_ratio: torch.Tensor, is_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight min(ratio, is_cap) with gradient w * grad log_ratio, and where the
    cap binds.  # (B, T) -> (B, T), (B, T) bool

    Why the truncation (Yao et al. 2025, "truncated importance sampling"): the clip bounds a
    token's weight only where it stops its gradient (A > 0 above 1 + clip_high, A < 0 below
    1 - clip_low). A token with A < 0 that the trainer finds far likelier than the engine did
    keeps the unclipped branch with weight ratio, unbounded; capping the weight at is_cap bounds
    its share of the gradient and keeps its direction (dropping it would lose the signal). The
    cap acts in log space, so is_cap = inf (no truncation) needs no special case and makes no
    NaN. is_cap must exceed 1 + clip_high, else a capped token with A > 0 would escape its clip.
    """
    excess = (log_ratio.detach() - math.log(is_cap)).clamp(min=0.0)  # (B, T), a constant
    return torch.exp(log_ratio - excess), excess > 0


def clipped_surrogate(weight: torch.Tensor, adv: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(w * A, clip(w, 1 - clip_low, 1 + clip_high) * A) per token, PPO's pessimistic surrogate,
    and where the clipped branch won the min (its tokens get no gradient).  # (B, T), (B, 1) -> (B, T), (B, T)

    adv may also be (B, T): an advantage per token."""
    unclipped = weight * adv
    clipped = torch.clamp(weight, 1.0 - clip_low, 1.0 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """exp(ref - lp) - (ref - lp) - 1 per token: >= 0, unbiased for KL(pi || ref) on samples of
    pi; 0 on padding, whatever log-prob it holds.  # (B, T) -> (B, T)"""
    d = torch.where(valid, ref_logprobs.detach() - logprobs, 0.0)  # (B, T)
    return torch.exp(d) - d - 1.0


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_cap: float = 2.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: int | None = None,
) -> LossTerms:
    """PPO-clip surrogate against the policy that sampled the tokens, its importance weight
    truncated at is_cap (truncated_weight), with token-mean aggregation and an optional k3 KL
    penalty.

    logprobs (B, T) are the trainer's (pi_theta) and carry the graph; behaviour_logprobs (B, T)
    are each token's log-prob under the policy that sampled it (pi_behaviour: what the rollout
    engine recorded); they, ref_logprobs (B, T), advantages (B,) per row or (B, T) per token
    (for rows that pack several responses) and mask (B, T) are constants. Per token, with sg()
    the stop-gradient:
        log_r = logprobs - behaviour                        ratio = exp(log_r) = pi_theta / pi_behaviour
        w     = exp(log_r - sg(max(0, log_r - log is_cap))) value min(ratio, is_cap), gradient w * grad lp
        pg    = -min(w * A, clip(w, 1 - clip_low, 1 + clip_high) * A)
        k3    = exp(ref - lp) - (ref - lp) - 1              (>= 0, unbiased for KL(pi || ref))
    loss = sum over valid tokens of (pg + kl_coef * k3) / num_tokens.

    Why the behaviour policy: the tokens were drawn from it, so A * ratio * grad lp is the policy
    gradient of pi_theta estimated from its samples, and the clip keeps the step inside a trust
    region around the policy that actually sampled. The trainer's own recompute is no stand-in:
    with one optimizer step per rollout batch it equals pi_theta, its ratio is exactly 1 and
    nothing is ever clipped, while the engine computes the policy differently (another dtype,
    other kernels). When the two agree the ratio is 1 and the gradient is A * grad lp.

    num_tokens defaults to this batch's valid-token count. With gradient accumulation pass the
    valid-token count of the whole optimizer batch: the micro-batch losses then sum to exactly
    the full-batch token mean (a per-micro-batch mean would overweight short micro-batches).
    """
    valid = mask.bool()  # (B, T)
    mask = valid.to(logprobs.dtype)
    denom = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1.0).item()
    _check(denom, num_tokens, kl_coef, ref_logprobs, is_cap, clip_high)
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # (B, 1)
    # Padding may hold any log-prob (even -inf): zero its log-ratio before exp so that neither
    # the forward (inf * 0) nor the backward (0 * inf) produces NaN.
    log_ratio = torch.where(valid, logprobs - behaviour_logprobs.detach(), 0.0)  # (B, T)
    weight, capped = truncated_weight(log_ratio, is_cap)
    pg, is_clipped = clipped_surrogate(weight, adv, clip_low, clip_high)
    per_token = pg
    kl = torch.zeros_like(pg)
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs, valid)
        per_token = pg + kl_coef * kl
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        return _terms(loss, pg, kl, log_ratio.detach(), capped, is_clipped, mask)


def _check(denom: float, num_tokens: int | None, kl_coef: float, ref_logprobs: torch.Tensor | None,
           is_cap: float, clip_high: float) -> None:
    """policy_loss's argument checks, one line each."""
    if denom <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if not is_cap > 1.0 + clip_high:
        raise ValueError(f"is_cap must be > 1 + clip_high ({1.0 + clip_high}), got {is_cap}")


def _terms(loss: torch.Tensor, pg: torch.Tensor, kl: torch.Tensor, log_ratio: torch.Tensor, capped: torch.Tensor,
           is_clipped: torch.Tensor, mask: torch.Tensor) -> LossTerms:
    """The diagnostics of policy_loss, token means over mask (all (B, T)). The ratio is the
    untruncated one: it describes how far the engine was from the trainer, not what the loss
    used. The mismatch KL is the k3 estimator ratio - 1 - log ratio: the tokens are samples of
    pi_behaviour, where E[ratio] = 1, so its mean is unbiased for KL(pi_behaviour || pi_theta),
    and, unlike the mean of -log ratio (also unbiased), it is >= 0 token by token. (With top-k /
    top-p the tokens come from the truncated distribution, not the recorded one, and the
    estimate is approximate.)"""
    n = mask.sum().clamp(min=1.0)

    def mean(x: torch.Tensor) -> float:
        return ((x.to(mask.dtype) * mask).sum() / n).item()

    ratio = torch.exp(log_ratio)  # (B, T)
    return LossTerms(
        loss=loss,
        pg_loss=mean(pg),
        kl=mean(kl),
        clip_fraction=mean(is_clipped),
        ratio_mean=mean(ratio),
        ratio_max=(ratio * mask).max().item() if mask.numel() else 0.0,
        capped_fraction=mean(capped),
        mismatch_kl=mean(ratio - 1.0 - log_ratio),
    )
