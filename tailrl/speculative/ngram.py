"""Model-free n-gram drafter: continue a row by what followed the same last tokens elsewhere.

One NgramIndex per prompt group holds token sequences: the prompt, each sibling response of the
current step (appended to as it grows, the drafted row's own response included) and earlier
steps' responses to the same prompt. A hash map from every n-gram (min_n <= n <= max_n) to the
places it ended is updated as tokens arrive, so proposing never rescans.

A proposal matches the context's last tokens, longest n first, gathers what followed each match
(most recent first, up to max_matches), merges those continuations into a trie and keeps nodes
best-first: longer match, then more occurrences, then more recent; at most topk children per
node and depth at most draft_depth. The tree is then padded to exactly num_draft_tokens nodes: a
chain repeating the last token (depth <= draft_depth), then copies of it under the root (extra
root children, harmless: the target verifies every node). Output uses DraftTree's format
(parents[i] < i, -1 = root).

Knows: token ids and sequences. Does not know: models, sampling, acceptance, the engine.
Cost: pure Python; extending is a few hash-map updates per token, proposing grows with
max_matches (docs/performance.md).
Memory: max_n - min_n + 1 hash-map entries per indexed token (each a CPython tuple key and list).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tailrl.speculative.tree import DraftTree


@dataclass(frozen=True)
class NgramConfig:
    """Which context suffixes the n-gram drafter matches, and how many matches it reads."""

    max_n: int = field(default=4, metadata={"help": "longest suffix of the context matched, in tokens"})
    min_n: int = field(default=1, metadata={"help": "shortest suffix matched if longer ones give few drafts"})
    max_matches: int = field(default=64, metadata={"help": "most recent matches read per proposal"})

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {self.max_matches}")


class NgramIndex:
    """Token sequences of one prompt group, indexed by n-gram for continuation lookup."""

    def __init__(self, config: NgramConfig = NgramConfig()) -> None:
        self.config = config
        self._seqs: list[list[int]] = []
        self._table: dict[tuple[int, ...], list[int]] = {}  # n-gram -> stamps of its occurrences
        self._where: list[tuple[int, int]] = []  # stamp -> (sequence id, index right after the n-gram)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def add(self, tokens: Sequence[int] = ()) -> int:
        """Start a new sequence (prompt, response, earlier response); returns its id for extend."""
        self._seqs.append([])
        self.extend(len(self._seqs) - 1, tokens)
        return len(self._seqs) - 1

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence; costs max_n - min_n + 1 map updates per token."""
        seq, lo, hi = self._seqs[seq_id], self.config.min_n, self.config.max_n
        for t in tokens:
            seq.append(int(t))
            end = len(seq)
            # One stamp per token: it orders occurrences by recency and dedups them across n.
            stamp = len(self._where)
            self._where.append((seq_id, end))
            for n in range(lo, min(hi, end) + 1):
                self._table.setdefault(tuple(seq[end - n :]), []).append(stamp)

    def propose(
        self, context: Sequence[int], draft_depth: int, topk: int, num_draft_tokens: int
    ) -> tuple[list[int], list[int]]:
        """A draft tree (tokens, parents) of exactly num_draft_tokens nodes after context[-1].

        context is the row's tokens so far (prompt + response); only its last max_n are read.
        """
        if not context:
            raise ValueError("context must hold at least the root token")
        if draft_depth < 1 or topk < 1 or num_draft_tokens < 0:
            raise ValueError(
                f"need draft_depth >= 1, topk >= 1, num_draft_tokens >= 0, "
                f"got {draft_depth}, {topk}, {num_draft_tokens}"
            )
        trie = _Trie()
        for n, stamp, cont in self._matches(context, draft_depth):
            trie.insert(cont, n, stamp)
        tokens, parents = trie.best(topk, num_draft_tokens)
        _pad(tokens, parents, int(context[-1]), draft_depth, num_draft_tokens)
        return tokens, parents

    def _matches(self, context: Sequence[int], draft_depth: int):
        """(match length, stamp, continuation) of the most recent matches, longest n first."""
        cfg, seen, found = self.config, set(), 0
        tail = [int(t) for t in context[-cfg.max_n :]]
        for n in range(min(cfg.max_n, len(tail)), cfg.min_n - 1, -1):
            for stamp in reversed(self._table.get(tuple(tail[len(tail) - n :]), ())):
                if stamp in seen:
                    continue
                seen.add(stamp)
                seq_id, end = self._where[stamp]
                # A match at a sequence's current end (e.g. the row itself) has nothing after it yet.
                cont = self._seqs[seq_id][end : end + draft_depth]
                if cont:
                    yield n, stamp, cont
                    found += 1
                    if found == cfg.max_matches:
                        return


@dataclass(slots=True)
class _Node:
    token: int
    parent: int  # trie index, -1 = root
    depth: int
    match_n: int  # longest context match among the occurrences through this node
    recent: int  # stamp of the most recent of them
    count: int = 0  # how many of them
    children: dict[int, int] = field(default_factory=dict)  # token -> trie index


class _Trie:
    """Continuations merged by prefix; a node ranks by (match length, count, recency)."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.root: dict[int, int] = {}

    def insert(self, cont: list[int], n: int, stamp: int) -> None:
        kids, parent = self.root, -1
        for depth, t in enumerate(cont, start=1):
            i = kids.get(t)
            if i is None:
                i = kids[t] = len(self.nodes)
                self.nodes.append(_Node(t, parent, depth, n, stamp))
            node = self.nodes[i]
            node.count += 1
            # Matches arrive longest n first, so a node's first match_n is already its longest.
            if stamp > node.recent:
                node.recent = stamp
            kids, parent = node.children, i

    def _key(self, i: int) -> tuple[int, ...]:
        node = self.nodes[i]
        # heapq pops the smallest: best rank first, then shallower, then earlier in the trie.
        return (-node.match_n, -node.count, -node.recent, node.depth, i)

    def _top_children(self, kids: dict[int, int], topk: int) -> list[tuple[int, ...]]:
        return sorted(self._key(c) for c in kids.values())[:topk]

    def best(self, topk: int, limit: int) -> tuple[list[int], list[int]]:
        """Best-first selection; a node becomes eligible only once its parent is kept."""
        heap = self._top_children(self.root, topk)
        heapq.heapify(heap)
        tokens: list[int] = []
        parents: list[int] = []
        new_index = {-1: -1}
        while heap and len(tokens) < limit:
            i = heapq.heappop(heap)[-1]
            new_index[i] = len(tokens)
            tokens.append(self.nodes[i].token)
            parents.append(new_index[self.nodes[i].parent])
            for key in self._top_children(self.nodes[i].children, topk):
                heapq.heappush(heap, key)
        return tokens, parents


def _pad(tokens: list[int], parents: list[int], last: int, draft_depth: int, size: int) -> None:
    """Fill up to size nodes: a chain repeating the last token under the root, then root duplicates."""
    for k in range(size - len(tokens)):
        parents.append(len(tokens) - 1 if 0 < k < draft_depth else -1)
        tokens.append(last)


def propose_tree(
    indexes: Sequence[NgramIndex],
    contexts: Sequence[Sequence[int]],
    draft_depth: int,
    topk: int,
    num_draft_tokens: int,
    device: torch.device | str = "cpu",
) -> DraftTree:
    """One n-gram draft per row (row b drafts from indexes[b], its prompt group's index)."""
    if len(indexes) != len(contexts):
        raise ValueError(f"need one index per context, got {len(indexes)} and {len(contexts)}")
    drafts = [ix.propose(ctx, draft_depth, topk, num_draft_tokens) for ix, ctx in zip(indexes, contexts)]
    tokens = torch.tensor([t for t, _ in drafts], dtype=torch.long).reshape(len(drafts), num_draft_tokens)
    parents = torch.tensor([p for _, p in drafts], dtype=torch.long).reshape(len(drafts), num_draft_tokens)
    return DraftTree(tokens.to(device), parents.to(device))
