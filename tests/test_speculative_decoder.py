"""The speculative step: SD on and SD off emit the same tokens, logprobs and hidden states.

A random tiny target accepts few real drafts, so most tests use an oracle proposer that knows
what plain decoding emits (precomputed by a plain run with EOS disabled, so it also drafts past
EOS and the length limit) and hides it among wrong siblings: long accepted paths at
non-consecutive verify indices exercise KV compaction and the EOS / length cut. A scrambled
oracle (random tree shapes, half the nodes right) and a purely random proposer cover arbitrary
tree masks.

Tolerances: the same position's logits come from a 1-token forward (plain) and from a T-token
tree forward (SD); tailrl.model makes them equal bit for bit on the CPUs measured, but logprobs
and hidden states are compared at 1e-5 so these tests check the mechanism, not a platform's
kernels. The last test holds the real model to exact token equality over a longer run.
"""

from __future__ import annotations

import random

import pytest
import torch

from tailrl import decode_kernels
from tailrl.engine import Engine, EngineConfig, Seq
from tailrl.loading import load_model, resolve_dtype
from tailrl.records import Request
from tailrl.sampling import SamplingParams
from tailrl.speculative import decoder as decoder_mod
from tailrl.speculative.decoder import NgramProposer, SpecDecoder, fixed, tuned
from tailrl.speculative.tree import DraftTree
from tailrl.stats import SpecStats, position_bucket, position_label
from tailrl.tuner import PLAIN, Arm, Tuner, TunerConfig

ATOL = 1e-5
MAX_NEW = 24
PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "t1_top_p_top_k": SamplingParams(temperature=1.0, top_p=0.9, top_k=20),
    "t07": SamplingParams(temperature=0.7),
}


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, dtype="fp32")


def requests(seed: int = 0) -> list[Request]:
    """7 requests for 3 slots: two groups of 3 sharing a prompt, one single; distinct seeds."""
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(2, 96) for _ in range(n)) for n in (5, 9, 3)]
    groups = [0, 0, 0, 1, 1, 1, 2]
    return [Request(prompts[g], seed=1000 * seed + i, group=g) for i, g in enumerate(groups)]


def run(model, reqs, params, decoder=None, max_new=MAX_NEW, capture=False, eos=True):
    engine = Engine(model, EngineConfig(max_batch=3, capture_hidden=capture))
    if decoder is not None:
        engine.decoder = decoder
    if not eos:
        engine.eos = set()
    return engine.generate(reqs, params, max_new), engine.stats


class Oracle:
    """Proposes the plain continuation among wrong siblings; `scramble` randomises the tree."""

    kind = "drafter"
    needs_hidden = False

    def __init__(self, reference: list[list[int]] | None, scramble: float = 0.0, seed: int = 0):
        self.reference, self.scramble, self.rng = reference, scramble, random.Random(seed)

    def begin(self, engine):
        pass

    def moved(self, src, dst, seq):
        pass

    def finished(self, seq):
        pass

    def propose(self, engine, running: list[Seq], arm: Arm) -> DraftTree:
        rows = [self._row(s, arm) for s in running]
        return DraftTree(torch.tensor([t for t, _ in rows]), torch.tensor([p for _, p in rows]))

    def _row(self, seq: Seq, arm: Arm) -> tuple[list[int], list[int]]:
        done = len(seq.tokens)
        truth = self.reference[seq.req_index][done : done + arm.draft_depth] if self.reference else []
        n = arm.num_draft_tokens
        if self.scramble:
            # Random shape; a node is right (the truth at its depth) with probability 1 - scramble.
            parents = [self.rng.randrange(-1, i) for i in range(n)]
            depth: list[int] = []
            for p in parents:
                depth.append(1 if p < 0 else depth[p] + 1)
            right = [d <= len(truth) and self.rng.random() > self.scramble for d in depth]
            tokens = [truth[d - 1] if r else self.rng.randrange(96) for d, r in zip(depth, right)]
            return tokens, parents
        # A wrong sibling before each right node, so accepted nodes sit at verify indices 2, 4, ...
        tokens, parents, last = [], [], -1
        for t in truth:
            if len(tokens) + 2 > n:
                break
            tokens += [(t + 1) % 96, t]
            parents += [last, last]
            last = len(tokens) - 1
        while len(tokens) < n:
            tokens.append(self.rng.randrange(96))
            parents.append(-1)
        return tokens, parents


def random_proposer(seed: int = 0) -> Oracle:
    """Random tree shapes and tokens: an oracle that knows nothing."""
    return Oracle(None, scramble=1.0, seed=seed)


def reference(model, reqs, params, arm):
    """What plain decoding emits per request, EOS ignored, far enough for any draft."""
    outs, _ = run(model, reqs, params, max_new=MAX_NEW + arm.draft_depth + 1, eos=False)
    return [c.token_ids for c in outs]


def assert_same(plain, spec, hidden=False):
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert s.finish_reason == p.finish_reason
        assert max(abs(a - b) for a, b in zip(s.logprobs, p.logprobs)) <= ATOL
        assert s.top1 == p.top1  # scored at the same positions by the verify forward
        if hidden:
            assert s.hidden.shape == p.hidden.shape == (len(p.token_ids), 64)
            assert (s.hidden - p.hidden).abs().max().item() <= ATOL


def assert_stats_consistent(stats, completions, arm):
    sp = stats.spec
    assert sum(sp.accept_hist) == sp.verify_steps
    assert sum(d * n for d, n in enumerate(sp.accept_hist)) == sp.accepted
    assert sp.proposed == sp.verify_steps * arm.num_draft_tokens
    # Cuts at EOS / the length limit drop accepted tokens, never add any.
    assert sp.emitted <= sp.verify_steps + sp.accepted
    total = sum(len(c.token_ids) for c in completions)
    # Each request's first token comes from its prefill; the rest from spec or plain steps.
    assert stats.tokens == total == len(completions) + sp.emitted + sp.plain_tokens
    assert sp.spec_steps + sp.plain_steps == stats.steps
    # Acceptance by response position partitions the verifies and their tokens.
    assert sum(sp.position_verifies) == sp.verify_steps and sum(sp.position_emitted) == sp.emitted


def test_response_positions_fall_in_half_open_buckets():
    assert [position_bucket(p) for p in (0, 511, 512, 1023, 1024, 2047, 2048, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [position_label(b) for b in range(4)] == ["0-512", "512-1024", "1024-2048", "2048+"]
    stats = SpecStats(position_verifies=[4, 0, 2, 0], position_emitted=[10, 0, 3, 0])
    assert stats.accept_len_by_position() == {"0-512": 2.5, "1024-2048": 1.5}


ARM = Arm("drafter", draft_depth=5, topk=2, num_draft_tokens=10)


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("seed", [0, 1])
def test_oracle_sd_equals_plain(model, name, seed):
    params, reqs = PARAMS[name], requests(seed)
    plain, _ = run(model, reqs, params, capture=True)
    oracle = Oracle(reference(model, reqs, params, ARM), seed=seed)
    spec, stats = run(model, reqs, params, fixed(ARM, oracle), capture=True)
    assert_same(plain, spec, hidden=True)
    assert_stats_consistent(stats, spec, ARM)
    sp = stats.spec
    # The truth is always in the tree (5 deep), so only the finishing verify of each request can
    # accept fewer than 5: accept_len = 6 except where a request ends.
    assert sp.accept_hist[5] >= sp.verify_steps - len(reqs)
    assert sp.accept_len > 4.0
    assert sp.emitted < sp.verify_steps + sp.accepted  # some path ran past EOS / the limit and was cut


def test_compaction_is_what_makes_long_paths_right(model, monkeypatch):
    """Sensitivity check: without moving accepted K/V to consecutive positions the outputs differ."""
    params, reqs = PARAMS["greedy"], requests(0)
    plain, _ = run(model, reqs, params)
    oracle = Oracle(reference(model, reqs, params, ARM))
    monkeypatch.setattr(decoder_mod, "_compact", lambda cache, lens, paths: None)
    spec, _ = run(model, reqs, params, fixed(ARM, oracle))
    assert any(s.token_ids != p.token_ids for p, s in zip(plain, spec))


@pytest.mark.parametrize("name", ["greedy", "t1_top_p_top_k"])
def test_scrambled_and_random_trees_equal_plain(model, name):
    params, reqs = PARAMS[name], requests(2)
    plain, _ = run(model, reqs, params, capture=True)
    arm = Arm("drafter", draft_depth=4, topk=3, num_draft_tokens=12)
    ref = reference(model, reqs, params, arm)
    for proposer in (Oracle(ref, scramble=0.5, seed=3), random_proposer(seed=4)):
        spec, stats = run(model, reqs, params, fixed(arm, proposer), capture=True)
        assert_same(plain, spec, hidden=True)
        assert_stats_consistent(stats, spec, arm)
    assert stats.spec.verify_steps > 0


def test_max_new_tokens_one_and_two(model):
    """A first token that ends a sequence is never followed by a speculative step's tokens."""
    params, reqs = PARAMS["t07"], requests(3)
    for max_new in (1, 2):
        plain, _ = run(model, reqs, params, max_new=max_new)
        oracle = Oracle(reference(model, reqs, params, ARM))
        spec, stats = run(model, reqs, params, fixed(ARM, oracle), max_new=max_new)
        assert_same(plain, spec)
        assert all(len(c.token_ids) <= max_new for c in spec)
        assert_stats_consistent(stats, spec, ARM)


class ChainOracle(Oracle):
    """Proposes plain decoding's continuation as a chain (every node the child of the one before):
    each verify accepts the whole draft, and its mask is a prefix of the keys a token."""

    def _row(self, seq: Seq, arm: Arm) -> tuple[list[int], list[int]]:
        done, n = len(seq.tokens), arm.num_draft_tokens
        truth = self.reference[seq.req_index][done : done + n]
        return truth + [self.rng.randrange(96) for _ in range(n - len(truth))], list(range(-1, n - 1))


CHAIN = Arm("drafter", draft_depth=5, topk=1, num_draft_tokens=5)


def test_a_stop_inside_a_speculative_step_ends_the_response_where_plain_decoding_does(model):
    """Every verify accepts 5 drafts and emits 6 tokens (response positions 1-6, 7-12, ...); the
    stop is a token whose first place in request 0's response falls inside a verify's tokens, so
    the step is cut there: the tokens, log-probs and finish reasons of plain decoding with the same
    stop. EOS is off, so the stop is the only cut."""
    params, reqs = PARAMS["t07"], requests(5)
    ref = reference(model, reqs, params, CHAIN)
    at = next(i for i, t in enumerate(ref[0]) if i >= 2 and i % 6 != 0 and t not in ref[0][:i])
    stop = lambda tokens: tokens[-1] == ref[0][at]  # noqa: E731

    def generate(decoder=None):
        engine = Engine(model, EngineConfig(max_batch=3))
        engine.eos = set()
        if decoder is not None:
            engine.decoder = decoder
        return engine.generate(reqs, params, MAX_NEW, stop=stop), engine.stats

    plain, _ = generate()
    spec, stats = generate(fixed(CHAIN, ChainOracle(ref)))
    assert_same(plain, spec)
    assert spec[0].token_ids == ref[0][: at + 1] and spec[0].finish_reason == "stop"
    assert stats.spec.emitted < stats.spec.verify_steps + stats.spec.accepted  # accepted tokens dropped at the stop


def test_a_chain_verify_takes_the_decode_kernel_when_it_is_built(model, monkeypatch):
    """Where the C decode kernel is built (tailrl.decode_kernels), a chain's verify forward runs
    its attention there (`decode_step`, or `attn_step` with the projections where the few-row loop
    takes them): one call of CHAIN's 6 tokens a row per layer and verify, counted; and the tokens
    stay plain decoding's."""
    if decode_kernels.library() is None:
        pytest.skip("no C compiler: the kernel is not built")
    monkeypatch.setenv(decode_kernels.SWITCH, "1")
    calls = []
    # args[at]: each new token's cache position (B, T); a verify's first is past the prompt.
    for name, at in (("decode_step", 5), ("attn_step", 6)):
        real = getattr(decode_kernels, name)
        monkeypatch.setattr(decode_kernels, name, lambda *args, real=real, at=at: calls.append(
            (args[at].shape[1], int(args[at][:, 0].min()))) or real(*args))
    params, reqs = PARAMS["greedy"], requests(6)
    plain, _ = run(model, reqs, params)
    oracle = ChainOracle(reference(model, reqs, params, CHAIN))
    calls.clear()
    spec, stats = run(model, reqs, params, fixed(CHAIN, oracle))
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    verifies = [c for c in calls if c[0] == CHAIN.num_draft_tokens + 1 and c[1] > 0]
    assert stats.spec.spec_steps > 0 and len(verifies) == stats.spec.spec_steps * model.cfg.num_layers


def test_ngram_proposer_and_tuner_equal_plain(model):
    params, reqs = PARAMS["t1_top_p_top_k"], requests(4)
    plain, _ = run(model, reqs, params)
    arm = Arm("ngram", draft_depth=4, topk=2, num_draft_tokens=8)
    proposer = NgramProposer()
    spec, stats = run(model, reqs, params, fixed(arm, proposer))
    assert_same(plain, spec)
    assert_stats_consistent(stats, spec, arm)
    # Same requests again: the previous call's responses are in the n-gram history, so the
    # drafts now often carry the exact continuation.
    first_accept = stats.spec.accept_len
    again, stats = run(model, reqs, params, fixed(arm, proposer))
    assert_same(plain, again)
    assert stats.spec.accept_len > max(2.0, first_accept)
    # The tuner mixes plain and n-gram steps; the tokens stay the same.
    tuner = Tuner([PLAIN, arm], TunerConfig(switch_patience=0, epsilon=0.5, loser_margin=1.0), seed=0)
    mixed, stats = run(model, reqs, params, tuned(tuner, {"ngram": NgramProposer()}))
    assert_same(plain, mixed)
    assert_stats_consistent(stats, mixed, arm)
    assert stats.spec.plain_steps > 0 and stats.spec.spec_steps > 0
    assert sum(sum(p) for p in tuner.state_dict()["pulls"]) == stats.steps


def test_ngram_proposer_drafts_from_siblings_and_history():
    class Stub:
        device = torch.device("cpu")

    prompt, arm = (5, 6, 7), Arm("ngram", draft_depth=2, topk=1, num_draft_tokens=2)

    def seq(i, tokens, finish=None):
        return Seq(i, Request(prompt, seed=i), length=len(prompt) + len(tokens) - 1, pending=tokens[-1],
                   tokens=list(tokens), finish=finish)

    proposer = NgramProposer()
    proposer.begin(Stub)
    b = seq(1, [20, 11, 12])
    assert proposer.propose(Stub, [b], arm).tokens.tolist() == [[12, 12]]  # nothing matches: padding
    # A sibling finishing while the group is drafted joins its index at once.
    proposer.finished(seq(0, [10, 11, 12, 13, 14], finish="eos"))
    tree = proposer.propose(Stub, [b], arm)
    assert tree.tokens.tolist() == [[13, 14]] and tree.parents.tolist() == [[-1, 0]]
    # The next call starts with an empty index per group, filled from the previous calls' responses.
    proposer.begin(Stub)
    assert proposer.propose(Stub, [seq(2, [30, 11, 12])], arm).tokens.tolist() == [[13, 14]]


def test_decoder_rejects_unknown_arms(model):
    arm = Arm("drafter", draft_depth=2, topk=1, num_draft_tokens=2)
    with pytest.raises(ValueError, match="needs a 'drafter' proposer"):
        SpecDecoder({}, lambda running: arm, [arm])
    other = Arm("drafter", draft_depth=3, topk=1, num_draft_tokens=3)
    dec = SpecDecoder({"drafter": random_proposer()}, lambda running: other, [arm])
    with pytest.raises(ValueError, match="not one of the decoder's arms"):
        run(model, requests(0), PARAMS["greedy"], dec)


CHATS = ["What is the capital of France?", "List three colors.", "Repeat after me: one two three, one two three."]


def test_smollm2_ngram_sd_equals_plain(smollm2_dir):
    from tailrl.generate import encode_prompt
    from tailrl.loading import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    model = load_model(smollm2_dir, dtype="fp32")
    reqs = [Request(encode_prompt(tok, c), seed=i, group=i) for i, c in enumerate(CHATS)]
    arm = Arm("ngram", draft_depth=4, topk=2, num_draft_tokens=8)
    params = SamplingParams(temperature=0.0)
    plain, _ = run(model, reqs, params, max_new=32)
    spec, stats = run(model, reqs, params, fixed(arm, NgramProposer()), max_new=32)
    print(f"smollm2 n-gram accept_len {stats.spec.accept_len:.2f}")
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
    assert_stats_consistent(stats, spec, arm)


# The dtype this CPU's runs use (--dtype auto) runs by default, the other with the slow tests:
# fp32 where bf16 is emulated (where it costs 2-5x), bf16 where it is native. Exact mode in the
# other dtype keeps its deterministic guard in the default selection
# (test_model.py::test_token_logits_do_not_depend_on_the_forward_shape, both dtypes).
EXACTNESS_DTYPES = [pytest.param(d, marks=() if d == resolve_dtype("auto") else pytest.mark.slow)
                    for d in ("fp32", "bf16")]


@pytest.mark.parametrize("dtype", EXACTNESS_DTYPES)
def test_smollm2_speculation_gives_plain_tokens_exactly(smollm2_shallow_dir, dtype):
    """SmolLM2 (its first two layers, conftest.smollm2_shallow_dir: every matmul of the full
    model's shapes, at a fraction of the cost where bf16 is emulated), exact mode, temperature 1
    with top-p: the n-gram drafter as a chain and as a tree emits exactly plain decoding's tokens
    over 8 x 64 tokens in fp32 and 8 x 32 in bf16: the engine's whole speculative path end to end.
    Before the row-invariant forwards (tailrl.model) a verify rounded differently from a one-token step and
    ~1 token in 1,000 flipped at this temperature in fp32, so this run of 512 tokens would catch
    that with p ~ 0.4; in bf16 without exact mode all 16 sequences of a run like this one flipped
    within their first 4 tokens (docs/lossless.md), so 32 tokens catch it surely (the deterministic
    guard is test_model.py::test_token_logits_do_not_depend_on_the_forward_shape). How often a
    rounding difference flips a token depends on the CPU's kernels: on a Zen 5 EPYC this run gives
    identical tokens even without exact mode (fp32 and bf16, full or two-layer model)."""
    target = load_model(smollm2_shallow_dir, dtype=dtype)
    prompts = [tuple(range(1000 + 50 * i, 1000 + 50 * i + 20 + 7 * i)) for i in range(4)]
    reqs = [Request(prompts[i // 2], seed=7 + i, group=i // 2) for i in range(8)]
    params = SamplingParams(temperature=1.0, top_p=0.95)
    engine = Engine(target, EngineConfig(max_batch=8, exact=True))
    n = 64 if dtype == "fp32" else 32  # bf16 is emulated, so slow, where the CPU lacks it
    plain = [c.token_ids for c in engine.generate(reqs, params, n)]
    for arm in (Arm("ngram", 4, 1, 4), Arm("ngram", 3, 2, 6)):
        engine.decoder = fixed(arm, NgramProposer())
        assert [c.token_ids for c in engine.generate(reqs, params, n)] == plain, arm.label
        assert engine.stats.spec.verify_steps > 0

