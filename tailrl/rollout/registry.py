"""The rollout engines a run can choose (--engine), found by name, and what choosing one means.

Each engine describes itself in its own package (an `EngineEntry`, `ENGINE` in its config
module): the configuration sections it reads, what it refuses, how its RolloutConfig is built
from its sections, and which of them `tailrl generate` reads. This module maps the names to those
descriptions and imports an engine's only when it is asked for, so the RL loop can offer the
names (TrainConfig.engine's choices) without importing any engine, and vLLM stays optional.
`EngineEntry` lives with the Rollout protocol (tailrl.rollout.protocol), so the dependency runs
one way: this module imports the engines' config modules, none of them imports this one.

Sections are shared by name between engines ([speculation], [tuner], [adapt]); a section that
only engines other than the chosen one read would configure nothing, so one set away from its
defaults is refused; so is exact mode ([engine] exact) on an engine that has none (`exact`).

Knows: the engines' names and where each describes itself. Does not know: what any engine does.
"""

from __future__ import annotations

from typing import Callable, Mapping

from tailrl.engine import EngineConfig
from tailrl.rollout.protocol import EngineEntry, RolloutConfig
from tailrl.sampling import SamplingParams


def _native() -> EngineEntry:
    from tailrl.rollout.native.config import ENGINE

    return ENGINE


def _vllm() -> EngineEntry:
    from tailrl.rollout.vllm.config import ENGINE

    return ENGINE


_ENGINES: dict[str, Callable[[], EngineEntry]] = {"native": _native, "vllm": _vllm}
NAMES = tuple(_ENGINES)
DEFAULT = NAMES[0]


def engine(name: str) -> EngineEntry:
    """The engine called `name`; ValueError for no such engine."""
    if name not in _ENGINES:
        raise ValueError(f"engine must be one of {', '.join(NAMES)}, got {name!r}")
    return _ENGINES[name]()


def train_sections() -> dict[str, type]:
    """Every engine's `tailrl train` sections by name, a shared one once (importing every engine)."""
    return {name: cls for e in NAMES for name, cls in engine(e).sections.items()}


def generate_sections() -> dict[str, type]:
    """Every engine's `tailrl generate` sections by name, a shared one once."""
    return {name: cls for e in NAMES for name, cls in engine(e).generate_sections.items()}


def refuse_foreign(name: str, sections: Mapping[str, object]) -> None:
    """ValueError for a section that only other engines than `name`'s read, set away from its
    defaults: it would configure nothing."""
    own = engine(name).sections
    for other in NAMES:
        for section, cls in engine(other).sections.items():
            if section not in own and sections.get(section) not in (None, cls()):
                raise ValueError(f"[{section}] configures the {other} engine, but this run's is --engine {name}: "
                                 f"leave [{section}] at its defaults or use --engine {other}")


def refuse_exact(name: str, sections: Mapping[str, object]) -> None:
    """ValueError for exact mode ([engine] exact, --exact) on an engine without it, before [engine]
    would be refused as another engine's section, so the line says why."""
    asked = sections.get("engine")
    if engine(name).exact or not (isinstance(asked, EngineConfig) and asked.exact):
        return
    having = [n for n in NAMES if engine(n).exact]
    raise ValueError(f"--exact is the {' and '.join(having)} engine's (bit-identical tokens with speculation on and "
                     f"off); the {name} engine's speculation is lossless in distribution only: drop --exact or use "
                     f"--engine {having[0]}")


def rollout_config(name: str, sections: Mapping[str, object], sampling: SamplingParams) -> RolloutConfig:
    """The RolloutConfig of engine `name` from a run's sections by name, sampling as given; what
    it cannot run is refused (ValueError, one line) before anything starts."""
    entry = engine(name)
    refuse_exact(name, sections)
    entry.check(sections, sampling)
    refuse_foreign(name, sections)
    return entry.config({section: sections[section] for section in entry.sections if sections.get(section) is not None})
