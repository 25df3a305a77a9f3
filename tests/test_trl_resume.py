"""TLT inside TRL's GRPOTrainer resumed from one of TRL's checkpoints (tailrl.trl): the resumed
run drafts from the next step on with the drafter and the tuner the uninterrupted run had.

Two runs on the tiny model, drafter and configs: four steps saving a checkpoint after
the second, then a second trainer resumed from that checkpoint. As each generate call starts
(after TRL's weight sync), the test reads what the engine drafts with: the drafting version, the
adapting drafter's whole state (weights, optimizer, version, the next step's data), the weights
in vLLM's drafter, and the tuner's state. At step 3 the two runs' must be equal, bit for bit;
at step 4 the drafter's too (the version the resumed run trained at the end of step 3, on the
data the checkpoint held and the policy as step 3 moved it: both runs sampled the same responses,
TRL's checkpoint restoring the random generators the in-process engine samples from), and the
micro-steps logged at the end of step 3; not the tuner's, whose rewards are step 3's timings.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")

from conftest import TRL_MIN_STEPS, assert_same, engine_drafter, tiny_trl_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("trl_process")

STEPS, SAVE = 4, 2


def watch_generations(trainer) -> dict[int, dict]:
    """What the engine drafts with as each of the trainer's generate calls starts, by step."""
    gen, seen = trainer.vllm_generation, {}
    own = gen.generate

    def generate(*args, **kwargs):
        seen[trainer.state.global_step + 1] = dict(
            version=gen.drafter_version, adapt=copy.deepcopy(gen.adapt.state_dict()),
            tuner=copy.deepcopy(gen.steps.schedule.tuner.state_dict()), engine=engine_drafter(gen.llm))
        return own(*args, **kwargs)

    gen.generate = generate
    return seen


def train(resume: str | None = None, **kwargs) -> tuple[dict[int, dict], dict[int, dict]]:
    """A TLT trainer's run: what each step drafted with (watch_generations), and TRL's log by step."""
    from tailrl.trl import TLTGRPOTrainer

    trainer = TLTGRPOTrainer(**kwargs)
    seen = watch_generations(trainer)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        trainer.vllm_generation.close()
    return seen, {h["step"]: h for h in trainer.state.log_history if "loss" in h}


@pytest.mark.slow
def test_a_resumed_run_drafts_with_the_drafter_and_tuner_it_had(tmp_path, monkeypatch):
    from trl.trainer.utils import ensure_master_addr_port

    # Both runs one-process DDP jobs, as under `accelerate launch`, whatever ran before in this
    # process: the trainer then trains other tensors than those the model held when the engine
    # started, and the drafter must read those it trains.
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    ensure_master_addr_port()
    straight, straight_log = train(**tiny_trl_run(tmp_path, max_steps=STEPS, save_strategy="steps", save_steps=SAVE))
    checkpoint = tmp_path / "out" / f"checkpoint-{SAVE}"
    assert (checkpoint / "tlt_state.pt").is_file()
    resumed, resumed_log = train(str(checkpoint),
                                 **tiny_trl_run(tmp_path, max_steps=STEPS, output_dir=str(tmp_path / "re")))
    assert sorted(resumed) == [3, 4]
    # The uninterrupted run drafts at step 3 with a version trained at the end of step 2: the
    # comparison is of an adapted drafter, not of the drafter's files.
    assert straight[3]["version"] == 1
    with pytest.raises(AssertionError):
        assert_same(straight[1]["engine"], straight[3]["engine"])
    for key in ("version", "adapt", "engine", "tuner"):
        assert_same(straight[3][key], resumed[3][key], key)
    # At step 4, the version trained at the end of step 3 on the checkpoint's data, on the
    # policy as step 3 moved it (its responses the same: TRL's checkpoint restores the random
    # generators the in-process engine samples from).
    assert resumed[4]["version"] == straight[4]["version"] == 2
    for key in ("adapt", "engine"):
        assert_same(straight[4][key], resumed[4][key], key)
    assert resumed_log[3]["tlt/drafter_micro_steps"] == straight_log[3]["tlt/drafter_micro_steps"] == TRL_MIN_STEPS
