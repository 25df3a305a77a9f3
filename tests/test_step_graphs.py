"""The step graphs' buckets (tailrl.step_graphs) on CPU: everything but the capture itself.

In exact mode a row's logits depend neither on the other rows nor on how many keys the batch
reads (tailrl.model, "Row invariance"), so padding a forward's rows and keys to its bucket must
leave every completion the same bits: tokens, log-probs and hidden states. A mask left stale
past a row's keys, a padded row written into a running slot, or a bucket's buffers reused with
another batch's rows would change them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model
from tailrl.records import Request
from tailrl.sampling import SamplingParams
from tailrl.speculative.decoder import NgramProposer, fixed
from tailrl.speculative.drafter.model import Drafter, DrafterProposer
from tailrl.step_graphs import KEYS_MIN, bucket
from tailrl.tuner import Arm


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, dtype="fp32")


def _requests() -> list[Request]:
    """9 requests through 5 slots, prompts of 3 and 40 tokens."""
    rng = np.random.default_rng(0)
    return [Request(tuple(int(t) for t in rng.integers(2, 96, size=3 + 37 * (i % 2))), seed=500 + i, group=i)
            for i in range(9)]


def test_bucket_is_the_next_power_of_two_multiple_capped():
    assert [bucket(n, 1, 5) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 5]
    assert [bucket(n, KEYS_MIN, 1024) for n in (1, 256, 257, 600, 1000)] == [256, 256, 512, 1024, 1024]
    assert bucket(300, KEYS_MIN, 384) == 384


def _decoders(target) -> dict:
    return {
        "plain": None,
        "ngram chain": fixed(Arm("ngram", 4, 1, 4), NgramProposer()),
        "drafter tree": fixed(Arm("drafter", draft_depth=3, topk=2, num_draft_tokens=6),
                              DrafterProposer(Drafter.from_target(target, list(range(96)), "tiny", seed=0))),
    }


@pytest.mark.parametrize("decoder", ["plain", "ngram chain", "drafter tree"])
def test_bucketed_forwards_emit_the_same_bits_in_exact_mode(tiny, decoder):
    reqs, params = _requests(), SamplingParams(temperature=1.0)

    def run(graphs: str) -> tuple[list, Engine]:
        engine = Engine(tiny, EngineConfig(max_batch=5, capture_hidden=True, exact=True, graphs=graphs))
        engine.eos = set()  # lengths come from the stop below alone
        chosen = _decoders(tiny)[decoder]
        if chosen is not None:
            engine.decoder = chosen
        # Each sequence stops at a length its first token picks (70-300 tokens), so the running
        # batch passes through rows 5, 4, 3 (padded to 4), 2 and 1 and its longest row through
        # more than one key bucket.
        return engine.generate(reqs, params, 300, stop=lambda toks: len(toks) >= 60 + 3 * toks[0]), engine

    direct, _ = run("off")
    bucketed, engine = run("on")
    assert engine.graphs is not None and not engine.graphs.capture  # a CPU: the buckets, no capture
    # The buckets the run met: rows padded (3 -> 4) and keys past the first bucket.
    rows = {k[0] for k in engine.graphs._steps}
    keys = {k[2] for k in engine.graphs._steps}
    assert 4 in rows and 5 in rows and max(keys) > KEYS_MIN
    for a, b in zip(direct, bucketed):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
        assert torch.equal(a.hidden, b.hidden)


def test_graphs_default_to_off_on_a_cpu_and_reject_unknown_values(tiny):
    assert Engine(tiny, EngineConfig()).graphs is None
    with pytest.raises(ValueError, match="graphs must be auto, on or off"):
        EngineConfig(graphs="yes")
