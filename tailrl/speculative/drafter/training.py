"""Training the drafter: data packing, the loss, an optimizer loop, and a held-out accept simulation.

Data. A TrainSeq is a token sequence with the target's hidden state at every position but the
last, exactly what the engine keeps (Seq.prompt_hidden + Seq.hidden, or a prompt forward plus
Completion.hidden): tokens x_0..x_{T-1}, hidden h_0..h_{T-2} (h_q produced x_{q+1}).

The offset (docs/architecture.md). Entry i = 0..T-3 reads (h_i, embed(x_{i+1})) at position i and
is trained to predict h_{i+1}: SmoothL1 against h_{i+1}, plus ce_weight x cross-entropy of the
drafter's draft-vocabulary distribution against the target's distribution of x_{i+2},
softmax(lm_head(h_{i+1})) restricted to the draft vocabulary and renormalised. The soft target (not
the sampled token) is what the drafter must imitate to rank the tokens the target will sample at
any temperature; it carries the whole distribution per position, so it has less variance than the
sampled token, and costs one K x E product. The last token x_{T-1} has no hidden state, so entry
T-2 would have no target and is not made. Optionally (unroll) the same loss one draft step deeper:
(predicted h_{i+1}, x_{i+2}) -> h_{i+2}, attending to the real entries up to i and itself, as a
tree's second layer does (the idea of EAGLE-3's training-time test, one step of it).

Packing. Several sequences share a row of at most max_tokens entries; each keeps its own positions
(from its first position) and a block-diagonal causal mask, so none attends to another; a sequence
longer than a row is cut into windows of a row, each with some context before it. Siblings
(sequences from position 0 with the same prompt: a GRPO group) share one copy of their prompt's
entries in a row: entries 0..P-3 (no loss: they predict prompt tokens) come once, and each
sibling's entries from P-2 on attend to them and to their own, so every entry sees what it would
see packed alone. A group's responses are short next to its prompt once RL has sharpened the
policy (~20 tokens after a ~180-token prompt on the default task), and then sharing puts several
times more loss-carrying entries into a micro-step of the same size.

Knows: the drafter's forward, the loss, AdamW, how SD acceptance counts on a known continuation
(and the engine's Seq layout, to replay it). Does not know: sampling, verification, tokenizers.

Shapes: R packed rows (1 here), T entries in a row, E hidden size, K draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tailrl.engine import Seq
from tailrl.records import Request
from tailrl.speculative.drafter.model import Drafter, DrafterProposer


@dataclass
class TrainSeq:
    """tokens (T,) from absolute position `offset`; hidden (T-1, E): hidden[j] = h_{offset+j}."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    prompt_len: int  # P: entries predicting a response token (absolute i >= P - 2) carry the loss
    offset: int = 0

    def __post_init__(self) -> None:
        if self.hidden.shape[0] != self.tokens.shape[0] - 1:
            n, t = self.hidden.shape[0], self.tokens.shape[0]
            raise ValueError(f"need one hidden row per token but the last, got {n} rows for {t} tokens")


@dataclass
class Packed:
    """One packed row of drafter entries."""

    ids: torch.Tensor  # (1, T) x_{i+1}
    hidden: torch.Tensor  # (1, T, E) h_i, the input
    target: torch.Tensor  # (1, T, E) h_{i+1}, the regression target
    next_ids: torch.Tensor  # (1, T) x_{i+2}, the token the target actually produced next
    positions: torch.Tensor  # (1, T) i
    mask: torch.Tensor  # (1, 1, T, T) block-diagonal causal
    loss_mask: torch.Tensor  # (1, T) entries in the loss


def entries(seq: TrainSeq, lo: int, hi: int, trained_from: int = 0) -> dict[str, torch.Tensor]:
    """Entries lo..hi-1 of one sequence, before packing (module doc); those before `trained_from`
    are context only, without loss."""
    idx = torch.arange(lo, hi)
    pos = seq.offset + idx
    return dict(
        ids=seq.tokens[lo + 1 : hi + 1],
        hidden=seq.hidden[lo:hi],
        target=seq.hidden[lo + 1 : hi + 1],
        next_ids=seq.tokens[lo + 2 : hi + 2],
        positions=pos,
        loss=(pos >= seq.prompt_len - 2) & (idx >= trained_from),
    )


def windows(n: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """(lo, hi, trained_from) spans of a row each that train every one of n entries once.

    A response longer than a row is where drafting gets hard (acceptance falls with position), so
    its late entries are trained, not cut: after the first, a window starts with a quarter of a
    row of the entries before it as context without loss, so that its first trained entries attend
    to context as they do when drafting (the rest of the context reaches them through h_i).
    """
    spans = [(0, min(n, max_tokens), 0)]
    context = max_tokens // 4
    while spans[-1][1] < n:
        done = spans[-1][1]
        lo = done - context
        spans.append((lo, min(n, lo + max_tokens), done))
    return spans


def pack(seqs: list[TrainSeq], max_tokens: int) -> list[Packed]:
    """Greedy packing in the given order, siblings grouped at their first sequence's place and
    sharing their prompt's entries (module doc); a sequence longer than max_tokens is cut into
    windows (`windows`), each placed as a sequence of its own."""
    rows: list[list[dict]] = [[]]
    used = 0
    for group in _siblings(seqs):
        first = group[0]
        shared = first.prompt_len - 2 if len(group) > 1 and first.prompt_len - 2 < max_tokens else 0  # entries 0..P-3
        context = entries(first, 0, shared) if shared > 0 else None
        in_row, at = False, -1  # whether the group's context is in the current row, and its part index
        for s in group:
            for k, span in enumerate(windows(s.tokens.shape[0] - 2, max_tokens)):
                e = entries(s, *span)
                with_context = k == 0 and context is not None
                if with_context:
                    e = {key: v[shared:] for key, v in e.items()}
                n = e["ids"].shape[0] + (shared if with_context and not in_row else 0)
                if used + n > max_tokens and rows[-1]:
                    rows.append([])
                    used, in_row = 0, False
                if with_context and not in_row:
                    rows[-1].append(dict(context, ctx=-1))
                    used += shared
                    in_row, at = True, len(rows[-1]) - 1
                rows[-1].append(dict(e, ctx=at if with_context else -1))
                used += e["ids"].shape[0]
    return [_pack_row(r) for r in rows if r]


def _siblings(seqs: list[TrainSeq]) -> list[list[TrainSeq]]:
    """Sequences with >= 1 entry, grouped by prompt (from position 0, P >= 3) in first-seen order.

    The prompt's hidden states must match too: the buffer can hold the same problem from two
    steps (a JSONL task repeats its problems), sampled by two policies, and a sibling must not
    attend to another policy's prompt states.
    """
    groups: dict[Any, list[TrainSeq]] = {}
    for s in seqs:
        if s.tokens.shape[0] < 3:
            continue  # no entry has a target
        key: Any = id(s)
        if s.offset == 0 and s.prompt_len >= 3 and s.tokens.shape[0] > s.prompt_len:
            prompt = tuple(s.tokens[: s.prompt_len].tolist())
            head = groups.get(prompt)
            ctx = s.prompt_len - 2
            if head is None or torch.equal(head[0].hidden[:ctx], s.hidden[:ctx]):
                key = prompt
        groups.setdefault(key, []).append(s)
    return list(groups.values())


def _pack_row(parts: list[dict]) -> Packed:
    cat = {k: torch.cat([p[k] for p in parts])[None] for k in parts[0] if k != "ctx"}
    seg = torch.cat([torch.full((p["ids"].shape[0],), i) for i, p in enumerate(parts)])
    ctx = torch.cat([torch.full((p["ids"].shape[0],), p["ctx"]) for p in parts])  # -1: none
    t = seg.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    # An entry sees its own sequence's earlier entries and, for a sibling, its group's prompt entries.
    mask = (causal & ((seg[:, None] == seg[None, :]) | (ctx[:, None] == seg[None, :])))[None, None]
    hidden, target = cat["hidden"].float(), cat["target"].float()
    return Packed(cat["ids"], hidden, target, cat["next_ids"], cat["positions"], mask, cat["loss"])


@dataclass
class LossStats:
    loss: float
    smooth_l1: float
    ce: float
    top1_target: float  # drafter argmax == target argmax (over the draft vocabulary)
    top1_next: float  # drafter argmax == the token actually produced next
    entries: int


def drafter_loss(
    drafter: Drafter,
    batch: Packed,
    target_head: torch.Tensor,
    ce_weight: float = 0.1,
    noise: float = 0.0,
    unroll: bool = False,
) -> tuple[torch.Tensor, LossStats]:
    """SmoothL1(pred, h_{i+1}) + ce_weight * CE(drafter, target distribution of x_{i+2}).

    target_head (K, E): the target's LM-head rows of the draft vocabulary (fixed, not the
    drafter's head). noise: uniform input noise on h_i, +-noise (EAGLE's robustness trick).
    unroll: add the same loss one draft step deeper, where the drafter reads its own prediction
    as a tree does (see _second_step); stats stay those of the first step.
    """
    h = batch.hidden
    if noise > 0:
        h = h + noise * (2 * torch.rand_like(h) - 1)
    pred = drafter(h, batch.ids, batch.positions, mask=batch.mask)  # (1, T, E)
    m = batch.loss_mask
    loss, stats = _term(drafter, pred[m], batch.target[m], batch.next_ids[m], target_head, ce_weight)
    if unroll:
        pred2, keep = _second_step(drafter, batch, pred)
        t = batch.target[:, 1:][keep]
        loss = loss + _term(drafter, pred2[keep], t, batch.next_ids[:, 1:][keep], target_head, ce_weight)[0]
    return loss, stats


def _term(drafter, pred, target, next_ids, target_head, ce_weight) -> tuple[torch.Tensor, LossStats]:
    """The loss of predictions pred (N, E) against target hidden states (N, E)."""
    reg = F.smooth_l1_loss(pred.float(), target)
    with torch.no_grad():
        p = torch.softmax(target @ target_head.T.float(), dim=-1)  # (N, K)
    logq = torch.log_softmax(drafter.logits(pred).float(), dim=-1)
    ce = -(p * logq).sum(-1).mean()
    loss = reg + ce_weight * ce
    with torch.no_grad():
        guess = logq.argmax(-1)
        top1_target = float((guess == p.argmax(-1)).float().mean())
        top1_next = float((drafter.d2t[guess] == next_ids).float().mean())
    return loss, LossStats(loss.item(), reg.item(), ce.item(), top1_target, top1_next, pred.shape[0])


def _second_step(drafter: Drafter, batch: Packed, pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry i one step deeper: (predicted h_{i+1}, x_{i+2}) at position i + 1 -> h_{i+2}.

    As in a draft tree, it attends to the real entries up to i (teacher-forced keys) and to
    itself. One forward over [real entries ; second-step entries] with that mask; returns the
    second-step predictions (1, T-1, E) and which of them have a target (entry i+1 exists in the
    same sequence and is in the loss).
    """
    t = batch.ids.shape[1]
    real = batch.mask[0, 0]  # (T, T)
    mask = torch.cat(
        [torch.cat([real, torch.zeros_like(real)], 1), torch.cat([real, torch.eye(t, dtype=torch.bool)], 1)]
    )[None, None]  # (1, 1, 2T, 2T)
    h2 = torch.cat([batch.hidden, pred], 1)
    ids2 = torch.cat([batch.ids, batch.next_ids], 1)
    pos2 = torch.cat([batch.positions, batch.positions + 1], 1)
    out = drafter(h2, ids2, pos2, mask=mask)[:, t:-1]  # (1, T-1, E)
    same = real.diagonal(-1)[None]  # (1, T-1) entry i+1 sees entry i: the same sequence
    return out, same & batch.loss_mask[:, 1:]


@torch.no_grad()
def evaluate_loss(
    drafter: Drafter, batches: list[Packed], target_head: torch.Tensor, ce_weight: float = 0.1
) -> LossStats:
    """Entry-weighted mean of the loss statistics over batches."""
    total: dict[str, float] = {}
    n = 0
    for b in batches:
        _, s = drafter_loss(drafter, b, target_head, ce_weight)
        for k in ("loss", "smooth_l1", "ce", "top1_target", "top1_next"):
            total[k] = total.get(k, 0.0) + getattr(s, k) * s.entries
        n += s.entries
    return LossStats(**{k: v / max(n, 1) for k, v in total.items()}, entries=n)


# Continuing a trained drafter on one step's fresh samples (spot training, the RL loop's learner):
# lower than the warm-up's rate, where a larger step overshoots (the replay that chose it:
# docs/workers.md, "Packing"); a micro-step of this many entries bounds how long a stop waits.
CONTINUE_LR = 1e-4
CONTINUE_BATCH_TOKENS = 512


def drafter_optimizer(drafter: Drafter, lr: float,
                      weight_decay: float = 0.0) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """The drafter's trainable parameters and an AdamW over them."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    return params, torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def micro_step(
    drafter: Drafter,
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    batch: Packed,
    target_head: torch.Tensor,
    ce_weight: float,
    noise: float = 0.0,
    unroll: bool = False,
) -> LossStats:
    """One optimizer step on one packed row (gradient norm clipped to 1): the unit every drafter
    training loop (warm-up, spot training, the RL loop's learner) is made of."""
    loss, stats = drafter_loss(drafter, batch, target_head, ce_weight, noise, unroll)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return stats


@dataclass(frozen=True)
class DrafterTrainConfig:
    """Optimiser and loss settings of `train` (warm-up and spot training set them)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    ce_weight: float = 0.1  # TLT's w
    noise: float = 0.0  # drafter_loss's input noise
    train_head: bool = True  # else the head stays the target's LM-head rows (exact SGLang export)
    unroll: bool = False  # drafter_loss's second draft step
    warmup_steps: int = 20  # linear learning-rate ramp: the first steps' large gradients overshoot


def train_drafter(
    drafter: Drafter,
    batches: list[Packed],
    target_head: torch.Tensor,
    cfg: DrafterTrainConfig,
    should_stop: Callable[[int], bool],
    on_step: Callable[[int, LossStats], None] | None = None,
    seed: int = 0,
    lr_scale: Callable[[], float] = lambda: 1.0,
) -> list[LossStats]:
    """AdamW over the batches (shuffled each epoch) until should_stop(step) is True. The rate
    of each step is cfg.lr times the ramp times lr_scale() (a schedule the caller steers from
    what it measures between steps, e.g. tailrl.speculative.drafter.plateau)."""
    if not batches:
        raise ValueError("no training entries: every sequence is shorter than 3 tokens")
    drafter.train()
    drafter.head.requires_grad_(cfg.train_head)
    params, opt = drafter_optimizer(drafter, cfg.lr, cfg.weight_decay)
    ramp = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)) * lr_scale())
    gen = torch.Generator().manual_seed(seed)
    history: list[LossStats] = []
    step = 0
    while not should_stop(step):
        for i in torch.randperm(len(batches), generator=gen).tolist():
            if should_stop(step):
                break
            stats = micro_step(drafter, opt, params, batches[i], target_head, cfg.ce_weight, cfg.noise, cfg.unroll)
            ramp.step()
            history.append(stats)
            step += 1
            if on_step is not None:
                on_step(step, stats)
    drafter.eval()
    return history


# ---- held-out acceptance, simulated ------------------------------------------------------------


@dataclass
class AcceptStats:
    verify_steps: int
    emitted: int
    accept_hist: list[int]  # accept_hist[d]: verifies that accepted exactly d drafts

    @property
    def accept_len(self) -> float:
        return self.emitted / max(self.verify_steps, 1)


@torch.no_grad()
def top1_flags(seqs: list[TrainSeq], head: torch.Tensor, chunk: int = 1024) -> list[list[bool]]:
    """Per response token of each sequence (offset 0): was it the target's most likely one, from
    the target's LM head (V, E) on the hidden state that produced it: the Completion.top1 of a
    replay (up to float near-ties), from which tailrl.speculative.report.chain_ceiling gives the
    accept_len the target itself would reach as a chain drafter on these responses."""
    out = []
    for s in seqs:
        p = s.prompt_len
        h, nxt = s.hidden[p - 1 :], s.tokens[p:]  # h_{p-1+k} produced x_{p+k}
        best = torch.cat([(h[i : i + chunk].float() @ head.T.float()).argmax(-1) for i in range(0, h.shape[0], chunk)])
        out.append((best == nxt).tolist())
    return out


def _walk(tokens: list[int], parents: list[int], actual: list[int]) -> int:
    """Drafts accepted when the target emits `actual`: the longest tree path matching it."""
    node, depth = -1, 0
    while depth < len(actual):
        kids = [i for i, p in enumerate(parents) if p == node and tokens[i] == actual[depth]]
        if not kids:
            break
        node, depth = kids[0], depth + 1
    return depth


@torch.no_grad()
def simulate_accept(drafter: Drafter, seqs: list[TrainSeq], arm: Any, max_batch: int = 64) -> AcceptStats:
    """Speculative decoding replayed on known responses, with DrafterProposer as the engine runs it.

    Each sequence is a prompt (prompt_len tokens, offset 0) and the response the target sampled.
    With position-keyed sampling the verify walk emits exactly that response, so a draft node is
    accepted iff it matches the next response token: accept_len here is what the engine would
    measure (up to float near-ties). Rows retire and are refilled like the engine's slots.
    """
    proposer = DrafterProposer(drafter)
    proposer.begin()
    stats = AcceptStats(0, 0, [0] * (arm.draft_depth + 2))
    waiting = list(range(len(seqs)))
    running: list[Seq] = []
    while waiting or running:
        while waiting and len(running) < max_batch:
            j = waiting.pop(0)
            running.append(_start(seqs[j], j))
        tree = proposer.propose(None, running, arm)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for b, s in enumerate(running):
            full, p = seqs[s.req_index], s.length + 1  # next position to emit
            actual = full.tokens[p:].tolist()
            acc = _walk(tokens[b], parents[b], actual)
            emit = min(acc + 1, len(actual))
            stats.verify_steps += 1
            stats.emitted += emit
            stats.accept_hist[acc] += 1
            _advance(s, full, emit)
        i = 0
        while i < len(running):  # retire finished rows, the last row moves into the slot
            s = running[i]
            if s.length + 1 < seqs[s.req_index].tokens.shape[0]:
                i += 1
                continue
            last = running.pop()
            if last is not s:
                proposer.moved(len(running), i, last)
                running[i] = last
    return stats


def _start(seq: TrainSeq, index: int) -> Seq:
    """The engine's state right after prefill: first response token emitted, pending."""
    p = seq.prompt_len
    s = Seq(index, Request(tuple(seq.tokens[:p].tolist()), seed=0), length=p, pending=int(seq.tokens[p]))
    s.prompt_hidden = seq.hidden[: p - 1]
    s.tokens = [s.pending]
    s.hidden = [seq.hidden[p - 1 : p]]
    return s


def _advance(s: Seq, full: TrainSeq, n: int) -> None:
    """Emit n more tokens of the known response (the engine's state after a verify)."""
    for _ in range(n):
        s.length += 1
        s.pending = int(full.tokens[s.length])
        s.tokens.append(s.pending)
        s.hidden.append(full.hidden[s.length - 1 : s.length])  # h_{L-1}: what produced the new pending
