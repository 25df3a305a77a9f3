"""Peak resident memory of this process over a phase of work, as the kernel counts it.

Linux keeps a process's resident high-water mark (VmHWM in /proc/self/status) and resets it to
the current resident size when "5" is written to /proc/self/clear_refs, so a phase's peak is
read at its end after a reset at its start. Elsewhere (or where /proc is read-only) the peak is
unknown: `Peak.gb` is None then, never a guess.

Knows: /proc. Does not know: what the phases are.
"""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _high_water_kb() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Peak:
    """The resident peak from `start()` to `gb` (in GiB; None where the kernel cannot tell)."""

    def __init__(self) -> None:
        self._reset = False

    def start(self) -> Peak:
        try:
            _CLEAR_REFS.write_text("5")
            self._reset = True
        except OSError:
            self._reset = False
        return self

    @property
    def gb(self) -> float | None:
        kb = _high_water_kb() if self._reset else None
        return kb / 2**20 if kb is not None else None
