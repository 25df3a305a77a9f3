"""One RL step's rollout, rewards and gradients, run one after another or overlapped.

Synchronous (what veRL and TRL do): the rollout, then every group's rewards and advantages, then
the gradient of the whole batch. Overlapped: a group is scored as soon as its last response
finishes, and its share of the gradient is computed on a background thread while the rest of the
batch still decodes (tailrl.rl.update). Both feed the same GroupGradients, group by group, each
group computed on one torch thread (two groups at a time once the rollout is over), so the
gradient has the same bits either way, on any CPU; only where the time goes differs.

In the overlapped schedule the background thread computes only in the rollout's tail (at most
`overlap_batch` sequences running): with few sequences running a core is better spent on the
update than on decoding, so the rollout is asked to lend one while the update has work (the
IdleCore handed to Rollout.generate, which also tells the rollout when the update is busy).

What the update computes is the rollout's to learn from: a rollout that wants them gets each
computed group's sequences with the policy's hidden states (Rollout.feed().observe), and in the
overlapped schedule the rollout's own idle work (its drafter's training) runs on the lent core
while no group waits (policy work first, tailrl.rl.update "Idle work"). The core is lent for
the policy's work only: the tail decodes faster on every core it has (docs/workers.md), so the
rollout's idle work gets the gaps between groups, never a core of its own. The synchronous
schedule has no such gaps.

Knows: the order of a step's phases, groups, rewards, advantages. Does not know: how the
rollout decodes (tailrl.rollout.protocol), the loss (tailrl.rl.update), the optimizer, what the
rollout does with its idle time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tailrl.memory import Peak
from tailrl.model import Transformer
from tailrl.records import Completion, Progress, Request
from tailrl.rl.grpo import GRPOConfig, group_advantages
from tailrl.rl.packing import Sample
from tailrl.rl.rewards import RewardBatch, safe_rewards
from tailrl.rl.tasks import Problem, Tokenizer
from tailrl.rl.update import BackgroundUpdate, GroupGradients, UpdateStats, group_key
from tailrl.rollout.protocol import IdleCore, PolicyForward, Rollout
from tailrl.sampling import SamplingParams


@dataclass(frozen=True)
class ScoredGroup:
    texts: list[str]
    rewards: RewardBatch
    samples: list[Sample]  # empty when the group's rewards are all equal (no signal: it sits out)


def score_group(problem: Problem, completions: Sequence[Completion], tokenizer: Tokenizer,
                score: Callable[[Problem, str], float], timeout_s: float, drop_truncated: bool = False) -> ScoredGroup:
    """Decode a group's responses, reward them (a reward that raises or hangs scores 0 and is
    counted) and attach group-normalised advantages and the log-probs the engine sampled each
    token with (the update's importance ratio is taken against them); with drop_truncated,
    responses cut off at the length limit get an advantage (they count in the group's mean and
    spread) but no sample: their reward says where the limit was, not what a finished answer
    earns, and their many tokens would otherwise dominate the token-mean loss."""
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    rewards = safe_rewards(score, [(problem, t) for t in texts], timeout_s)
    table = torch.tensor(rewards.rewards, dtype=torch.float64)[None]  # (1, G)
    if not table.max() > table.min():
        return ScoredGroup(texts, rewards, [])
    adv = group_advantages(table)[0]  # (G,)
    return ScoredGroup(texts, rewards, [Sample(c.prompt_ids, c.token_ids, float(a), c.logprobs)
                                        for c, a in zip(completions, adv)
                                        if not (drop_truncated and c.finish_reason == "length")])


@dataclass
class StepWork:
    """What one step's rollout and update produced, with where its time went."""

    completions: list[Completion]
    groups: list[ScoredGroup]
    stats: UpdateStats
    times: dict[str, float] = field(default_factory=dict)
    rollout_peak_gb: float | None = None  # resident peak from the step's start to the rollout's end

    @property
    def texts(self) -> list[str]:
        return [t for g in self.groups for t in g.texts]

    @property
    def rewards(self) -> RewardBatch:
        return RewardBatch([r for g in self.groups for r in g.rewards.rewards],
                           sum(g.rewards.failures for g in self.groups), sum(g.rewards.timeouts for g in self.groups))

    @property
    def skipped(self) -> int:
        return sum(not g.samples for g in self.groups)

    @property
    def trained(self) -> bool:
        """Some group had reward spread, so there is a gradient to apply."""
        return any(g.samples for g in self.groups)


@dataclass(frozen=True)
class StepInputs:
    """What the phases need from the loop for one step."""

    problems: list[Problem]
    requests: list[Request]
    params: SamplingParams
    max_new_tokens: int
    group_size: int
    tokenizer: Tokenizer
    score: Callable[[Problem, str], float]
    reward_timeout_s: float


@dataclass(frozen=True)
class UpdateSetup:
    """What the phases need from the loop for the step's update: the policy (the gradient goes
    into its .grad), the update's settings, the frozen reference policy of the KL term (None
    without one), and when groups' gradients are computed: while at most overlap_batch
    sequences decode, or after the whole rollout (0)."""

    policy: Transformer
    cfg: GRPOConfig
    ref: Transformer | None
    overlap_batch: int


def policy_forwards(samples: Sequence[Sample], hidden: list[torch.Tensor]) -> list[PolicyForward]:
    """Samples with their hidden states (tailrl.rl.packing.packed_logprobs_and_hidden), as the rollout takes them."""
    return [PolicyForward(torch.tensor([*s.prompt_ids, *s.token_ids]), h, len(s.prompt_ids))
            for s, h in zip(samples, hidden)]


def run_step(rollout: Rollout, step: int, inputs: StepInputs, setup: UpdateSetup,
             on_progress: Callable[[Progress], None], peak: Peak) -> StepWork:
    """Rollout, rewards and the gradient (written into the policy's .grad), its log-probs taken
    at the rollout's sampling temperature; overlapped when overlap_batch > 0, else synchronous
    (module doc). `peak`, started with the step, is read at the rollout's end
    (StepWork.rollout_peak_gb) and started again: from there on it is the update's."""
    on_hidden, feed = None, rollout.feed()
    if feed is not None:
        on_hidden = lambda samples, hidden: feed.observe(policy_forwards(samples, hidden))  # noqa: E731
    cfg = setup.cfg
    grads = GroupGradients(setup.policy, cfg, inputs.params.temperature, len(inputs.problems), setup.ref, on_hidden)
    if setup.overlap_batch > 0:
        return _overlapped(rollout, step, inputs, grads, setup.overlap_batch, on_progress, peak)
    t0 = time.perf_counter()
    completions = rollout.generate(step, inputs.requests, inputs.params, inputs.max_new_tokens, on_progress=on_progress)
    t1 = time.perf_counter()
    rollout_peak = peak.gb
    peak.start()
    G = inputs.group_size
    groups = [score_group(p, completions[g * G : (g + 1) * G], inputs.tokenizer, inputs.score, inputs.reward_timeout_s,
                          cfg.drop_truncated)
              for g, p in enumerate(inputs.problems)]
    t2 = time.perf_counter()
    update = BackgroundUpdate(grads)  # its gate never opens before drain: the update after the rollout
    for g, group in enumerate(groups):
        update.submit(g, group.samples, group_key([c.token_ids for c in completions[g * G : (g + 1) * G]]))
    update.drain()
    stats = grads.finish()
    return StepWork(completions, groups, stats, {"rollout_s": t1 - t0, "reward_s": t2 - t1,
                                                 "update_in_rollout_s": 0.0, "groups_in_rollout": 0}, rollout_peak)


def _overlapped(rollout: Rollout, step: int, inputs: StepInputs, grads: GroupGradients, overlap_batch: int,
                on_progress: Callable[[Progress], None], peak: Peak) -> StepWork:
    G, P = inputs.group_size, len(inputs.problems)
    finished: list[list[Completion | None]] = [[None] * G for _ in range(P)]
    left = [G] * P
    groups: list[ScoredGroup | None] = [None] * P
    update = BackgroundUpdate(grads, rollout.feed())
    core = IdleCore(busy=lambda: update.active)  # lent in the tail while the update has work
    reward_s = 0.0

    def on_finished(index: int, completion: Completion) -> None:
        nonlocal reward_s
        g = index // G
        finished[g][index % G] = completion
        left[g] -= 1
        if left[g] > 0:
            update.bound(g, len(completion.token_ids))
            return
        t = time.perf_counter()
        groups[g] = score_group(inputs.problems[g], finished[g], inputs.tokenizer, inputs.score,
                                inputs.reward_timeout_s, grads.cfg.drop_truncated)
        reward_s += time.perf_counter() - t
        update.submit(g, groups[g].samples, group_key([c.token_ids for c in finished[g] if c is not None]))

    def progress(p: Progress) -> None:
        on_progress(p)
        update.floor(p.fewest_unfinished)
        tail = p.running <= overlap_batch and update.has_work
        if tail:
            update.open_gate()
        else:
            update.close_gate()
        core.lent = tail

    t0 = time.perf_counter()
    try:
        completions = rollout.generate(step, inputs.requests, inputs.params, inputs.max_new_tokens,
                                       on_progress=progress, on_finished=on_finished,
                                       core=core)
    except BaseException:
        update.abort()
        raise
    t1 = time.perf_counter()
    in_rollout = update.seconds_so_far()
    rollout_peak = peak.gb
    peak.start()
    update.drain()
    stats = grads.finish()
    return StepWork(completions, list(groups), stats, {  # type: ignore[arg-type]
        "rollout_s": t1 - t0 - reward_s, "reward_s": reward_s,
        "update_in_rollout_s": in_rollout[0], "groups_in_rollout": in_rollout[1],
    }, rollout_peak)
