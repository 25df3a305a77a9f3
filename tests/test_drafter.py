"""The learned drafter: files, the training offset, the proposer's catch-up, training, export.

Tiny random targets from conftest.build_hf, fp32. Equalities are exact where the same arithmetic
runs twice (save/load, export in fp32); the proposer comparisons (catch-up in one batched forward
vs entry by entry) differ by float rounding only (~1e-6 on logits), so trees are compared exactly
on a random model whose draft scores have no near-ties at that scale, and scores to 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_hf
from rollout_helpers import train_seqs

from tailrl.engine import Engine, EngineConfig
from tailrl.loading import load_model
from tailrl.records import Request
from tailrl.sampling import SamplingParams
from tailrl.speculative.drafter.export import export, load_exported
from tailrl.speculative.drafter.model import Drafter, DrafterError, DrafterProposer, load_drafter, save_drafter
from tailrl.speculative.drafter.training import (
    DrafterTrainConfig,
    TrainSeq,
    _advance,
    _start,
    drafter_loss,
    evaluate_loss,
    pack,
    simulate_accept,
    train_drafter,
    windows,
)
from tailrl.tuner import Arm

VOCAB = list(range(1, 96, 2)) + [2, 4, 6, 8]  # 52 of the tiny model's 96 tokens, EOS (1) in


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir, dtype="fp32")


@pytest.fixture(scope="module")
def seqs(target):
    """Six sampled responses (prompts of 3-11 tokens) with the hidden states the engine keeps."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(3, 12, (6,), generator=g).tolist()
    prompts = [tuple(torch.randint(2, 96, (n,), generator=g).tolist()) for n in lens]
    reqs = [Request(p, seed=i, group=i) for i, p in enumerate(prompts)]
    return train_seqs(target, reqs, SamplingParams(temperature=1.0), 24)


def _drafter(target, seed: int = 0, layers: int = 1) -> Drafter:
    """A drafter with every parameter random, so no part of it is a no-op in the comparisons."""
    d = Drafter.from_target(target, VOCAB, "tiny", seed=seed, num_layers=layers)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return d


def _outputs(d: Drafter, seqs) -> torch.Tensor:
    b = pack(seqs, 400)[0]
    with torch.no_grad():
        pred = d(b.hidden, b.ids, b.positions, mask=b.mask)
        return torch.cat([pred, d.logits(pred)], dim=-1)


# ---- files --------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2])
def test_save_load_round_trip_gives_identical_outputs(tmp_path, target, seqs, layers):
    d = _drafter(target, layers=layers)
    save_drafter(d, tmp_path / "dr")
    cfg = json.loads((tmp_path / "dr" / "drafter.json").read_text())
    assert cfg["draft_vocab"] == sorted(VOCAB) and cfg["target_name"] == "tiny" and cfg["version"] == 0
    assert cfg["layer"]["num_layers"] == layers
    back = load_drafter(tmp_path / "dr", target)
    assert back.dtype == torch.float32 and torch.equal(back.d2t, d.d2t)
    assert torch.equal(_outputs(back, seqs), _outputs(d, seqs))


def test_a_second_layer_changes_the_outputs_and_a_format_1_drafter_still_loads(tmp_path, target, seqs):
    """Layer 0 of a two-layer drafter alone is the one-layer drafter; the second layer (its input
    norm included) changes the prediction. Format 1 (one layer, named `layer.`) reads as before."""
    two = _drafter(target, layers=2)
    one = Drafter.from_target(target, VOCAB, "tiny", num_layers=1)
    one.load_state_dict({k: v for k, v in two.state_dict().items() if not k.startswith("layers.1.")})
    assert not torch.allclose(_outputs(one, seqs), _outputs(two, seqs), atol=1e-3)
    save_drafter(one, tmp_path / "v1")
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "v1" / "drafter.safetensors"
    save_file({k.replace("layers.0.", "layer.", 1): v for k, v in load_file(weights).items()}, weights)
    cfg = json.loads((tmp_path / "v1" / "drafter.json").read_text())
    (tmp_path / "v1" / "drafter.json").write_text(json.dumps(cfg | {"format": 1}))
    assert torch.equal(_outputs(load_drafter(tmp_path / "v1", target), seqs), _outputs(one, seqs))
    (tmp_path / "v1" / "drafter.json").write_text(json.dumps(cfg | {"format": 3}))
    with pytest.raises(DrafterError, match="unsupported drafter format 3"):
        load_drafter(tmp_path / "v1", target)


def test_refuses_missing_corrupt_or_foreign_drafters(tmp_path, target):
    with pytest.raises(DrafterError, match="not found"):
        load_drafter(tmp_path / "nope", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterError, match="no drafter.json"):
        load_drafter(tmp_path / "empty", target)
    good = save_drafter(_drafter(target), tmp_path / "good")

    bad = save_drafter(_drafter(target), tmp_path / "bad")
    (bad / "drafter.json").write_text("{not json")
    with pytest.raises(DrafterError, match="malformed"):
        load_drafter(bad, target)
    (bad / "drafter.json").write_text((good / "drafter.json").read_text())
    (bad / "drafter.safetensors").write_bytes(b"garbage")
    with pytest.raises(DrafterError, match="cannot read drafter weights"):
        load_drafter(bad, target)

    wider = build_hf("llama", seed=1, hidden_size=32, tie_word_embeddings=False)
    wider.save_pretrained(tmp_path / "wider")
    with pytest.raises(DrafterError, match="hidden size 64"):
        load_drafter(good, load_model(tmp_path / "wider", dtype="fp32"))
    # Same shapes, different weights: another model, refused by the embedding fingerprint.
    build_hf("llama", seed=7, tie_word_embeddings=False).save_pretrained(tmp_path / "other")
    with pytest.raises(DrafterError, match="another target"):
        load_drafter(good, load_model(tmp_path / "other", dtype="fp32"))


def test_accepts_its_target_after_a_small_update(tmp_path, tiny_dir):
    """RL moves the target's weights a little; the drafter must stay loadable for it."""
    updated = load_model(tiny_dir, dtype="fp32")
    good = save_drafter(_drafter(updated), tmp_path / "good")
    w = updated.model.embed_tokens.weight
    w.add_(0.1 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    assert load_drafter(good, updated).cfg.target_name == "tiny"


# ---- the offset -----------------------------------------------------------------------------


def test_packing_pairs_h_i_and_x_i_plus_1_with_h_i_plus_1_by_hand():
    h = torch.arange(4.0)[:, None].expand(4, 3)  # h_q = q in every dim
    a = TrainSeq(torch.tensor([10, 11, 12, 13, 14]), h, prompt_len=2)
    b = TrainSeq(torch.tensor([20, 21, 22]), 10 + h[:2], prompt_len=1, offset=5)
    (row,) = pack([a, b], 16)
    assert row.ids.tolist() == [[11, 12, 13, 21]]  # x_{i+1}
    assert row.hidden[0, :, 0].tolist() == [0, 1, 2, 10]  # h_i
    assert row.target[0, :, 0].tolist() == [1, 2, 3, 11]  # h_{i+1}
    assert row.next_ids.tolist() == [[12, 13, 14, 22]]  # x_{i+2}
    assert row.positions.tolist() == [[0, 1, 2, 5]]  # i, per sequence
    assert row.loss_mask.tolist() == [[True, True, True, True]]  # a: i >= P - 2 = 0
    assert row.mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    (c,) = pack([TrainSeq(torch.tensor([10, 11, 12, 13, 14]), h, prompt_len=4)], 16)
    assert c.loss_mask.tolist() == [[False, False, True]]  # only x_{i+2} = x_4, a response token


def test_a_sequence_longer_than_a_row_trains_every_entry_once_in_windows_with_context():
    """12 tokens (10 entries) in rows of 4: windows 0..3, then 3..6 and 6..9, each starting with
    one entry of context (a quarter of a row) that carries no loss; every entry is trained once, at
    its own position, paired with its own h_i and h_{i+1}."""
    assert windows(10, 4) == [(0, 4, 0), (3, 7, 4), (6, 10, 7)]
    assert windows(3, 4) == [(0, 3, 0)]
    h = torch.arange(11.0)[:, None].expand(11, 3)  # h_q = q
    seq = TrainSeq(torch.arange(100, 112), h, prompt_len=2, offset=50)
    rows = pack([seq], 4)
    assert [r.positions.tolist() for r in rows] == [[[50, 51, 52, 53]], [[53, 54, 55, 56]], [[56, 57, 58, 59]]]
    assert [r.loss_mask.tolist() for r in rows] == [[[True] * 4], [[False, True, True, True]],
                                                    [[False, True, True, True]]]
    trained = torch.cat([r.positions[r.loss_mask] for r in rows])
    assert trained.tolist() == list(range(50, 60))
    for r in rows:
        i = int(r.positions[0, 0]) - 50
        assert r.hidden[0, :, 0].tolist() == (i + torch.arange(r.ids.shape[1])).float().tolist()  # h_i
        assert r.target[0, :, 0].tolist() == (i + 1 + torch.arange(r.ids.shape[1])).float().tolist()  # h_{i+1}
        assert r.ids[0].tolist() == (101 + i + torch.arange(r.ids.shape[1])).tolist()  # x_{i+1}
        assert r.mask[0, 0].equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_siblings_share_their_prompt_entries_and_see_what_they_would_alone(target, seqs):
    """Three responses to one prompt, packed together: the prompt's entries 0..P-3 appear once and
    every entry's drafter output equals its output with each response packed alone (up to
    float rounding: other matmul shapes), so the loss over the loss-carrying entries is the same.
    A row too small for all three starts again with the prompt's entries."""
    d = _drafter(target)
    a = seqs[0]
    p = a.prompt_len
    g = torch.Generator().manual_seed(5)
    sibs = [a] + [
        TrainSeq(torch.cat([a.tokens[:p], torch.randint(2, 96, (n,), generator=g)]),
                 torch.cat([a.hidden[: p - 1], torch.randn(n, 64, generator=g)]), p)
        for n in (6, 9)
    ]
    (row,) = pack(sibs, 400)
    alone = [pack([s], 400)[0] for s in sibs]
    tails = [b.ids.shape[1] - (p - 2) for b in alone]
    assert row.ids.shape[1] == (p - 2) + sum(tails)
    with torch.no_grad():
        out = d(row.hidden, row.ids, row.positions, mask=row.mask)[0]
        ref = [d(b.hidden, b.ids, b.positions, mask=b.mask)[0] for b in alone]
    assert torch.allclose(out[: p - 2], ref[0][: p - 2], atol=1e-5)
    k = p - 2
    for r, n in zip(ref, tails):
        assert torch.allclose(out[k : k + n], r[p - 2 :], atol=1e-5)
        k += n
    head = target.lm_head.weight.detach()[d.d2t]
    total, stats = drafter_loss(d, row, head)
    parts = [drafter_loss(d, b, head)[1] for b in alone]
    assert stats.entries == sum(s.entries for s in parts)
    assert total.item() == pytest.approx(sum(s.loss * s.entries for s in parts) / stats.entries, abs=1e-5)
    small = pack(sibs, (p - 2) + tails[0] + tails[1])
    assert [b.ids.shape[1] for b in small] == [(p - 2) + tails[0] + tails[1], (p - 2) + tails[2]]
    # The same prompt sampled by another policy (other prompt hidden states) is not a sibling.
    other = TrainSeq(sibs[1].tokens, torch.cat([a.hidden[: p - 1] + 0.5, sibs[1].hidden[p - 1 :]]), p)
    (row,) = pack([a, other], 400)
    assert row.ids.shape[1] == alone[0].ids.shape[1] + alone[1].ids.shape[1]


def test_loss_is_minimal_for_an_oracle_only_at_the_right_offset(target):
    """Synthetic target whose hidden state at q encodes the token at q: h_q = G[x_q].

    Then h_{i+1} = G[x_{i+1}] is computable from the entry's own token, so an oracle drafter
    returning G[ids] has SmoothL1 0 and cross-entropy equal to the target distribution's entropy.
    An entry paired one position off (h_i or h_{i+2}) cannot be predicted from x_{i+1}. The same
    holds one step deeper (the unrolled loss), where the oracle reads the drafted token x_{i+2}.
    """
    d = _drafter(target)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(96, 64, generator=g)
    tokens = torch.randint(0, 96, (40,), generator=g)
    seq = TrainSeq(tokens, table[tokens[:-1]], prompt_len=1)
    (batch,) = pack([seq], 64)
    head = torch.randn(len(VOCAB), 64, generator=g)
    d.forward = lambda hidden, ids, positions, view=None, mask=None: table[ids]
    d.head.weight.data.copy_(head)
    p = torch.softmax(batch.target[0] @ head.T, -1)
    _, right = drafter_loss(d, batch, head, ce_weight=0.1)
    entropy = float(-(p * p.log()).sum(-1).mean())
    assert right.smooth_l1 == 0.0 and right.ce == pytest.approx(entropy, rel=1e-5)
    assert right.top1_target == 1.0
    # One draft step deeper (unroll): (h_{i+1} as predicted, x_{i+2}) -> h_{i+2} = G[x_{i+2}], also exact.
    both, _ = drafter_loss(d, batch, head, ce_weight=0.1, unroll=True)
    ent = -(p * p.log()).sum(-1)  # (T,) per entry
    assert both.item() == pytest.approx(0.1 * float(ent.mean()) + 0.1 * float(ent[1:].mean()), rel=1e-5)
    for shift in (-1, 1):
        def off(hidden, ids, positions, view=None, mask=None, s=shift):
            return table[tokens[1 + s : 1 + s + ids.shape[1]]][None]

        d.forward = off
        _, wrong = drafter_loss(d, batch, head, ce_weight=0.1)
        assert wrong.smooth_l1 > 0.1 and wrong.ce > entropy + 0.1


# ---- the proposer ---------------------------------------------------------------------------


def test_root_children_are_the_training_forwards_top_k(target, seqs):
    """The proposer's first tree layer (catch-up over the whole prefix, then the root entry) is
    the top-K of the training-path forward's last entry: inference and training agree on the offset."""
    d = _drafter(target)
    arm = Arm("drafter", 1, 5, 5)
    running = [_start(s, i) for i, s in enumerate(seqs)]
    for s, full in zip(running, seqs):
        _advance(s, full, 3)
    tree = DrafterProposer(d).propose(Engine(target), running, arm)
    for b, (s, full) in enumerate(zip(running, seqs)):
        # Training view of the same prefix: tokens up to the root (pending), hidden up to L - 1.
        prefix = TrainSeq(full.tokens[: s.length + 1], full.hidden[: s.length], full.prompt_len)
        (row,) = pack([prefix], 400)
        with torch.no_grad():
            # The last entry (h_{L-1}, x_L) is not a training entry (it has no target): append it.
            hid = torch.cat([row.hidden, full.hidden[s.length - 1][None, None]], 1)
            ids = torch.cat([row.ids, torch.tensor([[s.pending]])], 1)
            pred = d(hid, ids, torch.arange(ids.shape[1])[None])
            want = d.d2t[d.logits(pred[0, -1]).topk(5).indices]
        assert tree.tokens[b].tolist() == want.tolist()
        assert tree.parents[b].tolist() == [-1] * 5


def _replay(proposers, seqs, arm, steps, switch_on, retire_at, engine):
    """Drive proposers over the same running rows, advancing 1-3 tokens per step (as verifies
    would), retiring row 0 at step `retire_at` (the last row moves into its slot). proposers[k]
    starts proposing at step switch_on[k], for `engine`. Returns, per step, the trees of the
    active proposers."""
    g = torch.Generator().manual_seed(0)
    running = [_start(s, i) for i, s in enumerate(seqs)]
    for p in proposers:
        p.begin()
    trees = []
    for step in range(steps):
        if step == retire_at:
            last = running.pop()
            for p in proposers:
                p.moved(len(running), 0, last)
            running[0] = last
        trees.append([p.propose(engine, running, arm) if step >= on else None for p, on in zip(proposers, switch_on)])
        for s in running:
            room = seqs[s.req_index].tokens.shape[0] - 1 - s.length
            _advance(s, seqs[s.req_index], min(int(torch.randint(1, 4, (1,), generator=g)), room))
    return trees


@pytest.mark.parametrize("arm,layers", [(Arm("drafter", 3, 2, 5), 1), (Arm("drafter", 4, 3, 12), 1),
                                        (Arm("drafter", 4, 3, 12), 2)])
def test_catch_up_equals_drafting_from_the_start(target, seqs, arm, layers):
    """SD on from the first step, switched on at step 3, or at step 6 (after a slot move):
    the same trees once on, and every tree is valid."""
    d = _drafter(target, layers=layers)
    runs = _replay([DrafterProposer(d) for _ in range(3)], seqs, arm, steps=8, switch_on=[0, 3, 6], retire_at=5,
                   engine=Engine(target))
    allowed = set(VOCAB)
    for step, trees in enumerate(runs):
        ref = trees[0]
        assert ref.tokens.shape == (len(seqs) - (step >= 5), arm.num_draft_tokens)
        assert set(ref.tokens.flatten().tolist()) <= allowed
        assert bool((ref.depths <= arm.draft_depth).all())
        for t in trees[1:]:
            if t is not None:
                assert torch.equal(t.tokens, ref.tokens) and torch.equal(t.parents, ref.parents)


class _TreePath(DrafterProposer):
    """The reference path: every arm through build_tree."""

    def propose(self, engine, running, arm):
        return self.propose_tree(engine, running, arm)


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("arm,layers", [(Arm("drafter", 4, 1, 4), 1), (Arm("drafter", 6, 1, 3), 1),
                                        (Arm("drafter", 1, 1, 1), 1), (Arm("drafter", 4, 1, 4), 2)])
def test_chain_fast_path_equals_the_build_tree_path(target, seqs, arm, layers, graphs):
    """Chains skip build_tree; they must give its trees, step after step (catch-up, slot moves),
    in fp32 and in bf16; and so must the chain loop over the step graphs' buckets (on a CPU
    without capture: from step 5 five rows padded to the cache's six, keys to 256)."""
    for dtype in (torch.float32, torch.bfloat16):
        d = _drafter(target, layers=layers).to(dtype)
        runs = _replay([_TreePath(d), DrafterProposer(d)], seqs, arm, steps=8, switch_on=[0, 0], retire_at=5,
                       engine=Engine(target, EngineConfig(graphs=graphs)))
        for ref, fast in runs:
            assert ref.parents.tolist() == [list(range(-1, arm.num_draft_tokens - 1))] * ref.batch_size
            assert torch.equal(fast.tokens, ref.tokens) and torch.equal(fast.parents, ref.parents)


def test_simulated_accept_counts_match_a_hand_walk(target, seqs):
    """accept_len of the replay: every verify emits between 1 and draft_depth + 1 tokens and the
    emitted tokens add up to the responses' lengths (the first token comes from prefill)."""
    arm = Arm("drafter", 3, 2, 6)
    stats = simulate_accept(_drafter(target), seqs, arm, max_batch=4)
    total = sum(s.tokens.shape[0] - s.prompt_len - 1 for s in seqs)
    assert stats.emitted == total and 1.0 <= stats.accept_len <= arm.draft_depth + 1
    assert sum(stats.accept_hist) == stats.verify_steps


# ---- training and export --------------------------------------------------------------------


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(target, seqs):
    d = Drafter.from_target(target, VOCAB, "tiny")
    batches = pack(seqs, 64)
    head = target.lm_head.weight.detach()[d.d2t]
    before = evaluate_loss(d, batches, head)
    train_drafter(d, batches, head, DrafterTrainConfig(lr=3e-3, warmup_steps=5), should_stop=lambda step: step >= 60)
    after = evaluate_loss(d, batches, head)
    assert after.loss < 0.7 * before.loss and after.smooth_l1 < before.smooth_l1  # measured: 0.52x


# What each engine's EAGLE-1 weight loader has a place for (both prefix "model." to every name but
# lm_head and refuse a tensor with no place): the layer's projections and its post-attention norm
# (input_layernorm is replaced by the identity), and fc. vLLM: vllm/model_executor/models/
# llama_eagle.py, EagleLlamaForCausalLM.load_weights -> LlamaModel (fc is a ReplicatedLinear with
# bias=False). SGLang: python/sglang/srt/models/llama_eagle.py, LlamaForCausalLMEagle.load_weights
# -> LlamaModel (fc is torch.nn.Linear, whose bias is on and must be loaded).
# A second layer has its input norm (vLLM: LlamaDecoderLayer(disable_input_layernorm=i == 0)).
_LAYER_NAMES = {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {
    f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {"layers.0.post_attention_layernorm.weight"}
_SECOND_LAYER = {n.replace("layers.0.", "layers.1.") for n in _LAYER_NAMES} | {"layers.1.input_layernorm.weight"}
EXPECTED_WEIGHTS = {"vllm": _LAYER_NAMES | {"fc.weight"}, "sglang": _LAYER_NAMES | {"fc.weight", "fc.bias"}}
# The class each resolves: vLLM's method="eagle" prefixes "Eagle" to the architecture
# (vllm/transformers_utils/configs/eagle.py, EAGLEConfig) and its registry maps EagleLlamaForCausalLM
# (vllm/model_executor/models/registry.py); SGLang's EntryClass is LlamaForCausalLMEagle.
EXPECTED_CLASS = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
# Config keys both loaders' Llama layers read (vllm .../models/llama.py LlamaDecoderLayer/LlamaAttention,
# sglang .../models/llama.py likewise).
EXPECTED_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                 "vocab_size", "hidden_act", "tie_word_embeddings"}


@pytest.mark.parametrize("engine,layers", [("vllm", 1), ("sglang", 1), ("vllm", 2), ("sglang", 2)])
def test_export_has_exactly_what_the_engine_loader_reads_and_round_trips(tmp_path, target, seqs, engine, layers):
    from safetensors.torch import load_file

    d = _drafter(target, layers=layers)
    save_drafter(d, tmp_path / "dr")
    out = export(tmp_path / "dr", tmp_path / "eagle", engine, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [EXPECTED_CLASS[engine]] and config["num_hidden_layers"] == layers
    assert EXPECTED_KEYS <= set(config) and config["vocab_size"] == 96
    assert "tailrl" not in config and "fingerprint" not in json.dumps(config)  # provenance is a side file
    # Both loaders read every *.safetensors (and, without one, *.pt / *.bin) at the top level only.
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    second = _SECOND_LAYER if layers == 2 else set()
    assert set(load_file(out / "model.safetensors")) == EXPECTED_WEIGHTS[engine] | second
    if engine == "sglang":
        assert torch.equal(torch.load(out / "hot_token_ids.pt"), d.d2t)  # --speculative-token-map
        assert not load_file(out / "model.safetensors")["fc.bias"].any()
    else:
        assert not (out / "hot_token_ids.pt").exists()
    head = load_file(out / "tailrl" / "draft_head.safetensors")
    assert torch.equal(head["d2t"] + torch.arange(len(VOCAB)), torch.tensor(sorted(VOCAB)))
    assert head["t2d"].sum() == len(VOCAB)
    back = load_exported(out, target)
    assert torch.equal(_outputs(back, seqs), _outputs(d, seqs))


def test_export_replaces_only_an_earlier_export_and_refuses_unsupported_families(tmp_path, target):
    save_drafter(_drafter(target), tmp_path / "dr")
    first = export(tmp_path / "dr", tmp_path / "eagle", "sglang")
    export(tmp_path / "dr", first, "vllm")  # an earlier export is replaced whole
    assert not (first / "hot_token_ids.pt").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(DrafterError, match="not a tailrl export"):
        export(tmp_path / "dr", tmp_path / "mine", "vllm")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    qwen = load_model(_qwen2_dir(tmp_path), dtype="fp32")
    save_drafter(Drafter.from_target(qwen, VOCAB, "qwen"), tmp_path / "qd")
    with pytest.raises(DrafterError, match="vllm has no EAGLE-1 class for qwen2"):
        export(tmp_path / "qd", tmp_path / "q-vllm", "vllm")
    assert not (tmp_path / "q-vllm").exists()
    config = json.loads((export(tmp_path / "qd", tmp_path / "q-sg", "sglang") / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLMEagle"]


def _qwen2_dir(tmp_path):
    path = tmp_path / "qwen2"
    build_hf("qwen2", seed=2).save_pretrained(path)
    return path


@pytest.mark.slow
def test_warmup_on_smollm2_writes_a_drafter_and_its_curves(tmp_path, smollm2_dir):
    from tailrl.warmup import WarmupConfig, warmup

    cfg = WarmupConfig(model=str(smollm2_dir), num_prompts=6, holdout_prompts=2, group_size=2, max_new_tokens=32,
                       seconds=0, steps=15, batch_tokens=512, draft_vocab_size=512)
    events = []
    report = warmup(cfg, tmp_path / "dr", on_progress=events.append)
    assert {e.phase for e in events} == {"sample", "train", "eval"}
    for name in ("drafter.json", "drafter.safetensors", "loss.png", "losses.json"):
        assert (tmp_path / "dr" / name).is_file()
    assert report.steps == 15 and len(json.loads((tmp_path / "dr" / "losses.json").read_text())["train_loss"]) == 15
    assert report.heldout["after"]["loss"] < report.heldout["before"]["loss"]
    assert set(report.accept) == {"temperature 1", "greedy"}
    # Chains of depth 2, 4 (the replay depth) and 6 (the stopping rule's), each beside its ceiling, and the tree.
    assert list(report.accept["temperature 1"]) == ["drafter(2,1,2)", "drafter(4,1,4)", "drafter(6,1,6)",
                                                    "drafter(4,4,16)"]
    for arms in report.accept.values():
        for label, v in arms.items():
            hist = v["accept_hist"]  # each verify emits its accepted drafts and one more, cut at a response's end
            assert sum(hist) == v["verify_steps"]
            assert (v["accept_len"] * v["verify_steps"]
                    <= sum(d * n for d, n in enumerate(hist)) + v["verify_steps"] + 1e-6)
            if "ceiling" in v:
                assert v["of_ceiling"] == round(v["accept_len"] / v["ceiling"], 3)


def test_cli_export_needs_an_engine_and_writes_its_layout(tmp_path, target, capsys):
    from tailrl.cli import main

    save_drafter(_drafter(target), tmp_path / "dr")
    with pytest.raises(SystemExit) as e:  # argparse: --for is required
        main(["drafter", "export", str(tmp_path / "dr"), "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "--for" in capsys.readouterr().err
    assert main(["drafter", "export", str(tmp_path / "dr"), "--out", str(tmp_path / "v"), "--for", "vllm"]) == 0
    assert json.loads((tmp_path / "v" / "config.json").read_text())["architectures"] == ["EagleLlamaForCausalLM"]
    capsys.readouterr()
    assert main(["drafter", "export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "y"), "--for", "sglang"]) == 2
    assert capsys.readouterr().err.startswith("tailrl: error: drafter directory not found")
