"""The n-gram drafter: what it proposes from the prompt, siblings and earlier responses, and that
every proposal is a valid tree of exactly num_draft_tokens nodes."""

from __future__ import annotations

import random

import pytest
import torch

from tailrl.speculative.ngram import NgramConfig, NgramIndex, propose_tree
from tailrl.speculative.tree import DraftTree


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def test_repeated_phrase_in_prompt_is_proposed_exactly():
    prompt = [5, 6, 7, 8, 9, 1, 2, 3, 10, 11, 5, 6, 7]
    index = NgramIndex()
    index.add(prompt)
    # The last "5 6 7" is the context's own end (nothing after it yet); the first one continues.
    assert index.propose(prompt, draft_depth=4, topk=1, num_draft_tokens=4) == ([8, 9, 1, 2], [-1, 0, 1, 2])


def test_sibling_continuation_is_proposed_and_branches_rank_by_frequency():
    prompt = [40, 41, 42]
    index = NgramIndex()
    index.add(prompt)
    for tail in ([5, 6, 7], [9, 9, 9], [5, 6, 7], [5, 6, 8]):
        index.add([1, 2, 3, 4] + tail)
    row = index.add([1, 2, 3])  # the drafted row is a sibling too; its own end has no continuation
    context = prompt + [1, 2, 3]
    # "4 5 6 7" twice beats the more recent "4 5 6 8" once.
    assert index.propose(context, 4, 1, 4) == ([4, 5, 6, 7], [-1, 0, 1, 2])
    # Best-first with two branches per node: 4 (x4), 5 (x3), 6 (x3), 7 (x2), then the count-1
    # nodes, most recent first: 8 (last sibling) before the "9 9 9" branch.
    assert index.propose(context, 4, 2, 8) == ([4, 5, 6, 7, 8, 9, 9, 9], [-1, 0, 1, 2, 2, 0, 5, 6])
    # The row grows; the longer context now matches "2 3 4 5" in three siblings.
    index.extend(row, [4, 5])
    assert index.propose(context + [4, 5], 2, 1, 2) == ([6, 7], [-1, 0])


def test_topk_caps_the_branching():
    index = NgramIndex()
    for k in range(10):
        index.add([1, 2, 3, 10 + k, 20 + k])
    # Equal counts: the most recent continuations, each kept whole before the next is started.
    assert index.propose([1, 2, 3], 2, 3, 6) == ([19, 29, 18, 28, 17, 27], [-1, 0, -1, 2, -1, 4])


def test_longer_match_beats_more_frequent_shorter_match():
    index = NgramIndex(NgramConfig(max_n=3))
    index.add([1, 2, 3, 50])  # "1 2 3" -> 50 once
    index.add([7, 3, 60, 8, 3, 60, 9, 3, 60])  # "3" -> 60 three times (only a 1- or 2-gram match)
    assert index.propose([1, 2, 3], 1, 2, 2) == ([50, 60], [-1, -1])


def test_more_recent_response_wins_a_tie():
    index = NgramIndex()
    index.add([1, 2, 3, 10, 11])  # an earlier step's response
    index.add([1, 2, 3, 20, 21])  # this step's sibling
    assert index.propose([0, 1, 2, 3], 2, 1, 2) == ([20, 21], [-1, 0])


def test_incremental_appends_equal_one_bulk_add():
    rng = random.Random(0)
    seqs = [[rng.randrange(6) for _ in range(60)] for _ in range(3)]
    bulk, grown = NgramIndex(), NgramIndex()
    for s in seqs:
        bulk.add(s)
        sid = grown.add(s[:1])
        for start in range(1, 60, 7):  # n-grams spanning chunk boundaries must be indexed too
            grown.extend(sid, s[start : start + 7])
    for _ in range(30):
        ctx = [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        assert bulk.propose(ctx, 3, 2, 6) == grown.propose(ctx, 3, 2, 6)


def test_no_match_is_padded_to_a_valid_tree():
    index = NgramIndex()
    index.add([1, 2, 3])
    tokens, parents = index.propose([7, 8, 9], draft_depth=3, topk=2, num_draft_tokens=5)
    # A chain repeating the last token up to draft_depth, then duplicates under the root.
    assert tokens == [9, 9, 9, 9, 9]
    assert parents == [-1, 0, 1, -1, -1]
    assert NgramIndex().propose([4], 2, 2, 0) == ([], [])
    with pytest.raises(ValueError):
        index.propose([], 2, 2, 3)


def test_short_continuation_is_padded_after_the_real_nodes():
    index = NgramIndex()
    index.add([1, 2, 3, 4])  # only "4" follows "3"
    tokens, parents = index.propose([0, 2, 3], draft_depth=4, topk=1, num_draft_tokens=4)
    assert tokens == [4, 3, 3, 3]
    assert parents == [-1, -1, 1, 2]  # the padding chain hangs from the root, beside the real node


@pytest.mark.parametrize("draft_depth, topk, n", [(1, 1, 3), (3, 2, 6), (5, 3, 16), (4, 1, 4)])
def test_random_proposals_are_valid_trees(draft_depth, topk, n):
    rng = random.Random(draft_depth * 10 + n)
    index = NgramIndex()
    for _ in range(4):
        index.add([rng.randrange(8) for _ in range(rng.randint(0, 80))])
    for _ in range(50):
        ctx = [rng.randrange(10) for _ in range(rng.randint(1, 8))]
        tokens, parents = index.propose(ctx, draft_depth, topk, n)
        assert len(tokens) == len(parents) == n
        assert all(-1 <= p < i for i, p in enumerate(parents))
        assert max(depths(parents), default=0) <= draft_depth


def test_propose_tree_batches_rows_from_their_own_groups():
    a, b = NgramIndex(), NgramIndex()
    a.add([1, 2, 3, 4, 5])
    b.add([1, 2, 3, 9, 9])
    tree = propose_tree([a, b, a], [[1, 2, 3], [1, 2, 3], [7]], draft_depth=2, topk=1, num_draft_tokens=3)
    assert isinstance(tree, DraftTree)
    assert tree.tokens.dtype == torch.long and tree.tokens.shape == (3, 3)
    assert tree.tokens.tolist() == [[4, 5, 3], [9, 9, 3], [7, 7, 7]]
    assert tree.parents.tolist() == [[-1, 0, -1], [-1, 0, -1], [-1, 0, -1]]
