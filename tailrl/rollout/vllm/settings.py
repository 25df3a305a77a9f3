"""The vLLM engine's settings: the [vllm] section (flags and TOML), checked as they are read.

Knows: the fields, their checks, the per-batch-size draft-length table, what drafting a
speculating engine does (`Drafting`). Does not know: vLLM's
API (rollout.py), how an engine is opened (config.py), RL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailrl.rollout.vllm.checks import DRAFT_SAMPLING


@dataclass(frozen=True)
class VllmSettings:
    """The [vllm] section (--engine vllm): the engine's memory, batch and speculative decoding."""

    kv_cache_gb: float = field(
        default=2.0, metadata={"help": "vLLM: memory for the KV cache, GiB (allocated at start)"}
    )
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
    speculative_per_batch: str | None = field(
        default=None, metadata={"help": "vLLM: a fixed table of draft tokens per engine step by running batch size, "
                                        "'FIRST-LAST:K,...' from batch 1, e.g. '1-8:4,9-1024:0', in place of --spec's "
                                        "(on: --draft-depth every step; auto: tailrl's tuner picks plain or a draft "
                                        "length per step and running-batch bucket, TLT's adaptive engine)"}
    )
    draft_sampling: str = field(
        default="probabilistic", metadata={"help": "vLLM: the drafter proposes a sample of its distribution or its "
                                                   "argmax (both lossless; a sample is accepted more often at T > 0: "
                                                   "docs/vllm.md)", "choices": DRAFT_SAMPLING}
    )

    engine_restarts: int = field(
        default=3, metadata={"help": "vLLM on Ray (--workers >= 2): dead or hung engines restarted per run before "
                                     "the run stops (docs/workers.md)"}
    )

    def __post_init__(self) -> None:
        if self.engine_restarts < 0:
            raise ValueError(f"engine_restarts must be >= 0, got {self.engine_restarts}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {', '.join(DRAFT_SAMPLING)}, got {self.draft_sampling!r}")
        self.batch_schedule()  # refuse a malformed table now, not when the engine starts

    def batch_schedule(self) -> list[tuple[int, int, int]] | None:
        """speculative_per_batch as vLLM's num_speculative_tokens_per_batch_size: (first, last, K)
        per inclusive range of running batch sizes, starting at 1, in order, not overlapping,
        some K >= 1; None when not given."""
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
            if first != start or last < first or k < 0:
                raise ValueError(f"speculative_per_batch: {first}-{last}:{k} must start at batch {start}, end at or "
                                 f"after it, with K >= 0")
        if not any(k for _, _, k in out):
            raise ValueError(f"speculative_per_batch: {self.speculative_per_batch!r} drafts at no batch size; "
                             f"--spec off runs without speculation")
        return out


@dataclass(frozen=True)
class Drafting:
    """How a speculating engine drafts: its draft tokens per verify at most (vLLM sizes its
    buffers by it), and each step's: a fixed table by running batch size, or, without one, the
    tuner's choice among `tuned` lengths (and plain) per step."""

    num_speculative_tokens: int
    table: list[tuple[int, int, int]] | None
    tuned: tuple[int, ...] = ()
