"""Check tailrl's layering: no module imports one from a layer above its own, and no cycle among
its imports, those at module level and those inside functions alike.

Layers, bottom to top (docs/architecture.md): base (model, sampling, stats, the records of a
generate call, ...), engine, speculative, the seam (rollout/protocol.py), the rollout engines,
rl, and the top (pipeline, warmup, generate, tracking, bench, cli, trl). An import at module
level runs at import time; one inside a function runs when called (how the registry reaches the
engines, and the CLI its commands): both are dependencies and both must point down or sideways.
Only the first can make an import cycle at import time; two modules that import each other
through the second are reported too (their dependency should run one way). Imports named in
strings (`"tailrl.bench.train:run"`, read with importlib by the top layer) are not seen.

    python scripts/check_layers.py            # exit status 1 on a violation
    python scripts/check_layers.py --list     # also every module's imports
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; a module belongs to the first layer with a prefix it matches (the seam before
# the rest of rollout).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("tailrl.cache_dir", "tailrl.decode_kernels", "tailrl.model", "tailrl.kv_cache", "tailrl.linears",
              "tailrl.kernels", "tailrl.step_graphs",
              "tailrl.loading", "tailrl.memory", "tailrl.sampling", "tailrl.stats", "tailrl.records", "tailrl.tuner",
              "tailrl.config")),
    ("engine", ("tailrl.engine",)),
    ("speculative", ("tailrl.speculative",)),
    ("seam", ("tailrl.rollout.protocol",)),
    ("rollout", ("tailrl.rollout",)),
    ("rl", ("tailrl.rl",)),
    ("top", ("tailrl.pipeline", "tailrl.warmup", "tailrl.generate", "tailrl.tracking", "tailrl.bench",
             "tailrl.cli", "tailrl.__main__", "tailrl.trl")),
]

@dataclass
class Module:
    name: str
    top: set[str] = field(default_factory=set)  # tailrl modules imported when this one is
    deferred: set[str] = field(default_factory=set)  # inside functions, or only for type checkers


def layer(module: str) -> int:
    """The module's layer's index in LAYERS; ValueError for a module in none."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise ValueError(f"{module} is in no layer: add it to LAYERS in scripts/check_layers.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, names: set[str]) -> set[str]:
    """The tailrl modules an import statement loads (`from pkg import mod` names the module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in names}
    if node.level or not node.module:
        raise ValueError(f"relative import at line {node.lineno}: tailrl imports absolutely")
    subs = {f"{node.module}.{a.name}" for a in node.names} & names
    return subs or ({node.module} & names)


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def collect(tree: ast.AST, names: set[str], mod: Module, deferred: bool = False) -> None:
    """Sort every import under `tree` into mod.top or mod.deferred."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (mod.deferred if deferred else mod.top).update(imported(node, names) - {mod.name})
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
            or is_type_checking(node)
        collect(node, names, mod, inner)


def modules() -> dict[str, Module]:
    paths = sorted((ROOT / "tailrl").rglob("*.py"))
    names = {module_name(p) for p in paths}
    out = {}
    for p in paths:
        mod = Module(module_name(p))
        collect(ast.parse(p.read_text(), str(p)), names, mod)
        out[mod.name] = mod
    return out


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """The cycles of the graph of `mods`' top-level imports: its strongly connected components
    of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(mods[v].top):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return found


def violations(mods: dict[str, Module]) -> list[str]:
    """One line per upward import and per import-time cycle."""
    lines = []
    for m in sorted(mods):
        for kind, targets in (("top-level", mods[m].top), ("function-level", mods[m].deferred)):
            for t in sorted(targets):
                if layer(t) > layer(m):
                    lines.append(f"upward ({kind}): {m} [{LAYERS[layer(m)][0]}] imports {t} [{LAYERS[layer(t)][0]}]")
    at_import = cycles(mods)
    lines += [f"cycle (top-level): {', '.join(c)}" for c in at_import]
    called = {m: Module(m, mods[m].top | mods[m].deferred) for m in mods}
    lines += [f"cycle (through function-level imports): {', '.join(c)}" for c in cycles(called) if c not in at_import]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print every module's imports too")
    args = ap.parse_args(argv)
    mods = modules()
    if args.list:
        for m in sorted(mods):
            print(f"{m} [{LAYERS[layer(m)][0]}]")
            print(f"  top-level:      {', '.join(sorted(mods[m].top)) or '-'}")
            print(f"  function-level: {', '.join(sorted(mods[m].deferred)) or '-'}")
    found = violations(mods)
    print("\n".join(found) or f"layers ok: {len(mods)} modules, no upward import, no cycle")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
