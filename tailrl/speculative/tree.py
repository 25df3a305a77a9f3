"""Draft trees: the one format every drafter proposes and the target verifies.

A DraftTree holds, per row, N draft nodes with parent pointers (-1 = the root). The root is the
row's last emitted token, already known, at absolute position P_b. The target verifies
[root, node_0, ..., node_{N-1}] in one forward: verify index 0 is the root and node i is verify
index i + 1, at position P_b + depth(i), attending to the prefix cache and to its ancestors
(`verify_layout`).

`build_tree` grows the learned drafter's tree EAGLE-2 style (best-first by cumulative draft
log-prob) from scores returned by a callback, so it never touches a torch module.

Knows: tree structure, masks, depths, the best-first expansion over draft scores. Does not know:
models, the drafter's internals, sampling, the acceptance rule.

Shapes: B rows, N draft nodes (N + 1 verify tokens, root first), K = topk, F frontier nodes
expanded in one step (1 at step 0, then K), E draft-forward entries so far, `*` whatever state a
drafter passes from a node to its children.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class DraftTree:
    """N draft nodes per row; parents[b, i] < i is the parent node index, or -1 for the root."""

    tokens: Tensor  # (B, N) long
    parents: Tensor  # (B, N) long

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.shape != self.parents.shape:
            shapes = f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}"
            raise ValueError(f"tokens and parents must both be (B, N), got {shapes}")
        if self.tokens.dtype != torch.long or self.parents.dtype != torch.long:
            raise ValueError("DraftTree tokens and parents must be torch.long tensors")
        idx = torch.arange(self.parents.shape[1], device=self.parents.device)
        if bool(((self.parents < -1) | (self.parents >= idx)).any()):
            raise ValueError("DraftTree parents must satisfy -1 <= parents[b, i] < i (topological order)")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def depths(self) -> Tensor:
        """Depth of each node: the root's children are at depth 1.  # (B, N)"""
        return _ancestors(self.parents)[1]

    @property
    def is_chain(self) -> bool:
        """Whether every row is a chain (node i's parent is node i - 1), as `chain` builds."""
        n = self.num_nodes
        return bool((self.parents == torch.arange(-1, n - 1, device=self.parents.device)).all())

    def verify_ids(self, root_tokens: Tensor) -> Tensor:
        """The target's verify input [root, node_0, ..., node_{N-1}].  # (B,) -> (B, N + 1)"""
        return torch.cat([root_tokens.reshape(-1, 1).to(self.tokens), self.tokens], dim=1)

    def to(self, device: torch.device | str) -> DraftTree:
        if self.tokens.device == torch.device(device):
            return self  # already checked when built
        return DraftTree(self.tokens.to(device), self.parents.to(device))


def chain(tokens: Tensor) -> DraftTree:
    """A linear draft: node i's parent is node i - 1.  # (B, N) -> tree"""
    b, n = tokens.shape
    parents = torch.arange(-1, n - 1, device=tokens.device).expand(b, n).clone()
    return DraftTree(tokens.long(), parents)


def _ancestors(parents: Tensor) -> tuple[Tensor, Tensor]:
    """anc[b, i, j]: node j is node i or an ancestor of it; and node depths.  # (B, N, N), (B, N)

    Starts from "itself or its parent" and squares the relation: after m squarings it reaches
    2**m levels up, and no node has more than N - 1 ancestors, so m = ceil(log2(N - 1)). A fixed
    number of batched ops, none of which waits on a value (a climb one level per pass asks every
    pass whether to go on).
    """
    b, n = parents.shape
    if n == 0:
        return parents.new_zeros(b, 0, 0, dtype=torch.bool), parents.new_zeros(b, 0)
    has_parent = (parents >= 0)[..., None]  # (B, N, 1)
    step = torch.eye(n, device=parents.device) + F.one_hot(parents.clamp(min=0), n) * has_parent  # (B, N, N)
    for _ in range(max(n - 2, 0).bit_length()):
        step = (torch.bmm(step, step) > 0).float()
    anc = step > 0
    return anc, anc.sum(-1)


def verify_layout(parents: Tensor) -> tuple[Tensor, Tensor]:
    """The verify forward's tree mask and depth offsets from one ancestor computation.

    mask[b, q, k]: verify token k is q or an ancestor of q, the root everyone's; offsets[b, q]:
    depth of verify token q (root 0), its absolute position being P_b + offset.
    # (B, N) -> (B, N+1, N+1), (B, N+1)
    """
    b, n = parents.shape
    anc, depths = _ancestors(parents)
    mask = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=parents.device)
    mask[:, :, 0] = True
    mask[:, 1:, 1:] = anc
    return mask, torch.cat([depths.new_zeros(b, 1), depths], dim=1)


# ---- the learned drafter's tree (EAGLE-2 style) ----------------------------------------------


@dataclass
class Frontier:
    """The nodes a drafter expands in one step, all at depth `step` (positions P_b + step).

    Nodes are numbered in generation order over the whole build ("node ids"): step 0 generates
    ids 0..K-1 (the root's children), each later step K*K more. The root itself has id -1.
    The drafter's forwards are numbered too ("entries"): entry 0 is the step-0 forward on the
    root, then K entries per step in frontier order, so a drafter that appends each step's K/V
    to a list and concatenates them can use `attn_mask` as its tree attention over them.
    """

    step: int
    tokens: Tensor  # (B, F) token of each node to expand (the root tokens at step 0, -1 if not given)
    node_ids: Tensor  # (B, F) generation index of each node; -1 for the root
    parents: Tensor  # (B, F) node id of each node's parent; -1 = the root (and for the root itself)
    parent_state: Tensor | None  # (B, F, *) what expand returned for each node's parent (root_state at step 0)
    attn_mask: Tensor  # (B, F, E) bool: entry e is this node or one of its ancestors (E = 1 + step * K)

    @property
    def depth(self) -> int:
        return self.step


class Expansion(NamedTuple):
    """What expand returns for a frontier: K children per node, and the node's own state.

    log_probs are the drafter's log-probabilities of each child given its parent (not cumulative;
    the builder accumulates). state (e.g. the drafter's output hidden state at each node) is
    handed back to the node's children as their `parent_state`; None if the drafter keeps none.
    A plain (log_probs, token_ids) or (log_probs, token_ids, state) tuple works too.
    """

    log_probs: Tensor  # (B, F, K)
    token_ids: Tensor  # (B, F, K)
    state: Tensor | None = None  # (B, F, *)


def max_tree_nodes(draft_depth: int, topk: int) -> int:
    """How many nodes build_tree generates: K at step 0, K*K per later step."""
    return topk + (draft_depth - 1) * topk * topk


def build_tree(
    expand: Callable[[Frontier], Expansion | tuple],
    root_state: Tensor,
    draft_depth: int,
    topk: int,
    num_draft_tokens: int,
    *,
    root_tokens: Tensor | None = None,
) -> DraftTree:
    """Best-first draft tree: draft_depth calls to expand, then the best num_draft_tokens nodes.

    Step 0 expands the root into K children. Each later step expands the K best nodes of the
    last generated layer (by cumulative draft log-prob) into K children each. Finally the
    num_draft_tokens best nodes over all generated nodes are kept, in generation order.
    root_state (B, *) reaches expand as the root's `parent_state` at step 0; root_tokens (B,)
    fills the step-0 frontier's tokens. The result is closed under parents: log-probs are
    clamped to <= 0 (NaN counts as -inf), so scores never rise along a path, and ties go to the
    earlier node, which a parent always is.

    An EAGLE drafter's expand, one drafter forward per call (P_b = the root's position):
      input    (frontier.parent_state, embed(frontier.tokens)) at positions P_b + frontier.step;
               at step 0 parent_state is root_state, the target's hidden state at P_b - 1
      attends  its own KV cache (the prefix) plus this build's earlier entries where
               frontier.attn_mask is True (its ancestors and itself)
      returns  (top-K draft log-probs, their target token ids, the output hidden state), each
               (B, F, ...); the hidden state comes back as its children's parent_state.
    """
    if draft_depth < 1 or topk < 1:
        raise ValueError(f"draft_depth and topk must be >= 1, got {draft_depth} and {topk}")
    if not 1 <= num_draft_tokens <= max_tree_nodes(draft_depth, topk):
        raise ValueError(
            f"num_draft_tokens must be in [1, {max_tree_nodes(draft_depth, topk)}] for draft_depth={draft_depth}, "
            f"topk={topk}, got {num_draft_tokens}"
        )
    b, device = root_state.shape[0], root_state.device
    none = torch.full((b, 1), -1, dtype=torch.long, device=device)
    root = none if root_tokens is None else root_tokens.reshape(b, 1).long()
    ones = torch.ones(b, 1, 1, dtype=torch.bool, device=device)
    frontier = Frontier(0, root, none, none, root_state[:, None], ones)
    frontier_scores = torch.zeros(b, 1, device=device)  # (B, F)
    scores, tokens, parents = [], [], []  # per step: (B, F*K)
    for step in range(draft_depth):
        exp = Expansion(*expand(frontier))
        log_probs = _checked_log_probs(exp, frontier, topk)  # (B, F, K)
        step_scores = (frontier_scores[:, :, None] + log_probs).flatten(1)  # (B, F*K)
        step_tokens = exp.token_ids.long().flatten(1)
        step_parents = frontier.node_ids[:, :, None].expand(-1, -1, topk).flatten(1)
        first_id = sum(s.shape[1] for s in scores)
        scores.append(step_scores)
        tokens.append(step_tokens)
        parents.append(step_parents)
        if step + 1 < draft_depth:
            best = _best(step_scores, topk)  # (B, K) candidate index = slot * K + child
            frontier = _next_frontier(frontier, exp.state, best, step_tokens, step_parents, first_id, topk)
            frontier_scores = step_scores.gather(1, best)
    return _keep_best(torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), num_draft_tokens)


def _checked_log_probs(exp: Expansion, frontier: Frontier, topk: int) -> Tensor:
    shape = (*frontier.tokens.shape, topk)
    if tuple(exp.log_probs.shape) != shape or tuple(exp.token_ids.shape) != shape:
        raise ValueError(
            f"expand must return log_probs and token_ids of shape {shape} at step {frontier.step}, "
            f"got {tuple(exp.log_probs.shape)} and {tuple(exp.token_ids.shape)}"
        )
    if exp.state is not None and tuple(exp.state.shape[:2]) != shape[:2]:
        raise ValueError(f"expand's state must start with {shape[:2]}, got {tuple(exp.state.shape)}")
    lp = exp.log_probs.float()
    # A positive or NaN score would let a child outrank its parent and break closure.
    return torch.where(lp.isnan(), float("-inf"), lp).clamp(max=0.0)


def _best(scores: Tensor, k: int) -> Tensor:
    """Indices of the k best scores per row, ties to the lower index.  # (B, M) -> (B, k)"""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]


def _next_frontier(
    prev: Frontier,
    state: Tensor | None,
    best: Tensor,
    tokens: Tensor,
    parents: Tensor,
    first_id: int,
    topk: int,
) -> Frontier:
    b = best.shape[0]
    rows = torch.arange(b, device=best.device)[:, None]
    slots = best // topk  # (B, K) each chosen node's parent slot in prev
    self_entry = torch.eye(topk, dtype=torch.bool, device=best.device).expand(b, topk, topk)
    return Frontier(
        step=prev.step + 1,
        tokens=tokens.gather(1, best),
        node_ids=best + first_id,
        parents=parents.gather(1, best),
        parent_state=None if state is None else state[rows, slots],
        attn_mask=torch.cat([prev.attn_mask[rows, slots], self_entry], dim=2),
    )


def _keep_best(scores: Tensor, tokens: Tensor, parents: Tensor, n: int) -> DraftTree:
    """The n best generated nodes, re-indexed in generation order.  # (B, M) each -> tree (B, n)"""
    kept = _best(scores, n).sort(dim=1).values  # (B, n) node ids, ascending = topological
    new_index = torch.full_like(scores, -1, dtype=torch.long)
    new_index.scatter_(1, kept, torch.arange(n, device=kept.device).expand_as(kept))
    kept_parents = parents.gather(1, kept)
    new_parents = torch.where(kept_parents >= 0, new_index.gather(1, kept_parents.clamp(min=0)), -1)
    return DraftTree(tokens.gather(1, kept), new_parents)
