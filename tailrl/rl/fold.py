"""A sum of n values that arrive in any order, added left to right in an order their keys decide.

Floating-point addition is not associative, so a sum whose bits must not depend on the order
its terms arrive in needs a fixed association. Here it is a left-to-right fold over the terms
sorted by (key, index). A term may arrive before the terms that precede it in that order; it
then waits (in the update, tailrl.rl.update, each waiting term is a policy-sized gradient
buffer), so the order should be close to the order terms arrive in.

The keys need not be known up front. A term's key comes to light when the term does (`reveal`,
or with `put`), and until then the caller may say how small it can still be (`floor` for every
term not yet revealed, `bound` for one): the update's key is a GRPO group's longest response,
whose length is known when the group finishes, and every unfinished response already has the
tokens it has so far. A term is added once it is provably next: every term before it in the
order is in, and every unrevealed one is bounded past it. So the order, and with it the bits,
is the one sorting all final keys gives, whatever the bounds were; bounds only decide how early
a term may be added. A bound that is not one (a revealed key below it) is refused: it could
have let a term in before this one, which would change the bits.

A term may be None (nothing to add: a group without tokens); `add(a, b)` combines two present
ones and may reuse a's storage.

Knows: the order, which terms may be added. Does not know: what the values are.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterable, TypeVar

T = TypeVar("T")


class OrderedFold(Generic[T]):
    """Terms 0..n-1 `put` in any order, each with its key; `result` once all are in: the left
    fold over (key, index), the same bits for every arrival order and every set of bounds."""

    def __init__(self, n: int, add: Callable[[T, T], T]):
        if n < 0:
            raise ValueError(f"a sum of {n} terms")
        self.n, self._add = n, add
        self._key: list[int | None] = [None] * n  # revealed keys
        self._bound = [0] * n  # a lower bound on each unrevealed key
        self._floor = 0  # one on every unrevealed key
        self._waiting: dict[int, T | None] = {}  # put, not yet added
        self._added: list[int] = []  # the terms added so far, in the fold's order
        self._in: set[int] = set()
        self._sum: T | None = None

    # ---- what is known of the order -----------------------------------------------------------

    def floor(self, at_least: int) -> None:
        """Every term not yet revealed has a key of at least `at_least`."""
        self._floor = max(self._floor, at_least)

    def bound(self, i: int, at_least: int) -> None:
        """Term i's key is at least `at_least`."""
        self._check(i)
        self._bound[i] = max(self._bound[i], at_least)

    def reveal(self, i: int, key: int) -> None:
        """Term i's key (before or when it is put)."""
        self._check(i)
        if self._key[i] is not None:
            if self._key[i] != key:
                raise ValueError(f"term {i} revealed with key {key} after {self._key[i]}")
            return
        if key < max(self._bound[i], self._floor):  # then it could come before a term added already
            raise RuntimeError(f"term {i}'s key {key} is below a bound it was given: the fold's order is broken")
        self._key[i] = key

    def _order(self, i: int) -> tuple[int, int]:
        """Term i's place: its key, or while unrevealed the least it can be; then its index."""
        key = self._key[i]
        return (key if key is not None else max(self._bound[i], self._floor), i)

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise ValueError(f"term {i} out of range for {self.n} terms")

    # ---- the sum --------------------------------------------------------------------------------

    def _next(self, waiting: Iterable[int]) -> list[int]:
        """The terms of `waiting` that are provably next, in the fold's order: the first term not
        yet added is revealed and waiting, then the first after it, and so on."""
        waiting, out = set(waiting), []
        rest = sorted((i for i in range(self.n) if i not in self._in), key=self._order)
        for i in rest:
            if i not in waiting or self._key[i] is None:
                break
            out.append(i)
        return out

    def put(self, i: int, key: int, value: T | None) -> list[int]:
        """Term i with its key; the terms this adds (i and those that waited for it), in order."""
        self._check(i)
        if i in self._waiting or i in self._in:
            raise ValueError(f"term {i} was put twice")
        self.reveal(i, key)
        self._waiting[i] = value
        added = self._next(self._waiting)
        for j in added:
            v = self._waiting.pop(j)
            self._sum = v if self._sum is None else self._sum if v is None else self._add(self._sum, v)
            self._in.add(j)
            self._added.append(j)
        return added

    @property
    def held_values(self) -> int:
        """Values waiting to be added, the running sum among them until the last term is in."""
        return (self._sum is not None and not self.done) + sum(v is not None for v in self._waiting.values())

    def held_values_after(self, i: int, present: bool) -> int:
        """held_values once term i (revealed) is put, a value if `present`, the terms it lets in added."""
        if self._key[i] is None:
            raise ValueError(f"term {i} is not revealed")
        added = set(self._next([*self._waiting, i]))
        present_now = {**{j: v is not None for j, v in self._waiting.items()}, i: present}
        has_sum = self._sum is not None or any(present_now[j] for j in added)
        done = len(self._in) + len(added) == self.n
        return (has_sum and not done) + sum(p for j, p in present_now.items() if j not in added)

    @property
    def added(self) -> list[int]:
        """The terms added so far, in the order they were added."""
        return list(self._added)

    @property
    def done(self) -> bool:
        return len(self._in) == self.n

    def result(self) -> T | None:
        """The sum (None where every term was None)."""
        if not self.done:
            raise RuntimeError(f"{self.n - len(self._in)} terms of {self.n} not added")
        return self._sum
