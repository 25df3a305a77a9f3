"""The vLLM engine's settings: the [vllm] section (flags and TOML), checked as they are read.

Knows: the fields, their checks, the per-batch-size draft-length table. Does not know: vLLM's
API (rollout.py), how an engine is opened (config.py), RL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailrl.rollout.vllm.checks import DRAFT_SAMPLING


@dataclass(frozen=True)
class VllmSettings:
    """The [vllm] section (--engine vllm): the engine's memory, batch and speculative decoding."""

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
        default=None, metadata={"help": "vLLM: drafter directory: a tailrl drafter (learned: trained on the run's "
                                        "responses, each version pushed into the engine; `tailrl train` warms one up "
                                        "unless --no-warmup-drafter), an EAGLE export or a small model of the "
                                        "target's vocabulary (fixed); None = no speculation"}
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "vLLM: draft tokens per verify; also the depth of the reported chain ceiling"}
    )
    speculative_per_batch: str = field(
        default="auto", metadata={"help": "vLLM: draft tokens per engine step: auto (tailrl's tuner picks plain or a "
                                          "draft length per step, per running-batch bucket, from measured throughput: "
                                          "TLT's adaptive engine) or a fixed table by running batch size, "
                                          "'FIRST-LAST:K,...' from batch 1, e.g. '1-8:4,9-1024:0'"}
    )
    draft_sampling: str = field(
        default="probabilistic", metadata={"help": "vLLM: the drafter proposes a sample of its distribution or its "
                                                   "argmax (both lossless; a sample is accepted more often at T > 0: "
                                                   "docs/vllm.md)", "choices": DRAFT_SAMPLING}
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

    def tuned_lengths(self) -> tuple[int, ...]:
        """The draft lengths the tuner chooses among (besides plain) with speculative_per_batch
        auto: num_speculative_tokens and half of it."""
        k = self.num_speculative_tokens
        return tuple(sorted({max(1, k // 2), k}))

    def batch_schedule(self) -> list[tuple[int, int, int]] | None:
        """A fixed speculative_per_batch as vLLM's num_speculative_tokens_per_batch_size: (first,
        last, K) per inclusive range of running batch sizes, starting at 1, in order, not
        overlapping; None for auto."""
        if self.speculative_per_batch == "auto":
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
