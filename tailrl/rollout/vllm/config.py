"""How a run configures and opens a vLLM engine behind the Rollout protocol (`--engine vllm`).

One section, [vllm], its flags named for what vLLM calls them. Opening it starts an in-process
vLLM engine on the policy's weights (tailrl.rollout.vllm.rollout). vLLM is imported only then,
so tailrl runs without it; without it, opening says how to install it.

Knows: the section's fields and their checks, which drafter directory vLLM loads how, that
held-out evaluations decode on the native engine. Does not know: vLLM's API (rollout.py), RL.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tailrl.engine import EngineConfig
from tailrl.model import Transformer
from tailrl.rollout.native.config import NativeRolloutConfig
from tailrl.rollout.protocol import Rollout, RolloutConfig
from tailrl.rollout.vllm.checks import check_installed, is_learned, spec_method
from tailrl.rollout.vllm.settings import VllmSettings
from tailrl.speculative.modes import SpeculationConfig

@dataclass(frozen=True)
class VllmRolloutConfig:
    """The vLLM engine as a tailrl.rollout.protocol.RolloutConfig: its [vllm] settings."""

    settings: VllmSettings = field(default_factory=VllmSettings)

    def sections(self) -> dict[str, object]:
        return {"vllm": self.settings}

    def learned_drafter(self) -> Path | None:
        """--vllm-drafter when it names a tailrl drafter: the engine drafts with it and takes the
        versions the RL loop trains (VllmRollout.publish_drafter)."""
        drafter = self.settings.vllm_drafter
        return Path(drafter).expanduser() if drafter is not None and is_learned(Path(drafter)) else None

    def for_evaluation(self) -> RolloutConfig:
        """tailrl's native engine, plain, in this process, with as many slots and as much cache:
        a second vLLM engine cannot run beside the training one (rollout.py, one per process).
        An evaluation measures the policy, whose distribution both engines sample."""
        return NativeRolloutConfig(engine=EngineConfig(max_batch=self.settings.max_num_seqs,
                                                       kv_budget_gb=self.settings.kv_cache_gb),
                                   speculation=SpeculationConfig(spec="off"))

    def open(self, model: Transformer, seed: int, state: dict[str, object] | None = None) -> Rollout:
        """An in-process vLLM engine on `model`'s architecture, weights and dtype, its unseeded
        randomness and its tuner seeded by `seed`, the tuner resuming `state`."""
        if state and set(state) != {"tuner"}:
            raise ValueError("this checkpoint holds another engine's rollout state; resume it with that engine")
        check_installed()
        if self.settings.vllm_drafter is not None:
            spec_method(Path(self.settings.vllm_drafter))  # a missing or unreadable drafter fails in one line
        # The engine runs in this process (rollout.py says why); vLLM's own log lines would bury
        # tailrl's progress (VLLM_LOGGING_LEVEL=INFO shows them; read when vLLM is imported).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        # vLLM 0.32's kernel dispatcher trips torch's deprecation of torch.distributed.reduce_op.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
        from tailrl.rollout.vllm.rollout import VllmRollout

        return VllmRollout.start(self.settings, model, seed, state)


# The configuration section of the vLLM engine (flags and TOML table), by name.
SECTIONS: dict[str, type] = {"vllm": VllmSettings}
