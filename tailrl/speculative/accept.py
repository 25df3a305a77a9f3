"""The lossless acceptance walk: which draft tokens the target keeps, and the token after them.

At each visited verify token (root first) the target's processed probabilities p and the
position-keyed uniform u pick x = inverse_cdf(p, u), exactly the token plain decoding would
sample at that position. If a child of the current node carries x, the walk descends into it;
otherwise x is emitted and the walk stops (at a leaf x is the "bonus" token). Every emitted token
is thus the token plain decoding emits, so any drafter is safe: its probabilities are never read.

Knows: the tree, the target's verify logits, sampling settings, seeds and root positions. Does
not know: models, caches, how the tree was drafted.

Shapes: B rows, N draft nodes, V vocabulary, A rows still walking at a given depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tailrl.sampling import (
    SamplingParams,
    inverse_cdf,
    is_top1,
    next_position,
    process_logits,
    token_logprobs,
    uniforms,
)
from tailrl.speculative.tree import DraftTree


@dataclass
class AcceptResult:
    """Per row: emitted tokens (accepted drafts, then the target's own pick) and where they came from."""

    tokens: list[list[int]]
    logprobs: list[list[float]]  # sampling.token_logprobs of each emitted token
    top1: list[list[bool]]  # sampling.is_top1 of each emitted token
    path: list[list[int]]  # verify indices of the accepted draft nodes (root excluded), root to leaf
    accept_len: list[int]  # len(tokens[b]): accepted drafts + 1


def accept_walk(
    logits: Tensor, tree: DraftTree, params: SamplingParams, seeds: list[int], root_positions: list[int]
) -> AcceptResult:
    """Walk each row's tree from the root with the target's position-keyed picks.  # (B, N+1, V)

    logits[b, j] are the target's logits at verify token j (j = 0 the root, j = i + 1 node i);
    root_positions[b] is the root's absolute position P_b. Only visited nodes are processed,
    depth by depth with the still-walking rows batched.
    """
    b, n = tree.tokens.shape
    if logits.dim() != 3 or logits.shape[:2] != (b, n + 1):
        raise ValueError(f"logits must be (B, N+1, V) = ({b}, {n + 1}, V), got {tuple(logits.shape)}")
    if len(seeds) != b or len(root_positions) != b:
        raise ValueError(
            f"need one seed and one root position per row ({b}), got {len(seeds)} and {len(root_positions)}"
        )
    if tree.is_chain:
        return _accept_chain(logits, tree, params, seeds, root_positions)
    device = logits.device
    node_parents = tree.parents.to(device) + 1  # (B, N) verify index of each node's parent
    node_tokens = tree.tokens.to(device)  # (B, N)
    tokens: list[list[int]] = [[] for _ in range(b)]
    logprobs: list[list[float]] = [[] for _ in range(b)]
    top1: list[list[bool]] = [[] for _ in range(b)]
    path: list[list[int]] = [[] for _ in range(b)]
    at = [0] * b  # verify index each row stands on
    rows, depth = list(range(b)), 0
    while rows:
        r = torch.tensor(rows, device=device)
        j = torch.tensor([at[i] for i in rows], device=device)
        # Widened once: process_logits, token_logprobs and is_top1 all compute in fp32.
        visited = logits[r, j].float()  # (A, V)
        probs = process_logits(visited, params)  # (A, V)
        # The node visited at this depth sits at position P_b + depth: the uniform plain decoding
        # uses for the token after it.
        u = uniforms([seeds[i] for i in rows], [next_position(root_positions[i] + depth) for i in rows])
        x = inverse_cdf(probs, u)  # (A,)
        # Descend iff the target's own pick is a child's draft token (the first such child).
        match = (node_parents[r] == j[:, None]) & (node_tokens[r] == x[:, None])  # (A, N)
        child = _first_true(match)  # (A,) verify index of the matching child, 0 if none
        lps, top = token_logprobs(visited, x, params).tolist(), is_top1(visited, x).tolist()
        still = []
        for i, xi, c, lp, tp in zip(rows, x.tolist(), child.tolist(), lps, top):
            tokens[i].append(xi)
            logprobs[i].append(lp)
            top1[i].append(tp)
            if c:
                path[i].append(c)
                at[i] = c
                still.append(i)
        rows, depth = still, depth + 1
    return AcceptResult(tokens, logprobs, top1, path, [len(t) for t in tokens])


def _accept_chain(
    logits: Tensor, tree: DraftTree, params: SamplingParams, seeds: list[int], root_positions: list[int]
) -> AcceptResult:
    """accept_walk on chains without reading the device until the end. On a chain the node at
    verify index j sits at depth j, so every position's pick is known before the walk: the
    accepted drafts are the leading nodes whose token is the pick before them. Picks past a row's
    first mismatch are computed and dropped (a chain's tokens are few), and the step reads the
    device once, not once per depth (on a GPU each read waits for the queue). Depth by depth, as
    the walk: B rows of the vocabulary at a time stay in the CPU's cache where all B (N + 1) would
    not. Each pick, log-prob and top-1 flag comes from the same functions on the same logits row
    as the walk's: the same bits."""
    b, n = tree.tokens.shape
    picks, parts = [], []
    for j in range(n + 1):
        rows = logits[:, j].float()  # (B, V)
        u = uniforms(seeds, [next_position(root + j) for root in root_positions])
        x = inverse_cdf(process_logits(rows, params), u)  # (B,)
        picks.append(x)
        parts.append(torch.stack((x.double(), token_logprobs(rows, x, params).double(), is_top1(rows, x).double())))
    accepted = (tree.tokens.to(logits.device) == torch.stack(picks, 1)[:, :n]).long().cumprod(1).sum(1)  # (B,)
    out = torch.cat((torch.stack(parts, 2).flatten(), accepted.double())).tolist()  # (3, B, N+1), then (B,)
    k = b * (n + 1)
    toks, lps, top, acc = out[:k], out[k : 2 * k], out[2 * k : 3 * k], out[3 * k :]
    result = AcceptResult([], [], [], [], [])
    for i in range(b):
        a, at = int(acc[i]), i * (n + 1)
        result.tokens.append([int(t) for t in toks[at : at + a + 1]])
        result.logprobs.append(lps[at : at + a + 1])
        result.top1.append([t == 1.0 for t in top[at : at + a + 1]])
        result.path.append(list(range(1, a + 1)))
        result.accept_len.append(a + 1)
    return result


def _first_true(match: Tensor) -> Tensor:
    """1 + index of the first True per row, 0 if none.  # (A, N) -> (A,)"""
    if match.shape[1] == 0:
        return torch.zeros(match.shape[0], dtype=torch.long, device=match.device)
    return torch.where(match.any(1), match.int().argmax(1) + 1, 0)
