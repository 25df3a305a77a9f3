"""Rollout workers on a tiny random model: sharding, the data buffer, spot training's preemption,
local processes giving the in-process engine's tokens, drafter versions published after spot
training in a (forced) long tail, the in-process engine lending a core, and dead or hung workers
reported with their rank and step. Ray actors: tests/test_ray.py. The in-process engine adapting
its drafter on the trainer's forwards: tests/test_engine_contract.py."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from conftest import exact_fp32_configs, same_run
from rollout_helpers import PARAMS, grouped_requests, reference, start_pool

from tailrl.engine import Engine, EngineConfig
from tailrl.linears import PACKED_DTYPES, FusedLinears, Linear
from tailrl.loading import load_model
from tailrl.pipeline import run_config
from tailrl.records import Completion
from tailrl.rl.progress import RolloutProgress, StepDone
from tailrl.rl.run_dir import RunDir
from tailrl.rl.train import train
from tailrl.rollout.native import pool as pool_module
from tailrl.rollout.native.buffer import DataBuffer, train_seq
from tailrl.rollout.native.pool import NativeRolloutState
from tailrl.rollout.native.spot import DrafterState, SpotJob, run_spot
from tailrl.rollout.native.worker import RolloutJob, RolloutWorker, ShardResult, SpotBeat, WorkerSetup
from tailrl.rollout.protocol import IdleCore, RolloutReport, WorkerError
from tailrl.rollout.workers import WorkerConfig, shard_indices
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import Drafter, save_drafter
from tailrl.speculative.drafter.training import TrainSeq
from tailrl.speculative.modes import SpeculationConfig
from tailrl.stats import EngineStats, SpecStats, merge_stats
from tailrl.tuner import TunerConfig

pytestmark = pytest.mark.usefixtures("no_plots")

VOCAB = list(range(1, 96, 2)) + [2, 4, 6, 8]  # 52 of the tiny model's 96 tokens, EOS (1) in


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir, dtype="fp32")


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    return save_drafter(Drafter.from_target(target, VOCAB, "tiny", seed=0), tmp_path_factory.mktemp("drafter"))


def emitted_per_verify(completions: list[Completion], report: RolloutReport) -> float:
    """The drafter's accept_len as the completions count it where every decode step verified a
    draft (--spec on): each response's tokens but its first (sampled at its prefill) came from a
    verify."""
    return (sum(len(c.token_ids) for c in completions) - len(completions)) / report.spec_verify_steps


# ---- pieces -----------------------------------------------------------------------------------


def test_shards_are_contiguous_and_balanced():
    assert shard_indices(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert shard_indices(2, 3) == [range(0, 1), range(1, 2), range(2, 2)]
    # 8 groups of 8 on 2 workers: 4 whole groups each.
    assert shard_indices(64, 2) == [range(0, 32), range(32, 64)]


def test_merge_stats_adds_counts_and_takes_the_longest_shard():
    a = EngineStats(tokens=10, seconds=2.0, prefill_seconds=0.5, steps=3, timeline=[(0.1, 2, "plain")],
                    spec=SpecStats(verify_steps=2, emitted=5, accept_hist=[1, 1]))
    b = EngineStats(tokens=4, seconds=3.0, prefill_seconds=0.25, steps=1, timeline=[(0.2, 1, "plain")],
                    spec=SpecStats(verify_steps=1, emitted=4, accept_hist=[0, 0, 0, 1]))
    m = merge_stats([a, b])
    assert (m.tokens, m.seconds, m.prefill_seconds, m.steps) == (14, 3.0, 0.75, 4)
    assert m.timeline == [(0.1, 2, "plain"), (0.2, 1, "plain")]
    assert m.spec.accept_hist == [1, 1, 0, 1] and m.spec.accept_len == 3.0


def _seq(prompt: int, response: int, e: int = 4) -> TrainSeq:
    n = prompt + response
    return TrainSeq(torch.arange(n), torch.zeros(n - 1, e), prompt)


def test_buffer_trains_on_this_step_first_then_the_previous_steps_longest():
    buf = DataBuffer(max_tokens=100, keep_long=0.5)
    step1 = [_seq(5, r) for r in (3, 20, 8, 12)]
    buf.add(step1)
    buf.end_step()  # the longest half of step 1 (responses of 20 and 12) is kept
    assert [s.tokens.shape[0] - 5 for s in buf.previous] == [20, 12]
    step2 = [_seq(5, 6), _seq(5, 7)]
    buf.add(step2)
    assert buf.training_order() == step2 + buf.previous
    assert buf.tokens == 11 + 12 + 25 + 17
    # Over the bound: the previous step's shortest goes first, then this step's oldest.
    buf.add([_seq(5, 30)])
    assert buf.tokens == 100  # at the bound, nothing dropped
    buf.add([_seq(5, 40)])  # 45 over: previous 17 and 25 go, then this step's oldest (11)
    assert buf.previous == [] and [s.tokens.shape[0] for s in buf.current] == [12, 35, 45]
    state = buf.state_dict()
    other = DataBuffer(100, 0.5)
    other.load_state_dict(state)
    assert [torch.equal(a.tokens, b.tokens) for a, b in zip(other.current, buf.current)] == [True] * 3


def test_train_seq_holds_the_prompt_hidden_states_of_a_prompt_forward(target):
    reqs = grouped_requests(prompts=2, group=2)
    out = Engine(target, EngineConfig(capture_hidden=True)).generate(reqs, PARAMS, 10)
    for r, c in zip(reqs, out):
        s = train_seq(c)
        p = torch.tensor([r.prompt_ids])
        with torch.no_grad():
            hp = target.hidden(p, torch.arange(p.shape[1])[None])[0, :-1]
        assert s.tokens.tolist() == list(r.prompt_ids) + c.token_ids and s.prompt_len == len(r.prompt_ids)
        torch.testing.assert_close(s.hidden[: len(r.prompt_ids) - 1], hp, rtol=1e-5, atol=1e-5)
        assert torch.equal(s.hidden[len(r.prompt_ids) - 1 :], c.hidden)


def test_spot_training_stops_before_the_next_micro_step(target):
    out = Engine(target, EngineConfig(capture_hidden=True)).generate(grouped_requests(), PARAMS, 20)
    seqs = [train_seq(c) for c in out]
    drafter = Drafter.from_target(target, VOCAB, "tiny")
    head = target.lm_head.weight.detach()[drafter.d2t].float()
    start = DrafterState(0, {k: v.clone() for k, v in drafter.state_dict().items()})
    stop_at = {"flag": 0}

    def on_step(n: int) -> None:
        if n == 3:  # "rollout ended" arrives during micro-step 3
            stop_at["flag"] = 1

    job = SpotJob(1, start, seqs, AdaptConfig(drafter_batch_tokens=64))
    result = run_spot(drafter, job, start, head, lambda: stop_at["flag"], on_step)
    assert result.micro_steps == 3 and result.loss > 0
    assert any(not torch.equal(result.weights[k], start.weights[k]) for k in start.weights)
    # A preempted job (id <= the preempted id) does nothing and sends nothing back.
    skipped = run_spot(drafter, job, start, head, lambda: 1)
    assert skipped.micro_steps == 0 and skipped.weights is None and skipped.optimizer is None
    # The next job continues the optimizer.
    steps = {"n": 0}
    job2 = SpotJob(2, None, seqs, job.cfg)
    after = DrafterState(1, result.weights, result.optimizer, 3)
    again = run_spot(drafter, job2, after, head, lambda: 2 if steps["n"] >= 2 else 1, lambda n: steps.update(n=n))
    assert again.micro_steps == 2 and int(again.optimizer["state"][0]["step"]) == 5


def test_a_job_without_state_trains_on_from_what_the_worker_holds(target, drafter_dir):
    """Sending the state again or not gives the same drafter: the worker keeps what it ended with."""
    out = Engine(target, EngineConfig(capture_hidden=True)).generate(grouped_requests(), PARAMS, 20)
    seqs = [train_seq(c) for c in out]
    start = DrafterState(0, {k: v.clone() for k, v in Drafter.from_target(target, VOCAB, "tiny").state_dict().items()})
    cfg = AdaptConfig(drafter_batch_tokens=64)
    spec = SpeculationConfig(spec="on", drafter=str(drafter_dir), draft_depth=3, num_draft_tokens=3)
    results = []
    for resend in (False, True):
        worker = RolloutWorker(0, target, WorkerSetup(EngineConfig(), spec, TunerConfig(), seed=0, collect=True))
        steps = {"n": 0}
        worker.beat = lambda beat: steps.update(n=getattr(beat, "micro_steps", steps["n"]))
        worker.preempted = lambda: 0 if steps["n"] < 2 else 10
        first = worker.spot_train(SpotJob(1, start, seqs, cfg))
        steps["n"] = 0
        state = DrafterState(1, first.weights, first.optimizer, 2) if resend else None
        results.append(worker.spot_train(SpotJob(2, state, seqs, cfg)))
    held, sent = results
    assert held.micro_steps == sent.micro_steps == 2
    assert all(torch.equal(held.weights[k], sent.weights[k]) for k in sent.weights)
    assert int(held.optimizer["state"][0]["step"]) == 4


def test_a_rollout_leaves_no_packed_weights_and_the_next_packs_them_again(tiny_dir, drafter_dir):
    """Decoding's packed copies of the target's and the drafter's weights (tailrl.linears, a
    model's size) go with the rollout, as its KV cache does: the update after it runs without
    them. The next rollout packs the same weights again into the same tokens."""
    dtype = next((name for name, d in (("fp32", torch.float32), ("bf16", torch.bfloat16)) if d in PACKED_DTYPES), None)
    if dtype is None:
        pytest.skip("no dtype's decode linears are prepacked on this CPU")
    model = load_model(tiny_dir, dtype=dtype)
    spec = SpeculationConfig(spec="on", drafter=str(drafter_dir), draft_depth=3, num_draft_tokens=3)
    worker = RolloutWorker(0, model, WorkerSetup(EngineConfig(), spec, TunerConfig(), seed=0, collect=False))

    def packs() -> list[object]:
        held = []
        for part in (model, worker.in_use):
            for module in part.modules():
                held += [module._pack] if isinstance(module, Linear) else []
                held += [v._weight for v in vars(module).values() if isinstance(v, FusedLinears)]
        return [p for p in held if p is not None]

    tokens = []
    for _ in range(2):
        out = worker.rollout(RolloutJob(grouped_requests(), PARAMS, 20))
        assert packs() == []
        tokens.append([c.token_ids for c in out.completions])
    assert tokens[0] == tokens[1]
    assert worker.engine.stats.spec.verify_steps > 0  # the drafter decoded, with packed weights of its own


# ---- local processes --------------------------------------------------------------------------


def test_process_workers_give_the_in_process_tokens(target, tiny_dir):
    reqs = grouped_requests()
    want = reference(target, reqs)
    for workers in (1, 2, 3):
        pool = start_pool(WorkerConfig(workers=workers), AdaptConfig(), target)
        finished: list = []
        try:
            got = pool.generate(1, reqs, PARAMS, 20, on_finished=lambda i, c: finished.append((i, c.token_ids)))
        finally:
            pool.close()
        # Each sequence is reported once, as it finishes, with the tokens generate returns.
        assert sorted(finished) == [(i, c.token_ids) for i, c in enumerate(got)]
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.seed for c in got] == [r.seed for r in reqs]
        assert pool.stats.tokens == sum(len(c.token_ids) for c in want)


def test_worker_tuners_learn_from_each_others_rollouts(target):
    # Every decode step rewards its worker's tuner once; before its next rollout each worker
    # also counts the other's rewards, and a checkpoint keeps what is not delivered yet.
    pool = start_pool(WorkerConfig(workers=2), AdaptConfig(), target, SpeculationConfig(spec="auto"))
    try:
        pool.generate(1, grouped_requests(step=1), PARAMS, 20)
        first = pool.stats.steps
        pulls = lambda rank: sum(map(sum, pool.tuners[rank]["pulls"]))  # noqa: E731
        assert pulls(0) + pulls(1) == first and pulls(0) > 0 and pulls(1) > 0
        state = pool.state_dict()
        assert [len(p) for p in state.tuner_pending] == [pulls(1), pulls(0)]
        pool.generate(2, grouped_requests(step=2), PARAMS, 20)
        assert pulls(0) + pulls(1) == 2 * first + pool.stats.steps
    finally:
        pool.close()


def test_spot_training_in_a_long_tail_publishes_a_new_drafter_version(target, drafter_dir):
    # Rank 0 is paused (SIGSTOP) so rank 1 finishes first and trains the drafter until rank 0,
    # resumed, finishes: a long tail made on purpose. Tokens stay those of plain decoding.
    spec = SpeculationConfig(spec="on", drafter=str(drafter_dir), draft_depth=3, num_draft_tokens=3)
    pool = start_pool(WorkerConfig(workers=2), AdaptConfig(drafter_batch_tokens=64), target, spec)
    seen = threading.Event()
    on_beat = pool.runtime.on_beat

    def watch(rank: int, payload) -> None:
        on_beat(rank, payload)
        if isinstance(payload, SpotBeat) and payload.micro_steps >= 2:
            seen.set()

    pool.runtime.on_beat = watch
    reqs = grouped_requests(prompts=2)
    try:
        rank0 = pool.runtime.pids[0]
        os.kill(rank0, signal.SIGSTOP)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(out=pool.generate(1, reqs, PARAMS, 20)))
        t.start()
        try:
            assert seen.wait(120), "the idle worker never trained"
        finally:
            os.kill(rank0, signal.SIGCONT)
        t.join(120)
        m = pool.report().metrics()
        assert m["drafter_version"] == 0 and m["drafter_micro_steps"] >= 2 and m["drafter_loss"] > 0
        assert m["idle_seconds_harvested"] > 0 and m["preempt_latency_s"] > 0
        assert pool.drafter.version == 1 and pool.drafter.micro_steps == m["drafter_micro_steps"]
        assert [c.token_ids for c in result["out"]] == [c.token_ids for c in reference(target, reqs)]
        # The next rollout drafts with version 1 on every worker; still the same tokens.
        reqs2 = grouped_requests(step=2, prompts=2)
        out2 = pool.generate(2, reqs2, PARAMS, 20)
        assert pool.report().drafter_version == 1 and pool.published == 1
        assert pool.report().drafter_accept_len == emitted_per_verify(out2, pool.report())
        assert [c.token_ids for c in out2] == [c.token_ids for c in reference(target, reqs2)]
        state = pool.state_dict()
        # The second rollout may have had an idle worker too (timing), training version 2.
        assert state.drafter.version == pool.drafter.version >= 1 and len(state.tuners) == 2
    finally:
        pool.close()


def test_a_checkpointed_drafter_version_is_what_workers_draft_with(target, drafter_dir):
    spec = SpeculationConfig(spec="on", drafter=str(drafter_dir), draft_depth=3, num_draft_tokens=3)
    weights = {k: v.clone() for k, v in Drafter.from_target(target, VOCAB, "tiny", seed=5).state_dict().items()}
    buffer = DataBuffer(1000, 0.5)
    buffer.add([_seq(5, 9, e=64)])
    reqs = grouped_requests(prompts=2)
    for workers in (1, 2):
        state = NativeRolloutState([None] * workers, [[] for _ in range(workers)], DrafterState(3, weights, None, 7),
                                   buffer.state_dict())
        # Frozen on one worker: an adapting drafter's version comes from its own state (the next test).
        adapt = AdaptConfig(adapt_drafter=workers > 1)
        pool = start_pool(WorkerConfig(workers=workers), adapt, target, spec, state)
        try:
            assert pool.drafter.version == 3 and pool.buffer.tokens == 14
            out = pool.generate(1, reqs, PARAMS, 20)
            assert pool.report().drafter_version == 3
            assert pool.report().drafter_accept_len == emitted_per_verify(out, pool.report())
            assert [c.token_ids for c in out] == [c.token_ids for c in reference(target, reqs)]
            if workers == 1:
                in_use = pool.runtime.worker.in_use.state_dict()
                assert all(torch.equal(in_use[k], weights[k]) for k in weights)
        finally:
            pool.close()


def test_an_in_process_rollout_lends_a_core_and_takes_it_back(target):
    """IdleCore.lent: while lent, the in-process engine decodes on one torch thread fewer;
    taken back, on all; a core still lent when generate returns comes back with it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    pool = start_pool(WorkerConfig(workers=1), AdaptConfig(), target)
    core = IdleCore()
    try:
        def on_progress(p):
            seen.append(torch.get_num_threads())
            core.lent = p.done < 6 or p.done == p.total  # lent early, back, lent again at the end

        pool.generate(1, grouped_requests(), PARAMS, 20, on_progress=on_progress, core=core)
        assert seen[0] == 2 and 1 in seen[1:] and 2 in seen[seen.index(1):]
        assert torch.get_num_threads() == 2
    finally:
        pool.close()
        torch.set_num_threads(threads)


def test_a_killed_worker_is_reported_with_rank_and_step(target):
    pool = start_pool(WorkerConfig(workers=2), AdaptConfig(), target)
    try:
        os.kill(pool.runtime.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"^worker 1 died \(exit code -9\) in step 4$"):
            pool.generate(4, grouped_requests(), PARAMS, 20)
    finally:
        pool.close()


def test_a_hung_worker_is_detected_by_timeout(target, monkeypatch):
    """Worker 0 is stopped (SIGSTOP) before the call and never beats; worker 1 decodes its shard.
    The pool's clock stands still until worker 1's shard is back, then jumps past the timeout, so
    only the stopped worker can be the one that sent nothing, however slow the machine."""
    pool = start_pool(WorkerConfig(workers=2, worker_timeout_s=10), AdaptConfig(), target)
    clock = [0.0]
    wait = pool.runtime.wait

    def wait_then_move_the_clock(timeout: float):
        replies = wait(timeout)
        if any(rank == 1 and isinstance(reply, ShardResult) for rank, reply in replies):
            clock[0] = 1000.0
        return replies

    pool.runtime.wait = wait_then_move_the_clock
    monkeypatch.setattr(pool_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    stopped = pool.runtime.pids[0]
    # Only a guard against a hang: were the stopped worker never called hung, it is resumed
    # after 2 minutes and the call returns instead of raising.
    guard = threading.Timer(120, lambda: os.kill(stopped, signal.SIGCONT))
    try:
        os.kill(stopped, signal.SIGSTOP)
        guard.start()
        with pytest.raises(WorkerError, match=r"^worker 0 sent nothing for 10 s \(hung\) in step 3$"):
            pool.generate(3, grouped_requests(), PARAMS, 20)
    finally:
        guard.cancel()
        pool.close()  # kills the stopped process


# ---- in the GRPO loop -------------------------------------------------------------------------

def test_killing_a_worker_stops_the_run_resumably(straight_fp32, tmp_path, char_model_dir, task_file):
    import multiprocessing

    def kill_worker_1_in_step_3(event):
        # Stopped once step 2 is done, killed when step 3's rollout reports progress: so it is
        # surely mid-rollout (killed at the first progress alone, it sometimes had its shard done).
        if isinstance(event, StepDone) and event.metrics["step"] == 2:
            (worker,) = [p for p in multiprocessing.active_children() if p.name == "tailrl-worker-1"]
            os.kill(worker.pid, signal.SIGSTOP)
        if isinstance(event, RolloutProgress) and event.step == 3:
            (worker,) = [p for p in multiprocessing.active_children() if p.name == "tailrl-worker-1"]
            os.kill(worker.pid, signal.SIGKILL)

    out = tmp_path / "run"
    configs = exact_fp32_configs(char_model_dir, task_file)
    configs["workers"] = WorkerConfig(workers=2)
    with pytest.raises(WorkerError, match=rf"^worker 1 died \(exit code -9\) in step 3; the run stopped after "
                                          rf"step 2, resume with --resume {out}$"):
        train(run_config(configs), out, on_event=kill_worker_1_in_step_3)
    assert [p.name for p in RunDir(out).checkpoints()] == ["step_000002"]
    assert [r["step"] for r in RunDir(out).read_metrics()] == [1, 2]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tailrl-worker")]
    # Resumed on two workers, the run is the in-process engine's run.
    train(run_config(configs), out, resume=True)
    assert same_run(RunDir(out).read_metrics(), RunDir(straight_fp32).read_metrics())
