"""The drafter adapted on the hidden states of the update's own forwards (tailrl.rollout.adapt,
tailrl.speculative.drafter.learner): the captured states are the policy's final-norm states and
leave the gradient's bits alone; a learner micro-step is spot training's; the stop check; a
checkpoint resumes it identically; and `train` with the vLLM engine and a learned drafter, its
tuner choosing draft lengths and the update overlapping the rollout (the default run), trains
and publishes new versions. A resumed run's drafter: tests/test_engine_contract.py."""

from __future__ import annotations

import copy
import dataclasses
import io
import random
import threading
import time

import pytest
import torch

from conftest import VLLM_TINY, write_char_model

from tailrl.loading import load_model
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.packing import Sample
from tailrl.rl.phases import policy_forwards
from tailrl.rl.update import BackgroundUpdate, GroupGradients
from tailrl.rollout.adapt import AdaptiveDrafter
from tailrl.rollout.native.spot import DrafterState, SpotJob, run_spot
from tailrl.speculative.drafter.learner import AdaptConfig, DrafterLearner
from tailrl.speculative.drafter.model import Drafter, save_drafter
from tailrl.speculative.drafter.training import TrainSeq, evaluate_loss, pack

VOCAB = list(range(1, 96, 2)) + [2, 4, 6, 8]  # 52 of the tiny model's 96 tokens


def groups_of(vocab: int, seed: int = 0, sizes=(4, 3, 4, 2)) -> list[list[Sample]]:
    """Groups of ragged responses; group 1 is empty (skipped: no reward spread)."""
    rng = random.Random(seed)
    out = []
    for g, n in enumerate(sizes):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(4, 10)))
        lengths = [rng.randrange(2, 14) for _ in range(n)]
        out.append([] if g == 1 else [Sample(prompt, [rng.randrange(3, vocab) for _ in range(k)],
                                             rng.uniform(-1.5, 1.5), [rng.uniform(-5.5, -3.5) for _ in range(k)])
                                      for k in lengths])
    return out


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return load_model(tiny_dir, dtype="fp32").requires_grad_(True)


@pytest.fixture(scope="module")
def drafter_dir(policy, tmp_path_factory):
    return save_drafter(Drafter.from_target(policy, VOCAB, "tiny", seed=0), tmp_path_factory.mktemp("drafter"))


def captured(policy, groups, cfg) -> tuple[list[torch.Tensor], list[tuple[list[Sample], list[torch.Tensor]]]]:
    """The gradient, and what on_hidden received, with groups added last first."""
    seen: list[tuple[list[Sample], list[torch.Tensor]]] = []
    gg = GroupGradients(policy, cfg, 0.8, len(groups), on_hidden=lambda s, h: seen.append((list(s), h)))
    for g in reversed(range(len(groups))):
        gg.add(g, groups[g], g)
    gg.finish()
    return [p.grad.clone() for p in policy.parameters()], seen


def data(policy, seed: int = 0):
    """Drafter data as the update captures it."""
    seqs = []
    _, seen = captured(policy, groups_of(policy.cfg.vocab_size, seed), GRPOConfig(micro_batch=3))
    for samples, hidden in seen:
        seqs += [TrainSeq(f.tokens, f.hidden, f.prompt_len) for f in policy_forwards(samples, hidden)]
    policy.zero_grad(set_to_none=True)
    return seqs


@pytest.mark.parametrize("autocast,tol", [("fp32", 1e-5), ("bf16", 3e-2)])
def test_captured_hidden_states_are_the_policys_final_norm_states_and_the_gradient_keeps_its_bits(
        policy, autocast, tol):
    groups, cfg = groups_of(policy.cfg.vocab_size), GRPOConfig(micro_batch=3, autocast=autocast)
    plain = GroupGradients(policy, cfg, 0.8, len(groups))
    for g in reversed(range(len(groups))):
        plain.add(g, groups[g], g)
    stats = plain.finish()
    want = [p.grad.clone() for p in policy.parameters()]
    got, seen = captured(policy, groups, cfg)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # Group order, the skipped group not forwarded, every sample of the others.
    assert [s for samples, _ in seen for s in samples] == groups[0] + groups[2] + groups[3]
    for samples, hidden in seen:
        for s, h in zip(samples, hidden):
            ids = torch.tensor([[*s.prompt_ids, *s.token_ids[:-1]]])
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bf16"):
                ref = policy.hidden(ids, torch.arange(ids.shape[1])[None])[0].float()  # a row of its own
            assert h.dtype == torch.float32 and not h.requires_grad and h.shape == ref.shape
            torch.testing.assert_close(h, ref, rtol=tol, atol=tol)
    assert stats.tokens == sum(len(s.token_ids) for g in groups for s in g)


def test_a_learner_micro_step_is_spot_trainings_and_the_loss_goes_down(policy, drafter_dir):
    seqs = data(policy)
    learner = DrafterLearner.load(drafter_dir, policy, AdaptConfig(drafter_batch_tokens=64))
    start = DrafterState(0, learner.weights())
    learner.add(seqs)
    learner.begin_step(policy)  # trains on what it was given last step
    calls = iter(range(100))
    learner.work(lambda: next(calls) >= 1)  # one micro-step
    flag = {"stop": 0}
    spot = Drafter.from_target(policy, VOCAB, "tiny", seed=9)  # run_spot loads start's weights into it
    head = policy.lm_head.weight.detach()[spot.d2t].float()
    result = run_spot(spot, SpotJob(1, start, seqs, AdaptConfig(drafter_batch_tokens=64)), start, head,
                      lambda: flag["stop"], lambda n: flag.update(stop=1))
    assert result.micro_steps == 1 and learner.micro_steps == 1
    assert all(torch.equal(result.weights[k], v) for k, v in learner.weights().items())
    batches = pack(seqs, 64)
    before = evaluate_loss(learner.drafter, batches, head).loss
    learner.work(lambda: learner.micro_steps >= 40)
    stats = learner.end_step()
    assert stats.micro_steps == 40 and stats.version == 1 and stats.seqs == len(seqs) and stats.seconds > 0
    assert evaluate_loss(learner.drafter, batches, head).loss < before - 0.01  # at spot training's small lr


def test_a_learner_asked_to_stop_does_no_further_micro_step(policy, drafter_dir):
    learner = DrafterLearner.load(drafter_dir, policy, AdaptConfig(drafter_batch_tokens=64))
    assert not learner.pending()  # the first step has no data: last step's is none
    learner.add(data(policy))
    learner.begin_step(policy)
    w = learner.weights()
    learner.work(lambda: True)
    assert learner.micro_steps == 0 and all(torch.equal(w[k], v) for k, v in learner.weights().items())
    learner.work(lambda: learner.micro_steps >= 3)
    assert learner.micro_steps == 3

    # In the update's background thread: it trains while the gate is open and no group waits,
    # yields to a queued group, and stops for good once the rollout is over (drain). Synchronised
    # on what the idle work itself sees (WatchedIdle), never on how long something took.
    groups = groups_of(policy.cfg.vocab_size, seed=1)
    gg = GroupGradients(policy, GRPOConfig(micro_batch=3), 0.8, len(groups))
    idle = WatchedIdle(AdaptiveDrafter(learner, min_steps=0), lambda: learner.micro_steps >= 6)
    update = BackgroundUpdate(gg, idle)
    assert not update.has_work  # idle work alone holds no core (tailrl.rl.phases)

    update.open_gate()
    assert idle.reached.wait(HANG_GUARD_S), "the learner trains on the open gate"
    update.close_gate()
    idle.closed = True  # from here on every stop() must say stop
    assert idle.wait_out(HANG_GUARD_S), "the idle work returns once the gate closes"
    n = learner.micro_steps
    update.open_gate()
    idle.closed = False
    assert n >= 6 and idle.ran_while_closed == 0  # the gate closed: it stopped, and did not start again
    for g, group in enumerate(groups):
        update.submit(g, group, g)
    deadline = time.monotonic() + HANG_GUARD_S
    while update.has_work:  # queued groups are computed on the open gate, idle work or not
        assert time.monotonic() < deadline, "the queued groups were not computed"
        time.sleep(0.005)
    assert gg.done
    update.drain()  # joins the background thread: nothing runs after it
    idle.closed = True
    assert idle.wait_out(0) and idle.ran_while_closed == 0


# A guard against a hang only: each wait ends as soon as what it waits for happens.
HANG_GUARD_S = 120.0


class WatchedIdle:
    """A DrafterFeed around `inner` that records what its idle work saw: `reached` is set once `cond()`
    holds at a stop check; `ran_while_closed` counts stop checks that let a unit of work run
    while the test had declared the gate closed (`closed`, set after close_gate returned, so
    every stop() after it must be True); wait_out waits until no work_idle call is running."""

    def __init__(self, inner: AdaptiveDrafter, cond):
        self.inner, self.cond = inner, cond
        self.reached = threading.Event()
        self.closed = False
        self.ran_while_closed = 0
        self._running = 0
        self._idle = threading.Condition()

    def observe(self, forwards) -> None:
        self.inner.observe(forwards)

    def has_idle_work(self) -> bool:
        return self.inner.has_idle_work()

    def work_idle(self, stop) -> None:
        def watched() -> bool:
            closed = self.closed  # read first: a stop() that began after close_gate returned
            if self.cond():
                self.reached.set()
            stopping = stop()
            self.ran_while_closed += closed and not stopping
            return stopping

        with self._idle:
            self._running += 1
        try:
            self.inner.work_idle(watched)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def wait_out(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)


def test_a_checkpointed_learner_resumes_as_the_uninterrupted_one(policy, drafter_dir):
    cfg = AdaptConfig(drafter_batch_tokens=64)
    first, second = data(policy, 0), data(policy, 1)
    a = DrafterLearner.load(drafter_dir, policy, cfg)
    a.begin_step(policy)
    a.add(first)
    assert a.end_step().version == 0  # nothing to train on in the first step
    a.begin_step(policy)
    a.add(second)
    a.work(lambda: a.micro_steps >= 3)
    assert a.end_step().version == 1
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)

    def restored() -> DrafterLearner:
        b = DrafterLearner.load(drafter_dir, policy, cfg)
        buf.seek(0)
        b.load_state_dict(torch.load(buf, weights_only=False))
        return b

    b, c = restored(), restored()
    c.begin_step(policy)  # an interrupted step: its work is not in the state
    c.work(lambda: c.micro_steps >= 5)
    assert all(torch.equal(c.state_dict()["weights"][k], v) for k, v in b.weights().items())
    for learner in (a, b):
        learner.begin_step(policy)  # trains on `second`
        learner.work(lambda learner=learner: learner.micro_steps >= 7)
    sa, sb = a.end_step(), b.end_step()
    assert sa == dataclasses.replace(sb, seconds=sa.seconds) and sa.version == 2 and sa.seqs == len(second)
    assert all(torch.equal(v, b.weights()[k]) for k, v in a.weights().items())
    assert int(a.opt.state_dict()["state"][0]["step"]) == int(b.opt.state_dict()["state"][0]["step"]) == 7


def mean_char_reward(prompt: str, completion: str, answer: object) -> float:
    return sum(map(ord, completion)) / (1 + len(completion)) / 128


# Slow: 21-35 s on a 2-core AVX2 CPU (the first vLLM test of a fresh process pays vLLM's ~10 s
# import); the contract suite's publish test covers the drafter's feeding and publishing on vLLM.
@pytest.mark.slow
def test_train_with_the_vllm_engine_trains_and_publishes_the_learned_drafter(tmp_path, task_file):
    pytest.importorskip("vllm")
    from tailrl.pipeline import TRAIN_SECTIONS, run_config
    from tailrl.rl.run_dir import RunDir
    from tailrl.rl.train import TrainConfig, train
    from tailrl.rollout.vllm.settings import VllmSettings
    from tailrl.speculative.modes import RolloutSpeculationConfig

    model = tmp_path / "model"
    write_char_model(model, **VLLM_TINY)
    drafter = save_drafter(Drafter.from_target(load_model(model, "fp32"), list(range(1, 128)), "model"), tmp_path / "d")
    configs = {name: cls() for name, cls in TRAIN_SECTIONS.items()}
    configs["train"] = TrainConfig(
        model=str(model), engine="vllm", dtype="bf16", task=str(task_file), reward=f"{__name__}:mean_char_reward",
        num_prompts=3, group_size=4, max_new_tokens=24, steps=2, seed=5, eval_every=0)
    # lr: a far larger step moves the embedding off the drafter's fingerprint (Drafter.attach refuses)
    configs["grpo"] = GRPOConfig(lr=1e-3, micro_batch=5)
    configs["vllm"] = VllmSettings(kv_cache_gb=1 / 16, max_num_seqs=8)
    configs["speculation"] = RolloutSpeculationConfig(drafter=str(drafter))  # one --drafter for both engines
    out = tmp_path / "run"
    assert train(run_config(configs), out).step == 2
    first, second = RunDir(out).read_metrics()
    # Step 1 has no data yet (the drafter trains on the previous step's); step 2 trains in its
    # rollout's tail (idle time: a step on a busy machine may get none) and after the update up
    # to drafter_min_steps (8), and publishes version 1. That the next rollout drafts with it:
    # the contract suite's resume test (tests/test_engine_contract.py).
    assert first["drafter_micro_steps"] == first["drafter_published"] == first["drafter_version"] == 0
    assert second["drafter_micro_steps"] >= 8 and second["drafter_loss"] > 0
    assert (second["drafter_version"], second["drafter_published"]) == (0, 1)
    assert all(r["spec_verify_steps"] > 0 and r["drafter_after_s"] >= 0 for r in (first, second))


def test_the_native_rollout_hands_its_learner_every_response_it_sampled_longest_first(policy, drafter_dir):
    """One in-process native worker adapting its drafter keeps the hidden states it sampled with
    and hands every response to the learner at the end of its rollout, the groups the update
    will skip included (the trainer's forwards are not taken), longest first; the states are the
    target's own final-norm states on those tokens (a full no-cache forward, fp32: to rounding)."""
    from tailrl.engine import EngineConfig
    from tailrl.records import Request
    from tailrl.rollout.native.config import NativeRolloutConfig, RolloutSpeculationConfig
    from tailrl.sampling import SamplingParams

    cfg = NativeRolloutConfig(engine=EngineConfig(max_batch=4), adapt=AdaptConfig(drafter_min_steps=0),
                              speculation=RolloutSpeculationConfig(spec="on", drafter=str(drafter_dir), draft_depth=2,
                                                                   num_draft_tokens=2))
    model = copy.deepcopy(policy)  # an in-process engine decodes with the model it is given
    rollout = cfg.open(model, seed=0)
    try:
        g = torch.Generator().manual_seed(5)
        reqs = [Request(tuple(torch.randint(2, 96, (5 + i,), generator=g).tolist()), seed=i, group=i // 2)
                for i in range(8)]
        out = rollout.generate(1, reqs, SamplingParams(temperature=1.0), 40)
        feed = rollout.feed()
        feed.observe([])  # the trainer's forwards: not taken (the rollout has every response already)
        rollout.publish(model)
        incoming = [TrainSeq(*x) for x in rollout.adapt.learner.state_dict()["incoming"]]
    finally:
        rollout.close()
    assert len(incoming) == len(reqs)
    sampled = [len(c.token_ids) for c in out]
    assert sampled != sorted(sampled, reverse=True)  # some responses ended early (EOS), out of order
    assert [s.tokens.shape[0] - s.prompt_len for s in incoming] == sorted(sampled, reverse=True)
    by_tokens = {tuple(s.tokens.tolist()): s for s in incoming}
    with torch.no_grad():
        for r, c in zip(reqs, out):
            s = by_tokens[(*r.prompt_ids, *c.token_ids)]
            full = policy.hidden(s.tokens[None, :-1], torch.arange(s.tokens.shape[0] - 1)[None])[0]
            torch.testing.assert_close(s.hidden, full, rtol=1e-4, atol=1e-4)
