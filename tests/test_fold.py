"""The fixed-tree sum: its association by hand, the same bits in every arrival order, at most
ceil(n / 2) partial sums waiting, fewer than a fold in order on average; and a lazily zeroed
tensor is zeros, resident only as written, and a piece of it released is zeros and not resident
again: the engine releases every cache slot its sequences leave, without changing a token."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tailrl import memory
from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model
from tailrl.memory import lazy_zeros
from tailrl.records import Request
from tailrl.rl.fold import TreeSum, most_held
from tailrl.sampling import SamplingParams


def _trace(n: int, order, keys=None) -> tuple[str, int]:
    """The sum as a string of its association, and the most partial sums held at once."""
    tree: TreeSum[str] = TreeSum(n, lambda a, b: f"({a}+{b})", keys)
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


def test_a_keyed_sum_folds_over_ascending_keys_ties_by_term():
    keys = [5, 1, 1, 3, 9, 1]  # by (key, term): 1, 2, 5 (tied), 3, 0, 4
    want = "(((((1+2)+5)+3)+0)+4)"
    assert all(_trace(6, order, keys)[0] == want for order in itertools.permutations(range(6)))
    # All tied: a fold by term, where no keys give the balanced tree.
    assert _trace(4, range(4), [7] * 4)[0] == "(((0+1)+2)+3)" and _trace(4, range(4))[0] == "((0+1)+(2+3))"
    # Ties put in the summing order keep the running sum alone waiting (a balanced tree over
    # four ties holds two partial sums in that order).
    assert _trace(4, range(4), [7] * 4)[1] == 1 and _trace(4, range(4))[1] == 2
    # Terms arriving in the keys' order never wait but the running sum: one partial sum held.
    assert _trace(6, sorted(range(6), key=lambda i: (keys[i], i)), keys)[1] == 1
    with pytest.raises(ValueError, match="2 keys for 3 terms"):
        TreeSum(3, lambda a, b: a, [1, 2])


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


def _anonymous_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))


def test_a_released_piece_reads_zeros_and_is_no_longer_resident():
    t = lazy_zeros((64, 3, 2048, 64), torch.float32)  # slots of 1.5 MiB, whole pages
    t[0].fill_(1.0)
    t[1].fill_(2.0)
    before = _anonymous_kb()  # (Rss counts files too: loading libc for madvise maps some)
    assert memory.release(t[0]) == 3 * 2048 * 64 * 4
    assert before - _anonymous_kb() >= 1536 - 64, before - _anonymous_kb()
    assert t[0].abs().sum().item() == 0.0 and t[1].sum().item() == 2.0 * 3 * 2048 * 64
    t[0, 0, 0, 0] = 5.0  # written again: an ordinary page
    assert t[0].sum().item() == 5.0
    # A piece that is not whole pages reads zeros too (its partial pages zeroed by hand).
    assert memory.release(t[1, 0, :3]) == 0 and t[1, 0, :3].abs().sum().item() == 0.0 and t[1, 0, 3].sum() == 128.0
    # Only lazy_zeros' own mappings: any other tensor is left as it is.
    other = torch.ones(1 << 20)
    assert memory.release(other) == 0 and other.sum().item() == 1 << 20
    assert not memory.is_lazy(other) and memory.is_lazy(t[5])


def test_the_engine_hands_back_every_slot_its_sequences_leave_without_changing_a_token(tiny_dir, monkeypatch):
    tiny = load_model(tiny_dir, dtype="fp32")
    requests = [Request((3 + i, 7, 11 + i % 3), seed=100 + i, group=i // 2) for i in range(10)]
    params = SamplingParams(temperature=1.0)
    engine = Engine(tiny, EngineConfig(max_batch=4, exact=True))  # slots refilled as sequences leave
    released = engine.generate(requests, params, 40)
    # Every slot was left last by a finished sequence, and handed back: the whole cache reads zeros.
    assert all(kv.abs().sum().item() == 0.0 for kv in (*engine.cache.k, *engine.cache.v))
    monkeypatch.setattr(memory, "release", lambda t: 0)
    kept = Engine(tiny, EngineConfig(max_batch=4, exact=True)).generate(requests, params, 40)
    assert [(c.token_ids, c.logprobs) for c in released] == [(c.token_ids, c.logprobs) for c in kept]
