"""Linear layers that read one input, run as one matmul in the library's forwards.

Queued rounds on a GPU are host-bound: every kernel a round launches costs host time, and a
matmul is the costliest launch (bench/RESULTS.md, "Joined projections"). An attention layer's
q, k and v projections read the same rows, as do an MLP's gate and up and a GatedDeltaNet
layer's input projections. `join` puts each such group's arrays side by side in one buffer and
makes every layer's own arrays views of its rows: the model keeps its parameters, their names
and values, its memory and its own forward, which mlx-lm's plain decoding runs unchanged.
Inside a library forward (`running`: the tree forwards of verify.py, a DFlash block) the
first layer of a group called on an input runs the joined matmul and each layer takes its own
columns of it; a layer called on another input runs the joined matmul over that one.

Each column is the same dot product as the layer's own: on CPU bit for bit (pinned by
`test_joined_forward_is_the_separate_forward`); a GPU's GEMM may tile a wider output otherwise,
which the exactness probe measures as it does a verify's row count.

A few rows run as matrix-vector products (`few_rows`): on a CUDA GPU MLX runs a one-row matmul
as a matrix-vector kernel and one of several rows as a cuBLASLt call, and each launched dearer
for the host than the same rows' products through `gather_mm` (single timings on an H100: 4
rows 97.6 against 21.1 us, one row 41.5 against 14.6; bench/RESULTS.md, "A chain step's linear
layers as products too"). A head's lane step is a few rows (one per lane), each through some
six linear layers, and a chain step one row; in a library forward a float layer over
1..`FEW_ROWS` rows runs one matrix-vector product a row instead, in one kernel
(`mx.gather_mm`), each row's arithmetic a one-row matmul's.
"""
import contextlib
import threading
import weakref

import numpy as np
import mlx.core as mx
import mlx.nn as nn

from .attention import kernel_backend

__all__ = ["GROUPS", "FEW_ROWS", "join", "arrays", "running", "held", "put_back", "joined_groups", "few_rows",
           "projected", "RowsLinear"]

# Layers that read one input, by attribute name, in output order: attention (mlx-lm's models,
# the heads, DFlash), SwiGLU MLPs, GatedDeltaNet's input projections (qwen3_5, qwen3_next)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
          ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), ("in_proj_qkvz", "in_proj_ba"))

_LEAVES = ("weight", "scales", "biases", "bias")  # a linear layer's arrays: one row per output
FEW_ROWS = 8  # the most rows a float linear layer runs as matrix-vector products (`few_rows`)
# the largest weight they run over: each row's product reads the whole weight, which stays in
# an H100's or H200's 50 MB L2 cache between the rows only where it is small; a larger one (an
# 8B model's layers, any real vocabulary's lm_head) is read once a row from memory, dearer than
# the launch it saves (not measured at those sizes: there the matmul stays; one row reads it
# once, as the matmul's own kernel does, but an 8B head's one-row steps were not measured either)
FEW_ROWS_BYTES = 8 << 20
_KINDS = (nn.Linear, nn.QuantizedLinear)


class _Memo(threading.local):
    """{id(group): (input, joined output)} while a library forward runs in this thread (None
    outside one): two threads generating at once keep their own."""

    outputs = None


_MEMO = _Memo()


class _Group:
    """One group's joined arrays (`joint`) and where each layer's columns start (`cuts`).
    `stale`: a layer's arrays were set since (its `__setitem__`), so the joint may differ.
    Its layers hold it; it holds them weakly, so a model it joined is freed when dropped, not
    when the garbage collector next runs (a head or DFlash drafter loaded per call)."""

    def __init__(self, owner, names):
        self.names, self.stale = names, False
        parts = [owner[n] for n in names]
        self._owner, self._parts = weakref.ref(owner), [weakref.ref(p) for p in parts]
        first = parts[0]
        self.leaves = [k for k in _LEAVES if k in first]
        self.quant = None if _base(first) is nn.Linear else \
            dict(group_size=first.group_size, bits=first.bits, mode=first.mode)
        self.joint = {k: mx.concatenate([p[k] for p in parts]) for k in self.leaves}
        mx.eval(self.joint)
        self.cuts = np.cumsum([0] + [p.weight.shape[0] for p in parts]).tolist()
        for i, (p, a, b) in enumerate(zip(parts, self.cuts[:-1], self.cuts[1:])):
            for k in self.leaves:
                dict.__setitem__(p, k, self.joint[k][a:b])  # a view: the layer's memory is the joint's
            _reclass(p, self, i)
        mx.eval([p.parameters() for p in parts])

    def __deepcopy__(self, memo):
        # (a copied model's layers get a group over the copies: a weak reference is copied as
        # itself, and would still name the original's)
        import copy

        new = memo[id(self)] = object.__new__(_Group)
        for k, v in self.__dict__.items():
            if k not in ("_owner", "_parts"):
                new.__dict__[k] = copy.deepcopy(v, memo)
        owner, parts = self.owner, self.parts
        new._owner = weakref.ref(copy.deepcopy(owner, memo)) if owner is not None else self._owner
        new._parts = [weakref.ref(copy.deepcopy(p, memo)) if p is not None else r for p, r in zip(parts, self._parts)]
        return new

    @property
    def owner(self):
        return self._owner()

    @property
    def parts(self):
        return [p() for p in self._parts]

    def intact(self):
        """Whether every layer is still in its place with the arrays it was joined with. (Not
        by array identity: a compiled call puts its implicit inputs back as new array objects.)"""
        owner = self.owner
        return not self.stale and owner is not None and all(
            p is not None and owner.get(n) is p for n, p in zip(self.names, self.parts))

    def matmul(self, x):
        """The group's output for rows x: each layer's output side by side (its own arithmetic:
        nn.Linear's addmm or matmul, nn.QuantizedLinear's quantized matmul and bias add; a few
        rows' products: `few_rows`)."""
        j = self.joint
        y = _products(x, j["weight"]) if self.quant is None and "bias" not in j else None
        if y is not None:
            return y
        if self.quant is None:
            return mx.addmm(j["bias"], x, j["weight"].T) if "bias" in j else x @ j["weight"].T
        y = mx.quantized_matmul(x, j["weight"], scales=j["scales"], biases=j.get("biases"), transpose=True,
                                **self.quant)
        return y + j["bias"] if "bias" in j else y

    def columns(self, i, x):
        """Layer i's columns of the group's output for x (run once per input)."""
        memo = _MEMO.outputs
        hit = memo.get(id(self))
        if hit is None or hit[0] is not x:
            hit = memo[id(self)] = (x, self.matmul(x))
        return hit[1][..., self.cuts[i] : self.cuts[i + 1]]


def _products_here(x, weight):
    """Whether `few_rows` runs x @ weight.T as products: float16 / bfloat16 on a CUDA GPU (one
    row runs a matrix-vector kernel there; CPU and Metal keep their matmul)."""
    return x.dtype in (mx.float16, mx.bfloat16) and weight.dtype == x.dtype and kernel_backend() == "cuda"


_PICKS = {}  # rows -> (each row's index, the weight's: 0), made once (a trace would launch them)


def few_rows(x, weight):
    """`x @ weight.T` (weight [N, K]) as one matrix-vector product a row, in one kernel
    (`mx.gather_mm`), where x holds 1..FEW_ROWS rows, the weight at most FEW_ROWS_BYTES and
    `_products_here`; else None (the caller runs its matmul)."""
    rows = x.size // x.shape[-1] if x.ndim >= 2 and x.shape[-1] else 0
    if (not 1 <= rows <= FEW_ROWS or weight.ndim != 2 or weight.nbytes > FEW_ROWS_BYTES
            or not _products_here(x, weight)):
        return None
    picks = _PICKS.get(rows)
    if picks is None:
        # (from host values: arrays that hold data, never a node of the trace that made them)
        picks = _PICKS[rows] = (mx.array(np.arange(rows, dtype=np.uint32)), mx.array(np.zeros(rows, np.uint32)))
    # (unsorted indices: MLX 0.32's CUDA gather_mm then runs one row as its matrix-vector kernel,
    # the arithmetic of a one-row matmul's, read from MLX's source; sorted, a grouped GEMM)
    y = mx.gather_mm(x.reshape(rows, 1, x.shape[-1]), weight.T[None], lhs_indices=picks[0], rhs_indices=picks[1],
                     sorted_indices=False)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _products(x, weight):
    """`few_rows` inside a library forward (`running`), else None: the one place the rule is
    asked, for a joined group, a layer in none and a tied lm_head alike."""
    return few_rows(x, weight) if _MEMO.outputs is not None else None


def projected(project, x):
    """`project(x)` for a head's lm_head: a tied target's (an Embedding's `as_linear`) runs a few
    rows as products inside a library forward; a linear layer is a RowsLinear already."""
    owner = getattr(project, "__self__", None)
    if type(owner) is nn.Embedding:
        y = _products(x, owner["weight"])
        if y is not None:
            return y
    return project(x)


class RowsLinear(nn.Linear):
    """A float linear layer in no joined group (o_proj, down_proj, an untied lm_head, a head's
    fc), re-classed by `join`: inside a library forward a few rows run as products."""

    def __call__(self, x):
        y = None if "bias" in self else _products(x, self["weight"])
        return nn.Linear.__call__(self, x) if y is None else y


def _part_call(self, x):
    group = self.__dict__.get("_treespec_group")
    if _MEMO.outputs is None or group is None or group.stale:  # outside a library forward, or its weights changed
        return super(type(self), self).__call__(x)   # since the joint was made (not joined again yet): its own
    return group.columns(self.__dict__["_treespec_column"], x)


def _stale(part, key):
    # an update, a load, an assignment or a removal of a layer's arrays: its joint is stale
    group = part.__dict__.get("_treespec_group")
    if group is not None and key in _LEAVES:
        group.stale = True


def _part_setitem(self, key, value):
    _stale(self, key)
    super(type(self), self).__setitem__(key, value)


def _part_delitem(self, key):
    _stale(self, key)
    super(type(self), self).__delitem__(key)


_CLASSES = {}


def _reclass(part, group, column):
    cls = _base(part)  # (a layer in no group at an earlier join: its own class again)
    if type(part) not in _CLASSES.values():
        sub = _CLASSES.get(cls)
        if sub is None:
            sub = _CLASSES[cls] = type(f"Joined{cls.__name__}", (cls,), {
                "__call__": _part_call, "__setitem__": _part_setitem, "__delitem__": _part_delitem})
        part.__class__ = sub
    part.__dict__["_treespec_group"] = group
    part.__dict__["_treespec_column"] = column


def _base(module):
    """A layer's class before `join` re-classed it."""
    cls = type(module)
    return cls.__mro__[1] if cls in _CLASSES.values() or cls is RowsLinear else cls


def _solo(model):
    """Re-class `model`'s float linear layers that joined no group (`RowsLinear`)."""
    for _, m in model.named_modules():
        if type(m) is nn.Linear:
            m.__class__ = RowsLinear


def _joinable(owner, names):
    """Whether `owner`'s layers `names` can be one matmul: all there, all float (or all
    quantized alike), one input width, one dtype per array, all with or all without a bias."""
    parts = [owner.get(n) for n in names]
    if not all(isinstance(p, nn.Module) for p in parts):
        return False
    kinds = {_base(p) for p in parts}
    if len(kinds) != 1 or kinds.pop() not in _KINDS:
        return False
    leaves = [tuple(k for k in _LEAVES if k in p) for p in parts]
    if len(set(leaves)) != 1:
        return False
    if any(len({(p[k].dtype, p[k].shape[1:]) for p in parts}) > 1 for k in leaves[0]):
        return False
    quant = {(getattr(p, "group_size", None), getattr(p, "bits", None), getattr(p, "mode", None)) for p in parts}
    return len(quant) == 1


def _groups(model):
    for _, module in model.named_modules():
        for names in GROUPS:
            if all(n in module for n in names) and _joinable(module, names):
                yield module, names


def join(model):
    """Join every group of `model` (`GROUPS`) whose layers can be one matmul, once; again where
    a group's layers changed since (new weights: its joint would be stale). A group joined for
    another model that shares the module (a layer-skip draft) is kept. Returns the groups."""
    groups = model.__dict__.get("_treespec_joined")
    if groups is not None and all(g.intact() for g in groups):
        return groups
    groups = []
    for module, names in _groups(model):
        group = module[names[0]].__dict__.get("_treespec_group")
        groups.append(group if group is not None and group.intact() else _Group(module, names))
    model.__dict__["_treespec_joined"] = groups
    _solo(model)
    arrays(model)
    return groups


def arrays(model):
    """The model's joined arrays: one list per model, updated in place by `join`, which the
    compiled verify takes as inputs, so a trace never runs a stale joint."""
    out = model.__dict__.setdefault("_treespec_joints", [])
    out[:] = [g.joint for g in model.__dict__.get("_treespec_joined", ())]
    return out


def held(model):
    """The joined arrays as they are now (a trace that raises leaves its placeholders in them:
    they are the compiled verify's inputs), for `put_back`."""
    return [(g, dict(g.joint)) for g in model.__dict__.get("_treespec_joined", ())]


def put_back(model, held):
    """The joined arrays `held` saved, after the layers' own arrays were put back (as they
    were joined: the groups are not stale)."""
    for g, joint in held:
        g.joint.clear()
        g.joint.update(joint)
        g.stale = False


def joined_groups(model):
    """(owner path, layer names) of each joined group of `model`."""
    paths = {id(m): p for p, m in model.named_modules()}
    return [(paths.get(id(g.owner), "?"), g.names) for g in model.__dict__.get("_treespec_joined", ())]


@contextlib.contextmanager
def running():
    """A library forward: joined layers run their group's matmul once per input. Nests (the
    outermost clears the outputs it kept)."""
    outer = _MEMO.outputs
    if outer is None:
        _MEMO.outputs = {}
    try:
        yield
    finally:
        if outer is None:
            _MEMO.outputs = None
