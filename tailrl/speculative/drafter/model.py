"""The learned drafter (EAGLE style): its model, its files, and the proposer the engine calls.

Model. One entry per position i: input = concat(embed(x_{i+1}), h_i), h_i the target's hidden
state at i (post final norm, the LM head's input; it produced x_{i+1}), through fc (2E -> E),
decoder layers of the target's architecture (tailrl.model.DecoderLayer, attention over the
drafter's own causal cache; one by default, `cfg.layer.num_layers`) -> predicted h_{i+1}; a head
over the draft vocabulary (K frequent target tokens, `d2t` maps draft index -> target id) reads it
as the drafter's distribution of x_{i+2}. The entry sits at rope position i, as EAGLE and vLLM
place it. As in EAGLE-1 the first layer has no input norm (fc's output goes straight in), later
layers have theirs (vLLM's EAGLE stack: llama_eagle.py), and there is no final norm (the
prediction lives in the target's post-norm space, the head's input space). The embedding is the
target's, shared and frozen: it is never saved, and a drafter is always loaded against a target.

Files. `drafter.json` (format, target name and fingerprint, the layer's architecture, the draft
vocabulary, version) and `drafter.safetensors` (fc, layer, head). The fingerprint (a fixed sample
of the target's embedding) tells another model from the same model after some RL steps.

Proposer. `DrafterProposer` keeps a drafter KV cache per engine slot: cache index i holds entry i.
Per slot it remembers which sequence it holds and how many entries are valid, so a slot that has
a new sequence restarts and a slot whose sequence decoded plain for a while (or since admission)
catches up from the target hidden states the engine kept (Seq.prompt_hidden, Seq.hidden); the
target never re-runs. The catch-up and the root entry (h_{L-1}, x_L) run in one forward (step 0
of the tree); a node at depth d is expanded by an entry at position L - 1 + d that reads its
parent's predicted hidden state and its own token. Tree entries go to scratch indices after the
prefix and are overwritten next time; only entries built from real hidden states are kept.
A draft step costs one layer and a draft-vocabulary head, a fraction of a target step
(docs/performance.md).

Knows: its layer, the draft vocabulary, the cache layout of its own entries, how a tree is grown
from its scores (via tailrl.speculative.tree.build_tree). Does not know: acceptance, sampling, the tuner.

Shapes: B rows, T entries per row in a forward, S attended keys, E hidden size, K draft vocab
size, F frontier nodes, V target vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tailrl.engine import Engine, Seq
from tailrl.kv_cache import CacheView, KVCache
from tailrl.linears import Linear
from tailrl.model import DecoderLayer, ModelConfig, Transformer, rope_inv_freq
from tailrl.speculative.drafter.chain_graphs import ChainGraphs, draft_chain, top_drafts
from tailrl.speculative.tree import DraftTree, Expansion, Frontier, build_tree, chain
from tailrl.tuner import Arm

# Format 2 names its layers layers.0, layers.1, ...; format 1 had one, named layer (still read).
FORMAT = 2
_FORMATS = (1, 2)
CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"
_FINGERPRINT_ROWS, _FINGERPRINT_DIMS = 32, 16
# A drafter stays usable while RL nudges the target's embedding; another model scores ~0.
_MIN_FINGERPRINT_COSINE = 0.9


class DrafterError(ValueError):
    """A drafter directory that cannot be used, with the reason in one line."""


@dataclass(frozen=True)
class DrafterConfig:
    """What a drafter is: its layer's architecture, its draft vocabulary and the target it serves."""

    target_name: str  # the target model's directory name (informational)
    layer: ModelConfig  # the target's architecture with the drafter's num_layers: its layers' shape
    draft_vocab: tuple[int, ...]  # target token id of each draft index, ascending
    fingerprint: tuple[float, ...]  # target_fingerprint() of the target it was trained for
    version: int = 0  # bumped by each training round that publishes it

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size."""
        return self.layer.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return len(self.draft_vocab)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DrafterConfig":
        if d.get("format") not in _FORMATS:
            raise DrafterError(f"unsupported drafter format {d.get('format')!r} (this tailrl reads {_FORMATS})")
        layer = dict(d["layer"])
        scaling = layer.get("rope_scaling")
        layer["rope_scaling"] = tuple(tuple(kv) for kv in scaling) if scaling else None
        layer["eos_token_ids"] = tuple(layer["eos_token_ids"])
        cfg = cls(
            target_name=str(d["target_name"]),
            layer=ModelConfig(**layer),
            draft_vocab=tuple(int(t) for t in d["draft_vocab"]),
            fingerprint=tuple(float(x) for x in d["fingerprint"]),
            version=int(d.get("version", 0)),
        )
        vocab = torch.tensor(cfg.draft_vocab)
        if len(vocab) < 1 or bool((vocab[1:] <= vocab[:-1]).any()) or vocab[0] < 0 or vocab[-1] >= cfg.vocab_size:
            raise DrafterError("draft_vocab must be ascending, distinct target token ids")
        return cfg


def target_fingerprint(target: Transformer) -> tuple[float, ...]:
    """A fixed sample of the target's embedding: evenly spaced rows, first dims."""
    w = target.model.embed_tokens.weight
    rows = torch.linspace(0, w.shape[0] - 1, _FINGERPRINT_ROWS).long()
    return tuple(w[rows, :_FINGERPRINT_DIMS].float().flatten().tolist())


def check_target(cfg: DrafterConfig, target: Transformer) -> None:
    """Refuse a target the drafter was not trained for (shapes, then the embedding fingerprint)."""
    tc = target.cfg
    if (tc.hidden_size, tc.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise DrafterError(
            f"drafter was trained for {cfg.target_name} (hidden size {cfg.hidden_size}, vocab {cfg.vocab_size}); "
            f"this target has hidden size {tc.hidden_size}, vocab {tc.vocab_size}"
        )
    a, b = torch.tensor(cfg.fingerprint), torch.tensor(target_fingerprint(target))
    cos = float(F.cosine_similarity(a, b, dim=0)) if a.shape == b.shape else 0.0
    if cos < _MIN_FINGERPRINT_COSINE:
        raise DrafterError(
            f"drafter was trained for another target ({cfg.target_name}): embedding fingerprint "
            f"cosine {cos:.2f} < {_MIN_FINGERPRINT_COSINE}"
        )


class Drafter(nn.Module):
    """fc + decoder layers + draft-vocabulary head; the embedding is the target's."""

    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        e = cfg.hidden_size
        # tailrl's Linear, nn.Linear's parameters: a draft step decodes through the engine's kernels.
        self.fc = Linear(2 * e, e, bias=False)
        # EAGLE-1 feeds fc's output to the first layer without its input norm (serving engines do too).
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer, input_norm=i > 0) for i in range(cfg.layer.num_layers))
        self.head = Linear(e, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.tensor(cfg.draft_vocab, dtype=torch.long), persistent=False)
        # Plain attributes, not parameters/buffers: never saved, never trained, not cast by .to().
        self.embed = embed  # (V, E) the target's embedding
        self.inv_freq = rope_inv_freq(cfg.layer).float()

    @classmethod
    def from_target(cls, target: Transformer, draft_vocab: list[int], target_name: str, seed: int = 0,
                    num_layers: int = 1) -> "Drafter":
        """A fresh fp32 drafter: head = the target's LM-head rows of the draft vocabulary.

        fc passes h_i straight through (embedding half small and random), the layers start random
        with small output projections, so the first prediction of h_{i+1} is h_i: a sane start.
        """
        if num_layers < 1:
            raise DrafterError(f"a drafter needs at least one layer, got {num_layers}")
        layer_cfg = dataclasses.replace(target.cfg, num_layers=num_layers)
        vocab = tuple(sorted(set(int(t) for t in draft_vocab)))
        cfg = DrafterConfig(target_name, layer_cfg, vocab, target_fingerprint(target))
        gen = torch.Generator().manual_seed(seed)
        embed = target.model.embed_tokens.weight.detach().float()
        net = cls(cfg, embed)
        e = cfg.hidden_size
        with torch.no_grad():
            for name, p in net.layers.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            net.fc.weight.copy_(torch.cat([torch.randn(e, e, generator=gen) * 0.02, torch.eye(e)], dim=1))
            net.head.weight.copy_(target.lm_head.weight.detach()[net.d2t].float())
        return net

    def attach(self, target: Transformer) -> None:
        """Share a (possibly updated) target's embedding; refuses a different target."""
        check_target(self.cfg, target)
        self.embed = target.model.embed_tokens.weight.detach()

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def forward(
        self,
        hidden: torch.Tensor,  # (B, T, E) h_i
        ids: torch.Tensor,  # (B, T) x_{i+1}
        positions: torch.Tensor,  # (B, T) i
        view: CacheView | None = None,
        mask: torch.Tensor | None = None,  # (B, 1, T, T) without a cache; None = causal
    ) -> torch.Tensor:
        """Predicted h_{i+1} for each entry.  # (B, T, E)"""
        dt = self.dtype
        emb = F.embedding(ids, self.embed.to(device=ids.device)).to(dt)
        x = self.fc(torch.cat([emb, hidden.to(dt)], dim=-1))
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        ang = positions.float().unsqueeze(-1) * self.inv_freq  # (B, T, D/2)
        ang = torch.cat((ang, ang), dim=-1).unsqueeze(1)  # (B, 1, T, D)
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, view, mask)
        return x

    def logits(self, pred: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of x_{i+2}.  # (..., E) -> (..., K)"""
        return self.head(pred)


# ---- files ------------------------------------------------------------------------------------


def save_drafter(drafter: Drafter, path: str | Path) -> Path:
    """Write drafter.json + drafter.safetensors into a directory (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, path / WEIGHTS_FILE, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(drafter.cfg.to_json(), indent=1))
    return path


def read_drafter_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    if not path.is_dir():
        raise DrafterError(f"drafter directory not found: {path}")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise DrafterError(f"{path} has no {CONFIG_FILE}; expected a directory written by `tailrl drafter warmup`")
    try:
        return DrafterConfig.from_json(json.loads(cfg_file.read_text()))
    except DrafterError as e:
        raise DrafterError(f"{cfg_file}: {e}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DrafterError(f"{cfg_file} is malformed: {e!r}") from None


def read_drafter_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A drafter directory's weights (fp32, as saved), under format 2's names."""
    path = Path(path)
    try:
        state = load_file(path / WEIGHTS_FILE)
    except Exception as e:  # safetensors raises several types for missing/corrupt files
        raise DrafterError(f"cannot read drafter weights {path / WEIGHTS_FILE}: {e}") from None
    return {"layers.0." + k.removeprefix("layer.") if k.startswith("layer.") else k: v for k, v in state.items()}


def load_drafter(
    path: str | Path, target: Transformer, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> Drafter:
    """A drafter for `target` (its embedding shared), in the target's dtype/device unless given."""
    path = Path(path)
    cfg = read_drafter_config(path)
    check_target(cfg, target)
    state = read_drafter_weights(path)
    net = Drafter(cfg, target.model.embed_tokens.weight.detach())
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise DrafterError(f"{path}: weights do not match {CONFIG_FILE}: {str(e).splitlines()[0]}") from None
    w = target.lm_head.weight
    return net.to(device=device or w.device, dtype=dtype or w.dtype).eval().requires_grad_(False)


# ---- the proposer ----------------------------------------------------------------------------


def _tokens(seq, lo: int, hi: int) -> list[int]:
    """Tokens at absolute positions lo..hi-1 of prompt + emitted tokens."""
    prompt, p = seq.req.prompt_ids, len(seq.req.prompt_ids)
    return list(prompt[lo:hi]) + seq.tokens[max(lo - p, 0) : max(hi - p, 0)]


def _hidden(seq, lo: int, hi: int) -> torch.Tensor:
    """Target hidden states of positions lo..hi-1: rows of concat(prompt_hidden, *hidden).  # (hi-lo, E)"""
    if seq.prompt_hidden is None:
        raise RuntimeError("the engine kept no target hidden states for this sequence; the drafter needs them")
    p1 = seq.prompt_hidden.shape[0]  # P - 1 rows; the engine appends one row per emitted token after them
    if p1 + len(seq.hidden) < hi:
        raise RuntimeError(f"target hidden states cover {p1 + len(seq.hidden)} positions, the drafter needs {hi}")
    parts = [seq.prompt_hidden[lo:hi]] if lo < p1 else []
    parts += seq.hidden[max(lo - p1, 0) : hi - p1]
    return torch.cat(parts)


class _RootInputs(NamedTuple):
    """Step 0 of a tree: each row's missing entries covered_b..L_b-1 (the root entry last), right-padded."""

    ids: torch.Tensor  # (B, T) x_{i+1}
    hidden: torch.Tensor  # (B, T, E) h_i
    write: torch.Tensor  # (B, T) cache index of each entry (i; padding: the first scratch index L_b)
    last: torch.Tensor  # (B, T) newest cache index each query sees (its own i; padding: L_b - 1)
    root: torch.Tensor  # (B,) column of the root entry


class DrafterProposer:
    """Draft trees from a learned drafter, batched over the running rows (see the module doc)."""

    kind = "drafter"
    needs_hidden = True

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.cache: KVCache | None = None
        self.owner: list[Seq | None] = []  # the Seq each slot's entries belong to
        self.covered: list[int] = []  # valid entries per slot (cache indices 0..covered-1)
        self.graphs: ChainGraphs | None = None  # the chain loop's graphs, made with the engine's

    def begin(self, engine: Engine | None = None) -> None:
        self.owner, self.covered = [], []

    def moved(self, src: int, dst: int, seq: Seq) -> None:
        self._grow_slots(dst + 1)
        if src < len(self.owner) and self.owner[src] is seq and self.cache is not None:
            self.cache.copy_slot(src, dst, self.covered[src])
            self.owner[dst], self.covered[dst] = seq, self.covered[src]
        else:
            self.owner[dst], self.covered[dst] = None, 0

    def finished(self, seq: Seq) -> None:
        pass  # a finished sequence's slot is taken over through `moved` or a new owner in `propose`

    def _grow_slots(self, n: int) -> None:
        while len(self.owner) < n:
            self.owner.append(None)
            self.covered.append(0)

    def _ensure_cache(self, slots: int, capacity: int) -> None:
        c = self.cache
        if c is not None and c.slots >= slots and c.capacity >= capacity:
            return
        d = self.drafter
        capacity = 256 * math.ceil(capacity / 256)
        if c is None:
            self.cache = KVCache(d.cfg.layer, slots, capacity, d.dtype, d.fc.weight.device)
        else:  # keep what the old cache held
            c.resize(max(slots, c.slots), max(capacity, c.capacity), c.slots, c.capacity)

    def propose(self, engine: Engine | None, running: list[Seq], arm: Arm) -> DraftTree:
        """One tree per running row; root = seq.pending at position seq.length; target token ids.

        A chain (topk 1) takes `draft_chain`: the tree `propose_tree` builds, with a fraction of
        its tensor bookkeeping (the tests compare the two); as CUDA graphs where the engine runs
        its own forwards as graphs (tailrl.speculative.drafter.chain_graphs). engine None: a
        replay without one (training.simulate_accept), eager."""
        if arm.topk > 1:
            return self.propose_tree(engine, running, arm)
        first, lens = self._prepare(running, arm)
        out = self._root_forward(first)  # (B, 1, E)
        lengths = [s.length for s in running]
        n = arm.num_draft_tokens
        if engine is None or engine.graphs is None:
            nodes = draft_chain(self.drafter, self.cache, out, lens, n, max(lengths) + n - 1)
        else:
            if self.graphs is None or self.graphs.capture != engine.graphs.capture:
                self.graphs = ChainGraphs(self.drafter, engine.graphs.capture)
            nodes, padded = self.graphs.draft(self.cache, out, lens, max(lengths) + n - 1, n)
            self._grow_slots(padded)
            for i in range(len(running), padded):  # padded rows wrote entries there
                self.owner[i], self.covered[i] = None, 0
        self.covered[: len(running)] = lengths
        return chain(nodes)

    def propose_tree(self, engine: Engine | None, running: list[Seq], arm: Arm) -> DraftTree:
        """`propose` for any arm, through build_tree (the reference for chains)."""
        d = self.drafter
        first, lens = self._prepare(running, arm)
        b, device = len(running), lens.device

        def expand(fr: Frontier) -> Expansion:
            out = self._root_forward(first) if fr.step == 0 else self._tree_forward(fr, lens, arm.topk)
            log_probs, idx = top_drafts(d, out, arm.topk)
            return Expansion(log_probs, d.d2t[idx], out)

        root_state = first.hidden[torch.arange(b, device=device), first.root]  # (B, E) h_{L-1}
        pending = torch.tensor([s.pending for s in running], device=device)
        tree = build_tree(expand, root_state, arm.draft_depth, arm.topk, arm.num_draft_tokens, root_tokens=pending)
        self.covered[:b] = lens.tolist()
        return tree

    def _prepare(self, running: list[Seq], arm: Arm) -> tuple[_RootInputs, torch.Tensor]:
        """Slot bookkeeping, cache room, and step 0's inputs; the root positions L_b.  # (B,)"""
        b = len(running)
        self._grow_slots(b)
        for i, s in enumerate(running):
            if self.owner[i] is not s:  # a new sequence in this slot: its entries start over
                self.owner[i], self.covered[i] = s, 0
        lengths = [s.length for s in running]
        scratch = max(1, (arm.draft_depth - 1) * arm.topk)
        self._ensure_cache(b, max(lengths) + scratch)
        device = self.drafter.fc.weight.device
        return self._root_inputs(running, device), torch.tensor(lengths, device=device)

    def _root_inputs(self, running: list, device) -> _RootInputs:
        # The root entry is always (re)computed: its output starts the tree.
        starts = [min(self.covered[i], s.length - 1) for i, s in enumerate(running)]
        counts = [s.length - c for s, c in zip(running, starts)]  # >= 1
        t = max(counts)
        e = self.drafter.cfg.hidden_size
        ids = torch.zeros(len(running), t, dtype=torch.long)
        hidden = torch.zeros(len(running), t, e, dtype=self.drafter.dtype, device=device)
        for b, (s, c, m) in enumerate(zip(running, starts, counts)):
            ids[b, :m] = torch.tensor(_tokens(s, c + 1, s.length + 1))
            hidden[b, :m] = _hidden(s, c, s.length).to(device=device, dtype=hidden.dtype)
        j = torch.arange(t)[None]  # (1, T)
        start, count = torch.tensor(starts)[:, None], torch.tensor(counts)[:, None]
        # Padding writes to the first scratch index (L_b; the tree overwrites it) and sees the prefix.
        write = torch.where(j < count, start + j, start + count)  # (B, T)
        last = torch.minimum(start + j, start + count - 1)  # (B, T)
        return _RootInputs(ids.to(device), hidden, write.to(device), last.to(device), (count[:, 0] - 1).to(device))

    def _root_forward(self, x: _RootInputs) -> torch.Tensor:
        """Catch-up and root entries in one forward; the root entries' outputs.  # (B, 1, E)"""
        kv_len = int(x.last.max()) + 1
        mask = torch.arange(kv_len, device=x.ids.device)[None, None] <= x.last[:, :, None]  # (B, T, S)
        # Entry i sits at rope position i (= x.last for real entries; padding reuses the root's).
        out = self.drafter(x.hidden, x.ids, x.last, CacheView(self.cache, 0, x.write, kv_len, mask))
        return out[torch.arange(x.ids.shape[0], device=x.ids.device), x.root][:, None]

    def _tree_forward(self, fr: Frontier, lens: torch.Tensor, topk: int) -> torch.Tensor:
        """Frontier nodes at depth `step`: entries at position L_b - 1 + step, scratch indices after L_b."""
        b, f = fr.tokens.shape
        s = fr.step
        dev = lens.device
        kv_len = int(lens.max()) + s * topk
        keys = torch.arange(kv_len, device=dev)[None, None]  # (1, 1, S)
        mask = (keys < lens[:, None, None]).expand(b, f, kv_len).clone()  # the prefix, root entry included
        scratch = lens[:, None] + torch.arange(s * topk, device=dev)[None]  # (B, s*K) entries 1..s*K
        mask.scatter_(2, scratch[:, None].expand(b, f, -1), fr.attn_mask[:, :, 1:])
        write = lens[:, None] + (s - 1) * topk + torch.arange(f, device=dev)[None]  # (B, F)
        positions = (lens[:, None] - 1 + s).expand(b, f)
        view = CacheView(self.cache, 0, write, kv_len, mask)
        return self.drafter(fr.parent_state, fr.tokens, positions, view)  # (B, F, E)
