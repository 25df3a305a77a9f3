"""The ordered fold: its order by hand, the same in every arrival order and with any true
bounds, terms let in early by bounds, what a put leaves waiting; and a lazily zeroed
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
from tailrl.rl.fold import OrderedFold
from tailrl.sampling import SamplingParams


def _trace(keys, order, floors=None) -> tuple[list[int], int]:
    """The order the terms were added in, and the most buffers held at once (each term put with
    one). Terms are revealed, then put, in `order`; floors[n], where given, raises every
    unrevealed key's bound between the n-th term's reveal and its put (as the update's floor
    rises while a group is scored)."""
    fold = OrderedFold(len(keys))
    most = 0
    for n, i in enumerate(order):
        fold.reveal(i, keys[i])
        if floors and n in floors:
            fold.floor(floors[n])
        fold.put(i, keys[i], 1)
        most = max(most, fold.held)
    assert fold.done
    return fold.added, most


def _true_floors(keys, order) -> dict[int, int]:
    """After each reveal, the least key still unrevealed: the best bound a caller can give."""
    return {n: min(keys[i] for i in order[n + 1 :]) for n in range(len(order) - 1)}


def test_the_fold_by_hand_over_ascending_keys_ties_by_term():
    keys = [5, 1, 1, 3, 9, 1]  # by (key, term): 1, 2, 5 (tied), 3, 0, 4
    assert all(_trace(keys, order)[0] == [1, 2, 5, 3, 0, 4] for order in itertools.permutations(range(6)))
    # Unbounded, a term waits for every unrevealed one (any could come first): arriving in the
    # order, all but the last wait.
    assert _trace(keys, [1, 2, 5, 3, 0, 4])[1] == 5
    # With true bounds and distinct keys, terms arriving in the order never wait: only the sum does.
    keys = [5, 1, 2, 3, 9, 4]
    order = sorted(range(6), key=lambda i: keys[i])
    assert _trace(keys, order, _true_floors(keys, order)) == (order, 1)


def test_floors_let_terms_in_early_and_never_change_the_order():
    keys = [30, 10, 20, 10, 40]
    want = [1, 3, 2, 0, 4]
    assert _trace(keys, [1, 3, 2, 0, 4]) == (want, 4)  # unbounded: every term waits
    # Every unrevealed key at least 11 once 3 is revealed: 1 and 3 (10, ties by term) are next;
    # at least 25 once 2 is: 2 is next too; at least 31 once 0 is: 0 too. Only the sum waits.
    assert _trace(keys, [1, 3, 2, 0, 4], floors={1: 11, 2: 25, 3: 31}) == (want, 1)
    assert _trace(keys, [1, 3, 2, 0, 4], floors={1: 11, 2: 25}) == (want, 2)  # 0 waits for 4's reveal
    # Any order, with true bounds or none: the same order.
    rng = random.Random(0)
    for _ in range(200):
        order = list(range(5))
        rng.shuffle(order)
        floors = {n: f for n, f in _true_floors(keys, order).items() if rng.random() < 0.5}
        assert _trace(keys, order, floors)[0] == want, (order, floors)


def test_a_waiting_term_is_added_once_a_bound_shows_it_next():
    fold = OrderedFold(3)
    assert fold.put(1, 10, 2) == []  # two buffers (micro-batches), waiting: 0 or 2 could come first
    assert fold.held == 2 and not fold.is_next(0)
    fold.reveal(0, 12)
    fold.floor(13)  # 2, unrevealed, comes after 0
    assert fold.is_next(0)  # 1 is next now, and 0 after it
    assert fold.settle() == [1] and fold.held == 1  # its buffers are the sum now
    assert fold.put(0, 12, 0, in_sum=True) == [0] and fold.held == 1  # added into the sum as it was computed
    assert fold.put(2, 30, 1) == [2] and fold.held == 0 and fold.added == [1, 0, 2]


def test_held_after_is_what_a_put_leaves_waiting():
    fold = OrderedFold(4)
    for i, key in enumerate([7, 3, 5, 9]):
        fold.reveal(i, key)  # the order: 1, 2, 0, 3
    assert fold.held_after(0, 2) == 2  # its two buffers wait for 1 and 2
    assert fold.held_after(1, 0, into_sum=True) == 1  # next, into the sum: the sum alone
    assert fold.held_after(1, 0) == 0  # next, with nothing to add: nothing at all
    fold.put(2, 5, 1)
    assert fold.held == 1 and fold.held_after(1, 0, into_sum=True) == 1  # 1 lets 2 in: the sum
    assert fold.held_after(1, 0) == 1  # no value of its own: 2's buffer becomes the sum
    fold.put(1, 3, 0, in_sum=True)
    assert fold.added == [1, 2] and fold.held == 1
    fold.put(0, 7, 0)
    assert fold.held_after(3, 1) == 0  # the last: the sum is done, nothing waits
    assert fold.put(3, 9, 1) == [3] and fold.added == [1, 2, 0, 3] and fold.done


def test_misuse_is_refused():
    fold = OrderedFold(4)
    fold.put(1, 5, 1)
    with pytest.raises(ValueError, match="put twice"):
        fold.put(1, 5, 1)
    with pytest.raises(ValueError, match="out of range"):
        fold.put(4, 0, 1)
    with pytest.raises(ValueError, match="revealed with key 6 after 5"):
        fold.reveal(1, 6)
    with pytest.raises(ValueError, match="not revealed"):
        fold.held_after(0, 1)
    fold.bound(0, 8)
    with pytest.raises(RuntimeError, match="below a bound"):
        fold.put(0, 7, 1)  # a bound that was not one would change the order
    fold.put(2, 1, 1)
    fold.floor(6)
    fold.put(0, 8, 1)  # 2 and 1 are in (3 is at least 6), 0 waits for 3
    assert fold.added == [2, 1] and fold.held == 2
    with pytest.raises(RuntimeError, match="below a bound"):
        fold.reveal(3, 5)  # it would have come before 1, which is in
    assert not fold.done and OrderedFold(0).done


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
