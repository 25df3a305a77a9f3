"""vLLM engine layouts on one machine: 1 engine x 2 threads (in process) against 2 engines x 1
thread (Ray actors, `--engine vllm --workers 2`), on the default run's batch.

The batch is the default run's first step (16 prompts x 4 samples of the default task, T = 1,
max_new_tokens 512). Each rollout runs on a freshly opened rollout (tailrl.rollout.vllm's
config, as a run opens it), after two untimed warm-up requests; the layouts alternate within a
repetition, with speculation off and with `--spec auto` on a learned drafter (frozen: a rollout,
not an RL step). One JSON line per rollout: its layout, start and rollout seconds, tokens,
tok/s, accept_len.

    .venv/bin/python scripts/vllm_layouts.py --model COLD --drafter DRAFTER [--reps 2]

The table in docs/workers.md ("vLLM engines on Ray") comes from this script. Needs vLLM and
Ray. Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (a cold start's)")
    ap.add_argument("--drafter", required=True, help="learned drafter directory for --spec auto")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    import torch

    from tailrl.loading import load_model, load_tokenizer
    from tailrl.rl.tasks import make_task
    from tailrl.rl.train import TrainConfig, rollout_requests
    from tailrl.rollout.vllm.config import VllmRolloutConfig
    from tailrl.rollout.vllm.settings import VllmSettings
    from tailrl.rollout.workers import WorkerConfig
    from tailrl.sampling import SamplingParams
    from tailrl.speculative.drafter.learner import AdaptConfig
    from tailrl.speculative.modes import RolloutSpeculationConfig

    model = load_model(args.model, "auto")
    tc = TrainConfig()
    requests = rollout_requests(make_task(tc.task), load_tokenizer(args.model), tc, 1, 0,
                                model.cfg.max_position_embeddings)[1]
    print(f"{len(requests)} requests, max_new_tokens {tc.max_new_tokens}, {model.lm_head.weight.dtype}, "
          f"{torch.get_num_threads()} torch threads here", flush=True)
    params = SamplingParams(tc.temperature)
    for rep in range(args.reps):
        for spec in ("off", "auto"):
            for engines, threads in ((1, 2), (2, 1)):
                cfg = VllmRolloutConfig(VllmSettings(max_num_seqs=len(requests)),
                                        RolloutSpeculationConfig(spec=spec, drafter=args.drafter),
                                        adapt=AdaptConfig(adapt_drafter=False),
                                        workers=WorkerConfig(workers=engines, worker_threads=threads))
                t0 = time.perf_counter()
                rollout = cfg.open(model, seed=0)
                start = time.perf_counter() - t0
                try:
                    rollout.generate(0, requests[:2], params, 2)
                    t0 = time.perf_counter()
                    out = rollout.generate(1, requests, params, tc.max_new_tokens)
                    seconds = time.perf_counter() - t0
                    report = rollout.report()
                finally:
                    rollout.close()
                tokens = sum(len(c.token_ids) for c in out)
                print(json.dumps({"rep": rep, "spec": spec, "layout": f"{engines}x{threads}",
                                  "start_s": round(start, 1), "seconds": round(seconds, 1), "tokens": tokens,
                                  "tok_s": round(tokens / seconds, 1),
                                  "accept_len": round(report.spec_accept_len, 2)}), flush=True)


if __name__ == "__main__":
    main()
