"""Rollout engine: continuous batching over a slotted KV cache, plain and speculative steps.

Sequences occupy cache slots 0..B-1 (a finished sequence's slot is refilled by moving the last
running sequence into it), so every forward reads a view of the cache, never a gather. Where
the KV budget holds every slot at a sequence's worst case (prompt + max_new_tokens) the cache is
that; where it does not, the slots start short and grow as the longest sequence needs, fewer of
them as they grow (slots x positions stays within the budget), and the shortest sequences are
preempted when the running ones outnumber the slots: their KV is recomputed when a slot frees,
as vLLM's recompute preemption does. Memory is then the running batch times its longest
sequence, not every sequence's worst case; a paged cache would hold only the tokens in use, at
the cost of a gather per forward. Prompts
shared by several samples (GRPO groups) are prefilled once and their KV copied to each sibling,
and the distinct prompts admitted together are prefilled in one right-padded forward.
A step is either plain (one token per sequence) or speculative (a draft tree per sequence,
verified in one forward); the `decoder` (the StepDecoder contract below) chooses per step and
emits through `Engine.emit`. Exact mode is the engine's own choice of forward (`Engine.forward`
runs the model row-invariant): the model itself is not changed, so a policy shared with the
trainer trains with its ordinary kernels. Token choice is position-keyed
(tailrl.sampling), so a sequence's output does not depend on the batch it ran in or on how its
tokens were produced.

Knows: sampling, KV cache, continuous batching, drafting/verification plumbing, hidden-state
capture. Does not know: rewards, tokenizer text (stop strings arrive as a callable), optimizers.

Shapes: B running sequences, T tokens per row in a forward, S attended keys, V vocabulary,
E hidden size, N draft nodes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from tailrl import memory
from tailrl.kernels import check_thread_invariance, request_reproducible_kernels
from tailrl.kv_cache import KV_CHUNK, CacheView, KVCache, whole_chunks
from tailrl.model import Transformer
from tailrl.records import Completion, Progress, Request, Stop
from tailrl.sampling import SamplingParams, is_top1, next_position, sample
from tailrl.stats import EngineStats, StepRecord
from tailrl.step_graphs import StepGraphs

# Padded tokens per batched prefill forward: bounds its attention scores (heads x tokens x prompt
# length x 4 bytes: ~75 MB for SmolLM2 at 512-token prompts) while batching short prompts.
PREFILL_TOKENS = 4096


@dataclass
class EngineConfig:
    """Rollout engine resources."""

    max_batch: int = field(default=64, metadata={"help": "most sequences decoded together (cache slots)"})
    kv_budget_gb: float = field(default=4.0, metadata={"help": "memory for the KV cache, GiB"})
    capture_hidden: bool = field(default=False, metadata={"help": "record each token's target hidden state"})
    exact: bool = field(default=False, metadata={"help": "bit-exact speculative decoding (row-invariant forwards, "
                                                 "slower; see docs/lossless.md)"})
    graphs: str = field(default="auto", metadata={
        "help": "plain and verify forwards as CUDA graphs, one per bucket of rows, tokens and keys "
                "(tailrl.step_graphs): auto = on CUDA; on a CPU 'on' runs the same buckets without capture",
        "choices": ["auto", "on", "off"]})

    def __post_init__(self) -> None:
        if self.graphs not in ("auto", "on", "off"):
            raise ValueError(f"graphs must be auto, on or off, got {self.graphs!r}")
        if self.exact:  # before this process's first matmul, where that is still possible (tailrl.kernels)
            request_reproducible_kernels()


@dataclass
class Seq:
    """A running sequence. Cache slot = its index in the running list."""

    req_index: int
    req: Request
    length: int  # tokens in the KV cache (prompt + fed generated tokens)
    pending: int  # last emitted token, not yet fed (at position `length`)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # (k, E) chunks, one row per emitted token
    # (P, E) target hidden states of the prompt, kept when hidden states are needed, so a drafter
    # switched on mid-rollout can catch up without re-running the prompt.
    prompt_hidden: torch.Tensor | None = None
    finish: str | None = None


@dataclass(frozen=True)
class GenerateCall:
    """What one generate call asks for; the engine hands it to the decoder with every step."""

    params: SamplingParams
    max_new_tokens: int
    stop: Stop | None = None  # tailrl.records.Stop


class StepDecoder(Protocol):
    """How the engine advances its running batch (plain or speculative), and what it must keep.

    In one generate call the engine calls `begin` once, then `step` once per decode step, `moved`
    whenever it moves a running sequence to another cache slot, and `finished` once per sequence
    as it leaves the batch. A decoder emits tokens only through `Engine.emit`.
    """

    max_tree: int  # most draft nodes a step verifies; the engine reserves max_tree + 1 cache positions
    needs_hidden: bool  # keep target hidden states on every Seq (prompt_hidden, hidden)

    def begin(self, engine: Engine) -> None:
        """A generate call starts: forget per-slot state of the last one."""
        ...

    def step(self, engine: Engine, running: list[Seq], call: GenerateCall) -> str:
        """Advance every running sequence by >= 1 token; return the label of the arm used."""
        ...

    def moved(self, src: int, dst: int, seq: Seq) -> None:
        """The engine moved `seq` from cache slot src to slot dst."""
        ...

    def finished(self, seq: Seq) -> None:
        """`seq` is done (seq.finish is set) and leaves the batch."""
        ...


class Engine:
    """Generates completions for token-id requests with a target model.

    `decoder` may be replaced between generate calls (tailrl.speculative.modes.install).
    """

    def __init__(self, model: Transformer, config: EngineConfig | None = None):
        self.model = model
        self.cfg = config or EngineConfig()
        self.eos = set(model.cfg.eos_token_ids)
        self.cache: KVCache | None = None
        self.stats = EngineStats()
        self.decoder: StepDecoder = PlainDecoder()
        cuda = self.device.type == "cuda"
        use = self.cfg.graphs == "on" or (self.cfg.graphs == "auto" and cuda)
        self.graphs = StepGraphs(model, self.cfg.exact, capture=cuda) if use else None
        if self.cfg.exact:
            request_reproducible_kernels()  # a config unpickled in a worker process skipped __post_init__
            check_thread_invariance(model)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    # ---- set-up -------------------------------------------------------------------------

    def _plan_cache(self, requests: Sequence[Request], max_new_tokens: int) -> None:
        """Room for the call's first admissions. Where the budget holds every slot at a sequence's
        worst case (prompt + max_new_tokens + the decoder's reserve), that is what the cache
        holds and it never grows; otherwise the budget is cut into equal slots, which `_make_room`
        grows as the sequences' tokens need, preempting some where the budget runs out."""
        reserve = self.decoder.max_tree + 1
        worst = self.check_requests(requests, max_new_tokens, extra=reserve)
        first = whole_chunks(max(len(r.prompt_ids) for r in requests) + reserve)
        per_token = KVCache.bytes_per_token(self.model.cfg, self.dtype)
        self._budget = int(self.cfg.kv_budget_gb * 2**30 // per_token)  # positions
        self._worst = whole_chunks(worst)
        if self._worst > self._budget:
            raise ValueError(
                f"kv_budget_gb={self.cfg.kv_budget_gb} cannot hold one sequence of {self._worst} tokens "
                f"({self._worst * per_token / 2**30:.2f} GiB needed)"
            )
        self._want = min(len(requests), self.cfg.max_batch)
        capacity = min(self._worst, max(self._budget // self._want // KV_CHUNK * KV_CHUNK, first))
        slots = min(self._want, self._budget // capacity)
        c = self.cache
        if c is None or c.capacity < capacity or c.slots < slots:
            self.cache = None  # free the old cache before allocating the new one
            self.cache = KVCache(self.model.cfg, slots, capacity, self.dtype, self.device)

    def _make_room(self, running: list[Seq], preempted: deque[Seq]) -> None:
        """Grow the cache before a step that would write past it: by a quarter at least (a resize
        copies the cache), to what fewer slots can hold within the budget. Where the running
        sequences outnumber those slots, the shortest are preempted: they leave the batch and
        their KV is recomputed when they are admitted again (`_resume`), as vLLM's default does."""
        need = max(s.length for s in running) + self.decoder.max_tree + 1
        c = self.cache
        if need <= c.capacity:
            return
        capacity = min(self._worst, whole_chunks(max(need, c.capacity * 5 // 4)))
        slots = min(self._want, self._budget // capacity)
        for seq in sorted(running, key=lambda s: s.length)[: max(0, len(running) - slots)]:
            self._leave(running, next(i for i, s in enumerate(running) if s is seq))
            preempted.append(seq)
            self.stats.preempted += 1
        c.resize(slots, capacity, len(running), max(s.length for s in running))
        self.stats.cache_resizes += 1

    def check_requests(self, requests: Sequence[Request], max_new_tokens: int, extra: int = 0) -> int:
        """Validate lengths; return the cache positions a sequence needs at most."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.model.cfg.max_position_embeddings
        longest = 0
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} has an empty prompt")
            longest = max(longest, len(r.prompt_ids))
        if longest + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
                f"context of {limit} tokens"
            )
        return longest + max_new_tokens + extra

    # ---- the loop -----------------------------------------------------------------------

    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        max_new_tokens: int,
        stop: Stop | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_finished: Callable[[int, Completion], None] | None = None,
    ) -> list[Completion]:
        """Run all requests to completion; stats of the call are left in `self.stats`.

        on_progress(Progress) is called after every decode step; on_finished(request index,
        completion) as each sequence finishes, before the call returns them all."""
        self.stats = EngineStats()
        if not requests:
            return []
        self._plan_cache(requests, max_new_tokens)
        call = GenerateCall(params, max_new_tokens, stop)
        self.decoder.begin(self)
        start = time.perf_counter()
        # Siblings adjacent, so one admission wave usually covers a whole group.
        order = sorted(range(len(requests)), key=lambda i: (requests[i].group, i))
        waiting = deque((i, requests[i]) for i in order)
        preempted: deque[Seq] = deque()  # admitted before any waiting request
        running: list[Seq] = []
        results: list[Completion | None] = [None] * len(requests)
        with torch.inference_mode():
            while waiting or preempted or running:
                self._admit(waiting, preempted, running, call)
                self._retire(running, results, on_finished)  # a first token can already end a sequence
                if not running:
                    continue
                self._make_room(running, preempted)
                t0, tokens0 = time.perf_counter(), self.stats.tokens
                label = self.decoder.step(self, running, call)
                t1 = time.perf_counter()
                self.stats.steps += 1
                self.stats.timeline.append(StepRecord(t1 - start, len(running), label, self.stats.tokens - tokens0,
                                                      t1 - t0))
                self._retire(running, results, on_finished)
                if on_progress is not None:
                    done = sum(r is not None for r in results)
                    now = time.perf_counter() - start
                    fewest = 0 if waiting else min((len(s.tokens) for s in (*running, *preempted)), default=0)
                    on_progress(Progress(done, len(requests), len(running), self.stats.tokens, now, fewest))
        self.stats.seconds = time.perf_counter() - start
        return results  # type: ignore[return-value]

    def _admit(self, waiting: deque, preempted: deque[Seq], running: list[Seq], call: GenerateCall) -> None:
        """Fill free slots: preempted sequences first (`_resume`), then waiting requests, one
        prefill per distinct prompt, the distinct prompts of a wave batched into one forward (up
        to PREFILL_TOKENS padded tokens)."""
        t0 = time.perf_counter()
        while preempted and len(running) < self.cache.slots:
            self._resume(preempted.popleft(), running)
        free = self.cache.slots - len(running)
        groups: list[list[tuple[int, Request]]] = []  # adjacent requests with one prompt
        while waiting and free > 0:
            members = [waiting.popleft()]
            while waiting and len(members) < free and waiting[0][1].prompt_ids == members[0][1].prompt_ids:
                members.append(waiting.popleft())
            free -= len(members)
            groups.append(members)
        # Longest prompts first: prefill batches pad less, and the wave's slots run from long to
        # short, so the attention's groups of consecutive rows (CacheView.segments) read little
        # past each row's own keys.
        groups.sort(key=lambda g: -len(g[0][1].prompt_ids))
        while groups:
            batch = [groups.pop(0)]
            longest = len(batch[0][0][1].prompt_ids)
            while groups and (len(batch) + 1) * max(longest, len(groups[0][0][1].prompt_ids)) <= PREFILL_TOKENS:
                longest = max(longest, len(groups[0][0][1].prompt_ids))
                batch.append(groups.pop(0))
            self._prefill(batch, running, call)
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _prefill(self, groups: list[list[tuple[int, Request]]], running: list[Seq], call: GenerateCall) -> None:
        """One forward over the groups' prompts (right-padded), each into the slot of its first
        member (slots len(running) ..), then the siblings' slots get a copy of its KV."""
        first, n = len(running), len(groups)
        lens = [len(g[0][1].prompt_ids) for g in groups]
        p = max(lens)
        ids = torch.zeros(n, p, dtype=torch.long)
        for i, g in enumerate(groups):
            ids[i, : lens[i]] = torch.tensor(g[0][1].prompt_ids)
        pos = torch.arange(p, device=self.device)[None].expand(n, p)  # (n, P)
        valid = pos < torch.tensor(lens, device=self.device)[:, None]  # (n, P)
        # Causal over each row's own prompt; padding writes KV past the prompt, which stays masked
        # (keys past a sequence's length) until decoding overwrites it.
        mask = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()[None] & valid[:, None]  # (n, P, P)
        view = CacheView(self.cache, first, pos, p, mask)
        h = self.model.hidden(ids.to(self.device), pos, view, exact=self.cfg.exact)  # (n, P, E)
        # Only the last prompt position's logits are needed: the LM head over every prompt token
        # would cost P x the head (49k rows for SmolLM2), about a third of a prefill.
        last = h[torch.arange(n, device=self.device), torch.tensor(lens, device=self.device) - 1]  # (n, E)
        logits = self.model.lm_head(last, self.cfg.exact)  # (n, V)
        heads = [self._start(idx, req, call, logits[i : i + 1], h[i, : lens[i]])
                 for i, ((idx, req), *_) in enumerate(groups)]
        running.extend(heads)
        # Siblings reuse their prompt's prefill: copy the KV, sample their own first token.
        for i, g in enumerate(groups):
            for j, sib in g[1:]:
                self.cache.copy_slot(first + i, len(running), lens[i])
                running.append(self._start(j, sib, call, logits[i : i + 1], h[i, : lens[i]]))

    def _resume(self, seq: Seq, running: list[Seq]) -> None:
        """Recompute a preempted sequence's KV into the next slot, PREFILL_TOKENS at a time (each
        piece attends to the pieces before it through the cache); its tokens, log-probs and
        hidden states were kept, so nothing is sampled again."""
        slot, ids = len(running), (list(seq.req.prompt_ids) + seq.tokens)[: seq.length]
        for start in range(0, seq.length, PREFILL_TOKENS):
            piece = torch.tensor(ids[start : start + PREFILL_TOKENS], device=self.device)[None]  # (1, T)
            pos = start + torch.arange(piece.shape[1], device=self.device)[None]  # (1, T)
            kv_len = start + piece.shape[1]
            mask = torch.arange(kv_len, device=self.device)[None, None] <= pos[..., None]  # (1, T, S)
            self.model.hidden(piece, pos, CacheView(self.cache, slot, pos, kv_len, mask), exact=self.cfg.exact)
        running.append(seq)

    def _start(self, idx: int, req: Request, call: GenerateCall, logits: torch.Tensor, h_prompt: torch.Tensor) -> Seq:
        """A running sequence from its prompt's last logits (1, V) and hidden states (P, E)."""
        p = len(req.prompt_ids)
        tok, lp = sample(logits, call.params, [req.seed], [next_position(p - 1)])
        top = is_top1(logits, tok)
        seq = Seq(idx, req, length=p, pending=int(tok[0]))
        keep = self.keep_hidden
        if keep:
            seq.prompt_hidden = h_prompt[:-1]
        self.emit(seq, call, [seq.pending], [float(lp[0])], [bool(top[0])], h_prompt[-1:] if keep else None)
        return seq

    @property
    def keep_hidden(self) -> bool:
        """Whether emitted tokens keep their target hidden states (for the caller or the decoder)."""
        return self.cfg.capture_hidden or self.decoder.needs_hidden

    def emit(
        self, seq: Seq, call: GenerateCall, tokens: list[int], logprobs: list[float], top1: list[bool],
        hidden: torch.Tensor | None,
    ) -> None:
        """Append a step's tokens to `seq`, cutting at EOS / the call's stop / its length limit;
        hidden (k, E), one row per token, when `keep_hidden`."""
        for k, (t, lp, top) in enumerate(zip(tokens, logprobs, top1)):
            seq.tokens.append(t)
            seq.logprobs.append(lp)
            seq.top1.append(top)
            if hidden is not None:
                seq.hidden.append(hidden[k : k + 1])
            self.stats.tokens += 1
            if t in self.eos:
                seq.finish = "eos"
            elif call.stop is not None and call.stop(seq.tokens):
                seq.finish = "stop"
            elif len(seq.tokens) >= call.max_new_tokens:
                seq.finish = "length"
            if seq.finish:
                return

    def _retire(self, running: list[Seq], results: list[Completion | None],
                on_finished: Callable[[int, Completion], None] | None) -> None:
        """Move finished sequences out; refill their slots from the end of the batch."""
        for seq in running:  # in slot order, before any slot moves
            if seq.finish is not None:
                self.decoder.finished(seq)
        i = 0
        while i < len(running):
            seq = running[i]
            if seq.finish is None:
                i += 1
                continue
            hidden = torch.cat(seq.hidden).float().cpu() if seq.hidden else None
            prompt_hidden = seq.prompt_hidden.float().cpu() if seq.prompt_hidden is not None else None
            results[seq.req_index] = Completion(
                seq.req.prompt_ids, seq.tokens, seq.logprobs, seq.finish, seq.req.seed, seq.req.group, hidden,
                prompt_hidden, seq.top1,
            )
            if on_finished is not None:
                on_finished(seq.req_index, results[seq.req_index])
            self._leave(running, i)

    def _leave(self, running: list[Seq], i: int) -> None:
        """Take slot i's sequence out of the batch; the last running sequence moves into its slot,
        and the slot it leaves is handed back to the kernel (tailrl.memory.release: a lazily
        zeroed cache reads zeros there again, and holds no memory for it until it is written)."""
        last = running.pop()
        if i < len(running):
            self.cache.copy_slot(len(running), i, last.length)
            self.decoder.moved(len(running), i, last)
            running[i] = last
        if memory.is_lazy(self.cache.k[0]):  # a cache off the CPU is not
            for kv in (*self.cache.k, *self.cache.v):
                memory.release(kv[len(running)])

    # ---- what decoders use ----------------------------------------------------------------

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits and hidden states over cached positions, row-invariant in exact
        mode; through the step graphs where the engine has them.  # (B, T), (B, T) -> (B, T, V), (B, T, E)"""
        if self.graphs is not None:
            return self.graphs.forward(ids, positions, view)
        return self.model(ids, positions, view, return_hidden=True, exact=self.cfg.exact)

    def plain_step(self, running: list[Seq], call: GenerateCall) -> None:
        """Feed each sequence's pending token; sample the next one."""
        lengths = [s.length for s in running]
        lens = torch.tensor(lengths, device=self.device)
        kv_len = max(lengths) + 1  # from the host's list: a device max would be a sync
        mask = (torch.arange(kv_len, device=self.device)[None] <= lens[:, None])[:, None]  # (B, 1, S)
        ids = torch.tensor([[s.pending] for s in running], device=self.device)
        logits, h = self.forward(ids, lens[:, None], CacheView(self.cache, 0, lens[:, None], kv_len, mask))
        # fp32 once: sampling works in fp32 anyway, and a bf16 argmax is a slow kernel on CPU.
        logits = logits[:, 0].float()  # (B, V)
        seeds = [s.req.seed for s in running]
        toks, lps = sample(logits, call.params, seeds, [next_position(n) for n in lengths])
        # The step's one read of the device: tokens, log-probs and top-1 flags together, in fp64
        # (exact for all three), not one transfer per tensor nor one tensor index per row.
        out = torch.stack((toks.double(), lps.double(), is_top1(logits, toks).double())).tolist()
        keep = self.keep_hidden
        for i, (s, tok, lp, top) in enumerate(zip(running, *out)):
            s.length += 1
            s.pending = int(tok)
            self.emit(s, call, [s.pending], [lp], [top == 1.0], h[i] if keep else None)


class PlainDecoder:
    """Always plain decoding: the baseline and the reference path. Keeps no state."""

    max_tree = 0
    needs_hidden = False

    def begin(self, engine: Engine) -> None:
        pass

    def step(self, engine: Engine, running: list[Seq], call: GenerateCall) -> str:
        engine.plain_step(running, call)
        return "plain"

    def moved(self, src: int, dst: int, seq: Seq) -> None:
        pass

    def finished(self, seq: Seq) -> None:
        pass
