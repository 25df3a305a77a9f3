"""Drafter warm-up: sample responses from the target, build the draft vocabulary, train, report.

TLT trains its drafter offline before RL starts; this is that step, sized for minutes on a CPU.
1. Prompts: the default task's (chat template + tailrl.rl.tasks.format_prompt) or a prompts
   file; group_size responses each, sampled by tailrl.engine.Engine with hidden-state capture.
   The last `holdout_prompts` prompts' responses are held out. Optionally, the task's worked
   solutions to `solutions` further problems, teacher-forced through the target: one forward
   each instead of a sampled rollout, so data is cheap where sampling is the budget. The labels
   are the target's own hidden states and head on that text either way (the drafter learns to
   predict the target, not the text), so a correct solution is as good a training sequence as a
   sampled one wherever the policy writes like its solutions.
2. Draft vocabulary: the draft_vocab_size most frequent response tokens (EOS always in), topped
   up with the lowest unused ids (BPE ids roughly follow corpus frequency).
3. Training (tailrl.speculative.drafter.training) until held-out acceptance stops rising: every
   `eval_every` steps the accept_len of a `stop_depth` chain is replayed on the held-out
   responses; when it stalls the learning rate drops, and after the last drop training stops
   (tailrl.speculative.drafter.plateau), keeping the best measurement's weights. `steps` (and,
   if asked, a time budget) caps it. Held-out loss is measured as it goes.
4. Report on the held-out prompts: loss, top-1 agreement, vocabulary coverage, and accept_len
   of speculative decoding replayed with the real proposer (drafter_train.simulate_accept) on
   their sampled responses and on greedy ones (the walk accepts exactly the sampled tokens):
   chains of several depths, each beside its ceiling (the target itself as a chain drafter of
   that depth on the same responses), and the configured tree.
Writes the drafter directory plus loss.png and losses.json (curves and the report).

Knows: prompts, the chat template, the engine's generate call, the training loop's budget.
Does not know: the drafter's internals beyond its constructor, acceptance rules, the tuner.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model, load_tokenizer, resolve_model_dir
from tailrl.records import Request
from tailrl.rl.sft import example, stop_token, worked_task
from tailrl.rl.tasks import DEFAULT_TASK, format_prompt, make_task
from tailrl.sampling import SamplingParams, derive_seed
from tailrl.speculative.drafter.model import Drafter, load_drafter, save_drafter
from tailrl.speculative.drafter.plateau import Plateau
from tailrl.speculative.drafter.training import (
    AcceptStats,
    DrafterTrainConfig,
    LossStats,
    TrainSeq,
    evaluate_loss,
    pack,
    simulate_accept,
    top1_flags,
    train_drafter,
)
from tailrl.speculative.report import chain_ceiling
from tailrl.tuner import Arm

# Chain depths the report replays, each beside its ceiling (the run's own depths are added).
REPORT_DEPTHS = (2, 4, 6)


@dataclass
class WarmupConfig:
    """Offline drafter warm-up: data, budget and optimiser."""

    model: str | None = field(default=None, metadata={
        "help": "target model directory (default: SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={"help": "target weights while sampling (auto: the rollouts' dtype, "
                                                 "bf16 where it is fast)", "choices": ["auto", "fp32", "bf16"]})
    prompts: str | None = field(default=None, metadata={"help": "JSONL prompts file (default: the task's prompts)"})
    task: str = field(default=DEFAULT_TASK, metadata={
        "help": "task whose prompts are sampled when no prompts file is given"})
    num_prompts: int = field(default=48, metadata={"help": "prompts sampled (held-out ones included)"})
    group_size: int = field(default=4, metadata={"help": "responses per prompt"})
    max_new_tokens: int = field(default=128, metadata={"help": "most tokens per response"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the responses"})
    solutions: int = field(default=0, metadata={"help": "also train on the task's worked solutions to this many "
                                                   "further problems (teacher-forced; 0 = none)"})
    holdout_prompts: int = field(default=8, metadata={"help": "prompts whose responses are held out for evaluation"})
    # Steps, not seconds, by default: the same command trains the same drafter on any machine.
    steps: int = field(default=3000, metadata={"help": "most optimiser steps of training (the stopping rule usually "
                                                "ends it first; 0 = no step limit)"})
    seconds: float = field(default=0.0, metadata={"help": "training time budget, seconds, if asked for (a "
                                                  "machine-dependent amount of training; 0 = no time limit)"})
    lr: float = field(default=2e-3, metadata={"help": "AdamW learning rate (before the stopping rule's drops)"})
    eval_every: int = field(default=100, metadata={"help": "optimiser steps between held-out replays of the stopping "
                                                   "rule (0 = none: a constant rate for `steps` steps)"})
    stop_depth: int = field(default=6, metadata={"help": "chain depth of the stopping rule's held-out replay"})
    patience: int = field(default=2, metadata={"help": "replays without progress before the rate drops (after the "
                                               "last drop: training stops)"})
    lr_drops: int = field(default=2, metadata={"help": "learning-rate drops before training may stop"})
    lr_drop_factor: float = field(default=0.25, metadata={"help": "the rate is multiplied by this at each drop"})
    min_gain: float = field(default=0.01, metadata={"help": "replayed accept_len gain that counts as progress"})
    batch_tokens: int = field(default=1024, metadata={"help": "drafter entries per optimiser step"})
    draft_vocab_size: int = field(default=4096, metadata={"help": "tokens the drafter can propose"})
    drafter_layers: int = field(default=1, metadata={"help": "decoder layers of the drafter (EAGLE-1: 1)"})
    ce_weight: float = field(default=0.1, metadata={"help": "weight of the cross-entropy term (TLT: 0.1)"})
    noise: float = field(default=0.0, metadata={"help": "uniform noise on input hidden states while training"})
    train_head: bool = field(default=True, metadata={"help": "train the head (else keep the target's LM-head rows)"})
    unroll: bool = field(default=False, metadata={
        "help": "also train one draft step deeper (several times the cost per step)"})
    seed: int = field(default=0, metadata={"help": "seed of prompts, sampling and training"})
    eval_draft_depth: int = field(default=4, metadata={"help": "draft depth of the held-out accept_len replay"})
    eval_topk: int = field(default=4, metadata={"help": "tree width of the held-out accept_len replay"})
    eval_num_draft_tokens: int = field(default=16, metadata={"help": "tree nodes of the held-out accept_len replay"})
    eval_greedy: bool = field(default=True, metadata={"help": "also replay greedy responses to the held-out prompts"})

    def __post_init__(self) -> None:
        if self.num_prompts <= self.holdout_prompts or self.holdout_prompts < 1:
            raise ValueError(f"need 1 <= holdout_prompts < num_prompts, got {self.holdout_prompts} and "
                             f"{self.num_prompts}")
        if self.seconds <= 0 and self.steps <= 0:
            raise ValueError("give a time budget (seconds > 0) or a step budget (steps > 0)")
        if min(self.group_size, self.max_new_tokens, self.draft_vocab_size, self.drafter_layers) < 1:
            raise ValueError("group_size, max_new_tokens, draft_vocab_size and drafter_layers must be >= 1")
        if self.solutions < 0 or (self.solutions and self.prompts):
            raise ValueError("solutions must be >= 0 and come from the task, not a prompts file")
        if self.eval_every < 0 or self.stop_depth < 1:
            raise ValueError(f"need eval_every >= 0 and stop_depth >= 1, got {self.eval_every} and {self.stop_depth}")
        self.plateau()  # its own checks

    def plateau(self) -> Plateau:
        """The stopping rule's state at the start of training."""
        return Plateau(self.patience, self.lr_drops, self.lr_drop_factor, self.min_gain)


@dataclass
class WarmupProgress:
    phase: str  # "sample" | "train" | "eval"
    done: int
    total: int  # 0 when unknown (a time budget)
    seconds: float
    loss: float | None = None
    budget_s: float = 0.0  # the phase's time budget (0: none)
    accept_len: float | None = None  # the last held-out replay of the stopping rule's chain
    ceiling: float | None = None  # the target's own chain of that depth on the same responses

    @property
    def seconds_left(self) -> float | None:
        """An estimate: the time budget's rest, or the rate so far over what is left; None
        before anything is done."""
        by_count = self.seconds * (self.total - self.done) / self.done if self.total and self.done else None
        by_budget = max(0.0, self.budget_s - self.seconds) if self.budget_s else None
        known = [x for x in (by_count, by_budget) if x is not None]
        return min(known) if known else None


@dataclass
class WarmupReport:
    sample_seconds: float
    train_seconds: float
    steps: int
    train_responses: int
    train_tokens: int  # response tokens trained on
    heldout_responses: int
    vocab_coverage: float  # held-out response tokens inside the draft vocabulary
    heldout: dict  # LossStats of the held-out responses, before and after training
    accept: dict  # "temperature T" / "greedy" -> arm label -> accept_len, histogram (chains: ceiling), held-out
    best_step: int = 0  # the step whose weights were kept (the stopping rule's best replay)
    replays: list = field(default_factory=list)  # [step, seconds, accept_len, rate scale] of each held-out replay


def prompt_ids(cfg: WarmupConfig, tokenizer) -> list[tuple[int, ...]]:
    """Token ids of num_prompts prompts: from the prompts file (cycled) or the task."""
    from tailrl.generate import encode_prompt, load_prompts

    if cfg.prompts:
        prompts = load_prompts(cfg.prompts)
        return [encode_prompt(tokenizer, prompts[i % len(prompts)]) for i in range(cfg.num_prompts)]
    task = make_task(cfg.task)
    return [encode_prompt(tokenizer, format_prompt(task.sample(cfg.seed, i).question)) for i in range(cfg.num_prompts)]


def sample_data(
    target, prompts: list[tuple[int, ...]], cfg: WarmupConfig, on_progress: Callable | None = None
) -> list[list[TrainSeq]]:
    """group_size responses per prompt with their target hidden states, grouped by prompt."""
    g = cfg.group_size
    reqs = [Request(p, derive_seed(cfg.seed, i, j), group=i) for i, p in enumerate(prompts) for j in range(g)]
    engine = Engine(target, EngineConfig(max_batch=64, capture_hidden=True))

    def progress(p) -> None:
        if on_progress is not None:
            on_progress(WarmupProgress("sample", p.done, p.total, p.seconds))

    outs = engine.generate(reqs, SamplingParams(temperature=cfg.temperature), cfg.max_new_tokens, on_progress=progress)
    groups: list[list[TrainSeq]] = [[] for _ in prompts]
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p])
            # The prompt's hidden states, which the engine keeps per running row but not in a Completion.
            hp = target.hidden(ids, torch.arange(len(p))[None])[0, :-1].float()  # (P-1, E)
            for c in outs[i * cfg.group_size : (i + 1) * cfg.group_size]:
                tokens = torch.tensor(list(p) + c.token_ids)
                groups[i].append(TrainSeq(tokens, torch.cat([hp, c.hidden.float()]), len(p)))
    return groups


def solution_data(target, tokenizer, cfg: WarmupConfig) -> list[TrainSeq]:
    """The task's worked solutions to cfg.solutions problems after the sampled prompts, with the
    target's hidden states over prompt and solution (one no-cache forward each)."""
    task = worked_task(cfg.task)
    stop = stop_token(tokenizer, target)
    seqs = []
    with torch.inference_mode():
        for j in range(cfg.solutions):
            s = example(task, tokenizer, task.sample(cfg.seed, cfg.num_prompts + j), stop)
            tokens = torch.tensor([*s.prompt_ids, *s.token_ids])
            hidden = target.hidden(tokens[None, :-1], torch.arange(len(tokens) - 1)[None])[0].float()
            seqs.append(TrainSeq(tokens, hidden, len(s.prompt_ids)))
    return seqs


def build_draft_vocab(responses: list[TrainSeq], size: int, vocab_size: int, eos: tuple[int, ...]) -> list[int]:
    """The `size` most frequent response tokens, EOS first, topped up with the lowest unused ids."""
    counts = Counter(t for s in responses for t in s.tokens[s.prompt_len :].tolist())
    chosen = [t for t in eos if t < vocab_size]
    chosen += [t for t, _ in counts.most_common() if t not in chosen]
    chosen = chosen[:size]
    taken = set(chosen)
    fill = (t for t in range(vocab_size) if t not in taken)
    while len(chosen) < min(size, vocab_size):
        chosen.append(next(fill))
    return sorted(chosen)


def coverage(seqs: list[TrainSeq], vocab: list[int]) -> float:
    v = set(vocab)
    toks = [t for s in seqs for t in s.tokens[s.prompt_len :].tolist()]
    return sum(t in v for t in toks) / max(len(toks), 1)


def warmup(cfg: WarmupConfig, out: Path, on_progress: Callable[[WarmupProgress], None] | None = None) -> WarmupReport:
    """Sample, build the vocabulary, train, evaluate; write the drafter directory to `out`."""
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    # dtype auto samples in the dtype the rollouts use (tailrl.loading.resolve_dtype), so the
    # drafter learns from the hidden states it will be fed.
    target = load_model(cfg.model, dtype=cfg.dtype)
    tokenizer = load_tokenizer(cfg.model)
    prompts = prompt_ids(cfg, tokenizer)
    groups = sample_data(target, prompts, cfg, on_progress)
    train_seqs = [s for g in groups[: -cfg.holdout_prompts] for s in g] + solution_data(target, tokenizer, cfg)
    held = [s for g in groups[-cfg.holdout_prompts :] for s in g]
    sample_seconds = time.perf_counter() - t0

    vocab = build_draft_vocab(train_seqs, cfg.draft_vocab_size, target.cfg.vocab_size, target.cfg.eos_token_ids)
    drafter = Drafter.from_target(target, vocab, resolve_model_dir(cfg.model).name, seed=cfg.seed,
                                  num_layers=cfg.drafter_layers)
    t1 = time.perf_counter()
    run = _train(drafter, target, train_seqs, held, cfg, on_progress)
    train_seconds = time.perf_counter() - t1

    if on_progress is not None:
        on_progress(WarmupProgress("eval", 0, 1, time.perf_counter() - t0))
    save_drafter(drafter, out)
    # Measured on the saved drafter as the engine loads it: in the target's dtype, sharing its embedding.
    loaded = load_drafter(out, target)
    head = target.lm_head.weight.detach()
    accept = {f"temperature {cfg.temperature:g}": evaluate_accept(loaded, held, cfg, top1_flags(held, head))}
    if cfg.eval_greedy and cfg.temperature > 0:
        one_greedy = dataclasses.replace(cfg, temperature=0.0, group_size=1)
        greedy = [g[0] for g in sample_data(target, prompts[-cfg.holdout_prompts :], one_greedy)]
        accept["greedy"] = evaluate_accept(loaded, greedy, cfg, top1_flags(greedy, head))
    entries = sum(s.tokens.shape[0] - s.prompt_len for s in train_seqs)
    report = WarmupReport(
        sample_seconds, train_seconds, len(run.history), len(train_seqs), entries, len(held), coverage(held, vocab),
        run.losses, accept, run.best_step, run.replays,
    )
    write_curves(Path(out), run.history, run.curve, report, cfg.ce_weight)
    return report


@dataclass
class TrainRun:
    history: list[LossStats]  # per optimiser step
    curve: list[tuple[int, float]]  # (step, held-out loss)
    losses: dict  # held-out LossStats before and after
    best_step: int
    replays: list[list[float]]  # [step, seconds, accept_len, rate scale]


def _train(drafter: Drafter, target, train_seqs: list[TrainSeq], held: list[TrainSeq], cfg: WarmupConfig,
           on_progress) -> TrainRun:
    """Train under the stopping rule and the caps (module doc), ending with the best replay's weights."""
    target_head = target.lm_head.weight.detach()[drafter.d2t].float()  # (K, E)
    order = torch.randperm(len(train_seqs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    batches = pack([train_seqs[i] for i in order], cfg.batch_tokens)
    held_batches = pack(held, cfg.batch_tokens)
    before = evaluate_loss(drafter, held_batches, target_head, cfg.ce_weight)
    curve: list[tuple[int, float]] = [(0, before.loss)]
    stop_arm = Arm("drafter", cfg.stop_depth, 1, cfg.stop_depth)
    ceiling = chain_ceiling(top1_flags(held, target.lm_head.weight.detach()), cfg.stop_depth)
    plateau = cfg.plateau()
    replays: list[list[float]] = []
    best_state: dict[str, torch.Tensor] | None = None
    t1 = time.perf_counter()
    accept: float | None = None  # the last replay's

    def replay(step: int) -> None:
        nonlocal best_state, accept
        drafter.eval()
        accept = simulate_accept(drafter, held, stop_arm).accept_len
        drafter.train()
        replays.append([step, round(time.perf_counter() - t1, 2), round(accept, 4), plateau.scale])
        if plateau.observe(step, accept):
            best_state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}

    def stop(step: int) -> bool:
        over_time = cfg.seconds > 0 and time.perf_counter() - t1 >= cfg.seconds
        return over_time or (cfg.steps > 0 and step >= cfg.steps) or plateau.done

    def on_step(step: int, s: LossStats) -> None:
        if step % 25 == 0:
            curve.append((step, evaluate_loss(drafter, held_batches, target_head, cfg.ce_weight).loss))
        if cfg.eval_every and step % cfg.eval_every == 0:
            replay(step)
        if on_progress is not None:
            on_progress(WarmupProgress("train", step, cfg.steps, time.perf_counter() - t1, s.loss, cfg.seconds,
                                       accept, ceiling))

    tc = DrafterTrainConfig(cfg.lr, ce_weight=cfg.ce_weight, noise=cfg.noise, train_head=cfg.train_head,
                            unroll=cfg.unroll)
    history = train_drafter(drafter, batches, target_head, tc, stop, on_step, seed=cfg.seed,
                            lr_scale=lambda: plateau.scale)
    if cfg.eval_every and (not replays or replays[-1][0] != len(history)):
        replay(len(history))
        drafter.eval()
    if best_state is not None:
        drafter.load_state_dict(best_state)
    after = evaluate_loss(drafter, held_batches, target_head, cfg.ce_weight)
    curve.append((len(history), after.loss))
    best_step = plateau.best_step if best_state is not None else len(history)
    return TrainRun(history, curve, {"before": dataclasses.asdict(before), "after": dataclasses.asdict(after)},
                    best_step, replays)


def evaluate_accept(drafter: Drafter, held: list[TrainSeq], cfg: WarmupConfig, top1: list[list[bool]]) -> dict:
    """accept_len on the held-out responses: chains of several depths, each with its ceiling (the
    target's own chain of that depth, from the responses' top-1 flags) and its share of it, and
    the configured tree."""
    depths = sorted({*REPORT_DEPTHS, cfg.eval_draft_depth, cfg.stop_depth})
    arms = [Arm("drafter", d, 1, d) for d in depths]
    arms.append(Arm("drafter", cfg.eval_draft_depth, cfg.eval_topk, cfg.eval_num_draft_tokens))
    result = {}
    for arm in arms:
        s: AcceptStats = simulate_accept(drafter, held, arm)
        entry = dict(accept_len=round(s.accept_len, 3), verify_steps=s.verify_steps, accept_hist=s.accept_hist)
        if arm.topk == 1:
            ceiling = chain_ceiling(top1, arm.draft_depth)
            if ceiling is not None:
                entry.update(ceiling=round(ceiling, 3), of_ceiling=round(s.accept_len / ceiling, 3))
        result[arm.label] = entry
    return result


def write_curves(
    out: Path, history: list[LossStats], curve: list[tuple[int, float]], report: WarmupReport, ce_weight: float
) -> None:
    """losses.json (per-step training losses, held-out curve, the report) and loss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_loss = [s.loss for s in history]
    data = {"train_loss": train_loss, "heldout_loss": curve, "report": dataclasses.asdict(report)}
    (out / "losses.json").write_text(json.dumps(data, indent=1))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(train_loss) + 1), train_loss, lw=0.8, label="train (per step)")
    ax.plot([s for s, _ in curve], [v for _, v in curve], "o-", label="held-out")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel(f"SmoothL1 + {ce_weight:g} x CE")
    ax.set_title("drafter warm-up")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
