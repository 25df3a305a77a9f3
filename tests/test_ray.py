"""Ray actors as rollout workers. The native engine's: the same tokens as local processes and
the in-process engine, a killed actor reported with its rank and step, and a GRPO run identical
to a local one. vLLM engines on Ray (`--engine vllm --workers 2`, tailrl.rollout.vllm.fleet): an
engine killed mid-rollout is replaced, its requests decoded again, and the replacement decodes
and drafts with the current policy and drafter version (the rest of the Rollout contract is the
in-process engine's, test_engine_contract.py, which each actor runs). One local Ray (2 CPUs, no
dashboard) serves the whole module."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from conftest import exact_fp32_configs, same_run, write_sharp_llama
from rollout_helpers import (
    GREEDY,
    PARAMS,
    drafting,
    grouped_requests,
    is_greedy_chain,
    opened,
    paired_requests,
    perturbed,
    reference,
    start_pool,
)

from tailrl.loading import load_model
from tailrl.model import Transformer
from tailrl.pipeline import run_config
from tailrl.rl.run_dir import RunDir
from tailrl.rl.train import train
from tailrl.rollout.native.spot import SpotConfig
from tailrl.rollout.protocol import WorkerError
from tailrl.rollout.workers import WorkerConfig
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import Drafter, save_drafter
from tailrl.speculative.modes import RolloutSpeculationConfig

pytestmark = pytest.mark.usefixtures("no_plots")

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def target(tiny_dir) -> Transformer:
    """The tiny random model in fp32 (as test_workers.py's workers decode it)."""
    return load_model(tiny_dir, dtype="fp32")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Transformer:
    """conftest.write_sharp_llama's model (as test_engine_contract.py's engines decode it)."""
    path = tmp_path_factory.mktemp("contract-llama")
    write_sharp_llama(path)
    return load_model(path, "fp32")


def test_ray_workers_give_the_in_process_tokens(target):
    reqs = grouped_requests()
    pool = start_pool(WorkerConfig(workers=2, ray=True), SpotConfig(), target)
    try:
        got = pool.generate(1, reqs, PARAMS, 20)
        assert [c.token_ids for c in got] == [c.token_ids for c in reference(target, reqs)]
        # Publishing new weights reaches the actors: a perturbed policy samples other tokens,
        # the same ones as an in-process engine on that policy.
        import copy

        import torch

        changed = copy.deepcopy(target)
        with torch.no_grad():
            for p in changed.parameters():
                p.add_(0.05 * torch.randn_like(p))
        pool.publish(changed)
        reqs2 = grouped_requests(step=2)
        got2 = pool.generate(2, reqs2, PARAMS, 20)
        assert [c.token_ids for c in got2] == [c.token_ids for c in reference(changed, reqs2)]
        assert [c.token_ids for c in got2] != [c.token_ids for c in reference(target, reqs2)]
    finally:
        pool.close()


def test_a_killed_ray_actor_is_reported_with_rank_and_step(target):
    pool = start_pool(WorkerConfig(workers=2, ray=True), SpotConfig(), target)
    try:
        os.kill(pool.runtime.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"^worker 1 died \(Ray actor: .*\) in step 5$"):
            pool.generate(5, grouped_requests(), PARAMS, 20)
    finally:
        pool.close()


def test_a_run_on_ray_actors_is_the_local_run(straight_fp32, tmp_path, char_model_dir, task_file):
    configs = exact_fp32_configs(char_model_dir, task_file)
    configs["workers"] = WorkerConfig(workers=2, ray=True)
    train(run_config(configs), tmp_path / "ray")
    assert same_run(RunDir(tmp_path / "ray").read_metrics(), RunDir(straight_fp32).read_metrics())


def test_vllm_on_ray_is_chosen_sized_and_refuses_another_layouts_checkpoint(model):
    """What a run asks of `--engine vllm --workers 2` before any engine starts: engines on Ray,
    each holding its KV cache and a copy of the weights, plus the object store's copy; a
    checkpoint of another layout refused in one line. (No actor starts: the default selection's
    check of the fleet; the kill test below is slow.)"""
    from tailrl.memory import parameters_gb
    from tailrl.rollout import registry
    from tailrl.rollout.native.pool import NativeRolloutState
    from tailrl.rollout.vllm.fleet import VllmFleet
    from tailrl.rollout.vllm.settings import VllmSettings

    cfg = registry.rollout_config("vllm", {"vllm": VllmSettings(kv_cache_gb=1.0), "workers": WorkerConfig(workers=2)},
                                  GREEDY)
    assert cfg.on_ray and cfg.describe().startswith("on 2 vLLM engine(s) on Ray")
    weights = parameters_gb(model)
    assert cfg.memory(model, 64, 512).gb == pytest.approx(2 * (1.0 + weights) + weights)
    assert not registry.rollout_config("vllm", {}, GREEDY).on_ray
    with pytest.raises(ValueError, match=r"^this checkpoint holds NativeRolloutState, not vLLM engines on Ray's state: "
                                         r"resume it with the --engine and --workers it was saved with$"):
        VllmFleet.start(model, 0, NativeRolloutState([None], [[]], None, {}), spec=cfg.engine_spec(model, 0),
                        workers=cfg.workers, max_restarts=3, adapt=cfg.adapt)


@pytest.mark.slow  # ~50 s on a 2-core AVX2 EPYC: three engine starts, each importing vLLM (~10 s)
def test_an_engine_killed_mid_rollout_is_replaced_and_drafts_with_the_current_version(model, tmp_path):
    """Two engines, a learned drafter adapting on the trainer's forwards (version 1 published
    after step 2, as in the contract suite). Both engines' shares hold the same prompts, so
    each engine's drafting counts are half a step's: step 2 (version 0) and step 3 (version 1)
    drafting differently shows that a share's counts tell the versions apart. In step 4 engine 1
    is stopped (SIGSTOP) before it decodes anything and killed once engine 0 has finished its
    whole share, so the kill lands mid-rollout whatever the machine's speed: the step still
    returns every sample, each the new policy's greedy chain, counts one restart, and drafts
    exactly as step 3 did: the replacement drafts with version 1."""
    pytest.importorskip("vllm", reason="the vllm engine needs vLLM installed (pip install 'tailrl[vllm]')")
    save_drafter(Drafter.from_target(model, list(range(96)), "target", seed=0), tmp_path / "v0")
    new = perturbed(model)
    half = paired_requests(8, 8)
    reqs = half + [dataclasses.replace(r, seed=r.seed + 100) for r in half]
    spec = RolloutSpeculationConfig(spec="on", drafter=str(tmp_path / "v0"), draft_depth=3, num_draft_tokens=3)
    with opened("vllm", model, speculation=spec, workers=WorkerConfig(workers=2),
                adapt=AdaptConfig(drafter_lr=1e-2, drafter_min_steps=4)) as fleet:
        fleet.publish(model)
        drafting(fleet, reqs, 1, observed_by=model)
        fleet.publish(new)
        step2, _ = drafting(fleet, reqs, 2, observed_by=new)
        fleet.publish(new)  # trains version 1 on step 1's forwards and pushes it to both engines
        step3, _ = drafting(fleet, reqs, 3)
        assert step3[0] == step2[0] and step3[1:3] != step2[1:3] and (step2[3], step3[3]) == (0, 1)
        engine1 = fleet.pids[1]
        os.kill(engine1, signal.SIGSTOP)
        finished = []

        def kill_engine_1(i, completion):
            finished.append(i)
            if len(finished) == len(half):  # engine 0's share: engine 1 has decoded nothing
                os.kill(engine1, signal.SIGKILL)

        out = fleet.generate(4, reqs, GREEDY, 24, on_finished=kill_engine_1)
        report = fleet.report()
        assert sorted(finished) == list(range(len(reqs)))  # each once
        assert all(is_greedy_chain(new, c, 24) for c in out)
        assert (report.engine_restarts, report.drafter_version) == (1, 1)
        assert fleet.pids[1] != engine1
        step4 = ([c.token_ids for c in out], report.spec_verify_steps, report.accept_hist, report.drafter_version)
        assert step4 == step3
