"""The `tailrl` command: parses flags (generated from component configs) and calls components.

Bad input ends with one line on stderr and exit code 2; set TAILRL_DEBUG=1 for the traceback.

Knows: argument parsing, printing. Does not know: how any component works inside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tailrl import config as cfglib
from tailrl.bench.suite import BENCHES, BenchAllConfig
from tailrl.records import Progress
from tailrl.rl.sft import SFTConfig
from tailrl.rollout import registry
from tailrl.rollout.protocol import DrafterVersionError, WorkerError
from tailrl.sampling import SamplingParams
from tailrl.warmup import WarmupConfig, WarmupProgress


def progress_printer(label: str = "") -> Callable[[Progress], None]:
    """A callback that redraws one status line on stderr, at most ~5 times a second."""
    last = [0.0]

    def show(p: Progress) -> None:
        now = time.perf_counter()
        if now - last[0] < 0.2 and p.done < p.total:
            return
        last[0] = now
        rate = p.tokens / p.seconds if p.seconds else 0.0
        end = "\n" if p.done == p.total else ""
        print(
            f"\r{label}{p.done}/{p.total} done | running {p.running:3d} | {p.tokens} tok | {rate:6.1f} tok/s",
            end=end, file=sys.stderr, flush=True,
        )

    return show


# ---- generate ---------------------------------------------------------------------------------

def _generate_sections() -> dict[str, type]:
    from tailrl.generate import GenerateConfig

    return {"generate": GenerateConfig, "sampling": SamplingParams, **registry.generate_sections()}


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample completions for prompts", description="Sample completions for prompts.")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE.jsonl", help='prompts file: objects with "prompt" or "messages"')
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON line per sample, then a stats line")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with [generate], [sampling], [engine] tables")
    cfglib.add_arguments(p, _generate_sections())
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> None:
    from tailrl.generate import completion_text, encode_prompt, generate, load_prompts, make_requests, stop_checker
    from tailrl.loading import load_model, load_tokenizer

    toml = cfglib.read_toml(args.config) if args.config else None
    c = cfglib.resolve(_generate_sections(), args, toml)
    gen = c["generate"]
    prompts = list(args.prompt) + (load_prompts(args.prompts) if args.prompts else [])
    if not prompts:
        raise ValueError("no prompts: give --prompt TEXT or --prompts FILE.jsonl")
    engine = registry.engine(gen.engine)
    registry.refuse_foreign(engine.name, c)
    model = load_model(gen.model, dtype=gen.dtype)
    tok = load_tokenizer(gen.model)
    ids = [encode_prompt(tok, p, gen.chat) for p in prompts]
    requests = make_requests(ids, gen.n, gen.seed)
    progress = None if args.json else progress_printer()
    own = {name: c[name] for name in engine.generate_sections}
    out, summary = generate(engine.name, own, model, requests, c["sampling"], gen.max_new_tokens, gen.seed,
                            stop_checker(tok, args.stop), progress)
    for k, (req, comp) in enumerate(zip(requests, out)):
        text = completion_text(tok, comp, args.stop)
        if args.json:
            print(json.dumps({
                "prompt_index": req.group, "sample_index": k % gen.n, "text": text,
                "token_ids": comp.token_ids, "logprobs": comp.logprobs, "finish_reason": comp.finish_reason,
            }))
        else:
            print(f"--- prompt {req.group} sample {k % gen.n} ({len(comp.token_ids)} tokens, {comp.finish_reason})")
            print(text)
    if args.json:
        print(json.dumps({"stats": summary}))
    else:
        extra = f", accept_len {summary['accept_len']:.2f}" if "accept_len" in summary else ""
        print(f"{summary['tokens']} tokens in {summary['seconds']:.2f} s ({summary['tokens_per_s']:.1f} tok/s{extra})",
              file=sys.stderr)


# ---- train ------------------------------------------------------------------------------------

def _train_sections() -> dict[str, type]:
    from tailrl.pipeline import TRAIN_SECTIONS

    return TRAIN_SECTIONS


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="GRPO training (default: SmolLM2 on the default task)",
        description="GRPO training. With no flags: the default model learns the default reasoning task.",
    )
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/<timestamp>)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with one table per section below")
    _add_report_to(p)
    cfglib.add_arguments(p, _train_sections())
    p.set_defaults(run=_run_train)


def _add_report_to(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report-to", action="append", default=[], choices=["tensorboard", "wandb"],
                   help="also log per-step metrics to TensorBoard (DIR/tensorboard) or Weights & Biases "
                        "(offline unless WANDB_MODE or WANDB_API_KEY is set); repeatable")


def _reporters(args: argparse.Namespace, directory: Path, sections: dict[str, object]):
    import dataclasses

    from tailrl.tracking import open_reporters

    config = {name: dataclasses.asdict(c) for name, c in sections.items()}
    return open_reporters(args.report_to, directory, directory.name, config)


def _run_train(args: argparse.Namespace) -> None:
    from tailrl.pipeline import prepare, run_config
    from tailrl.rl.run_dir import CONFIG_FILE, default_out_dir
    from tailrl.rl.train import train
    from tailrl.tracking import TrainTracking, tee

    if args.resume and args.out:
        raise ValueError("give either --out (a new run) or --resume DIR, not both")
    toml = cfglib.read_toml(args.config) if args.config else None
    if args.resume and toml is None:
        # The run's own resolved config; flags may still change what resume allows (e.g. --steps).
        toml = cfglib.read_toml(Path(args.resume) / CONFIG_FILE)
    cfg = run_config(cfglib.resolve(_train_sections(), args, toml))
    out = Path(args.resume or args.out or default_out_dir())
    show = run_printer()
    if not args.resume:  # a resumed run keeps the model and drafter it started with
        cfg = prepare(cfg, on_event=show, on_warmup=show)
    reporters = _reporters(args, out, cfg.sections())
    try:
        result = train(cfg, out, resume=bool(args.resume), on_event=tee(show, TrainTracking(reporters)))
    finally:
        reporters.close()
    state = "interrupted; resume with --resume" if result.interrupted else "done"
    print(f"tailrl: {state}: {result.out_dir} (step {result.step})", file=sys.stderr)


def run_printer() -> Callable[[Any], None]:
    """Prints the default run's events: phases, cold-start and warm-up progress, then the
    training loop's. A redrawn progress line is ended before the next message."""
    from tailrl.pipeline import Phase
    from tailrl.rl.progress import ConsolePrinter
    from tailrl.rl.sft import EvalResult, SFTProgress
    from tailrl.warmup import WarmupProgress

    loop, cold, warm = ConsolePrinter(), sft_printer(), warmup_printer()
    redrawn = [False]  # the last thing printed is a progress line without its newline

    def show(event: Any) -> None:
        if redrawn[0] and not isinstance(event, (SFTProgress, WarmupProgress, EvalResult)):
            print(file=sys.stderr)
        redrawn[0] = isinstance(event, (SFTProgress, WarmupProgress))
        if isinstance(event, Phase):
            print(f"tailrl: phase {event.index}/{event.total}: {event.name}: {event.detail}", file=sys.stderr,
                  flush=True)
        elif isinstance(event, (SFTProgress, EvalResult)):
            cold(event)
        elif isinstance(event, WarmupProgress):
            warm(event)
        else:
            loop(event)

    return show


# ---- sft --------------------------------------------------------------------------------------

SFT_SECTIONS = {"sft": SFTConfig}


def _add_sft(sub) -> None:
    p = sub.add_parser(
        "sft", help="cold start: fine-tune a model on a task's worked solutions",
        description="Cold start: supervised fine-tuning on a task's worked solutions. Writes a Hugging Face "
                    "model directory (default: the tailrl cache, keyed by base model, task and settings, "
                    "so a second run reuses it) that `tailrl train --model DIR` starts from.",
    )
    p.add_argument("--out", metavar="DIR", help="model directory to write (default: in the tailrl cache)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with an [sft] table")
    cfglib.add_arguments(p, SFT_SECTIONS)
    p.set_defaults(run=_run_sft)


def sft_printer() -> Callable[[Any], None]:
    """Prints `tailrl sft` events: a redrawn progress line with an estimate, one line per evaluation."""
    from tailrl.rl.sft import EvalResult, SFTProgress

    def show(event: Any) -> None:
        if isinstance(event, SFTProgress):
            left = event.seconds / event.step * (event.steps - event.step)
            print(f"\rsft step {event.step}/{event.steps} | loss {event.loss:.4f} | lr {event.lr:.2e} | "
                  f"{event.seconds:.0f} s, ~{left:.0f} s left   ", end="", file=sys.stderr, flush=True)
        elif isinstance(event, EvalResult):
            acc = ", ".join(f"{k} {v:.2f} (format {event.format_rate[k]:.2f}, {event.mean_len[k]:.0f} tok)"
                            for k, v in event.accuracy.items())
            print(f"\nsft eval at step {event.step}: held-out loss {event.loss:.4f}; accuracy {acc}",
                  file=sys.stderr, flush=True)

    return show


def _run_sft(args: argparse.Namespace) -> None:
    from tailrl.rl.sft import sft

    toml = cfglib.read_toml(args.config) if args.config else None
    cfg = cfglib.resolve(SFT_SECTIONS, args, toml)["sft"]
    result = sft(cfg, args.out, on_event=sft_printer())
    if result.cached:
        print(f"tailrl: reusing the cold start in {result.out_dir} ({result.steps} steps)", file=sys.stderr)
    elif result.interrupted:
        print(f"tailrl: interrupted; saved {result.out_dir} after {result.steps} steps", file=sys.stderr)
    print(result.out_dir)


# ---- drafter ----------------------------------------------------------------------------------

def _add_drafter(sub) -> None:
    p = sub.add_parser("drafter", help="train (warm up) and export the speculative drafter")
    d = p.add_subparsers(dest="drafter_command", metavar="ACTION", required=True)
    w = d.add_parser("warmup", help="sample from the target, train a drafter, write it to --out")
    w.add_argument("--out", metavar="DIR", required=True, help="drafter directory to write")
    w.add_argument("--config", metavar="FILE.toml", help="TOML file with a [warmup] table")
    _add_report_to(w)
    cfglib.add_arguments(w, {"warmup": WarmupConfig})
    w.set_defaults(run=_run_warmup)
    e = d.add_parser("export", help="write a drafter as an EAGLE checkpoint for a serving engine")
    e.add_argument("drafter_dir", metavar="DRAFTER_DIR")
    e.add_argument("--out", metavar="DIR", required=True, help="checkpoint directory to write")
    e.add_argument("--for", dest="engine", required=True, choices=["vllm", "sglang"],
                   help="the serving engine whose EAGLE loader reads it (docs/serving.md)")
    e.set_defaults(run=_run_export)


def warmup_printer() -> Callable[[WarmupProgress], None]:
    """Redraws one line on stderr with the drafter warm-up's phase, progress and an estimate."""

    def show(p: WarmupProgress) -> None:
        total = f"/{p.total}" if p.total else ""
        loss = f" loss {p.loss:.4f}" if p.loss is not None else ""
        if p.accept_len is not None:
            loss += f", held-out accept {p.accept_len:.2f}" + (f" of {p.ceiling:.2f}" if p.ceiling is not None else "")
        left = p.seconds_left
        eta = f", ~{left:.0f} s left" if left is not None else ""
        print(f"\rwarmup {p.phase}: {p.done}{total} ({p.seconds:.0f} s{eta}){loss}   ", end="", file=sys.stderr,
              flush=True)

    return show


def _run_warmup(args: argparse.Namespace) -> None:
    from tailrl.tracking import WarmupTracking, tee
    from tailrl.warmup import warmup

    toml = cfglib.read_toml(args.config) if args.config else None
    cfg = cfglib.resolve({"warmup": WarmupConfig}, args, toml)["warmup"]
    tracking = WarmupTracking(_reporters(args, Path(args.out), {"warmup": cfg}))

    try:
        report = warmup(cfg, Path(args.out), on_progress=tee(warmup_printer(), tracking))
        tracking.finish(report)
    finally:
        tracking.reporter.close()
    print(file=sys.stderr)
    print(json.dumps({"drafter": args.out, "accept": report.accept, "vocab_coverage": round(report.vocab_coverage, 4),
                      "train_seconds": round(report.train_seconds, 1), "steps": report.steps}))


def _run_export(args: argparse.Namespace) -> None:
    from tailrl.speculative.drafter.export import export

    out = export(args.drafter_dir, args.out, args.engine)
    print(f"tailrl: EAGLE checkpoint for {args.engine} written to {out} (serve it: docs/serving.md)", file=sys.stderr)


# ---- bench ------------------------------------------------------------------------------------

def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (ratios measured in one run)")
    bench = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    runners = {"generate": _run_bench_generate, "spec": _run_bench_spec, "rollout": _run_bench_rollout,
               "drafter": _run_bench_drafter, "train": _run_bench_train,
               "peers": _run_bench_peers}
    for name, entry in BENCHES.items():
        b = bench.add_parser(name, help=entry.help)
        b.add_argument("--json", action="store_true", help="print one JSON object")
        cfglib.add_arguments(b, {"bench": entry.config})
        b.set_defaults(run=runners[name])
    a = bench.add_parser("all", help="every bench: a JSON file and PNG each, and the results page (docs/results.md)")
    a.add_argument("--config", metavar="FILE.toml", help="one table per bench ([rollout], [train], ...) and [all]")
    a.add_argument("--json", action="store_true", help="print one JSON object: bench -> result file or why skipped")
    cfglib.add_arguments(a, {"all": BenchAllConfig})
    a.set_defaults(run=_run_bench_all)


def _bench_config(args: argparse.Namespace) -> Any:
    return cfglib.resolve({"bench": BENCHES[args.bench].config}, args)["bench"]


def _run_bench_generate(args: argparse.Namespace) -> None:
    from tailrl.bench import generate as bench

    report = bench.report(_bench_config(args), log=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps(report))


def _run_bench_spec(args: argparse.Namespace) -> None:
    from tailrl.bench import speculative as bench

    report = bench.report(_bench_config(args), log=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps(report))
    if not all(r["identical"] for r in report["results"]):
        # Without exact mode a verify forward rounds differently from a one-token step, and a
        # uniform within that rounding of a CDF boundary flips a token (tailrl.model).
        print("tailrl: note: some sequences differ from plain decoding: a verify forward rounds differently "
              "from a one-token step (near-ties; exact mode removes them, see tailrl.model)", file=sys.stderr)


def _run_bench_rollout(args: argparse.Namespace) -> None:
    from tailrl.bench import rollout as bench

    cfg = _bench_config(args)
    report = bench.run(cfg, log=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps(report))


def _run_bench_drafter(args: argparse.Namespace) -> None:
    from tailrl.bench import drafter as bench

    cfg = _bench_config(args)
    result = bench.run(cfg, log=(lambda *_: None) if args.json else (lambda line: print(line, file=sys.stderr)))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"accept_ratio {result['accept_ratio']:.3f} (adaptive over frozen, last {bench.LAST} steps), "
              f"overhead {result['overhead']:.3f}, training on the step's time {result['train_share']:.4f} of it; "
              f"plot {result['png']}")


def _run_bench_train(args: argparse.Namespace) -> None:
    from tailrl.bench import train as bench

    cfg = _bench_config(args)
    report = bench.run(cfg, log=(lambda *_: None) if args.json else (lambda line: print(line, file=sys.stderr)))
    if args.json:
        print(json.dumps(report))
    else:
        for name, r in report["runs"].items():
            lo, hi = r["speedup_step_range"]
            print(f"{name:12s} speedup_e2e {r['speedup_e2e']:.3f} (per step {lo:.2f}-{hi:.2f}), speedup_rollout "
                  f"{r['speedup_rollout']:.3f}; idle s/step: policy {r['idle_policy_s']:.1f}, drafter "
                  f"{r['idle_drafter_s']:.1f}, unused {r['idle_unused_s']:.1f}")
        print(f"identical tokens {report['identical_tokens']}, rewards {report['identical_rewards']}; "
              f"plot {report['png']}")
        budgets = report.get("memory_budget_gb", {})
        print("resident peak: " + ", ".join(
            f"{name} {gb:.1f} GiB" + (f" of {budgets[name]:.1f} budget" if budgets.get(name) is not None else "")
            for name, gb in report["peak_rss_gb"].items() if gb is not None))


def _run_bench_all(args: argparse.Namespace) -> None:
    from tailrl.bench import suite

    toml = cfglib.read_toml(args.config) if args.config else None
    sections = {"all": BenchAllConfig} | {name: entry.config for name, entry in BENCHES.items()}
    # A flag of [all] that a bench also has (--drafter) applies to both.
    configs = cfglib.resolve(sections, args, toml)
    done = suite.run(configs.pop("all"), configs, log=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps(done))


def _run_bench_peers(args: argparse.Namespace) -> None:
    from tailrl.bench import peers as bench

    cfg = _bench_config(args)
    result = bench.run(cfg, log=(lambda *_: None) if args.json else (lambda line: print(line, file=sys.stderr)))
    if args.json:
        print(json.dumps(result))
    else:
        t, r = result["trl"], result["tailrl"]
        print(f"step seconds (median of {cfg.steps}): TRL {t['step_s']:.2f} vs tailrl {r['step_s']:.2f} "
              f"({result['speedup_step']:.2f}x); tokens {t['tokens_generated']} vs {r['tokens_generated']}")
        if "batch1" in result:
            b = result["batch1"]
            print(f"batch 1 tokens/s: transformers plain {b['transformers']['plain']['tok_s']:.1f}, prompt lookup "
                  f"{b['transformers']['lookup']['tok_s']:.1f}; tailrl plain {b['tailrl']['plain']['tok_s']:.1f}, "
                  f"n-gram {b['tailrl']['ngram']['tok_s']:.1f}")


# ---- entry ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailrl",
                                     description="GRPO training with fast, lossless speculative rollouts.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_train(sub)
    _add_sft(sub)
    _add_drafter(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    try:
        args.run(args)
    except (ValueError, OSError) as e:  # bad input: config, model dir, prompts, sampling settings
        if os.environ.get("TAILRL_DEBUG"):
            raise
        print(f"tailrl: error: {e}", file=sys.stderr)
        return 2
    # A rollout worker died or hung, or a drafter version does not fit its engine (a bug, not bad
    # input): the run directory keeps its last checkpoint.
    except (WorkerError, DrafterVersionError) as e:
        if os.environ.get("TAILRL_DEBUG"):
            raise
        print(f"tailrl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntailrl: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
