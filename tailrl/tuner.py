"""Tuner: a bucketed epsilon-greedy bandit that picks how the rollout engine decodes each step.

An arm is one way to decode a step: plain (one target forward, one token per sequence), or
speculative decoding with the learned drafter or the n-gram drafter and a draft-tree shape
(draft_depth, topk, num_draft_tokens). The reward of a step is the tokens it emitted per wall
second per running sequence, and arms are ranked at equal batch sizes: each reward is weighed by
what a plain step of its size costs, alpha + beta * b seconds, a line fitted to the plain steps in
the windows (`plain_step_line`), which makes it the step's speed-up over plain decoding at that
size. Why: a bucket spans batch sizes up to 2x apart and a rollout walks down through it, so its
arms are tried at different sizes. TLT's tokens per second favours the arms tried at the larger
ones (docs/history.md); per sequence, the arms tried at the smaller ones: a plain step's rate per
sequence, 1 / (alpha + beta * b), is 1.6x higher at 33 running than at 64 on a 2-core Zen 4 (alpha
23 ms, beta 1.24 ms), so 4-chains timed at 40-51 running outranked plain steps timed at 60-64,
though at 64 plain decoding was 1.4x faster (docs/performance.md, "The tuner at equal batch
sizes"). The weight removes both biases: with beta = 0 it ranks by the rate per sequence, with
alpha = 0 by tokens per second. Until plain has been timed at two sizes the weight is 1. Rewards
are kept per (bucket, arm), the bucket being the range the running batch size falls in, in a
sliding window of the last `window` rewards. Within a bucket the tuner plays arms with too few
rewards first (fewest first, then in the order given): `min_pulls`, or fewer where every step of
the bucket decodes many sequences (`pulls_needed`: a step of b sequences averages b sequences'
acceptance, so one step of 33+ running tells about what three of 11 do, and trying an arm that
loses at a full batch costs most there: in exact mode on a 2-core Zen 3 one n-gram verify of 64
rows took 5 s against 0.85 s for a plain step); then with probability epsilon a uniformly random
arm (the greedy one included), else the arm with the best median weighted reward over its window
(TLT's rule; the median shrugs off the odd slow step, once an arm has 3 rewards: with one, a single
step slowed by another process could bury the best arm, which epsilon then revisits only rarely).
Ties go to the arm listed first. An exploration that draws a clear loser (the upper quartile of its
last LOSER_RECENT weighted rewards more than `loser_margin` below the best arm's median) plays it
only one time in LOSER_EXPLORE_INVERSE, the greedy arm otherwise: where no speculative arm pays,
uniform exploration spent epsilon of the steps on arms several times slower than plain decoding,
while a loser still gets rechecked now and then (a drafter that adapts may turn one into a winner:
its recent rewards clear it, whatever its older ones were). The quartile, not the best reward: a
speculative step's reward swings with what it accepted, so an arm at half plain's speed kept a
lucky step or two in its window and was never judged a loser (docs/performance.md); nor do a few
unlucky steps condemn an arm, as a median would.

A switch gate sits in front (TLT's rule): SD is considered only once the running batch has
stayed <= switch_batch for switch_patience consecutive decode steps, counting the current one.
A step above switch_batch closes the gate and restarts the count, and so does the start of a
rollout (`new_rollout`). While the gate is closed the
step decodes plain and the tuner draws no randomness. PLAIN must be one of the arms, so inside
the gate the bandit can learn to keep decoding plain where speculation does not pay: the learned
threshold overrides the fixed one. switch_patience 0 leaves the gate always open.

Per decode step the engine does:
    arm = tuner.step(batch_size)                       # gate + choose
    ... decode one step with arm ...
    tuner.update(batch_size, arm, tokens / seconds / batch_size)  # also plain steps of a closed gate

Several tuners of the same arms and buckets (one per rollout worker) can learn together: each
passes its new rewards on (`take_new`) and counts the others' (`absorb`), so every arm is
explored once for all workers rather than once per worker.

One random.Random, seeded, serves every bucket, so the whole sequence of choices is a function
of the seed and the rewards; state_dict() captures it as plain JSON-serialisable data.

Knows: arms, buckets, rewards (tokens per second per sequence) and the batch sizes they were
measured at, its own random generator.
Does not know: torch, models, how an arm is executed, what a token is.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from statistics import median

ARM_KINDS = ("plain", "drafter", "ngram")
LOSER_EXPLORE_INVERSE = 10  # a clear loser drawn by exploration is played one time in this many
LOSER_RECENT = 12  # an arm's newest rewards that decide whether it is a clear loser
# Sequence-steps (a step's running sequences, summed over its steps) that make an arm tried in
# a bucket, if fewer than min_pulls steps hold them (Tuner.pulls_needed).
TRIED_SEQUENCE_STEPS = 32


@dataclass(frozen=True)
class Arm:
    """One way to decode a step. Plain has no draft tree; drafter/ngram carry its shape."""

    kind: str  # "plain" | "drafter" | "ngram"
    draft_depth: int = 0  # draft depth
    topk: int = 0  # children expanded per node
    num_draft_tokens: int = 0  # tree nodes kept for verification

    def __post_init__(self) -> None:
        if self.kind not in ARM_KINDS:
            raise ValueError(f"arm kind must be one of {ARM_KINDS}, got {self.kind!r}")
        shape = (self.draft_depth, self.topk, self.num_draft_tokens)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in shape):
            raise ValueError(f"draft_depth, topk and num_draft_tokens must be ints, got {shape}")
        if self.kind == "plain":
            if shape != (0, 0, 0):
                raise ValueError(f"a plain arm has no draft tree: its shape must be (0, 0, 0), got {shape}")
            return
        if min(shape) < 1:
            raise ValueError(f"a {self.kind} arm needs draft_depth, topk, num_draft_tokens >= 1, got {shape}")
        max_nodes = sum(self.topk**d for d in range(1, self.draft_depth + 1))
        if self.num_draft_tokens > max_nodes:
            raise ValueError(
                f"num_draft_tokens {self.num_draft_tokens} exceeds the {max_nodes} nodes a tree of "
                f"depth {self.draft_depth} and width {self.topk} can hold"
            )

    @property
    def label(self) -> str:
        """Short name for plots and metrics, e.g. "plain" or "drafter(3,4,8)"."""
        if self.kind == "plain":
            return "plain"
        return f"{self.kind}({self.draft_depth},{self.topk},{self.num_draft_tokens})"


PLAIN = Arm("plain")


def plain_step_line(seconds: dict[int, float]) -> tuple[float, float]:
    """(alpha, beta) of a plain step's seconds = alpha + beta * b, least squares over {b: seconds},
    both >= 0 (through the origin where the intercept would be negative); (1, 0), every size alike,
    from fewer than two sizes or where the time does not grow with b."""
    if len(seconds) < 2:
        return 1.0, 0.0
    n = len(seconds)
    mean_b, mean_s = sum(seconds) / n, sum(seconds.values()) / n
    beta = (sum((b - mean_b) * (s - mean_s) for b, s in seconds.items())
            / sum((b - mean_b) ** 2 for b in seconds))
    if beta <= 0:
        return 1.0, 0.0
    alpha = mean_s - beta * mean_b
    if alpha < 0:
        return 0.0, sum(b * s for b, s in seconds.items()) / sum(b * b for b in seconds)
    return alpha, beta


def bucket_index(edges: Sequence[int], batch_size: int) -> int:
    """Index of the bucket whose range (edges[i-1], edges[i]] holds batch_size."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return bisect.bisect_left(edges, batch_size)


def bucket_label(edges: Sequence[int], b: int) -> str:
    """Bucket b as text: "1", "3-4" or "33+" (sizes above the last edge)."""
    lo = edges[b - 1] + 1 if b > 0 else 1
    if b == len(edges):
        return f"{lo}+"
    return str(lo) if lo == edges[b] else f"{lo}-{edges[b]}"


@dataclass
class TunerConfig:
    """Bandit and switch-gate settings; the defaults are TLT's."""

    epsilon: float = field(
        default=0.1, metadata={"help": "probability of trying a uniformly random arm instead of the best one"}
    )
    window: int = field(
        default=300, metadata={"help": "rewards kept per (bucket, arm); arms are ranked by their median"}
    )
    min_pulls: int = field(
        default=3, metadata={"help": "rewards each arm gets in a bucket before the bandit ranks it (fewer where a "
                                     "bucket's steps decode 17 sequences or more: 32 sequence-steps suffice)"}
    )
    loser_margin: float = field(
        default=0.15, metadata={"help": "an arm whose recent rewards in a bucket (their upper quartile) are more than "
                                        "this fraction below the best arm's median is explored 10x less often there "
                                        "(1: every arm alike)"}
    )
    bucket_edges: tuple[int, ...] = field(
        default=(1, 2, 4, 8, 16, 32),
        metadata={
            "help": "running-batch-size bucket upper edges: bucket i covers (edges[i-1], edges[i]], "
            "sizes above the last edge form one more bucket"
        },
    )
    switch_batch: int = field(
        default=256, metadata={"help": "SD is considered only while the running batch is at most this (below it the "
                                       "bandit decides, plain decoding being one of its arms)"}
    )
    switch_patience: int = field(
        default=10,
        metadata={"help": "consecutive decode steps at <= switch-batch before SD is considered (0: always)"},
    )

    def __post_init__(self) -> None:
        self.bucket_edges = tuple(self.bucket_edges)
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {self.epsilon}")
        if not 0.0 <= self.loser_margin <= 1.0:
            raise ValueError(f"loser_margin must be in [0, 1], got {self.loser_margin}")
        if self.window < 1 or self.min_pulls < 1:
            raise ValueError(f"window and min_pulls must be >= 1, got {self.window} and {self.min_pulls}")
        edges = self.bucket_edges
        if any(e < 1 for e in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
            raise ValueError(f"bucket_edges must be strictly increasing integers >= 1, got {edges}")
        if self.switch_batch < 0 or self.switch_patience < 0:
            raise ValueError(
                "switch_batch and switch_patience must be >= 0, "
                f"got {self.switch_batch} and {self.switch_patience}"
            )


class Tuner:
    """Bucketed epsilon-greedy bandit over decode arms, with TLT's SD switch gate in front."""

    def __init__(self, arms: Sequence[Arm], config: TunerConfig | None = None, seed: int = 0) -> None:
        self.arms = tuple(arms)
        if PLAIN not in self.arms:
            raise ValueError("arms must include PLAIN, the arm the switch gate falls back to")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must be distinct, got {[a.label for a in self.arms]}")
        self.config = config if config is not None else TunerConfig()
        self._index = {arm: i for i, arm in enumerate(self.arms)}
        self._rng = random.Random(seed)
        num_buckets = len(self.config.bucket_edges) + 1
        # (batch size, reward) per bucket and arm
        self._rewards: list[list[deque[tuple[int, float]]]] = [
            [deque(maxlen=self.config.window) for _ in self.arms] for _ in range(num_buckets)]
        self._pulls = [[0] * len(self.arms) for _ in range(num_buckets)]
        self._gate_run = 0  # consecutive steps at <= switch_batch, capped at switch_patience
        self._new: list[tuple[int, int, float, int]] = []  # update()s since take_new(), for other tuners
        # Plain's step seconds (1 / reward) per batch size over its windows, each list sorted.
        self._plain_seconds: dict[int, list[float]] = {}
        self._line: tuple[float, float] | None = None  # plain_cost(), until a plain reward changes it
        self._weighted: dict[int, list[list[float]]] = {}  # _weighted_rewards(b), kept while the line holds

    def bucket(self, batch_size: int) -> int:
        """Index of the bucket whose range (edges[i-1], edges[i]] holds batch_size."""
        return bucket_index(self.config.bucket_edges, batch_size)

    def new_rollout(self) -> None:
        """Close the gate: a rollout starts at its full batch, whatever the last one ended at.
        (Left open, a rollout that starts at <= switch_batch, e.g. a worker's shard of 32,
        would speculate from its first step, before TLT's patience has passed.)"""
        self._gate_run = 0

    def gate(self, batch_size: int) -> bool:
        """Record one decode step's running batch size; True if SD may be used. Call once per step."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        patience = self.config.switch_patience
        self._gate_run = min(self._gate_run + 1, patience) if batch_size <= self.config.switch_batch else 0
        return self._gate_run >= patience

    def pulls_needed(self, b: int) -> int:
        """Rewards an arm needs in bucket b before the bandit ranks it: min_pulls, or as few steps
        as hold TRIED_SEQUENCE_STEPS sequence-steps at the bucket's smallest batch (at least 1)."""
        smallest = self.config.bucket_edges[b - 1] + 1 if b > 0 else 1
        return max(1, min(self.config.min_pulls, -(-TRIED_SEQUENCE_STEPS // smallest)))

    def choose(self, batch_size: int) -> Arm:
        """The bandit's pick for this bucket, ignoring the gate: under-tried, random (a clear
        loser seldom), or best median."""
        b = self.bucket(batch_size)
        fewest = min(self._pulls[b])
        if fewest < self.pulls_needed(b):
            return self.arms[self._pulls[b].index(fewest)]
        if self._rng.random() < self.config.epsilon:
            arm = self._rng.choice(self.arms)
            if not self._loses(b, arm) or self._rng.random() * LOSER_EXPLORE_INVERSE < 1.0:
                return arm
        return self._best(b)

    def _loses(self, b: int, arm: Arm) -> bool:
        """Whether the upper quartile of `arm`'s last LOSER_RECENT weighted rewards in bucket b is
        more than loser_margin below the best arm's median."""
        best = self._best(b)
        weighted = self._weighted_rewards(b)
        window, top = weighted[self._index[arm]], weighted[self._index[best]]
        if not window:
            return False
        recent = sorted(window[-LOSER_RECENT:])
        return recent[3 * len(recent) // 4] < (1.0 - self.config.loser_margin) * median(top)

    def step(self, batch_size: int) -> Arm:
        """The arm for this decode step: PLAIN while the gate is closed, else choose()."""
        return self.choose(batch_size) if self.gate(batch_size) else PLAIN

    def best(self, batch_size: int) -> Arm | None:
        """The greedy arm of the bucket (best window median among tried arms); None if none tried."""
        return self._best(self.bucket(batch_size))

    def _best(self, b: int) -> Arm | None:
        best, best_median = None, -math.inf
        for arm, window in zip(self.arms, self._weighted_rewards(b)):
            if window and (m := median(window)) > best_median:
                best, best_median = arm, m
        return best

    def plain_cost(self) -> tuple[float, float]:
        """(alpha, beta): a plain step of b sequences takes alpha + beta * b seconds, fitted to the
        median step time at each batch size in plain's windows (plain_step_line)."""
        if self._line is None:
            self._line = plain_step_line({size: median(s) for size, s in self._plain_seconds.items() if s})
        return self._line

    def _weighted_rewards(self, b: int) -> list[list[float]]:
        """Bucket b's rewards per arm, each times plain's step seconds at its batch size."""
        weighted = self._weighted.get(b)
        if weighted is None:
            alpha, beta = self.plain_cost()
            weighted = self._weighted[b] = [[r * (alpha + beta * size) for size, r in w] for w in self._rewards[b]]
        return weighted

    def update(self, batch_size: int, arm: Arm, reward: float) -> None:
        """Record the reward (tokens emitted per wall second per sequence) of one step of
        batch_size sequences decoded with arm."""
        i = self._index.get(arm)
        if i is None:
            raise ValueError(f"{arm!r} is not one of this tuner's arms")
        if not (math.isfinite(reward) and reward >= 0.0):
            raise ValueError(f"reward must be a finite number >= 0 (tokens per second per sequence), got {reward}")
        b = self.bucket(batch_size)
        self._record(b, i, batch_size, float(reward))
        self._new.append((b, i, float(reward), batch_size))

    def _record(self, b: int, i: int, size: int, reward: float) -> None:
        window = self._rewards[b][i]
        full = len(window) == window.maxlen
        if full and self.arms[i] == PLAIN:
            self._plain_time(*window[0], add=False)
        window.append((size, reward))
        self._pulls[b][i] += 1
        if self.arms[i] == PLAIN:  # the line moves, and every bucket's weights with it
            self._plain_time(size, reward, add=True)
            self._line = None
            self._weighted.clear()
        elif (weighted := self._weighted.get(b)) is not None:  # the window's weights, kept in step
            alpha, beta = self.plain_cost()
            if full:
                del weighted[i][0]
            weighted[i].append(reward * (alpha + beta * size))

    def _plain_time(self, size: int, reward: float, add: bool) -> None:
        """Count a plain reward's step seconds in (or out of) _plain_seconds. A plain step emits a
        token a sequence, so its reward per sequence is 1 / its seconds."""
        if reward > 0:
            times = self._plain_seconds.setdefault(size, [])
            if add:
                bisect.insort(times, 1.0 / reward)
            else:
                times.remove(1.0 / reward)

    def take_new(self) -> list[tuple[int, int, float, int]]:
        """The (bucket, arm index, reward, batch size) records of update() since the last call: what
        tuners of the same arms and buckets elsewhere (other rollout workers) can `absorb`."""
        new, self._new = self._new, []
        return new

    def absorb(self, records: Sequence[Sequence[float]]) -> None:
        """Count rewards observed by another tuner of the same arms and buckets as if updated here
        (not passed on by take_new; draws no randomness). A record without its batch size (a
        checkpoint's, from before they were kept) gets its bucket's smallest."""
        for b, i, reward, *size in records:
            self._record(int(b), int(i), int(size[0]) if size else self._smallest(int(b)), float(reward))

    def _smallest(self, b: int) -> int:
        """The smallest batch size in bucket b."""
        return self.config.bucket_edges[b - 1] + 1 if b else 1

    def state_dict(self) -> dict:
        """Everything that decides future choices, as JSON-serialisable lists and numbers."""
        version, internal, gauss_next = self._rng.getstate()
        return {
            "arms": [asdict(arm) for arm in self.arms],
            "bucket_edges": list(self.config.bucket_edges),
            "rewards": [[[list(pair) for pair in window] for window in bucket] for bucket in self._rewards],
            "pulls": [list(pulls) for pulls in self._pulls],
            "rng": [version, list(internal), gauss_next],
            "gate_run": self._gate_run,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from state_dict(). Same arms (in order) and bucket edges required; a smaller
        window keeps each arm's newest rewards."""
        arms = tuple(Arm(**a) for a in state["arms"])
        if arms != self.arms:
            raise ValueError(
                f"state has arms {[a.label for a in arms]} but this tuner has {[a.label for a in self.arms]}"
            )
        if tuple(state["bucket_edges"]) != self.config.bucket_edges:
            raise ValueError(
                f"state has bucket_edges {tuple(state['bucket_edges'])} "
                f"but this tuner has {self.config.bucket_edges}"
            )
        # A checkpoint from before the batch sizes were kept holds bare rewards: each gets its
        # bucket's smallest size.
        self._rewards = [[deque(((int(r[0]), float(r[1])) if isinstance(r, list) else (self._smallest(b), float(r))
                                 for r in w), maxlen=self.config.window)
                          for w in bucket] for b, bucket in enumerate(state["rewards"])]
        self._plain_seconds = {}
        for bucket in self._rewards:
            for size, reward in bucket[self._index[PLAIN]]:
                self._plain_time(size, reward, add=True)
        self._line = None
        self._weighted.clear()
        self._pulls = [list(pulls) for pulls in state["pulls"]]
        version, internal, gauss_next = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss_next))
        self._gate_run = min(int(state["gate_run"]), self.config.switch_patience)

    def summary(self) -> dict:
        """Per bucket with any pulls, keyed like "3-4" or "33+": best arm label, pulls per arm,
        median reward per tried arm (as measured: tokens per second per sequence)."""
        out = {}
        for b, (windows, pulls) in enumerate(zip(self._rewards, self._pulls)):
            if not any(pulls):
                continue
            out[bucket_label(self.config.bucket_edges, b)] = {
                "best": self._best(b).label,
                "pulls": {arm.label: n for arm, n in zip(self.arms, pulls)},
                "median": {arm.label: median(r for _, r in w) for arm, w in zip(self.arms, windows) if w},
            }
        return out
