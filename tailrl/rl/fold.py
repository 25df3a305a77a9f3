"""The order a sum of n terms is added in, left to right, when the terms arrive in any order.

Floating-point addition is not associative, so a sum whose bits must not depend on the order
its terms arrive in needs a fixed association. Here it is a left-to-right fold over the terms
sorted by (key, index). A term may arrive before the terms that precede it in that order; it
then waits (in the update, tailrl.rl.update, each waiting term holds policy-sized gradient
buffers), so the order should be close to the order terms arrive in.

The keys need not be known up front. A term's key comes to light when the term does (`reveal`,
or with `put`), and until then the caller may say how small it can still be (`floor` for every
term not yet revealed, `bound` for one): the update's key is a GRPO group's longest response,
whose length is known when the group finishes, and every unfinished response already has the
tokens it has so far. A term is added once it is provably next (`is_next`): every term before it
in the order is in, and every unrevealed one is bounded past it. So the order, and with it the
bits, is the one sorting all final keys gives, whatever the bounds were; bounds only decide how
early a term may be added. A bound that is not one (a revealed key below it) is refused: it
could have let a term in before this one, which would change the bits.

`OrderedFold` holds no values: `put` says which terms are added now, in order, and the caller
adds them. It counts what waits: each term put with the buffers it holds until it is added (0: a
term with nothing to add, or one the caller added into the sum itself because it was next),
and the running sum once it holds anything.

Knows: the order, which terms may be added, what waits. Does not know: what the values are.
"""

from __future__ import annotations

from typing import Iterable


class OrderedFold:
    """Terms 0..n-1 `put` in any order, each with its key; the left fold over (key, index)."""

    def __init__(self, n: int):
        if n < 0:
            raise ValueError(f"a sum of {n} terms")
        self.n = n
        self._key: list[int | None] = [None] * n  # revealed keys
        self._bound = [0] * n  # a lower bound on each unrevealed key
        self._floor = 0  # one on every unrevealed key
        self._waiting: dict[int, int] = {}  # put, not yet added: the buffers each holds
        self._added: list[int] = []  # the terms added so far, in the fold's order
        self._in: set[int] = set()
        self._sum = False  # the running sum holds a value

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
        for i in sorted((i for i in range(self.n) if i not in self._in), key=self._order):
            if i not in waiting or self._key[i] is None:
                break
            out.append(i)
        return out

    def is_next(self, i: int) -> bool:
        """Whether term i (revealed, not yet put) is next once the waiting terms that are next
        now are added (`settle`): put now, it would be added at once."""
        return i in self._next([*self._waiting, i])

    def settle(self) -> list[int]:
        """Add the waiting terms that are next now (bounds may have risen since they were put);
        they are returned in order: the caller adds them."""
        added = self._next(self._waiting)
        for j in added:
            buffers = self._waiting.pop(j)
            self._sum = self._sum or buffers > 0
            self._in.add(j)
            self._added.append(j)
        return added

    def put(self, i: int, key: int, buffers: int, in_sum: bool = False) -> list[int]:
        """Term i with its key and the buffers it holds until it is added (in_sum: none, the
        caller added it into the sum itself, as it was next); the terms this adds (i and those
        that waited for it), in order: the caller adds them."""
        self._check(i)
        if i in self._waiting or i in self._in:
            raise ValueError(f"term {i} was put twice")
        self.reveal(i, key)
        self._waiting[i] = buffers
        self._sum = self._sum or in_sum
        return self.settle()

    @property
    def held(self) -> int:
        """Buffers waiting to be added, the running sum among them until the last term is in."""
        return (self._sum and not self.done) + sum(self._waiting.values())

    def held_after(self, i: int, buffers: int, into_sum: bool = False) -> int:
        """`held` once term i (revealed) is put with `buffers`, the terms it lets in added;
        into_sum: i adds itself to the sum as it is computed (it is next), so nothing of it waits."""
        if self._key[i] is None:
            raise ValueError(f"term {i} is not revealed")
        waiting = {**self._waiting, i: buffers}
        added = self._next(waiting)
        has_sum = self._sum or into_sum or any(waiting[j] > 0 for j in added)
        done = len(self._in) + len(added) == self.n
        return (has_sum and not done) + sum(b for j, b in waiting.items() if j not in added)

    @property
    def added(self) -> list[int]:
        """The terms added so far, in the order they were added."""
        return list(self._added)

    @property
    def done(self) -> bool:
        return len(self._in) == self.n
