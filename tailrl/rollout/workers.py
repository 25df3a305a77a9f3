"""The [workers] section, which both engines read, and how a step's requests are split among
workers: how many engines decode a step side by side, where they run, when one counts as hung.

The native engine runs its workers as local processes or Ray actors (tailrl.rollout.native);
the vLLM engine as Ray actors, one engine each (tailrl.rollout.vllm.fleet). Either way each
worker decodes one contiguous, equal share of the step's requests.

Knows: the section's fields and checks, shards. Does not know: any engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerConfig:
    """Rollout workers: how many, where they run, when one counts as hung."""

    workers: int = field(default=1, metadata={
        "help": "rollout workers (1 = one engine in the trainer's process); vLLM's run as Ray actors"})
    ray: bool = field(default=False, metadata={
        "help": "run the workers as Ray actors (local Ray unless --ray-address)"})
    ray_address: str | None = field(default=None, metadata={"help": "Ray cluster to join (implies --ray)"})
    worker_threads: int = field(default=1, metadata={"help": "torch threads per worker process or actor"})
    worker_timeout_s: float = field(
        default=300.0, metadata={"help": "a worker silent this long (no progress, no reply) counts as hung"}
    )

    def __post_init__(self) -> None:
        if self.workers < 1 or self.worker_threads < 1:
            raise ValueError(f"workers and worker_threads must be >= 1, got {self.workers} and {self.worker_threads}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")

    @property
    def use_ray(self) -> bool:
        return self.ray or self.ray_address is not None


def shard_indices(n: int, workers: int) -> list[range]:
    """Contiguous shards of n requests, sizes differing by at most one (siblings are adjacent,
    so GRPO groups stay whole whenever the shard size allows)."""
    base, extra = divmod(n, workers)
    bounds = [0]
    for rank in range(workers):
        bounds.append(bounds[-1] + base + (rank < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
