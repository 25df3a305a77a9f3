"""Parts of an engine forward on CPU as compiled calls: a decode step's attention (RoPE
on the new tokens' queries and keys, the new keys and values into the slotted cache, each token's
query heads over its own first L keys where they lie in the cache; one token a row in a plain
step, a chain of them in a verify) in one call a layer, every cached forward's two RMSNorms
with the residual add between them in two, and its linears of a few rows (`linear`; at those
rows a layer's MLP with its residual add in one call, `mlp_step`, and its attention block with
the q/k/v and o projections in one, `attn_step`).

Why the attention: torch's CPU SDPA (its flash kernel) computes a decode step's attention as two
small GEMMs per (sequence, kv head, 512-key block), each a separate library call whose fixed
cost is many times its arithmetic when a kv head has only a few query rows; its bf16 path is no
faster than its fp32 one. vLLM's CPU backend has its own kernel for this, and a native step
spent about twice vLLM's time in attention (docs/performance.md, "Decode attention"). This one
reads each sequence's own keys once for scores and its values once, fp32 sums (bf16 scores from
the CPU's bf16 dot products where it has them), four keys at a time with the lines a few keys
ahead prefetched (at long contexts a step is a stream through its cache: docs/performance.md,
"Long contexts"), and
splits the (sequence, kv head) pairs over threads; it reads bf16 or fp32 caches, so the cache
stays in the run's dtype. Why RoPE, the cache write and the norms: at a few rows a step's time is mostly
small tensor operations and their Python dispatch (about 40 per layer, these two dozen of
them), not arithmetic (same section). Why the linears: at a few rows a step streams its weights
from memory, and oneDNN's prepacked kernels (fp32; bf16 too, on a Zen 4) read them slower than a
loop that reads each weight row once for every row of x, besides a fixed ~28 us a call ("Linears
of a few rows").

It is C (csrc/decode_kernels.c), compiled at first use with the machine's C compiler for the
machine's own instruction set (`-march=native`) into the cache directory, keyed by the source,
the compiler and the CPU, and loaded with ctypes; a ctypes call releases the GIL. Where there is
no compiler or the build fails, `library()` is None (said once, in one line, on the log), the
`usable` checks say no and the model keeps its torch path: the kernels are a speed-up, never a
requirement. They are not row-invariant by design (no exact mode): exact mode keeps its own path
(tailrl.model).

Knows: the KV cache's layout (slot, kv head, position, dim), rotate-half RoPE, grouped-query
heads, RMSNorm's roundings, a linear's weight layout (out, in), the C compiler, ctypes.
Does not know: the model's modules, masks other than a row's key count, engines.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tailrl.cache_dir import cache_root

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "decode_kernels.c"
MAX_ROWS, MAX_DIM, MAX_HIDDEN = 64, 256, 8192  # the C source's fixed limits
# Rows up to which `linear` (and with it `mlp_step`, `attn_step`) computes, by dtype. fp32: on a
# Zen 3 it streams a model's weights 1.1-1.2x faster than oneDNN's prepacked kernel at 1-8 rows,
# and decode steps of 12 and 16 rows were slower with it. bf16, on a Zen 4: the linears alone
# 1.2-1.3x at 1-4 rows, even at 5-8; decode steps with the layer calls 0.61-0.82x the time at
# 1-4 rows, 0.70-0.79x at 5-8, 0.89x at 10, even at 12, 1.11x at 16 (docs/performance.md,
# "Linears of a few rows").
LINEAR_ROWS = {torch.float32: 8, torch.bfloat16: 8}
DTYPES = (torch.bfloat16, torch.float32)
# "0" turns the kernel off (SDPA then computes every step), read at each call so that one process
# can compare the two (scripts/step_cost.py).
SWITCH = "TAILRL_DECODE_KERNEL"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]


def _cpu_key() -> str:
    """What the compiled code depends on besides the source: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags", "vendor_id"))][:3]
    return platform.machine() + "\n" + "\n".join(wanted)


def _build(compiler: str) -> Path:
    """The compiled library's path, built unless cached; OSError with the compiler's first error
    line where the build fails."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), version, " ".join(FLAGS), _cpu_key()]).encode()
    ).hexdigest()[:16]
    out = cache_root() / "kernels" / key / "decode_kernels.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        built = Path(tmp.name)
    done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        built.unlink(missing_ok=True)
        first = next((line.strip() for line in done.stderr.splitlines() if line.strip()),
                     f"exit code {done.returncode}")
        raise OSError(f"{compiler} failed: {first}")
    os.replace(built, out)  # atomic: a concurrent process sees the whole library or none
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be (no C compiler, a failed
    build, not Linux-like), which is said once, in one line: decoding then takes torch's slower
    path, and a user comparing speeds should know."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        if compiler is None or not SOURCE.exists():
            raise OSError("no C compiler (cc, gcc or $CC)" if compiler is None else f"{SOURCE} is missing")
        lib = ctypes.CDLL(str(_build(compiler)))
    except OSError as e:
        reason = " ".join(str(e).split())  # one line, whatever the compiler or loader wrote
        logger.warning("the C decode kernels are not built (%s): decoding takes torch's path", reason)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.decode_step.argtypes = [p, i, p, i, p, i, p, p, p, p, p, p, p, i, i, i, i, i, i, i, ctypes.c_float,
                                ctypes.c_int, ctypes.c_int]
    lib.decode_step.restype = ctypes.c_int
    lib.add_rms_norm.argtypes = [p, p, p, p, p, i, i, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.add_rms_norm.restype = ctypes.c_int
    lib.skinny_linear.argtypes = [p, i, ctypes.c_int, p, p, p, p, i, i, i, ctypes.c_int, ctypes.c_int]
    lib.skinny_linear.restype = ctypes.c_int
    lib.linear_bf16_available.restype = ctypes.c_int
    lib.mlp_step.argtypes = [p, i, p, i, p, p, p, p, i, p, i, i, i, ctypes.c_int, ctypes.c_int]
    lib.mlp_step.restype = ctypes.c_int
    lib.attn_step.argtypes = [p, i, p, p, p, p, p, p, p, p, p, p, p, p, p, p, p, i, i, i, i, i, i, i, i,
                              ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.attn_step.restype = ctypes.c_int
    return lib


def _enabled(x: torch.Tensor) -> bool:
    """What every kernel needs of a call: a CPU tensor of a supported dtype, no autograd (the calls
    have no backward), the library built, and not switched off (SWITCH)."""
    return (os.environ.get(SWITCH) != "0" and x.device.type == "cpu" and x.dtype in DTYPES
            and not torch.is_grad_enabled() and library() is not None)


def usable(keys: torch.Tensor, dtype: torch.dtype, group: int, tokens: int = 1) -> bool:
    """Whether `decode_step` can take a step of `tokens` new tokens a row, of `dtype`, over this
    cache view (B, K, M, D): `_enabled`, the new tokens in the cache's dtype, tokens x G (`group`
    query heads per kv head) and D within the C limits (a multiple of 8), a cache with unit stride along D."""
    d = keys.shape[-1]
    return (dtype == keys.dtype and tokens * group <= MAX_ROWS and d <= MAX_DIM and d % 8 == 0
            and keys.stride(-1) == 1 and keys.stride(-2) == d and _enabled(keys))


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as rows of `width` (one per token) with unit stride along the row (a view where it already is one)."""
    x = x.reshape(-1, width)
    return x if x.stride(-1) == 1 else x.contiguous()


def _step_inputs(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, rows: int,
                 d: int) -> tuple[torch.Tensor, ...]:
    """cos, sin (rows, D) and pos (rows,) int64, lens (rows,) int32, contiguous: what the C calls read."""
    return (cos.reshape(rows, d).contiguous(), sin.reshape(rows, d).contiguous(),
            pos.reshape(rows).to(torch.int64).contiguous(), lens.reshape(rows).to(torch.int32).contiguous())


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor, lens: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """T new tokens per row (a plain step: 1; a chain's verify: its tokens): writes RoPE(k) and v
    into keys/values at each token's `pos`, then softmax(RoPE(q) k^T / sqrt(D)) v for token t of
    row b over the row's keys [0, lens[b, t]), which may hold the tokens written before it; the call
    must be `usable`.  q (B, T, ...) of H*D a token, k/v (B, T, ...) of K*D a token (any stride
    between tokens that flattens (B, T)), cos/sin (B, ..., T, D), pos (B, T) int64 < M, lens (B, T)
    int32 with pos[b, t] < lens[b, t] <= M, keys/values (B, K, M, D) views of the cache (same
    strides)  -> (B, T, H*D) in q's dtype"""
    b, kv, _, d = keys.shape
    t = pos.shape[-1]
    heads = q.numel() // (b * t * d)
    if keys.stride() != values.stride():
        raise ValueError("keys and values must share one layout")
    q, k, v = _rows(q, heads * d), _rows(k, kv * d), _rows(v, kv * d)
    cos, sin, pos, lens = _step_inputs(cos, sin, pos, lens, b * t, d)
    out = q.new_empty(b, t, heads * d)
    status = library().decode_step(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(),
        sin.data_ptr(), pos.data_ptr(), lens.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), b, t, kv,
        heads // kv, d, keys.stride(0), keys.stride(1), 1.0 / d**0.5, int(keys.dtype == torch.bfloat16),
        torch.get_num_threads())
    if status:
        raise RuntimeError(f"decode attention kernel failed (status {status})")
    return out


def attn_usable(h: torch.Tensor, wq: torch.Tensor, wo: torch.Tensor, keys: torch.Tensor, group: int,
                tokens: int) -> bool:
    """Whether `attn_step` can take h (B, T, E) through these projections over this cache view:
    `usable` for the attention, `linear_usable` for the q/k/v projections (k and v of wq's
    layout) and o's (wo (E, H*D), its input a multiple of the vector width)."""
    return (usable(keys, h.dtype, group, tokens) and linear_usable(h, wq) and wo.dtype == wq.dtype
            and wo.is_contiguous() and wo.shape[-1] % (32 if h.dtype == torch.bfloat16 else 8) == 0)


def attn_step(h: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              biases: tuple[torch.Tensor | None, ...], wo: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pos: torch.Tensor, lens: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A decoder layer's attention block on its normed input h in one call: the q, k, v
    projections (weights, biases), then what `decode_step` does with them, then the output
    projection wo; the call must be `attn_usable`.  h (B, T, E), the rest as decode_step's
    -> (B, T, E) in h's dtype"""
    b, kv, _, d = keys.shape
    t, e = pos.shape[-1], h.shape[-1]
    heads = weights[0].shape[0] // d
    if keys.stride() != values.stride():
        raise ValueError("keys and values must share one layout")
    rows = _rows(h, e)
    cos, sin, pos, lens = _step_inputs(cos, sin, pos, lens, b * t, d)
    biases = tuple(None if x is None else x.contiguous() for x in biases)  # kept alive through the call
    out = h.new_empty(b, t, e)
    buf = h.new_empty(b * t * (2 * heads + 2 * kv) * d)
    status = library().attn_step(
        rows.data_ptr(), rows.stride(0), *(w.data_ptr() for w in weights),
        *(None if x is None else x.data_ptr() for x in biases), wo.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        pos.data_ptr(), lens.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), buf.data_ptr(), b, t,
        kv, heads // kv, d, e, keys.stride(0), keys.stride(1), 1.0 / d**0.5, int(h.dtype == torch.bfloat16),
        torch.get_num_threads())
    if status:
        raise RuntimeError(f"attention block kernel failed (status {status})")
    return out


def norm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` can take x (..., E) with this weight: `_enabled`, the weight in x's
    dtype, E within the C limit."""
    return weight.dtype == x.dtype and x.shape[-1] <= MAX_HIDDEN and _enabled(x)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add and RMSNorm in one call, computed as tailrl.model.RMSNorm
    computes them (fp32 mean, roundings to x's dtype where torch rounds): x' = x + delta (x where
    delta is None), h = RMSNorm(x'); the call must be `norm_usable`.  x, delta (..., E),
    weight (E,)  -> (x', h), both (..., E)"""
    x = x.contiguous()
    out = x if delta is None else torch.empty_like(x)
    delta = None if delta is None else delta.contiguous()
    h = torch.empty_like(x)
    status = library().add_rms_norm(
        x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(), h.data_ptr(),
        x.numel() // x.shape[-1], x.shape[-1], eps, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if status:
        raise RuntimeError(f"RMSNorm kernel failed (status {status})")
    return out, h


def linear_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` can take x (..., K) through this weight (N, K): `_enabled`, both fp32 (K a
    multiple of 8) or both bf16 on a CPU with bf16 dot products (K a multiple of 32), at most
    LINEAR_ROWS[dtype] rows, the weight contiguous (a parameter is)."""
    k = x.shape[-1]
    if (x.dtype != weight.dtype or x.dtype not in LINEAR_ROWS or x.numel() > LINEAR_ROWS[x.dtype] * k
            or not weight.is_contiguous() or not _enabled(x)):
        return False
    if x.dtype == torch.bfloat16:
        return k % 32 == 0 and bool(library().linear_bf16_available())
    return k % 8 == 0


def linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """x W_j^T + b_j for each of up to three weights reading x, side by side in one output's last
    dimension (FusedLinears splits it); each weight must be `linear_usable` with x. In bf16 the
    sums are fp32 and the output rounded once, as oneDNN's are.
    x (..., K), weights (N_j, K), biases (N_j,) or None  -> (..., sum N_j) in x's dtype"""
    k = x.shape[-1]
    rows = _rows(x, k)
    sizes = [w.shape[0] for w in weights]
    out = x.new_empty(*x.shape[:-1], sum(sizes))
    count = len(weights)
    biases = tuple(None if b is None else b.contiguous() for b in biases)  # kept alive through the call
    status = library().skinny_linear(
        rows.data_ptr(), rows.stride(0), count, (ctypes.c_void_p * count)(*[w.data_ptr() for w in weights]),
        (ctypes.c_void_p * count)(*[None if b is None else b.data_ptr() for b in biases]),
        (ctypes.c_int64 * count)(*sizes), out.data_ptr(), out.shape[-1], rows.shape[0], k,
        int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if status:
        raise RuntimeError(f"linear kernel failed (status {status})")
    return out


def mlp_usable(x: torch.Tensor, gate: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `mlp_step` can take x (..., E) with these gate (I, E) and down (E, I) weights: both
    `linear_usable` (down's with an input of I)."""
    return (linear_usable(x, gate) and down.dtype == gate.dtype and down.is_contiguous()
            and down.shape[-1] % (32 if x.dtype == torch.bfloat16 else 8) == 0)


def mlp_step(h: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
             down: torch.Tensor) -> torch.Tensor:
    """A decoder layer's SwiGLU MLP on its normed input h, and the residual add after it, in one
    call: x + down(silu(gate h) * up h), rounded where the model's ops round in its dtype; the
    call must be `mlp_usable`.  h, x (..., E), gate/up (I, E), down (E, I)  -> (..., E)"""
    e, inter = h.shape[-1], gate.shape[0]
    rows, residual = _rows(h, e), _rows(x, e)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    buf = h.new_empty(rows.shape[0] * 3 * inter)
    status = library().mlp_step(
        rows.data_ptr(), rows.stride(0), residual.data_ptr(), residual.stride(0), gate.data_ptr(), up.data_ptr(),
        down.data_ptr(), out.data_ptr(), e,
        buf.data_ptr(), rows.shape[0], e, inter, int(h.dtype == torch.bfloat16), torch.get_num_threads())
    if status:
        raise RuntimeError(f"MLP kernel failed (status {status})")
    return out
