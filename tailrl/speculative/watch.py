"""Whether a new drafter version collapsed: its acceptance against the last good version's.

A drafter trained during RL goes live as a new version every step; one that collapses (its
drafts rejected at the first token, so speculating costs a verify per emitted token) makes the
rollout slower than plain decoding, silently. Each version's verifies are tallied per draft shape
(the arm's label: a drafter arm, or vLLM's draft length): how many verifies, and how many
accepted the first draft token. A version is judged against the last good one on the shapes
both drafted with, its verifies weighting each shape, so an arm mix that changed between the
two steps is not mistaken for a change in the drafter.

The test, one-sided. Let n_s, k_s be the new version's verifies and first-token acceptances on
shape s, m_s and j_s the reference's, N = sum n_s, K = sum k_s, L = ln(1 / alpha). The version
collapsed when

    K < ratio * sum_s n_s * max(0, j_s / m_s - sqrt(L / (2 m_s))) - sqrt(N L / 2)

False alarms: if on every shape the version's true acceptance is at least `ratio` times the
reference's, each reference rate lowered by its Hoeffding margin is below its true value with
probability >= 1 - alpha, and then K falls below its lowest expectation by sqrt(N L / 2) with
probability <= alpha (Hoeffding again), so an alarm has probability <= (shapes + 1) * alpha,
verifies taken as independent. Verifies of one sequence are not (a predictable stretch accepts
verify after verify), which widens K's real spread; `ratio` well below 1 is the margin for that,
and for the policy moving between two versions' steps. With the defaults (ratio 0.5, alpha 1e-6)
a drafter whose first token is never accepted, against a reference that accepted 60% of 500
verifies, is called collapsed once it has made 120-160 verifies (a rollout's tail makes thousands).

A version that has made at least `min_verifies` verifies on shared shapes without collapsing is
trusted: it becomes the reference for the next one.

Knows: counts, the bound. Does not know: torch, drafters, engines, what a shape is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Tally:
    """Verifies of one draft shape, and how many of them accepted the first draft token."""

    verifies: int = 0
    accepted: int = 0

    def add(self, verifies: int, accepted: int) -> None:
        if not 0 <= accepted <= verifies:
            raise ValueError(f"accepted must be in [0, verifies], got {accepted} of {verifies}")
        self.verifies += verifies
        self.accepted += accepted


Tallies = dict[str, Tally]  # by draft shape


def add_tallies(into: Tallies, more: Tallies) -> None:
    for shape, t in more.items():
        into.setdefault(shape, Tally()).add(t.verifies, t.accepted)


@dataclass(frozen=True)
class WatchConfig:
    """The collapse test's settings (module doc)."""

    ratio: float = 0.5
    alpha: float = 1e-6
    min_verifies: int = 100

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0 or not 0.0 < self.alpha < 1.0 or self.min_verifies < 1:
            raise ValueError(f"ratio must be in (0, 1], alpha in (0, 1) and min_verifies >= 1, got {self.ratio}, "
                             f"{self.alpha} and {self.min_verifies}")


@dataclass(frozen=True)
class Verdict:
    collapsed: bool
    trusted: bool  # made min_verifies verifies on shared shapes without collapsing
    verifies: int  # the version's, on shapes the reference drafted with too
    rate: float | None  # its first-token acceptance there
    reference_rate: float | None  # the reference's on those shapes, weighted by the version's verifies


def judge(version: Tallies, reference: Tallies, cfg: WatchConfig = WatchConfig()) -> Verdict:
    """The version's verdict against the reference's tallies (module doc)."""
    shared = [s for s, t in version.items() if t.verifies and s in reference and reference[s].verifies]
    n = sum(version[s].verifies for s in shared)
    if n == 0:
        return Verdict(False, False, 0, None, None)
    k = sum(version[s].accepted for s in shared)
    log = math.log(1.0 / cfg.alpha)
    lowest = 0.0  # the reference's rates at the bottom of their margins, weighted by the version's verifies
    weighted = 0.0
    for s in shared:
        ref = reference[s]
        rate = ref.accepted / ref.verifies
        lowest += version[s].verifies * max(0.0, rate - math.sqrt(log / (2 * ref.verifies)))
        weighted += version[s].verifies * rate
    collapsed = k < cfg.ratio * lowest - math.sqrt(n * log / 2)
    return Verdict(collapsed, not collapsed and n >= cfg.min_verifies, n, k / n, weighted / n)


@dataclass
class VersionWatch:
    """The tallies of the reference (the last trusted version) and of the version drafting now."""

    cfg: WatchConfig = field(default_factory=WatchConfig)
    reference: int = 0  # the loaded drafter is trusted until a version earns the place
    reference_tallies: Tallies = field(default_factory=dict)
    current: int = 0
    current_tallies: Tallies = field(default_factory=dict)

    def record(self, version: int, tallies: Tallies) -> None:
        """A rollout drafted with `version`, with these tallies."""
        if version != self.current:
            raise ValueError(f"tallies of drafter version {version}, but version {self.current} is drafting")
        add_tallies(self.reference_tallies if version == self.reference else self.current_tallies, tallies)

    def verdict(self) -> Verdict | None:
        """The drafting version's verdict so far; None while the reference itself drafts."""
        if self.current == self.reference:
            return None
        return judge(self.current_tallies, self.reference_tallies, self.cfg)

    def promote(self) -> None:
        """The drafting version becomes the reference (its verdict said trusted)."""
        self.reference, self.reference_tallies = self.current, self.current_tallies
        self.current_tallies = {}

    def drafting(self, version: int) -> None:
        """From now on `version` drafts (the reference itself, or a new version to judge)."""
        if version != self.current:
            self.current, self.current_tallies = version, {}

    def state_dict(self) -> dict[str, object]:
        def plain(t: Tallies) -> dict[str, list[int]]:
            return {s: [x.verifies, x.accepted] for s, x in t.items()}

        return {"reference": self.reference, "reference_tallies": plain(self.reference_tallies),
                "current": self.current, "current_tallies": plain(self.current_tallies)}

    def load_state_dict(self, state: dict) -> None:
        self.reference, self.current = int(state["reference"]), int(state["current"])
        self.reference_tallies = {s: Tally(*x) for s, x in state["reference_tallies"].items()}
        self.current_tallies = {s: Tally(*x) for s, x in state["current_tallies"].items()}
