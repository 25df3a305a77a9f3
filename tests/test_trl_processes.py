"""TLT inside TRL's GRPOTrainer under `accelerate launch --num_processes 2` (gloo on CPU): one
colocated engine per process, one drafter for both (tailrl.trl.generation, "Several processes").

The test launches this file as the training script of two processes (`main`), a three-step run
on the tiny model, drafter and configs of tests/conftest.py, with a checkpoint after step 2.
Each process records, for each step: what its engine drafts with as the step's generate call
starts (the version, the weights in vLLM's drafter, the tuner's state), the sequences its loss
forwards observed, the rollback tallies and speculative counts of its generate call; process 0
also what its adapting drafter received at each publish. The test then checks, exactly:

- both engines draft with the same version, the same weights bit for bit, at every step, and
  the version at step 3 is one the drafter trained (not the drafter's files);
- process 0's drafter trained on both processes' sequences (process 0's, then process 1's) and
  its rollback watch got both engines' tallies;
- the logged accept_len is over both engines; each process's tuner is saved beside process 0's
  state in the checkpoint.

Slow (two processes each start vLLM: about 80 s on a 2-core CPU).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("vllm")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).parent))  # conftest, when this file runs as the training script
from conftest import TRL_MIN_STEPS, assert_same, engine_drafter, tiny_trl_run  # noqa: E402

STEPS, SAVE = 3, 2


def _tallies(tallies) -> dict[str, tuple[int, int]]:
    return {shape: (t.verifies, t.accepted) for shape, t in tallies.items()}


def main(tmp: Path) -> None:
    """One process of the two-process run: train, and write what it saw to tmp / f"rank{i}.pt"."""
    from tailrl.trl import TLTGRPOTrainer

    trainer = TLTGRPOTrainer(**tiny_trl_run(tmp, max_steps=STEPS, save_strategy="steps", save_steps=SAVE))
    gen, rank = trainer.vllm_generation, trainer.accelerator.process_index
    seen: dict[str, dict] = {"generations": {}, "observed": {}, "received": {}, "recorded": {}}
    own_generate, own_observe = gen.generate, gen.observe

    def generate(*args, **kwargs):
        step = trainer.state.global_step + 1
        record = dict(version=gen.drafter_version, engine=engine_drafter(gen.llm),
                      tuner=gen.steps.schedule.tuner.state_dict())
        out = own_generate(*args, **kwargs)
        seen["generations"][step] = dict(record, tallies=_tallies(gen.steps.tallies), drafts=gen.steps.drafts,
                                         accepted=gen.steps.accepted)
        return out

    def observe(forwards):
        seen["observed"].setdefault(trainer.state.global_step + 1, []).extend(f.tokens.tolist() for f in forwards)
        own_observe(forwards)

    gen.generate, gen.observe = generate, observe
    if gen.adapt is not None:  # process 0: what publish hands its adapting drafter (at the step's end)
        adapt_observe, adapt_record = gen.adapt.observe, gen.adapt.record

        def received(forwards):
            seen["received"].setdefault(trainer.state.global_step, []).extend(f.tokens.tolist() for f in forwards)
            adapt_observe(forwards)

        def recorded(tallies):
            seen["recorded"].setdefault(trainer.state.global_step, []).append(_tallies(tallies))
            adapt_record(tallies)

        gen.adapt.observe, gen.adapt.record = received, recorded
    try:
        trainer.train()
    finally:
        gen.close()
    seen["logs"] = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    seen["processes"] = trainer.accelerator.num_processes
    torch.save(seen, tmp / f"rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl2")
    tiny_trl_run(tmp)  # the model and drafter written once, before both processes read them
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), __file__, str(tmp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [torch.load(tmp / f"rank{i}.pt", weights_only=False) for i in range(2)]
    return dict(ranks=ranks, checkpoint=tmp / "out" / f"checkpoint-{SAVE}")


@pytest.mark.slow
def test_both_engines_draft_with_the_same_adapted_version(two_processes):
    first, second = two_processes["ranks"]
    assert first["processes"] == second["processes"] == 2
    for step in range(1, STEPS + 1):
        a, b = first["generations"][step], second["generations"][step]
        assert a["version"] == b["version"], step
        assert_same(a["engine"], b["engine"], f"step {step}")
    # Version 1 (trained at the end of step 2) drafts at step 3: an adapted drafter, not its files.
    assert [first["generations"][s]["version"] for s in range(1, STEPS + 1)] == [0, 0, 1]
    with pytest.raises(AssertionError):
        assert_same(first["generations"][1]["engine"], first["generations"][3]["engine"])
    assert [first["logs"][s]["tlt/drafter_micro_steps"] for s in range(1, STEPS + 1)] == [0, TRL_MIN_STEPS,
                                                                                         TRL_MIN_STEPS]


@pytest.mark.slow
def test_the_drafter_trains_on_every_process_and_watches_every_engine(two_processes):
    first, second = two_processes["ranks"]
    assert not second["received"]  # process 0 alone adapts
    for step in range(1, STEPS + 1):
        mine, theirs = first["observed"][step], second["observed"][step]
        assert len(mine) == len(theirs) == 8 and mine != theirs  # each process's own share of the batch
        assert first["received"][step] == mine + theirs, step
        assert first["recorded"][step] == [first["generations"][step]["tallies"],
                                           second["generations"][step]["tallies"]], step


@pytest.mark.slow
def test_accept_len_is_over_both_engines_and_each_tuner_is_checkpointed(two_processes):
    first, second = two_processes["ranks"]
    for step in range(1, STEPS + 1):
        a, b = first["generations"][step], second["generations"][step]
        assert a["drafts"] > 0 and b["drafts"] > 0
        expected = 1 + (a["accepted"] + b["accepted"]) / (a["drafts"] + b["drafts"])
        assert first["logs"][step]["tlt/accept_len"] == pytest.approx(expected, rel=1e-6)
    checkpoint = two_processes["checkpoint"]
    # Each tuner as the step after the checkpoint found it: the checkpoint's.
    mine = torch.load(checkpoint / "tlt_state.pt", weights_only=True)["tuner"]
    theirs = torch.load(checkpoint / "tlt_state_1.pt", weights_only=True)["tuner"]
    assert_same(first["generations"][SAVE + 1]["tuner"], mine)
    assert_same(second["generations"][SAVE + 1]["tuner"], theirs)
    with pytest.raises(AssertionError):  # two tuners: each steered its own engine
        assert_same(mine, theirs)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
