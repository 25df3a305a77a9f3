"""TRL's colocated vLLM generation with TLT inside: the learned drafter drafting, adapting, pushed.

`TLTGeneration` is TRL's VLLMGeneration (colocate mode) with four changes, each the vLLM rollout's
own mechanism (tailrl.rollout.vllm):

- the engine TRL builds gets the learned drafter as its EAGLE drafter, with the drafter's own
  draft-vocabulary head (speculation.install_draft_head) and, on CPU, the T > 0 repair
  (cpu_fix); TRL's engine arguments are kept, the speculative ones added;
- the weight sync is vLLM's layerwise reload (internals.reload_weights): TRL's
  parameter-by-parameter `load_weights` fails on CPU, where vLLM repacks its linear weights; a
  LoRA wrapper's weights go in merged (tailrl.trl.lora.merged_weights), the model left unmerged;
- at the end of each optimizer step the adapting drafter publishes (`end_drafter_step`;
  tailrl.rollout.adapt.AdaptiveDrafter.publish: the floor of micro-steps on what the trainer's
  loss forwards observed, a new version when it trained, a collapsed one rolled back), and the
  next sync puts the version it published into the engine's drafter in place;
- with spec "auto", TLT's tuner chooses each engine step's draft length (tailrl.trl.steps).

Several processes (`accelerate launch`, tailrl.trl.processes): each has its engine and its tuner
(steering by its own engine's steps); process 0 alone holds the adapting drafter (`adapt`). At
the end of each optimizer step it gets every process's observed forwards and rollback tallies,
publishes, and hands the published version to the others, whose next sync loads it: every
engine drafts with the same version, the same weights.

Each generate call's speculation becomes `stats` (accept_len over every process's engine, the
drafter version drafted with); `save_drafter` writes the drafting version as tailrl's drafter
files; `state_dict` is what a checkpoint needs to resume the drafter and the tuner where they
were (`load_state_dict`).

Knows: TRL's VLLMGeneration (trl 1.16), the vLLM rollout's pieces. Does not know: GRPO's loss,
TRL's trainer (tailrl.trl.trainer).
"""

from __future__ import annotations

import copy
import functools
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl.generation.vllm_generation import VLLMGeneration
from vllm import LLM

from tailrl.rollout.adapt import AdaptiveDrafter, AdaptStep
from tailrl.rollout.protocol import PolicyForward
from tailrl.rollout.vllm import cpu_fix, internals as vllm_internals
from tailrl.rollout.vllm.checks import DRAFT_SAMPLING, prepare_process, process_state_kept
from tailrl.rollout.vllm.speculation import Schedule, install_draft_head, load_drafter_version, write_learned_drafter
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.drafter.model import read_drafter_config, save_drafter
from tailrl.speculative.modes import DRAFTER_ARMS
from tailrl.speculative.watch import Tallies, add_tallies
from tailrl.trl import internals, processes
from tailrl.trl.lora import is_peft, merged_weights
from tailrl.trl.policy import policy_view
from tailrl.trl.steps import EngineSteps
from tailrl.tuner import TunerConfig


@dataclass(frozen=True)
class TLTConfig:
    """TLT in a TRL GRPOTrainer: the drafter, how it drafts, how it adapts."""

    drafter: Path | None  # a tailrl learned drafter for the policy (`tailrl drafter warmup`)
    # "auto": TLT's adaptive engine, the tuner choosing each step's draft length among the native
    # engine's chain depths and plain decoding (tailrl.speculative.modes); "on": always
    # num_speculative_tokens; "off": no drafter (TRL's engine with the weight sync that works on CPU).
    spec: str = "auto"
    num_speculative_tokens: int = 4
    draft_sampling: str = "probabilistic"  # vLLM's draft_sample_method (docs/vllm.md)
    # The engine's dtype; None leaves it to vLLM, as TRL does (a float32 checkpoint then decodes
    # in bf16, which CPUs without native bf16 emulate, docs/performance.md).
    dtype: str | None = None
    # vLLM's enforce_eager; None leaves it to vLLM, as TRL does (torch.compile at start: minutes
    # on a CPU, where tailrl's own vLLM engine runs eager, docs/vllm.md).
    enforce_eager: bool | None = None
    # vLLM's KV cache in GB; None leaves it to TRL's vllm_gpu_memory_utilization (on a CPU, that
    # share of the RAM less what the process already holds: TRL's default 0.3 is 7 GB of 24).
    kv_cache_gb: float | None = None
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)
    seed: int = 0  # the tuner's exploration

    def __post_init__(self) -> None:
        if self.spec not in ("auto", "on", "off"):
            raise ValueError(f"spec must be 'auto', 'on' or 'off', got {self.spec!r}")
        if (self.drafter is None) != (self.spec == "off"):
            raise ValueError("a drafter drafts with spec 'auto' or 'on', and only then")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {self.draft_sampling!r}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0 (or None: TRL's memory share), got {self.kv_cache_gb}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16 (or None: vLLM's choice), got {self.dtype!r}")
        if self.drafter is not None:
            read_drafter_config(Path(self.drafter))  # a missing or unreadable drafter fails here, in one line

    def lengths(self) -> tuple[int, ...]:
        """The draft lengths the engine drafts at (the tuner's choices, or the fixed one)."""
        if self.spec == "on":
            return (self.num_speculative_tokens,)
        return tuple(sorted({arm.draft_depth for arm in DRAFTER_ARMS}))


@dataclass(frozen=True)
class GenerationStats:
    """One generate call's speculation."""

    accept_len: float | None  # tokens per verify over every process's engine; None: no step drafted
    drafter_version: int
    seconds: float  # the call's wall time, the slowest process's (the sync before it not included)


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
        self.adapt: AdaptiveDrafter | None = None  # process 0's, with a drafter (module doc)
        self.drafter_version = 0  # the version in the engine (0: the drafter's files)
        self._published: tuple[int, dict[str, torch.Tensor]] | None = None  # for the next sync to load
        self._forwards: list[PolicyForward] = []  # observed since the last publish, and
        self._tallies: Tallies = {}  # the engine's verifies by the drafting version since then
        # Per-step stats on, for EngineSteps; dtype, eagerness and KV cache where asked.
        llm_kwargs: dict[str, object] = {"disable_log_stats": False}
        if self.tlt.dtype:
            llm_kwargs["dtype"] = self.tlt.dtype
        if self.tlt.enforce_eager is not None:
            llm_kwargs["enforce_eager"] = self.tlt.enforce_eager
        if self.tlt.kv_cache_gb is not None:
            llm_kwargs["kv_cache_memory_bytes"] = int(self.tlt.kv_cache_gb * 2**30)
        if self.tlt.drafter is None:
            self._start(llm_kwargs)
            self.steps = EngineSteps(self.llm.llm_engine, None, "plain")
            return
        drafter = Path(self.tlt.drafter)
        if processes.rank() == 0:
            self.adapt = AdaptiveDrafter.open(drafter, self.policy, self.tlt.adapt, None)
        lengths = self.tlt.lengths()
        with tempfile.TemporaryDirectory(prefix="tailrl-trl-") as tmp:
            # fp32 on disk: vLLM casts the drafter to the engine's dtype as it loads it.
            cfg, state = write_learned_drafter(drafter, self.policy, torch.float32, Path(tmp) / "d")
            cpu_fix.install()
            # A per-batch-size table makes the scheduler keep the dense lookup the tuner rewrites.
            llm_kwargs["speculative_config"] = {
                "method": "eagle", "model": str(Path(tmp) / "d"), "num_speculative_tokens": max(lengths),
                "draft_sample_method": self.tlt.draft_sampling,
                "num_speculative_tokens_per_batch_size": [(1, self.max_num_seqs, max(lengths))]}
            self._start(llm_kwargs)
        engine = self.llm.llm_engine
        vocab = torch.tensor(cfg.draft_vocab, dtype=torch.long)
        engine.collective_rpc(install_draft_head, args=(state["head.weight"].to(self.dtype), vocab))
        vllm_internals.check_engine(engine, speculative=True)
        # Each process's tuner explores with its own seed, as TRL seeds each process's engine.
        seed = self.tlt.seed + processes.rank()
        schedule = (Schedule(vllm_internals.draft_length_lookup(engine), lengths, self.tlt.tuner, None, seed)
                    if self.tlt.spec == "auto" else None)
        self.steps = EngineSteps(engine, schedule, f"eagle-{lengths[0]}")

    def _start(self, llm_kwargs: dict[str, object]) -> None:
        """TRL's own engine start, with `llm_kwargs` added to its arguments."""
        # vLLM's start would leave the trainer's process with torch.set_num_threads made a no-op,
        # the global random generators reseeded (TRL seeded them) and the GC heap frozen.
        with internals.replaced(internals.LLM_CLASS, functools.partial(LLM, **llm_kwargs)), process_state_kept():
            super()._init_vllm()
        self.dtype = self.llm.llm_engine.model_config.dtype

    @property
    def drafts(self) -> bool:
        """Whether the engine drafts with a learned drafter (spec "auto" or "on")."""
        return self.tlt.drafter is not None

    def observe(self, forwards: list[PolicyForward]) -> None:
        """What the trainer's loss forward computed: the drafter's data for the step after next
        (it trains one step behind, tailrl.speculative.drafter.learner), handed over at publish."""
        if self.drafts:
            self._forwards += forwards

    def end_drafter_step(self) -> AdaptStep | None:
        """The adapting drafter publishes on the policy as the optimizer step left it (module
        doc; None: no drafter), on every process: a collective. The trainer calls it before TRL
        saves a checkpoint, so the checkpoint holds the drafter as the next step starts from it."""
        if not self.drafts:
            return None
        data = processes.to_first((self._forwards, self._tallies))
        self._forwards, self._tallies = [], {}
        step = None
        if self.adapt is not None:  # process 0: every process's data, in process order
            # A view on the model's tensors now: under DDP (any process group, which TRL's engine
            # start leaves in os.environ) the view made at start reads other tensors than those the
            # optimizer steps, and the drafter would train on the initial weights.
            self.policy = policy_view(self.model)
            for forwards, tallies in data:
                self.adapt.record(tallies)
                self.adapt.observe(forwards)
            step = self.adapt.publish(self.policy, self._publish)
        step, self._published = processes.from_first((step, self._published))
        return step

    def _publish(self, step: AdaptStep, weights: dict[str, torch.Tensor]) -> None:
        """How a published version reaches the engine: at the next sync, with the policy's weights."""
        self._published = (step.drafting, weights)

    def sync_weights(self) -> None:
        """The policy's weights (a LoRA wrapper's merged) and the version published since the
        last sync, if any, go into the engine in place; the prefix cache is reset."""
        engine = self.llm.llm_engine
        # A LoRA wrapper's weights merged into new tensors (tailrl.trl.lora), not TRL's merge in place.
        named = merged_weights(self.model).items() if is_peft(self.model) else self._iter_named_params()
        weights = {name: p.detach().to(self.dtype) for name, p in named}
        engine.collective_rpc(_load_policy, args=(weights,))
        if self._published is not None:
            version, drafter = self._published
            load_drafter_version(engine, version, drafter, self.dtype)
            self.drafter_version, self._published = version, None
        self.llm.reset_prefix_cache()

    def generate(self, *args, **kwargs):
        self.steps.begin()
        t0 = time.perf_counter()
        out = super().generate(*args, **kwargs)
        seconds = time.perf_counter() - t0
        if self.drafts:  # the drafting version's acceptance, for its rollback watch
            add_tallies(self._tallies, self.steps.tallies)
        calls = processes.across((self.steps.drafts, self.steps.accepted, seconds))
        drafts, accepted = sum(c[0] for c in calls), sum(c[1] for c in calls)
        accept_len = 1.0 + accepted / drafts if drafts else None
        self.stats = GenerationStats(accept_len, self.drafter_version, max(c[2] for c in calls))
        return out

    def save_drafter(self, path: Path) -> Path:
        """The drafting version as tailrl drafter files (what `vllm serve` and tailrl load)."""
        if self.adapt is None:
            raise ValueError("no drafter: TLT runs with spec 'off'" if not self.drafts else
                             "the adapting drafter is process 0's: save it there")
        drafter = copy.deepcopy(self.adapt.learner.drafter)
        drafter.load_state_dict(self.adapt.drafting_weights())
        return save_drafter(drafter, path)

    def state_dict(self) -> dict[str, object] | None:
        """TLT's state for a checkpoint: the adapting drafter's (its learner's weights, optimizer,
        version and next step's data; the rollback watch) and this process's tuner's; on a process
        other than 0, which holds no adapting drafter, its tuner's alone; None without a drafter."""
        if not self.drafts:
            return None
        schedule = self.steps.schedule
        tuner = schedule.tuner.state_dict() if schedule else None
        return {"adapt": self.adapt.state_dict(), "tuner": tuner} if self.adapt is not None else {"tuner": tuner}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Resume state_dict()'s drafter (process 0's, on every process) and tuner; the next sync
        puts the drafting version into the engine (which holds version 0, the drafter's files)."""
        # The trainer's resume put the checkpoint's weights into other tensors than those the
        # view was made on: a new view, or the drafter would go on reading the old ones.
        self.policy = policy_view(self.model)
        adapt = AdaptiveDrafter.open(Path(self.tlt.drafter), self.policy, self.tlt.adapt, state["adapt"])
        if adapt.version != self.drafter_version:
            self._published = (adapt.version, adapt.drafting_weights())
        if self.adapt is not None:
            self.adapt = adapt
            # What end_step did after its checkpointed state: the next step trains on the data that
            # state holds, on the policy as the trainer just loaded it.
            self.adapt.learner.begin_step(self.policy)
        if self.steps.schedule is not None and state["tuner"] is not None:
            self.steps.schedule.tuner.load_state_dict(state["tuner"])

    def close(self) -> None:
        """Shut the engine down (its model and KV cache freed): another may start in this process."""
        vllm_internals.shutdown(self.llm.llm_engine)
