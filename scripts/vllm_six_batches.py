"""The vLLM engine's three decoding modes over several rollout batches of the default run.

`tailrl bench rollout` times one batch; on vLLM each mode samples its own tokens (the same
distribution, other responses), so one batch compares different tails. This sums several
batches (steps 1..N of the default run's problem stream) per mode: vllm-off (plain), vllm-drafter
(the learned drafter every step, K = 4) and vllm-auto (tailrl's tuner choosing each step's draft
length). One engine per mode, its tuner's state carried from batch to batch as in training.

    python scripts/vllm_six_batches.py MODEL_DIR DRAFTER_DIR --batches 6 --out six-batches.json
"""

from __future__ import annotations

import argparse
import json
import time

from tailrl.loading import load_model, load_tokenizer
from tailrl.rl.tasks import DEFAULT_TASK, make_task
from tailrl.rl.train import TrainConfig, rollout_requests
from tailrl.rollout.vllm.config import VllmRolloutConfig
from tailrl.rollout.vllm.settings import VllmSettings
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.learner import AdaptConfig
from tailrl.speculative.modes import SpeculationConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("drafter")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tokenizer, model = load_tokenizer(args.model), load_model(args.model, dtype="auto")
    tc = TrainConfig(num_prompts=16, group_size=4, max_new_tokens=512, temperature=1.0, seed=0)
    batches = [rollout_requests(make_task(DEFAULT_TASK), tokenizer, tc, step, tc.num_prompts * (step - 1),
                                model.cfg.max_position_embeddings)[1] for step in range(1, args.batches + 1)]
    modes = {"vllm-off": "off", "vllm-drafter": "on", "vllm-auto": "auto"}
    params, out = SamplingParams(tc.temperature), {}
    for name, spec in modes.items():
        speculation = SpeculationConfig(spec=spec, drafter=args.drafter, draft_depth=4, num_draft_tokens=4)
        rollout = VllmRolloutConfig(VllmSettings(max_num_seqs=64), speculation,
                                    adapt=AdaptConfig(adapt_drafter=False)).open(model, seed=0)
        rollout.generate(0, batches[0][:2], params, 2)  # warm the kernels: untimed
        seconds, tokens, accept, sd, buckets = [], [], [], [], []
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            completions = rollout.generate(i + 1, batch, params, tc.max_new_tokens)
            seconds.append(time.perf_counter() - t0)
            report = rollout.report()
            tokens.append(sum(len(c.token_ids) for c in completions))
            accept.append(report.spec_accept_len)
            sd.append(report.sd_fraction)
            buckets.append(report.by_bucket)
        rollout.close()
        out[name] = dict(seconds=seconds, tokens=tokens, accept_len=accept, sd_fraction=sd, by_bucket_last=buckets[-1])
        print(f"{name:>12}: {sum(seconds):6.1f} s, {sum(tokens)} tokens, {sum(tokens) / sum(seconds):6.1f} tok/s, "
              f"accept_len {sum(accept) / len(accept):.2f}, SD share {sum(sd) / len(sd):.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
