"""The memory floor of an RL step (tailrl.rl.floor): counted by hand on the tiny model, and a
run whose floor passes what the machine has stops before it starts, naming the settings."""

import pytest

from conftest import tiny_configs

from tailrl.loading import load_model
from tailrl.pipeline import run_config
from tailrl.rl import train as train_mod
from tailrl.rl.floor import update_gb
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.train import train


def test_the_update_floor_is_the_kept_tensors_and_one_logits_chunk(tiny_dir):
    model = load_model(tiny_dir, dtype="fp32")  # conftest.TINY: hidden 64, intermediate 128, 2 layers, vocabulary 96
    cfg = GRPOConfig(micro_batch=4, micro_batch_tokens=100, checkpoint_tokens=60, logprob_chunk=32)
    # 3 responses of 30 tokens fit 100 tokens: 90 > 60, checkpointed: each layer keeps its fp32
    # input (64 x 4 bytes a token), one layer is recomputed ((9 x 64 + 4 x 128) x 4 bytes a token);
    # one chunk of 32 tokens' logits and fp32 log-softmax (96 x (4 + 4) bytes a token).
    assert update_gb(model, cfg, False, 4, 30) * 2**30 == 90 * (2 * 64 * 4 + 1088 * 4) + 32 * 96 * 8
    # Not checkpointed, bf16 autocast: both layers keep their tensors at 2 bytes.
    cfg = GRPOConfig(micro_batch=4, micro_batch_tokens=100, checkpoint_tokens=1000, logprob_chunk=32)
    assert update_gb(model, cfg, True, 4, 30) * 2**30 == 90 * 2 * 1088 * 2 + 32 * 96 * 6
    # A response longer than the micro-batch budget gets one of its own.
    assert update_gb(model, cfg, True, 4, 300) * 2**30 == 300 * 2 * 1088 * 2 + 32 * 96 * 6


def test_a_run_that_cannot_fit_stops_before_it_starts(char_model_dir, task_file, tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod, "available_gb", lambda: 0.001)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"needs at least \d+\.\d GiB more than this process holds, and 0\.0 GiB is "
                                         r"available: .*\(--kv-budget-gb, --workers\).*\(--micro-batch-tokens, "):
        train(run_config(tiny_configs(char_model_dir, task_file)), out)
    assert not out.exists()
