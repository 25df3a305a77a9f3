"""The compiled decode step (tailrl.decode_kernels) against a float64 reference (the model's
decode steps through it against full forwards: test_model.py).

Tolerances. fp32 cache: the kernel sums in fp32 what the reference sums in float64, over at
most a few hundred keys of unit-scale values, so outputs (magnitude <= ~1) differ by ~1e-7; we
assert 1e-5. bf16 cache: the reference takes the same bf16 inputs, and the kernel's only extra
roundings past fp32 sums are its bf16 outputs (the written key, the attention output; round to
nearest: at most 2^-9 of the value, where the reference's own rounding of the key in float64
can land one step (2^-7 of it) away when the two sit on either side of a tie), so we assert
|diff| <= 2^-8 |ref| + 1e-5; a wrong key count, stride, rotation or softmax is off by far more.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tailrl import decode_kernels
from tailrl.kv_cache import CacheView, KVCache
from tailrl.linears import PACKED_DTYPES, FusedLinears, Linear
from tailrl.model import MLP, RMSNorm

pytestmark = pytest.mark.skipif(decode_kernels.library() is None, reason="no C compiler: the kernel is not built")


def rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float64.  x (B, heads, D), cos/sin (B, D)"""
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def reference(q, k, v, cos, sin, pos, lens, keys, values):
    """The step in float64 on copies of the cache: RoPE, every new key and value and the scaled
    queries rounded to the cache's dtype, then each token over its row's first lens[b, t] keys.
    q, k, v (B, T, ...), cos/sin (B, T, D), pos/lens (B, T)  -> (B, T, H*D), keys, values"""
    b, kv, _, d = keys.shape
    t = pos.shape[1]
    keys, values = keys.clone(), values.clone()
    for j in range(t):
        rows = torch.arange(b)
        keys[rows, :, pos[:, j]] = rope64(k[:, j].reshape(b, kv, d), cos[:, j], sin[:, j]).to(keys.dtype)
        values[rows, :, pos[:, j]] = v[:, j].reshape(b, kv, d)
    out = torch.empty(b, t, q.shape[-1], dtype=torch.float64)
    for j in range(t):
        # The scaled query in the cache's dtype, as the torch path holds it (query head h*G + g reads kv head h).
        qr = ((rope64(q[:, j].reshape(b, -1, d), cos[:, j], sin[:, j]) / d**0.5)
              .to(keys.dtype).double().view(b, kv, -1, d))
        for i in range(b):
            n = int(lens[i, j])
            scores = qr[i] @ keys[i, :, :n].double().transpose(-1, -2)
            out[i, j] = (scores.softmax(-1) @ values[i, :, :n].double()).reshape(-1)
    return out, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,group,dim,tokens", [(3, 3, 64, 1), (2, 1, 16, 1), (3, 3, 64, 5), (2, 2, 32, 9)])
def test_kernel_equals_reference(dtype, threads, heads, group, dim, tokens):
    """Rows of 1 to 300 keys in a cache of capacity 320 (strided views, as the engine's are); q, k
    and v slices of one fused projection's output, as the model passes them. With T tokens a row
    (a chain's verify), token t is written at the row's position L + t and attends keys
    [0, L + t + 1): the tokens before it, written in the same call, and itself."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([300, 1, 77, 128, 5, 299, 64]) - (tokens - 1)
    lens = lens.clamp(min=1)[:, None] + torch.arange(tokens)  # (B, T)
    pos = lens - 1  # each new token is its own last key
    cache_k = torch.randn(9, heads, 320, dim, generator=gen).to(dtype)
    cache_v = torch.randn(9, heads, 320, dim, generator=gen).to(dtype)
    keys, values = cache_k[2:9], cache_v[2:9]  # rows 2.. of the cache, as a view at `first` = 2 is
    b, h = len(lens), heads * group
    qkv = (2 * torch.randn(b, tokens, (h + 2 * heads) * dim, generator=gen)).to(dtype)
    q, k, v = qkv.split([h * dim, heads * dim, heads * dim], -1)
    angle = torch.rand(b, tokens, dim // 2, generator=gen, dtype=torch.float64) * 300
    cos, sin = torch.cat((angle, angle), -1).cos().to(dtype), torch.cat((angle, angle), -1).sin().to(dtype)
    want, want_k, want_v = reference(q, k, v, cos, sin, pos, lens, keys, values)
    with torch.no_grad():  # the kernel has no backward
        assert decode_kernels.usable(keys, dtype, group, tokens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_kernels.decode_step(q, k, v, cos[:, None], sin[:, None], pos, lens, keys, values)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == dtype and got.shape == (b, tokens, h * dim)
    got = got.double()
    # The cache: the new values exactly, the new keys to their rounding, nothing else touched.
    assert torch.equal(values, want_v)
    written = torch.zeros_like(keys, dtype=torch.bool)
    for j in range(tokens):
        written[torch.arange(b), :, pos[:, j]] = True
    assert torch.equal(keys[~written], want_k[~written])
    diff, ref_k = (keys[written].double() - want_k[written].double()).abs(), want_k[written].double().abs()
    if dtype == torch.float32:
        assert diff.max().item() <= 1e-5 and (got - want).abs().max().item() <= 1e-5
    else:
        assert bool((diff <= ref_k * 2**-7 + 1e-6).all())  # one bf16 step at most
        assert bool(((got - want).abs() <= want.abs() * 2**-8 + 1e-5).all())


def test_token_keys_only_where_every_token_attends_a_prefix():
    """The kernel takes a forward only where each new token attends a prefix of the keys: a plain
    step's, a chain verify's (token t over the row's keys and the chain's first t + 1), not a
    tree's (a second child does not attend its sibling) nor one with a hole."""
    cache = KVCache.__new__(KVCache)  # the view's key counts do not read the cache
    lens = torch.tensor([4, 2])
    prefix = (torch.arange(5)[None] <= lens[:, None])[:, None]  # (2, 1, 5)
    assert CacheView(cache, 0, lens[:, None], 5, prefix).token_keys.tolist() == [[5], [3]]
    holed = prefix.clone()
    holed[0, 0, 1] = False
    assert CacheView(cache, 0, lens[:, None], 5, holed).token_keys is None
    at = lens[:, None] + torch.arange(3)  # a chain of 3 from each row's end
    chain = torch.arange(8)[None, None] <= at[:, :, None]  # (2, 3, 8)
    assert CacheView(cache, 0, at, 8, chain).token_keys.tolist() == [[5, 6, 7], [3, 4, 5]]
    tree = chain.clone()
    tree[:, 2, at[:, 1]] = False  # the third node is the second's sibling, not its child
    assert CacheView(cache, 0, at, 8, tree).token_keys is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: past the row count where the call uses threads
def test_add_rms_norm_equals_the_models_norm(dtype, rows):
    """x + delta and RMSNorm in one call against tailrl.model.RMSNorm on the torch sum: the sum
    bit for bit (an elementwise add rounds once either way); the norm within the dtype's rounding
    (the two sum the squares in other orders, so the scale may differ in its last fp32 bit, and in
    bf16 the normalised value and its product with the weight may each then round one step the
    other way: 2^-6 of the value in bf16; 1e-6 in fp32)."""
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(rows, 1, 576, generator=gen)).to(dtype)
    delta = torch.randn(rows, 1, 576, generator=gen).to(dtype)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(576, generator=gen))
    norm = norm.to(dtype)
    with torch.no_grad():
        summed, h = decode_kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        alone, h_alone = decode_kernels.add_rms_norm(x, None, norm.weight, norm.eps)
        want, want_alone = norm(x + delta), norm(x)
    assert torch.equal(summed, x + delta) and torch.equal(alone, x)
    for got, ref in ((h, want), (h_alone, want_alone)):
        bound = ref.double().abs() * (2**-6 if dtype == torch.bfloat16 else 1e-6) + 1e-6
        assert got.dtype == dtype and bool(((got.double() - ref.double()).abs() <= bound).all())


def _bf16_linears() -> bool:
    return bool(decode_kernels.library().linear_bf16_available())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])  # each of the kernels' tiles, full and partial
def test_linear_equals_reference(dtype, threads, rows):
    """Three weights reading one x, each into its own columns, against float64: 5 and 7 output rows
    (partial tiles), 300 (past the size where the call uses threads, split between threads
    mid-weight); x a strided slice, as a fused projection's output slice is. fp32 sums of K
    products differ from exact ones by at most ~K u sum|x w| (u = 2^-24; the bias add and the
    output's rounding add ~2u of it), which bounds the assertion; in bf16 the products of bf16
    values are exact in fp32, the sums as in fp32, and the output's one rounding to bf16 adds at
    most 2^-8 of the value. A wrong row, column, stride or bias is off by the size of a product."""
    if dtype == torch.bfloat16 and not _bf16_linears():
        pytest.skip("this CPU has no bf16 dot products (avx512_bf16): no bf16 linear kernel")
    gen = torch.Generator().manual_seed(rows)
    k = 64
    wide = torch.randn(rows, 1, k + 16, generator=gen).to(dtype)
    x = wide[..., 8 : 8 + k]  # row stride k + 16
    weights = tuple(torch.randn(n, k, generator=gen).to(dtype) for n in (5, 300, 7))
    biases = (None, torch.randn(300, generator=gen).to(dtype), torch.randn(7, generator=gen).to(dtype))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            assert decode_kernels.linear_usable(x, weights[0]) == (rows <= decode_kernels.LINEAR_ROWS[dtype])
            got = decode_kernels.linear(x, weights, biases)
    finally:
        torch.set_num_threads(before)
    w = torch.cat(weights).double()
    b = torch.cat([torch.zeros(5), *[bias.double() for bias in biases[1:]]]).double()
    want = x.double() @ w.T + b
    bound = (k + 2) * 2**-24 * (x.double().abs() @ w.abs().T + b.abs())
    if dtype == torch.bfloat16:
        bound = bound + 2**-8 * want.abs()
    assert got.shape == (rows, 1, 312) and got.dtype == dtype
    assert bool(((got.double() - want).abs() <= bound).all())


def test_linear_usable_only_for_a_few_rows():
    """The linear kernel takes fp32 x of at most LINEAR_ROWS rows and K a multiple of 8, bf16 ones
    of K a multiple of 32 where the CPU has bf16 dot products, without autograd."""
    w = torch.zeros(4, 32)
    fp32_rows = decode_kernels.LINEAR_ROWS[torch.float32]
    with torch.no_grad():
        assert decode_kernels.linear_usable(torch.zeros(fp32_rows, 1, 32), w)
        assert not decode_kernels.linear_usable(torch.zeros(fp32_rows + 1, 1, 32), w)
        assert not decode_kernels.linear_usable(torch.zeros(1, 12), torch.zeros(4, 12))
        assert not decode_kernels.linear_usable(torch.zeros(1, 32, dtype=torch.bfloat16), w)  # mixed dtypes
        bf16_rows = decode_kernels.LINEAR_ROWS[torch.bfloat16]
        assert decode_kernels.linear_usable(torch.zeros(bf16_rows, 32).bfloat16(), w.bfloat16()) == _bf16_linears()
        assert not decode_kernels.linear_usable(torch.zeros(bf16_rows + 1, 32).bfloat16(), w.bfloat16())
        assert not decode_kernels.linear_usable(torch.zeros(1, 16).bfloat16(), torch.zeros(4, 16).bfloat16())
    assert not decode_kernels.linear_usable(torch.zeros(1, 32), w)  # autograd on: no backward here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_take_the_kernel_up_to_linear_rows_on_the_packed_path(dtype):
    """Where decoding in `dtype` takes the packed path (fp32: AMD CPUs; bf16: CPUs with bf16
    instructions), Linear and FusedLinears compute up to LINEAR_ROWS rows through the kernel, bit
    for bit, and more rows through oneDNN, bit for bit."""
    if dtype not in PACKED_DTYPES:
        pytest.skip(f"{dtype} linears are not prepacked on this CPU")
    if dtype == torch.bfloat16 and not _bf16_linears():
        pytest.skip("this CPU has no bf16 dot products (avx512_bf16): no bf16 linear kernel")
    gen = torch.Generator().manual_seed(3)
    lin = Linear(64, 40).to(dtype)
    fused = FusedLinears(Linear(64, 24, bias=False).to(dtype), Linear(64, 16, bias=False).to(dtype))
    rows = decode_kernels.LINEAR_ROWS[dtype]
    with torch.no_grad():
        x = torch.randn(rows, 1, 64, generator=gen).to(dtype)
        assert torch.equal(lin(x), decode_kernels.linear(x, (lin.weight,), (lin.bias,)))
        want = decode_kernels.linear(x, tuple(layer.weight for layer in fused.layers), (None, None))
        assert torch.equal(torch.cat(fused(x), -1), want)
        wide = torch.randn(rows + 1, 1, 64, generator=gen).to(dtype)
        assert torch.equal(lin(wide), torch.ops.mkldnn._linear_pointwise(wide, lin.weight, lin.bias, "none", [], ""))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_mlp_step_equals_the_models_mlp(dtype, threads, rows):
    """x + MLP(h) in one call against the model's own ops on the packed path (its linears through
    the same loop, torch's SiLU, product and add): in bf16 bit for bit (the same products summed
    in the same order, each op rounded where torch rounds it); in fp32 the two SiLUs' exp may
    differ in its last bits, 4u of the activation, which the down projection carries to at most
    4u |W_down| |a| (asserted with 16u; a wrong row, column or stride is off by a product's size)."""
    if dtype not in PACKED_DTYPES or (dtype == torch.bfloat16 and not _bf16_linears()):
        pytest.skip(f"{dtype} decoding takes no few-row loop on this CPU")
    gen = torch.Generator().manual_seed(rows)
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=96)).to(dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 8)
    h = torch.randn(rows, 1, 64, generator=gen).to(dtype)
    x = torch.randn(rows, 1, 64, generator=gen).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            assert decode_kernels.mlp_usable(h, mlp.gate_proj.weight, mlp.down_proj.weight)
            got = decode_kernels.mlp_step(h, x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
            want = x + mlp(h)
            assert torch.equal(mlp.add_to(x, h), got)  # the model's engine path takes it
    finally:
        torch.set_num_threads(before)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        with torch.no_grad():
            a = F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)
        bound = 16 * 2**-24 * (a.double().abs() @ mlp.down_proj.weight.double().abs().T) + 2**-24 * want.double().abs()
        assert bool(((got.double() - want.double()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,tokens,bias", [(3, 1, False), (1, 3, True), (2, 2, True)])
def test_attn_step_equals_its_parts(dtype, threads, rows, tokens, bias):
    """The attention block in one call against its three parts called one after another (the q/k/v
    linear, decode_step, the o linear; each against float64 above): the same output and the same
    cache writes, bit for bit (each part computes the same sums in the same order), for plain
    steps of a few rows and short chains, with q/k/v biases (Qwen2) and without."""
    if dtype == torch.bfloat16 and not _bf16_linears():
        pytest.skip("this CPU has no bf16 dot products (avx512_bf16): no bf16 linear kernel")
    gen = torch.Generator().manual_seed(rows * 10 + tokens)
    e, kv, group, d = 64, 2, 2, 32
    h = kv * group
    lens = torch.tensor([40, 7, 21][:rows])[:, None] + torch.arange(tokens)  # (B, T)
    pos = lens - 1
    caches = [torch.randn(rows + 1, kv, 64, d, generator=gen).to(dtype) for _ in range(2)]
    weights = tuple((torch.randn(n, e, generator=gen) / 8).to(dtype) for n in (h * d, kv * d, kv * d))
    biases = tuple((torch.randn(w.shape[0], generator=gen) if bias else None) for w in weights)
    biases = tuple(None if b is None else b.to(dtype) for b in biases)
    wo = (torch.randn(e, h * d, generator=gen) / 8).to(dtype)
    x = torch.randn(rows, tokens, e, generator=gen).to(dtype)
    angle = torch.rand(rows, tokens, d // 2, generator=gen, dtype=torch.float64) * 300
    cos, sin = torch.cat((angle, angle), -1).cos().to(dtype), torch.cat((angle, angle), -1).sin().to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            views = [(c.clone()[1:], c.clone()[1:]) for c in caches]  # rows 1.. of the cache: strided views
            keys, values = views[0][0], views[1][0]
            assert decode_kernels.attn_usable(x, weights[0], wo, keys, group, tokens)
            got = decode_kernels.attn_step(x, weights, biases, wo, cos[:, None], sin[:, None], pos, lens, keys,
                                           values)
            keys2, values2 = views[0][1], views[1][1]
            q, k, v = decode_kernels.linear(x, weights, biases).split([h * d, kv * d, kv * d], -1)
            att = decode_kernels.decode_step(q, k, v, cos[:, None], sin[:, None], pos, lens, keys2, values2)
            want = decode_kernels.linear(att, (wo,), (None,))
    finally:
        torch.set_num_threads(before)
    assert got.shape == (rows, tokens, e) and got.dtype == dtype
    assert torch.equal(got, want) and torch.equal(keys, keys2) and torch.equal(values, values2)
