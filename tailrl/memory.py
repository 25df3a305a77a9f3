"""Peak resident memory of this process over a phase of work, as the kernel counts it.

Linux keeps a process's resident high-water mark (VmHWM in /proc/self/status) and resets it to
the current resident size when "5" is written to /proc/self/clear_refs, so a phase's peak is
read at its end after a reset at its start. Elsewhere (or where /proc is read-only) the peak is
unknown: `Peak.gb` is None then, never a guess.

`fix_mmap_threshold` stops glibc's malloc from keeping the update's freed tensors in its heap
(docs/memory.md, "The allocator").

`available_gb` is what the kernel says the process may still take: MemAvailable, or less where
a cgroup (v2) limit is nearer.

`resident_gb` is this process's resident size now (VmRSS).

`total_gb` is the memory the machine gives this process: MemTotal, or a cgroup (v2) limit where
that is less.

`parameters_gb` is what a module's parameters hold.

`trim` hands the free pages malloc keeps in its arenas back to the kernel.

`lazy_zeros` is a zero tensor whose pages become resident only as they are written (a KV cache
sized for every sequence's worst case holds only the positions its sequences reach); `release`
zeroes a piece of one again and hands its pages back (a cache slot whose sequence finished).

Knows: /proc, /sys/fs/cgroup, glibc's mallopt. Does not know: what the phases are.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import weakref
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MEMINFO = Path("/proc/meminfo")
_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_MADV_DONTNEED = 4  # Linux mman.h
MMAP_THRESHOLD = 4 * 2**20
_CGROUP = Path("/sys/fs/cgroup")


def _status_kb(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def resident_gb() -> float | None:
    """This process's resident size now, in GiB; None where the kernel does not say."""
    kb = _status_kb("VmRSS")
    return kb / 2**20 if kb is not None else None


class Peak:
    """The resident peak from `start()` to `gb` (in GiB; None where the kernel cannot tell)."""

    def __init__(self) -> None:
        self._reset = False

    def start(self) -> Peak:
        try:
            _CLEAR_REFS.write_text("5")
            self._reset = True
        except OSError:
            self._reset = False
        return self

    @property
    def gb(self) -> float | None:
        kb = _status_kb("VmHWM") if self._reset else None
        return kb / 2**20 if kb is not None else None


def _meminfo_gb(key: str) -> float | None:
    """A /proc/meminfo entry in GiB; None where the kernel does not say."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _cgroup_gb(left: bool) -> float | None:
    """This process's cgroup memory limit in GiB (left: less what the cgroup uses); None where
    there is no limit or the kernel does not say."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int((_CGROUP / "memory.current").read_text()) if left else 0
        return (int(limit) - used) / 2**30
    except (OSError, ValueError):
        return None


def _least(*gbs: float | None) -> float | None:
    known = [g for g in gbs if g is not None]
    return min(known) if known else None


def available_gb() -> float | None:
    """GiB this process may still allocate before the kernel's OOM killer acts; None where
    the kernel does not say."""
    return _least(_meminfo_gb("MemAvailable"), _cgroup_gb(left=True))


def total_gb() -> float | None:
    """GiB of memory this process runs in: the machine's, or its cgroup's limit where less; None
    where the kernel does not say."""
    return _least(_meminfo_gb("MemTotal"), _cgroup_gb(left=False))


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation of `threshold` bytes or more from a mapping of its own, returned to
    the kernel when freed. glibc's default raises the threshold as large blocks are freed (up to
    32 MB), so a checkpointed forward's kept layer inputs, allocated between freed transients of
    that size, pin the heap: 1.6 GB of a 3.7 GB update peak at 4,096 tokens (docs/memory.md).
    A user's MALLOC_MMAP_THRESHOLD_ wins. True where glibc took the setting."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


def trim() -> bool:
    """Return the free memory of every malloc arena to the kernel (glibc's malloc_trim): a
    thread's arena grows to the most its tensors below the mmap threshold ever held at once and
    keeps it when they are freed (the update's, after a step). True where glibc did so."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False


def parameters_gb(module: torch.nn.Module) -> float:
    """GiB a module's parameters hold (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zeros; on the CPU on an anonymous mapping of their own, which the kernel maps to its shared
    zero page until written: only the pages written are resident (torch.zeros writes, and so
    holds, every page). Unmapped with the tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared ones fill on reading
    t = torch.frombuffer(pages, dtype=torch.uint8)
    start = t.data_ptr()
    _LAZY[start] = nbytes
    weakref.finalize(pages, _forget, start)  # the mapping lives while a tensor on it does
    return t.view(dtype).view(shape)


_LAZY: dict[int, int] = {}  # start address -> length of the mappings lazy_zeros made and still holds
_libc: ctypes.CDLL | None = None


def _forget(start: int) -> None:
    _LAZY.pop(start, None)


def _madvise_dontneed(start: int, length: int) -> bool:
    global _libc
    try:
        _libc = _libc or ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc
        return False
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED) == 0


def is_lazy(t: torch.Tensor) -> bool:
    """Whether t lies on a mapping of `lazy_zeros` (so `release` may hand its pages back)."""
    if t.device.type != "cpu":
        return False
    begin = t.untyped_storage().data_ptr()
    end = begin + t.untyped_storage().nbytes()
    return any(start <= begin and end <= start + length for start, length in _LAZY.items())


def release(t: torch.Tensor) -> int:
    """Zero a contiguous piece of a `lazy_zeros` tensor and return its whole pages to the kernel
    (madvise MADV_DONTNEED: they read as zeros again, resident only once written). Bytes handed
    back; 0 for any other tensor (left as it is) or where the kernel refuses."""
    if not t.is_contiguous() or t.numel() == 0 or not is_lazy(t):
        return 0
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    first, last = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    flat = t.view(-1).view(torch.uint8)
    if last <= first or not _madvise_dontneed(first, last - first):
        flat.zero_()
        return 0
    # Bytes of the piece outside its whole pages are zeroed by hand: the whole piece reads as zeros.
    flat[: first - begin].zero_()
    flat[last - begin :].zero_()
    return last - first
