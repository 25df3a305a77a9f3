"""Where tailrl keeps what it builds once per machine: converted models, cold starts, warmed-up
drafters, compiled kernels; and how paths under it are shown in records meant for other machines.

Knows: the TAILRL_CACHE variable and its default. Does not know: what is stored there.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TAILRL_CACHE", Path.home() / ".cache" / "tailrl"))


def shown_path(path: str) -> str:
    """`path` as a record meant for other machines shows it: under the cache directory's
    documented name, or relative to the working directory (the repository, where benches run),
    so that it names no one machine's home or temporary directory; other paths as given."""
    p = Path(path)
    cache = "$TAILRL_CACHE" if "TAILRL_CACHE" in os.environ else "~/.cache/tailrl"
    for root, shown in ((cache_root(), cache), (Path.cwd(), "")):
        if p.is_absolute() and p.is_relative_to(root):
            return str(Path(shown, p.relative_to(root)))
    return path
