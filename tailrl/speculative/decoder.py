"""The engine's speculative step: propose a draft tree per row, verify all rows in one target
forward, keep what the lossless walk accepts.

A SpecDecoder is the engine's StepDecoder. Each step it asks `choose` for an arm: a plain arm runs
`engine.plain_step`; a drafter or n-gram arm asks that kind's Proposer for a DraftTree, feeds
[pending, tree nodes] per row to the target at positions length + depth (cache writes at
length .. length + N, each node attending the prefix and its ancestors), walks the tree with
`accept_walk` and compacts the accepted path's K/V to consecutive positions. The walk uses the
uniform plain decoding would use at each position, so SD and plain emit the same tokens.

NgramProposer adapts tailrl.speculative.ngram to the Proposer protocol: one NgramIndex per prompt, holding
the prompt, this call's sibling responses and earlier calls' responses to the same prompt.

After every step it reports a StepReport to its observers (the tuner's reward, a worker's
counters), given when it is built.

Knows: the Proposer and StepObserver protocols, verify-forward plumbing (positions, masks, cache
writes and compaction), the engine's emission and stats. Does not know: how a drafter drafts, the
tuner's policy (it only sees `choose` and its observers), rewards, tokenizers.

Shapes: B running rows, N draft nodes, T = N + 1 verify tokens (root first), S attended keys,
V vocabulary, E hidden size, L layers, K kv heads, D head dim, M moved cache positions.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from tailrl.engine import Engine, GenerateCall, Seq
from tailrl.kv_cache import CacheView, KVCache
from tailrl.speculative.accept import accept_walk
from tailrl.speculative.ngram import NgramConfig, NgramIndex, propose_tree
from tailrl.speculative.tree import DraftTree, verify_layout
from tailrl.stats import position_bucket
from tailrl.tuner import Arm, Tuner


class Proposer(Protocol):
    """A drafter as the speculative step sees it. The decoder relays the engine's calls: `begin`
    once per generate call, `moved` on every slot move, `finished` once per sequence."""

    kind: str  # "drafter" | "ngram" (matches tuner Arm.kind)
    needs_hidden: bool  # the engine must keep Seq.prompt_hidden / Seq.hidden (target hidden states)

    def begin(self, engine: Engine) -> None:
        """Start of a generate call: forget per-slot state."""
        ...

    def propose(self, engine: Engine, running: list[Seq], arm: Arm) -> DraftTree:
        """One tree per running row (row i == running[i]), N nodes padded equal across rows.

        The root (not in the tree) is running[i].pending at absolute position running[i].length.
        With needs_hidden, row q of cat(seq.prompt_hidden, *seq.hidden) is the target hidden state
        at position q, the one that produced the token at q + 1.
        """
        ...

    def moved(self, src: int, dst: int, seq: Seq) -> None:
        """The engine moved a sequence from cache slot src to dst."""
        ...

    def finished(self, seq: Seq) -> None:
        """`seq` is done (seq.finish is set) and leaves the batch."""
        ...


@dataclass(frozen=True)
class StepReport:
    """One decode step, as a tuner rewards it."""

    arm: Arm
    batch_size: int
    tokens: int  # tokens emitted by the step (after EOS / length cuts)
    draft_seconds: float
    verify_seconds: float  # for a plain step: the whole step
    first_accepted: int = 0  # rows whose verify accepted the first draft token (a drafter's health)

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds


class StepObserver(Protocol):
    """Something that watches a SpecDecoder's steps (the tuner's reward, a worker's counters)."""

    def begin(self) -> None:
        """A generate call starts."""
        ...

    def observe(self, report: StepReport) -> None:
        """A step was decoded."""
        ...


class SpecDecoder:
    """Decodes each step with the arm `choose` picks; `arms` lists every arm it may pick;
    `observers` see every step's report."""

    def __init__(
        self,
        proposers: dict[str, Proposer],
        choose: Callable[[list[Seq]], Arm],
        arms: Sequence[Arm],
        observers: Sequence[StepObserver] = (),
    ):
        for arm in arms:
            if arm.kind != "plain" and arm.kind not in proposers:
                raise ValueError(f"arm {arm.label} needs a {arm.kind!r} proposer; have {sorted(proposers)}")
        self.proposers, self.choose, self.arms = proposers, choose, tuple(arms)
        self.observers = tuple(observers)
        self.max_tree = max((a.num_draft_tokens for a in self.arms), default=0)

    @property
    def needs_hidden(self) -> bool:
        return any(p.needs_hidden for p in self.proposers.values())

    def begin(self, engine: Engine) -> None:
        for p in self.proposers.values():
            p.begin(engine)
        for o in self.observers:
            o.begin()

    def moved(self, src: int, dst: int, seq: Seq) -> None:
        for p in self.proposers.values():
            p.moved(src, dst, seq)

    def finished(self, seq: Seq) -> None:
        for p in self.proposers.values():
            p.finished(seq)

    def step(self, engine: Engine, running: list[Seq], call: GenerateCall) -> str:
        arm = self.choose(running)
        if arm not in self.arms:
            raise ValueError(f"choose returned {arm.label}, not one of the decoder's arms")
        tokens_before, t0 = engine.stats.tokens, time.perf_counter()
        stats = engine.stats.spec
        first_accepted = 0
        if arm.kind == "plain":
            engine.plain_step(running, call)
            _settle(engine)
            draft, verify = 0.0, time.perf_counter() - t0
            stats.plain_steps += 1
            stats.plain_tokens += engine.stats.tokens - tokens_before
            stats.plain_seconds += verify
        else:
            tree = self.proposers[arm.kind].propose(engine, running, arm).to(engine.device)
            if tree.num_nodes > self.max_tree:  # generate() reserved only max_tree cache positions
                raise ValueError(f"{arm.kind} proposer returned {tree.num_nodes} nodes for {arm.label}")
            t1 = time.perf_counter()
            first_accepted = spec_step(engine, running, tree, call)
            _settle(engine)
            draft, verify = t1 - t0, time.perf_counter() - t1
            stats.draft_seconds += draft
            stats.verify_seconds += verify
        report = StepReport(arm, len(running), engine.stats.tokens - tokens_before, draft, verify, first_accepted)
        for o in self.observers:
            o.observe(report)
        return arm.label


def _settle(engine: Engine) -> None:
    """Wait for the step's queued device work: a verify's cache compaction runs after its last
    host sync, so on CUDA the next step's sync would absorb it, and the tuner would see verifies
    cheaper and plain steps dearer than they are (docs/performance.md, "On a GPU")."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def spec_step(engine: Engine, running: list[Seq], tree: DraftTree, call: GenerateCall) -> int:
    """Verify each row's tree in one target forward; emit the accepted tokens and the target's
    next. Returns how many rows accepted at least one draft token."""
    if tree.batch_size != len(running):
        raise ValueError(f"need one draft tree row per running sequence ({len(running)}), got {tree.batch_size}")
    lens_list = [s.length for s in running]
    logits, hidden, depth = _verify_forward(engine, running, tree)  # (B, T, V), (B, T, E), deepest node
    # The lossless rule: at each visited node the target picks x = inverse_cdf(p, u(seed, position))
    # exactly as plain decoding would at that position (the root is at `length`, so its pick is the
    # token at length + 1); the walk descends into the child carrying x, else emits x and stops.
    result = accept_walk(logits, tree, call.params, [s.req.seed for s in running], lens_list)
    _compact(engine.cache, lens_list, result.path)
    stats, keep = engine.stats.spec, engine.keep_hidden
    for i, seq in enumerate(running):
        accepted, emitted_before = len(result.path[i]), len(seq.tokens)
        seq.length += 1 + accepted  # root and accepted nodes are now in the cache; the last pick is not
        seq.pending = result.tokens[i][-1]
        # Hidden rows of [root, accepted nodes]: the states that produced the emitted tokens.
        rows = hidden[i, [0, *result.path[i]]] if keep else None  # (accepted + 1, E)
        engine.emit(seq, call, result.tokens[i], result.logprobs[i], result.top1[i], rows)
        stats.verify_steps += 1
        stats.proposed += tree.num_nodes
        stats.accepted += accepted
        stats.emitted += len(seq.tokens) - emitted_before
        stats.accept_hist.extend([0] * (accepted + 1 - len(stats.accept_hist)))
        stats.accept_hist[accepted] += 1
        at = position_bucket(emitted_before)
        stats.position_verifies[at] += 1
        stats.position_emitted[at] += len(seq.tokens) - emitted_before
    stats.spec_steps += 1
    stats.count_depth(depth, len(running))
    return sum(1 for path in result.path if path)


def _verify_forward(engine: Engine, running: list[Seq], tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Target logits and hidden states over [pending, nodes] per row, and the tree's depth (its
    deepest node's, read off the layout the mask needs anyway).  # (B, T, V), (B, T, E)"""
    device, t = engine.device, tree.num_nodes + 1
    lens = torch.tensor([s.length for s in running], device=device)  # (B,)
    ids = tree.verify_ids(torch.tensor([s.pending for s in running], device=device))  # (B, T)
    ancestry, depths = verify_layout(tree.parents)  # (B, T, T), (B, T)
    positions = lens[:, None] + depths  # (B, T): length + depth
    write_pos = lens[:, None] + torch.arange(t, device=device)  # (B, T): length .. length + N
    kv_len = max(s.length for s in running) + t  # from the host: a device max would be a sync
    # Each verify token sees the row's prefix (< length) and, among this forward's tokens, itself
    # and its ancestors; keys past the row's own writes are stale cache and stay masked.
    mask = (torch.arange(kv_len, device=device) < lens[:, None])[:, None].repeat(1, t, 1)  # (B, T, S)
    mask.scatter_(2, write_pos[:, None].expand(-1, t, -1), ancestry)
    view = CacheView(engine.cache, 0, write_pos, kv_len, mask)
    return *engine.forward(ids, positions, view), int(depths.max())


def _compact(cache: KVCache, lens: list[int], paths: list[list[int]]) -> None:
    """Move accepted nodes' K/V from length + verify index to length + 1 + k, layer by layer.

    Nodes already in place (a chain drafter's accepted prefix) are skipped. The gather on the
    right-hand side completes before the write, so overlapping sources and destinations are safe.
    """
    moves = [
        (b, lens[b] + j, lens[b] + 1 + k) for b, path in enumerate(paths) for k, j in enumerate(path) if j != k + 1
    ]
    if not moves:
        return
    rows, src, dst = (torch.tensor(x, device=cache.k[0].device) for x in zip(*moves))  # (M,) each
    for kv in (*cache.k, *cache.v):  # (C, K, M_cap, D) each
        kv[rows, :, dst] = kv[rows, :, src]


def fixed(arm: Arm, proposer: Proposer, observers: Sequence[StepObserver] = ()) -> SpecDecoder:
    """Speculate every step with one arm (`--spec on`)."""
    return SpecDecoder({arm.kind: proposer}, lambda running: arm, [arm], observers)


class TunerFeedback:
    """The tuner as a StepObserver: a new rollout at each generate call, and each step's reward,
    tokens per second per running sequence (see tailrl.tuner: a bucket spans batch sizes up to
    2x apart, so a per-sequence rate compares steps across it)."""

    def __init__(self, tuner: Tuner):
        self.tuner = tuner

    def begin(self) -> None:
        self.tuner.new_rollout()

    def observe(self, r: StepReport) -> None:
        self.tuner.update(r.batch_size, r.arm, r.tokens / r.seconds / r.batch_size if r.seconds > 0 else 0.0)


def tuned(tuner: Tuner, proposers: dict[str, Proposer], observers: Sequence[StepObserver] = ()) -> SpecDecoder:
    """Let the tuner pick each step's arm (gate included) and learn from each step (TunerFeedback)."""
    return SpecDecoder(proposers, lambda running: tuner.step(len(running)), tuner.arms,
                       (TunerFeedback(tuner), *observers))


# ---- the n-gram proposer -------------------------------------------------------------------


@dataclass(frozen=True)
class NgramProposerConfig:
    """What the n-gram proposer remembers across generate calls."""

    history_prompts: int = field(default=1024, metadata={"help": "prompts whose earlier responses are kept"})
    history_responses: int = field(default=16, metadata={"help": "earlier responses kept per prompt"})


class NgramProposer:
    """Drafts from the prompt, sibling responses and earlier responses to the same prompt."""

    kind = "ngram"
    needs_hidden = False

    def __init__(self, ngram: NgramConfig = NgramConfig(), config: NgramProposerConfig = NgramProposerConfig()):
        self.ngram, self.config = ngram, config
        # prompt -> its latest responses (4-byte ids: a Python int per token would cost 36 bytes), LRU
        self._history: OrderedDict[tuple[int, ...], deque[array]] = OrderedDict()
        self._groups: dict[tuple[int, ...], NgramIndex] = {}  # this call's index per prompt
        self._rows: dict[int, tuple[int, int]] = {}  # req_index -> (sequence id in its index, tokens fed)

    def begin(self, engine: Engine) -> None:
        self._groups.clear()
        self._rows.clear()

    def moved(self, src: int, dst: int, seq: Seq) -> None:
        pass  # rows are keyed by request, not slot

    def propose(self, engine: Engine, running: list[Seq], arm: Arm) -> DraftTree:
        indexes = [self._sync(seq) for seq in running]
        n = self.ngram.max_n
        # Only the last max_n tokens of prompt + response are matched; the last one is the root.
        contexts = [(list(s.req.prompt_ids[-n:]) + s.tokens[-n:])[-n:] for s in running]
        return propose_tree(indexes, contexts, arm.draft_depth, arm.topk, arm.num_draft_tokens, engine.device)

    def finished(self, seq: Seq) -> None:
        """Keep the response for later calls and, if its group is being drafted, for its siblings.

        A group's index is built only when one of its rows is first drafted, from the history,
        which by then holds this call's finished siblings too; so memory goes to drafted groups.
        """
        prompt = seq.req.prompt_ids
        if prompt in self._groups:
            self._sync(seq)
        responses = self._history.pop(prompt, None) or deque(maxlen=self.config.history_responses)
        responses.append(array("i", seq.tokens))
        self._history[prompt] = responses
        while len(self._history) > self.config.history_prompts:
            self._history.popitem(last=False)

    def _sync(self, seq: Seq) -> NgramIndex:
        """The sequence's group index, with all of its tokens so far appended."""
        prompt = seq.req.prompt_ids
        index = self._groups.get(prompt)
        if index is None:
            index = self._groups[prompt] = NgramIndex(self.ngram)
            index.add(prompt)
            for response in self._history.get(prompt, ()):
                index.add(response)
        row = self._rows.get(seq.req_index)
        if row is None:
            self._rows[seq.req_index] = (index.add(seq.tokens), len(seq.tokens))
        else:
            seq_id, fed = row
            index.extend(seq_id, seq.tokens[fed:])
            self._rows[seq.req_index] = (seq_id, len(seq.tokens))
        return index
