"""When a drafter's warm-up lowers its learning rate and when it stops, from held-out acceptance.

A fixed step count at a constant rate either stops while acceptance still rises (a constant rate
leaves the last part of the fit undone: it keeps stepping over the minimum) or spends minutes
after it has stopped rising. So the warm-up measures the replayed accept_len on held-out
responses every so many steps and feeds it here: while it rises (by more than `min_gain` over
the best so far) the rate stays; after `patience` measurements without such progress, the rate
drops by `factor` and training goes on from there; after the last drop, the next `patience`
measurements without progress end training. The caller keeps the weights of the best
measurement (a later one may only be noise below it).

Knows: a score sequence and the rules above. Does not know: what is trained or how it is scored.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Plateau:
    """The rate's scale and the stop, after each held-out measurement (`observe`)."""

    patience: int  # measurements without progress before a drop, or after the last drop the stop
    drops: int  # rate drops before training may stop
    factor: float  # the rate's scale is multiplied by this at each drop
    min_gain: float  # a measurement is progress when it beats the best by more than this
    best: float = float("-inf")
    best_step: int = 0
    scale: float = 1.0
    dropped: int = 0
    stalled: int = 0  # measurements since the last best or drop
    done: bool = False

    def __post_init__(self) -> None:
        if self.patience < 1 or self.drops < 0 or not 0.0 < self.factor < 1.0 or self.min_gain < 0:
            raise ValueError(f"need patience >= 1, drops >= 0, 0 < factor < 1 and min_gain >= 0, got {self.patience}, "
                             f"{self.drops}, {self.factor} and {self.min_gain}")

    def observe(self, step: int, score: float) -> bool:
        """Take the measurement at `step`; True when it is the best so far (the caller keeps its
        weights). Only a gain of more than min_gain counts as progress against the plateau."""
        progress = score > self.best + self.min_gain
        best = score > self.best
        if best:
            self.best, self.best_step = score, step
        if progress:
            self.stalled = 0
            return best
        self.stalled += 1
        if self.stalled >= self.patience:
            if self.dropped < self.drops:
                self.dropped, self.scale, self.stalled = self.dropped + 1, self.scale * self.factor, 0
            else:
                self.done = True
        return best
