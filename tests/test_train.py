"""The GRPO loop on a tiny random model: micro-batch invariance of the update, resume after
Ctrl-C or SIGKILL reproducing an uninterrupted run, the run directory's files, and clear errors."""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import comparable, comparable_evals, final_state, high_chars_reward, tiny_configs

from tailrl.config import ConfigError, read_toml, resolve
from tailrl.loading import load_model, load_tokenizer
from tailrl.pipeline import TRAIN_SECTIONS, run_config
from tailrl.rl import heldout
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.guards import deterministic, sigint_deferred
from tailrl.rl.packing import ON_POLICY, Sample, packed_logprobs
from tailrl.rl.progress import ConsolePrinter, EvalProgress, Notice, RolloutProgress, StepDone
from tailrl.rl.rewards import from_reward_fn
from tailrl.rl.run_dir import RunDir, RunDirError, TrainState, policy_weights
from tailrl.rl.tasks import encode_question, make_task
from tailrl.rl.train import train
from tailrl.rl.update import accumulate_gradients
from tailrl.rollout.native.config import NativeRolloutConfig
from tailrl.sampling import SamplingParams
from tailrl.speculative.modes import SpeculationConfig
from tailrl.tuner import TunerConfig

pytestmark = pytest.mark.usefixtures("no_plots")

REQUIRED = {
    "step", "reward_mean", "reward_std", "response_len_mean", "response_len_max", "rollout_s", "reward_s",
    "train_s", "step_s", "tokens_generated", "loss", "pg_loss", "kl", "reward_failures", "reward_timeouts",
    "groups_skipped", "response_lens", "grad_norm", "sd_fraction", "plain_s", "draft_s", "verify_s",
    "accept_hist", "by_bucket", "arm_by_bucket", "batch_timeline", "clip_fraction", "ratio_mean", "ratio_max",
    "capped_fraction", "mismatch_kl", "peak_rss_gb", "rollout_peak_rss_gb", "update_peak_rss_gb", "held_rss_gb",
}


def failing_reward(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError("reward bug")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, char_model_dir, task_file):
    """Three uninterrupted steps: the reference the resume tests must reproduce."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    events = []
    result = train(run_config(tiny_configs(char_model_dir, task_file)), out, on_event=events.append)
    assert result.step == 3 and not result.interrupted
    return out, events


# ---- the update ------------------------------------------------------------------------------


def _ragged_samples(vocab: int) -> list[Sample]:
    """Eight responses of lengths 1-9 to three prompts (3 + 3 + 2 responses, siblings adjacent),
    on-policy (their importance ratio is 1)."""
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(3, vocab, (p,), generator=g).tolist()) for p in (5, 3, 7)]
    out = []
    for i in range(8):
        n = 1 + (5 * i) % 9
        out.append(Sample(prompts[i // 3], torch.randint(3, vocab, (n,), generator=g).tolist(),
                          float(torch.randn(1, generator=g)), ON_POLICY))
    return out


def _reference_grads(policy, ref, samples, temperature, kl_coef):
    """The loss computed row by row without padding or micro-batches, straight from the logits.

    With old = current log-probs the ratio is 1, so per token pg = -A and k3 = e^d - d - 1.
    """
    total = sum(len(s.token_ids) for s in samples)
    policy.zero_grad()
    loss = 0.0
    for s in samples:
        ids = torch.tensor([list(s.prompt_ids) + list(s.token_ids)])
        pos = torch.arange(ids.shape[1])[None]
        p = len(s.prompt_ids)
        targets = torch.tensor(list(s.token_ids))
        lp = torch.log_softmax(policy(ids, pos)[0, p - 1 : -1] / temperature, -1)[torch.arange(len(targets)), targets]
        with torch.no_grad():
            rlp = torch.log_softmax(ref(ids, pos)[0, p - 1 : -1] / temperature, -1)[torch.arange(len(targets)), targets]
        d = rlp - lp
        loss = loss + (-s.advantage * torch.exp(lp - lp.detach()) + kl_coef * (torch.exp(d) - d - 1)).sum() / total
    loss.backward()
    return loss.item(), [p.grad.clone() for p in policy.parameters()]


def test_micro_batches_give_the_full_batch_gradient(char_model_dir):
    # fp64 so that equality holds to 1e-12: only summation order differs between the paths.
    policy = load_model(char_model_dir, dtype="fp32").double().requires_grad_(True)
    ref = load_model(char_model_dir, dtype="fp32").double()
    with torch.no_grad():  # a reference that differs from the policy, so the KL term is non-zero
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    samples = _ragged_samples(policy.cfg.vocab_size)
    want_loss, want = _reference_grads(policy, ref, samples, 0.7, kl_coef=0.1)
    # 8: one pack with three prompts; 3 and 5: packs that split groups; 1: a row per response.
    for micro in (8, 5, 3, 1):
        policy.zero_grad()
        cfg = GRPOConfig(micro_batch=micro, kl_coef=0.1)
        stats = accumulate_gradients(policy, samples, cfg, 0.7, ref)
        assert stats.tokens == sum(len(s.token_ids) for s in samples)
        assert stats.loss == pytest.approx(want_loss, abs=1e-12)
        assert stats.kl > 0 and stats.ratio_mean == pytest.approx(1.0, abs=1e-12)
        for p, w in zip(policy.parameters(), want):
            torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-12)


def test_autocast_bf16_computes_the_update_in_bf16(char_model_dir):
    # fp32 weights: bf16 autocast must change the gradient's bits (it is on) and stay within
    # bf16's precision of the fp32 gradient (it computes the same thing). Measured relative
    # error on this model: ~0.5%; bf16's 8-bit mantissa alone is 0.4% per rounding.
    policy = load_model(char_model_dir, dtype="fp32").requires_grad_(True)
    samples = _ragged_samples(policy.cfg.vocab_size)
    grads = {}
    for autocast in ("fp32", "bf16"):
        policy.zero_grad()
        accumulate_gradients(policy, samples, GRPOConfig(micro_batch=3, autocast=autocast), 0.7)
        grads[autocast] = torch.cat([p.grad.flatten() for p in policy.parameters()])
    error = (grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert 0 < error < 0.03, error


def test_one_update_moves_the_policy_towards_better_responses(char_model_dir):
    # The update ascends J = sum_i A_i * sum_t log p(token_it) / N; a small enough SGD step
    # must raise J (first order), and the best response's log-prob must rise relative to the worst.
    policy = load_model(char_model_dir, dtype="fp32").double().requires_grad_(True)
    samples = _ragged_samples(policy.cfg.vocab_size)

    def objective_and_logprobs():
        with torch.no_grad():
            lp = packed_logprobs(policy, samples, 1.0)[0]  # (N,)
        per_sample = torch.split(lp, [len(s.token_ids) for s in samples])
        j = sum(s.advantage * x.sum() for s, x in zip(samples, per_sample)) / lp.numel()
        return float(j), [float(x.sum()) for x in per_sample]

    j0, lp0 = objective_and_logprobs()
    policy.zero_grad()
    accumulate_gradients(policy, samples, GRPOConfig(micro_batch=3), 1.0)
    torch.optim.SGD(policy.parameters(), lr=1e-2).step()
    j1, lp1 = objective_and_logprobs()
    assert j1 > j0
    best = max(range(len(samples)), key=lambda i: samples[i].advantage)
    worst = min(range(len(samples)), key=lambda i: samples[i].advantage)
    assert lp1[best] - lp0[best] > lp1[worst] - lp0[worst]


# ---- the loop, the run directory and resume -------------------------------------------------------


def test_metrics_config_and_plots(straight_run, char_model_dir, task_file):
    out, events = straight_run
    records = RunDir(out).read_metrics()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["lr"] for r in records] == [1.5e-2, 3e-2, 3e-2]  # the one warm-up step at half the lr
    for r in records:
        assert REQUIRED <= set(r)
        assert len(r["response_lens"]) == 3 * 4
        assert r["tokens_generated"] == sum(r["response_lens"])
        assert r["response_len_max"] == max(r["response_lens"]) <= 12
        assert r["groups_skipped"] == 0 and r["grad_norm"] > 0  # every group had reward spread
        assert (r["reward_failures"], r["reward_timeouts"]) == (0, 0)
        # bf16 rollouts, fp32 policy: the ratio against the engine's log-probs sees the difference.
        assert r["ratio_max"] > 1.0 and r["mismatch_kl"] > 0.0
        # The step's resident peak covers the rollout's, the update's and what the step's end holds
        # (Linux counts them all: tailrl.memory).
        if sys.platform == "linux":
            assert 0.0 < max(r["rollout_peak_rss_gb"], r["update_peak_rss_gb"]) <= r["peak_rss_gb"]
            assert 0.0 < r["held_rss_gb"] <= r["peak_rss_gb"]
    assert [e.metrics["step"] for e in events if isinstance(e, StepDone)] == [1, 2, 3]
    assert any(isinstance(e, RolloutProgress) for e in events)
    # Off a terminal the printer writes the notices, one rollout line (it is rate-limited) and a
    # summary line per step.
    stream = io.StringIO()
    printer = ConsolePrinter(stream, every_s=3600)
    for e in events:
        printer(e)
    lines = stream.getvalue().splitlines()
    assert sum(line.startswith("step 1/3 rollout:") for line in lines) == 1
    # Each held-out evaluation shows its progress while it decodes (after steps 0, 2 and 3).
    assert sorted({e.step for e in events if isinstance(e, EvalProgress)}) == [0, 2, 3]
    finals = [e.progress for e in events if isinstance(e, EvalProgress) and e.progress.done == e.progress.total]
    assert len(finals) == 3 and all(p.total == 4 for p in finals)
    assert any(line.startswith("held-out evaluation after step 0: ") and " done, running " in line for line in lines)
    assert [line.split(" |")[0] for line in lines if " | reward " in line] == ["step 1/3", "step 2/3", "step 3/3"]
    assert all(e.text in lines for e in events if isinstance(e, Notice))
    # The saved config reads back to the run's config.
    saved = resolve(TRAIN_SECTIONS, toml=read_toml(out / "config.toml"))
    assert saved == {**resolve(TRAIN_SECTIONS), **tiny_configs(char_model_dir, task_file)}  # spec, tuner: defaults
    for name in ("rewards", "lengths", "times", "decoding"):
        assert (out / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # One checkpoint kept; it is a loadable model directory, and training changed the weights.
    (ckpt,) = RunDir(out).checkpoints()
    assert ckpt.name == "step_000003"
    trained, initial = load_model(ckpt, dtype="fp32"), load_model(char_model_dir, dtype="fp32")
    assert not torch.equal(trained.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    assert trained.lm_head.weight is trained.model.embed_tokens.weight  # the tie survives


def test_ctrl_c_then_resume_reproduces_the_uninterrupted_run(straight_run, tmp_path, char_model_dir, task_file):
    straight, _ = straight_run
    out = tmp_path / "interrupted"

    def ctrl_c_in_step_3(event):
        if isinstance(event, RolloutProgress) and event.step == 3 and event.progress.done >= 2:
            raise KeyboardInterrupt

    result = train(run_config(tiny_configs(char_model_dir, task_file)), out, on_event=ctrl_c_in_step_3)
    assert result.interrupted and result.step == 2
    assert [p.name for p in RunDir(out).checkpoints()] == ["step_000002"]
    assert [r["step"] for r in RunDir(out).read_metrics()] == [1, 2]

    result = train(run_config(tiny_configs(char_model_dir, task_file)), out, resume=True)
    assert result.step == 3 and not result.interrupted
    assert comparable(RunDir(out).read_metrics()) == comparable(RunDir(straight).read_metrics())
    assert comparable_evals(out) == comparable_evals(straight)
    weights, optimizer_state = final_state(out)
    want_weights, want_optimizer = final_state(straight)
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[k], want_weights[k]) for k in weights)
    for a, b in zip(optimizer_state["state"].values(), want_optimizer["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_heldout_evaluations_score_the_policy_after_their_step(straight_run, char_model_dir, task_file):
    straight, _ = straight_run
    evals = RunDir(straight).read_evals()
    assert [e["step"] for e in evals] == [0, 2, 3]  # before the first step, every 2 steps, after the last
    assert all(e["heldout_problems"] == 4 and 0.0 <= e["heldout_reward"] <= 1.0 for e in evals)
    # The evaluation after the last step is the final checkpoint's: the same problems, seeds and
    # reward, evaluated from the saved weights (the bf16 rollout copy casts the same fp32 values).
    tc = tiny_configs(char_model_dir, task_file)["train"]
    tokenizer = load_tokenizer(char_model_dir)
    held = heldout.heldout_set(make_task(tc.task), tc.seed, tc.eval_problems, lambda q: encode_question(tokenizer, q))
    final = load_model(RunDir(straight).latest_checkpoint(), dtype="bf16")
    engine = tiny_configs(char_model_dir, task_file)["engine"]
    rollout = NativeRolloutConfig(engine=engine, speculation=SpeculationConfig(spec="off")).open(final, 0)
    want = heldout.evaluate(rollout, held, tc.seed, SamplingParams(tc.temperature), tc.max_new_tokens, tokenizer,
                            from_reward_fn(high_chars_reward), 10.0)
    assert {k: v for k, v in evals[-1].items() if k not in ("step", "heldout_s")} == \
        {k: v for k, v in want.items() if k != "heldout_s"}


def test_the_run_ends_with_its_heldout_gain_and_its_standard_error(straight_run):
    straight, events = straight_run
    first, last = RunDir(straight).read_evals()[0], RunDir(straight).read_evals()[-1]
    diffs = [b - a for a, b in zip(first["heldout_rewards"], last["heldout_rewards"])]
    mean = sum(diffs) / len(diffs)
    se = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
    want = (f"held-out reward {first['heldout_reward']:.3f} at step 0 -> {last['heldout_reward']:.3f} at step 3: "
            f"{last['heldout_reward'] - first['heldout_reward']:+.3f} +- {se:.3f} (one standard error, 4 problems)")
    assert [e.text for e in events if isinstance(e, Notice) and e.text.startswith("held-out reward")] == [want]


def test_heldout_evaluations_do_not_change_the_run(straight_run, tmp_path, char_model_dir, task_file):
    straight, _ = straight_run
    train(run_config(tiny_configs(char_model_dir, task_file, eval_every=0)), tmp_path / "no-eval")
    assert RunDir(tmp_path / "no-eval").read_evals() == []
    assert comparable(RunDir(tmp_path / "no-eval").read_metrics()) == comparable(RunDir(straight).read_metrics())


def test_ctrl_c_in_an_evaluation_then_resume_evaluates_the_checkpoint(straight_run, tmp_path, char_model_dir,
                                                                      task_file):
    straight, _ = straight_run
    out = tmp_path / "interrupted-eval"

    def ctrl_c_in_the_step_2_evaluation(event):
        if isinstance(event, Notice) and event.text.startswith("held-out evaluation after step 2"):
            raise KeyboardInterrupt

    result = train(run_config(tiny_configs(char_model_dir, task_file)), out, on_event=ctrl_c_in_the_step_2_evaluation)
    assert result.interrupted and result.step == 2
    assert [e["step"] for e in RunDir(out).read_evals()] == [0]
    train(run_config(tiny_configs(char_model_dir, task_file)), out, resume=True)
    assert comparable_evals(out) == comparable_evals(straight)
    assert comparable(RunDir(out).read_metrics()) == comparable(RunDir(straight).read_metrics())


_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from conftest import tiny_configs
    import tailrl.rl.train
    from tailrl.pipeline import run_config
    from tailrl.rl.progress import RolloutProgress
    from tailrl.rl.train import train

    tailrl.rl.train.write_plots = lambda *args: []

    def kill_in_step_3(event):
        if isinstance(event, RolloutProgress) and event.step == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    train(run_config(tiny_configs(sys.argv[1], sys.argv[2])), sys.argv[3], on_event=kill_in_step_3)
    """
)


def test_sigkill_mid_step_loses_only_that_step(straight_run, tmp_path, char_model_dir, task_file):
    straight, _ = straight_run
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(char_model_dir), str(task_file), str(out)],
        env=env, capture_output=True, text=True, timeout=600,  # a guard against a hang only: the run takes seconds
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [r["step"] for r in RunDir(out).read_metrics()] == [1, 2]
    train(run_config(tiny_configs(char_model_dir, task_file)), out, resume=True)
    assert comparable(RunDir(out).read_metrics()) == comparable(RunDir(straight).read_metrics())
    assert comparable_evals(out) == comparable_evals(straight)


def test_speculative_rollouts_give_the_same_run(tmp_path, char_model_dir, task_file):
    # fp32 rollouts in exact mode: a verify forward computes a one-token step's logits bit for
    # bit (tailrl.model's row invariance), so the runs are equal (deterministic, no false failures).
    # "auto" is the tuner picking a uniformly random arm at every step (epsilon 1, no arm a clear
    # loser): the arms a tuner picks by measured speed change nothing but the speed, whichever
    # they are.
    runs = {}
    for mode in ("off", "on", "auto"):
        configs = tiny_configs(char_model_dir, task_file, dtype="fp32", steps=2)
        configs["speculation"] = SpeculationConfig(spec=mode, draft_depth=3, num_draft_tokens=3)
        configs["tuner"] = TunerConfig(epsilon=1.0, loser_margin=1.0, switch_patience=0)
        train(run_config(configs), tmp_path / mode)
        runs[mode] = RunDir(tmp_path / mode).read_metrics()
    assert all(r["spec_verify_steps"] == 0 for r in runs["off"])
    assert all(r["spec_verify_steps"] > 0 for r in runs["on"])  # it did speculate
    assert [r["sd_fraction"] for r in runs["off"]] == [0.0, 0.0]
    assert [r["sd_fraction"] for r in runs["on"]] == [1.0, 1.0]
    assert all(set(r["arm_by_bucket"].values()) == {"ngram(3,1,3)"} for r in runs["on"])
    assert all(0.0 < r["sd_fraction"] < 1.0 for r in runs["auto"])  # plain and speculative steps mixed
    assert len({arm for r in runs["auto"] for arms in r["by_bucket"].values() for arm in arms}) >= 3
    assert comparable(runs["on"]) == comparable(runs["off"]) == comparable(runs["auto"])


def test_truncate_metrics_drops_later_and_torn_records(tmp_path, char_model_dir, task_file):
    run = RunDir.create(tmp_path / "run", tiny_configs(char_model_dir, task_file))
    for step in (1, 2, 3):
        run.append_metrics({"step": step, "reward_mean": step / 10})
    with open(run.metrics_path, "a") as fh:
        fh.write('{"step": 4, "rew')  # a kill mid-write
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    run.truncate_metrics(2)
    assert run.read_metrics() == [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}]


def test_checkpoints_are_atomic(tmp_path, char_model_dir, task_file):
    configs = tiny_configs(char_model_dir, task_file)
    run = RunDir.create(tmp_path / "run", configs)
    weights = policy_weights(load_model(char_model_dir, dtype="fp32"))
    first = run.save_checkpoint(weights, {"state": {}}, TrainState(step=1, data_cursor=3), char_model_dir)
    assert run.checkpoints() == [first] and RunDir.load_checkpoint(first)[1].data_cursor == 3

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    # A save that fails half-way (model written, optimizer not) leaves no checkpoint behind.
    with pytest.raises(RuntimeError, match="disk full"):
        run.save_checkpoint(weights, {"boom": Unpicklable()}, TrainState(step=2), char_model_dir)
    assert run.checkpoints() == [first]
    assert [p.name for p in run.checkpoints_dir.iterdir()] == [first.name]
    # A SIGKILL mid-save leaves its temporary directory; it is ignored, and removed on resume.
    stale = run.checkpoints_dir / ".tmp-step_000002.999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert run.latest_checkpoint() == first
    RunDir.open(run.path, configs)
    assert not stale.exists()
    # keep=1: a newer checkpoint replaces the older one only once it is complete.
    second = run.save_checkpoint(weights, {"state": {}}, TrainState(step=2), char_model_dir, keep=1)
    assert run.checkpoints() == [second]


def test_failing_reward_is_counted_and_skips_the_update(tmp_path, char_model_dir, task_file):
    out = tmp_path / "run"
    configs = tiny_configs(char_model_dir, task_file, steps=1, reward=f"{__name__}:failing_reward")
    train(run_config(configs), out)
    (r,) = RunDir(out).read_metrics()
    assert r["reward_failures"] == 12 and r["reward_mean"] == 0.0
    assert r["groups_skipped"] == 3 and r["loss"] == 0.0 and r["train_tokens"] == 0
    trained = load_model(RunDir(out).latest_checkpoint(), dtype="fp32")
    initial = load_model(char_model_dir, dtype="fp32")
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), initial.parameters()))


# ---- errors ----------------------------------------------------------------------------------


def test_bad_configs_and_directories_fail_clearly(straight_run, tmp_path, char_model_dir, task_file):
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        resolve(TRAIN_SECTIONS, toml={"train": {"group_size": 1}})
    too_long = tiny_configs(char_model_dir, task_file, max_new_tokens=400)
    with pytest.raises(ValueError, match="exceeds the model's context of 512 tokens"):
        train(run_config(too_long), tmp_path / "long")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(RunDirError, match="cannot write the output directory"):
        train(run_config(tiny_configs(char_model_dir, task_file)), blocker / "run")
    with pytest.raises(RunDirError, match="no checkpoint"):
        train(run_config(too_long), tmp_path / "long", resume=True)

    out, _ = straight_run
    with pytest.raises(RunDirError, match="already holds a run"):
        train(run_config(tiny_configs(char_model_dir, task_file)), out)
    changed = tiny_configs(char_model_dir, task_file, steps=5)  # steps may change on resume, lr may not
    changed["grpo"] = dataclasses.replace(changed["grpo"], lr=1e-3)
    with pytest.raises(ConfigError, match=r"grpo\.lr: 0\.03 -> 0\.001$"):
        train(run_config(changed), out, resume=True)


def test_the_first_rollout_line_prints_on_a_machine_just_booted(monkeypatch):
    # monotonic() counts from boot on Linux: a printer that assumed a clock origin printed no
    # progress for the first every_s seconds after boot.
    from tailrl.records import Progress
    from tailrl.rl import progress as progress_mod

    clock = iter([0.5, 0.6, 30.4, 30.6])
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    printer = ConsolePrinter(stream, every_s=30)
    for k in range(4):
        printer(RolloutProgress(1, 2, Progress(k, 4, 4 - k, 10 * k, 1.0)))
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["step 1/2 rollout: 0/4 done", "step 1/2 rollout: 3/4 done"]


def test_sigint_is_held_until_the_block_ends():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("rest of the block")
    assert done == ["rest of the block"]



def test_update_gradients_are_the_same_bits_call_after_call(smollm2_shallow_dir):
    """Two threads, SmolLM2 fp32 (its first two layers: every matmul of the full model's shapes,
    which is what the kernels' choices depend on), the same samples: inside `deterministic` the
    backward pass gives the same gradient bits every call, with the allocator in another state
    each time. Without it they differed on every call on an AMX Xeon (~1e-8), and two runs of
    identical tokens drifted apart (tailrl.rl.guards.deterministic)."""
    import random

    policy = load_model(smollm2_shallow_dir, dtype="fp32").requires_grad_(True)
    rng = random.Random(0)
    prompt = tuple(rng.randrange(100, 20000) for _ in range(150))
    samples = [Sample(prompt, [rng.randrange(100, 20000) for _ in range(30)], rng.uniform(-1, 1), ON_POLICY)
               for _ in range(4)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for rep in range(2):
            policy.zero_grad(set_to_none=True)
            _ = [torch.empty(rng.randrange(1, 5000)) for _ in range(50)]  # another allocator state
            with deterministic(torch.device("cpu")):
                accumulate_gradients(policy, samples, GRPOConfig(), 1.0)
            grads.append([p.grad.clone() for p in policy.parameters()])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_overlapped_update_gives_the_synchronous_run(straight_run, tmp_path, char_model_dir, task_file):
    # straight_run computes each group's gradient in the rollout's tail when it can (overlap_batch
    # 8 >= the 8 running slots, so always); with overlap_batch 0 the update waits for the whole
    # rollout. Same tokens, rewards, losses and gradient norms; same weights and optimizer bits.
    straight, _ = straight_run
    out = tmp_path / "sync"
    train(run_config(tiny_configs(char_model_dir, task_file, overlap_batch=0)), out)
    a, b = RunDir(out).read_metrics(), RunDir(straight).read_metrics()
    assert comparable(a) == comparable(b)
    assert all(r["groups_in_rollout"] == 0 for r in a)
    (wa, oa), (wb, ob) = final_state(out), final_state(straight)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for x, y in zip(oa["state"].values(), ob["state"].values()):
        assert all(torch.equal(x[k], y[k]) for k in x)
