"""The run's memory budget (tailrl.rl.budget): the update's micro-batches sized to it, counted by
hand on the tiny model; a run sized to it records the settings and the budget, and a budget that
cannot hold the run stops it before it starts."""

import dataclasses

import pytest

from conftest import tiny_configs

from tailrl.cli import main
from tailrl.loading import load_model
from tailrl.pipeline import run_config
from tailrl.rl.budget import Budget, size_update
from tailrl.rl.grpo import GRPOConfig
from tailrl.rl.run_dir import RunDir
from tailrl.rl.train import train

WEIGHTS = 2**20 / 2**30  # a gradient buffer of 1 MiB
WAITING = GRPOConfig().waiting_gradients  # gradient buffers waiting to be added, the sum among them


def _budget(room_bytes: float, fixed_gb: float = 3.0, waiting: int = WAITING) -> Budget:
    """A budget leaving, beside `waiting` buffers, the group being computed its gradient buffer and
    room_bytes more."""
    return Budget(fixed_gb + waiting * WEIGHTS + WEIGHTS + room_bytes / 2**30, {"models and optimizer": fixed_gb})


def test_the_budget_sizes_checkpointing_and_micro_batches_by_hand(tiny_dir):
    m = load_model(tiny_dir, dtype="fp32").cfg  # conftest.TINY: hidden 64, intermediate 128, 2 layers, vocabulary 96
    # Per token in fp32, times SLACK 1.25: a micro-batch kept whole keeps both layers'
    # (9 x 64 + 4 x 128) x 4 = 4,352 bytes, and its logits and log-softmax 96 x 8 = 768:
    # (8,704 + 768) x 1.25 = 11,840 bytes. Checkpointed: each layer's fp32 input (64 x 4) and one
    # layer recomputed: (2 x 256 + 4,352 + 768) x 1.25 = 7,040 bytes.
    # 1,000 tokens kept whole fit, 1,001 do not; checkpointed 1,682 (11,845,920 / 7,040 = 1,682.6).
    room = 11_840 * 1000.5
    sized = size_update(GRPOConfig(micro_batch_tokens=8192, checkpoint_tokens=2560), _budget(room), m, WEIGHTS,
                        False, 100)
    assert (sized.checkpoint_tokens, sized.micro_batch_tokens) == (1000, 1682)
    # Settings the budget already holds are kept: it only ever lowers them.
    kept = GRPOConfig(micro_batch_tokens=600, checkpoint_tokens=300)
    assert size_update(kept, _budget(room), m, WEIGHTS, False, 100) == kept
    # bf16 autocast: matmul outputs at 2 bytes, the log-softmax stays fp32: whole (2 x 1,088 x 2 +
    # 96 x 6) x 1.25 = 6,160 bytes a token; checkpointed (2 x 256 + 1,088 x 2 + 96 x 6) x 1.25 = 4,080.
    room = 6_160 * 500.5
    sized = size_update(GRPOConfig(micro_batch_tokens=8192), _budget(room), m, WEIGHTS, True, 100)
    assert (sized.checkpoint_tokens, sized.micro_batch_tokens) == (500, 755)  # 3,083,080 / 4,080 = 755.7


def test_a_budget_that_cannot_hold_one_checkpointed_response_waits_for_fewer_groups_then_refuses(tiny_dir):
    m = load_model(tiny_dir, dtype="fp32").cfg
    two = GRPOConfig(waiting_gradients=2, micro_batch_tokens=8192)  # a config letting a second buffer wait
    # Room for 1,682 checkpointed tokens (above) beside two buffers waiting: a response of 1,682
    # tokens fits as configured.
    room = 11_840 * 1000.5
    assert size_update(two, _budget(room, waiting=2), m, WEIGHTS, False, 1682).waiting_gradients == 2
    # A longer one: fewer buffers wait, down to the gradient sum alone, which leaves the group
    # being computed 1 MiB more: 1,831 checkpointed tokens fit ((11,845,920 + 1,048,576) / 7,040 = 1,831.6).
    sized = size_update(two, _budget(room, waiting=2), m, WEIGHTS, False, 1831)
    assert sized.waiting_gradients == 1 and sized.micro_batch_tokens == 1831
    # The budget it needs: the fixed part, the gradient sum, the computed group's buffer and 1,832
    # checkpointed tokens.
    need = 3.0 + WEIGHTS + WEIGHTS + 1832 * 7_040 / 2**30
    with pytest.raises(ValueError, match=rf"memory budget of 3\.0 GiB cannot hold this run: it needs at least "
                                         rf"{need:.1f} GiB \(models and optimizer 3\.0, the gradient sum 0\.0, and "
                                         rf"the group being computed with a checkpointed response of 1832 tokens\)"):
        size_update(two, _budget(room, waiting=2), m, WEIGHTS, False, 1832)
    # No room at all beside the fixed parts.
    with pytest.raises(ValueError, match="cannot hold this run"):
        size_update(GRPOConfig(), Budget(2.0, {"models and optimizer": 3.0}), m, WEIGHTS, False, 1)


def fp32_update(configs: dict) -> dict:
    """The update in fp32 on every CPU: with `autocast = auto` a CPU with bf16 instructions keeps
    half the activation bytes a token, and 0.505 GiB then holds the default micro-batch."""
    return {**configs, "grpo": dataclasses.replace(configs["grpo"], autocast="fp32")}


def test_a_run_is_sized_to_its_budget_and_reports_it(char_model_dir, task_file, tmp_path):
    configs = fp32_update(tiny_configs(char_model_dir, task_file, steps=1, eval_every=0, memory_gb=0.505))
    out = tmp_path / "run"
    train(run_config(configs), out)
    run = RunDir(out)
    saved = (out / "config.toml").read_text()
    # The tiny run holds ~0.50 GiB beside its update (RUNTIME_GB the most): 0.505 leaves room for
    # few tokens: its settings are lowered, and written down, so that a resume computes with them.
    sized = [line for line in saved.splitlines() if line.startswith(("micro_batch_tokens", "checkpoint_tokens"))]
    defaults = GRPOConfig()
    assert sized and all(int(line.split("=")[1]) < min(defaults.micro_batch_tokens, defaults.checkpoint_tokens)
                         for line in sized), sized
    (record,) = run.read_metrics()
    assert record["memory_budget_gb"] == 0.505
    # A resume is sized again: to the same budget it goes on; to a smaller one it would compute
    # other micro-batches than the run did, and is refused.
    with pytest.raises(ValueError, match="would not reproduce the run; changed: grpo.micro_batch_tokens"):
        train(run_config(fp32_update(tiny_configs(char_model_dir, task_file, steps=2, eval_every=0, memory_gb=0.504))),
              out, resume=True)
    train(run_config(fp32_update(tiny_configs(char_model_dir, task_file, steps=2, eval_every=0, memory_gb=0.505))), out,
          resume=True)
    assert [r["step"] for r in run.read_metrics()] == [1, 2]


def test_a_run_over_its_budget_stops_before_it_starts_with_one_line(char_model_dir, task_file, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--model", str(char_model_dir), "--task", str(task_file), "--max-new-tokens", "12",
                 "--num-prompts", "2", "--spec", "off", "--memory-gb", "0.01", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("tailrl: error: a memory budget of 0.0 GiB cannot hold this run: it needs "
                                            "at least "), err
    assert not out.exists()
