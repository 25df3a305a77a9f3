"""TLT inside TRL's GRPOTrainer (tailrl.trl) on a tiny model: three GRPO steps with TLT on (the
tuner choosing draft lengths), then what the engine drafts with, what policy it decodes, and
what it samples.

One trainer run (module fixture) on a tiny random Llama with a character-level tokenizer, its
head sharpened so that greedy choices are no near-ties between two engines' fp32 kernels, the
engine in fp32, and a fresh learned drafter over half the vocabulary; every check reads that
run. The distribution check is a KS test at false-failure probability 0.001 (the asymptotic
bound on sqrt(n) D, as tests/test_vllm_cpu_fix.py); the equalities are exact.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("vllm")

from conftest import TRL_MIN_STEPS, TRL_STEPS, tiny_trl_run, trl_prompts  # noqa: E402
from distribution_checks import KS_CRIT, ks_distance, pit  # noqa: E402

from tailrl.records import Request  # noqa: E402
from tailrl.rollout.vllm.config import VllmRolloutConfig  # noqa: E402
from tailrl.rollout.vllm.internals import draft_length_lookup  # noqa: E402
from tailrl.rollout.vllm.settings import VllmSettings  # noqa: E402
from tailrl.sampling import SamplingParams  # noqa: E402
from tailrl.speculative.drafter.learner import AdaptConfig  # noqa: E402
from tailrl.speculative.modes import SpeculationConfig  # noqa: E402

K = 4  # draft tokens per verify


def spec_counters(llm) -> tuple[int, int]:
    """vLLM's own Prometheus counters of the engine's drafts and accepted draft tokens so far."""
    metrics = llm.get_metrics()
    return tuple(sum(m.value for m in metrics if m.name == name)
                 for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"))


def count_generate_calls(gen) -> list[tuple[int, int]]:
    """Each of the trainer's generate calls from now on, as vLLM's own counters (not tailrl's
    stat logger) count its drafts and accepted tokens: the list the calls fill."""
    counted: list[tuple[int, int]] = []
    own = gen.generate

    def generate(*args, **kwargs):
        before = spec_counters(gen.llm)
        out = own(*args, **kwargs)
        after = spec_counters(gen.llm)
        counted.append((after[0] - before[0], after[1] - before[1]))
        return out

    gen.generate = generate
    return counted


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train TRL_STEPS GRPO steps with TLT; then, with the trained policy and the adapted drafter:
    greedy and T = 1 responses of the TRL trainer's engine, the trainer model's own greedy
    responses, and greedy responses of tailrl's vLLM engine started from the saved drafter version."""
    from vllm import SamplingParams as VllmSampling
    from vllm.inputs import TokensPrompt

    from tailrl.trl import TLTGRPOTrainer
    from tailrl.trl.policy import policy_view

    tmp = tmp_path_factory.mktemp("trl")
    kwargs = tiny_trl_run(tmp)
    hf = kwargs["model"]
    trainer = TLTGRPOTrainer(**kwargs)
    counted = count_generate_calls(trainer.vllm_generation)
    trainer.train()
    gen = trainer.vllm_generation
    gen.sync_weights()  # the last step's weights, as the next generation would
    prompts = trl_prompts(16)
    try:
        gen.steps.begin()
        # One seed per response: four responses to a prompt under one seed would be one response four times.
        sampled = gen.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(4)],
                                   [VllmSampling(temperature=1.0, max_tokens=32, ignore_eos=True, seed=i)
                                    for i in range(4 * len(prompts))], use_tqdm=False)
        shapes = set(gen.steps.tallies)
        # Then K draft tokens every step, as the fresh engine below drafts: the tuner set aside.
        gen.steps.schedule = None
        draft_length_lookup(gen.llm.llm_engine)[:] = [K] * len(draft_length_lookup(gen.llm.llm_engine))
        gen.steps.begin()
        greedy = gen.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                  VllmSampling(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        greedy_counts = (gen.steps.drafts, gen.steps.accepted)
        version = gen.drafter_version
        saved = trainer.save_drafter(tmp / "adapted")
    finally:
        gen.close()
    with torch.no_grad():
        hf_greedy = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                                 eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    policy = policy_view(hf)
    settings = VllmSettings(kv_cache_gb=1 / 16, max_num_seqs=16, draft_sampling="greedy")
    spec = SpeculationConfig(spec="on", drafter=str(saved), draft_depth=K, num_draft_tokens=K)
    rollout = VllmRolloutConfig(settings, spec, adapt=AdaptConfig(adapt_drafter=False)).open(policy, seed=0)
    try:
        fresh = rollout.generate(1, [Request(p, seed=i, group=i) for i, p in enumerate(prompts)],
                                 SamplingParams(temperature=0.0), 24)
        hist = rollout.report().accept_hist
    finally:
        rollout.close()
    return dict(logs=trainer.state.log_history, counted=counted, version=version, shapes=shapes,
                greedy=[list(o.outputs[0].token_ids) for o in greedy],
                greedy_counts=greedy_counts, sampled=sampled, hf_greedy=hf_greedy, policy=policy,
                fresh=[c.token_ids for c in fresh], fresh_counts=(sum(hist), sum(i * h for i, h in enumerate(hist))))


def test_the_drafter_adapts_and_trls_metrics_say_so(run):
    steps = [h for h in run["logs"] if "loss" in h]
    assert len(steps) == TRL_STEPS
    # One generate call a step; its logged accept_len is tokens per verify as vLLM's own counters
    # give it (float32 in TRL's logs).
    assert [h["tlt/accept_len"] for h in steps] == pytest.approx([1 + a / d for d, a in run["counted"]], rel=1e-6)
    # Training lags a step: the first step's data trains at the end of the second, and version 1
    # drafts at step 3; the micro-steps are logged with the step that ran them.
    assert [h["tlt/drafter_version"] for h in steps] == [0.0, 0.0, 1.0]
    assert [h["tlt/drafter_micro_steps"] for h in steps] == [0.0, float(TRL_MIN_STEPS), float(TRL_MIN_STEPS)]
    assert run["version"] == 2  # trained at the end of the last step, pushed by the sync after it


def test_the_engine_decodes_the_trainers_policy(run):
    """After the sync, the engine's greedy responses are the trainer model's own (fp32)."""
    assert run["greedy"] == run["hf_greedy"]


def test_the_engine_drafts_with_the_pushed_version(run):
    """Greedy drafts of the pushed version in the trainer's engine equal those of a fresh engine
    started from that version's files: the same verifies, the same accepted tokens, the same tokens."""
    drafts, accepted = run["greedy_counts"]
    assert drafts > 0 and accepted > 0
    assert (drafts, accepted) == run["fresh_counts"]
    assert run["fresh"] == run["greedy"]


def test_samples_at_t1_follow_the_trained_policy_with_the_tuner_switching(run):
    """T = 1 responses with the tuner choosing each step's draft length: it drafted at more than
    one length within the call, and every response token's PIT is U(0, 1) (KS, 0.001)."""
    assert len(run["shapes"]) >= 2, run["shapes"]
    g = torch.Generator().manual_seed(11)
    from tailrl.records import Completion

    u = torch.cat([pit(run["policy"], Completion(tuple(o.prompt_token_ids), list(o.outputs[0].token_ids), [], "length",
                                                 0, 0), g) for o in run["sampled"]])
    assert math.sqrt(u.numel()) * ks_distance(u) < KS_CRIT


def test_a_drafter_goes_with_speculation_and_only_with_it(tmp_path):
    from tailrl.speculative.drafter.model import DrafterError
    from tailrl.trl import TLTConfig

    with pytest.raises(ValueError, match="only then"):
        TLTConfig(drafter=None, spec="auto")
    with pytest.raises(ValueError, match="only then"):
        TLTConfig(drafter=tmp_path, spec="off")
    with pytest.raises(DrafterError, match="drafter.json"):
        TLTConfig(drafter=tmp_path)
    assert TLTConfig(drafter=None, spec="off").dtype is None  # vLLM's choice, as TRL leaves it
