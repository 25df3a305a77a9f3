"""`tailrl bench peers`: the same GRPO steps run by TRL's GRPOTrainer and by tailrl, timed.

Both sides train the same model (fp32) on the same problems (the task's seeded stream, step s
taking problems (s-1)*P .. s*P-1, chat-formatted by tailrl.rl.tasks.format_prompt; TRL applies
the same chat template), P prompts x G samples per step, the same sampling (temperature 1,
top_p 1, no top-k, max_new_tokens), the same reward (tailrl's task reward, wrapped as a TRL
reward function), the same update (AdamW at a constant lr, no weight decay, one optimizer step
per RL step over micro-batches of `micro_batch` responses, token-mean PPO-clip loss with clip
0.2, no KL, grad-norm clip 1.0) and the same number of torch threads. TRL generates with plain
`transformers` `generate` (no vLLM, no continuous batching). The first `warmup` steps of each
side are run but not timed.

Per side: step seconds (median, min, max over the timed steps), and their split into rollout
(generation), reward, and train (everything else: for TRL also tokenization and padding) seconds,
and the tokens generated. TRL's split is timed by wrapping its generate and reward methods
(`_generate_single_turn`, `_calculate_rewards`: private, TRL 1.16's, hence the pin in the
`peers` extra); its step seconds run from one optimizer step's end to the next (a callback).

Not the same on both sides, by design of each library (reported, not equalised):
- the sampled tokens: each side draws its own random numbers, so response lengths differ;
  compare seconds per token as well as seconds per step;
- TRL's `generate` pads the batch and keeps decoding finished rows until the longest is done;
  tailrl's engine drops finished sequences and may speculate (--spec);
- tailrl skips groups whose rewards are all equal in the update (zero advantage), TRL computes
  them; tailrl packs a prompt once per micro-batch, TRL pads prompt + completion per row;
- tailrl takes the PPO ratio against the log-probs its engine recorded, TRL (without vLLM)
  against its own recompute; with fp32 rollouts both are 1 to rounding.

With --lookup, also batch 1 without a model drafter: transformers' prompt-lookup decoding
(`prompt_lookup_num_tokens`) against tailrl's n-gram drafter, each beside its own plain decoding,
one sample of each of the first step's prompts, in tokens/s.

Knows: how to configure a tailrl run and a TRL GRPOTrainer for the same work, and read both
sides' times. Does not know: how either side generates or trains.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tailrl.rl.tasks import DEFAULT_TASK

NO_TRL = "TRL is not installed: pip install 'tailrl[peers]'"
SPEC_MODES = ("off", "auto", "on")


@dataclass(frozen=True)
class BenchPeersConfig:
    model: str | None = field(default=None, metadata={"help": "model directory (default: SmolLM2-135M-Instruct)"})
    task: str = field(default=DEFAULT_TASK, metadata={"help": "reasoning-gym name or .jsonl file"})
    num_prompts: int = field(default=4, metadata={"help": "prompts per step"})
    group_size: int = field(default=4, metadata={"help": "responses per prompt"})
    max_new_tokens: int = field(default=128, metadata={"help": "longest response"})
    steps: int = field(default=2, metadata={"help": "timed RL steps per side"})
    warmup: int = field(default=1, metadata={"help": "untimed RL steps before them"})
    micro_batch: int = field(default=4, metadata={
        "help": "responses per forward/backward (must divide prompts x group)"})
    lr: float = field(default=1e-5, metadata={"help": "AdamW learning rate (constant)"})
    threads: int = field(default=1, metadata={
        "help": "torch threads on both sides (also run with OMP_NUM_THREADS set to it)"})
    spec: str = field(default="auto", metadata={"help": "tailrl's speculative decoding (tailrl train's default: auto)",
                                                "choices": SPEC_MODES})
    drafter: str | None = field(default=None, metadata={"help": "learned drafter directory for tailrl's spec modes"})
    seed: int = field(default=0, metadata={"help": "run seed of both sides"})
    out: str | None = field(default=None, metadata={
        "help": "keep both runs' directories here (default: a temporary one)"})
    lookup: bool = field(default=False, metadata={"help": "also time batch 1, model-free speculation: transformers' "
                                                  "prompt lookup vs tailrl's n-gram drafter (tokens/s)"})

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "steps", "micro_batch", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2 or self.warmup < 0:
            raise ValueError(f"need group_size >= 2 and warmup >= 0, got {self.group_size} and {self.warmup}")
        if (self.num_prompts * self.group_size) % self.micro_batch:
            # TRL accumulates over whole micro-batches of one generation batch.
            raise ValueError(f"micro_batch {self.micro_batch} must divide num_prompts x group_size "
                             f"= {self.num_prompts * self.group_size}")
        if self.spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {', '.join(SPEC_MODES)}, got {self.spec!r}")

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


def require_trl() -> None:
    try:
        import trl  # noqa: F401
    except ImportError:
        raise ValueError(NO_TRL) from None


def summarise(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over the timed steps; each step dict has step_s, rollout_s, reward_s, train_s, tokens."""
    step_s = [s["step_s"] for s in steps]
    tokens = sum(s["tokens"] for s in steps)
    out: dict[str, Any] = {"step_s": statistics.median(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s)}
    out |= {k: statistics.median(s[k] for s in steps) for k in ("rollout_s", "reward_s", "train_s")}
    out |= {"tokens_generated": tokens, "s_per_token": sum(step_s) / tokens if tokens else None, "steps": steps}
    return out


# ---- tailrl ----------------------------------------------------------------------------------


def run_tailrl(cfg: BenchPeersConfig, out: Path) -> dict[str, Any]:
    """tailrl.rl.train.train as configured; its metrics.jsonl gives the times."""
    from tailrl.pipeline import run_config
    from tailrl.rl.grpo import GRPOConfig
    from tailrl.rl.run_dir import RunDir
    from tailrl.rl.train import TrainConfig, train
    from tailrl.speculative.modes import RolloutSpeculationConfig

    configs = {
        # fp32 as on the TRL side; one checkpoint at the end (its save is not in step_s anyway).
        "train": TrainConfig(model=cfg.model, dtype="fp32", task=cfg.task, num_prompts=cfg.num_prompts,
                             group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens, temperature=1.0, top_p=1.0,
                             steps=cfg.total_steps, seed=cfg.seed, checkpoint_every=cfg.total_steps, eval_every=0),
        "grpo": GRPOConfig(lr=cfg.lr, micro_batch=cfg.micro_batch, clip_low=0.2, grad_clip=1.0, kl_coef=0.0),
        "speculation": RolloutSpeculationConfig(spec=cfg.spec, drafter=cfg.drafter),
    }
    train(run_config(configs), out)
    records = RunDir(out).read_metrics()[cfg.warmup:]
    steps = [{k: r[k] for k in ("step_s", "rollout_s", "reward_s", "train_s")}
             | {"tokens": r["tokens_generated"], "train_tokens": r["train_tokens"], "reward_mean": r["reward_mean"],
                "groups_skipped": r["groups_skipped"], "sd_fraction": r["sd_fraction"]} for r in records]
    return summarise(steps)


# ---- TRL -------------------------------------------------------------------------------------


def _timed(fn: Callable[..., Any], sink: list[float]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    return call


def _trl_args(cfg: BenchPeersConfig, out: Path) -> Any:
    from trl import GRPOConfig as TRLConfig

    batch = cfg.num_prompts * cfg.group_size
    return TRLConfig(
        output_dir=str(out), use_cpu=True, bf16=False, seed=cfg.seed,
        # One generation batch of P x G per optimizer step, accumulated in micro-batches as tailrl does.
        per_device_train_batch_size=cfg.micro_batch, gradient_accumulation_steps=batch // cfg.micro_batch,
        num_generations=cfg.group_size, max_steps=cfg.total_steps,
        max_completion_length=cfg.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        loss_type="dapo",  # token mean over the whole accumulated batch: tailrl's aggregation
        beta=0.0, epsilon=0.2, num_iterations=1, scale_rewards="group",
        # TRL turns gradient checkpointing on by default; tailrl does not checkpoint.
        gradient_checkpointing=False,
        shuffle_dataset=False,  # step s trains on the same problems as tailrl's step s
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )


@dataclass
class TrlLog:
    """What a TRL run recorded: per step (one reward call and one generation each) the problems
    scored, the tokens generated, the mean reward, the generation's and the reward's seconds and
    TRL's own "step_time" (its training_step calls, no optimizer step); the clock at the
    training's start and at each step's end."""

    problems: list[list[int]] = field(default_factory=list)  # indices into the run's problems
    tokens: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    gen_s: list[float] = field(default_factory=list)
    reward_s: list[float] = field(default_factory=list)
    own_step_time: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    def steps(self, cfg: BenchPeersConfig) -> list[dict[str, float]]:
        """The timed steps, as `summarise` takes them; RuntimeError where TRL did not run one
        generation of the expected problems per step."""
        P, G = cfg.num_prompts, cfg.group_size
        expected = [[s * P + i for i in range(P) for _ in range(G)] for s in range(cfg.total_steps)]
        if self.problems != expected or len(self.gen_s) != cfg.total_steps:
            raise RuntimeError(f"TRL did not run one generation of the expected problems per step: {self.problems}, "
                               f"{len(self.gen_s)} generations")
        step_s = [b - a for a, b in zip(self.ends, self.ends[1:])]
        return [{"step_s": step_s[k], "rollout_s": self.gen_s[k], "reward_s": self.reward_s[k],
                 "train_s": step_s[k] - self.gen_s[k] - self.reward_s[k], "tokens": self.tokens[k],
                 "train_tokens": self.tokens[k], "reward_mean": self.rewards[k],
                 "trl_step_time": self.own_step_time[k]}
                for k in range(cfg.warmup, cfg.total_steps)]


def _trl_reward(score: Callable[[Any, str], float], problems: list[Any], log: TrlLog) -> Callable[..., list[float]]:
    """`score` as a TRL reward function over the dataset's problem indices, logging each call."""

    def task_score(prompts: list, completions: list, completion_ids: list, problem: list[int], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        log.problems.append(list(problem))
        log.tokens.append(sum(len(ids) for ids in completion_ids))
        r = [score(problems[i], t) for i, t in zip(problem, texts)]
        log.rewards.append(sum(r) / len(r))
        return r

    return task_score


def _step_clock(log: TrlLog) -> Any:
    """A TrainerCallback logging the clock at the training's start and each step's end, and
    TRL's own step times."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log.ends.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log.ends.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if logs and "step_time" in logs:
                log.own_step_time.append(logs["step_time"])

    return StepClock()


def run_trl(cfg: BenchPeersConfig, out: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same problems and reward; step times from a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    from tailrl.loading import resolve_model_dir
    from tailrl.rl.rewards import task_reward
    from tailrl.rl.tasks import format_prompt, make_task

    task = make_task(cfg.task)
    problems = [task.sample(cfg.seed, i) for i in range(cfg.total_steps * cfg.num_prompts)]
    data = Dataset.from_list([{"prompt": format_prompt(p.question), "problem": i} for i, p in enumerate(problems)])
    log = TrlLog()
    reward = _trl_reward(task_reward(task), problems, log)  # tailrl train's default reward (format_weight 0)
    model_dir = resolve_model_dir(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=_trl_args(cfg, out), train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[_step_clock(log)])
    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout, where --json goes
    trainer._generate_single_turn = _timed(trainer._generate_single_turn, log.gen_s)
    trainer._calculate_rewards = _timed(trainer._calculate_rewards, log.reward_s)
    trainer.train()
    return summarise(log.steps(cfg))


# ---- batch 1: prompt lookup vs n-gram drafter ----------------------------------------------------


def _tailrl_batch1(cfg: BenchPeersConfig, model_dir: Path, prompts: list[tuple[int, ...]]) -> dict[str, Any]:
    from tailrl.engine import Engine, EngineConfig, PlainDecoder
    from tailrl.generate import make_requests
    from tailrl.loading import load_model
    from tailrl.sampling import SamplingParams
    from tailrl.speculative.decoder import fixed
    from tailrl.speculative.modes import SpeculationConfig, proposers

    spec = SpeculationConfig(spec="on")  # `--spec on`'s n-gram chain
    engine = Engine(load_model(model_dir, dtype="fp32"), EngineConfig(max_batch=1))
    params = SamplingParams(temperature=1.0, top_p=1.0)
    requests = make_requests(prompts, 1, cfg.seed)
    engine.generate(requests[:1], params, 2)  # allocate the cache outside the timed runs
    out = {}
    for name, decoder in (("plain", PlainDecoder()), ("ngram", fixed(spec.arm, proposers(spec, engine)["ngram"]))):
        engine.decoder = decoder
        tokens, t = 0, time.perf_counter()
        for req in requests:
            tokens += len(engine.generate([req], params, cfg.max_new_tokens)[0].token_ids)
        out[name] = {"tokens": tokens, "tok_s": tokens / (time.perf_counter() - t)}
    out["ngram"]["draft_tokens"] = spec.draft_depth
    return out


def _hf_batch1(cfg: BenchPeersConfig, model_dir: Path, prompts: list[tuple[int, ...]], pad: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from tailrl.speculative.modes import SpeculationConfig

    draft = SpeculationConfig(spec="on").draft_depth  # as many proposed tokens per verify as tailrl's chain
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad)

    def generate(ids: tuple[int, ...], max_new_tokens: int, **extra: Any) -> int:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                            **sampling, **extra)
        return y.shape[1] - x.shape[1]

    generate(prompts[0], 2)  # first-call overheads outside the timed runs
    out = {}
    for name, extra in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": draft})):
        torch.manual_seed(cfg.seed)
        tokens, t = 0, time.perf_counter()
        for ids in prompts:
            tokens += generate(ids, cfg.max_new_tokens, **extra)
        out[name] = {"tokens": tokens, "tok_s": tokens / (time.perf_counter() - t)}
    out["lookup"]["draft_tokens"] = draft
    return out


def run_batch1(cfg: BenchPeersConfig) -> dict[str, Any]:
    """One sample of each of the first step's prompts, one at a time, plain and speculative on
    each side. Tokens differ between sides (own random numbers): compare tokens/s."""
    from tailrl.loading import load_tokenizer, resolve_model_dir
    from tailrl.rl.tasks import encode_question, make_task

    model_dir = resolve_model_dir(cfg.model)
    tok = load_tokenizer(model_dir)
    task = make_task(cfg.task)
    prompts = [encode_question(tok, task.sample(cfg.seed, i).question) for i in range(cfg.num_prompts)]
    out = {"tailrl": _tailrl_batch1(cfg, model_dir, prompts),
           "transformers": _hf_batch1(cfg, model_dir, prompts, tok.pad_token_id)}
    out["ngram_over_lookup"] = out["tailrl"]["ngram"]["tok_s"] / out["transformers"]["lookup"]["tok_s"]
    return out


# ---- both ------------------------------------------------------------------------------------


def run(cfg: BenchPeersConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    require_trl()  # before minutes of tailrl work
    import torch

    with tempfile.TemporaryDirectory(prefix="tailrl-peers-") as tmp:
        out = Path(cfg.out or tmp)
        result: dict[str, Any] = {}
        for name, side in (("tailrl", run_tailrl), ("trl", run_trl)):
            torch.set_num_threads(cfg.threads)  # each side may have changed it
            log(f"{name}: {cfg.warmup} + {cfg.steps} steps of {cfg.num_prompts} x {cfg.group_size} "
                f"x {cfg.max_new_tokens} tokens, {cfg.threads} thread(s)")
            result[name] = side(cfg, out / name)
            result[name]["threads_after"] = torch.get_num_threads()
            log(f"{name}: step {result[name]['step_s']:.2f} s (rollout {result[name]['rollout_s']:.2f} s), "
                f"{result[name]['tokens_generated']} tokens")
    if cfg.lookup:
        torch.set_num_threads(cfg.threads)
        log("batch 1: transformers' prompt lookup vs tailrl's n-gram drafter")
        result["batch1"] = run_batch1(cfg)
    result["speedup_step"] = result["trl"]["step_s"] / result["tailrl"]["step_s"]
    t, r = result["trl"]["s_per_token"], result["tailrl"]["s_per_token"]
    result["speedup_per_token"] = t / r if t and r else None
    result["config"] = dataclasses.asdict(cfg) | {"omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    return result
