"""Where a `tailrl train` run's resident memory sits, phase by phase (docs/memory.md).

    python scripts/step_memory.py OUT.json -- train [tailrl train flags]

Runs the CLI in this process with a probe around it: a thread samples /proc/self/status (RssAnon,
RssFile, RssShmem: Ray's object store mapped in) and glibc's mallinfo2 (bytes in use and free in
malloc's arenas, bytes in malloc's own mappings) every 0.2 s, each sample labelled with the phase
the trainer is in (hooks on the step's stages: rollout, drain, finish, clip, optimizer, trim (the
publish after it included), save); at each phase's end it
takes a snapshot: the same counters, /proc/self/smaps by kind of mapping, and the live tensors
reachable from Python by owner (the policy's parameters and gradients, each AdamW's moments, the
rest), storages counted once. Writes OUT.json: per step and phase the peak sample and the
snapshot. Tensors autograd keeps for a backward and those of C++ threads are not reachable from
Python: they show as malloc's in-use bytes and mappings beyond the tensors counted.

Knows: /proc, glibc, the trainer's stage names. Changes nothing the run computes.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

GIB = 2**30


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def counters() -> dict[str, float]:
    status = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            status[k] = int(v.split()[0]) * 1024 / GIB
    m = _libc.mallinfo2()
    return {"rss": status["VmRSS"], "anon": status["RssAnon"], "file": status["RssFile"], "shmem": status["RssShmem"],
            "hwm": status["VmHWM"],
            "malloc_in_use": m.uordblks / GIB, "malloc_free": m.fordblks / GIB,
            "malloc_mmapped": m.hblkhd / GIB, "malloc_arena": m.arena / GIB}


_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def smaps_by_kind() -> dict[str, float]:
    """Resident GiB by kind of mapping: [heap], anonymous >= 4 MB (tensors of their own), smaller
    anonymous (malloc's thread arenas are 64 MB reservations), files, other."""
    out: dict[str, float] = {}
    kind = None
    size = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        h = _HEADER.match(line)
        if h and not line.startswith(("Rss", "Size")):
            start, end, name = int(h.group(1), 16), int(h.group(2), 16), h.group(3).strip()
            size = end - start
            if name == "[heap]":
                kind = "heap"
            elif name.startswith("/"):
                kind = "files"
            elif name == "":
                kind = "anon >= 64 MB" if size >= 64 * 2**20 else "anon 4-64 MB" if size >= 4 * 2**20 else "anon < 4 MB"
            else:
                kind = "other"
        elif line.startswith("Rss:") and kind is not None:
            out[kind] = out.get(kind, 0.0) + int(line.split()[1]) * 1024 / GIB
    return {k: round(v, 3) for k, v in sorted(out.items())}


_OPTIMIZERS: list[torch.optim.Optimizer] = []


def _tensors_alive() -> list[torch.Tensor]:
    """Every tensor the garbage collector tracks. The walk holds a reference to every object,
    other threads' half-built tuples included, and a thread that then fills one fails
    (PyTuple_SetItem: "bad argument to internal function"; it stopped a run in the update's
    backward): so no other thread runs until those references are dropped (the interpreter's
    switch interval raised, and no warning written, whose write could yield)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            found = [o for o in objects if isinstance(o, torch.Tensor)]
            del objects
    finally:
        sys.setswitchinterval(interval)
    return found


def tensors_by_owner() -> dict[str, float]:
    """GiB of live tensor storages reachable from Python, by owner, each storage once."""
    owner: dict[int, str] = {}
    sizes: dict[int, int] = {}

    def claim(t: torch.Tensor, name: str) -> None:
        if t.device.type != "cpu":
            return
        s = t.untyped_storage()
        key = s.data_ptr()
        if key and key not in owner:
            owner[key], sizes[key] = name, s.nbytes()

    for i, opt in enumerate(_OPTIMIZERS):
        n = sum(p.numel() for g in opt.param_groups for p in g["params"])
        label = f"optimizer {i} ({n / 1e6:.0f}M params)"
        for g in opt.param_groups:
            for p in g["params"]:
                claim(p, f"{label}: params")
                if p.grad is not None:
                    claim(p.grad, f"{label}: .grad")
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    claim(v, f"{label}: moments")
    for obj in _tensors_alive():
        try:
            claim(obj, "other tensors >= 4 MB" if obj.untyped_storage().nbytes() >= 4 * 2**20 else "other tensors")
        except Exception:  # noqa: BLE001 - a tensor being torn down
            pass
    out: dict[str, float] = {}
    for key, name in owner.items():
        out[name] = out.get(name, 0.0) + sizes[key] / GIB
    return {k: round(v, 3) for k, v in sorted(out.items())}


class Probe:
    def __init__(self, every_s: float = 0.2):
        self.phase = "start"
        self.step = 0
        self.records: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.every_s = every_s
        self.computing = 0  # groups whose gradient share is being computed now
        self.grads = None  # the step's GroupGradients
        self.events: list[dict] = []  # groups finished (submitted) and computed, with times
        self.snapshots = os.environ.get("PROBE_SNAPSHOTS", "1") != "0"
        self.stopped = threading.Event()
        threading.Thread(target=self._sample, daemon=True, name="memory-probe").start()

    def _key(self) -> str:
        return f"{self.step}:{self.phase}"

    def _sample(self) -> None:
        while not self.stopped.wait(self.every_s):
            c = counters()
            c["groups_computing"] = self.computing
            c["buffers_waiting"] = self.grads.held_buffers if self.grads is not None else 0
            with self.lock:
                rec = self.records.setdefault(self._key(), {"step": self.step, "phase": self.phase})
                if c["rss"] > rec.get("peak", {}).get("rss", -1):
                    rec["peak"] = {k: round(v, 3) for k, v in c.items()}
                    rec["peak_at_s"] = round(time.perf_counter() - T0, 1)

    def enter(self, phase: str) -> None:
        with self.lock:
            self.phase = phase
            self.records.setdefault(self._key(), {"step": self.step, "phase": phase,
                                                  "start_s": round(time.perf_counter() - T0, 1)})

    def snapshot(self, label: str) -> None:
        if not self.snapshots:
            return
        snap = {"counters": {k: round(v, 3) for k, v in counters().items()}, "smaps": smaps_by_kind(),
                "tensors": tensors_by_owner(), "at_s": round(time.perf_counter() - T0, 1)}
        with self.lock:
            self.records.setdefault(f"{self.step}:{label}", {"step": self.step, "phase": label})["snapshot"] = snap
        print(f"[probe] step {self.step} {label}: rss {snap['counters']['rss']:.2f} in use "
              f"{snap['counters']['malloc_in_use']:.2f} free {snap['counters']['malloc_free']:.2f} "
              f"tensors {sum(snap['tensors'].values()):.2f}", file=sys.stderr, flush=True)

    def write(self, path: Path) -> None:
        with self.lock:
            path.write_text(json.dumps({"phases": list(self.records.values()), "events": self.events}, indent=1))


T0 = time.perf_counter()


def install(probe: Probe) -> None:
    import tailrl.rl.phases as phases_mod
    import tailrl.rl.train as train_mod
    import tailrl.rl.update as update_mod

    def wrap(owner, name, phase, snap_after=None, step_start=False):
        fn = getattr(owner, name)

        def wrapped(*a, **k):
            if step_start:
                probe.step += 1
            probe.enter(phase)
            try:
                return fn(*a, **k)
            finally:
                if snap_after:
                    probe.snapshot(snap_after)

        setattr(owner, name, wrapped)

    orig_init = torch.optim.AdamW.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        _OPTIMIZERS.append(self)
        _OPTIMIZERS.sort(key=lambda o: -sum(p.numel() for g in o.param_groups for p in g["params"]))

    torch.optim.AdamW.__init__ = init
    wrap(train_mod.Trainer, "rollout_and_gradient", "rollout", step_start=True)
    wrap(update_mod.BackgroundUpdate, "drain", "drain", snap_after="after drain")
    wrap(update_mod.GroupGradients, "finish", "finish")
    wrap(train_mod.Trainer, "clip", "clip")
    orig_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        if _OPTIMIZERS and self is _OPTIMIZERS[0]:
            probe.enter("optimizer")
        return orig_step(self, *a, **k)

    torch.optim.AdamW.step = step
    wrap(train_mod, "trim", "trim", snap_after="after trim")
    wrap(train_mod.Trainer, "save", "save", snap_after="after save")
    wrap(train_mod.Trainer, "evaluate_heldout", "eval")

    orig_add = update_mod.GroupGradients.add

    def add(self, group, samples, key):
        probe.grads = self
        probe.computing += 1
        t = time.perf_counter() - T0
        tokens = sum(len(s.prompt_ids) + len(s.token_ids) for s in samples)
        try:
            return orig_add(self, group, samples, key)
        finally:
            probe.computing -= 1
            probe.events.append({"step": probe.step, "event": "computed", "group": group, "tokens": tokens,
                                 "start_s": round(t, 2), "end_s": round(time.perf_counter() - T0, 2),
                                 "thread": threading.current_thread().name})

    orig_submit = update_mod.BackgroundUpdate.submit

    def submit(self, group, samples, key):
        probe.events.append({"step": probe.step, "event": "finished", "group": group, "samples": len(samples),
                             "key": key, "at_s": round(time.perf_counter() - T0, 2)})
        return orig_submit(self, group, samples, key)

    update_mod.BackgroundUpdate.submit = submit

    for name, is_open in (("open_gate", True), ("close_gate", False)):
        def gate(self, _orig=getattr(update_mod.BackgroundUpdate, name), _open=is_open):
            if getattr(self, "_probe_gate", None) != _open:
                self._probe_gate = _open
                probe.events.append({"step": probe.step, "event": "gate open" if _open else "gate closed",
                                     "at_s": round(time.perf_counter() - T0, 2)})
            return _orig(self)

        setattr(update_mod.BackgroundUpdate, name, gate)

    update_mod.GroupGradients.add = add

    # The rollout's end: the drain is entered right after (phases.run_step reads the peak there).
    orig_drain = update_mod.BackgroundUpdate.drain

    def drain(self):
        probe.events.append({"step": probe.step, "event": "rollout end", "at_s": round(time.perf_counter() - T0, 2)})
        probe.snapshot("rollout end")
        return orig_drain(self)

    update_mod.BackgroundUpdate.drain = drain
    del phases_mod


def main() -> int:
    out = Path(sys.argv[1])
    args = sys.argv[sys.argv.index("--") + 1:]
    probe = Probe()
    install(probe)
    from tailrl.cli import main as cli_main

    try:
        return cli_main(args)
    finally:
        probe.stopped.set()
        probe.write(out)


if __name__ == "__main__":
    sys.exit(main())
