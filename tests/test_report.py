"""rollout_report and chain_ceiling against hand-computed summaries of made-up steps and flags."""

import pytest

from tailrl.speculative.report import chain_ceiling, rollout_report
from tailrl.stats import EngineStats, SpecStats, StepRecord

EDGES = (1, 2, 4, 8, 16, 32)


def test_report_by_bucket_and_arm():
    stats = EngineStats(
        timeline=[
            StepRecord(1.0, 40, "plain", 40, 1.0),  # bucket 33+
            StepRecord(2.0, 40, "plain", 39, 1.0),  # same batch and arm: one segment
            StepRecord(2.5, 3, "plain", 3, 0.5),  # bucket 3-4
            StepRecord(3.0, 3, "ngram(4,1,4)", 9, 0.5),  # 3 rows emitted 9 tokens: accept_len 3
            StepRecord(3.4, 4, "ngram(4,1,4)", 6, 0.4),  # 4 rows, 6 tokens (EOS cuts)
            StepRecord(3.6, 1, "ngram(4,1,4)", 5, 0.2),  # bucket 1
        ],
        spec=SpecStats(draft_seconds=0.3, verify_seconds=0.8, accept_hist=[2, 3, 0, 1]),
    )
    r = rollout_report(stats, EDGES)
    assert r.sd_fraction == 20 / 102
    assert r.plain_s == 2.5 and r.draft_s == 0.3 and r.verify_s == 0.8
    assert r.accept_hist == [2, 3, 0, 1]
    assert list(r.by_bucket) == ["1", "3-4", "33+"]  # ordered by batch size
    assert r.by_bucket["3-4"]["ngram(4,1,4)"]["accept_len"] == 15 / 7
    assert r.by_bucket["3-4"]["ngram(4,1,4)"]["steps"] == 2
    assert r.by_bucket["3-4"]["plain"] == {"steps": 1, "tokens": 3, "seconds": 0.5, "accept_len": 1.0}
    assert r.by_bucket["33+"]["plain"]["accept_len"] == 79 / 80
    assert r.arm_by_bucket == {"1": "ngram(4,1,4)", "3-4": "ngram(4,1,4)", "33+": "plain"}
    assert r.batch_timeline == [
        [0.0, 2.0, 40, "plain"],
        [2.0, 2.5, 3, "plain"],
        [2.5, 3.0, 3, "ngram(4,1,4)"],
        [3.0, 3.4, 4, "ngram(4,1,4)"],
        [3.4, 3.6, 1, "ngram(4,1,4)"],
    ]


def test_tail_share_counts_steps_with_at_most_eight_running():
    stats = EngineStats(
        prefill_seconds=0.5,
        timeline=[
            StepRecord(1.0, 40, "plain", 40, 1.0),
            StepRecord(1.2, 9, "plain", 9, 0.2),  # 9 running: not the tail
            StepRecord(1.5, 8, "plain", 8, 0.3),
            StepRecord(3.5, 1, "ngram(4,1,4)", 5, 2.0),
        ],
    )
    r = rollout_report(stats, EDGES)
    assert r.tail_s == pytest.approx(2.3) and r.tail_share == pytest.approx(2.3 / 4.0)


def test_report_of_an_empty_call():
    r = rollout_report(EngineStats(), EDGES)
    assert r.sd_fraction == 0.0 and r.by_bucket == {} and r.batch_timeline == []
    assert r.tail_s == 0.0 and r.tail_share == 0.0


def test_chain_ceiling_replays_verifies_by_hand():
    T, F = True, False
    # Token 0 comes from prefill. Depth 2 from token 1: [T, T] accepted + bonus token 3 (3
    # tokens); from 4: [F] 0 accepted, emit token 4 (1); from 5: [T, F] 1 + bonus (2, tokens 5-6);
    # from 7: [T] then the end: 1 token left, emitted alone (1). 7 tokens over 4 verifies.
    assert chain_ceiling([[F, T, T, F, F, T, F, T]], depth=2) == 7 / 4
    # Depth 1 on the same flags: 1-2 (2), 3 (1), 4 (1), 5-6 (2), 7 (1): 7 tokens, 5 verifies.
    assert chain_ceiling([[F, T, T, F, F, T, F, T]], depth=1) == 7 / 5
    # Responses pool their verifies; a one-token response has none.
    assert chain_ceiling([[T, T, T], [F]], depth=4) == 2 / 1
    assert chain_ceiling([[T]], depth=3) is None
    with pytest.raises(ValueError):
        chain_ceiling([[T, T]], depth=0)
