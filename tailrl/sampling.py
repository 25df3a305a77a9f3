"""Position-keyed sampling: logits -> processed probabilities -> one token per row.

Every random choice in tailrl's decoding is keyed by (sequence seed, absolute position): the
uniform for a position comes from a counter-based hash (splitmix64), and the token is the inverse
CDF of the processed target probabilities, walked in token-id order. Plain decoding and every
speculative path therefore use the same uniform for the same position, so they emit the same
tokens whatever the batch composition, given logits that do not depend on it (tailrl.model's
exact mode; otherwise they can differ where a uniform falls within rounding of a CDF boundary).

Knows: sampling settings, probability processing (temperature, top-k, top-p), the hash, the
inverse CDF. Does not know: models, caches, drafting, tokenizers.

Shapes: B rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijective avalanche on uint64 (wrap-around arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash_ints(*parts: int | np.ndarray) -> np.ndarray:
    """Hash a tuple of non-negative integers (or arrays of them) to uint64, order-sensitive."""
    with np.errstate(over="ignore"):
        z = np.zeros(np.broadcast(*[np.asarray(p) for p in parts]).shape, dtype=np.uint64)
        for p in parts:
            z = _mix64(z + _GOLDEN + np.asarray(p).astype(np.uint64))
    return z


def derive_seed(*parts: int) -> int:
    """A sequence seed from e.g. (run seed, step, prompt index, sample index)."""
    return int(hash_ints(*parts))


def next_position(input_position: int) -> int:
    """The position convention every decoding path keys its uniforms by.

    The logits a forward computes at input position q (prompt and response counted from 0)
    predict the token that will sit at position q + 1, and that token's uniform is
    uniforms(seed, q + 1): the first response token's comes from the prompt's last position
    (len(prompt) - 1), a plain step's from the pending token's position, a verify's from each
    tree node's position along its path. Losslessness rests on all of them agreeing, so they
    all compute it here.
    """
    return input_position + 1


def uniforms(seeds: np.ndarray | list[int], positions: np.ndarray | list[int]) -> np.ndarray:
    """One uniform in [0, 1) per (seed, position) pair; depends on nothing else."""
    z = hash_ints(np.asarray(seeds, dtype=np.uint64), np.asarray(positions, dtype=np.uint64))
    return (z >> np.uint64(11)).astype(np.float64) * (2.0**-53)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target probabilities after temperature, top-k and top-p, in fp32.  # (B, V) -> (B, V)

    Greedy (temperature 0) returns a one-hot of the argmax, so the inverse CDF below and the
    speculative acceptance walk treat greedy as the same walk.
    """
    x = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    x = _scaled(x, params.temperature)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token if the mass strictly before it is below top_p: the smallest nucleus.
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# Ids per block of inverse_cdf's two-level search.
CDF_BLOCK = 1024


def inverse_cdf(probs: torch.Tensor, u: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Token ids: the first id whose cumulative probability exceeds u * total.  # (B, V) -> (B,)

    The CDF runs in token-id order (not sorted by probability) so that near-equal
    probabilities computed by different kernels cannot reorder the walk; it accumulates in
    fp64 so a 49k-token vocabulary keeps its tail mass. Two levels: fp64 sums of CDF_BLOCK-id
    blocks find the block, a running sum inside it the id. (A running sum over the whole
    vocabulary is V dependent fp64 additions per row, with an fp64 copy of the row: at batch
    64 it cost several times the rest of sampling.) A block's sum and its running sum may
    differ in the last bits; where the target falls in that gap, the block's last id with
    probability > 0 is taken, so an id of probability 0 is never sampled.
    """
    b, v = probs.shape
    padded = probs if v % CDF_BLOCK == 0 else F.pad(probs, (0, -v % CDF_BLOCK))
    blocks = padded.view(b, -1, CDF_BLOCK)  # (B, NB, BS)
    cum = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # (B, NB)
    u = torch.as_tensor(u, dtype=torch.float64, device=probs.device).reshape(-1, 1)
    target = u * cum[:, -1:]  # (B, 1)
    j = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)  # (B, 1) the block
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), 0.0)  # (B, 1) the blocks before it
    block = blocks.gather(1, j[..., None].expand(-1, -1, CDF_BLOCK)).squeeze(1)  # (B, BS)
    k = torch.searchsorted(block.cumsum(-1, dtype=torch.float64) + before, target, right=True)  # (B, 1)
    last = CDF_BLOCK - 1 - (block > 0).flip(-1).int().argmax(-1, keepdim=True)  # (B, 1) its last id with p > 0
    return (j * CDF_BLOCK + torch.minimum(k, last)).squeeze(-1).clamp_(max=v - 1)


def sample(
    logits: torch.Tensor, params: SamplingParams, seeds: list[int], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their log-probabilities for one row per sequence.  # (B, V) -> (B,), (B,)

    The log-probability is that of the temperature-scaled distribution before top-k/top-p
    (the quantity an RL trainer recomputes); for greedy it is the raw log-softmax.
    """
    if params.greedy:
        # The inverse CDF of the one-hot argmax is the argmax: skip the (B, V) fp64 cumsum. In fp32
        # (exact for bf16 values, same first maximum): CPU argmax over bf16 is a slow kernel.
        tokens = logits.float().argmax(-1)
    else:
        tokens = inverse_cdf(process_logits(logits, params), uniforms(seeds, positions))
    return tokens, token_logprobs(logits, tokens, params)


def is_top1(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Whether each token is its row's most likely one.  # (B, V), (B,) -> (B,) bool

    On the raw logits: temperature, top-k and top-p keep the argmax. A chain drafter that
    proposed the target's own argmax would have had exactly these tokens accepted. The argmax
    runs in fp32: widening is exact, so it is the same index, and on CPU a cast plus an fp32
    argmax is cheaper than a bf16 argmax (docs/performance.md).
    """
    return logits.float().argmax(-1) == tokens.reshape(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature).  # (B, V), (B,) -> (B,)"""
    x = logits.float()
    if not params.greedy:
        x = _scaled(x, params.temperature)
    return torch.log_softmax(x, dim=-1).gather(-1, tokens.reshape(-1, 1)).squeeze(-1)


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / temperature; at temperature 1 x itself (IEEE division by 1 is exact), saving a pass
    over the vocabulary per row."""
    return x if temperature == 1.0 else x / temperature
