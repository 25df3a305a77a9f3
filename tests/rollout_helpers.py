"""Helpers the rollout tests share (test_engine_contract.py, test_workers.py, test_ray.py): an
engine opened as a run opens it, requests, the reference decodings a rollout's tokens are checked
against, a policy moved as an update moves it, and sampled responses as drafter training data.
Fixtures live in conftest.py; this module holds plain functions, so no test module imports
another."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch

from tailrl.engine import Engine, EngineConfig
from tailrl.model import Transformer
from tailrl.records import Completion, Request
from tailrl.rl.packing import Sample, packed_logprobs_and_hidden
from tailrl.rl.phases import policy_forwards
from tailrl.rollout import registry
from tailrl.rollout.native.config import NativeRolloutConfig
from tailrl.rollout.native.pool import NativeRolloutState, WorkerPool
from tailrl.rollout.protocol import Rollout
from tailrl.rollout.workers import WorkerConfig
from tailrl.sampling import SamplingParams, derive_seed
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.training import TrainSeq
from tailrl.speculative.modes import SpeculationConfig
from tailrl.speculative.report import chain_ceiling
from tailrl.tuner import TunerConfig

GREEDY = SamplingParams(temperature=0.0)
SLOTS = 8  # fewer than the requests: sequences queue, and slots are refilled
PARAMS = SamplingParams(temperature=1.0)


def own_sections(engine: str, same_run: bool = False) -> dict[str, object]:
    """Each engine's own section, small: a vLLM engine starts in ~2 s with 64 MiB of KV cache
    instead of ~10 s with its default share of memory. same_run: what makes two runs of one
    seed the same run (resume): exact mode on the native engine (its recorded log-probs
    otherwise move with the batch's split), greedy drafts on vLLM (its probabilistic drafts come
    from torch's global generator, which a restarted engine does not repeat: docs/vllm.md)."""
    if engine == "vllm":
        from tailrl.rollout.vllm.settings import VllmSettings

        return {"vllm": VllmSettings(kv_cache_gb=1 / 16, max_num_seqs=SLOTS,
                                     draft_sampling="greedy" if same_run else "probabilistic")}
    return {"engine": EngineConfig(max_batch=SLOTS, exact=same_run)}


@contextlib.contextmanager
def opened(engine: str, model: Transformer, **sections: object) -> Iterator[Rollout]:
    """The engine's rollout as a run opens it, from its sections by name, on a copy of `model`
    (an in-process engine decodes with the model it is given, and publishing writes into it)."""
    config = registry.rollout_config(engine, {**own_sections(engine), **sections}, GREEDY)
    rollout = config.open(copy.deepcopy(model), seed=0)
    try:
        yield rollout
    finally:
        rollout.close()


def paired_requests(prompt_len: int = 6, n: int = 12) -> list[Request]:
    """n requests in groups of 2 (siblings share a prompt)."""
    g = torch.Generator().manual_seed(prompt_len)
    prompts = [tuple(torch.randint(2, 96, (prompt_len,), generator=g).tolist()) for _ in range(n // 2)]
    return [Request(prompts[i // 2], seed=1000 + i, group=i // 2) for i in range(n)]


def argmax_chain(model: Transformer, c: Completion) -> list[int]:
    """The argmax of the reference forward (one no-cache forward over prompt + response) at each
    of the response's positions. Greedy decoding emitted token k from the prefix before it, so
    its tokens are the chain exactly when they equal these (by induction over k)."""
    ids = torch.tensor([list(c.prompt_ids) + c.token_ids[:-1]])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None])[0, len(c.prompt_ids) - 1:]
    return logits.argmax(-1).tolist()


def is_greedy_chain(model: Transformer, c: Completion, max_new_tokens: int) -> bool:
    """Tokens equal the argmax chain, ending at EOS (1) or at the length limit."""
    ended = c.finish_reason == "eos" and c.token_ids[-1] == 1 or \
        c.finish_reason == "length" and len(c.token_ids) == max_new_tokens
    return c.token_ids == argmax_chain(model, c) and ended


def perturbed(model: Transformer, scale: float = 0.3) -> Transformer:
    """A copy of `model` with every weight moved by `scale` of its spread: an update's new policy."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return out


def drafting(rollout: Rollout, reqs: list[Request], step: int, observed_by: Transformer | None = None
             ) -> tuple[tuple[list[list[int]], int, list[int], int], list[Completion]]:
    """A greedy call's tokens and how it drafted (verifies, acceptance histogram, drafter
    version), and its completions; observed_by: the policy whose forwards of these responses the
    rollout is then handed, as the loop hands them."""
    out, report = rollout.generate(step, reqs, GREEDY, 24), rollout.report()
    # Every verify drafted a 3-chain (the tests' fixed shape), so the ceiling beside its accept_len
    # is the target's own 3-chain on these responses.
    assert report.spec_draft_depth == 3.0
    assert report.spec_accept_ceiling == pytest.approx(chain_ceiling([c.top1 for c in out], 3), rel=1e-12)
    if observed_by is not None:
        observe(rollout, observed_by, out)
    return ([c.token_ids for c in out], report.spec_verify_steps, report.accept_hist, report.drafter_version), out


def observe(rollout: Rollout, policy: Transformer, out: list[Completion]) -> None:
    """Hand the rollout what the trainer's forwards compute for these responses, as the loop does."""
    samples = [Sample(c.prompt_ids, c.token_ids, 1.0, c.logprobs) for c in out]
    with torch.no_grad():
        rollout.feed().observe(policy_forwards(samples, packed_logprobs_and_hidden(policy, samples, 1.0)[1]))


def grouped_requests(step: int = 1, prompts: int = 3, group: int = 4) -> list[Request]:
    """`prompts` prompts of 4, 7, 10, ... tokens, `group` requests each, seeded as a run seeds step `step`."""
    g = torch.Generator().manual_seed(step)
    ps = [tuple(torch.randint(2, 96, (4 + 3 * i,), generator=g).tolist()) for i in range(prompts)]
    return [Request(ps[i], derive_seed(7, step, i, j), group=i) for i in range(prompts) for j in range(group)]


def reference(target, reqs, max_new_tokens=20):
    return Engine(target, EngineConfig()).generate(reqs, PARAMS, max_new_tokens)


def start_pool(workers: WorkerConfig, adapt: AdaptConfig, target: Transformer,
               spec: SpeculationConfig = SpeculationConfig(), state: NativeRolloutState | None = None) -> WorkerPool:
    """The native rollout on `workers`, as a run opens it (seed 0)."""
    return NativeRolloutConfig(EngineConfig(max_batch=8), spec, TunerConfig(), adapt, workers).open(target, 0, state)


def train_seqs(model: Transformer, reqs: list[Request], params: SamplingParams, max_new_tokens: int) -> list[TrainSeq]:
    """The model's responses to reqs as drafter training data: the prompt's hidden states from one
    forward, the response's as the engine kept them while sampling."""
    outs = Engine(model, EngineConfig(capture_hidden=True)).generate(reqs, params, max_new_tokens)
    result = []
    with torch.no_grad():
        for r, c in zip(reqs, outs):
            p = torch.tensor([r.prompt_ids])
            hp = model.hidden(p, torch.arange(p.shape[1])[None])[0, :-1]
            tokens = torch.tensor(list(r.prompt_ids) + c.token_ids)
            result.append(TrainSeq(tokens, torch.cat([hp, c.hidden]), p.shape[1]))
    return result
