"""--spec off | on | auto: same tokens in every mode; the tuner sees every step."""

from __future__ import annotations

import pytest

from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model
from tailrl.records import Request
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.model import Drafter, save_drafter
from tailrl.speculative.modes import SpeculationConfig, install
from tailrl.tuner import TunerConfig


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, dtype="fp32")


def _requests() -> list[Request]:
    # Repetitive prompts give the n-gram drafter something to match.
    prompts = [(5, 6, 7, 5, 6, 7, 5, 6), (9, 10, 9, 10, 9), (3, 4, 3, 4)]
    return [Request(p, seed=50 + 8 * g + s, group=g) for g, p in enumerate(prompts) for s in range(4)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.95)])
def test_modes_emit_identical_tokens(tiny, params):
    reqs = _requests()
    outputs = {}
    for mode in ("off", "on", "auto"):
        engine = Engine(tiny, EngineConfig(max_batch=5))
        tuner = install(engine, SpeculationConfig(spec=mode, draft_depth=4, topk=1, num_draft_tokens=4),
                        TunerConfig(switch_patience=0), seed=1)
        outputs[mode] = [c.token_ids for c in engine.generate(reqs, params, 40)]
        if mode == "on":
            assert engine.stats.spec.verify_steps > 0
        if mode == "auto":
            pulls = sum(sum(b["pulls"].values()) for b in tuner.summary().values())
            assert pulls == engine.stats.steps  # every decode step rewarded the tuner once
    assert outputs["off"] == outputs["on"] == outputs["auto"]


def test_bad_spec_config():
    with pytest.raises(ValueError, match="spec must be one of"):
        SpeculationConfig(spec="maybe")
    with pytest.raises(ValueError, match="can hold"):
        SpeculationConfig(spec="on", draft_depth=2, topk=1, num_draft_tokens=3)


def test_exact_mode_drafts_chains_only(tiny, tmp_path):
    """Trees are not exact on every CPU (modes.EXACT_CHAINS): exact mode refuses --spec on with a
    tree; the tuner's arms are chains in both modes, so exact and ordinary runs choose among the same."""
    with pytest.raises(ValueError, match="chains only"):
        install(Engine(tiny, EngineConfig(exact=True)),
                SpeculationConfig(spec="on", draft_depth=3, topk=2, num_draft_tokens=6))
    drafter = save_drafter(Drafter.from_target(tiny, list(range(1, 96, 2)), "tiny"), tmp_path / "drafter")
    for exact in (True, False):
        tuner = install(Engine(tiny, EngineConfig(exact=exact)), SpeculationConfig(spec="auto", drafter=str(drafter)),
                        TunerConfig())
        assert all(a.topk <= 1 for a in tuner.arms)  # plain has none
        assert {a.kind for a in tuner.arms} == {"plain", "ngram", "drafter"}


def test_every_rollout_starts_with_the_gate_closed(tiny):
    # switch_batch above the batch: the gate opens after `patience` steps of each rollout, and
    # epsilon 1 makes an open gate explore; the first patience - 1 steps of the second rollout
    # must still decode plain.
    engine = Engine(tiny, EngineConfig(max_batch=12))
    install(engine, SpeculationConfig(spec="auto"), TunerConfig(switch_patience=5, epsilon=1.0, loser_margin=1.0),
            seed=1)
    for _ in range(2):
        engine.generate(_requests(), SamplingParams(temperature=1.0), 30)
        arms = [r.arm for r in engine.stats.timeline]
        assert arms[:4] == ["plain"] * 4 and any(a != "plain" for a in arms[4:])
