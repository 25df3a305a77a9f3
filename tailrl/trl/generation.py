"""TRL's colocated vLLM generation with TLT inside: the learned drafter drafting, adapting, pushed.

`TLTGeneration` is TRL's VLLMGeneration (colocate mode) with three changes, each the vLLM rollout's
own mechanism (tailrl.rollout.vllm):

- the engine TRL builds gets the learned drafter as its EAGLE drafter, with the drafter's own
  draft-vocabulary head (speculation.install_draft_head) and, on CPU, the T > 0 repair
  (cpu_fix); TRL's engine arguments are kept, the speculative ones added;
- the weight sync is vLLM's layerwise reload (internals.reload_weights): TRL's
  parameter-by-parameter `load_weights` fails on CPU, where vLLM repacks its linear weights;
- at every sync, the adapting drafter closes its step (tailrl.rollout.adapt: the floor of
  micro-steps on what the trainer's loss forwards observed, a new version when it trained, a
  collapsed one rolled back) and a new version goes into the engine's drafter in place.

Each generate call's speculative counters (vLLM's metrics) become `stats`: accept_len, drafts,
the drafter version drafted with; `save_drafter` writes the drafting version as tailrl's files.

Knows: TRL's VLLMGeneration (trl 1.16), the vLLM rollout's pieces. Does not know: GRPO's loss,
TRL's trainer (tailrl.trl.trainer).
"""

from __future__ import annotations

import copy
import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl.generation.vllm_generation import VLLMGeneration
from vllm import LLM

from tailrl.rollout.adapt import AdaptiveDrafter
from tailrl.rollout.protocol import PolicyForward
from tailrl.rollout.vllm import cpu_fix
from tailrl.rollout.vllm import internals as vllm_internals
from tailrl.rollout.vllm.checks import DRAFT_SAMPLING, prepare_process
from tailrl.rollout.vllm.speculation import install_draft_head, load_drafter_in_place, write_learned_drafter
from tailrl.speculative.drafter.export import eagle_weights
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import read_drafter_config, save_drafter
from tailrl.speculative.watch import Tally
from tailrl.trl import internals
from tailrl.trl.policy import policy_view

_DRAFTS, _ACCEPTED, _PER_POS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                                "vllm:spec_decode_num_accepted_tokens_per_pos")


@dataclass(frozen=True)
class TLTConfig:
    """TLT in a TRL GRPOTrainer: the drafter, how far it drafts, how it adapts."""

    drafter: Path  # a tailrl learned drafter for the policy (`tailrl drafter warmup`)
    num_speculative_tokens: int = 4
    draft_sampling: str = "probabilistic"  # vLLM's draft_sample_method (docs/vllm.md)
    # The engine's dtype; None leaves it to vLLM, as TRL does (a float32 checkpoint then decodes
    # in bf16, which CPUs without native bf16 emulate, docs/performance.md).
    dtype: str | None = None
    adapt: AdaptConfig = field(default_factory=AdaptConfig)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {self.draft_sampling!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16 (or None: vLLM's choice), got {self.dtype!r}")
        read_drafter_config(Path(self.drafter))  # a missing or unreadable drafter fails here, in one line


@dataclass(frozen=True)
class GenerationStats:
    """One generate call's speculation."""

    drafts: int  # verifies of a draft
    accepted: int  # draft tokens accepted
    drafter_version: int

    @property
    def accept_len(self) -> float | None:
        """Tokens per verify: the accepted draft tokens plus the target's own."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None


def _load_policy(worker, weights: dict[str, torch.Tensor]) -> None:
    """On the engine's worker: the policy's weights replaced in place."""
    vllm_internals.reload_weights(worker, weights)


class TLTGeneration(VLLMGeneration):
    """VLLMGeneration (colocate mode) with TLT (module doc)."""

    def __init__(self, *, tlt: TLTConfig, **kwargs):
        self.tlt = tlt
        super().__init__(**kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "colocate":
            raise ValueError("TLT for TRL needs vllm_mode='colocate' (server mode syncs weights over NCCL only)")
        if self.tensor_parallel_size != 1:
            raise ValueError("TLT for TRL runs one engine per process (vllm_tensor_parallel_size=1)")
        prepare_process()
        vllm_internals.check_supported()
        self.policy = policy_view(self.model)
        self.adapt = AdaptiveDrafter.open(Path(self.tlt.drafter), self.policy, self.tlt.adapt, None)
        speculative = {"method": "eagle", "num_speculative_tokens": self.tlt.num_speculative_tokens,
                       "draft_sample_method": self.tlt.draft_sampling}
        with tempfile.TemporaryDirectory(prefix="tailrl-trl-") as tmp:
            # fp32 on disk: vLLM casts the drafter to the engine's dtype as it loads it.
            cfg, state = write_learned_drafter(Path(self.tlt.drafter), self.policy, torch.float32, Path(tmp) / "d")
            cpu_fix.install()
            extra = {"dtype": self.tlt.dtype} if self.tlt.dtype else {}
            llm = functools.partial(LLM, speculative_config=speculative | {"model": str(Path(tmp) / "d")},
                                    disable_log_stats=False, **extra)  # the counters `stats` comes from
            with internals.replaced(internals.LLM_CLASS, llm):
                super()._init_vllm()
        engine = self.llm.llm_engine
        self.dtype = engine.model_config.dtype
        vocab = torch.tensor(cfg.draft_vocab, dtype=torch.long)
        engine.collective_rpc(install_draft_head, args=(state["head.weight"].to(self.dtype), vocab))
        self.drafter_version = 0
        self.last_adapt = None
        self._seen = self.counters()

    def observe(self, forwards: list[PolicyForward]) -> None:
        """What the trainer's loss forward computed: the drafter's data for the step after next
        (it trains one step behind, tailrl.speculative.drafter.learner)."""
        self.adapt.observe(forwards)

    def sync_weights(self) -> None:
        """The adapting drafter's step closes (module doc), then the policy's weights and, when it
        changed, the drafter's new version go into the engine in place; the prefix cache is reset."""
        self.last_adapt = step = self.adapt.end_step(self.policy)
        engine = self.llm.llm_engine
        weights = {name: p.detach().to(self.dtype) for name, p in self._iter_named_params()}
        engine.collective_rpc(_load_policy, args=(weights,))
        if step.changed:
            w = self.adapt.drafting_weights()
            eagle = {k: v.to(self.dtype) for k, v in eagle_weights(w, "vllm").items()}
            engine.collective_rpc(load_drafter_in_place, args=(eagle, w["head.weight"].to(self.dtype)))
            self.drafter_version = step.drafting
        self.llm.reset_prefix_cache()

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        drafts, accepted, first = self._delta()
        if drafts:  # the drafting version's acceptance, for its rollback watch
            self.adapt.record({self.arm: _tally(drafts, first)})
        self.stats = GenerationStats(drafts, accepted, self.drafter_version)
        return out

    def save_drafter(self, path: Path) -> Path:
        """The drafting version as tailrl drafter files (what `vllm serve` and tailrl load)."""
        drafter = copy.deepcopy(self.adapt.learner.drafter)
        drafter.load_state_dict(self.adapt.drafting_weights())
        return save_drafter(drafter, path)

    def close(self) -> None:
        """Shut the engine down (its model and KV cache freed): another may start in this process."""
        vllm_internals.shutdown(self.llm.llm_engine)

    @property
    def arm(self) -> str:
        return f"vllm-eagle-{self.tlt.num_speculative_tokens}"

    def counters(self) -> tuple[int, int, int]:
        """vLLM's cumulative drafts, accepted draft tokens, and accepted first draft tokens."""
        drafts = accepted = first = 0
        for m in self.llm.get_metrics():
            if m.name == _DRAFTS:
                drafts += m.value
            elif m.name == _ACCEPTED:
                accepted += m.value
            elif m.name == _PER_POS and m.values:
                first += m.values[0]
        return drafts, accepted, first

    def _delta(self) -> tuple[int, int, int]:
        now = self.counters()
        delta = tuple(a - b for a, b in zip(now, self._seen))
        self._seen = now
        return delta  # type: ignore[return-value]


def _tally(verifies: int, accepted_first: int) -> Tally:
    t = Tally()
    t.add(verifies, accepted_first)
    return t
