"""Drafters: what proposes a round's tree (the interface is `mlx_treespec.draft.Drafter`).

- `model.ModelDrafter`: a small mlx-lm model, chains and EAGLE-2 trees;
- `lookup.LookupDrafter`, `suffix.SuffixDrafter`: model-free, from the text itself;
- `merged.MergedDrafter`: a draft model's tree and a lookup chain under one root;
- `dflash.DFlashDrafter`: a DFlash block drafter over the target's hidden states, its chain and
  DDTree's best-first tree.
"""
import functools

import numpy as np
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..draft import Draft, Layout
from ..tree import MAX_NODES, check_int


class GatedMLP(nn.Module):
    """The SwiGLU MLP of the heads' layers (DFlash, EAGLE-3): the published weight names."""

    def __init__(self, dim, hidden_dim, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


@functools.lru_cache(maxsize=64)
def aranges(*sizes):
    """0..n-1 (int32) for each size, made once per size: a drafter's queued draft reads them
    every round (a head's columns, slots, steps, top-k; a DFlash chain's draw depths), and one
    made each round is a kernel launch of its own in a host-bound loop."""
    return tuple(mx.array(np.arange(n, dtype=np.int32)) for n in sizes)


def check_budget_depth(budget, max_depth):
    """The bounds every model-free drafter shares: both count draft nodes, root excluded."""
    check_int(budget, "budget (draft nodes without the root)", 0, MAX_NODES - 1)
    check_int(max_depth, "max_depth", 0, MAX_NODES - 1)


def check_branches(branches):
    if branches is not None:
        check_int(branches, "branches (or None)", 1)


def host_draft(root, tree, budget, depth):
    """A model-free drafter's host tree as a Draft (the root alone where it holds no node)."""
    if tree.size == 1:
        return Draft.root_only(root)
    return Draft(mx.array(tree.tokens.astype(np.uint32)), Layout.host(tree.parents), budget=budget, depth=depth)


def host_probe_parents(branches, budget, max_depth):
    """The largest layout a model-free drafter sends: a chain with `branches=1`, else a tree of
    its whole budget."""
    from ..probe import representative_tree_parents
    from ..tree import chain_parents

    if branches == 1:
        return chain_parents(min(budget, max_depth) + 1)
    return representative_tree_parents(2, max_depth, budget)


def vocab_rows(project, ids):
    """Some outputs of `project` (an nn.Linear or QuantizedLinear, or an Embedding's or
    QuantizedEmbedding's `as_linear`: an lm_head, tied or not) as a function of x: a matmul over
    those rows of its weight (and scales, biases). `ids`: an int n (the first n rows: slices
    sharing its memory) or an array of row ids (a copy of those rows)."""
    owner = getattr(project, "__self__", project)  # a bound as_linear: its embedding
    if not isinstance(owner, (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)):
        raise ValueError(f"cannot narrow this lm_head ({type(owner).__name__}, e.g. one sharded over "
                         "processes) to a draft vocabulary: drop --draft-vocab")
    prefix = isinstance(ids, (int, np.integer))
    pick = (lambda a: a[:int(ids)]) if prefix else (lambda a: mx.take(a, mx.array(ids), axis=0))
    rows = {k: pick(owner[k]) for k in ("weight", "scales", "biases", "bias") if k in owner}
    mx.eval(list(rows.values()))
    if "scales" in rows:
        gs, bits, mode = owner.group_size, owner.bits, getattr(owner, "mode", "affine")

        def matmul(x):
            y = mx.quantized_matmul(x, rows["weight"], scales=rows["scales"], biases=rows.get("biases"),
                                    transpose=True, group_size=gs, bits=bits, mode=mode)
            return y + rows["bias"] if "bias" in rows else y
        return matmul
    if "bias" in rows:
        return lambda x: x @ rows["weight"].T + rows["bias"]
    return lambda x: x @ rows["weight"].T


def dequantize_linears(module):
    """The module's quantized linear layers as float layers holding the same values.

    A drafter ships quantized (small) and runs as float: its numerics are the quantized
    weights', and MLX's CPU matmul over quantized weights is ~10x slower at draft sizes than a
    float one. The dtype is the module's norms' (the unquantized parameters')."""
    swaps = []
    for path, m in module.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits,
                              mode=getattr(m, "mode", "affine"))  # (mxfp4 / nvfp4 / mxfp8 too)
            lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            lin.weight = w
            if "bias" in m:
                lin.bias = m.bias
            swaps.append((path, lin))
    if swaps:
        floats = [v.dtype for k, v in tree_flatten(module.parameters())
                  if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases"))]
        module.update_modules(tree_unflatten(swaps))
        for _, lin in swaps:
            lin.set_dtype(floats[0] if floats else mx.float16)
        mx.eval(module.parameters())
    return module


def text_model(target):
    """An mlx-lm model's text model: `target.language_model` where there is one (qwen3_5, VLM
    wrappers), else the model itself."""
    lm = getattr(target, "language_model", None)
    return lm if isinstance(lm, nn.Module) else target


def target_io(target):
    """(text model args, embedding module, lm_head callable) of an mlx-lm model (of its
    `text_model`); lm_head is its `lm_head`, or the embedding as a linear map when tied."""
    lm = text_model(target)
    inner = getattr(lm, "model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    if embed is None:
        embed = getattr(lm, "embed_tokens", None)
    if embed is None:
        raise ValueError(f"cannot find the token embedding of {type(target).__name__} "
                         "(looked for .model.embed_tokens): pass an mlx-lm model")
    args = getattr(lm, "args", None) or getattr(target, "args", None)
    tied = bool(getattr(args, "tie_word_embeddings", False)) if args is not None else False
    head = getattr(lm, "lm_head", None)
    if head is None or tied:
        head = embed.as_linear
    elif getattr(lm, "sharding_group", None) is not None and "Sharded" in type(head).__name__:
        # mlx-lm's shard splits an untied head over the vocabulary (qwen3_5) and gathers its
        # output in the model's own call: a drafter binding it must gather too, or each process
        # would draft from its own slice of the vocabulary
        from mlx_lm.models.base import gather_last_axis

        sliced, group = head, lm.sharding_group
        head = lambda x: gather_last_axis(sliced(x), group)  # noqa: E731
    return args, embed, head
