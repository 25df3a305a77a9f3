"""The native model against transformers' implementation, and KV-cache decode against a full forward.

Tolerance: fp32 throughout. The two implementations do the same arithmetic in a different
order (fused vs split projections, matmul vs SDPA attention), so logits differ by float
rounding only: ~1e-6 relative on these sizes. We assert max |diff| <= 1e-4 absolute on logits
of magnitude ~1-30, which a real bug (a wrong RoPE layout, a missing bias or norm, an off-by-one
position) exceeds by orders of magnitude.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import build_hf

import tailrl.kv_cache as kv_cache_module
from tailrl import decode_kernels
from tailrl.engine import EngineConfig
from tailrl.kv_cache import CacheView, KVCache, row_segments
from tailrl.linears import PACKED_DTYPES
from tailrl.loading import ModelError, load_model

ATOL = 1e-4


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("qwen2", {}),
        ("qwen3", {}),
    ],
)
def test_logits_match_transformers(tmp_path, kind, extra):
    hf = build_hf(kind, **extra)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype="fp32")
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, pos)
    assert (got - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("kernel", ["1", "0"])  # decode steps in the compiled kernel, or SDPA
@pytest.mark.parametrize("rows", [3, 1])  # one row: SDPA's decode steps take its unmasked path
@torch.no_grad()  # as the engine decodes: the kernels have no backward
def test_cached_decode_equals_full_forward(tiny_dir, monkeypatch, rows, kernel):
    monkeypatch.setenv(decode_kernels.SWITCH, kernel)
    model = load_model(tiny_dir, dtype="fp32")
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (3, 30))[:rows]
    pos = torch.arange(30).expand(rows, 30)
    full = model(ids, pos)
    cache = KVCache(model.cfg, slots=rows, capacity=64, dtype=torch.float32, device="cpu")
    # Prefill 20 tokens, then decode the remaining 10 one at a time.
    mask = torch.ones(20, 20).tril().bool().expand(rows, 20, 20)
    out = [model(ids[:, :20], pos[:, :20], CacheView(cache, 0, pos[:, :20], 20, mask))]
    for t in range(20, 30):
        m = torch.ones(rows, 1, t + 1, dtype=torch.bool)
        out.append(model(ids[:, t : t + 1], pos[:, t : t + 1], CacheView(cache, 0, pos[:, t : t + 1], t + 1, m)))
    assert (torch.cat(out, 1) - full).abs().max().item() <= ATOL


def test_row_segments_minimise_keys_read_plus_calls():
    """Hand-computed: a range costs rows x its longest row's keys, plus `cost` per range."""
    assert row_segments([10, 10, 10], 5) == [(0, 3, 10)]
    assert row_segments([100, 100, 1, 1], 5) == [(0, 2, 100), (2, 4, 1)]  # 212 against 405 whole
    assert row_segments([1, 100, 1], 50) == [(0, 1, 1), (1, 2, 100), (2, 3, 1)]  # 252 against 301, 350
    assert row_segments([1, 100, 1], 100) == [(0, 3, 100)]  # 400 against 401, 402


# The decode steps' attention: the compiled kernel (tailrl.decode_kernels), or SDPA over row
# groups with `cost` (0: a group per distinct length).
@pytest.mark.parametrize("kernel,cost",
                         [("1", kv_cache_module.SEGMENT_COST_KEYS), ("0", 0), ("0", kv_cache_module.SEGMENT_COST_KEYS)])
@torch.no_grad()  # as the engine decodes: the kernels have no backward
def test_rows_of_different_lengths_equal_their_own_full_forward(tiny_dir, monkeypatch, kernel, cost):
    """A right-padded prefill of prompts of 7, 30 and 15 tokens, then 5 decode steps each at its
    own position: every row's logits are those of a full forward over that row alone. With the
    kernel, each decode step's attention (`decode_step`, or `attn_step` where the few-row loop
    takes its projections too: fp32 on AMD CPUs) and norms are counted to have gone through it."""
    calls = []

    def counting(name):
        real = getattr(decode_kernels, name)
        monkeypatch.setattr(decode_kernels, name, lambda *args: calls.append(name) or real(*args))

    counting("decode_step")
    counting("attn_step")
    counting("add_rms_norm")
    monkeypatch.setenv(decode_kernels.SWITCH, kernel)
    monkeypatch.setattr(kv_cache_module, "SEGMENT_COST_KEYS", cost)
    model = load_model(tiny_dir, dtype="fp32")
    torch.manual_seed(0)
    lens, steps = torch.tensor([7, 30, 15]), 5
    prompts, fed = torch.randint(0, 96, (3, 30)), torch.randint(0, 96, (3, steps))
    cache = KVCache(model.cfg, slots=3, capacity=64, dtype=torch.float32, device="cpu")
    pos = torch.arange(30).expand(3, 30)
    mask = torch.ones(30, 30).tril().bool()[None] & (pos < lens[:, None])[:, None]
    got = [model(prompts, pos, CacheView(cache, 0, pos, 30, mask))[torch.arange(3), lens - 1][:, None]]
    for t in range(steps):
        at = lens + t  # (3,) each row's next position
        m = (torch.arange(int(at.max()) + 1)[None] <= at[:, None])[:, None]
        got.append(model(fed[:, t : t + 1], at[:, None], CacheView(cache, 0, at[:, None], int(at.max()) + 1, m)))
    got = torch.cat(got, 1)  # (3, 1 + steps, V)
    built = decode_kernels.library() is not None
    through = kernel == "1" and built
    assert calls.count("decode_step") + calls.count("attn_step") == (steps * model.cfg.num_layers if through else 0)
    assert calls.count("add_rms_norm") == (2 * (1 + steps) * model.cfg.num_layers if through else 0)  # prefill too
    for i in range(3):
        own = torch.cat([prompts[i, : lens[i]], fed[i]])
        full = model(own[None], torch.arange(len(own))[None])[0, lens[i] - 1 :]
        assert (got[i] - full).abs().max().item() <= ATOL


@pytest.mark.parametrize("kernel", ["1", "0"])
@torch.no_grad()
def test_a_chain_verify_equals_the_full_forward(tiny_dir, monkeypatch, kernel):
    """After a right-padded prefill of 7, 30 and 15 tokens, one forward of 4 tokens a row, token t
    at the row's position L + t over its prefix (a chain's verify): every row's logits are those
    of a full forward over that row alone, and with the kernel each layer's attention went
    through it once (`decode_step`, or `attn_step` with the projections where the few-row loop
    takes them: the 3-row plain step on AMD CPUs). The verify's cache writes are then what a full
    forward computes: a plain step after it agrees too. (fp32; the kernel's bf16 arithmetic:
    test_decode_kernels.py.)"""
    calls = []
    for name, at in (("decode_step", 5), ("attn_step", 6)):  # at: the new tokens' cache positions (B, T)
        real = getattr(decode_kernels, name)
        monkeypatch.setattr(decode_kernels, name, lambda *args, real=real, at=at: calls.append(args[at].shape)
                            or real(*args))
    monkeypatch.setenv(decode_kernels.SWITCH, kernel)
    model = load_model(tiny_dir, dtype="fp32")
    torch.manual_seed(0)
    lens, t = torch.tensor([7, 30, 15]), 4
    prompts, fed = torch.randint(0, 96, (3, 30)), torch.randint(0, 96, (3, t + 1))
    cache = KVCache(model.cfg, slots=3, capacity=64, dtype=torch.float32, device="cpu")
    pos = torch.arange(30).expand(3, 30)
    mask = torch.ones(30, 30).tril().bool()[None] & (pos < lens[:, None])[:, None]
    model(prompts, pos, CacheView(cache, 0, pos, 30, mask))
    calls.clear()
    at = lens[:, None] + torch.arange(t)  # (3, 4)
    chain = torch.arange(int(at.max()) + 1)[None, None] <= at[:, :, None]  # (3, 4, S)
    got = model(fed[:, :t], at, CacheView(cache, 0, at, int(at.max()) + 1, chain))
    nxt = (lens + t)[:, None]
    step = torch.arange(int(nxt.max()) + 1)[None, None] <= nxt[:, :, None]
    got = torch.cat([got, model(fed[:, t:], nxt, CacheView(cache, 0, nxt, int(nxt.max()) + 1, step))], 1)
    through = kernel == "1" and decode_kernels.library() is not None
    assert calls == ([torch.Size([3, t])] * model.cfg.num_layers + [torch.Size([3, 1])] * model.cfg.num_layers
                     if through else [])
    for i in range(3):
        own = torch.cat([prompts[i, : lens[i]], fed[i]])
        full = model(own[None], torch.arange(len(own))[None])[0, lens[i] :]
        assert (got[i] - full).abs().max().item() <= ATOL


def test_a_kernel_that_cannot_be_built_is_said_once_in_one_line(tmp_path, monkeypatch, caplog):
    """A compiler that fails (here a script that writes an error and exits 1): library() is None,
    the model keeps torch's path, and the log says so once, in one line, with the compiler's
    error; asked again, the process does not try (or say it) again."""
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: error: unrecognized command-line option' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path / "cache"))  # no library built before for this compiler
    decode_kernels.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=decode_kernels.__name__):
            assert decode_kernels.library() is None and decode_kernels.library() is None
    finally:
        decode_kernels.library.cache_clear()  # the next caller builds (or loads) the real one
    said = [r.getMessage() for r in caplog.records if r.name == decode_kernels.__name__]
    assert len(said) == 1 and "\n" not in said[0] and "unrecognized command-line option" in said[0], said


def test_one_row_with_a_hidden_key_is_masked(tiny_dir):
    """The unmasked shortcut is only for a row that sees every key: hiding key 5 from a
    one-row decode step must give what the same row gets beside a second, unmasked row."""
    model = load_model(tiny_dir, dtype="fp32")
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 21))
    pos = torch.arange(21).expand(2, 21)
    cache = KVCache(model.cfg, slots=2, capacity=64, dtype=torch.float32, device="cpu")
    model(ids[:, :20], pos[:, :20],
          CacheView(cache, 0, pos[:, :20], 20, torch.ones(20, 20).tril().bool().expand(2, 20, 20)))
    m = torch.ones(2, 1, 21, dtype=torch.bool)
    m[0, 0, 5] = False
    both = model(ids[:, 20:], pos[:, 20:], CacheView(cache, 0, pos[:, 20:], 21, m))
    alone = model(ids[:1, 20:], pos[:1, 20:], CacheView(cache, 0, pos[:1, 20:], 21, m[:1]))
    assert (alone - both[:1]).abs().max().item() <= ATOL
    unmasked = model(ids[:1, 20:], pos[:1, 20:],
                     CacheView(cache, 0, pos[:1, 20:], 21, torch.ones(1, 1, 21, dtype=torch.bool)))
    assert (alone - unmasked).abs().max().item() > 100 * ATOL  # the hidden key mattered


def test_smollm2_matches_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = load_model(smollm2_dir, dtype="fp32")
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 28, 1117, 4863, 28, 7018]])
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, torch.arange(ids.shape[1])[None])
    # Logits of the 49k vocabulary reach ~40 in magnitude; 30 layers of rounding stay < 1e-3.
    assert (got - ref).abs().max().item() <= 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_bad_model_dirs(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelError, match="unsupported model_type"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 8}')
    with pytest.raises(ModelError, match="malformed model config"):
        load_model(tmp_path)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_token_logits_do_not_depend_on_the_forward_shape(smollm2_shallow_dir, dtype):
    """The row invariance lossless SD relies on (tailrl.model docstring): a token's logits are bit
    for bit the same fed alone, with 4 draft tokens after it, beside rows of other lengths (which
    set the number of keys attended), or at the end of a tree branch whose ancestors sit at
    non-consecutive cache positions, in exact mode. Without it (fixed row blocks, chunked_pv, the
    fp64 softmax normaliser) they differ by ~1e-5 in fp32 on this project's CPUs (1-2 threads),
    and in bf16 (the rollout dtype on CPUs with AVX512-BF16 / AMX) by whole bf16 steps.

    On SmolLM2 cut to two layers (conftest.smollm2_shallow_dir): the property holds matmul by
    matmul, and every matmul here has the full model's shapes (rows, keys, features, the 49k
    vocabulary head), so depth adds cost, not cases. With exact=False this test fails on the
    two-layer model too, in fp32 and bf16 (measured on a Zen 5 EPYC)."""
    model = load_model(smollm2_shallow_dir, dtype=dtype)
    torch.manual_seed(0)
    tokens = torch.randint(100, 30000, (4, 700))
    prompt_lens = [290, 293, 407, 630]  # row 0 is the one compared; the others span key chunks

    def prefilled(rows: int) -> KVCache:
        cache = KVCache(model.cfg, slots=rows, capacity=704, dtype=model.lm_head.weight.dtype, device="cpu")
        for b in range(rows):
            n = prompt_lens[b]
            pos = torch.arange(n)[None]
            model.hidden(tokens[b : b + 1, :n], pos, CacheView(cache, b, pos, n, torch.ones(1, n, n).tril().bool()),
                         exact=True)
        return cache

    def logits_of_row0(rows: int, t: int) -> torch.Tensor:  # [token, t - 1 drafts] per row, causal
        cache = prefilled(rows)
        write = torch.stack([prompt_lens[b] + torch.arange(t) for b in range(rows)])  # (rows, t)
        ids = torch.stack([tokens[b, prompt_lens[b] : prompt_lens[b] + t] for b in range(rows)])
        kv_len = int(write.max()) + 1
        mask = torch.arange(kv_len)[None, None] <= write[:, :, None]
        return model(ids, write, CacheView(cache, 0, write, kv_len, mask), exact=True)[0]

    with torch.inference_mode():
        alone = logits_of_row0(1, 1)[0]
        assert torch.equal(logits_of_row0(1, 5)[0], alone)  # a verify forward of [token, 4 drafts]
        assert torch.equal(logits_of_row0(4, 1)[0], alone)  # a plain step beside longer rows
        assert torch.equal(logits_of_row0(4, 5)[0], alone)
        # A tree [root, a, x, b] with b under a and x a sibling branch: b sits at cache index
        # n + 3 with its parent at n + 1, while plain decoding has them at n + 2 and n + 1.
        n = prompt_lens[0]
        root, a, b = tokens[0, n], tokens[0, n + 1], tokens[0, n + 2]
        chain = logits_of_row0(1, 3)[2]  # logits after [.., root, a, b], consecutive
        cache = prefilled(1)
        write = torch.tensor([[n, n + 1, n + 2, n + 3]])
        positions = torch.tensor([[n, n + 1, n + 1, n + 2]])
        mask = torch.arange(n + 4)[None, None] < n
        mask = mask.repeat(1, 4, 1)
        for i, ancestors in enumerate(([0], [0, 1], [0, 2], [0, 1, 3])):
            mask[0, i, [n + j for j in ancestors]] = True
        ids = torch.stack([root, a, torch.tensor(999), b])[None]
        tree = model(ids, positions, CacheView(cache, 0, write, n + 4, mask), exact=True)[0, 3]
        assert torch.equal(tree, chain)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_exact_forwards_do_not_depend_on_the_thread_count(smollm2_shallow_dir, dtype):
    """The overlapped update takes a torch thread from an in-process engine in the rollout's tail
    (tailrl.rl.phases), so exact-mode tokens need a row's logits to be the same bits on one thread
    as on two: a prefill of 4 prompts, then a 5-token verify-shaped step per row. Two layers of
    SmolLM2 (conftest.smollm2_shallow_dir) run every kernel shape the full model runs."""
    model = load_model(smollm2_shallow_dir, dtype=dtype)
    torch.manual_seed(1)
    tokens = torch.randint(100, 30000, (4, 80))
    lens = torch.tensor([41, 57, 70, 66])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        cache = KVCache(model.cfg, slots=4, capacity=80, dtype=model.lm_head.weight.dtype, device="cpu")
        p = int(lens.max())
        pos = torch.arange(p)[None].expand(4, p)
        mask = torch.ones(p, p).tril().bool()[None] & (pos < lens[:, None])[:, None]
        h = model.hidden(tokens[:, :p], pos, CacheView(cache, 0, pos, p, mask), exact=True)
        write = lens[:, None] + torch.arange(5)  # (4, 5)
        ids = torch.stack([tokens[b, lens[b] : lens[b] + 5] for b in range(4)])
        step_mask = torch.arange(p + 5)[None, None] <= write[:, :, None]
        logits = model(ids, write, CacheView(cache, 0, write, p + 5, step_mask), exact=True)
        return h, logits

    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = run()
            torch.set_num_threads(2)
            two = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_packed_linears_are_onednns_and_follow_weight_updates(tiny_dir, dtype):
    """Decoding in a PACKED_DTYPES dtype takes oneDNN's prepacked weights (linears.Linear,
    FusedLinears for q, k, v and for gate, up): the bits of oneDNN's linear on the plain weights
    (in bf16 those are F.linear's; in fp32 F.linear is MKL's, within rounding), before and after
    the weights change in place (a published update), and a deep copy (held-out evaluation)
    packs its own."""
    import copy

    model = load_model(tiny_dir, dtype=dtype)
    if model.lm_head.weight.dtype not in PACKED_DTYPES:
        pytest.skip(f"{dtype} linears are not prepacked on this CPU")

    def onednn(x, layer):
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")

    layer0 = model.model.layers[0]
    attn, mlp = layer0.self_attn, layer0.mlp
    x = torch.randn(3, 5, model.cfg.hidden_size).to(model.lm_head.weight.dtype)
    for _ in range(2):
        with torch.inference_mode():
            for fused, layers in ((attn.qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj)),
                                  (mlp.gate_up(x), (mlp.gate_proj, mlp.up_proj))):
                assert all(torch.equal(f, onednn(x, p)) for f, p in zip(fused, layers))
            head = model.lm_head(x)
            assert torch.equal(head, onednn(x, model.lm_head))
            assert torch.allclose(head, F.linear(x, model.lm_head.weight), rtol=0, atol=1e-5 * float(head.abs().max()))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    twin = copy.deepcopy(model)
    with torch.inference_mode():
        assert torch.equal(twin.lm_head(x), model.lm_head(x))


def test_asking_for_exact_mode_asks_mkl_for_its_strict_mode_unless_the_user_chose(monkeypatch):
    """MKL reads MKL_CBWR at its first call, so exact mode asks for strict CNR as soon as it is
    configured (tailrl.kernels), and only then: the mode slows ordinary fp32 decoding."""
    monkeypatch.delenv("MKL_CBWR", raising=False)
    EngineConfig()
    assert "MKL_CBWR" not in os.environ
    EngineConfig(exact=True)
    assert os.environ["MKL_CBWR"] == "AUTO,STRICT"
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    EngineConfig(exact=True)
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


# Math-library switches that send this CPU down the code path another CPU kind takes (libraries
# only ever narrow their instruction set on request), and the CPU feature that path leaves out.
# MKL computes fp32 matmuls, oneDNN bf16 ones where it has bf16 instructions, torch's own kernels
# the rest (tailrl.kernels).
OTHER_CPU_PATHS = {
    # avx512_bf16 without AMX (AMD Zen 4 / Zen 5): oneDNN's AVX512-BF16 kernels, MKL's AVX2 ones.
    "avx512_bf16": ("amx_bf16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    # AVX2 only (AMD Zen 1): MKL's AVX2 kernels; bf16 falls to torch's own AVX2 kernels (emulated).
    "avx2": ("avx512f", {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                         "ATEN_CPU_CAPABILITY": "avx2"}),
}


@pytest.mark.parametrize("path", sorted(OTHER_CPU_PATHS))
def test_exact_mode_holds_on_the_code_paths_of_other_cpu_kinds(path):
    """Exact mode's two properties (the same bits whatever the forward's shape or the thread
    count) depend on the kernels each library picks for this CPU, so a result on one CPU kind is
    not one on another: a thread-count dependence on Intel's MKL path went unseen on AMD machines.
    This reruns both tests in a fresh process with the libraries capped to another kind's path
    (docs/testing.md), and with MKL_CBWR left to what tailrl sets, as in a user's process."""
    above, caps = OTHER_CPU_PATHS[path]
    if above not in _cpu_flags():
        pytest.skip(f"this CPU has no {above}: its own code path is {path}'s or below it, and the suite runs that one")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | caps
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "forward_shape or thread_count"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
