"""The decoder's linear layers on CPU: fixed row blocks for exact mode, oneDNN's prepacked
weights for decoding.

Exact mode (tailrl.model, "Row invariance") computes every matmul on blocks of exactly
`row_block(dtype)` rows (`blocked`), so a row's kernel does not depend on the batch. Decoding
(no autograd) in a dtype oneDNN computes well hands it a weight reordered once into its blocked
layout (`Linear`, `FusedLinears`) instead of the row-major parameter it would reorder on every
call; `release_packed` drops those copies (a model's size) where no decoding needs them before the
weights change. A forward of at most `decode_kernels.LINEAR_ROWS[dtype]` rows (a plain step of a
few sequences, a short chain's verify, a draft step) reads the row-major weight through
tailrl.decode_kernels.linear instead where that takes the dtype (fp32; bf16 on CPUs with bf16
dot products), which streams it faster there. Training (autograd,
autocast) always takes F.linear.

Knows: torch's CPU kernels (MKL, oneDNN), the CPU's vendor. Does not know: the architecture,
the KV cache, sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tailrl import decode_kernels

# Rows per matmul call in exact mode (see "Row invariance"): small blocks keep a 1-row decode step
# cheap; bf16 gets a larger block because CPU bf16 matrix units work on tiles of 16 rows, so a
# 16-row call costs little more than a 1-row one, where an fp32 call grows with its rows.
_ROW_BLOCK = {torch.float32: 4, torch.bfloat16: 16}
# The LM head's: every call reads its whole vocabulary-sized weight, which costs more than the
# arithmetic of a few dozen rows, so wider blocks cost about what narrow ones do and are called
# several times less often (docs/lossless.md, "Block sizes").
_HEAD_ROW_BLOCK = {torch.float32: 32, torch.bfloat16: 16}


def row_block(dtype: torch.dtype) -> int:
    return _ROW_BLOCK.get(dtype, 16)


def blocked(fn, x: torch.Tensor, dim: int, rows: int | None = None) -> torch.Tensor:
    """fn over x split along dim into blocks of exactly `rows` rows (default row_block(x.dtype)),
    the last one zero-padded; fn must treat rows along dim independently (a matmul's M dimension)."""
    n, r = x.shape[dim], rows or row_block(x.dtype)
    if n % r:
        shape = list(x.shape)
        shape[dim] = r - n % r
        x = torch.cat([x, x.new_zeros(shape)], dim)
    parts = [fn(x.narrow(dim, i, r)) for i in range(0, x.shape[dim], r)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    return out.narrow(dim, 0, n)


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def _packed_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose CPU decode linears take oneDNN's prepacked weights. bf16: torch's x86
    builds have them where oneDNN does bf16 (AVX512-BF16, AMX), and F.linear would call the same
    oneDNN kernel on an unpacked weight. fp32: F.linear calls MKL's sgemm, which picks its code
    path by vendor; on AMD CPUs its decode-shaped products (a few rows through a wide weight)
    take 2-3.5x oneDNN's prepacked time, so there oneDNN computes them. On Intel CPUs MKL keeps
    them (its own vendor's path; not measured against oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    dtypes = {torch.bfloat16} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else set()
    if _cpu_vendor() == "AuthenticAMD":
        dtypes.add(torch.float32)
    return frozenset(dtypes)


PACKED_DTYPES = _packed_dtypes()


def packed_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a forward of x through `weight` takes oneDNN's prepacked linears (Linear's doc):
    both of a PACKED_DTYPES dtype on the CPU, no autograd, no autocast (which would cast them)."""
    return (x.dtype == weight.dtype and x.dtype in PACKED_DTYPES and x.device.type == "cpu"
            and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"))


class FusedLinears:
    """Linears reading the same input (q, k, v; gate, up) as one prepacked GEMM on the packed
    path: one call instead of several, which at decode batch sizes costs little more than one. The
    concatenated packed weight is made again whenever one of the weights changes."""

    def __init__(self, *layers: Linear):
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self._key: tuple | None = None
        self._weight = self._bias = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if decode_kernels.linear_usable(x, self.layers[0].weight):  # a few fp32 rows (Linear's doc)
            out = decode_kernels.linear(x, tuple(layer.weight for layer in self.layers),
                                        tuple(layer.bias for layer in self.layers))
            return out.split(self.sizes, -1)
        params = [p for layer in self.layers for p in (layer.weight, layer.bias) if p is not None]
        key = tuple((p.data_ptr(), p._version) for p in params)
        if key != self._key:
            self._weight = torch.ops.mkldnn._reorder_linear_weight(
                torch.cat([layer.weight.detach() for layer in self.layers]), None)
            biases = [layer.bias for layer in self.layers]
            self._bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "").split(self.sizes, -1)

    def release(self) -> None:
        """Drop the packed weight (made again by the next call)."""
        self._key = self._weight = self._bias = None

    def __getstate__(self) -> dict:
        # Copies and pickles (held-out evaluation's model copy, worker processes) leave the
        # packed weight behind: oneDNN's opaque tensors have no storage to copy, and a copy packs again.
        return {**self.__dict__, "_key": None, "_weight": None, "_bias": None}


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys), computed in fixed row blocks when exact.

    Decoding on a CPU (no autograd) in a PACKED_DTYPES dtype, the weight goes to oneDNN
    prepacked: F.linear hands oneDNN the plain row-major weight, which it reorders into its
    blocked layout on every call, a cost of the weight's size paid per forward; the packed copy is made once per weight
    version (a published update changes the version) and kept beside the parameter, not in the
    state dict. Exact mode keeps F.linear: its row invariance is measured on those kernels.
    In fp32 the prepacked kernel is not MKL's, so a decode step's logits differ from the
    trainer's (autograd, F.linear) by rounding, as in bf16 they differ by the forward's shape."""

    _pack: torch.Tensor | None = None
    _pack_key: tuple[int, int] | None = None

    def exact_rows(self, dtype: torch.dtype) -> int:
        """Rows per matmul call in exact mode."""
        return row_block(dtype)

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if exact:
            out = blocked(lambda rows: F.linear(rows, self.weight, self.bias), x.reshape(-1, x.shape[-1]), 0,
                          self.exact_rows(x.dtype))
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if packed_path(x, self.weight):
            if decode_kernels.linear_usable(x, self.weight):
                return decode_kernels.linear(x, (self.weight,), (self.bias,))
            return torch.ops.mkldnn._linear_pointwise(x, self._packed(), self.bias, "none", [], "")
        return super().forward(x)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_pack": None, "_pack_key": None}  # as FusedLinears.__getstate__

    def release(self) -> None:
        """Drop the packed copy (made again by the next packed forward)."""
        self._pack = self._pack_key = None

    def _packed(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._pack_key != key:
            self._pack = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._pack_key = key
        return self._pack


def release_packed(model: nn.Module) -> None:
    """Drop every packed copy `model`'s decoding made (its Linears' and the FusedLinears its
    modules hold): memory of the model's size, made again on the next decode."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.release()
        for value in vars(module).values():
            if isinstance(value, FusedLinears):
                value.release()


class Head(Linear):
    """The LM head: a Linear whose exact-mode blocks are wider (_HEAD_ROW_BLOCK)."""

    def exact_rows(self, dtype: torch.dtype) -> int:
        return _HEAD_ROW_BLOCK.get(dtype, row_block(dtype))
