"""A DFlash block drafter over the target's hidden states, and DDTree's trees from it.

DFlash (z-lab) proposes every position of a block in ONE forward: the block is [the last
emitted token] + [mask token] * (B - 1); its queries attend, without a mask, to each other and
to the context: the target's hidden states of every earlier token (outputs of a few chosen
target layers, concatenated, projected by `fc` and `hidden_norm`), injected as extra keys and
values in every draft layer. The drafter has no embedding and no lm_head: it uses the target's.
Block position k predicts the token k places after the root.

The round's tree:
- a chain: each position's argmax (`topk = 1`), depth k <= B - 1 (no host sync before verify);
- DDTree: the `budget` most probable prefixes under the per-position marginals, best first
  (builders.best_first_tree over each position's top `topk`; one host sync for the top-k). In
  rounds queued ahead (queued.py) the same tree is built on the device (`device_tree.best_first`):
  no host sync between rounds.
At temp > 0 a chain is the block's guess of the target's draws (sampling.Draw: the same filters,
temperature and noise over the block's logits, position k drawn where the target draws the token
k places after the root), as a draft model's and a head's are. DDTree's trees keep the block's
marginals: best-first over the draw's scores emitted no more on the demo pairs (bench/RESULTS.md,
"DFlash guesses the draw"), their softmax being no probability of the target's token.

Either way the drafter costs one forward per round whatever the tree's size. The draft cache
holds the context's keys and values only; commit appends the accepted path's hidden states (the
rows the target computed for them in the verify), which the next draft forward projects in the
same pass as its block.

Shapes stay fixed across rounds (a GPU pays for every new attention shape): each layer keeps
whole K/V buffers grown in steps of `verify.width_step()` rows, new context rows are padded to B, and a mask
hides the unused rows; the block's own K/V are written after the padded context rows and
overwritten next round.
"""
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..builders import best_first_tree
from ..draft import Draft, Layout
from ..join import join, running
from ..tree import MAX_NODES, chain_parents, check_int, preorder, relabel
from ..verify import check_capture, grown
from . import GatedMLP, aranges, dequantize_linears, target_io
from ..device_tree import best_first, top_k

__all__ = ["DFlashModel", "DFlashDrafter", "load_dflash", "bind_dflash", "probe_parents", "default_layer_ids"]


def default_layer_ids(num_target_layers, num_draft_layers):
    """The published drafters' rule: evenly spaced from layer 1 to layer N - 3 (one draft
    layer: the middle one)."""
    n, l = num_target_layers, num_draft_layers
    if l == 1:
        return [n // 2]
    return [int(round(1 + i * (n - 4) / (l - 1))) for i in range(l)]


class _Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        H, d = a["hidden_size"], a["head_dim"]
        self.n_heads, self.n_kv, self.head_dim = a["num_attention_heads"], a["num_key_value_heads"], d
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(H, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, H, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=a["rms_norm_eps"])
        self.k_norm = nn.RMSNorm(d, eps=a["rms_norm_eps"])
        self.rope = initialize_rope(d, base=a.get("rope_theta", 10000.0), traditional=False,
                                    scaling_config=a.get("rope_scaling"),
                                    max_position_embeddings=a.get("max_position_embeddings"))

    def heads(self, x, proj, n, norm=None):
        y = proj(x).reshape(1, x.shape[1], n, self.head_dim)
        return (norm(y) if norm is not None else y).transpose(0, 2, 1, 3)  # [1, n, L, d]

    def kv(self, h, offset):
        """Keys (normed, rotated from position `offset`) and values of rows h [1, L, H]."""
        return self.rope(self.heads(h, self.k_proj, self.n_kv, self.k_norm), offset=offset), \
            self.heads(h, self.v_proj, self.n_kv)


class _Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        H, I, eps = a["hidden_size"], a["intermediate_size"], a["rms_norm_eps"]
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.self_attn = _Attention(a)
        self.mlp = GatedMLP(H, I)


class DFlashModel(nn.Module):
    """The drafter's own weights (published layout: fc, hidden_norm, layers.N.*, norm)."""

    def __init__(self, config):
        super().__init__()
        a = dict(config)
        a.setdefault("head_dim", a["hidden_size"] // a["num_attention_heads"])
        a.setdefault("rms_norm_eps", 1e-6)
        self.config = a
        dc = a.get("dflash_config") or {}
        self.block_size = int(a.get("block_size", 16))
        self.num_target_layers = int(a.get("num_target_layers", 0))
        ids = dc.get("target_layer_ids") or a.get("target_layer_ids")
        if ids is None:
            ids = default_layer_ids(self.num_target_layers, a["num_hidden_layers"])
        self.target_layer_ids = tuple(int(i) for i in ids)
        self.mask_token_id = dc.get("mask_token_id", a.get("mask_token_id"))
        H = a["hidden_size"]
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=a["rms_norm_eps"])
        self.layers = [_Layer(a) for _ in range(a["num_hidden_layers"])]
        self.norm = nn.RMSNorm(H, eps=a["rms_norm_eps"])

    def context(self, feats):
        """Target features [L, n*H] -> the context rows every layer reads [1, L, H]."""
        return self.hidden_norm(self.fc(feats.astype(self.hidden_norm.weight.dtype)))[None]

    def block_logits(self, target, ctx_feats, root):
        """One block over a whole context, no cache (reference semantics, for checks):
        ctx_feats [L, n*H] at positions 0..L-1, block at L..L+B-1; logits [B, V]."""
        _, embed, lm_head = target_io(target)
        L, B = ctx_feats.shape[0], self.block_size
        ctx = self.context(ctx_feats)
        x = embed(mx.array([[int(root)] + [self.mask_token_id] * (B - 1)]))
        for layer in self.layers:
            at = layer.self_attn
            xn = layer.input_layernorm(x)
            q = at.rope(at.heads(xn, at.q_proj, at.n_heads, at.q_norm), offset=L)
            kb, vb = at.kv(xn, L)
            kc, vc = at.kv(ctx, 0)
            o = mx.fast.scaled_dot_product_attention(q, mx.concatenate([kc, kb], axis=2),
                                                     mx.concatenate([vc, vb], axis=2), scale=at.scale)
            x = x + at.o_proj(o.transpose(0, 2, 1, 3).reshape(1, B, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return lm_head(self.norm(x))[0]


def _weak(fn):
    """`fn` (a module, or a bound method of one: a tied lm_head) called through a weak reference."""
    owner = getattr(fn, "__self__", None)
    if owner is None:
        return weakref.proxy(fn)
    ref, name = weakref.proxy(owner), fn.__name__
    return lambda *a: getattr(ref, name)(*a)


def load_dflash(path):
    """A DFlash folder (config.json + safetensors, the published layout; an mlx `quantization`
    entry in the config loads quantized weights) -> DFlashModel."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no config.json: pass a DFlash drafter folder (config.json and "
                         "safetensors with fc, hidden_norm, layers.N.*, norm)")
    config = json.loads(cfg_file.read_text())
    dc = config.get("dflash_config") or {}
    if "block_size" not in config or "target_layer_ids" not in dc:
        raise ValueError(f"{path}/config.json is not a DFlash drafter's (no block_size and "
                         "dflash_config.target_layer_ids): pass a DFlash drafter folder")
    if dc.get("mask_token_id") is None:
        raise ValueError(f"{path}/config.json has no dflash_config.mask_token_id: add the token id the "
                         "drafter was trained with as its mask")
    model = DFlashModel(config)
    q = config.get("quantization")
    if q:
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
    weights = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no safetensors weights")
    for f in files:
        weights.update(mx.load(str(f)))
    weights = {k[len("model."):] if k.startswith("model.") else k: v for k, v in weights.items()}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{path}: the weights do not match a DFlash drafter of this config ({str(e).splitlines()[0]})") from None
    if q:
        dequantize_linears(model)
    mx.eval(model.parameters())
    model.eval()
    model.path = str(path)
    return model


@dataclass(frozen=True)
class BoundDFlash:
    """A DFlash drafter bound to the target whose embedding, output head and layers it reads."""

    model: DFlashModel
    embed: object
    lm_head: object


def bind_dflash(drafter, target):
    """Check a DFlash drafter (a folder or a DFlashModel) against its target; one-line errors."""
    if target is None:
        raise ValueError("a DFlash drafter reads the target's embedding and hidden states: pass target=")
    model = drafter if isinstance(drafter, DFlashModel) else load_dflash(drafter)
    _, embed, lm_head = target_io(target)
    V, H = embed.weight.shape[0], model.config["hidden_size"]
    t_args = getattr(target, "args", None)
    t_hidden = getattr(t_args, "hidden_size", None) or (getattr(t_args, "text_config", None) or {}).get("hidden_size")
    if t_hidden is not None and t_hidden != H:
        raise ValueError(f"the DFlash drafter has hidden size {H}, the target {t_hidden}: use a drafter "
                         "trained for this target")
    if model.config.get("vocab_size") not in (None, V):
        raise ValueError(f"the DFlash drafter's vocabulary ({model.config['vocab_size']}) differs from the "
                         f"target's ({V}): use a drafter trained for this target")
    check_capture(target, model.target_layer_ids)
    if not 0 <= int(model.mask_token_id) < V:
        raise ValueError(f"the DFlash mask token {model.mask_token_id} is outside the target's vocabulary "
                         f"(0..{V - 1}): fix dflash_config.mask_token_id")
    if not 2 <= model.block_size <= MAX_NODES:
        raise ValueError(f"the DFlash block size must be in 2..{MAX_NODES}, got {model.block_size}")
    join(model)  # (its block forward runs q/k/v and gate/up as one matmul each: join.py)
    return BoundDFlash(model, embed, lm_head)


def probe_parents(topk, depth, budget, block_size=16):
    """The largest layout a round sends: the chain, or a best-first tree of the budget."""
    if topk == 1:
        return chain_parents(depth + 1)
    budget = budget or default_budget(block_size)
    from ..probe import representative_tree_parents

    return representative_tree_parents(2, depth or block_size - 1, budget)


def default_budget(block_size):
    """DDTree nodes per round when none is given: twice the block's predictions (31 for B = 16;
    32 verify rows, a power of two), at most 63. Larger trees only where asked for: past 64 rows
    a verify's cost depends on the device (bench/RESULTS.md at e45f48f, "DDTree past 64 nodes")."""
    return min(2 * (block_size - 1) + 1, 63)


class DFlashDrafter:
    """Chains (`topk = 1`, `depth` tokens) and DDTree trees (`budget` nodes, `topk` candidates per
    position, at most `depth` deep; 0 means the block's) from a bound DFlash drafter."""

    def __init__(self, bound, topk=0, depth=0, budget=0):
        if not isinstance(bound, BoundDFlash):
            raise ValueError("DFlashDrafter takes a drafter bound to its target: bind_dflash(folder, target)")
        for name, value in (("topk", topk), ("depth", depth), ("budget", budget)):
            check_int(value, f"DFlashDrafter {name} (0: the block's)", 0, MAX_NODES - 1)
        self.bound = bound
        m = bound.model
        self.block = m.block_size
        self.capture = m.target_layer_ids
        if depth > self.block - 1:
            raise ValueError(f"this DFlash drafter drafts blocks of {self.block}: a chain of at most "
                             f"{self.block - 1} (--draft-block-size), got {depth}")
        self.depth = depth or self.block - 1
        if topk == 1:
            self.topk, self.budget = 1, self.depth
        else:
            self.budget = budget or default_budget(self.block)
            self.topk = topk or self.budget
        # one trace per bound drafter, shared by every DFlashDrafter over it (a library call
        # makes a drafter per generation; a trace costs far more than a round)
        compiled = bound.model.__dict__.setdefault("_treespec_compiled", {})
        # (by module: a tied target's lm_head is a new bound method of its embedding each bind;
        # the trace holds the target's modules weakly, and an entry whose modules are gone is
        # dropped, else a DFlash model bound to target after target kept every one's alive)
        owners = (bound.embed, getattr(bound.lm_head, "__self__", bound.lm_head))
        for k in [k for k, (refs, _) in compiled.items() if any(r() is None for r in refs)]:
            del compiled[k]
        key = tuple(id(o) for o in owners)
        if key not in compiled:
            compiled[key] = (tuple(weakref.ref(o) for o in owners), self._compile())
        self._forward = compiled[key][1]
        self.draw = None  # set by the loop per generation (not by reset): at temp > 0 the sampling.Draw it guesses
        self.reset()

    # ------------------------------------------------------------------ the context cache

    def reset(self):
        self.keys = self.values = None  # per layer [1, n_kv, cap, d]
        self.length = 0  # context rows held (= the position of the next root)
        self.pending = None  # context features not yet projected [n, n*H]
        self._queued = None  # rounds queued ahead: (context rows on the device, a host bound on them)
        self._entry = 0  # the context rows when the rounds under way began to queue

    def _scores(self, logits):
        """What a chain picks each of a block's positions 1..n (`logits` [n, V]) by: the logits, or
        at temp > 0 the draw's scores of them (position k is drawn at depth k - 1 from the root)."""
        if self.draw is None:
            return logits
        return self.draw.at(logits, aranges(logits.shape[0])[0])

    def _room(self, rows):
        """Grow every layer's buffers (`verify.grown`: a multiple of `width_step()`, each width
        a trace of the block forward) to hold `rows` rows."""
        if self.keys is None:
            m = self.bound.model
            at = m.layers[0].self_attn
            empty = mx.zeros((1, at.n_kv, 0, at.head_dim), m.norm.weight.dtype)
            self.keys, self.values = [empty] * len(m.layers), [empty] * len(m.layers)
        # (one array per layer and buffer once grown: rows are written in place)
        self.keys = [grown(k, rows) for k in self.keys]
        self.values = [grown(v, rows) for v in self.values]

    def _write_context(self, feats, sync=True):
        """Project context features and write their K/V after the held context (no block);
        `sync=False` leaves the writes queued for the next forward (a round's catch-up)."""
        m = self.bound.model
        for start in range(0, feats.shape[0], 512):
            part = feats[start : start + 512]
            n = part.shape[0]
            self._room(self.length + n + 2 * self.block)
            ctx = m.context(part)
            for i, layer in enumerate(m.layers):
                k, v = layer.self_attn.kv(ctx, self.length)
                self.keys[i][..., self.length : self.length + n, :] = k
                self.values[i][..., self.length : self.length + n, :] = v
            self.length += n
            if sync:  # a long prompt: bound the graph
                mx.eval(self.keys, self.values)

    def prefill(self, prompt, hidden=None):
        self.reset()
        if hidden is None:
            raise ValueError("a DFlash drafter reads the target's hidden states: the loop passes them "
                             "(drafter.capture)")
        if hidden.shape[0]:
            self._write_context(hidden)

    def commit(self, draft, path, emitted, hidden=None):
        # the root and the accepted nodes are context now; their rows go in with the next block
        self.pending = hidden if self.pending is None else mx.concatenate([self.pending, hidden])

    def settle(self, sync=True, keep=None):
        """Write every pending context row but the last `keep` (default: a block's worth, which
        a block forward takes in its own pass); True where rows were written. `_block_logits`
        does it queued; after a plain stretch (adaptive.py's `catch_up`) it is done at once, so
        the stretch pays for the rows it added, not the next DFlash round (whose time would
        otherwise price DFlash against plain with the stretch's catch-up in it)."""
        keep = self.block if keep is None else keep
        n = 0 if self.pending is None else self.pending.shape[0]
        if n <= keep:
            return False
        self._write_context(self.pending[: n - keep], sync=sync)
        self.pending = self.pending[n - keep :] if keep else None
        return True

    # ------------------------------------------------------------------ drafting

    def _block_logits(self, root):
        """One forward: the pending context rows (padded to B) and the block [B, V]."""
        B = self.block
        # more context than one pass takes (rounds without a draft): written first
        self.forwards = 2 if self.settle(sync=False) else 1
        n = 0 if self.pending is None else self.pending.shape[0]
        L0 = self.length
        self._room(L0 + 2 * B)
        feats = self._block_rows(self.pending)
        root = root if isinstance(root, mx.array) else mx.array([int(root)], mx.uint32)
        logits, self.keys, self.values = self._forward(feats, root.reshape(1).astype(mx.uint32),
                                                       mx.array(L0, mx.int32), mx.array(n, mx.int32),
                                                       self.keys, self.values)
        self.length, self.pending = L0 + n, None
        return logits

    def _block_rows(self, rows):
        """Context rows for one block forward, in the drafter's dtype, padded to B rows (None:
        none). Padded rows are written after the context, hidden by the mask and overwritten
        by the next round's."""
        m, B = self.bound.model, self.block
        width = len(m.target_layer_ids) * m.config["hidden_size"]
        dtype = m.hidden_norm.weight.dtype
        n = 0 if rows is None else rows.shape[0]
        feats = rows.astype(dtype) if n else mx.zeros((0, width), dtype)
        return mx.concatenate([feats, mx.zeros((B - n, width), dtype)]) if n < B else feats

    def _compile(self):
        """The block forward as one compiled function: the graph is traced once per buffer
        width, so a round spends no Python per op and the device runs fused kernels."""
        # (kept on the drafter model: a weak reference to it leaves that model no cycle, so one
        # loaded per call is freed when the call returns)
        m, embed, lm_head, B = weakref.proxy(self.bound.model), _weak(self.bound.embed), _weak(self.bound.lm_head), self.block
        mask_tokens = mx.full((B - 1,), int(m.mask_token_id), mx.uint32)

        def forward(feats, root, L0, n, keys, values):
            with running():
                return block(feats, root, L0, n, keys, values)

        def block(feats, root, L0, n, keys, values):
            # context rows go to [L0, L0 + B), the block to [L0 + B, L0 + 2B); the block sits at
            # positions L0 + n.. (right after the real context rows)
            ctx = m.context(feats)
            x = embed(mx.concatenate([root, mask_tokens])[None])
            pos = L0 + n
            cols = mx.arange(keys[0].shape[2])
            mask = (cols < pos) | ((cols >= L0 + B) & (cols < L0 + 2 * B))
            start = L0.reshape(1)
            new_keys, new_values = [], []
            for layer, kbuf, vbuf in zip(m.layers, keys, values):
                at = layer.self_attn
                xn = layer.input_layernorm(x)
                q = at.rope(at.heads(xn, at.q_proj, at.n_heads, at.q_norm), offset=pos)
                kb, vb = at.kv(xn, pos)
                kc, vc = at.kv(ctx, L0)
                kbuf = mx.slice_update(kbuf, mx.concatenate([kc, kb], axis=2), start, axes=(2,))
                vbuf = mx.slice_update(vbuf, mx.concatenate([vc, vb], axis=2), start, axes=(2,))
                new_keys.append(kbuf)
                new_values.append(vbuf)
                o = mx.fast.scaled_dot_product_attention(q, kbuf, vbuf, scale=at.scale, mask=mask)
                x = x + at.o_proj(o.transpose(0, 2, 1, 3).reshape(1, B, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return lm_head(m.norm(x))[0], new_keys, new_values

        return mx.compile(forward)

    def draft(self, root, max_depth):
        depth = min(self.depth, max_depth)
        if depth == 0:
            return Draft.root_only(root)
        if self.topk == 1:
            logits = self._block_logits(root)[1 : depth + 1]  # position k predicts k after the root
            chain = mx.argmax(self._scores(logits), axis=-1).astype(mx.uint32)
            root_arr = mx.array([int(root)], mx.uint32)
            return Draft(mx.concatenate([root_arr, chain]), Layout.fixed(chain_parents(depth + 1)),
                         budget=depth, depth=depth, forwards=self.forwards)
        ids, top = self.ranked(root, depth)
        return self.as_draft(root, ids, best_first_tree(0, top, self.budget), depth, self.budget)

    @property
    def ahead(self):
        """`chain_ahead` or `tree_ahead`: drafts from device values alone (rounds queued ahead:
        queued.py)."""
        return self.chain_ahead if self.topk == 1 else self.tree_ahead

    @property
    def queues_trees(self):
        """`ahead` drafts trees (queued.py: over recurrent layers too, scanned over device parents)."""
        return self.topk != 1

    def _ahead_logits(self, root, rows, count):
        """The block forward of a queued round: `root` (mx uint32 [1]), `rows` the captured
        target rows of the previous verify along its accepted path (root first; None in the
        first round) of which the first `count` (mx int32) were accepted and are context now."""
        B = self.block
        if self._queued is None:
            self._queued = (mx.array(self.length, mx.int32), self.length)
            self._entry = self.length
        L0, bound = self._queued  # the context rows, and at most how many: room for this block
        self._room(bound + 2 * B)
        rows = None if rows is None else rows[:B]  # (a path is at most B rows: count <= B)
        feats = self._block_rows(rows)  # rows past `count` are written after the context, hidden
        if rows is None:
            count = mx.array(0, mx.int32)
        logits, self.keys, self.values = self._forward(feats, root.reshape(1).astype(mx.uint32), L0,
                                                       count, self.keys, self.values)
        self._queued = (L0 + count, bound + (0 if rows is None else rows.shape[0]))
        self.forwards = 1
        return logits

    def chain_ahead(self, root, rows, count):
        """A chain drafted from device values alone, so the host never waits (`_ahead_logits`'s
        arguments). Returns the chain, mx uint32 [depth]."""
        logits = self._ahead_logits(root, rows, count)
        return mx.argmax(self._scores(logits[1 : self.depth + 1]), axis=-1).astype(mx.uint32)

    def tree_ahead(self, root, rows, count, path=None):
        """DDTree's tree drafted from device values alone (`device_tree.best_first`;
        `_ahead_logits`'s arguments; the path's tokens are not needed: its rows are the context).
        Returns a Draft whose layout lives on the device."""
        logits = self._ahead_logits(root, rows, count)[1 : self.depth + 1]
        lp = logits.astype(mx.float32)
        tokens, parents, depths, anc = best_first(root.reshape(1).astype(mx.uint32),
                                                  lp - mx.logsumexp(lp, axis=-1, keepdims=True), self.budget,
                                                  self.topk)
        return Draft(tokens, Layout.on_device(parents, depths, anc), budget=self.budget,
                     depth=self.depth, forwards=1)

    def queued_read(self, emitted):
        """The host has read queued rounds that emitted `emitted` tokens since queueing began,
        and the next round's block is queued: its forward took their rows, so the context holds
        exactly the rows at entry + `emitted` (the host's bound on it, which only grew by a
        block a round, is that again: buffers grow with the context, not the rounds)."""
        if self._queued is not None:
            self._queued = (self._queued[0], self._entry + emitted)

    def handed_back(self, start, tokens):
        """Rounds queued ahead ended (queued.py) at the target's `start` rows, having emitted
        `tokens`; the round loop drafts next. The context gained a row for the root they started
        from and for each of them but the last, the next root (the round queued past the end
        wrote the last round's): counted from the rows at entry, not `start`, as a prompt
        cache's earlier turns are in the target's rows, not in this context."""
        self.length, self.pending, self._queued = self._entry + len(tokens), None, None

    def requeue(self):
        """Rounds are queued again from here (after the round loop's): every pending context
        row is written (a queued round's first block takes none), so `chain_ahead` starts at
        the context's end."""
        self.settle(sync=False, keep=0)
        self._queued = None

    def ranked(self, root, depth):
        """One block forward; each of the first `depth` positions' best candidates on the host:
        (token ids, log-probabilities), both [depth, k], best first (the round's extra sync)."""
        logits = self._block_logits(root)[1 : depth + 1]  # position k predicts k after the root
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        k = min(self.topk, self.budget, logprobs.shape[-1])
        ids, top = top_k(logprobs, k, ordered=True)  # (`as_draft`'s columns are ranks)
        mx.eval(ids, top)
        return np.array(ids), np.array(top)

    def as_draft(self, root, ids, tree, depth, budget):
        """A best-first tree over column ranks (`builders.best_first_tree` over `ranked`'s
        log-probabilities; a column is a rank, its token ids[position, column]) as the round's
        draft, renumbered depth-first so the most probable chain takes ids 1, 2, ... (see
        tree.preorder)."""
        order = preorder(tree.parents)
        parents = relabel(tree.parents, order)
        cols, depths = tree.tokens[order][1:], tree.depths[order][1:]
        tokens = np.concatenate([[int(root)], ids[depths - 1, cols]]).astype(np.uint32)
        return Draft(mx.array(tokens), Layout.host(parents), budget=budget, depth=depth,
                     forwards=self.forwards)

    def probe_parents(self):
        return probe_parents(self.topk, self.depth, self.budget, self.block)
