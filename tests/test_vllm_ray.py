"""vLLM engines on Ray (`--engine vllm --workers 2`, tailrl.rollout.vllm.fleet): an engine killed
mid-rollout is replaced, its requests decoded again, and the replacement decodes and drafts
with the current policy and drafter version. The rest of the Rollout contract is the in-process
engine's (test_engine_contract.py): the fleet runs that engine in each actor."""

from __future__ import annotations

import copy
import os
import signal

import pytest

from test_engine_contract import GREEDY, drafting, is_greedy_chain, model, opened, perturbed, requests  # noqa: F401

from tailrl.rollout.workers import WorkerConfig
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import Drafter, save_drafter
from tailrl.speculative.modes import RolloutSpeculationConfig

pytest.importorskip("vllm", reason="the vllm engine needs vLLM installed (pip install 'tailrl[vllm]')")
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    yield
    ray.shutdown()


def test_an_engine_killed_mid_rollout_is_replaced_and_drafts_with_the_current_version(model, tmp_path):  # noqa: F811
    """Two engines, a learned drafter adapting on the trainer's forwards (version 1 published
    after step 2, as in the contract suite). In step 3 engine 1 is stopped (SIGSTOP) before it
    decodes anything and killed once engine 0 has finished its whole share, so the kill lands
    mid-rollout whatever the machine's speed: the step still returns every sample, each the new
    policy's greedy chain, and counts one restart. In step 4 the fleet, its replaced engine
    included, decodes and drafts exactly as an in-process engine opened from the new policy
    and version 1's files."""
    save_drafter(Drafter.from_target(model, list(range(96)), "target", seed=0), tmp_path / "v0")
    new = perturbed(model)
    reqs = requests(8, 16)
    spec = RolloutSpeculationConfig(spec="on", drafter=str(tmp_path / "v0"), draft_depth=3, num_draft_tokens=3)
    with opened("vllm", model, speculation=spec, workers=WorkerConfig(workers=2),
                adapt=AdaptConfig(drafter_lr=1e-2, drafter_min_steps=4)) as fleet:
        fleet.publish(model)
        drafting(fleet, reqs, 1, observed_by=model)
        fleet.publish(new)
        drafting(fleet, reqs, 2, observed_by=new)
        fleet.publish(new)  # trains version 1 on step 1's forwards and pushes it to both engines
        assert fleet.report().drafter_published == 1
        engine1 = fleet.pids[1]
        os.kill(engine1, signal.SIGSTOP)
        finished = []

        def kill_engine_1(i, completion):
            finished.append(i)
            if len(finished) == len(reqs) // 2:  # engine 0's share: engine 1 has decoded nothing
                os.kill(engine1, signal.SIGKILL)

        out3 = fleet.generate(3, reqs, GREEDY, 24, on_finished=kill_engine_1)
        report = fleet.report()
        assert sorted(finished) == list(range(len(reqs)))  # each once
        assert all(is_greedy_chain(new, c, 24) for c in out3)
        assert (report.engine_restarts, report.drafter_version) == (1, 1)
        assert fleet.pids[1] != engine1
        step4, _ = drafting(fleet, reqs, 4)
        save_drafter(fleet.adapt.learner.drafter, tmp_path / "v1")
    spec1 = RolloutSpeculationConfig(spec="on", drafter=str(tmp_path / "v1"), draft_depth=3, num_draft_tokens=3)
    with opened("vllm", copy.deepcopy(new), speculation=spec1, adapt=AdaptConfig(adapt_drafter=False)) as fresh:
        started, _ = drafting(fresh, reqs, 1)
    assert step4[0] == [c.token_ids for c in out3]
    assert step4[:3] == started[:3] and (step4[3], started[3]) == (1, 0)
