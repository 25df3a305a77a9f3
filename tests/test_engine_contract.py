"""The Rollout contract (tailrl.rollout.protocol), one suite run over every registered engine
(tailrl.rollout.registry.NAMES), each opened as a run opens it (registry.rollout_config) on a
tiny model built here:

- greedy tokens are the reference forward's argmax chain (tailrl.model.Transformer, no cache),
  on_finished fires once per request, on_progress ends at done == total; a caller's Stop ends
  a sequence at the token where it says;
- a bad request fails in one line (ValueError), and the engine decodes on as before;
- the report has the fields the loop writes, its counts consistent with the completions;
- a published policy, and a published drafter version, are what the next rollout decodes with:
  the same tokens and the same drafting as an engine opened from those weights;
- a run stopped by Ctrl-C and resumed is the uninterrupted run (`tailrl train`).

What only one engine has stays in its own tests (test_engine.py, test_workers.py: workers, exact
mode; test_vllm.py: vLLM's sampling, its quirks). vLLM's parameter is skipped where vLLM is not
installed. One vLLM engine may be open per process (tailrl.rollout.vllm.rollout), so each test
closes what it opens before the next opens another."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import pytest
import torch

from conftest import VLLM_TINY, comparable, comparable_evals, final_state, write_char_model, write_sharp_llama
from rollout_helpers import GREEDY, SLOTS, drafting, is_greedy_chain, opened, own_sections, paired_requests, perturbed

from tailrl.loading import load_model
from tailrl.model import Transformer
from tailrl.pipeline import TRAIN_SECTIONS, run_config
from tailrl.records import Completion, Request
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.progress import RolloutProgress
from tailrl.rl.run_dir import RunDir
from tailrl.rl.train import TrainConfig, train
from tailrl.rollout import registry
from tailrl.rollout.protocol import Rollout, RolloutReport
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import Drafter, save_drafter
from tailrl.speculative.modes import RolloutSpeculationConfig
from tailrl.speculative.report import chain_ceiling

pytestmark = pytest.mark.usefixtures("no_plots")

MAX_NEW = 16


@dataclass(frozen=True)
class EndsWith:
    """A Stop (tailrl.records): the sequence ends at `token`."""

    token: int

    def __call__(self, tokens: list[int]) -> bool:
        return tokens[-1] == self.token


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Transformer:
    """conftest.write_sharp_llama's model: greedy choices with no near-ties."""
    path = tmp_path_factory.mktemp("contract-llama")
    write_sharp_llama(path)
    return load_model(path, "fp32")


@pytest.fixture(scope="module", params=registry.NAMES)
def engine(request) -> str:
    if request.param == "vllm":
        pytest.importorskip("vllm", reason="the vllm engine needs vLLM installed (pip install 'tailrl[vllm]')")
    return request.param


# ---- plain decoding ------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def rollout(engine, model) -> Iterator[Rollout]:
    """The engine decoding plainly (the report's speculative fields then have hand-computed
    values), for the tests of one class."""
    with opened(engine, model, speculation=RolloutSpeculationConfig(spec="off")) as r:
        yield r


@pytest.fixture(scope="class")
def greedy(rollout) -> tuple[list[Completion], RolloutReport, list, list]:
    """One greedy call: its completions, report, on_finished calls and on_progress reports."""
    finished, progress = [], []
    out = rollout.generate(1, paired_requests(), GREEDY, MAX_NEW, on_progress=progress.append,
                           on_finished=lambda i, c: finished.append((i, c)))
    return out, rollout.report(), finished, progress


class TestPlainDecoding:
    """One engine per class and engine: its plain greedy call, the report, bad requests."""

    def test_greedy_tokens_are_the_reference_forwards_argmax_chain(self, greedy, model):
        out, _, finished, progress = greedy
        reqs = paired_requests()
        assert [(c.prompt_ids, c.seed, c.group) for c in out] == [(r.prompt_ids, r.seed, r.group) for r in reqs]
        assert all(is_greedy_chain(model, c, MAX_NEW) for c in out)
        assert {c.finish_reason for c in out} == {"eos", "length"}  # both endings are checked
        # Greedy log-probs: the raw log-softmax of the chosen (the most likely) token, to fp32
        # kernel rounding (logits here reach |10|: ~1e-5); top1 is every token.
        for c in out:
            ids = torch.tensor([list(c.prompt_ids) + c.token_ids[:-1]])
            with torch.no_grad():
                logits = model(ids, torch.arange(ids.shape[1])[None])[0, len(c.prompt_ids) - 1:]
            want = torch.log_softmax(logits, -1).max(-1).values
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
            assert c.top1 == [True] * len(c.token_ids)
        assert sorted(i for i, _ in finished) == list(range(len(reqs)))  # once per request
        assert all(out[i] == c for i, c in finished)
        assert (progress[-1].done, progress[-1].total, progress[-1].running) == (len(reqs), len(reqs), 0)
        assert progress[-1].tokens == sum(len(c.token_ids) for c in out)

    def test_the_report_has_the_loops_fields_counted_from_the_completions(self, greedy):
        out, report, _, _ = greedy
        metrics = report.metrics()
        assert metrics.keys() == {f.name for f in dataclasses.fields(RolloutReport)}
        json.dumps(metrics)  # a metrics line
        tokens = sum(len(c.token_ids) for c in out)
        assert report.rollout_tok_s > 0 and report.prefill_s > 0 and report.decode_steps > 0
        # Decode steps: each in one running-batch bucket, all plain, at most SLOTS sequences each.
        cells = [cell for arms in report.by_bucket.values() for cell in arms.values()]
        assert sum(c["steps"] for c in cells) == report.decode_steps
        # Every first token comes from a prefill, so decode steps emit the rest at most (vLLM
        # counts a step that also prefilled as prefill: its decode tokens are in neither).
        assert 0 < sum(c["tokens"] for c in cells) <= tokens - len(out)
        assert (set(report.arm_by_bucket.values()) == {"plain"}
                and report.by_bucket.keys() == report.arm_by_bucket.keys())
        assert all(1 <= batch <= SLOTS for _, _, batch, _ in report.batch_timeline)
        # Plain decoding: no speculation, no drafter.
        assert (report.spec_verify_steps, report.spec_proposed, report.spec_accepted,
                report.sd_fraction) == (0, 0, 0, 0)
        assert (report.draft_s, report.verify_s, sum(report.accept_hist)) == (0, 0, 0)
        assert (report.spec_accept_ceiling, report.spec_draft_depth) == (None, 0.0)
        assert (report.drafter_version, report.drafter_published, report.drafter_accept_len) == (0, 0, None)
        assert report.drafter_rollback is None and report.kv_preempted == 0
        # With at most 8 sequences running every decode step is the tail, and plain.
        assert report.tail_s == report.plain_s > 0
        assert report.tail_share == pytest.approx(report.tail_s / (report.tail_s + report.prefill_s))
        # The headroom, by hand: greedy tokens are all top-1, so a depth-6 chain drafter (the
        # default depth) would emit 1 + 6 per verify after the first token: ceil((n - 1) / 7)
        # verifies for a response of n tokens.
        verifies = sum(-(-(len(c.token_ids) - 1) // 7) for c in out)
        assert report.accept_len_ceiling == pytest.approx((tokens - len(out)) / verifies)
        assert report.accept_len_ceiling == chain_ceiling([c.top1 for c in out], 6)

    def test_progress_bounds_every_unfinished_response_from_below(self, rollout, greedy):
        # The update sums a finished group before the rollout ends only where every response
        # still decoding ends at least Progress.fewest_unfinished long (tailrl.rl.update): a bound
        # that is not one would change the gradient's bits.
        events: list[tuple[str, int]] = []
        out = rollout.generate(5, paired_requests(), GREEDY, MAX_NEW,
                               on_progress=lambda p: events.append(("progress", p.fewest_unfinished)),
                               on_finished=lambda i, c: events.append(("finished", i)))
        assert [c.token_ids for c in out] == [c.token_ids for c in greedy[0]]
        unfinished, bounds = set(range(len(out))), []
        for kind, value in events:
            if kind == "finished":
                unfinished.discard(value)
            elif unfinished:
                assert value <= min(len(out[i].token_ids) for i in unfinished)
                bounds.append(value)
        assert max(bounds) > 0  # it says something once every request has started

    def test_a_stop_ends_each_sequence_at_the_token_where_it_says(self, rollout, greedy):
        out = greedy[0]
        # The token most greedy responses reach before their last: most of them stop there.
        target = Counter(t for c in out for t in set(c.token_ids[:-1])).most_common(1)[0][0]
        finished = []
        stopped = rollout.generate(4, paired_requests(), GREEDY, MAX_NEW, stop=EndsWith(target),
                                   on_finished=lambda i, c: finished.append(i))
        cuts = [c.token_ids.index(target) + 1 if target in c.token_ids else None for c in out]
        assert sum(cut is not None for cut in cuts) >= len(out) // 2
        for c, s, cut in zip(out, stopped, cuts):
            if cut is None:  # never reached: as without the stop
                assert (s.token_ids, s.finish_reason) == (c.token_ids, c.finish_reason)
            else:  # the greedy chain to the stop's token, the step's tokens after it dropped
                assert (s.token_ids, s.finish_reason) == (c.token_ids[:cut], "stop")
            assert len(s.logprobs) == len(s.top1) == len(s.token_ids)
        assert sorted(finished) == list(range(len(out)))
        assert rollout.report().rollout_tok_s > 0

    @pytest.mark.parametrize("prompt,max_new_tokens,word", [
        ((), 4, "request 3 has an empty prompt"),
        ((5,) * 500, 13, "prompt of 500 tokens + max_new_tokens 13"),  # 513 > the model's 512 positions
        ((5, 6), 0, "max_new_tokens must be >= 1, got 0"),
    ], ids=["empty", "too-long", "no-tokens"])
    def test_a_bad_request_fails_in_one_line_and_the_engine_decodes_on(self, rollout, greedy, model, prompt,
                                                                        max_new_tokens, word):
        reqs = paired_requests()
        with pytest.raises(ValueError) as e:
            rollout.generate(2, [*reqs[:3], Request(prompt, seed=7)], GREEDY, max_new_tokens)
        assert word in str(e.value) and "\n" not in str(e.value)
        out = rollout.generate(3, reqs[:4], GREEDY, MAX_NEW)
        assert [c.token_ids for c in out] == [c.token_ids for c in greedy[0][:4]]


# ---- publishing ----------------------------------------------------------------------------------


def test_a_published_policy_and_drafter_version_are_what_the_next_rollout_decodes_with(engine, model, tmp_path):
    """The rollout adapts its learned drafter on the trainer's forwards (Rollout.feed().observe; training
    lags one step) and each publish hands it the policy's new weights and a new drafter version.
    Step 2 decodes with the new policy and the old drafter (its tokens are the new policy's argmax
    chain: no KV of the old weights is reused for the same prompts), step 3 with the new drafter
    version: the same tokens, drafted otherwise; an engine opened from the new policy and that
    version's files decodes and drafts exactly as step 3 did. Publishing the first policy again
    gives step 1's tokens."""
    save_drafter(Drafter.from_target(model, list(range(96)), "target", seed=0), tmp_path / "v0")
    new = perturbed(model)
    reqs = paired_requests(8, 16)

    def sections(drafter: Path, adapt: bool) -> Mapping[str, object]:
        # A fixed draft length: the tuner's would follow measured time, not a function of the inputs.
        return dict(speculation=RolloutSpeculationConfig(spec="on", drafter=str(drafter), draft_depth=3,
                                                         num_draft_tokens=3),
                    adapt=AdaptConfig(adapt_drafter=adapt, drafter_lr=1e-2, drafter_min_steps=4))

    with opened(engine, model, **sections(tmp_path / "v0", adapt=True)) as r:
        r.publish(model)  # as the loop does before its first rollout
        step1, _ = drafting(r, reqs, 1, observed_by=model)
        r.publish(new)  # nothing to train on yet: version 0 drafts on
        step2, out2 = drafting(r, reqs, 2, observed_by=new)
        feed = r.feed()
        assert feed is not None and feed.has_idle_work()  # step 1's forwards, for this step
        units = []
        feed.work_idle(lambda: units.append(1) or len(units) > 1)  # one micro-step on a lent core
        r.publish(new)  # trains version 1: up to drafter_min_steps, on the step's own time
        m = r.report()
        assert (m.drafter_published, m.drafter_micro_steps) == (1, 4)
        assert m.idle_seconds_harvested > 0 and m.drafter_after_s > 0 and m.drafter_loss > 0
        step3, _ = drafting(r, reqs, 3)
        save_drafter(r.adapt.learner.drafter, tmp_path / "v1")
        r.publish(model)
        again, _ = drafting(r, reqs, 4)
    with opened(engine, new, **sections(tmp_path / "v1", adapt=False)) as fresh:
        started, _ = drafting(fresh, reqs, 1)
    assert step2[0] != step1[0] and again[0] == step1[0]
    assert all(is_greedy_chain(new, c, 24) for c in out2)
    assert (step1[3], step2[3], step3[3], started[3]) == (0, 0, 1, 0)
    assert step3[:3] == started[:3]
    assert step3[0] == step2[0] and step3[1:3] != step2[1:3]  # greedy tokens are the policy's, whatever drafts


# ---- resume --------------------------------------------------------------------------------------


def mean_char_reward(prompt: str, completion: str, answer: str) -> float:
    """Varies between random responses, so every group has reward spread and the update is never empty."""
    return sum(map(ord, completion)) / (126.0 * len(completion)) if completion else 0.0


# vLLM's resumed run is a slow test (~33 s on a 2-core AVX2 CPU: three runs, each starting an
# engine): the suite's time budget (docs/testing.md). The native engine's runs by default.
@pytest.mark.parametrize("engine", [pytest.param(name, marks=pytest.mark.slow if name == "vllm" else ())
                                    for name in registry.NAMES])
def test_a_run_stopped_by_ctrl_c_and_resumed_is_the_uninterrupted_run(engine, tmp_path, task_file):
    """`tailrl train` on the engine with an adapting learned drafter, stopped by Ctrl-C in step 3
    and resumed: the same tokens, rewards, updates, held-out evaluations and final weights, and
    the same drafter versions trained, published and drafted with, as the uninterrupted run.
    What the checkpoint must hold for that: the policy, the optimizer, the sampling seeds and
    the rollout's state (its adapting drafter's). Nothing depends on timing: a fixed draft
    length (--spec on, not the tuner's measured choice), the update after the rollout (no idle
    time: the drafter trains its drafter_min_steps floor only), and own_sections' same_run."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vllm engine needs vLLM installed (pip install 'tailrl[vllm]')")
    model = tmp_path / "model"
    write_char_model(model, **VLLM_TINY)
    drafter = save_drafter(Drafter.from_target(load_model(model, "fp32"), list(range(1, 128)), "model"), tmp_path / "d")
    configs = {name: cls() for name, cls in TRAIN_SECTIONS.items()}
    configs["train"] = TrainConfig(
        # bf16 rollouts on an fp32 policy: the engine's copy is refreshed by every publish.
        model=str(model), engine=engine, dtype="bf16", task=str(task_file), reward=f"{__name__}:mean_char_reward",
        num_prompts=3, group_size=4, max_new_tokens=12, steps=3, seed=5, eval_every=3, eval_problems=4,
        overlap_batch=0)
    # kl and clip-higher on, so the resumed step needs the reference model too, and a warm-up it
    # must pick up from the step number. lr: a far larger step moves the embedding off the
    # drafter's fingerprint (Drafter.attach refuses).
    configs["grpo"] = GRPOConfig(lr=1e-3, lr_warmup_steps=1, micro_batch=5, kl_coef=0.05, clip_high=0.28)
    configs["speculation"] = RolloutSpeculationConfig(spec="on", drafter=str(drafter), draft_depth=3,
                                                      num_draft_tokens=3)
    configs["adapt"] = AdaptConfig(drafter_batch_tokens=256, drafter_min_steps=3)  # a row holds a group
    configs.update(own_sections(engine, same_run=True))
    train(run_config(configs), tmp_path / "straight")

    def ctrl_c_in_step_3(event):
        if isinstance(event, RolloutProgress) and event.step == 3:
            raise KeyboardInterrupt

    result = train(run_config(configs), tmp_path / "resumed", on_event=ctrl_c_in_step_3)
    assert result.interrupted and result.step == 2
    assert train(run_config(configs), tmp_path / "resumed", resume=True).step == 3
    straight, resumed = (RunDir(tmp_path / name) for name in ("straight", "resumed"))
    records = straight.read_metrics()
    assert comparable(resumed.read_metrics()) == comparable(records)
    assert comparable_evals(resumed.path) == comparable_evals(straight.path)
    assert [e["step"] for e in straight.read_evals()] == [0, 3]  # before the first step, after the last
    # Training lags one step; each step that trained publishes, and the next rollout drafts with it.
    assert [(r["drafter_version"], r["drafter_published"], r["drafter_micro_steps"]) for r in records] == \
        [(0, 0, 0), (0, 1, 3), (1, 2, 3)]
    assert all(r["drafter_loss"] > 0 for r in records[1:]) and all(r["spec_verify_steps"] > 0 for r in records)
    # Every metrics line has the rollout's report and the loop's own fields.
    fields = {f.name for f in dataclasses.fields(RolloutReport)}
    for r in records:
        assert fields | {"reward_mean", "loss", "ratio_mean", "mismatch_kl", "rollout_s", "response_lens"} <= r.keys()
        assert r["tokens_generated"] == sum(r["response_lens"]) > 0 and r["rollout_tok_s"] > 0 and r["decode_steps"] > 0
        assert math.isfinite(r["loss"]) and abs(r["ratio_mean"] - 1) < 0.05
    assert f'engine = "{engine}"' in (straight.path / "config.toml").read_text()
    (a, a_opt), (b, b_opt) = (final_state(run.path) for run in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for x, y in zip(a_opt["state"].values(), b_opt["state"].values(), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    states = [RunDir.load_checkpoint(run.latest_checkpoint())[1].rollout for run in (straight, resumed)]
    assert [state.adapt["learner"]["version"] for state in states] == [2, 2]
    weights = [state.adapt["learner"]["weights"] for state in states]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
