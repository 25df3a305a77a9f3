"""Ray actors as rollout workers: the same tokens as local processes and the in-process engine,
a killed actor reported with its rank and step, and a GRPO run identical to a local one.
One local Ray (2 CPUs, no dashboard) serves the whole module."""

from __future__ import annotations

import os
import signal

import pytest

from tailrl.rl.run_dir import RunDir
from tailrl.rl.train import train
from tailrl.pipeline import run_config
from tailrl.rollout.workers import WorkerConfig
from tailrl.rollout.protocol import WorkerError
from tailrl.rollout.native.spot import SpotConfig
from test_workers import (  # noqa: F401 - target, straight_fp32, task_file, no_plots are fixtures
    PARAMS, exact_fp32_configs, no_plots, reference, requests, same_run, start_pool, straight_fp32, target, task_file,
)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    yield
    ray.shutdown()


def test_ray_workers_give_the_in_process_tokens(target):  # noqa: F811
    reqs = requests()
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
        reqs2 = requests(step=2)
        got2 = pool.generate(2, reqs2, PARAMS, 20)
        assert [c.token_ids for c in got2] == [c.token_ids for c in reference(changed, reqs2)]
        assert [c.token_ids for c in got2] != [c.token_ids for c in reference(target, reqs2)]
    finally:
        pool.close()


def test_a_killed_ray_actor_is_reported_with_rank_and_step(target):  # noqa: F811
    pool = start_pool(WorkerConfig(workers=2, ray=True), SpotConfig(), target)
    try:
        os.kill(pool.runtime.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"^worker 1 died \(Ray actor: .*\) in step 5$"):
            pool.generate(5, requests(), PARAMS, 20)
    finally:
        pool.close()


def test_a_run_on_ray_actors_is_the_local_run(straight_fp32, tmp_path, char_model_dir, task_file):  # noqa: F811
    configs = exact_fp32_configs(char_model_dir, task_file)
    configs["workers"] = WorkerConfig(workers=2, ray=True)
    train(run_config(configs), tmp_path / "ray")
    assert same_run(RunDir(tmp_path / "ray").read_metrics(), RunDir(straight_fp32).read_metrics())
