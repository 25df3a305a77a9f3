"""Native PyTorch decoder for the Llama / Qwen2 / Qwen3 families, with a slotted KV cache.

The module names mirror Hugging Face's (model.layers.N.self_attn.q_proj, ...) so a checkpoint's
state dict loads without renaming. The architecture comes only from the checkpoint's config.

Knows: weights, RMSNorm, RoPE (default / linear / llama3 scaling), grouped-query attention,
SwiGLU, tied embeddings, Qwen2 q/k/v bias, Qwen3 q/k norm, the KV cache (tailrl.kv_cache).
Does not know: sampling, drafting, RL, tokenizers.

Row invariance. Lossless speculative decoding needs a token's logits to come out the same
whether it is fed alone (a plain step), with its draft (a verify forward) or beside other
sequences. CPU matmul kernels do not give that: the kernel, and with it the order of a row's
sums, is chosen by the number of rows; with the row count fixed, a row's result depends neither
on its place among the rows nor on the other rows. The attention products also group their sums
by the number of keys, which is the batch's longest row. A tiny logit difference flips a sampled
token whenever the position's uniform lands between the two CDFs, and from there the sequence
goes another (equally valid) way. So with `exact=True` (a per-call argument of `forward` and
`hidden`, which the rollout engine passes; the model holds no such state, so one model serves
exact rollouts and ordinary training at once) every matmul runs on blocks of exactly
`row_block(dtype)` rows, zero-padded (tailrl.linears `blocked`: the linears, `Linear`, and the
attention's query rows), the attention products run in fixed-size key chunks (`chunked_qk`,
`chunked_pv`) and the softmax normaliser is summed in fp64 (a tree's accepted path sits at non-consecutive keys). It
costs speed (fixed blocks are padded work, and past one block the weights are read once per
block), so it is off by default. The thread count picks kernels too; what the math libraries
need for a row not to depend on it is process-wide (tailrl.kernels). Without exact mode,
speculative decoding is lossless in distribution
(every token is an exact sample of the target's logits as one kernel or the other computed
them) but not bit-reproducible. Measurements: docs/lossless.md.

Shapes: B batch rows, T new tokens, S key positions, H query heads, K kv heads, G = H / K,
D head dim, E hidden size, V vocabulary, L layers, C cache slots, M cache capacity (tokens).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tailrl import decode_kernels
from tailrl.kv_cache import KV_CHUNK, CacheView
from tailrl.linears import FusedLinears, Head, Linear, blocked, packed_path

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
# New tokens a row up to which attention may take the decode kernel: plain steps, chain verifies (<= 9).
DECODE_KERNEL_TOKENS = 16


def chunked_qk(q: torch.Tensor, keys: torch.Tensor, s: int) -> torch.Tensor:
    """q @ keys[..., :s, :]^T in KV_CHUNK-key pieces.  # (B, K, N, D), (B, K, M, D) -> (B, K, N, S)

    The matmul kernel (and a score's rounding) also depends on the number of keys, which is the
    batch's longest row (so a prompt's prefill scores change when it is padded to a longer
    prompt's length); every piece here has exactly KV_CHUNK keys (read from the cache,
    whose capacity is whole chunks) on blocks of query rows (`blocked`).
    """
    out = [blocked(lambda rows: rows @ keys[:, :, c : c + KV_CHUNK].mT, q, 2) for c in range(0, s, KV_CHUNK)]
    return torch.cat(out, -1)[..., :s]


def chunked_pv(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs @ values[..., :S, :] summed chunk by chunk.  # (B, K, N, S), (B, K, M, D) -> (B, K, N, D)

    A matmul over S keys groups its sum by S (the same nonzero probabilities can give other bits at
    another S), so a row's output would depend on the longest row in its batch. Here every chunk is
    a KV_CHUNK-long matmul (probs zero-padded at the end, values read from the cache: finite, so the
    padding adds exact zeros) on blocks of query rows (`blocked`), and the chunk results are added
    in position order: a row's output depends only on its own keys.
    """
    b, k, n, s = probs.shape
    chunks = -(-s // KV_CHUNK)
    cap = values.shape[2]
    probs = F.pad(probs, (0, chunks * KV_CHUNK - s))
    if chunks * KV_CHUNK > cap:
        values = F.pad(values, (0, 0, 0, chunks * KV_CHUNK - cap))
    v = values[:, :, : chunks * KV_CHUNK].view(b, k, chunks, KV_CHUNK, -1)  # (B, K, chunks, KV_CHUNK, D)
    p = probs.view(b, k, n, chunks, KV_CHUNK).transpose(2, 3)  # (B, K, chunks, N, KV_CHUNK)
    parts = blocked(lambda rows: rows @ v, p, 3)  # (B, K, chunks, N, D)
    out = parts[:, :, 0]
    for c in range(1, chunks):
        out = out + parts[:, :, c]
    return out


@dataclass(frozen=True)
class ModelConfig:
    """Architecture read from a checkpoint's config.json (never from flags)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED_TYPES:
            raise ValueError(f"unsupported model_type {mt!r}; tailrl supports {', '.join(SUPPORTED_TYPES)}")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope = dict(d.get("rope_parameters") or {})  # transformers >= 5 layout
            theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
            scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=mt,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias; Llama/Qwen3 say so in attention_bias.
                attention_bias=mt == "qwen2" or bool(d.get("attention_bias", False)),
                qk_norm=mt == "qwen3",
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed model config: {e!r}") from e


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies with the checkpoint's theta and scaling.  # (D/2,)"""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    if cfg.rope_scaling is None:
        return inv
    s = dict(cfg.rope_scaling)
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        return inv / float(s["factor"])
    if kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(is_mid, mid, scaled)
    if kind == "default":
        return inv
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face layout).  x (B, H, T, D), cos/sin (B, 1, T, D)"""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in (at least) fp32 as the reference does; bf16 variance loses too much.
        # One fused op (equal bits to x * rsqrt(mean(x^2) + eps) in fp32; a decode step's time at a
        # few rows is mostly small ops like these).
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(xf, (xf.shape[-1],), eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, k, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.h, self.k, self.d = h, k, d
        self.q_proj = Linear(e, h * d, bias=cfg.attention_bias)
        self.k_proj = Linear(e, k * d, bias=cfg.attention_bias)
        self.v_proj = Linear(e, k * d, bias=cfg.attention_bias)
        self.o_proj = Linear(h * d, e, bias=False)
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, layer: int, view: CacheView | None, mask: torch.Tensor | None, exact: bool = False):
        b, t, _ = x.shape
        g = self.h // self.k
        kernel = view is not None and not exact and t <= DECODE_KERNEL_TOKENS  # the decode kernels may take it
        if kernel:
            rows = slice(view.first, view.first + b)
            ck, cv = view.cache.k[layer][rows], view.cache.v[layer][rows]  # (B, K, M, D) views
            # The usability checks first: the key counts cost a device sync where the kernel cannot run.
            if (not self.qk_norm and packed_path(x, self.q_proj.weight)
                    and decode_kernels.attn_usable(x, self.q_proj.weight, self.o_proj.weight, ck, g, t)
                    and view.token_keys is not None):
                # A few rows: the projections, the kernel's attention and o_proj in one call (the
                # kernels' module says why).
                return decode_kernels.attn_step(
                    x, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight),
                    (self.q_proj.bias, self.k_proj.bias, self.v_proj.bias), self.o_proj.weight, cos, sin,
                    view.write_pos, view.token_keys, ck, cv)
        if not exact and packed_path(x, self.q_proj.weight):
            q, k, v = self.qkv(x)
        else:
            q, k, v = (proj(x, exact) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = q.view(b, t, self.h, self.d), k.view(b, t, self.k, self.d), v.view(b, t, self.k, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if kernel and decode_kernels.usable(ck, q.dtype, g, t) and view.token_keys is not None:
            # RoPE, the cache write and each token's attention over its own keys in one call.
            out = decode_kernels.decode_step(q, k, v, cos, sin, view.write_pos, view.token_keys, ck, cv)
            return self.o_proj(out, exact)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, K, T, D)
        v = v.transpose(1, 2)
        if view is None:
            # Training / reference path: causal attention over the given tokens only.
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.h != self.k
            )
        else:
            out = self._cached(q, k, v, layer, view, exact)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.d), exact)

    def _cached(self, q, k, v, layer: int, view: CacheView, exact: bool) -> torch.Tensor:
        b, _, t, d = q.shape
        rows = slice(view.first, view.first + b)
        ck, cv = view.cache.k[layer][rows], view.cache.v[layer][rows]  # (B, K, M, D) views
        ck[view.rows, :, view.write_pos] = k.transpose(1, 2)
        cv[view.rows, :, view.write_pos] = v.transpose(1, 2)
        g = self.h // self.k
        n = g * t  # the G query heads of a kv head stacked as rows: K and V are read once per kv head
        qg = q.reshape(b, self.k, n, d)
        if not exact:
            # SDPA reads the cache's first S keys where they lie: a matmul needs them contiguous,
            # and a row's keys are strided by the cache's capacity, so it would copy K and V on
            # every layer of every step (most of a batch-64 decode step's time); its fused kernel
            # also skips the fp32 score tensor of a prefill.
            # Rows in groups (CacheView.segments): one attention call over the batch's longest
            # row would read every row's cache up to that length.
            parts = []
            for i, j, s, m in view.segments:
                if m is not None and t > 1:
                    m = m[:, None].expand(j - i, g, t, -1).reshape(j - i, 1, n, -1)
                elif m is not None:
                    m = m[:, None]
                parts.append(F.scaled_dot_product_attention(qg[i:j], ck[i:j, :, :s], cv[i:j, :, :s], attn_mask=m))
            out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (B, K, G*T, D)
            return out.reshape(b, self.h, t, d)  # CUDA's kernels may return other strides
        scores = chunked_qk(qg, ck, view.kv_len) * (1.0 / math.sqrt(d))  # (B, K, G*T, S)
        scores = scores.view(b, self.k, g, t, -1).masked_fill_(view.hidden_keys, float("-inf"))
        # Softmax with the normaliser summed in fp64: a vectorised fp32 sum groups keys by their
        # index, so the same keys at other positions (a tree's accepted path, before compaction)
        # would round differently; fp64 makes the order invisible after rounding back.
        e = torch.exp(scores.float() - scores.amax(-1, keepdim=True).float())
        probs = (e / e.sum(-1, keepdim=True, dtype=torch.float64).float()).to(q.dtype)
        out = chunked_pv(probs.view(b, self.k, n, -1), cv)  # (B, K, G*T, D)
        return out.reshape(b, self.h, t, d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if not exact and packed_path(x, self.gate_proj.weight):
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x, exact), self.up_proj(x, exact)
        return self.down_proj(F.silu(gate) * up, exact)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + self(h), an engine's forward: in one compiled call where its linears take the few-row
        loop (decode_kernels.mlp_step)."""
        gate, down = self.gate_proj.weight, self.down_proj.weight
        if packed_path(h, gate) and decode_kernels.mlp_usable(h, gate, down):
            return decode_kernels.mlp_step(h, x, gate, self.up_proj.weight, down)
        return x + self(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, input_norm: bool = True):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        # EAGLE-1 drafters feed their fc's output to the layer without its input norm.
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer: int, view: CacheView | None, mask: torch.Tensor | None, exact: bool = False):
        one, two = self.input_layernorm, self.post_attention_layernorm
        if view is not None and not exact and decode_kernels.norm_usable(x, two.weight):
            # An engine's forward: the norms and the residual add between them in two calls
            # instead of nine small ops (at a few rows a step is mostly such ops: decode_kernels's
            # module).
            h = decode_kernels.add_rms_norm(x, None, one.weight, one.eps)[1] if isinstance(one, RMSNorm) else x
            x, h = decode_kernels.add_rms_norm(x, self.self_attn(h, cos, sin, layer, view, mask), two.weight, two.eps)
            return self.mlp.add_to(x, h)
        x = x + self.self_attn(one(x), cos, sin, layer, view, mask, exact)
        return x + self.mlp(two(x), exact)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# SDPA's cuDNN backend builds a plan for every new (rows x keys) shape, and a cached decode meets
# new key counts on every step: on an H200 a rollout's first pass over a batch ran ~7x slower with
# it (docs/performance.md, "On a GPU"). The other fused kernels take any shape at no set-up cost.
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _decode_attention(device: torch.device, view: CacheView | None) -> contextlib.AbstractContextManager:
    if view is None or device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(_DECODE_BACKENDS)


class Transformer(nn.Module):
    """The target model: token ids in, logits (and optionally the LM head's input) out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = Head(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain attribute, not a buffer: module.to(bf16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(cfg).float()

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        ang = positions.float().unsqueeze(-1) * self.inv_freq  # (B, T, D/2)
        ang = torch.cat((ang, ang), dim=-1).unsqueeze(1)  # (B, 1, T, D)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def hidden(
        self,
        ids: torch.Tensor,  # (B, T)
        positions: torch.Tensor,  # (B, T)
        view: CacheView | None = None,
        mask: torch.Tensor | None = None,  # (B, 1, T, T) for the no-cache path; None = causal
        exact: bool = False,
        checkpoint: bool = False,
    ) -> torch.Tensor:
        """Final-normed hidden states, the LM head's input.  # (B, T, E)

        exact: row-invariant (module docstring, "Row invariance"); a choice per call, so one
        model serves exact rollouts and ordinary training at once. checkpoint: autograd keeps
        each layer's input only and recomputes the layer in the backward (training on long
        sequences: a layer's activations are ~30x its input)."""
        x = self.model.embed_tokens(ids)
        cos, sin = self.rope(positions, x.dtype)
        with _decode_attention(ids.device, view):
            for i, layer in enumerate(self.model.layers):
                if checkpoint:
                    x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, i, view, mask, exact, use_reentrant=False)
                else:
                    x = layer(x, cos, sin, i, view, mask, exact)
        return self.model.norm(x)

    def forward(self, ids, positions, view=None, mask=None, return_hidden: bool = False, exact: bool = False):
        """Logits (B, T, V), and the hidden states (B, T, E) when asked."""
        h = self.hidden(ids, positions, view, mask, exact)
        logits = self.lm_head(h, exact)
        return (logits, h) if return_hidden else logits
