"""A plain decode step's cost in a speculating vLLM engine against one without speculation.

`--spec auto` on the vLLM engine sets vLLM's draft-length lookup to 0 for the steps tailrl's
tuner decodes plainly. Such a step should cost what a step of an engine without a drafter costs.
This opens the engines as tailrl's vLLM rollout opens them, in one process, on the same model and
dtype: `off` (no drafter) and `k0` (the learned drafter loaded, `--spec auto`, its tuner held at
plain so every step's lookup is 0); with `--vllm-k0` also `k0-vllm`, the same with every step
through vLLM's rejection sampler, as vLLM runs a K = 0 step (what tailrl's was before
internals.sample_plainly_without_drafts). A repetition adds `rows` requests with random prompts
of `--prompt` tokens to each engine, EOS ignored, and decodes them `--steps` tokens, the engines
stepped in turn (so a machine's drift reaches each alike), each step steered and counted as the
rollout does (Steering: the lookup set, the stat logger's counters taken) and its outputs read
as the rollout reads them (SequenceOutput). Only the steps that decode the whole batch are timed
(not those that still compute a prompt, nor the last ones, after the requests admitted first
have finished).

A case's time is the median decode step over its repetitions, ms, beside its ratio to `off`.
`--profile` adds, per case, the ops and vLLM's named phases of a step (sample, draft, ...) whose
own time differs most from `off`'s (torch.profiler over one more repetition of each engine
alone, ms per decode step).

    .venv/bin/python scripts/vllm_plain_steps.py [--model DIR] [--drafter DIR] [--rows 16 32 64]
        [--prompt 256] [--steps 24] [--reps 3] [--vllm-k0] [--profile] [--json FILE]

Without --drafter, a random-weight drafter for the model is built (a K = 0 step never uses the
drafter's predictions, so its acceptance does not matter). docs/vllm.md ("Plain steps in a
speculating engine") has the numbers. Needs vLLM; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def verify_every_step(worker) -> None:
    """On the engine's worker: tailrl's plain sampling of steps without drafts undone
    (tailrl.rollout.vllm.internals.sample_plainly_without_drafts), so that such a step goes
    through vLLM's rejection sampler as vLLM runs it."""
    vars(worker.model_runner.rejection_sampler).pop("forward")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", default=None, help="a tailrl drafter directory (default: a random-weight one)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=24, help="tokens decoded per request and repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vllm-k0", action="store_true", help="also k0-vllm: the K = 0 step as vLLM runs it, every "
                    "step through its rejection sampler (what tailrl's k0 step was before it sampled plainly)")
    ap.add_argument("--profile", action="store_true", help="the ops whose time differs between the engines")
    ap.add_argument("--top", type=int, default=12, help="--profile: this many ops and phases")
    ap.add_argument("--json", default=None, help="also write the cases to this file")
    args = ap.parse_args()

    from tailrl.rollout.vllm.checks import prepare_process

    prepare_process()
    if args.profile:  # vLLM's named phases of a step (sample, draft, bookkeep) in the profile
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    import torch
    from torch.profiler import profile
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams as VllmParams

    from tailrl.kv_cache import KVCache
    from tailrl.loading import load_model
    from tailrl.rollout.vllm.config import VllmRolloutConfig
    from tailrl.rollout.vllm.outputs import SequenceOutput
    from tailrl.rollout.vllm.rollout import VllmRollout
    from tailrl.rollout.vllm.settings import VllmSettings
    from tailrl.speculative.drafter.learner import AdaptConfig
    from tailrl.speculative.drafter.model import Drafter, save_drafter
    from tailrl.speculative.modes import SpeculationConfig
    from tailrl.tuner import PLAIN

    model = load_model(args.model, dtype=args.dtype)
    dtype = model.lm_head.weight.dtype
    tmp = tempfile.TemporaryDirectory(prefix="tailrl-plain-steps-")
    drafter = args.drafter
    if drafter is None:
        vocab = list(range(0, model.cfg.vocab_size, 4))  # a draft vocabulary of a quarter of the target's
        drafter = str(save_drafter(Drafter.from_target(model, vocab, "random"), Path(tmp.name) / "drafter"))
    max_len = args.prompt + args.steps + 32
    # Room for every row at its longest, the drafter's layer beside the target's: no preemption.
    per_token = KVCache.bytes_per_token(model.cfg, dtype) * (model.cfg.num_layers + 1) / model.cfg.num_layers
    settings = VllmSettings(kv_cache_gb=1.25 * max(args.rows) * max_len * per_token / 2**30 + 0.125,
                            max_num_seqs=max(args.rows), max_model_len=max_len)
    engines: dict[str, VllmRollout] = {}
    for name in ["off", "k0"] + (["k0-vllm"] if args.vllm_k0 else []):
        speculation = SpeculationConfig(spec="off" if name == "off" else "auto", drafter=drafter)
        engines[name] = rollout = VllmRolloutConfig(settings, speculation, adapt=AdaptConfig(adapt_drafter=False)).open(
            model, 0)
        # More than one engine open at once: they are only stepped here, none closed while another runs.
        VllmRollout.running = False
        if rollout.steering.schedule is not None:  # every step plain: the whole lookup 0
            rollout.steering.schedule.tuner.step = lambda running: PLAIN
        if name == "k0-vllm":
            rollout.engine.collective_rpc(verify_every_step)

    rng = random.Random(7)
    eos = engines["off"].eos

    def add(rollout: VllmRollout, rows: int) -> dict[str, SequenceOutput]:
        rollout.steering.begin()
        seqs = {}
        for i in range(rows):
            rid = f"{time.monotonic_ns()}-{i}"
            prompt = [rng.randrange(100, 20000) for _ in range(args.prompt)]
            params = VllmParams(temperature=1.0, max_tokens=args.steps, seed=rng.randrange(2**31), logprobs=1,
                                ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA)
            rollout.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
            seqs[rid] = SequenceOutput()
        return seqs

    def step(rollout: VllmRollout, seqs: dict[str, SequenceOutput]) -> tuple[float, bool]:
        """One engine step, steered and read as the rollout's (VllmCall.step); its time and
        whether it was a decode step of the whole batch (every request had its first token
        before it and got one more token in it: requests admitted in different steps finish in
        different steps)."""
        steering, decoding = rollout.steering, all(s.tokens for s in seqs.values())
        steering.before(len(seqs))
        t = time.perf_counter()
        outs = rollout.engine.step()
        seconds = time.perf_counter() - t
        tokens = 0
        for o in outs:
            seq = seqs[o.request_id]
            before = len(seq.tokens)
            seq.extend(o.outputs[0], None, eos)
            tokens += len(seq.tokens) - before
        steering.after(seconds, len(outs), tokens, not decoding)
        return seconds, decoding and tokens == len(seqs)

    def rep(names: list[str], rows: int, prof=None) -> dict[str, list[float]]:
        """One repetition: `rows` requests in each engine, the engines stepped in turn (so a
        machine's drift reaches each alike); each one's decode-step times, s."""
        seqs = {name: add(engines[name], rows) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        while any(engines[name].engine.has_unfinished_requests() for name in names):
            for name in names:
                if engines[name].engine.has_unfinished_requests():
                    if prof is not None and not times[name] and all(s.tokens for s in seqs[name].values()):
                        prof.start()  # at the first decode step (one engine profiled at a time)
                    seconds, decoding = step(engines[name], seqs[name])
                    if decoding:
                        times[name].append(seconds)
        if prof is not None:
            prof.stop()
        return times

    def ops(name: str, rows: int) -> dict[str, float]:
        """ms per decode step by op and by vLLM's named phase (own time)."""
        prof = profile()
        steps = len(rep([name], rows, prof)[name])
        out: dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            out[e.key] += e.self_cpu_time_total / 1e3 / steps
        return out

    rep(list(engines), 2)  # warm the kernels
    names = list(engines)
    print(f"dtype {dtype}, {torch.get_num_threads()} threads, prompts of {args.prompt} tokens; ms per plain decode "
          f"step (median of a case's {args.reps} repetitions' whole-batch decode steps)")
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} / off" for n in names[1:])
          + " |\n|---|" + "---|" * (2 * len(names) - 1))
    cases = []
    for rows in args.rows:
        samples: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.reps):
            for name, times in rep(names, rows).items():
                samples[name] += times
        ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
        case = {"rows": rows, "ms": ms, "ratio": {name: ms[name] / ms["off"] for name in names[1:]}}
        print(f"| {rows} | " + " | ".join(f"{ms[n]:.1f}" for n in names) + " | "
              + " | ".join(f"{case['ratio'][n]:.3f}" for n in names[1:]) + " |", flush=True)
        if args.profile:
            by_op = {name: ops(name, rows) for name in names}
            keys = set().union(*by_op.values())
            top = sorted(keys, key=lambda k: -max(abs(by_op[n].get(k, 0.0) - by_op["off"].get(k, 0.0)) for n in names))
            case["profile_ms"] = {k: {n: by_op[n].get(k, 0.0) for n in names} for k in top[:args.top]}
            for k in top[:args.top]:
                print(f"    {k[:64]:<64}" + "".join(f" {n} {by_op[n].get(k, 0.0):7.2f}" for n in names))
        cases.append(case)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": str(dtype), "threads": torch.get_num_threads(), "prompt": args.prompt,
                       "steps": args.steps, "reps": args.reps, "cases": cases}, f, indent=1)
    tmp.cleanup()


if __name__ == "__main__":
    main()
