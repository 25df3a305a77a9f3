"""The drafter warm-up's stopping rule, its held-out ceiling and the weights it keeps.

Plateau is checked on hand-made score sequences; top1_flags against the engine's own top-1
flags of the same responses; the training loop on a tiny random target (fp32), where the stop
step follows from the rule by hand and the kept weights replay to the best measurement exactly
(the same drafter on the same responses is the same arithmetic).
"""

from __future__ import annotations

import pytest
import torch

from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model
from tailrl.records import Request
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.model import Drafter
from tailrl.speculative.drafter.plateau import Plateau
from tailrl.speculative.drafter.training import TrainSeq, simulate_accept, top1_flags
from tailrl.speculative.report import chain_ceiling
from tailrl.tuner import Arm
from tailrl.warmup import WarmupConfig, _train

VOCAB = list(range(1, 96, 2)) + [2, 4, 6, 8]  # 52 of the tiny model's 96 tokens, EOS (1) in


def test_plateau_drops_the_rate_then_stops_by_hand():
    p = Plateau(patience=2, drops=1, factor=0.5, min_gain=0.1)
    # (step, score) -> (a best?, the scale after it, done after it), worked out from plateau.py's rules
    expected = [
        (1, 1.00, True, 1.0, False),  # first measurement: progress and a best
        (2, 1.05, True, 1.0, False),  # a best, but not by min_gain: stalled 1
        (3, 1.10, True, 0.5, False),  # a best, not progress: stalled 2 = patience -> the one drop
        (4, 1.30, True, 0.5, False),  # progress: stalled 0
        (5, 1.20, False, 0.5, False),  # stalled 1
        (6, 1.25, False, 0.5, True),  # stalled 2, no drop left -> done
    ]
    for step, score, best, scale, done in expected:
        assert (p.observe(step, score), p.scale, p.done) == (best, scale, done), step
    assert (p.best, p.best_step, p.dropped) == (1.30, 4, 1)


def test_plateau_refuses_settings_that_never_stop_or_never_drop():
    for bad in (dict(patience=0), dict(drops=-1), dict(factor=1.0), dict(factor=0.0), dict(min_gain=-0.1)):
        with pytest.raises(ValueError):
            Plateau(**{**dict(patience=1, drops=0, factor=0.5, min_gain=0.0), **bad})


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir, dtype="fp32")


def _sampled(target, n: int, seed: int, temperature: float = 1.0):
    """n responses with their hidden states as the warm-up keeps them, and the engine's completions."""
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(2, 96, (int(k),), generator=g).tolist())
               for k in torch.randint(3, 9, (n,), generator=g)]
    reqs = [Request(p, seed=seed * 100 + i, group=i) for i, p in enumerate(prompts)]
    outs = Engine(target, EngineConfig(capture_hidden=True)).generate(reqs, SamplingParams(temperature=temperature), 24)
    seqs = []
    with torch.no_grad():
        for r, c in zip(reqs, outs):
            ids = torch.tensor([r.prompt_ids])
            hp = target.hidden(ids, torch.arange(ids.shape[1])[None])[0, :-1]
            seqs.append(TrainSeq(torch.tensor([*r.prompt_ids, *c.token_ids]), torch.cat([hp, c.hidden]), ids.shape[1]))
    return seqs, outs


def test_top1_flags_are_the_engines_own_and_give_its_ceiling(target):
    seqs, outs = _sampled(target, 6, seed=1)
    flags = top1_flags(seqs, target.lm_head.weight.detach(), chunk=5)  # chunks cut inside responses
    assert flags == [c.top1 for c in outs]
    assert sum(map(sum, flags)) not in (0, sum(map(len, flags)))  # at T = 1 some sampled tokens are not the top-1
    for depth in (1, 3):
        assert chain_ceiling(flags, depth) == chain_ceiling([c.top1 for c in outs], depth)


def test_training_stops_by_the_rule_and_keeps_the_best_replays_weights(target):
    train, _ = _sampled(target, 8, seed=2)
    held, _ = _sampled(target, 4, seed=3)
    drafter = Drafter.from_target(target, VOCAB, "tiny", seed=0)
    # min_gain so large that only the first replay is progress: with patience 1 the 2nd replay
    # drops the rate (the one drop) and the 3rd, stalled again, stops training at step 3 x 7.
    cfg = WarmupConfig(steps=1000, eval_every=7, stop_depth=3, patience=1, lr_drops=1, min_gain=1e9, batch_tokens=64,
                       lr=3e-3)
    run = _train(drafter, target, train, held, cfg, on_progress=None)
    assert len(run.history) == 21 and [r[0] for r in run.replays] == [7, 14, 21]
    assert [r[3] for r in run.replays] == [1.0, 1.0, cfg.lr_drop_factor]  # the scale each replay saw
    scores = [r[2] for r in run.replays]
    best = max(range(3), key=lambda i: (scores[i], -i))
    assert run.best_step == run.replays[best][0]
    kept = simulate_accept(drafter, held, Arm("drafter", 3, 1, 3)).accept_len
    assert round(kept, 4) == scores[best]


def test_training_without_the_rule_runs_its_steps_at_a_constant_rate(target):
    train, _ = _sampled(target, 4, seed=4)
    held, _ = _sampled(target, 2, seed=5)
    drafter = Drafter.from_target(target, VOCAB, "tiny", seed=0)
    run = _train(drafter, target, train, held, WarmupConfig(steps=12, eval_every=0, batch_tokens=64), on_progress=None)
    assert len(run.history) == 12 and run.replays == [] and run.best_step == 12
