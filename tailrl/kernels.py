"""What exact mode needs from the CPU math libraries under torch, which are set per process.

Exact mode (tailrl.model, "Row invariance") fixes every matmul's shape, so the library picks the
same kernel for a row whatever else the batch holds. The thread count picks kernels too, and it
changes inside a run: the in-process engine decodes on one torch thread fewer while it lends a
core to the overlapped update (tailrl.rl.phases). So an exact-mode row must come out the same
bits on one thread as on several.

Which library computes what on CPU (torch's x86 builds): fp32 matmuls go to MKL's sgemm; bf16
ones to oneDNN's matmul where oneDNN has bf16 instructions for the CPU (AVX512-BF16, AMX), else
to torch's own kernels. (Ordinary decoding's prepacked linears are oneDNN's, tailrl.linears;
exact mode never takes them.) MKL picks its code path by vendor and instruction set, and on some
paths a small sgemm splits its work differently on one thread than on two, which reorders a
sum. MKL documents one switch that removes this: conditional numerical reproducibility (CNR) in
strict mode, `MKL_CBWR=AUTO,STRICT`. In strict mode ?gemm on MKL's AVX2 and AVX-512 code paths
gives the same bits whatever the number of threads; AUTO keeps the code path MKL would pick
anyway. oneDNN has no such switch; its bf16 matmuls are checked like MKL's (below).

MKL reads the setting once, at its first call in a process, so it has to be in the environment
before torch's first fp32 matmul there; processes started later (worker processes, Ray actors)
inherit it. It is not set for every process: strict mode slows MKL's one-row products (a
batch-1 fp32 decode step; docs/lossless.md), so only a process that asks for exact mode sets it
(`request_reproducible_kernels`, called by EngineConfig(exact=True), the earliest point a CLI
command, a TOML file, a resumed run or a user's script declares it). An exact engine then
checks the property on its own weights before it decodes (`check_thread_invariance`): a process
whose MKL started before the request fails at once, saying what to do, instead of drifting
apart in a rollout's tail.

Knows: MKL's reproducibility switch, torch's thread count. Does not know: engines, sampling.
"""

from __future__ import annotations

import os

import torch

from tailrl.linears import Linear
from tailrl.model import Transformer

MKL_MODE_VARIABLE = "MKL_CBWR"
MKL_STRICT_MODE = "AUTO,STRICT"


class ExactModeError(ValueError):
    """Exact mode cannot hold in this process (a bad setting, not a bug: the CLI's exit code 2)."""


def request_reproducible_kernels() -> None:
    """Ask MKL for its strict reproducible mode in this process and the processes it starts,
    unless the user chose an MKL_CBWR setting. Takes effect only where MKL has not run yet."""
    os.environ.setdefault(MKL_MODE_VARIABLE, MKL_STRICT_MODE)


def check_thread_invariance(model: Transformer) -> None:
    """Raise ExactModeError unless a block of exact-mode rows through each of `model`'s linear
    shapes gives the same bits on one torch thread as on this process's count.

    A necessary condition, cheap (one block per distinct weight shape): it catches a process
    whose math library runs in a thread-dependent mode; the model tests check whole forwards."""
    threads = torch.get_num_threads()
    weight = model.lm_head.weight
    if threads == 1 or weight.device.type != "cpu":
        return
    shapes = {(tuple(m.weight.shape), m.exact_rows(weight.dtype)): m for m in model.modules() if isinstance(m, Linear)}
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for ((n, k), rows), layer in shapes.items():
                x = torch.randn(rows, k, generator=gen).to(weight.dtype)  # (rows, k)
                torch.set_num_threads(1)
                one = layer(x, exact=True)
                torch.set_num_threads(threads)
                if not torch.equal(one, layer(x, exact=True)):
                    raise ExactModeError(_diagnosis(weight.dtype, f"{rows} x {k} -> {n}", threads))
    finally:
        torch.set_num_threads(threads)


def _diagnosis(dtype: torch.dtype, shape: str, threads: int) -> str:
    what = f"exact mode: {dtype} products of {shape} give other bits on 1 torch thread than on {threads}"
    if dtype == torch.float32:
        return (f"{what}: MKL computes them, and its strict reproducible mode ({MKL_MODE_VARIABLE}={MKL_STRICT_MODE}) "
                f"takes effect only if set before MKL's first call in the process: set it in the environment, or "
                f"ask for exact mode before torch's first matmul (docs/lossless.md)")
    return f"{what}: this CPU's kernels cannot give exact mode in {dtype} (docs/lossless.md)"
