"""Draft trees and the lossless acceptance walk.

The walk must emit exactly what plain position-keyed decoding emits, whatever the tree; and the
emitted tokens must follow the target distribution even against an adversarial drafter.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from tailrl.sampling import SamplingParams, derive_seed, hash_ints, inverse_cdf, is_top1, process_logits, sample
from tailrl.speculative.accept import accept_walk
from tailrl.speculative.tree import DraftTree, Frontier, build_tree, chain, verify_layout

PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "t1": SamplingParams(temperature=1.0),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
}

# ---- tree structure ------------------------------------------------------------------------

#   root ── n0 (10) ── n2 (12) ── n4 (14)
#        │          └─ n3 (13)
#        └─ n1 (11) ── n5 (15)
HAND_PARENTS = [-1, -1, 0, 0, 2, 1]


def test_verify_layout_on_a_hand_drawn_tree():
    parents = torch.tensor([HAND_PARENTS, [-1, 0, 1, 2, 3, 4]])
    expected_row0 = [
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # n0
        [1, 0, 1, 0, 0, 0, 0],  # n1
        [1, 1, 0, 1, 0, 0, 0],  # n2
        [1, 1, 0, 0, 1, 0, 0],  # n3
        [1, 1, 0, 1, 0, 1, 0],  # n4
        [1, 0, 1, 0, 0, 0, 1],  # n5
    ]
    mask, offsets = verify_layout(parents)
    assert mask.dtype == torch.bool and mask.shape == (2, 7, 7)
    assert mask[0].int().tolist() == expected_row0
    assert torch.equal(mask[1], torch.ones(7, 7, dtype=torch.bool).tril())  # a chain is causal
    assert offsets.tolist() == [[0, 1, 1, 2, 2, 3, 2], [0, 1, 2, 3, 4, 5, 6]]
    tree = DraftTree(torch.arange(10, 16).expand(2, 6).clone(), parents)
    assert tree.depths.tolist() == [[1, 1, 2, 2, 3, 2], [1, 2, 3, 4, 5, 6]]
    assert tree.verify_ids(torch.tensor([7, 8]))[:, :2].tolist() == [[7, 10], [8, 10]]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 33])
def test_verify_layout_matches_a_walk_up_the_parents(n):
    """Random trees (chains, stars, anything topological): the mask and depths are those of a
    plain Python walk from each node up to the root."""
    rng = random.Random(n)
    rows = [[rng.randrange(-1, i) for i in range(n)] for _ in range(5)] + [list(range(-1, n - 1)), [-1] * n]
    mask, offsets = verify_layout(torch.tensor(rows))
    for b, parents in enumerate(rows):
        for i in range(n):
            chain_up, k = [i], parents[i]
            while k >= 0:
                chain_up.append(k)
                k = parents[k]
            assert offsets[b, i + 1] == len(chain_up)
            assert mask[b, i + 1].nonzero().flatten().tolist() == sorted([0] + [j + 1 for j in chain_up])


def test_chain_and_empty_tree():
    tree = chain(torch.tensor([[5, 6, 7]]))
    assert tree.parents.tolist() == [[-1, 0, 1]]
    empty = DraftTree(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long))
    mask, offsets = verify_layout(empty.parents)
    assert mask.tolist() == [[[True]], [[True]]] and offsets.tolist() == [[0], [0]]


def test_draft_tree_rejects_non_topological_parents():
    with pytest.raises(ValueError):
        DraftTree(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 1, 0]]))
    with pytest.raises(ValueError):
        DraftTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-2, 0]]))


# ---- build_tree -----------------------------------------------------------------------------

# Per token: its drafter children and their probabilities (topk = 2), hand-ranked below.
HAND_TABLE = {
    # row 0
    0: ([1, 2], [0.6, 0.4]),
    1: ([3, 4], [0.5, 0.5]),
    2: ([5, 6], [0.9, 0.1]),
    3: ([9, 10], [1.0, 0.0]),  # a certain child: its score ties its parent's
    5: ([7, 8], [0.5, 0.5]),
    # row 1
    100: ([101, 102], [0.5, 0.5]),
    101: ([103, 104], [0.2, 0.8]),
    102: ([105, 106], [0.7, 0.3]),
    104: ([107, 108], [0.5, 0.5]),
    105: ([109, 110], [0.9, 0.1]),
}


def _table_expand(seen: list[Frontier]):
    def expand(fr: Frontier):
        seen.append(fr)
        kids = [[HAND_TABLE[t][0] for t in row] for row in fr.tokens.tolist()]
        probs = [[HAND_TABLE[t][1] for t in row] for row in fr.tokens.tolist()]
        # The drafter's state at a node is just its token, so gathers are easy to check.
        return torch.tensor(probs).log(), torch.tensor(kids), fr.tokens[:, :, None].float()

    return expand


@pytest.mark.parametrize(
    "n, tokens, parents",
    [
        # Cumulative probabilities, row 0: 1 .6, 2 .4, 5 .36, 3 .3, 4 .3, 9 .3, 7 .18, 8 .18, 6 .04, 10 0
        # row 1: 101 .5, 102 .5, 104 .4, 105 .35, 109 .315, 107 .2, 108 .2, 106 .15, 103 .1, 110 .035
        (6, [[1, 2, 3, 4, 5, 9], [101, 102, 104, 105, 107, 109]],
            [[-1, -1, 0, 0, 1, 2], [-1, -1, 0, 1, 2, 3]]),
        (4, [[1, 2, 3, 5], [101, 102, 104, 105]],
            [[-1, -1, 0, 1], [-1, -1, 0, 1]]),
        (7, [[1, 2, 3, 4, 5, 7, 9], [101, 102, 104, 105, 107, 108, 109]],
            [[-1, -1, 0, 0, 1, 4, 2], [-1, -1, 0, 1, 2, 2, 3]]),
    ],
)
def test_build_tree_matches_hand_ranking(n, tokens, parents):
    seen: list[Frontier] = []
    root_state = torch.tensor([[-1.0], [-2.0]])
    tree = build_tree(_table_expand(seen), root_state, 3, 2, n, root_tokens=torch.tensor([0, 100]))
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents

    assert [fr.step for fr in seen] == [0, 1, 2]
    assert seen[0].parent_state.tolist() == [[[-1.0]], [[-2.0]]]
    step2 = seen[2]
    # Row 0's frontier: 5 (id 4, .36) then 3 (id 2, .3; ties 4 at id 3 and wins on id).
    assert step2.tokens.tolist() == [[5, 3], [104, 105]]
    assert step2.node_ids.tolist() == [[4, 2], [3, 4]]
    assert step2.parents.tolist() == [[1, 0], [0, 1]]
    assert step2.parent_state[..., 0].tolist() == [[2.0, 1.0], [101.0, 102.0]]
    # Entries: 0 root, 1-2 step-1 frontier (tokens 1, 2 / 101, 102), 3-4 this frontier.
    assert step2.attn_mask.int().tolist() == [
        [[1, 0, 1, 1, 0], [1, 1, 0, 0, 1]],
        [[1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
    ]


def test_frontier_gives_an_eagle_style_drafter_its_tree_attention():
    """A toy drafter whose state at a node sums keys over the node's path (root included), each
    key being embed(token) + parent state: computed once with Frontier.attn_mask over the
    entries appended step by step, once by replaying the node's path from the root."""
    g = torch.Generator().manual_seed(5)
    vocab, dim, k, b = 16, 4, 3, 2
    emb, head = torch.randn(vocab, dim, generator=g), torch.randn(dim, vocab, generator=g)
    root_state, roots = torch.randn(b, dim, generator=g), torch.tensor([3, 7])
    entries: list[torch.Tensor] = []  # the drafter's per-step "KV"
    known: list[dict[int, tuple[int, int]]] = [{} for _ in range(b)]  # node id -> (parent id, token)
    generated = [0]

    def replay(r: int, node: int) -> torch.Tensor:
        path = []
        while node != -1:
            node, tok = known[r][node]
            path.append(tok)
        state, total = root_state[r], torch.zeros(dim)
        for t in [int(roots[r])] + path[::-1]:
            total = total + emb[t] + state
            state = total
        return state

    def expand(fr: Frontier):
        entries.append(emb[fr.tokens] + fr.parent_state)  # (B, F, D)
        state = fr.attn_mask.float() @ torch.cat(entries, 1)  # (B, F, E) @ (B, E, D)
        for r in range(b):
            for f, node in enumerate(fr.node_ids[r].tolist()):
                assert torch.allclose(state[r, f], replay(r, node), atol=1e-4)
        log_probs, ids = (state @ head).log_softmax(-1).topk(k, -1)
        for r in range(b):
            for f, node in enumerate(fr.node_ids[r].tolist()):
                for c in range(k):
                    known[r][generated[0] + f * k + c] = (node, int(ids[r, f, c]))
        generated[0] += fr.tokens.shape[1] * k
        return log_probs, ids, state

    tree = build_tree(expand, root_state, 4, k, 12, root_tokens=roots)
    assert len(entries) == 4 and tree.tokens.shape == (b, 12)


def test_build_tree_rejects_impossible_arm():
    with pytest.raises(ValueError):
        build_tree(lambda fr: None, torch.zeros(1, 1), 2, 2, 7)  # only 2 + 4 nodes exist


@pytest.mark.parametrize("draft_depth, topk, n", [(1, 3, 2), (4, 3, 10), (4, 3, 30), (3, 2, 10)])
def test_build_tree_is_closed_and_keeps_best_nodes_under_ties_and_bad_scores(draft_depth, topk, n):
    """Scores full of ties, certain children (0), -inf, NaN and positive values (invalid)."""
    gen = torch.Generator().manual_seed(draft_depth * 100 + n)
    values = torch.tensor([0.0, -0.5, -1.0, -2.0, float("-inf"), float("nan"), 0.25])
    b = 3
    score: list[dict[int, float]] = [{0: 0.0} for _ in range(b)]  # token -> reference cumulative score
    parent_tok: list[dict[int, int]] = [{} for _ in range(b)]
    counter = [1]

    last_layer: list[list[int]] = [[] for _ in range(b)]

    def expand(fr: Frontier):
        f = fr.tokens.shape[1]
        lp = values[torch.randint(len(values), (b, f, topk), generator=gen)]
        ids = counter[0] + torch.arange(f * topk).reshape(1, f, topk).expand(b, f, topk)  # generation order
        counter[0] += f * topk
        for r in range(b):
            if fr.step > 0:  # the frontier is the K best of the last layer, ties to the earlier node
                assert fr.tokens[r].tolist() == sorted(last_layer[r], key=lambda t: (-score[r][t], t))[:topk]
            last_layer[r] = ids[r].flatten().tolist()
            for s, t in enumerate(fr.tokens[r].tolist()):
                for c in range(topk):
                    x = float(lp[r, s, c])
                    child = int(ids[r, s, c])
                    score[r][child] = score[r][t] + (-math.inf if math.isnan(x) else min(x, 0.0))
                    parent_tok[r][child] = t
        return lp, ids

    roots = torch.zeros(b, dtype=torch.long)
    tree = build_tree(expand, torch.zeros(b, 1), draft_depth, topk, n, root_tokens=roots)
    for r in range(b):
        ranked = sorted(parent_tok[r], key=lambda t: (-score[r][t], t))
        assert sorted(tree.tokens[r].tolist()) == sorted(ranked[:n])
        toks = tree.tokens[r].tolist()
        for i, p in enumerate(tree.parents[r].tolist()):
            assert p < i
            assert (toks[p] if p >= 0 else 0) == parent_tok[r][toks[i]]  # closed: the real parent is kept
    assert int(tree.depths.max()) <= draft_depth


# ---- acceptance equals plain decoding ----------------------------------------------------------

V, T_MAX, END = 12, 96, 48
_gen = torch.Generator().manual_seed(1234)
W = torch.randn(V, V, T_MAX, V, generator=_gen) * 2.5  # next-token logits by (last, second-last, position)


def target_logits(ctx: list[int], pos: int) -> torch.Tensor:
    """Logits for the token after ctx, whose last token sits at absolute position pos."""
    return W[ctx[-1], ctx[-2], pos]


def plain_decode(prompt: list[int], seed: int, length: int, params: SamplingParams):
    seq, lps = list(prompt), []
    while len(seq) < length:
        t = len(seq)
        tok, lp = sample(target_logits(seq, t - 1)[None], params, [seed], [t])
        seq.append(int(tok[0]))
        lps.append(float(lp[0]))
    return seq, lps


def draft(rng: random.Random, seq: list[int], p: int, n: int, shape: str) -> tuple[list[int], list[int]]:
    """A tree rooted at seq[p]; shapes mix friendly nodes (plain's tokens) with adversarial ones."""
    if shape == "star":  # every token under the root, the right one duplicated at the end
        toks = list(range(V))[: n - 1] + [seq[p + 1]]
        return toks[:n], [-1] * n
    if shape == "corrupted_chain":  # plain's continuation with one token replaced
        toks = seq[p + 1 : p + 1 + n]
        if n:
            k = rng.randrange(n)
            toks[k] = (toks[k] + 1 + rng.randrange(V - 1)) % V
        return toks, list(range(-1, n - 1))
    toks, parents, ctxs, good = [], [], [], []
    for i in range(n):
        on_path = [-1] + [j for j in range(i) if good[j]]
        par = rng.choice(on_path) if rng.random() < 0.6 else rng.randrange(-1, i)
        ctx = seq[: p + 1] if par < 0 else ctxs[par]
        depth = len(ctx) - p
        r = rng.random()
        if r < 0.5 and (par < 0 or good[par]):
            tok = seq[p + depth]
        elif r < 0.8:  # the token the target likes least here
            tok = int(target_logits(ctx, p + depth - 1).argmin())
        else:
            tok = rng.randrange(V)
        toks.append(tok)
        parents.append(par)
        ctxs.append(ctx + [tok])
        good.append((par < 0 or good[par]) and tok == seq[p + depth])
    return toks, parents


def verify_logits(seq: list[int], p: int, toks: list[int], parents: list[int]) -> torch.Tensor:
    """What the target computes for [root, nodes...]: each node sees the prefix and its ancestors."""
    ctxs, rows = [], [target_logits(seq[: p + 1], p)]
    for tok, par in zip(toks, parents):
        ctx = (seq[: p + 1] if par < 0 else ctxs[par]) + [tok]
        ctxs.append(ctx)
        rows.append(target_logits(ctx, len(ctx) - 1))
    return torch.stack(rows)  # (N+1, V)


@pytest.mark.parametrize("name", list(PARAMS))
def test_accept_walk_emits_exactly_the_plain_decoding_tokens(name):
    params, rng = PARAMS[name], random.Random(name)
    seeds = [derive_seed(7, r) for r in range(3)]
    plains = [plain_decode([r, (5 * r + 1) % V], s, END + 12, params) for r, s in enumerate(seeds)]
    shapes = ["random", "random", "star", "corrupted_chain", "empty"]
    pos, emitted, logprobs = [1, 1, 1], [[], [], []], [[], [], []]
    rounds = 0
    while active := [r for r in range(3) if pos[r] < END]:
        n = 0 if shapes[rounds % 5] == "empty" else rng.randint(1, 9)
        trees = [draft(rng, plains[r][0], pos[r], n, shapes[rounds % 5]) for r in active]
        shape = (len(active), n)
        tree = DraftTree(
            torch.tensor([t for t, _ in trees], dtype=torch.long).reshape(shape),
            torch.tensor([p for _, p in trees], dtype=torch.long).reshape(shape),
        )
        logits = torch.stack([verify_logits(plains[r][0], pos[r], *tr) for r, tr in zip(active, trees)])
        res = accept_walk(logits, tree, params, [seeds[r] for r in active], [pos[r] for r in active])
        for k, r in enumerate(active):
            toks, parents = trees[k]
            assert res.accept_len[k] == len(res.tokens[k]) == len(res.path[k]) + 1
            assert [toks[j - 1] for j in res.path[k]] == res.tokens[k][:-1]
            assert [parents[j - 1] + 1 for j in res.path[k]] == ([0] + res.path[k])[:-1]
            emitted[r] += res.tokens[k]
            logprobs[r] += res.logprobs[k]
            pos[r] += res.accept_len[k]
        rounds += 1
    accepted = sum(len(e) for e in emitted) - 3 * rounds
    assert accepted > 3 * END // 4, "the trees should have let the walk descend often"
    for r, (seq, lps) in enumerate(plains):
        assert emitted[r] == seq[2 : 2 + len(emitted[r])]
        assert logprobs[r] == lps[: len(emitted[r])]  # the same function on the same row: same bits


def test_accept_walk_rejects_mismatched_shapes():
    tree = chain(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError):
        accept_walk(torch.zeros(1, 2, 5), tree, PARAMS["t1"], [0], [0])
    with pytest.raises(ValueError):
        accept_walk(torch.zeros(1, 3, 5), tree, PARAMS["t1"], [0, 1], [0])


def test_is_top1_on_bf16_logits_is_the_bf16_argmax_ties_included():
    """is_top1 computes in fp32; on bf16 logits it must flag the bf16 argmax (first index on ties)."""
    logits = torch.randn(6, 300).bfloat16()
    logits[1, [5, 9]] = logits[1].max() + 1  # a tie: index 5 is the argmax
    logits[2, -1] = float("nan")  # NaN wins argmax in both dtypes
    for tokens in (logits.argmax(-1), torch.tensor([0, 9, 3, 7, 1, 2])):
        assert torch.equal(is_top1(logits, tokens), logits.argmax(-1) == tokens)
    assert is_top1(logits, torch.tensor([0, 5, 299, 0, 0, 0]))[1:3].tolist() == [True, True]


# ---- acceptance follows the target distribution against an adversarial drafter ------------

P0 = torch.tensor([0.30, 0.25, 0.18, 0.12, 0.09, 0.06])
LOG_P0 = P0.log()
LOG_P1 = torch.stack([P0.roll(x + 1).log() for x in range(6)])  # second token's logits given the first
M = 12_000
SEEDS = hash_ints(99, np.arange(M)).tolist()  # one independent sequence seed per trial
# Chance that a correct walk fails one chi-square assertion, over the choice of seeds (asymptotic
# chi-square law; >= 5 expected per cell is checked). 12 assertions: <= 1.2e-5 for the file.
FALSE_FAILURE = 1e-6


def _children(q: torch.Tensor, drafter: str) -> list[int]:
    order = q.argsort().tolist()  # least likely first
    return order[:2] if drafter == "adversarial" else [order[0], order[-1]]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= statistic) over the support; mass outside the support must be unobserved."""
    support = probs > 0
    assert int(counts[~support].sum()) == 0
    expected = probs[support].double() * counts.sum()
    assert float(expected.min()) >= 5, "chi-square approximation needs >= 5 expected per cell"
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("drafter", ["adversarial", "mixed"])
@pytest.mark.parametrize(
    "params", [SamplingParams(1.0), SamplingParams(0.8, top_k=4), SamplingParams(1.2, top_p=0.85)], ids=str
)
def test_first_two_tokens_follow_the_target_distribution(params, drafter):
    # Position-keyed sampling makes the emitted tokens identical for both drafters (the equality
    # test above); the drafters differ in which paths the walk takes to produce them.
    q0 = process_logits(LOG_P0[None], params)[0]
    q1 = process_logits(LOG_P1, params)  # (6, 6) second token given the first
    seeds, root_pos = SEEDS, 17
    # Round 1: root children are the drafter's picks under q0, each with two children under q1.
    kids = _children(q0, drafter)
    grand = [_children(q1[c], drafter) for c in kids]
    nodes = torch.tensor([kids + grand[0] + grand[1]])
    tree = DraftTree(nodes.expand(M, 6), torch.tensor([[-1, -1, 0, 0, 1, 1]]).expand(M, 6))
    row = torch.cat([LOG_P0[None], LOG_P1[kids], torch.zeros(4, 6)])  # (7, V): depth-2 logits are never used
    first = accept_walk(row.expand(M, 7, 6), tree, params, seeds, [root_pos] * M)
    # Round 2 for rows that emitted one token: a fresh tree from the same drafter, rooted there.
    again = [i for i in range(M) if first.accept_len[i] == 1]
    x1 = [first.tokens[i][0] for i in again]
    kids_of = torch.tensor([_children(q1[x], drafter) for x in range(6)])
    kids2 = kids_of[torch.tensor(x1, dtype=torch.long)]
    tree2 = DraftTree(kids2, torch.tensor([[-1, -1]]).expand(len(again), 2))
    logits2 = torch.cat([LOG_P1[x1][:, None], torch.zeros(len(again), 2, 6)], dim=1)
    second = accept_walk(logits2, tree2, params, [seeds[i] for i in again], [root_pos + 1] * len(again))
    pairs = [t[:2] for t in first.tokens]
    for i, t in zip(again, second.tokens):
        pairs[i] = [pairs[i][0], t[0]]

    assert (len(again) < M) == bool(q0[kids].sum() > 0), "the walk descends iff a draft can be picked"
    pair_ids = torch.tensor([6 * a + c for a, c in pairs])
    counts = torch.bincount(pair_ids, minlength=36).reshape(6, 6).double()
    assert _chi2_pvalue(counts.sum(1), q0) > FALSE_FAILURE
    assert _chi2_pvalue(counts.flatten(), (q0[:, None] * q1).flatten()) > FALSE_FAILURE


def test_inverse_cdf_is_the_first_id_past_the_target_on_the_whole_vocabularys_running_sum():
    """The two-level search (sampling.inverse_cdf) against the definition: the first id whose
    fp64 running sum over the whole row exceeds u * total. Rows of 49,152 ids (SmolLM2's
    vocabulary, whole blocks) and of 1,000 (a padded last block), a seventh of the ids at
    probability 0, 2,000 uniforms. The two sums differ in their last bits only, so they can
    disagree only where u * total lies within ~1e-16 of one of a row's running-sum values:
    about 1e-8 for all draws together (the false-failure probability). An id of probability 0
    is never drawn, even at u just below 1, where rounding puts the target past a running
    sum's end."""
    gen = torch.Generator().manual_seed(0)
    for v in (49152, 1000):
        p = torch.softmax(3 * torch.randn(1000, v, generator=gen), -1)
        p[:, ::7] = 0.0
        p = p / p.sum(-1, keepdim=True)
        u = torch.rand(1000, generator=gen, dtype=torch.float64)
        cdf = p.double().cumsum(-1)
        want = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(-1)
        assert torch.equal(inverse_cdf(p, u.numpy()), want)
        near_one = inverse_cdf(p, np.full(1000, 1 - 2**-53))
        assert bool((p[torch.arange(1000), near_one] > 0).all())
