"""Tree forwards on unmodified mlx-lm models.

A round runs one or more forwards over tree nodes on top of a model's committed caches, then
commits the accepted root path. Nothing in the model is copied: each attention's `rope` module
(and each GatedDeltaNet layer) is re-classed once to a subclass that passes through outside tree
forwards, and during a forward each layer cache is replaced by a stand-in that gives the model the
tree's mask and key layout.

- Position of a node = committed offset + its depth (per-token RoPE: a (B, H, L, D) input is
  viewed as (L*B, H, 1, D) so `mx.fast.rope` takes one offset per token).
- A node sees the history and its own ancestors, nothing else.
- Round nodes are numbered in the order they are added; parent -1 means "child of the history".
- A round is a transaction: until `commit`, only append-kind caches are written (past their
  committed offset, invisible to later rounds); `abort` puts every cache back as the round found
  it, and `commit` prepares every layer's new state before it writes any.
- Hidden-state capture: a round made with `capture` (target layer indices) records those layers'
  outputs for every node of each forward (`TreeRound.hidden`); nothing is recorded otherwise.
"""
import dataclasses
import sys
import threading
import time
import weakref

import numpy as np
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.base import scaled_dot_product_attention as _BASE_SDPA

from . import attention
from . import join as joining

from .cache import (
    cache_kind,
    commit_appended,
    committed_offset,
    commit_rotating,
    leading_run,
    restore,
    rotating_layout,
    snapshot,
)
from .draft import Layout
from .launch import in_launch
from .tree import ancestors_of, depths_of

__all__ = ["TreeRound", "install", "is_tree_module", "cached_array", "capturing", "check_capture",
           "row_bucket", "pad_keys_default", "width_step", "compiled_forward", "whole_buffer_forward",
           "reserve", "grown", "layer_span", "rows_are_steps", "kernel_fits"]


class _Context(threading.local):
    """What the re-classed modules read while a tree forward runs: one per thread (two threads
    generating at once each run their own forwards), not per model, since a draft model may
    share modules with its target (layer-skip self-speculation:
    `draft.model.layers = target.model.layers[:k]`)."""

    def __init__(self):
        self.positions = None  # mx int [L] while a tree forward runs
        self.parents = None  # np int [L]: round parents of the forward's nodes (-1: committed state)
        self.first = 0  # the round node the forward's first node is
        self.captured = None  # {layer index: output} while a capturing forward runs
        self.layer_ids = None  # {id(layer module): its index in the model that captures}
        self.last_layer = None  # the last decoder layer output of a capturing forward
        self.attend = None  # (the forward's additive mask, (hist, end) on the device): attention.py


_CTX = _Context()


def _rope_call(self, x, offset=0, **kwargs):
    positions = _CTX.positions
    if positions is None:
        return super(type(self), self).__call__(x, offset=offset, **kwargs)
    B, H, L, D = x.shape
    if B == 1:  # (1, H, L, D) -> (L, H, 1, D) is a swap of two axes, no reshape copy
        return _rope_rows(self, x.swapaxes(0, 2), positions, kwargs).swapaxes(0, 2)
    rows = x.transpose(2, 0, 1, 3).reshape(L * B, H, 1, D)
    out = _rope_rows(self, rows, mx.repeat(positions, B), kwargs)
    return out.reshape(L, B, H, -1).transpose(1, 2, 0, 3)


def rope_rows_per_call(dims, heads):
    """The most rows (one position each) one rope call takes. MLX's CUDA rope kernel (0.32)
    launches 2^10 threads a block, dims / 2 of them in x and rows x ceil(heads / 4) in z: under
    32 rotary dims (a partial rotary at a small head dim: the demo hybrid's 16) the block's z
    passes CUDA's 64 from 128 rows x ceil(heads / 4) on, and the launch fails."""
    return None if dims >= 32 else max(1, 64 // -(-heads // 4))


def _rope_rows(rope, rows, offsets, kwargs):
    """The rope of `rows` [n, H, 1, D] at per-row positions `offsets`, in pieces of at most
    `rope_rows_per_call` rows (each row's rotation is its own: the same values)."""
    call = super(type(rope), rope).__call__
    n, H, _, D = rows.shape
    most = rope_rows_per_call(getattr(rope, "dims", D), H)
    if most is None or n <= most:
        return call(rows, offset=offsets, **kwargs)
    return mx.concatenate([call(rows[i : i + most], offset=offsets[i : i + most], **kwargs)
                           for i in range(0, n, most)])


def _gdn_call(self, inputs, mask=None, cache=None):
    if _CTX.positions is None:
        return super(type(self), self).__call__(inputs, mask=mask, cache=cache)
    from .gdn import gdn_layer_tree_forward

    done = 0 if cache.payload is None else cache.payload["parents"].size
    if done != _CTX.first:  # its payload must hold exactly the round's earlier nodes
        raise ValueError(f"GatedDeltaNet layer ran over {done} of the round's {_CTX.first} earlier nodes "
                         "(called twice in a forward, or skipped one): no tree forward for this model")
    out, payload = gdn_layer_tree_forward(self, inputs, cache.inner, _CTX.parents, prior=cache.payload)
    cache.record(self, payload)
    return out


def _mla_call(self, x, mask=None, cache=None):
    """Multi-head latent attention (deepseek_v3's, glm4_moe_lite's) in a tree forward. mlx-lm
    attends over the latent rows for one token (the query absorbed into the latent space,
    decoding's arithmetic) and over expanded K/V for several (prefill's): a verify of several
    nodes must take decoding's arithmetic for every row to be decoding, bitwise on CPU. The
    same steps as mlx-lm's one-token branch, for any number of rows."""
    if _CTX.positions is None:
        return super(type(self), self).__call__(x, mask=mask, cache=cache)
    B, L, _ = x.shape
    q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q_nope, q_pe = mx.split(q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3),
                            [self.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(self.kv_a_layernorm(latent), axis=1)
    q_pe, k_pe = self.rope(q_pe, cache.offset), self.rope(k_pe, cache.offset)  # per-token positions
    latent, k_pe = cache.update_and_fetch(latent, k_pe)
    scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
    if mask is not None:  # the round's mask: boolean (CPU) or additive (GPU)
        low = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
        scores = mx.where(mask, scores, low) if mask.dtype == mx.bool_ else scores + mask.astype(scores.dtype)
    out = _BASE_SDPA(self.embed_q(q_nope), latent, latent, cache=cache, scale=self.scale, mask=scores)
    return self.o_proj(self.unembed_out(out).transpose(0, 2, 1, 3).reshape(B, L, -1))


# Attention classes whose several-token forward is not their one-token arithmetic, and the tree
# forward that is (by class name)
MLA_CLASSES = {"DeepseekV3Attention", "Glm4MoeLiteAttention"}


def _tree_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, where a model module calls it: a tree forward's
    own mask (the very array the stand-ins handed out) goes to the tree-attention kernel where
    it takes the shapes; everything else, and every call outside such a forward, to mlx-lm's."""
    attend = _CTX.attend
    if attend is not None and mask is attend[0] and sinks is None and \
            attention.fits(queries, keys, values, mask, steps=attend[2]):
        return attention.tree_attention(queries, keys, values, mask, attend[1], scale)
    return _BASE_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _route_attention(module):
    """Point the module's `scaled_dot_product_attention` (mlx-lm's, imported by name into each
    model file) at `_tree_sdpa`; once per model file."""
    mod = sys.modules.get(type(module).__module__)
    if mod is not None and getattr(mod, "scaled_dot_product_attention", None) is _BASE_SDPA:
        mod.scaled_dot_product_attention = _tree_sdpa


def _layer_call(self, *args, **kwargs):
    out = super(type(self), self).__call__(*args, **kwargs)
    captured = _CTX.captured
    if captured is not None:
        i = _CTX.layer_ids.get(id(self))
        h = out[0] if isinstance(out, tuple) else out
        _CTX.last_layer = h  # the rows' shape, for the layers another pipeline process holds
        if i in captured:
            captured[i] = h
    return out


_TREE_CLASSES = {}


def _make_tree_module(module, call):
    """Give `module` a subclass whose __call__ knows tree forwards; parameters stay as they are."""
    cls = type(module)
    if cls in _TREE_CLASSES.values():  # already re-classed (a module shared by two models)
        return
    sub = _TREE_CLASSES.get((cls, call))
    if sub is None:
        sub = type(f"Tree{cls.__name__}", (cls,), {"__call__": call})
        _TREE_CLASSES[(cls, call)] = sub
    module.__class__ = sub


def is_tree_module(module):
    return type(module) in _TREE_CLASSES.values()


# Recurrent layer classes that fork over a tree (mlx_treespec.gdn), by class name
GDN_CLASSES = {"GatedDeltaNet", "Qwen3NextGatedDeltaNet"}
# Where a layer keeps its rope module (re-classed to take per-token positions)
ROPE_KEYS = ("rope", "rotary_emb")


def install(model):
    """Re-class every rope module and GatedDeltaNet layer of `model` (once per module), route its
    model files' attention calls through `_tree_sdpa`, and join the linear layers that read one
    input (join.py: one matmul each group in a tree forward)."""
    if getattr(model, "_treespec_installed", False):
        return
    joining.join(model)
    from .gdn import forkable

    for _, module in model.named_modules():
        if not isinstance(module, nn.Module) or is_tree_module(module):
            continue
        for key in ROPE_KEYS:
            rope = module.get(key)
            if isinstance(rope, nn.Module):
                _make_tree_module(rope, _rope_call)
        if type(module).__name__ in GDN_CLASSES and forkable(module):  # (the gate refuses the others)
            _make_tree_module(module, _gdn_call)
        if type(module).__name__ in MLA_CLASSES:
            _make_tree_module(module, _mla_call)
        _route_attention(module)
    model._treespec_installed = True
    model._treespec_rows_are_steps = not any(type(m).__dict__.get("__call__") is _mla_call
                                             for _, m in model.named_modules())


def rows_are_steps(model):
    """Whether the model's plain forward of several tokens is, row by row, its one-token
    decoding (on CPU, bitwise). Not with multi-head latent attention: mlx-lm computes several
    rows by prefill's arithmetic there. Where it is not, a chain verifies through the tree
    forward and accepted tokens are never re-run in a plain forward."""
    install(model)
    return model._treespec_rows_are_steps


def layer_span(model):
    """(index of this process's first decoder layer, its layers, the model's layer count): under
    mlx-lm's pipeline parallelism (`model.model.pipeline(group)`) a process holds a slice of the
    layers; otherwise (0, all of them, their count)."""
    layers = list(getattr(model, "layers", []))
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        args = getattr(model, "args", None)
        total = getattr(args, "num_hidden_layers", None) or (getattr(args, "text_config", None) or {}).get(
            "num_hidden_layers") or len(inner.layers)
        return inner.start_idx, layers, int(total)
    return 0, layers, len(layers)


def _pipeline_group(model):
    """The group a pipelined model's captured rows are summed over (None: not pipelined)."""
    if getattr(getattr(model, "model", None), "pipeline_size", 1) <= 1:
        return None
    group = mx.distributed.init()
    if group.size() != model.model.pipeline_size:
        raise ValueError("a drafter that reads the target's hidden states needs the pipeline group to be "
                         "the whole launch (mlx.launch): shard with pipeline_group=mx.distributed.init()")
    return group


def check_capture(model, capture):
    """Refuse layer indices the model does not have, naming its depth."""
    n = layer_span(model)[2]
    bad = [i for i in capture if not 0 <= i < n]
    if bad:
        raise ValueError(f"the drafter reads target layers {bad}, but the target has {n} layers "
                         f"(0..{n - 1}): use a drafter made for this target")


class capturing:
    """`with capturing(model, capture) as c:` records the outputs of decoder layers `capture`
    (indices into the model's layers) in every forward inside; `c.hidden(n)` concatenates the
    first n rows of each on the feature axis ([n, len(capture) * H]). An empty `capture`
    records nothing and costs nothing. Under pipeline parallelism each process records the
    layers it holds and the rows are summed over the group (zeros for the others' layers), so
    every process gets every captured row: one all_sum per forward."""

    def __init__(self, model, capture):
        self.capture = tuple(capture)
        self.start, self.layers, _ = layer_span(model) if self.capture else (0, [], 0)
        self.group = _pipeline_group(model) if self.capture else None

    def __enter__(self):
        if self.capture:
            for layer in self.layers:
                _make_tree_module(layer, _layer_call)
            _CTX.layer_ids = {id(m): self.start + i for i, m in enumerate(self.layers)}
            _CTX.captured = {i: None for i in self.capture}
        return self

    def hidden(self, n=None):
        if not self.capture:
            return None
        rows = [_CTX.captured[i] for i in self.capture]
        if self.group is None:
            return mx.concatenate([r[0][:n] if n is not None else r[0] for r in rows], axis=-1)
        like = next((r for r in rows if r is not None), _CTX.last_layer)
        rows = [r[0] if r is not None else mx.zeros_like(like[0]) for r in rows]  # another process's layer
        out = mx.distributed.all_sum(mx.concatenate(rows, axis=-1), group=self.group)
        return out[:n] if n is not None else out

    def take(self):
        """The recorded rows (all of them), and a clean slate for the next forward."""
        h = self.hidden()
        if self.capture:
            _CTX.captured = {i: None for i in self.capture}
        return h

    def __exit__(self, *exc):
        _CTX.captured = None
        _CTX.layer_ids = None
        return False


class _AppendLayer:
    """Stands in for a KVCache / QuantizedKVCache: tree K/V go in place after the history."""

    def __init__(self, inner, rnd):
        self.inner = inner
        self.rnd = rnd

    def __getattr__(self, name):  # bits, group_size (quantized attention reads them)
        return getattr(self.inner, name)

    @property
    def offset(self):
        return self.inner.offset

    def make_mask(self, N, window_size=None, return_array=False):
        return self.rnd._append_mask(window_size)

    def update_and_fetch(self, keys, values):
        keys, values = self.inner.update_and_fetch(keys, values)
        if self.rnd.width is not None:  # the whole buffer; the mask hides the unused tail
            return self.inner.keys, self.inner.values
        return keys, values


_NODE_ROWS = ("qkv", "q", "k", "v", "g", "beta")  # payload arrays [B, nodes, ...] (gdn.py)


class _ArraysLayer:
    """Stands in for a GatedDeltaNet layer's ArraysCache: verify reads it, commit replays. In a
    whole-buffer forward of queued rounds its `inner` is the [conv, recurrent] states the rounds
    carry (no round: `rnd` None)."""

    def __init__(self, inner, rnd):
        self.inner = inner
        self.rnd = rnd
        self.layer = None
        self.payload = None

    def __getitem__(self, i):
        return self.inner[i]

    def __setitem__(self, i, v):
        # only mlx-lm's scheduling hint (mx.depends on the same value) writes here in a forward
        self.inner[i] = v

    def make_mask(self, N):
        return None

    def record(self, layer, payload):
        """The layer's payload after a forward: every node of the round so far (a later forward
        of the round continues it: gdn.gdn_layer_tree_forward's `prior`)."""
        self.layer, self.payload = layer, payload

    def keep_first(self, m):
        """Keep the payload's first m nodes, the round's (a forward's filler rows after them are
        leaves no node continues and no commit keeps; a payload this forward did not reach,
        an error's, holds none)."""
        if self.payload is None or self.payload["parents"].size <= m:
            return
        self.payload = {k: (v[:m] if k == "parents" else v[:, :m] if k in _NODE_ROWS else v)
                        for k, v in self.payload.items()}


class _RotatingLayer:
    """Stands in for a RotatingKVCache: the committed buffer is only read during the round.

    Tree K/V are kept aside and the keys are presented in the slot order plain decoding would
    have (see cache.rotating_layout), so windowed attention is exact, wrapped or not.
    """

    def __init__(self, inner, rnd):
        self.inner = inner
        self.rnd = rnd
        self.keys = None
        self.values = None

    @property
    def offset(self):
        return self.inner.offset

    def make_mask(self, N, window_size=None, return_array=False):
        return self.rnd._rotating(self.inner, window_size)[1]

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        order = self.rnd._rotating_order(self.inner)
        if self.inner.keys is None:
            all_k, all_v = self.keys, self.values
        else:
            all_k = mx.concatenate([self.inner.keys, self.keys], axis=2)
            all_v = mx.concatenate([self.inner.values, self.values], axis=2)
        return all_k[:, :, order, :], all_v[:, :, order, :]


class _NotCompilable(Exception):
    """Raised while tracing a compiled verify where the model does what the trace cannot keep
    (a windowed mask, the cache's offset read outside RoPE): the round runs eagerly."""


class _Offset:
    """What a compiled verify's stand-in gives for `offset`: RoPE ignores it in a tree forward
    (positions come per token); any other use would bake one round's offset into the trace."""

    def __getattr__(self, name):
        raise _NotCompilable("the model reads its cache offset outside RoPE")

    def __index__(self):
        raise _NotCompilable("the model reads its cache offset outside RoPE")

    __int__ = __bool__ = __index__
    __add__ = __radd__ = __sub__ = __rsub__ = __lt__ = __gt__ = __le__ = __ge__ = __eq__ = \
        lambda self, *a: _Offset.__index__(self)
    __hash__ = object.__hash__


class _TracedAppend:
    """A KVCache inside the compiled verify: K/V rows written at `start` into whole buffers
    (function inputs), attention over the whole buffers with the round's additive mask."""

    def __init__(self, keys, values, start, mask):
        self.keys, self.values, self.start, self.mask = keys, values, start, mask
        self.offset = _Offset()

    def make_mask(self, N, window_size=None, return_array=False):
        if window_size is not None:
            raise _NotCompilable("the model asks for windowed masks")
        return self.mask

    def update_and_fetch(self, keys, values):
        self.keys = mx.slice_update(self.keys, keys, self.start[:1], axes=(2,))
        self.values = mx.slice_update(self.values, values, self.start[:1], axes=(2,))
        return self.keys, self.values


CHECKS = 4  # compiled calls per shape checked bitwise against the eager forward before trusted
_clock = time.perf_counter  # times the checks' two forwards (tests replace it)


def whole_buffer_forward(model, capture, scans=frozenset(), kernel=False, steps=False):
    """A tree forward over whole KV buffers: tokens [T], positions [T], the round's additive
    mask [T, W], `start` [3] (the write offset, then the mask's bounds: every row sees the
    columns before the second, none those from the third on) and each layer's buffers in;
    logits [T, V], the captured rows and the new buffers out.

    `scans`: the indices of recurrent layers (a hybrid's GatedDeltaNet), whose "buffers" are
    their committed conv and recurrent states; the tokens are a chain, or the tree of the
    optional last input `parents` (mx int32 [T]: a tree built on the device, or a queued chain
    whose commit reads every row's kept state, `gdn.DevicePlan`), and such a layer gives out
    its scan's payload (and None) for the commit (a compiled forward gives out the payload's
    host entries, its parents and kernel flag, as they were traced: they depend on the row
    count only; a device tree's parents are an input, given back).
    `kernel`: attention runs the tree-attention kernel (`kernel_fits`); `steps`: a drafter's
    forward, whose steps of up to `attention.STEP_ROWS` rows take it at any key width (a
    target's forwards keep the width bound: the exactness probe's shapes are its verifies)."""

    def forward(tokens, positions, mask, start, keys, values, parents=None):
        bufs = [_ArraysLayer([k, v], None) if i in scans else _TracedAppend(k, v, start, mask)
                for i, (k, v) in enumerate(zip(keys, values))]
        try:
            _CTX.positions = positions
            if kernel:
                _CTX.attend = (mask, start[1:], steps)
            if scans:
                from .gdn import DevicePlan, chain_plan

                _CTX.parents = chain_plan(tokens.shape[0]) if parents is None else DevicePlan(parents)
                _CTX.first = 0
            with capturing(model, capture) as cap, joining.running():
                out = model(tokens[None], cache=bufs)[0]
                hidden = [cap.hidden()] if capture else []
        finally:
            _CTX.positions = _CTX.attend = None
            if scans:
                _CTX.parents, _CTX.first = None, 0
        return (out, hidden, [b.payload if i in scans else b.keys for i, b in enumerate(bufs)],
                [None if i in scans else b.values for i, b in enumerate(bufs)])

    return forward


def kernel_fits(buffers):
    """Whether a whole-buffer forward over these K buffers (one per attention layer) runs its
    attention through the tree-attention kernel (attention.py: CUDA, float16 / bfloat16, head
    dim 64 or 128). Every layer's variant is built and checked here, outside any trace, so
    which layers take the kernel (`attention.fits`) never depends on what ran before."""
    variants = {(b.dtype, b.shape[-1]) for b in buffers if isinstance(b, mx.array)}
    return any([attention.usable(dtype, D) for dtype, D in sorted(variants, key=str)])


def _compiled(model, capture, kernel=False, scans=frozenset()):
    """The model's whole-buffer tree forward (`whole_buffer_forward`) as one `mx.compile`d function,
    traced once per shape, and its record (shapes checked, whether it is off and why). A round
    then spends no Python per op and elementwise ops fuse. Kept on the model.

    Plain decoding stays eager: a one-token step over whole buffers needs the mask, and on the
    H200 the masked step differs from mlx-lm's unmasked one (docs/design.md)."""
    store = model.__dict__.get("_treespec_compiled_verify")
    layers = _layers(model)
    if store is None or store["layers"] != layers:  # new layer modules: trace again
        store = _new_store(model, layers, {})
    if store["off"] is not None:
        return None, store
    own = store["own"]
    if own is not model:  # (read every call: a module set on the model since, e.g. a quantized lm_head)
        own.clear()
        own.update(model)
        if any(isinstance(v, mx.array) for v in own.values()):
            # arrays of the model's own at its top: the forward reads them from the model, not
            # from a copy, so the trace takes the model itself (a cycle the collector frees)
            store = _new_store(model, layers, model.state)
            own = model
    fn = store["fns"].get((capture, kernel, scans))
    if fn is None:
        # the model's arrays and its joined layers' are inputs, read at every call: a trace
        # never runs stale weights (an update, an in-place edit, an adapter: join.join)
        fn = store["fns"][(capture, kernel, scans)] = mx.compile(
            whole_buffer_forward(weakref.proxy(model), capture, scans, kernel), inputs=[own, joining.arrays(model)])
    return fn, store


def _new_store(model, layers, own):
    """A model's compiled-verify record, kept on it: the traces by (capture, kernel, scans), the
    shapes checked and which run eagerly, and `own`, the traces' input holding the model's
    arrays. `own` is a copy of the model's entries (its modules), not the model, and the
    forward sees the model through a weak proxy: kept on the model, the trace makes no
    reference cycle, so a dropped target is freed at once, not when the collector runs (an 8B
    target's weights)."""
    store = model.__dict__["_treespec_compiled_verify"] = {
        "fns": {}, "checked": {}, "eager": {}, "eager_wins": {}, "off": None, "calls": 0, "trusted_runs": 0,
        "layers": layers, "own": own}
    if in_launch():
        store["off"] = "a sharded model (mlx.distributed): its collectives run eagerly"
    return store


def compiled_forward(model, capture, n, args, reference, kernel=False, scans=frozenset()):
    """`whole_buffer_forward` through `_compiled` on args (tokens, positions, mask, start, keys,
    values), its attention through the tree-attention kernel where `kernel`, `scans` its
    recurrent layers. A shape's first `CHECKS` calls also run `reference()` (the eager forward:
    logits, the first n captured rows, the buffers) and must equal it bit for bit
    (`_bitwise_equal`: every output, the buffers and recurrent payloads later rounds read
    included), else the model runs eagerly from then on. The model's cache offset read outside
    RoPE, a windowed mask or an array evaluated inside the forward stops the trace the same way
    (any other error propagates).

    Every check but the first (it paid for the trace and the kernel plans) times both forwards
    from inputs already computed, each as its host part (built and launched) counted twice plus
    its wait, and a shape whose eager forward cost less in most of them runs eagerly from then
    on: compiling saves host time per op, which queued rounds wait on, but on the H200 the
    compiled forward's attention over long key buffers cost more than all it saved. Synced
    samples alone decided before (one, then a majority of three), and sent a short tree verify
    eager in one H200 call (docs/design.md, the compiled verify, says where each was measured).

    Returns (result, trusted): the compiled (logits, rows, keys, values) with trusted True, or
    the reference's result (in that order) with False; None where the eager path runs."""
    fn, store = _compiled(model, capture, kernel, scans)
    if fn is None:
        return None
    tokens, positions, mask, start, keys, values = args[:6]  # (then a tree's device parents, if any)
    # what a trace is made for (mx.compile traces again for any other input shape or dtype; the
    # buffers' shapes follow from the width and the model)
    shape = (tokens.shape[0], tokens.dtype, positions.dtype, start.dtype, mask.shape[1], mask.dtype,
             tuple(k.dtype for k in keys), tuple(None if v is None else v.dtype for v in values),
             capture, kernel, scans, len(args))
    store["calls"] += 1  # (verifies that asked for it; `trusted_runs` of them ran compiled)
    if store["eager"].get(shape):
        return None
    # a trace that raises leaves its placeholders in the model's arrays (they are the
    # function's inputs): the first call of a shape, the one that traces, keeps them
    saved = (tree_flatten(model.parameters()), joining.held(model)) if shape not in store["checked"] else None
    checked = store["checked"].get(shape, 0)
    timed = 0 < checked < CHECKS
    if timed:  # the inputs' pending work (the draft, the mask, an earlier round) is neither forward's
        mx.eval(args)
        t0 = _clock()
    try:
        out, hidden, keys, values = fn(*args)
    except BaseException as e:
        if saved is not None:
            model.update(tree_unflatten(saved[0]))
            joining.put_back(model, saved[1])
        if isinstance(e, _NotCompilable) or (isinstance(e, ValueError) and "transformation" in str(e)):
            store["off"] = f"{type(e).__name__}: {e}"  # the model reads or evaluates in its forward
            return None
        raise  # a real error: the round aborts as an eager one would
    hidden = hidden[0][:n] if hidden else None
    if checked < CHECKS:
        if timed:  # each forward's host part (built and launched), then its whole
            mx.async_eval(out, keys, values)
            t1 = _clock()
            mx.eval(out, keys, values)
            t2 = _clock()
        ref = reference()
        if timed:
            mx.async_eval(ref[0], ref[2:])
            t3 = _clock()
            mx.eval(ref[0], ref[2:])
            # the host part counts twice: a queued round's host work is on its critical path
            # (the device waits for the next round's launches), which one synced forward hides
            eager = 2 * (t3 - t2) + (_clock() - t3) < 2 * (t1 - t0) + (t2 - t1)
            wins = store["eager_wins"][shape] = store["eager_wins"].get(shape, 0) + eager
            if checked == CHECKS - 1:
                store["eager"][shape] = 2 * wins > CHECKS - 1
        # the logits, the captured rows, and what later rounds read: the buffers written and the
        # recurrent layers' payloads, which the commit scans again
        if not _bitwise_equal((out, hidden, keys, values)[:len(ref)], ref):
            store["off"] = "the compiled forward differs from the eager one"
        store["checked"][shape] = checked + 1
        return ref, False
    store["trusted_runs"] += 1
    return (out, hidden, keys, values), True


def _bitwise_equal(got, want):
    """Two forwards' outputs (arrays, lists, tuples, dicts; host entries by value) bit for bit:
    the same structure, dtypes and shapes, and equal values (one sync)."""
    flags = []
    return _same(got, want, flags) and (not flags or mx.all(mx.stack(flags)).item())


def _same(a, b, flags):
    """`_bitwise_equal`'s walk: the structures match; each pair of arrays' equality goes to
    `flags`. (A function of the module: a recursive closure is a reference cycle, its arrays
    held until the garbage collector runs.)"""
    if isinstance(b, mx.array):
        if not isinstance(a, mx.array) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        flags.append(mx.array_equal(a, b))
        return True
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all([_same(a[k], b[k], flags) for k in b])
    if isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and len(a) == len(b) and all([_same(x, y, flags) for x, y in zip(a, b)])
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and np.array_equal(a, b)
    return a is b or a == b


def _layers(model):
    """The layer modules a trace called (replacing one needs a new trace)."""
    return tuple(id(m) for m in getattr(model, "layers", []))


def pad_keys_default():
    """Whether attention reads whole KV buffers (shapes change only when a buffer grows).

    On CUDA, attention over a key length it has not seen costs a new kernel plan; a verify that
    reads the used rows only would pay it every round. On CPU reading the tail costs time only.
    """
    return mx.default_device() == mx.gpu


def width_step():
    """Rows a buffer that attention reads whole grows by: on a GPU every new width costs new
    kernel plans and a new trace, so widths should repeat across rounds and prompts (1024);
    on CPU a width costs nothing but the attention over its unused rows (256)."""
    return 1024 if pad_keys_default() else 256


def reserve(cache, n):
    """Room in a KVCache's buffer for n more tokens, leaving its offset; returns the buffer
    length, or None where it cannot be known ahead (empty or quantized caches). The buffer
    is made a multiple of `width_step()` rows (also the one a prefill left: mlx-lm sizes it
    by the prompt, and every prompt length would be a new width)."""
    if type(cache).__name__ != "KVCache" or cache.keys is None:
        return None
    cache.keys, cache.values = grown(cache.keys, cache.offset + n), grown(cache.values, cache.offset + n)
    return cache.keys.shape[2]


def grown(buffer, rows):
    """A K/V buffer [B, H, width, D] with room for `rows` rows, its width a multiple of
    `width_step()` (the same array where it is one already)."""
    width, step = buffer.shape[2], width_step()
    if rows <= width and width % step == 0:
        return buffer
    B, H, _, D = buffer.shape
    more = -(-max(rows, width) // step) * step - width
    return mx.concatenate([buffer, mx.zeros((B, H, more, D), buffer.dtype)], axis=2)


def row_bucket(n):
    """The row count a forward of n nodes runs with on GPU: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


_CACHED_ARRAYS = {}


def cached_array(a):
    """A small host array as an mx array, kept for the next round that needs the same one: on a
    GPU each host array costs a copy that waits on the queue, and rounds repeat their shapes."""
    key = (a.dtype.str, a.shape, a.tobytes())
    hit = _CACHED_ARRAYS.get(key)
    if hit is None:
        if len(_CACHED_ARRAYS) >= 512:
            _CACHED_ARRAYS.clear()
        hit = _CACHED_ARRAYS[key] = mx.array(a)
    return hit


def _filler_block(n, m, p):
    """bool [n + p, m + p]: True on the filler rows' own columns only."""
    block = np.zeros((n + p, m + p), bool)
    block[np.arange(n, n + p), np.arange(m, m + p)] = True
    return cached_array(block)


_STAND_INS = {"append": _AppendLayer, "rotating": _RotatingLayer, "arrays": _ArraysLayer}


class TreeRound:
    """Forwards of tree nodes over committed caches, then `commit` of the accepted nodes.

    The caches are only read until `commit`, except that append-kind caches hold the round's
    K/V after the history (invisible to later rounds: commit resets their offset).
    """

    def __init__(self, model, caches, capture=(), compiled=False):
        self.model = model
        # `compiled`: whole-buffer forwards run compiled (`_run_compiled`); the loop asks it for
        # its target. Not by default: a drafter's model may keep Python state between calls (a
        # head's pending hidden rows) that a trace would bake in
        self.compiled = compiled
        self.pad_keys = pad_keys_default()
        self.width = None  # key columns of append-kind layers when whole buffers are read
        install(model)
        self.capture = tuple(capture)
        self.hidden = None  # [n, len(capture) * H]: the last forward's captured layer outputs
        self.caches = caches
        self._before = snapshot(caches)  # what abort() restores
        self.aborted = False  # put back: rows a commit wrote in place are dead, not to be read again
        self.kinds = [cache_kind(c) for c in caches]
        unknown = sorted({type(c).__name__ for c, k in zip(caches, self.kinds) if k not in _STAND_INS})
        if unknown:
            raise ValueError(
                f"no tree implementation for cache type(s) {unknown}; "
                "check the target with mlx_treespec.support.tree_support(model)"
            )
        self.base = committed_offset(caches)
        self.depths = np.zeros(0, np.int64)
        self.parents = np.zeros(0, np.int64)
        self.chain = True  # every round node so far is the child of the one before it
        self._rows = None  # device visibility rows of the current forward (forward_rows)
        self._dev_depths = []  # (first node, device depths) of each forward_rows call
        self._ancestors = None
        self.all_append = all(k == "append" for k in self.kinds)
        # whole-buffer forwards pad their rows to a power of two (`row_bucket`) over these kinds:
        # filler rows are masked out of attention and are leaves of their own in a recurrent
        # layer's scan; a rotating layout has no place for them
        self.pads_rows = all(k in ("append", "arrays") for k in self.kinds)
        self.stand_ins = None
        self._pad = 0  # filler rows of the current forward (GPU: row counts are powers of two)
        self._kernel_fits = None  # whether the caches' attention may take the kernel (`_kernel`)
        self._masks = {}
        self._layouts = {}

    @property
    def size(self):
        return len(self.depths)

    @property
    def ancestors(self):
        """bool [m, m]: row j is True at j's ancestors among the round nodes and at j."""
        if self._ancestors is None or len(self._ancestors) != self.size:
            if (self.parents == -2).any():
                raise ValueError("this round has nodes added with forward_rows: no host ancestry")
            self._ancestors = ancestors_of(self.parents)
        return self._ancestors

    def _add(self, parents):
        parents = np.asarray(parents, np.int64)
        m0, n = self.size, len(parents)
        if (self.depths < 0).any():
            raise ValueError("this round has nodes with device-only depths: add nodes with forward_rows")
        if ((parents < -1) | (parents >= m0 + np.arange(n))).any():
            raise ValueError(f"round parents must be -1 or index an earlier node, got {parents}")
        self.chain = self.chain and bool((parents == np.arange(m0, m0 + n) - 1).all())
        self.parents = np.concatenate([self.parents, parents])
        self.depths = depths_of(self.parents)
        self._masks, self._layouts = {}, {}
        return m0

    def fit(self, draft, held=None):
        """The draft as this round's verify runs it. On GPUs a forward's rows are padded to a
        power of two (`row_bucket`): where the held tokens would push the draft into the next
        bucket, its last nodes are dropped instead (a prefix of a parents-first numbering is a
        tree: fewer candidates, the same tokens out). Drafts whose commit reads their nodes
        (`state`, `fetch`) and layouts without host parents stay whole."""
        p, n = (0 if held is None else held.shape[0]), draft.size
        if not (p and self.pad_keys and self.all_append) or draft.state is not None or draft.fetch \
                or draft.layout.parents is None:
            return draft
        rows = row_bucket(n)
        if p + n <= rows or p >= rows:
            return draft
        parents = draft.layout.parents[: rows - p]
        layout = Layout.fixed(parents) if draft.layout.device is not None else Layout.host(parents)
        return dataclasses.replace(draft, tokens=draft.tokens[: rows - p], layout=layout)

    def verify(self, draft, held=None):
        """The target's forward of a round: `held` (mx tokens accepted earlier and not in the
        caches yet, or None) as a chain, the draft tree hung from the last of them. Returns the
        tree's logits and its nodes' round depths (mx int32). No host array is made here for a
        layout the device holds: on a GPU one would wait for the queued draft."""
        p, n = (0 if held is None else held.shape[0]), draft.size
        self._held = p
        tokens = mx.concatenate([held, draft.tokens]) if p else draft.tokens
        layout = draft.layout
        if layout.device is not None and self.all_append:  # the topology stays on the device
            _, depths, rows = layout.device
            if p:
                depths = mx.concatenate([mx.arange(p, dtype=mx.int32), depths.astype(mx.int32) + p])
                lead = np.concatenate([np.tril(np.ones((p, p), bool)), np.zeros((p, n), bool)], axis=1)
                rows = mx.concatenate([cached_array(lead), mx.concatenate(
                    [mx.ones((n, p), mx.bool_), rows], axis=1)], axis=0)
            logits = self.forward_rows(tokens, depths, rows)
        else:
            parents = layout.host_parents()
            if p:
                parents = np.concatenate([np.arange(p) - 1, np.where(parents < 0, p - 1, parents + p)])
            logits = self.forward(tokens, parents)
            depths = cached_array(self.depths.astype(np.int32))
        if self.hidden is not None:
            self.hidden = self.hidden[p:]
        return (logits[p:], depths[p:]) if p else (logits, depths)

    def commit(self, path, tokens, rerun=True):
        """Keep the held lead and the tree's accepted `path` (numpy, root first); returns the
        tokens the caches did not keep (mx, or None), to lead the next round's forward.

        Over append caches with `rerun`, only the leading run of kept nodes already at
        consecutive positions stays (a trim: no K/V row moves); the rest of the path is handed
        back to be re-run, which costs less than a gather per layer (verify cost is flat in
        rows). Otherwise the whole path is kept: a gather (quantized KV), a replay (rotating),
        the chain recurrence (GatedDeltaNet)."""
        p = getattr(self, "_held", 0)
        keep = np.concatenate([np.arange(p), p + np.asarray(path, np.int64)])
        run = leading_run(keep) if rerun and self.all_append else len(keep)
        self.keep(keep[:run])
        nodes = (keep[run:] - p).tolist()  # tree nodes: the held lead is always kept
        return mx.concatenate([tokens[i : i + 1] for i in nodes]) if nodes else None

    def abort(self):
        """Put every cache back as this round found it (a round that raised lands nowhere)."""
        self.aborted = True
        restore(self.caches, self._before)

    def forward(self, tokens, parents):
        """Run nodes `tokens` (mx int [n]) with round parents `parents`; returns logits [n, V]."""
        first = self._add(parents)
        self._new = slice(first, self.size)
        self._rows = None
        if self.all_append and self.chain and (not self.pad_keys or len(parents) == 1) and (
                len(parents) == 1 or rows_are_steps(self.model)):
            # Every node sees everything before it: the plain causal forward is the same forward.
            # (One-token attention takes any key length without a new kernel plan.)
            with capturing(self.model, self.capture) as cap:
                out = self.model(tokens[None], cache=self.caches)[0]
                self.hidden = cap.hidden()
            return out
        return self._run(tokens, first)

    def forward_rows(self, tokens, depths, rows):
        """Run nodes whose topology is known on the device only: `rows` is bool
        [n, size + n] over the round's nodes (themselves included); `depths` is their round
        depth, one int for all or an mx int array [n].

        A drafter that ranks on the device calls this, and so does the round loop for its
        tree, so no host sync sits between drafting and verifying. Append-kind caches only
        (the rotating layout and the recurrent fork need the ancestry on the host).
        """
        if not self.all_append:
            raise ValueError("forward_rows needs append-kind caches; use forward with parents")
        n = tokens.shape[0]
        first = self.size
        if isinstance(depths, mx.array):
            depths = depths.astype(mx.int32)
            host = np.full(n, -1, np.int64)  # not on the host
        else:
            host = np.full(n, depths, np.int64)
            depths = mx.full((n,), int(depths), mx.int32)
        self.parents = np.concatenate([self.parents, np.full(n, -2, np.int64)])  # not on the host
        self.depths = np.concatenate([self.depths, host])
        self._dev_depths.append((first, depths))
        self.chain = False
        self._masks, self._layouts = {}, {}
        self._new = slice(first, self.size)
        self._rows = rows
        return self._run(tokens, first, self.base + depths)

    def _device_depths(self, m):
        """Round depths of nodes [0, m) as an mx array (device depths where the host has none).
        Built only when asked (windowed masks)."""
        parts, at = [], 0
        for first, depths in self._dev_depths:
            if first > at:
                parts.append(cached_array(self.depths[at:first].astype(np.int32)))
            parts.append(depths)
            at = first + depths.shape[0]
        if m > at:
            parts.append(cached_array(self.depths[at:m].astype(np.int32)))
        return mx.concatenate(parts)[:m] if len(parts) > 1 else parts[0][:m]

    def _run(self, tokens, first, positions=None):
        n = self.size - first
        self.width, self._pad = None, 0
        if self.pad_keys:
            # Whole buffers, and a power-of-two row count: the shapes a GPU kernel meets repeat,
            # so drafts of varying size never pay for a new plan (on the H200 a hybrid's verify
            # of a row count new to its key width cost ~300 ms: cuDNN builds a graph per shape)
            total = row_bucket(n) if self.pads_rows else n
            widths = {reserve(c, total) for c, k in zip(self.caches, self.kinds) if k == "append"}
            self.width = widths.pop() if len(widths) == 1 else None
            if self.width is not None and self.pads_rows:
                self._pad = total - n
        if self.stand_ins is None:
            # stand-ins see the round through a weak proxy: no cycle keeps a round's masks alive
            rnd = weakref.proxy(self)
            self.stand_ins = [_STAND_INS[k](c, rnd) for c, k in zip(self.caches, self.kinds)]
        parents = None  # the round's parents for recurrent layers (host topology known)
        if positions is None:
            positions = self.base + cached_array(self.depths[self._new].astype(np.int32))
            parents = self.parents[self._new]
        pad = self._pad
        if pad:  # filler rows: they see the history and themselves; no real row sees them
            tokens = mx.concatenate([tokens, mx.zeros((pad,), tokens.dtype)])
            positions = mx.concatenate([positions, mx.full((pad,), self.base, mx.int32)])
            if parents is not None:  # recurrent layers: children of the committed state
                parents = np.concatenate([parents, np.full(pad, -1, np.int64)])
        try:  # inside: whatever raises, `finally` leaves no later forward these parents
            if parents is not None:
                _CTX.parents, _CTX.first = parents, first
            if _CTX.parents is not None and first == 0 and "arrays" in self.kinds:
                from .gdn import tree_plan

                _CTX.parents = tree_plan(_CTX.parents)  # one plan (host tables) for every recurrent layer
            out = self._run_compiled(tokens, positions, n) if self._compilable() else None
            if out is None:
                out = self._run_eager(tokens, positions, n)
        finally:
            _CTX.parents, _CTX.first = None, 0
            if pad:  # the next forward of this round writes over the filler K/V and scans
                for c, kind in zip(self.caches, self.kinds):
                    if kind == "append":
                        c.offset -= pad
                if not self.all_append:  # recurrent layers' scans
                    for stand_in in self.stand_ins or ():
                        if isinstance(stand_in, _ArraysLayer):
                            stand_in.keep_first(self.size)
        return out[:n] if pad else out

    def _run_eager(self, tokens, positions, n):
        try:  # inside: a failure setting up must not leave a later forward these positions
            _CTX.positions = positions
            if self._kernel():
                _CTX.attend = (self._append_mask(None), self._bounds()[1:], False)
            with capturing(self.model, self.capture) as cap, joining.running():
                out = self.model(tokens[None], cache=self.stand_ins)[0]
                self.hidden = cap.hidden(n)
        finally:
            _CTX.positions = _CTX.attend = None
        return out

    def _kernel(self):
        """Attention through the tree-attention kernel: whole buffers and an additive mask (a GPU)."""
        if self.width is None or self._additive_dtype() is None:
            return False
        if self._kernel_fits is None:  # the caches' variants: once a round, not once a forward
            self._kernel_fits = kernel_fits([c.keys for c, k in zip(self.caches, self.kinds) if k == "append"])
        return self._kernel_fits

    def _bounds(self):
        """(write offset, hist, end) of this forward (`whole_buffer_forward`'s `start`)."""
        offset = next(c.offset for c, k in zip(self.caches, self.kinds) if k == "append")
        return cached_array(np.array([offset, self.base, self.base + self.size + self._pad], np.int32))

    def _compilable(self):
        """Whole-buffer forwards (GPU) over plain KV caches (not quantized) run compiled."""
        return self.compiled and self.width is not None and all(
            type(c).__name__ == "KVCache" and c.keys is not None for c in self.caches)

    def _run_compiled(self, tokens, positions, n):
        """The forward through `compiled_forward` (checked against this round's eager forward);
        returns None where the eager path runs."""
        mask = self._append_mask(None)
        offset = self.caches[0].offset
        start = self._bounds()
        res = compiled_forward(self.model, self.capture, n, (
            tokens, positions, mask, start, [c.keys for c in self.caches], [c.values for c in self.caches]),
            lambda: (self._run_eager(tokens, positions, n), self.hidden, [c.keys for c in self.caches],
                     [c.values for c in self.caches]), kernel=self._kernel())
        if res is None:
            return None
        (out, hidden, *bufs), trusted = res
        if not trusted:  # the eager forward ran (and wrote the caches)
            return out
        for i, c in enumerate(self.caches):
            c.keys, c.values = bufs[0][i], bufs[1][i]
            c.offset = offset + tokens.shape[0]
            # abort puts back the offset; rows before it are the same in the new buffers, and the
            # old ones are left to the graph alone
            self._before.attributes[i]["keys"], self._before.attributes[i]["values"] = c.keys, c.values
        self.hidden = hidden
        return out

    def _append_mask(self, window):
        mask = self._masks.get(window)
        if mask is None:
            tree = self._rows if self._rows is not None else cached_array(self.ancestors[self._new])
            hist, n, p = self.base, tree.shape[0], self._pad
            if p:  # filler rows see the history and themselves; no real row sees them
                tree = mx.pad(tree, ((0, p), (0, p))) | _filler_block(n, tree.shape[1], p)
            tail = 0 if self.width is None else self.width - hist - self.size - p
            parts = [mx.ones((n + p, hist), mx.bool_), tree]
            mask = mx.concatenate(parts + ([mx.zeros((n + p, tail), mx.bool_)] if tail else []), axis=1)
            if window is not None:  # depths on the device: forward_rows may have no host copy
                depths = self._device_depths(self.size)
                qpos = self.base + depths[self._new]
                kpos = mx.concatenate([mx.arange(hist), self.base + depths])
                near = (qpos[:, None] - kpos[None, :]) < window
                # filler rows sit at the committed offset: the window never hides their keys
                near = mx.pad(near, ((0, p), (0, mask.shape[1] - near.shape[1])), constant_values=True)
                mask = mask & near
            dtype = self._additive_dtype()
            if dtype is not None:
                mask = mx.where(mask, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
            self._masks[window] = mask
        return mask

    def _additive_dtype(self):
        """The dtype of an additive mask, where the verify should get one (else None).

        On a GPU, MLX's fused attention takes additive masks only: each layer would convert a
        boolean mask again, which at long context costs more than the attention itself
        (bench/RESULTS.md, 1d). One additive mask per round, in the keys' dtype, serves every
        layer. On CPU the boolean mask stays: its arithmetic is plain decoding's, bitwise.
        """
        if not self.pad_keys:
            return None
        for c, kind in zip(self.caches, self.kinds):
            if kind == "append" and type(c).__name__ == "KVCache" and c.keys is not None:
                return c.keys.dtype
        return None

    @staticmethod
    def _rotating_state(inner):
        return (inner.offset, inner._idx, 0 if inner.keys is None else inner.keys.shape[2],
                inner.keep, inner.max_size, inner.step)

    def _rotating_order(self, inner):
        """The key order only (any window): reuse the layout the mask request already built."""
        state = self._rotating_state(inner)
        for (s, _), (order, _) in self._layouts.items():
            if s == state:
                return order
        return self._rotating(inner, None)[0]

    def _rotating(self, inner, window):
        state = self._rotating_state(inner)
        key = (state, window)
        hit = self._layouts.get(key)
        if hit is None:
            order, visible = rotating_layout(state, self.depths, self.ancestors, window=window)
            hit = (mx.array(order.astype(np.int32)), mx.array(visible[self._new]))
            self._layouts[key] = hit
        return hit

    def keep(self, keep):
        """Keep round nodes `keep` (a root path, in depth order); drop every other node.

        Every layer's new state is prepared before any is written (the GatedDeltaNet replays,
        the rotating replays on fresh buffers), and a failure while writing puts back what the
        round found: a commit lands whole or not at all."""
        keep = np.asarray(keep, np.int64)
        writes = []
        try:
            for i, (cache, kind) in enumerate(zip(self.caches, self.kinds)):
                if kind == "append":
                    writes.append(lambda cache=cache: commit_appended(cache, self.base, keep))
                elif self.stand_ins is not None:  # nothing was written before commit
                    stand_in = self.stand_ins[i]
                    if kind == "arrays" and stand_in.payload is not None:
                        from .gdn import gdn_layer_commit

                        writes.append(gdn_layer_commit(stand_in.layer, cache, stand_in.payload, keep, apply=False))
                    elif kind == "rotating" and stand_in.keys is not None:
                        writes.append(lambda cache=cache, s=stand_in: commit_rotating(cache, s.keys, s.values, keep))
            for write in writes:
                write()
        except BaseException:
            self.abort()
            raise
