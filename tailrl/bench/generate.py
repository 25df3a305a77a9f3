"""`tailrl bench generate`: engine tokens/s vs transformers' own `generate`, same work.

Both sides get the same model directory, dtype, thread count, prompts (the default task's, one
distinct problem per row) and greedy decoding with the same max_new_tokens, so they produce
(nearly) the same tokens; tokens/s counts generated tokens up to and including EOS. Each side runs
`repeats` times, alternating, and its median tokens/s is reported: a batch-1 run lasts well under
a second, so one run is at the mercy of whatever else the machine does during it.

Knows: how to time both generators. Does not know: anything about training.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tailrl.engine import Engine, EngineConfig
from tailrl.generate import encode_prompt, make_requests
from tailrl.loading import DEVICES, DTYPES, load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model_dir
from tailrl.rl.tasks import DEFAULT_TASK, format_prompt, make_task
from tailrl.sampling import SamplingParams


@dataclass
class BenchGenerateConfig:
    model: str | None = field(default=None, metadata={"help": "model directory (default: SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations (auto: bf16 where the hardware has it)", "choices": ["auto", "bf16", "fp32"]})
    batch_sizes: tuple[int, ...] = field(default=(1, 8, 64), metadata={"help": "comma-separated batch sizes"})
    max_new_tokens: int = field(default=64, metadata={"help": "tokens generated per row"})
    repeats: int = field(default=3, metadata={"help": "runs per side and batch size, alternating (median reported)"})
    threads: int = field(default=0, metadata={"help": "torch threads for both sides (0: torch's default)"})
    device: str = field(default="auto", metadata={"help": "auto = cuda when present, else cpu", "choices": DEVICES})
    hf_cache: str = field(default="dynamic", metadata={
        "help": "transformers' KV cache: dynamic, or static (on CUDA transformers then compiles its forward)",
        "choices": ["dynamic", "static"]})

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.threads < 0:
            raise ValueError(f"repeats must be >= 1 and threads >= 0, got {self.repeats} and {self.threads}")
        if self.hf_cache not in ("dynamic", "static"):
            raise ValueError(f"hf_cache must be dynamic or static, got {self.hf_cache!r}")


@dataclass
class GenerateRow:
    batch_size: int
    tailrl_tok_s: float
    hf_tok_s: float
    tailrl_tokens: int
    hf_tokens: int

    @property
    def speedup(self) -> float:
        return self.tailrl_tok_s / self.hf_tok_s


def _prompts(tok, n: int) -> list[tuple[int, ...]]:
    task = make_task(DEFAULT_TASK)
    return [encode_prompt(tok, format_prompt(task.sample(0, i).question)) for i in range(n)]


def _hf_generate(hf, tok, prompts: list[tuple[int, ...]], max_new_tokens: int, cache: str) -> tuple[int, float]:
    """Left-padded batch through transformers; returns (generated tokens up to EOS, seconds)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    eos = set(hf.generation_config.eos_token_id if isinstance(hf.generation_config.eos_token_id, list)
              else [hf.generation_config.eos_token_id])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=pad, **({"cache_implementation": "static"} if cache == "static" else {}))
    if out.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = 0
    for row in out[:, width:].tolist():
        for t in row:
            tokens += 1
            if t in eos:
                break
    return tokens, seconds


def run(cfg: BenchGenerateConfig, log=print) -> list[GenerateRow]:
    from transformers import AutoModelForCausalLM

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    path = resolve_model_dir(cfg.model)
    tok = load_tokenizer(path)
    model = load_model(path, dtype=cfg.dtype, device=device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[resolve_dtype(cfg.dtype, device)]).to(device).eval()
    greedy = SamplingParams(temperature=0.0)
    rows = []
    for b in cfg.batch_sizes:
        prompts = _prompts(tok, b)
        engine = Engine(model, EngineConfig(max_batch=max(cfg.batch_sizes)))
        # Warm-up, one whole run a side: the cache allocated, CUDA graphs captured (each side's
        # are made the first time a shape is met), a static cache's forward compiled.
        engine.generate(make_requests(prompts, 1, 0), greedy, cfg.max_new_tokens)
        _hf_generate(hf, tok, prompts, cfg.max_new_tokens, cfg.hf_cache)
        ours, theirs = [], []
        for _ in range(cfg.repeats):
            engine.generate(make_requests(prompts, 1, 0), greedy, cfg.max_new_tokens)
            ours.append(engine.stats.tokens_per_s)
            hf_tokens, hf_s = _hf_generate(hf, tok, prompts, cfg.max_new_tokens, cfg.hf_cache)
            theirs.append(hf_tokens / hf_s)
        row = GenerateRow(b, statistics.median(ours), statistics.median(theirs), engine.stats.tokens, hf_tokens)
        log(f"batch {b:3d}: tailrl {row.tailrl_tok_s:7.1f} tok/s | transformers {row.hf_tok_s:7.1f} tok/s | "
            f"ratio {row.speedup:5.2f}x  (tokens {row.tailrl_tokens} vs {row.hf_tokens})")
        rows.append(row)
    return rows


def report(cfg: BenchGenerateConfig, log=print) -> dict[str, Any]:
    """`run` as the JSON object of `--json`."""
    return {"results": [dict(asdict(r), speedup=round(r.speedup, 3)) for r in run(cfg, log)]}
