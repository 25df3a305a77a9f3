"""Rollout engine: batch invariance, the sampling distribution, stops, hidden capture, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tailrl import cli, engine as engine_mod, memory, model as model_mod
from tailrl.engine import Engine, EngineConfig
from tailrl.kv_cache import KV_CHUNK, KVCache
from tailrl.loading import load_model
from tailrl.records import Request
from tailrl.sampling import SamplingParams, process_logits


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, dtype="fp32")


def _requests(n: int, group_size: int = 1) -> list[Request]:
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(2, 96, size=3 + i % 5)) for i in range(n // group_size)]
    return [Request(prompts[i // group_size], seed=1000 + i, group=i // group_size) for i in range(n)]


@pytest.mark.parametrize("params",
                         [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=20)])
def test_alone_equals_batch_of_64(tiny, params):
    """A sequence's tokens depend on its seed only, not on its batch mates or slot moves."""
    reqs = _requests(64, group_size=4)
    batched = Engine(tiny, EngineConfig(max_batch=64)).generate(reqs, params, 24)
    # Continuous batching: 64 sequences through 5 slots, finishing at different times.
    queued = Engine(tiny, EngineConfig(max_batch=5)).generate(reqs, params, 24)
    solo = Engine(tiny, EngineConfig(max_batch=1))
    for k in (0, 5, 17, 63):
        alone = solo.generate([reqs[k]], params, 24)[0]
        assert alone.token_ids == batched[k].token_ids == queued[k].token_ids
        # fp32 logits differ across batch shapes only by kernel rounding (~1e-6).
        np.testing.assert_allclose(alone.logprobs, batched[k].logprobs, atol=1e-4)
    assert all(a.token_ids == b.token_ids for a, b in zip(batched, queued))
    assert {c.finish_reason for c in batched} <= {"eos", "length"}


def test_batched_prefill_equals_one_prompt_per_forward(tiny, monkeypatch):
    """Distinct prompts of 3-7 tokens prefilled in one right-padded forward give, in exact mode,
    the same bits as one forward per prompt: tokens, logprobs, and the prompt and token hidden
    states a drafter trains on (padding stays masked; each prompt's KV lands in its own slot and
    is copied to its siblings)."""
    reqs = _requests(24, group_size=3)
    params = SamplingParams(temperature=1.0)

    def run():
        engine = Engine(tiny, EngineConfig(max_batch=24, capture_hidden=True, exact=True))
        return engine.generate(reqs, params, 12)

    batched = run()
    monkeypatch.setattr(engine_mod, "PREFILL_TOKENS", 1)  # every prompt alone
    alone = run()
    for a, b in zip(batched, alone):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.prompt_hidden, b.prompt_hidden)


def test_an_exact_engine_leaves_the_model_as_it_was_for_its_other_users(tiny, monkeypatch):
    """Exact mode is the engine's choice of forward, not a switch on the model: while and after an
    exact engine decodes, the same model's ordinary forward (the trainer's, when the policy is
    the rollout model) runs the ordinary kernels, never the fixed row blocks, and gives the bits
    it gave before the engine existed."""
    ids = torch.randint(2, 96, (3, 37), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(37)[None].expand(3, 37)
    with torch.no_grad():
        before = tiny(ids, pos)
    blocks = []
    real = model_mod.blocked
    monkeypatch.setattr(model_mod, "blocked", lambda fn, x, dim: (blocks.append(x.shape), real(fn, x, dim))[1])
    engine = Engine(tiny, EngineConfig(exact=True))
    engine.generate(_requests(4), SamplingParams(temperature=1.0), 8)
    assert blocks  # the engine's own forwards were the row-invariant ones
    blocks.clear()
    with torch.no_grad():
        after = tiny(ids, pos)
    assert not blocks
    assert torch.equal(after, before)


def _chi2_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal score z."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params",
                         [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=10, top_p=0.8)])
def test_sampling_matches_model_distribution(tiny, params):
    """Pearson chi-square goodness of fit of the first sampled token over 6000 seeds.

    Bins with expected count < 5 are pooled. Threshold: the chi-square quantile at z = 4.75
    (one-sided normal tail 1e-6), so this test fails falsely with probability about 1e-6.
    """
    prompt = (5, 17, 42)
    n = 6000
    reqs = [Request(prompt, seed=s, group=0) for s in range(n)]
    out = Engine(tiny, EngineConfig(max_batch=64)).generate(reqs, params, 1)
    counts = np.bincount([c.token_ids[0] for c in out], minlength=96)
    logits = tiny(torch.tensor([prompt]), torch.arange(3)[None])[0, -1:]
    probs = process_logits(logits, params)[0].double().numpy()
    expected = probs * n
    assert counts[expected == 0].sum() == 0  # never a token outside top-k / top-p
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    assert df >= 5
    assert chi2 < _chi2_quantile(df, 4.75), (chi2, df)


def test_stop_callable_and_length(tiny):
    reqs = _requests(8)
    free = Engine(tiny).generate(reqs, SamplingParams(), 20)
    target = free[0].token_ids[4]
    stopped = Engine(tiny).generate(reqs, SamplingParams(), 20, stop=lambda toks: toks[-1] == target)
    for f, s in zip(free, stopped):
        if target in f.token_ids and (f.finish_reason == "length" or f.token_ids.index(target) < len(f.token_ids) - 1):
            cut = f.token_ids.index(target) + 1
            assert s.token_ids == f.token_ids[:cut] and s.finish_reason == "stop"
        else:
            assert s.token_ids == f.token_ids
        assert len(f.token_ids) <= 20 and (f.finish_reason != "length" or len(f.token_ids) == 20)


def test_hidden_capture_matches_full_forward(tiny):
    """Captured hidden row i is the LM-head input that produced token i; prompt rows are kept too."""
    reqs = _requests(6, group_size=3)
    eng = Engine(tiny, EngineConfig(max_batch=4, capture_hidden=True))
    for c in eng.generate(reqs, SamplingParams(), 12):
        ids = list(c.prompt_ids) + c.token_ids
        _, h = tiny(torch.tensor([ids]), torch.arange(len(ids))[None], return_hidden=True)
        p = len(c.prompt_ids)
        torch.testing.assert_close(c.hidden, h[0, p - 1 : p - 1 + len(c.token_ids)], atol=1e-5, rtol=1e-5)


def test_top1_flags_are_the_full_forward_argmax(tiny):
    """Completion.top1[i]: token i is the argmax of a no-cache forward's logits at its position."""
    reqs = _requests(8, group_size=2)
    flags = []
    for c in Engine(tiny, EngineConfig(max_batch=4)).generate(reqs, SamplingParams(temperature=1.0), 12):
        ids = list(c.prompt_ids) + c.token_ids
        logits = tiny(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
        p = len(c.prompt_ids)
        assert c.top1 == (logits[p - 1 : -1].argmax(-1) == torch.tensor(c.token_ids)).tolist()
        flags += c.top1
    assert any(flags) and not all(flags)  # sampled at temperature 1: both kinds occur


def test_kv_budget(tiny):
    # 8 prompt + 16 new + 1 tokens, allocated in whole KV_CHUNKs of positions.
    per_seq = KVCache.bytes_per_token(tiny.cfg, torch.float32) * KV_CHUNK
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Engine(tiny, EngineConfig(kv_budget_gb=per_seq / 2 / 2**30)).generate(_requests(2), SamplingParams(), 16)
    # A budget of three sequences runs everything three at a time, with the same tokens.
    reqs = _requests(7)
    small = Engine(tiny, EngineConfig(kv_budget_gb=3.5 * per_seq / 2**30))
    out = small.generate(reqs, SamplingParams(), 16)
    assert small.cache.slots == 3 and max(r.batch for r in small.stats.timeline) == 3
    assert [c.token_ids for c in out] == [c.token_ids for c in Engine(tiny).generate(reqs, SamplingParams(), 16)]


def _drafting(target):
    """A random drafter drafting trees: the proposer whose per-slot state a preemption must not
    corrupt (its draft KV is rebuilt from the kept hidden states when a sequence returns)."""
    from tailrl.speculative.decoder import fixed
    from tailrl.speculative.drafter.model import Drafter, DrafterProposer
    from tailrl.tuner import Arm

    return fixed(Arm("drafter", draft_depth=3, topk=2, num_draft_tokens=6),
                 DrafterProposer(Drafter.from_target(target, list(range(96)), "tiny", seed=0)))


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "drafter"])
def test_a_full_cache_grows_and_preempts_without_changing_a_bit(tiny, monkeypatch, speculate):
    """A budget that holds 6 sequences of 128 positions but not of their worst case (7 + 300 + the
    verify reserve): the cache starts at 6 x 128, grows as they lengthen (to 256, then 384
    positions, 3 and then 2 slots), preempting the shortest each time; each preempted sequence's
    KV is recomputed on readmission, in pieces (PREFILL_TOKENS made 96). In exact mode every
    completion (tokens, log-probs, hidden states) is the same bits as with room for all."""
    monkeypatch.setattr(engine_mod, "PREFILL_TOKENS", 96)
    reqs, params = _requests(6), SamplingParams(temperature=1.0)
    per_token = KVCache.bytes_per_token(tiny.cfg, torch.float32)

    def run(budget_gb: float) -> tuple[list, Engine]:
        engine = Engine(tiny, EngineConfig(kv_budget_gb=budget_gb, capture_hidden=True, exact=True))
        engine.eos = set()  # every sequence runs to the limit, so the cache must grow
        if speculate:
            engine.decoder = _drafting(tiny)
        return engine.generate(reqs, params, 300), engine

    roomy, room = run(4.0)
    tight, engine = run(6 * KV_CHUNK * per_token / 2**30)
    assert room.stats.preempted == room.stats.cache_resizes == 0
    assert engine.stats.cache_resizes == 2 and engine.stats.preempted == 4
    assert (engine.cache.slots, engine.cache.capacity) == (2, 3 * KV_CHUNK)
    assert max(r.batch for r in engine.stats.timeline) == 6
    # The grown cache is lazily zeroed too, so the slots its sequences left were handed back.
    assert all(memory.is_lazy(kv) and kv.abs().sum().item() == 0.0 for kv in (*engine.cache.k, *engine.cache.v))
    for a, b in zip(roomy, tight):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 300
        assert a.logprobs == b.logprobs
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.prompt_hidden, b.prompt_hidden)


# ---- CLI ----------------------------------------------------------------------------------------

def _cli_error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tailrl: error:") and "\n" not in err, err
    return err


def test_cli_bad_input(tmp_path, tiny_dir, capsys):
    assert "not found" in _cli_error(capsys, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert "not valid JSON" in _cli_error(capsys, ["generate", "--model", str(bad), "--prompt", "x"])
    assert "top_p" in _cli_error(capsys, ["generate", "--model", str(tiny_dir), "--prompt", "x", "--top-p", "0"])
    assert "temperature" in _cli_error(capsys, ["generate", "--model", str(tiny_dir), "--prompt", "x",
                                                "--temperature", "-1"])
    assert "cannot read prompts" in _cli_error(capsys, ["generate", "--model", str(tiny_dir),
                                                        "--prompts", str(tmp_path / "none.jsonl")])
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "ok"}\n{"text": 3}\n')
    assert "p.jsonl:2" in _cli_error(capsys, ["generate", "--model", str(tiny_dir), "--prompts", str(lines)])
    assert "--max-new-tokens" in _cli_error(capsys, ["generate", "--model", str(tiny_dir), "--prompt", "x",
                                                     "--max-new-tokens", "many"])


def test_cli_prompt_longer_than_context(smollm2_dir, capsys):
    err = _cli_error(capsys, ["generate", "--prompt", "hi", "--max-new-tokens", "9000"])
    assert "exceeds the model's context of 8192 tokens" in err


def test_cli_stop_string_ends_the_greedy_sample_and_cuts_its_text(smollm2_dir, capsys):
    """`--stop WORD`: the sample is the greedy one up to the token that completes WORD, its text
    the greedy text cut before WORD's first occurrence."""
    argv = ["generate", "--temperature", "0", "--dtype", "fp32", "--max-new-tokens", "24", "--json", "--prompt",
            "List three prime numbers."]
    assert cli.main(argv) == 0
    full = json.loads(capsys.readouterr().out.splitlines()[0])
    word = full["text"].split()[3]  # a word in the middle: neither the first token nor the last
    assert cli.main([*argv, "--stop", word]) == 0
    cut = json.loads(capsys.readouterr().out.splitlines()[0])
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][:full["text"].find(word)]
    assert 0 < len(cut["token_ids"]) < len(full["token_ids"])
    assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]


def test_cli_greedy_matches_transformers(smollm2_dir, capsys):
    """`tailrl generate --temperature 0 --dtype fp32` == transformers greedy on SmolLM2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ["What is 7 times 8?", "Write a haiku about rain.", "List three prime numbers."]
    argv = ["generate", "--temperature", "0", "--dtype", "fp32", "--max-new-tokens", "24", "--json"]
    for p in prompts:
        argv += ["--prompt", p]
    assert cli.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[-1]["stats"]["tokens"] == sum(len(x["token_ids"]) for x in lines[:-1])
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for p, line in zip(prompts, lines):
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        assert line["token_ids"] == ref, p
