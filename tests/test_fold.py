"""The fixed-tree sum: its association by hand, the same bits in every arrival order, at most
ceil(n / 2) partial sums waiting, fewer than a fold in order on average; and a lazily zeroed
tensor is zeros, resident only as written."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tailrl.memory import lazy_zeros
from tailrl.rl.fold import TreeSum, most_held


def _trace(n: int, order) -> tuple[str, int]:
    """The sum as a string of its association, and the most partial sums held at once."""
    tree: TreeSum[str] = TreeSum(n, lambda a, b: f"({a}+{b})")
    most = 0
    for i in order:
        tree.put(i, str(i))
        most = max(most, tree.held)
    return tree.result(), most


def test_the_tree_by_hand():
    # [0, 5): the left part the largest power of two below 5 (4), then [0, 4) halves.
    assert _trace(5, range(5))[0] == "(((0+1)+(2+3))+4)"
    assert _trace(3, [2, 1, 0])[0] == "((0+1)+2)"
    assert _trace(1, [0])[0] == "0"
    assert _trace(6, range(6))[0] == "(((0+1)+(2+3))+(4+5))"


@pytest.mark.parametrize("n", range(1, 8))
def test_every_order_gives_the_same_association_and_holds_at_most_ceil_half_n(n):
    want = _trace(n, range(n))[0]
    worst = 0
    for order in itertools.permutations(range(n)):
        got, most = _trace(n, order)
        assert got == want, order
        worst = max(worst, most)
    assert worst == most_held(n)  # reached by some order, passed by none
    assert most_held(n) == {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 6: 3, 7: 4}[n]


def _held_in_order(order) -> int:
    """The most buffers a fold in group order holds waiting (finished, not yet added)."""
    done, head, most = set(), 0, 0
    for i in order:
        done.add(i)
        while head in done:
            done.discard(head)
            head += 1
        most = max(most, len(done))
    return most


def test_sixteen_groups_wait_less_than_in_a_fold_in_order():
    order = [*range(1, 16), 0]  # a fold in order's worst: group 0 last, 15 waiting
    assert _held_in_order(order) == 15 and _trace(16, order)[1] == 6  # 1, [2, 4), [4, 8), [8, 12), [12, 14), 14
    rng, tree, fold = random.Random(0), 0, 0
    for _ in range(2000):
        rng.shuffle(order)
        tree += _trace(16, order)[1]
        fold += _held_in_order(order)
    assert 7.0 < tree / 2000 < 7.4 and 11.3 < fold / 2000 < 11.7  # 7.2 and 11.5 over 20,000 orders


def test_tensor_bits_do_not_depend_on_the_order_and_none_adds_nothing():
    rng = torch.Generator().manual_seed(0)
    terms = [torch.randn(7, generator=rng) * 10.0 ** k for k in range(-3, 4)]  # spread exponents: order matters
    terms[2] = None

    def total(order):
        tree = TreeSum(len(terms), lambda a, b: a.add_(b))
        for i in order:
            tree.put(i, None if terms[i] is None else terms[i].clone())
        return tree.result()

    want = (((terms[0] + terms[1]) + terms[3]) + ((terms[4] + terms[5]) + terms[6]))  # the tree of 7, term 2 absent
    for seed in range(10):
        order = list(range(len(terms)))
        random.Random(seed).shuffle(order)
        assert torch.equal(total(order), want), order


def test_misuse_is_refused():
    tree = TreeSum(4, lambda a, b: a + b)
    tree.put(1, 1)
    tree.put(0, 2)  # [0, 2) complete
    with pytest.raises(ValueError, match="put twice"):
        tree.put(1, 3)
    with pytest.raises(ValueError, match="out of range"):
        tree.put(4, 3)
    with pytest.raises(RuntimeError, match="2 terms of 4 not put"):
        tree.result()
    assert TreeSum(0, lambda a, b: a + b).result() is None


def _rss_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Rss:"))


def test_lazy_zeros_are_zeros_resident_only_where_written():
    t = lazy_zeros((64, 3, 2048, 64), torch.float32)  # 96 MiB
    assert t.dtype == torch.float32 and t.shape == (64, 3, 2048, 64) and t.is_contiguous()
    before = _rss_kb()
    assert t.sum().item() == 0.0  # read whole: the kernel's zero page, nothing resident
    t[0].fill_(1.0)  # one slot written: 3 x 2048 x 64 x 4 bytes = 1.5 MiB
    grown = _rss_kb() - before
    assert 1536 <= grown < 8 * 1024, grown
    assert t.sum().item() == 3 * 2048 * 64
    assert lazy_zeros((2, 3), torch.bfloat16).tolist() == [[0.0] * 3] * 2
