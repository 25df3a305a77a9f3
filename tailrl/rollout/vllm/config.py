"""How a run configures and opens a vLLM engine behind the Rollout protocol (`--engine vllm`).

Sections: [vllm] (the engine's own, its flags named for what vLLM calls them) and the ones both
engines read: [speculation] (--spec off/on/auto, --drafter, --draft-depth), [tuner] and
[adapt] (the learned drafter's training during RL). Opening one starts an in-process vLLM
engine on the policy's weights (tailrl.rollout.vllm.rollout). vLLM is imported only then, so
tailrl runs without it; without it, opening says how to install it. The dependency runs one way:
this module hands rollout.py the settings it resolved, and rollout.py imports nothing of it.
Held-out evaluations decode on the registry's default engine, which the caller hands in
(for_evaluation): this package imports nothing of another engine.
Its `ENGINE` is what tailrl.rollout.registry finds as "vllm" (the registry imports this module
only when asked for it; this module imports nothing of the registry).

Speculation maps onto vLLM's as follows. --spec off, or no drafter: vLLM decodes plainly (the
native engine's n-gram drafter has no vLLM counterpart). --spec on: --draft-depth draft tokens
at every step. --spec auto: tailrl's tuner picks each step's draft length among the native
engine's learned-drafter chain depths (and plain), per running-batch bucket. A fixed
--speculative-per-batch table replaces either. vLLM drafts chains only (--topk 1).

Knows: the sections, their checks, which drafter directory vLLM loads how, that held-out
evaluations decode on another engine and that exact mode is not its, which sections `tailrl
generate` reads. Does not know: vLLM's API (rollout.py), RL.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from tailrl.memory import parameters_gb
from tailrl.model import Transformer
from tailrl.rollout import ray_support
from tailrl.rollout.protocol import EngineEntry, HeldMemory, Rollout, RolloutConfig, RolloutState
from tailrl.rollout.vllm.actor import EngineSpec
from tailrl.rollout.vllm.checks import check_available, check_sampling, prepare_process, spec_method
from tailrl.rollout.vllm.settings import Drafting, VllmSettings
from tailrl.rollout.workers import WorkerConfig
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.modes import DRAFTER_ARMS, RolloutSpeculationConfig, SpeculationConfig
from tailrl.tuner import TunerConfig


@dataclass(frozen=True)
class VllmRolloutConfig:
    """The vLLM engine as a tailrl.rollout.protocol.RolloutConfig."""

    settings: VllmSettings = field(default_factory=VllmSettings)
    speculation: SpeculationConfig = field(default_factory=RolloutSpeculationConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self) -> None:
        if self.speculation.topk != 1:
            raise ValueError(f"the vllm engine drafts chains (--topk 1), got --topk {self.speculation.topk}")

    @classmethod
    def from_sections(cls, sections: Mapping[str, object]) -> VllmRolloutConfig:
        """From a run's sections by name (those left out take their defaults)."""
        names = {"vllm": "settings", "speculation": "speculation", "tuner": "tuner", "adapt": "adapt",
                 "workers": "workers"}
        return cls(**{attr: sections[name] for name, attr in names.items() if sections.get(name) is not None})

    def sections(self) -> dict[str, object]:
        return {"vllm": self.settings, "speculation": self.speculation, "tuner": self.tuner, "adapt": self.adapt,
                "workers": self.workers}

    @property
    def on_ray(self) -> bool:
        """Engines in Ray actors (fleet.py) rather than one in this process: more than one, or
        Ray asked for."""
        return self.workers.workers > 1 or self.workers.use_ray

    def drafter(self) -> Path | None:
        """The drafter directory the engine drafts with; None: it decodes plainly."""
        spec = self.speculation
        return Path(spec.drafter).expanduser() if spec.drafter is not None and spec.spec != "off" else None

    def drafting(self) -> Drafting | None:
        """How the engine drafts (module doc); None without a drafter."""
        if self.drafter() is None:
            return None
        table = self.settings.batch_schedule()
        if table is not None:
            return Drafting(max(k for _, _, k in table), table)
        if self.speculation.spec == "on":
            k = self.speculation.draft_depth
            return Drafting(k, [(1, self.settings.max_num_seqs, k)])
        tuned = tuple(sorted({arm.draft_depth for arm in DRAFTER_ARMS}))
        return Drafting(max(tuned), None, tuned)

    def needs_drafter(self) -> bool:
        return self.speculation.spec != "off" and self.speculation.drafter is None

    def with_drafter(self, drafter: Path) -> VllmRolloutConfig:
        return dataclasses.replace(self, speculation=dataclasses.replace(self.speculation, drafter=str(drafter)))

    def memory(self, model: Transformer, sequences: int, tokens: int) -> HeldMemory:
        """vLLM allocates its whole KV cache at start and loads its own copy of the weights, in
        every engine; on Ray, the object store holds one more copy of the weights."""
        weights = parameters_gb(model)
        if not self.on_ray:
            return HeldMemory(self.settings.kv_cache_gb + weights, "--kv-cache-gb")
        engines = self.workers.workers * (self.settings.kv_cache_gb + weights)
        return HeldMemory(engines + weights, "--kv-cache-gb, --workers")

    def check(self) -> None:
        check_available()
        if self.on_ray and ray_support.ray is None:
            raise ValueError("--engine vllm with --workers >= 2 runs its engines as Ray actors: "
                             "pip install 'tailrl[ray]'")
        if (drafter := self.drafter()) is not None:
            spec_method(drafter)  # a missing or unreadable drafter fails in one line

    def describe(self) -> str:
        drafter = self.drafter()
        where = f"on {self.workers.workers} vLLM engine(s) on Ray" if self.on_ray else "on vLLM"
        return f"{where}, speculation {self.speculation.spec}" + (f" with drafter {drafter}" if drafter else "")

    def for_evaluation(self, default: EngineEntry) -> RolloutConfig:
        """The registry's default engine, plain, in this process, with as many slots and as much
        cache: a second vLLM engine cannot run beside the training one (rollout.py, one per
        process). An evaluation measures the policy, whose distribution both engines sample."""
        sections = default.capacity({"speculation": SpeculationConfig(spec="off")}, self.settings.max_num_seqs,
                                    self.settings.kv_cache_gb)
        return default.config(sections)

    def engine_spec(self, model: Transformer, seed: int) -> EngineSpec:
        """What each engine on Ray opens with (fleet.py)."""
        return EngineSpec(model.cfg, model.lm_head.weight.dtype, self.settings, self.drafter(), self.drafting(),
                          self.tuner, self.speculation.draft_depth, seed, self.workers.worker_threads)

    def open(self, model: Transformer, seed: int, state: RolloutState | None = None) -> Rollout:
        """A vLLM engine on `model`'s architecture, weights and dtype, in this process (or
        --workers of them on Ray: fleet.py), its unseeded randomness and its tuner seeded by
        `seed`, resuming `state`."""
        self.check()
        if self.on_ray:
            from tailrl.rollout.vllm.fleet import VllmFleet

            return VllmFleet.start(model, seed, state, spec=self.engine_spec(model, seed), workers=self.workers,
                                   max_restarts=self.settings.engine_restarts, adapt=self.adapt)
        prepare_process()
        from tailrl.rollout.vllm.rollout import VllmRollout

        return VllmRollout.start(model, seed, state, settings=self.settings, drafter=self.drafter(),
                                 drafting=self.drafting(), tuner=self.tuner, adapt=self.adapt,
                                 draft_depth=self.speculation.draft_depth)


# The configuration sections of the vLLM engine (flags and TOML tables), by name; all but [vllm]
# are shared with the native engine.
SECTIONS: dict[str, type] = {"vllm": VllmSettings, "speculation": RolloutSpeculationConfig, "tuner": TunerConfig,
                             "adapt": AdaptConfig, "workers": WorkerConfig}


def capacity(sections: Mapping[str, object], sequences: int, kv_gb: float | None) -> dict[str, object]:
    """`sections` with [vllm] holding `sequences` at once (and `kv_gb` GiB of KV cache)."""
    settings = sections.get("vllm") or VllmSettings()
    sized = dataclasses.replace(settings, max_num_seqs=sequences, **({} if kv_gb is None else {"kv_cache_gb": kv_gb}))
    return {**sections, "vllm": sized}


def check_run(sections: Mapping[str, object], sampling: SamplingParams) -> None:
    """ValueError for sampling whose log-probs vLLM records otherwise (checks.py), and when vLLM
    is not installed (exact mode, which it has not, the registry refuses: `exact`)."""
    check_sampling(sampling)
    check_available()


ENGINE = EngineEntry(
    name="vllm", sections=SECTIONS,
    generate_sections={"vllm": VllmSettings, "speculation": SpeculationConfig, "tuner": TunerConfig},
    check=check_run, config=VllmRolloutConfig.from_sections, capacity=capacity, exact=False,
)
