"""Check the module-size budget: every module under tailrl/ at most 500 lines, every test module
under tests/ at most 600 (a module a reader holds in mind at once; a test module gets a little
more room for its hand-computed cases). A module over budget is split by what it knows, not
squeezed: the check counts every line, comments and docstrings included, and shortening those
to fit is not the fix. `bash run test` (and so CI) runs it before the suite.

    python scripts/check_sizes.py     # exit status 1, naming each module over its budget
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"tailrl": 500, "tests": 600}  # lines per module, by top-level directory


def over_budget(root: Path = ROOT) -> list[str]:
    """One line per module over its directory's budget, the largest first."""
    found = []
    for top, budget in BUDGETS.items():
        for path in sorted((root / top).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > budget:
                found.append((lines, f"{path.relative_to(root)}: {lines} lines, over the {top}/ budget of {budget}"))
    return [line for _, line in sorted(found, reverse=True)]


def main() -> int:
    found = over_budget()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
