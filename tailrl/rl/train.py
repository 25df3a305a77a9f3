"""The GRPO training loop: rollout -> rewards -> advantages -> update -> publish the weights.

`train` runs one RL step per iteration of one loop, readable top to bottom, each stage a call:
`rollout_and_gradient` (the rollout, each group's rewards and advantages, the gradient of the
token-mean loss: tailrl.rl.phases, overlapped with the rollout's tail unless overlap_batch is
0), `clip`, then the optimizer step, publishing the weights and the checkpoint (`save`), and,
every eval_every steps, the held-out evaluation (`evaluate_heldout`, tailrl.rl.heldout); the
stages are methods of `Trainer`, which holds what lives from step to step; each step's record
(metrics.jsonl) is assembled by tailrl.rl.metrics. The update's tensor plumbing is
tailrl.rl.packing and tailrl.rl.update. The rollout is whatever `RunConfig.rollout` opens behind
the Rollout protocol (tailrl.rollout.protocol): tailrl's native engine, in this process by
default, or several worker processes / Ray actors whose idle time in the long tail trains the
drafter, or a vLLM engine in this process (--engine vllm).

Weights. The policy trains in `train_dtype` (fp32 master weights: an AdamW update of lr ~1e-5
relative to a weight vanishes in bf16's 8-bit mantissa). Rollouts run in `dtype`; when it
differs, on a copy refreshed from the policy after every update, else on the policy itself.
dtype "auto" (tailrl.loading.resolve_dtype) picks bf16 only where bf16 matmuls are fast: on
GPUs and on CPUs with native bf16 instructions; elsewhere a bf16 matmul runs on a slow emulation
(docs/performance.md).

Behaviour log-probs. Each rollout batch gets exactly one optimizer step, so the trainer's own
recompute of the sampling policy would equal the policy being differentiated (ratio exactly 1,
nothing clipped). But the tokens were sampled by the rollout engine, which computes the policy
differently (a bf16 copy, cached decode kernels, another engine), and it records each token's
log-prob. The PPO ratio is taken against those (tailrl.rl.grpo.policy_loss): clip_low/clip_high
keep the update near the policy that actually sampled, is_cap truncates the importance weight
of tokens the two disagree on most, and the metrics report the ratio (`ratio_mean`,
`ratio_max`), the clipped and capped shares and the mismatch's KL (`mismatch_kl`). Where engine
and trainer agree the ratio is 1 and the gradient is A * grad log p (DeepSeek's GRPO with one
iteration per batch).

Skipped groups. A group whose rewards are all equal has zero advantages; it is left out of the
update (neither computed nor counted in the token mean, as DAPO's dynamic sampling drops it) but
counts in the reward metrics.

Speculative rollouts are the rollout's business, and lossless: they change speed, not the
distribution of tokens (docs/lossless.md). So is the drafter: the loop hands the rollout what
the update's forwards computed (tailrl.rl.phases) and lends it the update's idle core, and the
rollout decides what to train and publishes it with the policy's weights (Rollout.publish); it
reports what its decoding and its drafter did, and its state is checkpointed with the run's.

Knows: tasks, rewards, the tokenizer, the Rollout protocol, AdamW, the run directory.
Does not know: how the engine produces tokens (plain or speculative), where workers run.

Shapes: P prompts, G group_size.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from tailrl.loading import (
    DEVICES,
    DTYPE_CHOICES,
    DTYPES,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
)
from tailrl.memory import Peak, available_gb, fix_mmap_threshold, parameters_gb, resident_gb, total_gb, trim
from tailrl.model import Transformer
from tailrl.records import Request
from tailrl.rl import heldout
from tailrl.rl.budget import RUNTIME_GB, Budget, default_budget_gb, size_update
from tailrl.rl.floor import step_floor
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.guards import deterministic, sigint_deferred
from tailrl.rl.metrics import memory_metrics, step_metrics, step_times
from tailrl.rl.phases import StepInputs, StepWork, UpdateSetup, run_step
from tailrl.rl.plots import write_plots
from tailrl.rl.progress import EvalDone, EvalProgress, Notice, RolloutProgress, StepDone, TrainEvent
from tailrl.rl.rewards import ProblemReward, from_reward_fn, load_reward, task_reward
from tailrl.rl.run_dir import RunDir, TrainState, capture_rng, default_out_dir, policy_weights, restore_rng
from tailrl.rl.tasks import DEFAULT_TASK, Problem, Task, Tokenizer, encode_question, make_task
from tailrl.rollout import registry
from tailrl.rollout.protocol import Rollout, RolloutConfig, WorkerError
from tailrl.sampling import SamplingParams, derive_seed

# Fields that cannot change a run's results, so a resume may change them.
# memory_gb: a resume is sized again, and refused where that changes the update's settings.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_problems", "memory_gb")


@dataclass(frozen=True)
class TrainConfig:
    """One GRPO run: model, task, rollout shape, length and checkpoints."""

    model: str | None = field(default=None, metadata={"help": "model directory (None = SmolLM2-135M-Instruct, "
                                                        "cold-started on the task: see --cold-start)"})
    cold_start: bool = field(default=True, metadata={"help": "a new run without --model first fine-tunes the default "
                                                     "model on the task's worked solutions (tailrl sft; cached)"})
    warmup_drafter: bool = field(default=True, metadata={"help": "a new run with speculation and no --drafter first "
                                                         "warms a drafter up on the policy (cached)"})
    drafter_layers: int = field(default=1, metadata={"help": "decoder layers of the drafter a new run warms up "
                                                     "(2 follows long running sums: configs/long.toml)"})
    device: str = field(default="auto", metadata={"help": "auto = cuda when present, else cpu", "choices": DEVICES})
    engine: str = field(default=registry.DEFAULT, metadata={
        "help": "rollout engine: native (tailrl's own) or vllm (an in-process vLLM engine, the [vllm] section; "
                "docs/vllm.md)", "choices": registry.NAMES})
    dtype: str = field(default="auto", metadata={
        "help": "rollout dtype; auto = bf16 where it is fast, else fp32", "choices": DTYPE_CHOICES})
    train_dtype: str = field(
        default="fp32", metadata={"help": "policy (master weights) dtype for the update", "choices": tuple(DTYPES)}
    )
    task: str = field(default=DEFAULT_TASK, metadata={
        "help": "'sums(max_terms=...)', a reasoning-gym name 'name(key=value)' or a .jsonl file"})
    reward: str | None = field(
        default=None, metadata={"help": "user reward 'module:function' (prompt, completion, answer) -> float"}
    )
    format_weight: float = field(
        default=0.0, metadata={"help": "share of the default reward given for using the answer format"}
    )
    reward_timeout_s: float = field(default=10.0, metadata={"help": "a reward call slower than this scores 0"})
    num_prompts: int = field(default=16, metadata={"help": "prompts per step"})
    group_size: int = field(default=4, metadata={"help": "responses per prompt (GRPO group, >= 2)"})
    max_new_tokens: int = field(default=512, metadata={"help": "longest response, in tokens"})
    temperature: float = field(default=1.0, metadata={"help": "rollout sampling temperature (> 0)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0 = off)"})
    steps: int = field(default=30, metadata={"help": "RL steps to run (in total, counting resumed ones)"})
    seed: int = field(default=0, metadata={"help": "run seed: data order and every sampling seed"})
    checkpoint_every: int = field(default=1, metadata={"help": "save a checkpoint every N steps (and at the end)"})
    keep_checkpoints: int = field(default=1, metadata={"help": "checkpoints kept on disk (the newest)"})
    overlap_batch: int = field(
        default=8, metadata={"help": "compute finished groups' gradients while at most this many sequences decode "
                                     "(the rollout's tail); 0 = the update waits for the whole rollout"})
    eval_every: int = field(
        default=10, metadata={"help": "mean reward on fixed held-out problems before the first step, every N steps "
                                      "and after the last (eval.jsonl; 0 = never)"})
    eval_problems: int = field(default=128, metadata={"help": "held-out problems per evaluation, one response each"})
    memory_gb: float | None = field(default=None, metadata={
        "help": "resident memory the run may hold, GiB: the update's micro-batches and checkpointing are sized to "
                "it, and a run that cannot fit stops before it starts (None = half the machine's memory)"})

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2: GRPO normalises rewards within a group, got {self.group_size}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy makes a group's responses identical), "
                             f"got {self.temperature}")
        if self.overlap_batch < 0:
            raise ValueError(f"overlap_batch must be >= 0, got {self.overlap_batch}")
        for name in ("num_prompts", "max_new_tokens", "checkpoint_every", "keep_checkpoints", "eval_problems",
                     "drafter_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0 or self.seed < 0 or self.eval_every < 0:
            raise ValueError(f"steps, seed and eval_every must be >= 0, got {self.steps}, {self.seed} and "
                             f"{self.eval_every}")
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {self.format_weight}")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ValueError(f"memory_gb must be positive, got {self.memory_gb}")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"reward_timeout_s must be positive, got {self.reward_timeout_s}")
        for name, valid in (("device", DEVICES), ("engine", registry.NAMES), ("dtype", DTYPE_CHOICES),
                            ("train_dtype", tuple(DTYPES))):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}")

    def sampling(self) -> SamplingParams:
        """How rollouts and held-out evaluations sample."""
        return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclass(frozen=True)
class RunConfig:
    """A run's configuration, typed: the loop's sections and the rollout's (its engine's own)."""

    rollout: RolloutConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def sections(self) -> dict[str, object]:
        """Every section by name, as config.toml holds them."""
        return {"train": self.train, "grpo": self.grpo, **self.rollout.sections()}


@dataclass(frozen=True)
class TrainResult:
    out_dir: Path
    step: int  # completed steps
    interrupted: bool


# ---- one run's steps ---------------------------------------------------------------------


def rollout_requests(task: Task, tokenizer: Tokenizer, tc: TrainConfig, step: int, data_cursor: int,
                     context: int) -> tuple[list[Problem], list[Request]]:
    """The problems of a step (the task's seeded stream at the data cursor) and group_size
    requests per problem, each seeded by (run seed, step, prompt, sample)."""
    problems = [task.sample(tc.seed, data_cursor + i) for i in range(tc.num_prompts)]
    prompts = [encode_question(tokenizer, p.question) for p in problems]
    _check_context(prompts, data_cursor, tc.max_new_tokens, context)
    G = tc.group_size
    requests = [Request(prompts[i], derive_seed(tc.seed, step, i, j), group=i)
                for i in range(len(prompts)) for j in range(G)]
    return problems, requests


def _check_context(prompts: Sequence[tuple[int, ...]], first_index: int, max_new_tokens: int, limit: int) -> None:
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise ValueError(
                f"problem {first_index + i}: its prompt of {len(p)} tokens + max_new_tokens {max_new_tokens} "
                f"exceeds the model's context of {limit} tokens; lower --max-new-tokens or shorten the prompts"
            )


# ---- the loop --------------------------------------------------------------------------------


@dataclass
class Trainer:
    """One run's parts that live from step to step (built by `start_run`), and the stages of a
    step that `train` calls in order."""

    cfg: RunConfig
    run: RunDir
    task: Task
    reward_fn: ProblemReward
    tokenizer: Tokenizer
    model_dir: Path
    device: torch.device
    policy: Transformer  # trains, in tc.train_dtype
    rollout_model: Transformer  # the policy itself, or a copy in the rollout dtype
    ref: Transformer | None  # the frozen initial policy, for the KL term
    optimizer: torch.optim.Optimizer
    state: TrainState
    rollout: Rollout
    emit: Callable[[TrainEvent], None]
    saved_step: int  # the step of the newest checkpoint; -1 before the first
    heldout: heldout.HeldOut | None  # the evaluation's problems; None: evaluations are off
    budget_gb: float | None  # the memory the update was sized to (tailrl.rl.budget); None: unknown

    @property
    def tc(self) -> TrainConfig:
        return self.cfg.train

    @property
    def gc(self) -> GRPOConfig:
        return self.cfg.grpo

    def rollout_and_gradient(self, step: int, peak: Peak) -> StepWork:
        """The step's rollout, rewards and advantages, and the gradient of the token-mean PPO-clip
        loss in the policy's .grad (tailrl.rl.phases). Problems come from the task's seeded
        stream at the data cursor; each response's sampling seed is keyed by (run seed, step,
        prompt, sample), so the tokens do not depend on batching or on a resume."""
        tc = self.tc
        problems, requests = rollout_requests(self.task, self.tokenizer, tc, step, self.state.data_cursor,
                                              self.rollout_model.cfg.max_position_embeddings)
        inputs = StepInputs(problems, requests, tc.sampling(), tc.max_new_tokens, tc.group_size, self.tokenizer,
                            self.reward_fn, tc.reward_timeout_s)
        setup = UpdateSetup(self.policy, self.gc, self.ref, tc.overlap_batch)
        self.optimizer.zero_grad(set_to_none=True)
        with deterministic(self.device):
            return run_step(self.rollout, step, inputs, setup,
                            lambda progress: self.emit(RolloutProgress(step, tc.steps, progress)), peak)

    def clip(self, work: StepWork) -> float:
        """Clip the gradient's global norm; its norm before clipping (0 when no group trained)."""
        if not work.trained:
            return 0.0
        max_norm = self.gc.grad_clip if self.gc.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm))

    def save(self) -> None:
        """Checkpoint the policy, optimizer, random state and the rollout's state."""
        self.state.rng = capture_rng()
        self.state.rollout = self.rollout.state_dict()  # tuners, the drafter and its training data
        path = self.run.save_checkpoint(policy_weights(self.policy), self.optimizer.state_dict(), self.state,
                                        self.model_dir, self.tc.keep_checkpoints)
        self.saved_step = self.state.step
        self.emit(Notice(f"saved {path}"))

    def evaluate_heldout(self) -> None:
        """The held-out evaluation of the policy after the current step, when one is due and not
        yet recorded (a resume evaluates the checkpoint's policy if a kill came first). It decodes
        on a rollout of its own (plain, in this process), so the training rollout's state is
        untouched, on the rollout model itself: decoding only reads the weights, and between steps
        nothing else decodes with them, so a copy would only add a model's size to the run's
        peak (docs/memory.md)."""
        tc, step = self.tc, self.state.step
        if (self.heldout is None or not heldout.due(step, tc.eval_every, tc.steps)
                or not heldout.missing(self.run.read_evals(), step)):
            return
        problems = len(self.heldout.problems)
        self.emit(Notice(f"held-out evaluation after step {step}: {problems} problems, one response each"))
        evaluation = self.cfg.rollout.for_evaluation(registry.engine(registry.DEFAULT))
        rollout = evaluation.open(self.rollout_model, tc.seed)
        try:
            rollout.publish(self.policy)  # the rollout model may be a copy workers on Ray never update
            with deterministic(self.device):
                record = heldout.evaluate(rollout, self.heldout, tc.seed, tc.sampling(), tc.max_new_tokens,
                                          self.tokenizer, self.reward_fn, tc.reward_timeout_s,
                                          lambda progress: self.emit(EvalProgress(step, progress)))
        finally:
            rollout.close()
            trim()  # the cache and packed weights, below malloc's mmap threshold: free, but resident until trimmed
        record = {"step": step, **record}
        self.run.append_eval(record)
        self.emit(EvalDone(record))

    def plot(self) -> None:
        """Redraw the run's plots; a plot must never stop training."""
        try:
            write_plots(self.run.read_metrics(), self.run.plots_dir, self.run.read_evals())
        except Exception as e:  # noqa: BLE001
            self.emit(Notice(f"warning: plots not written: {e!r}"))


def fit_memory(cfg: RunConfig, task: Task, tokenizer: Tokenizer, models: Sequence[Transformer], policy: Transformer,
               rollout_model: Transformer, device: torch.device) -> tuple[RunConfig, float | None]:
    """The run's config with the update sized to its memory budget (tailrl.rl.budget), and the
    budget (GiB; None where neither the user nor the machine says); ValueError where the budget,
    or a step at the run's limits, cannot fit the memory left (tailrl.rl.floor): the shortest
    prompt of the first step for the floor, the longest for the budget, every response at
    max_new_tokens."""
    tc, gc = cfg.train, cfg.grpo
    prompts = [len(encode_question(tokenizer, task.sample(tc.seed, i).question)) for i in range(tc.num_prompts)]
    bf16 = resolve_dtype(gc.autocast, device) == "bf16"
    budget_gb = tc.memory_gb if tc.memory_gb is not None else default_budget_gb(total_gb())
    if budget_gb is not None:
        weights = parameters_gb(policy)
        rollout = cfg.rollout.memory(rollout_model, tc.num_prompts * tc.group_size, max(prompts) + tc.max_new_tokens)
        fixed = {"models": sum(parameters_gb(m) for m in {id(m): m for m in models}.values()),
                 "optimizer": 2 * weights, "rollout": rollout.gb, "runtime": RUNTIME_GB}
        gc = size_update(gc, Budget(budget_gb, fixed), policy.cfg, weights, bf16, max(prompts) + tc.max_new_tokens)
    held = cfg.rollout.memory(rollout_model, tc.num_prompts * tc.group_size, min(prompts) + tc.max_new_tokens)
    step_floor(policy, gc, bf16, tc.group_size, tc.max_new_tokens, held).check(available_gb(), tc.max_new_tokens)
    return dataclasses.replace(cfg, grpo=gc), budget_gb


def start_run(cfg: RunConfig, out_dir: str | Path | None, resume: bool, emit: Callable[[TrainEvent], None]) -> Trainer:
    """Open the run directory, load the models (from the last checkpoint on a resume), restore
    the optimizer and random state, open the rollout."""
    tc, gc = cfg.train, cfg.grpo
    if resume and out_dir is None:
        raise ValueError("resume needs the run directory")
    task = make_task(tc.task)
    reward_fn = task_reward(task, tc.format_weight) if tc.reward is None else from_reward_fn(load_reward(tc.reward))
    model_dir = resolve_model_dir(tc.model)
    tokenizer = load_tokenizer(model_dir)
    checkpoint = RunDir(Path(out_dir)).latest_checkpoint() if resume else None  # the run's config is checked below
    device = resolve_device(tc.device)
    dtype = resolve_dtype(tc.dtype, device)
    policy = load_model(checkpoint or model_dir, tc.train_dtype, device).requires_grad_(True)
    rollout_model = policy if dtype == tc.train_dtype else load_model(checkpoint or model_dir, dtype, device)
    ref = load_model(model_dir, tc.train_dtype, device) if gc.kl_coef > 0 else None
    # Sized before the run's config is compared or written: a resume sized to another budget is refused.
    cfg, budget_gb = fit_memory(cfg, task, tokenizer, (policy, rollout_model, ref or policy), policy, rollout_model,
                                device)
    gc = cfg.grpo
    if resume:
        run = RunDir.open(out_dir, cfg.sections(), may_change=RESUMABLE_CHANGES)
    else:  # after the checks: a run that cannot start leaves no directory behind
        run = RunDir.create(out_dir if out_dir is not None else default_out_dir(), cfg.sections())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=gc.lr, weight_decay=gc.weight_decay)
    state = TrainState()
    if checkpoint is not None:
        optimizer_state, state = run.load_checkpoint(checkpoint)
        optimizer.load_state_dict(optimizer_state)
        restore_rng(state.rng)
        run.truncate_metrics(state.step)
        emit(Notice(f"resumed {run.path} at step {state.step}"))
    else:
        torch.manual_seed(tc.seed)
        emit(Notice(f"run directory {run.path}"))
    rollout = cfg.rollout.open(rollout_model, tc.seed, state.rollout)
    rollout.publish(policy)  # the policy the first rollout samples from (and its drafter learns from)
    where = "on the policy" if rollout_model is policy else f"on a {dtype} copy"
    emit(Notice(f"policy in {tc.train_dtype} on {device}; rollouts {where}"))
    held = (heldout.heldout_set(task, tc.seed, tc.eval_problems, lambda q: encode_question(tokenizer, q))
            if tc.eval_every else None)
    return Trainer(cfg, run, task, reward_fn, tokenizer, model_dir, device, policy, rollout_model, ref, optimizer,
                   state, rollout, emit, saved_step=state.step if checkpoint is not None else -1, heldout=held,
                   budget_gb=budget_gb)


def train(cfg: RunConfig, out_dir: str | Path | None = None, resume: bool = False,
          on_event: Callable[[TrainEvent], None] | None = None) -> TrainResult:
    """Run GRPO as configured.

    A new run writes to `out_dir` (default runs/<timestamp>); `resume=True` continues the run
    in `out_dir` from its last checkpoint and reproduces what an uninterrupted run computes.
    Ctrl-C saves the last completed step and returns with `interrupted=True`.
    """
    fix_mmap_threshold()  # the update's memory (tailrl.memory)
    trainer = start_run(cfg, out_dir, resume, on_event or (lambda event: None))
    tc, state = trainer.tc, trainer.state
    try:
        trainer.evaluate_heldout()  # the starting policy (or, on a resume, an evaluation a kill cut short)
        while state.step < tc.steps:
            step = state.step + 1
            t_start = time.perf_counter()
            peak = Peak().start()
            work = trainer.rollout_and_gradient(step, peak)  # 1-3. rollout, rewards and advantages, the gradient
            grad_norm = trainer.clip(work)
            with sigint_deferred():  # from here to the checkpoint, all or nothing
                if work.trained:
                    for group in trainer.optimizer.param_groups:
                        group["lr"] = trainer.gc.lr_at(step)
                    trainer.optimizer.step()
                    trainer.optimizer.zero_grad(set_to_none=True)  # a policy-sized buffer, unused until the next step
                trim()  # the update's freed tensors, kept by its thread's malloc arena (tailrl.memory)
                update_peak = peak.gb  # from the rollout's end: what is left of the gradient, the optimizer step
                trainer.rollout.publish(trainer.policy)  # 4. the next rollout samples from the updated policy
                t_train = time.perf_counter()
                state.step, state.data_cursor = step, state.data_cursor + tc.num_prompts
                metrics = step_metrics(step, tc.max_new_tokens, work, grad_norm, step_times(work, t_train - t_start),
                                       trainer.rollout.report(), trainer.gc.lr_at(step))
                held = resident_gb()  # before the high-water mark, which then covers it
                metrics.update(memory_metrics(work.rollout_peak_gb, update_peak, peak.gb, held, trainer.budget_gb))
                trainer.run.append_metrics(metrics)
                if step % tc.checkpoint_every == 0 or step == tc.steps:
                    trainer.save()  # 5. checkpoint
            trainer.emit(StepDone(tc.steps, metrics))
            trainer.evaluate_heldout()
            trainer.plot()
    except KeyboardInterrupt:
        if trainer.saved_step != state.step:
            trainer.save()
        trainer.emit(Notice(f"interrupted; resume with --resume {trainer.run.path}"))
        return TrainResult(trainer.run.path, state.step, interrupted=True)
    except WorkerError as e:  # the failed step applied nothing; keep the completed ones
        if trainer.saved_step != state.step:
            trainer.save()
        raise WorkerError(e.rank, f"{e.reason}; the run stopped after step {state.step}, "
                          f"resume with --resume {trainer.run.path}") from None
    finally:
        trainer.rollout.close()
    if trainer.saved_step != state.step:  # a run of 0 steps still leaves its starting checkpoint
        trainer.save()
    if (g := heldout.gain(trainer.run.read_evals())) is not None:
        trainer.emit(Notice(g.line()))
    return TrainResult(trainer.run.path, state.step, interrupted=False)
