"""How a run configures and opens tailrl's own engine behind the Rollout protocol.

One engine in the trainer's process by default (the policy's rollout copy, its torch threads
lent to the update in the tail, its learned drafter adapting on the update's idle core), or
several worker processes or Ray actors with spot training of the learned drafter on whichever
is idle first. Exact mode (bit-identical tokens with speculation on and off) is this engine's.

Its `ENGINE` is what tailrl.rollout.registry finds as "native" (the registry imports this module
only when asked for it; this module imports nothing of the registry).

Knows: which sections configure the native engine, how its workers start, which of them `tailrl
generate` reads. Does not know: RL.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from tailrl.engine import EngineConfig
from tailrl.kv_cache import KVCache, whole_chunks
from tailrl.linears import PACKED_DTYPES
from tailrl.memory import parameters_gb
from tailrl.model import Transformer
from tailrl.rollout.adapt import AdaptiveDrafter
from tailrl.rollout.native.pool import NativeRolloutState, WorkerPool
from tailrl.rollout.native.runtimes import InProcessRuntime, ProcessRuntime, Runtime
from tailrl.rollout.native.spot import DrafterState, SpotConfig
from tailrl.rollout.native.worker import WorkerSetup
from tailrl.rollout.protocol import EngineEntry, HeldMemory, check_state
from tailrl.rollout.workers import WorkerConfig
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import read_drafter_weights
from tailrl.speculative.modes import RolloutSpeculationConfig, SpeculationConfig
from tailrl.tuner import TunerConfig

# The configuration sections of the native engine (flags and TOML tables), by name.
SECTIONS: dict[str, type] = {
    "engine": EngineConfig,
    "speculation": RolloutSpeculationConfig,
    "tuner": TunerConfig,
    "adapt": AdaptConfig,
    "workers": WorkerConfig,
    "spot": SpotConfig,
}


@dataclass(frozen=True)
class NativeRolloutConfig:
    """The native engine's sections; a tailrl.rollout.protocol.RolloutConfig."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    speculation: SpeculationConfig = field(default_factory=RolloutSpeculationConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    spot: SpotConfig = field(default_factory=SpotConfig)

    @classmethod
    def from_sections(cls, sections: Mapping[str, object]) -> NativeRolloutConfig:
        """From a run's sections by name (those left out take their defaults)."""
        return cls(**{name: sections[name] for name in SECTIONS if sections.get(name) is not None})

    def sections(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def needs_drafter(self) -> bool:
        return self.speculation.spec != "off" and self.speculation.drafter is None

    def with_drafter(self, drafter: Path) -> NativeRolloutConfig:
        return dataclasses.replace(self, speculation=dataclasses.replace(self.speculation, drafter=str(drafter)))

    def memory(self, model: Transformer, sequences: int, tokens: int) -> HeldMemory:
        """Each engine's cache: the step's sequences at their worst case, or the budget where
        that is less (tailrl.engine); worker processes also load a copy of the model each, and
        where decoding takes oneDNN's prepacked linears (tailrl.linears) each engine holds a
        packed copy of the weights beside them."""
        n = self.workers.workers
        slots = min(self.engine.max_batch, -(-sequences // n))
        worst = slots * whole_chunks(tokens) * KVCache.bytes_per_token(model.cfg, model.lm_head.weight.dtype)
        cache = min(self.engine.kv_budget_gb, worst / 2**30)
        copies = parameters_gb(model) if n > 1 else 0.0
        packed = parameters_gb(model) if model.lm_head.weight.dtype in PACKED_DTYPES else 0.0
        return HeldMemory(n * (cache + copies + packed), "--kv-budget-gb, --workers")

    def check(self) -> None:
        drafter = self.speculation.drafter
        if drafter is not None and not Path(drafter).expanduser().is_dir():
            raise ValueError(f"drafter directory not found: {drafter}")

    def describe(self) -> str:
        spec = self.speculation
        return f"speculation {spec.spec}" + (f" with drafter {spec.drafter}" if spec.drafter else "")

    def for_evaluation(self, default: EngineEntry) -> NativeRolloutConfig:
        """Itself, plain, beside the training rollout (it runs twice in one process)."""
        return NativeRolloutConfig(engine=self.engine, speculation=SpeculationConfig(spec="off"))

    def open(self, model: Transformer, seed: int, state: NativeRolloutState | None = None) -> WorkerPool:
        """Workers as configured, decoding with `model` (the rollout model: one in-process worker
        decodes with it directly, others with a copy) and resuming `state`."""
        check_state(state, NativeRolloutState)
        speculation, workers = self.speculation, self.workers
        drafter = None
        if speculation.drafter and speculation.spec != "off":
            # fp32, as saved
            drafter = DrafterState(0, read_drafter_weights(Path(speculation.drafter).expanduser()))
        adapting = drafter is not None and self.adapt.adapt_drafter
        tuners = state.tuners if state is not None else None
        if tuners is not None and len(tuners) != workers.workers:
            raise ValueError(f"the checkpoint holds {len(tuners)} workers' state; resume with --workers {len(tuners)}")
        # The engine keeps the hidden states it sampled with: with two workers or more an idle one
        # spot-trains on them; with one, the drafter adapts on the trainer's side on them
        # (tailrl.rollout.adapt), every response of a step, the groups the update skips too.
        setup = WorkerSetup(self.engine, speculation, self.tuner, seed, collect=adapting)
        runtime = _runtime(workers, model, setup, tuners)
        adapt = None
        if adapting and workers.workers == 1:
            adapt = AdaptiveDrafter.open(Path(speculation.drafter).expanduser(), model, self.adapt,
                                         state.adapt if state is not None else None, own_data=True)
        pool = WorkerPool(runtime, self.spot, self.adapt, drafter, workers.worker_timeout_s, speculation.draft_depth,
                          self.tuner.bucket_edges, tuners, state.tuner_pending if state is not None else None, adapt)
        if state is not None:
            pool.load_state_dict(state)
        return pool


def _runtime(cfg: WorkerConfig, model: Transformer, setup: WorkerSetup, tuners: list | None) -> Runtime:
    # Starting (imports, model copy, drafter) takes seconds to minutes whatever the hang timeout is.
    start_s = max(cfg.worker_timeout_s, 300.0)
    if cfg.use_ray:
        from tailrl.rollout.native.ray_runtime import RayRuntime

        return RayRuntime(cfg.workers, cfg.ray_address, model, dataclasses.replace(setup, threads=cfg.worker_threads),
                          tuners, start_s)
    if cfg.workers == 1:
        # The engine in this process, on the trainer's rollout model, its threads as set.
        return InProcessRuntime(model, setup, tuners)
    return ProcessRuntime(cfg.workers, model, dataclasses.replace(setup, threads=cfg.worker_threads), tuners, start_s)


def capacity(sections: Mapping[str, object], sequences: int, kv_gb: float | None) -> dict[str, object]:
    """`sections` with [engine] holding `sequences` at once (and `kv_gb` GiB of KV cache)."""
    engine = sections.get("engine") or EngineConfig()
    sized = dataclasses.replace(engine, max_batch=sequences, **({} if kv_gb is None else {"kv_budget_gb": kv_gb}))
    return {**sections, "engine": sized}


def _check(sections: Mapping[str, object], sampling: SamplingParams) -> None:
    """Nothing to refuse: every sampling and every setting of its sections is the native engine's."""


ENGINE = EngineEntry(
    name="native", sections=SECTIONS,
    generate_sections={"engine": EngineConfig, "speculation": SpeculationConfig, "tuner": TunerConfig},
    check=_check, config=NativeRolloutConfig.from_sections, capacity=capacity, exact=True,
)
