"""The compiled decode attention (tailrl.attention_kernel) against a float64 reference (the
model's decode steps through it against full forwards: test_model.py).

Tolerances. fp32 cache: the kernel sums in fp32 what the reference sums in float64, over at
most a few hundred keys of unit-scale values, so outputs (magnitude <= ~1) differ by ~1e-7; we
assert 1e-5. bf16 cache: the reference takes the same bf16 inputs, and the kernel's only extra
rounding past fp32 sums is its bf16 output (round to nearest: at most 2^-9 of the value), so we
assert |diff| <= 2^-8 |ref| + 1e-5; a wrong key count, stride or softmax is off by far more.
"""

from __future__ import annotations

import pytest
import torch

from tailrl import attention_kernel
from tailrl.model import CacheView, KVCache

pytestmark = pytest.mark.skipif(attention_kernel.library() is None, reason="no C compiler: the kernel is not built")


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Row by row in float64.  q (B, K, n, D), keys/values (B, K, M, D), lens (B,) -> (B, K, n, D)"""
    out = []
    for b, n in enumerate(lens.tolist()):
        k, v = keys[b, :, :n].double(), values[b, :, :n].double()
        scores = q[b].double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        out.append(scores.softmax(-1) @ v)
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,rows,dim", [(3, 3, 64), (2, 1, 16)])
def test_kernel_equals_reference(dtype, threads, heads, rows, dim):
    """Rows of 1 to 300 keys in a cache of capacity 320 (strided views, as the engine's are)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([300, 1, 77, 128, 5, 299, 64])
    cache_k = torch.randn(9, heads, 320, dim, generator=gen).to(dtype)
    cache_v = torch.randn(9, heads, 320, dim, generator=gen).to(dtype)
    keys, values = cache_k[2:9], cache_v[2:9]  # rows 2.. of the cache, as a view at `first` = 2 is
    q = (2 * torch.randn(len(lens), heads, rows, dim, generator=gen)).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attention_kernel.decode_attention(q, keys, values, lens)
    finally:
        torch.set_num_threads(before)
    ref = reference(q, keys, values, lens)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        assert (got.double() - ref).abs().max().item() <= 1e-5
    else:
        assert bool(((got.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all())


def test_row_keys_only_for_one_token_over_a_prefix():
    """The kernel takes a step only where each row attends a prefix of the keys."""
    cache = KVCache.__new__(KVCache)  # the view's key counts do not read the cache
    lens = torch.tensor([4, 2])
    prefix = (torch.arange(5)[None] <= lens[:, None])[:, None]  # (2, 1, 5)
    assert CacheView(cache, 0, lens[:, None], 5, prefix).row_keys.tolist() == [5, 3]
    holed = prefix.clone()
    holed[0, 0, 1] = False
    assert CacheView(cache, 0, lens[:, None], 5, holed).row_keys is None
    two = torch.ones(2, 2, 5, dtype=torch.bool)
    assert CacheView(cache, 0, torch.zeros(2, 2, dtype=torch.long), 5, two).row_keys is None
