"""The rollout engines a run can choose (--engine), found by name, and what choosing one means.

Each engine describes itself in its own package (an `EngineEntry`, `ENGINE` in its config
module): the configuration sections it reads, what it refuses, how its RolloutConfig is built
from its sections, and which of them `tailrl generate` reads. This module maps the names to those
descriptions and imports an engine's only when it is asked for, so the RL loop can offer the
names (TrainConfig.engine's choices) without importing any engine, and vLLM stays optional.
The engines' config modules import `EngineEntry` from here when they are imported; this module
imports one of them only inside `engine()`, when it is called: neither import runs while the
other module is being imported, so there is no import cycle whichever comes first.

Sections are shared by name between engines ([speculation], [tuner], [adapt]); a section that
only engines other than the chosen one read would configure nothing, so one set away from its
defaults is refused.

Knows: the engines' names and where each describes itself. Does not know: what any engine does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from tailrl.rollout.protocol import RolloutConfig
from tailrl.sampling import SamplingParams


@dataclass(frozen=True)
class EngineEntry:
    """One rollout engine as a run chooses it."""

    name: str
    # `tailrl train`'s configuration sections (flags and TOML tables) it reads, by name.
    sections: Mapping[str, type]
    # `tailrl generate`'s, by name.
    generate_sections: Mapping[str, type]
    # ValueError for what a run's sections and sampling ask that it cannot do.
    check: Callable[[Mapping[str, object], SamplingParams], None]
    # Its RolloutConfig from its own sections by name (those left out take their defaults).
    config: Callable[[Mapping[str, object]], RolloutConfig]
    # `sections` with its own set to hold `sequences` at once, with `kv_gb` GiB of KV cache (None:
    # its default): how a benchmark sizes every engine alike.
    capacity: Callable[[Mapping[str, object], int, float | None], dict[str, object]]
    # Whether it has exact mode: bit-identical tokens with speculation on and off.
    exact: bool


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


def rollout_config(name: str, sections: Mapping[str, object], sampling: SamplingParams) -> RolloutConfig:
    """The RolloutConfig of engine `name` from a run's sections by name, sampling as given; what
    it cannot run is refused (ValueError, one line) before anything starts."""
    entry = engine(name)
    entry.check(sections, sampling)
    refuse_foreign(name, sections)
    return entry.config({section: sections[section] for section in entry.sections if sections.get(section) is not None})
