"""A sum of n values that arrive in any order, added along a fixed binary tree.

Floating-point addition is not associative, so a sum whose bits must not depend on the order
its terms arrive in needs a fixed association. A left-to-right fold has one (term i is added
once terms 0..i-1 are), but every term that arrives before an earlier one must wait: up to n - 1
of them at once (term 0 last). A fixed binary tree over [0, n) (each range [lo, hi) the sum of
[lo, mid) and [mid, hi), mid - lo the largest power of two below hi - lo) adds two subtrees as
soon as both are complete, so fewer wait: at most `most_held(n)` = ceil(n / 2) (every other
term first), and over random orders of 16 terms 7.2 at the worst moment on average, against
11.5 for the fold in order (tests/test_fold.py). In the update (tailrl.rl.update) each is a
policy-sized gradient buffer.

Where the order terms arrive in can be guessed before the first one does (`keys`: a term with a
smaller key tends to arrive earlier), the terms are summed in the guessed order: a left-to-right
fold over the terms sorted by (key, index), ties broken by index. Then the waiting ones are only
those that arrive before a term guessed earlier, and terms put in the summing order (the update
after its rollout) keep the running sum alone waiting; a balanced tree over each tie would wait
less while ties arrive in any order, but hold log2 of the tie's size in partial sums even in
order (docs/memory.md). The guess decides the bits, so it must be fixed before any term is put (the update's:
each GRPO group's prompt length, which in the default task predicts its longest response, hence
when it finishes, with correlation 0.96; docs/memory.md). Without keys the tree is the balanced
one.

A term may be None (nothing to add: a group without tokens); `add(a, b)` combines two present
ones and may reuse a's storage (a + b == b + a in IEEE arithmetic, so only the tree's shape
decides the bits).

Knows: the tree. Does not know: what the values are.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


def most_held(n: int) -> int:
    """The most partial sums a TreeSum over n terms holds waiting at once, over every arrival order."""
    return n // 2 + n % 2 if n >= 2 else 0


def _split(lo: int, hi: int) -> int:
    """The tree's cut of [lo, hi) (hi - lo >= 2): the left part the largest power of two below its size."""
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


class TreeSum(Generic[T]):
    """Terms 0..n-1 `put` in any order; `result` once all are in: the same bits for every order.

    Nodes are ranges of positions in the summing order: term i at position `position[i]` (the
    terms sorted by (key, index); without keys, i)."""

    def __init__(self, n: int, add: Callable[[T, T], T], keys: Sequence[Any] | None = None):
        if n < 0:
            raise ValueError(f"a sum of {n} terms")
        if keys is not None and len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} terms")
        self.n, self._add = n, add
        order = sorted(range(n), key=lambda i: (keys[i], i)) if keys is not None else list(range(n))
        self.position = [0] * n
        for at, i in enumerate(order):
            self.position[i] = at
        self._parent: dict[tuple[int, int], tuple[int, int]] = {}
        self._sibling: dict[tuple[int, int], tuple[int, int]] = {}
        if keys is not None:
            for at in range(1, n):
                self._join((0, at), (at, at + 1))  # the fold: the terms before `at`, then this one
        stack = [(0, n)] if keys is None else []
        while stack:
            lo, hi = stack.pop()
            if hi - lo < 2:
                continue
            mid = _split(lo, hi)
            self._join((lo, mid), (mid, hi))
            stack += [(lo, mid), (mid, hi)]
        self._held: dict[tuple[int, int], T | None] = {}  # complete subtrees whose sibling is not
        self._done = n == 0  # an empty sum: None
        self._result: T | None = None

    def _join(self, left: tuple[int, int], right: tuple[int, int]) -> None:
        self._parent[left] = self._parent[right] = (left[0], right[1])
        self._sibling[left], self._sibling[right] = right, left

    @property
    def held(self) -> int:
        """Partial sums waiting for their sibling subtree."""
        return len(self._held)

    @property
    def held_values(self) -> int:
        """Partial sums waiting that hold a value (a subtree of None terms holds nothing)."""
        return sum(v is not None for v in self._held.values())

    def held_values_after(self, i: int, present: bool) -> int:
        """held_values once term i is put (a value if `present`, else None), the sums it completes
        added: whether putting it now makes a value wait, or lets one go."""
        at = self.position[i]
        node, waiting = (at, at + 1), self.held_values
        while node != (0, self.n):
            sibling = self._sibling[node]
            if sibling not in self._held:
                return waiting + present
            other = self._held[sibling] is not None
            waiting -= other
            present = present or other
            node = self._parent[node]
        return waiting

    def put(self, i: int, value: T | None) -> None:
        if not 0 <= i < self.n:
            raise ValueError(f"term {i} out of range for {self.n} terms")
        at = self.position[i]
        node = (at, at + 1)
        if node in self._held or self._done or any(lo <= at < hi for lo, hi in self._held):
            raise ValueError(f"term {i} was put twice")
        while node != (0, self.n):
            sibling = self._sibling[node]
            if sibling not in self._held:
                self._held[node] = value
                return
            other = self._held.pop(sibling)
            left, right = (value, other) if node < sibling else (other, value)
            value = left if right is None else right if left is None else self._add(left, right)
            node = self._parent[node]
        self._done, self._result = True, value

    @property
    def done(self) -> bool:
        return self._done

    def result(self) -> T | None:
        """The sum (None where every term was None)."""
        if not self._done:
            raise RuntimeError(f"{self.n - sum(hi - lo for lo, hi in self._held)} terms of {self.n} not put")
        return self._result
