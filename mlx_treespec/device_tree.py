"""Trees from device values alone, for rounds queued ahead (queued.py): DDTree's best-first
build (`best_first`) and a tree round's walk (`walk`).

A queued round is host-bound at small model sizes: MLX pays host time for every kernel it
launches, and both jobs are a few dozen small ops each (a beam per depth, a rank of the beams,
an ancestor product). On a GPU each is one thread of one kernel instead
(`metal_kernels/ddtree_build.inc`, `tree_walk.inc`: one source for the Metal kernel and its CUDA
twin). The MLX-ops forms (`ddtree_ops`, `walk_ops`) run on the CPU and are each kernel's
reference: a kernel variant is used only after it agreed with them on a random problem (the
same root paths; the same count and path), else the ops run (a warning says so).
"""
import functools
import warnings

import numpy as np
import mlx.core as mx

from .attention import kernel_backend, kernel_text
from .tree import ancestors_of, depths_of

__all__ = ["best_first", "walk", "ddtree_ops", "walk_ops", "prefixes", "top_k"]

_HEADER = {"metal": "#define TS_NEG_INF (-INFINITY)\n",
           "cuda": "#define TS_NEG_INF (-cuda::std::numeric_limits<float>::infinity())\n"}


# A top-k of at most this many is taken by argmaxes, one pass over the row each; a larger one by
# argpartition. Why: MLX's argpartition sorts whole rows on a GPU, and a draft's rows are a
# vocabulary wide: over 128k-250k ids, 10 rows' runners-up cost 190-300 us that way and 80-110
# by argmaxes (bench/RESULTS.md, "Shorter head trees, and a step's runners-up by argmaxes", in git
# history: `git show d557c13:bench/RESULTS.md`).
ARGMAX_TOP_K = 8


@functools.lru_cache(maxsize=None)
def _columns(V):
    return mx.arange(V, dtype=mx.int32)


def _ranked(x, columns, skip):
    """x as a top-k ranks it: NaN and -inf after every number, a skipped id below them all."""
    key = mx.where(mx.isnan(x) | (x == -mx.inf), mx.array(mx.finfo(x.dtype).min, x.dtype), x)
    return key if skip is None else mx.where(columns == skip[..., None], -mx.inf, key)


@functools.lru_cache(maxsize=None)
def _argmax_top_k(k, skips):
    def best(x, columns, *skip):
        key = _ranked(x, columns, skip[0] if skip else None)
        ids = []
        for j in range(k):
            ids.append(mx.argmax(key, axis=-1, keepdims=True))
            if j < k - 1:  # (a taken id goes below every other: no id repeats)
                key = mx.where(columns == ids[-1], -mx.inf, key)
        return mx.concatenate(ids, axis=-1)

    return mx.compile(best)


def top_k(x, k, skip=None, ordered=False):
    """Each row's best k entries of x [..., V] (k <= V, less one with `skip`): (ids uint32
    [..., k], their values), NaN and -inf after every number. Up to ARGMAX_TOP_K they come best
    first, ties to the lower id; past it in argpartition's order, or best first where `ordered`
    (a sort of the k more: DDTree's build, on every queued round, ranks them itself). `skip`
    [...]: an id per row left out (a lane's own token, whose runners-up are wanted)."""
    columns = _columns(x.shape[-1])
    skip = None if skip is None else skip.astype(mx.int32)
    if k <= ARGMAX_TOP_K:
        ids = _argmax_top_k(k, skip is not None)(x, columns, *(() if skip is None else (skip,)))
    else:
        key = -_ranked(x, columns, skip)
        ids = mx.argpartition(key, kth=k - 1, axis=-1)[..., :k]
        if ordered:
            ids = mx.take_along_axis(ids, mx.argsort(mx.take_along_axis(key, ids, axis=-1), axis=-1), axis=-1)
    return ids, mx.take_along_axis(x, ids, axis=-1)


def prefixes(D, K):
    """How many prefixes D positions of K candidates make (capped: only whether it reaches a
    budget matters)."""
    total, level = 0, 1
    for _ in range(D):
        level = min(level * K, 1 << 20)
        total += level
    return total


def ddtree_ops(root, logprobs, budget, topk):
    """DDTree's tree (`builders.best_first_tree`'s node set) in MLX ops: root mx uint32 [1],
    logprobs [D, V] float32 (position k's marginals, k = 1..D). Returns (tokens, parents,
    depths, ancestor-or-self rows) of the root and `budget` nodes (fewer where the top `topk`
    of D positions make fewer prefixes), numbered as `keep_best` does.

    Why it is the same set: a prefix scores no more than its parent, so each of the `budget`
    best prefixes of depth d extends one of the `budget` best of depth d - 1. A beam of
    `budget` per depth (a selection over beam x top-k each) therefore holds every prefix of
    the best `budget`, and `keep_best` ranks the beams' union (ties: the shallower and earlier
    candidate first, where the host breaks them by rank tuple; a tie changes acceptance, never
    exactness)."""
    from .drafters.model import keep_best
    from .verify import cached_array

    D, V = logprobs.shape
    D = min(D, budget)
    K = min(topk, budget, V)
    lp = mx.where(mx.isnan(logprobs[:D]), -mx.inf, mx.minimum(logprobs[:D], 0))  # builders' clamp
    ids, top = top_k(lp, K)  # [D, K]
    # candidate ids: depth 1's K ranks, then each deeper depth's beam, in creation order
    scores, picks, beam, first = [top[0]], [], top[0], [0, K]
    for d in range(1, D):
        cand = (beam[:, None] + top[d][None, :]).reshape(-1)  # each beam prefix extended by each rank
        pick = mx.argpartition(-cand, kth=budget - 1)[:budget] if cand.shape[0] > budget else \
            mx.arange(cand.shape[0], dtype=mx.int32)
        beam = cand[pick]
        scores.append(beam)
        picks.append(pick.astype(mx.int32))
        first.append(first[-1] + pick.shape[0])
    # a pick p at depth d + 1 extends beam entry p // K of depth d with rank p % K (one gather)
    depths = [np.full(first[d + 1] - first[d], d + 1, np.int32) for d in range(D)]
    tokens, parents = ids[0], mx.full((K,), -1, mx.int32)
    if picks:
        pick = mx.concatenate(picks)
        at = cached_array(np.concatenate(depths[1:]) - 1)  # each pick's depth - 1
        bases = cached_array(np.array(first[:-2], np.int32))  # where depth d's candidates start
        tokens = mx.concatenate([tokens, ids.reshape(-1)[at * K + pick % K]])
        parents = mx.concatenate([parents, bases[at - 1] + pick // K])
    _, tree_parents, tree_depths, tree_tokens, anc = keep_best(
        root, tokens, mx.concatenate(scores), parents, np.concatenate(depths), min(budget, first[-1]))
    return tree_tokens, tree_parents, tree_depths, anc


def walk_ops(choice, tokens, parents, depths, visible):
    """The walk of a tree round in MLX ops: a node is accepted where it and each of its
    ancestors is the target's choice after its parent; the deepest accepted node ends the path
    (siblings hold distinct tokens, so it is unique). Returns (count: the path's nodes, root
    included, mx int32; every node ordered path first, in depth order; `choice` in that order)."""
    T = tokens.shape[0]
    agrees = (tokens == choice[mx.maximum(parents, 0)]) | (parents < 0)
    accepted = (visible.astype(mx.float32) @ (1 - agrees.astype(mx.float32))) == 0
    leaf = mx.argmax(mx.where(accepted, depths, -1))
    path = mx.argsort(mx.where(visible[leaf], depths, T + mx.arange(T, dtype=depths.dtype)))
    return depths[leaf] + 1, path, choice[path]


# ------------------------------------------------------------------ the kernels


@functools.lru_cache(maxsize=None)
def _kernel(backend, which):
    """The build or walk kernel of a backend ('metal', 'cuda')."""
    name, inputs, outputs = {
        "build": ("ddtree_build", ["lp", "ids", "root"], ["tokens", "parents", "depths", "anc"]),
        "walk": ("tree_walk", ["choice", "tokens", "parents"], ["count", "path", "emitted"]),
    }[which]
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(name=name, input_names=inputs, output_names=outputs, source=kernel_text(name + ".inc"),
                header=_HEADER[backend])


def run_build(backend, lp, ids, root, N, **kw):
    """The build kernel on each position's K candidates (lp float32 [D, K], ids uint32 [D, K])."""
    D, K = lp.shape
    T = N + 1
    return _kernel(backend, "build")(
        inputs=[lp, ids, root], template=[("D", D), ("K", K), ("N", N)], grid=(1, 1, 1),
        threadgroup=(1, 1, 1), output_shapes=[(T,), (T,), (T,), (T, T)],
        output_dtypes=[mx.uint32, mx.int32, mx.int32, mx.bool_], **kw)


def run_walk(backend, choice, tokens, parents, **kw):
    T = tokens.shape[0]
    count, path, emitted = _kernel(backend, "walk")(
        inputs=[choice, tokens, parents], template=[("T", T)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
        output_shapes=[(1,), (T,), (T,)], output_dtypes=[mx.int32, mx.int32, mx.uint32], **kw)
    return count.reshape(()), path, emitted


def _backend():
    return kernel_backend()


def _warn(what, e):
    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    warnings.warn(f"mlx_treespec: the {what} kernel is not used ({msg}); queued tree rounds run "
                  "MLX ops instead (more host time a round)", RuntimeWarning, stacklevel=4)


def _paths(tokens, parents):
    tokens, parents = np.array(tokens).tolist(), np.array(parents).tolist()
    out = set()
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.add(tuple(path))
    return out


_compile = mx.compile  # (tests run the kernels' glue eagerly through the emulated bodies)


@functools.lru_cache(maxsize=None)
def _build_fn(D, V, K, N, backend):
    """The compiled build for logprobs [D, V] on `backend` (None: no kernel): the kernel where it
    agreed with `ddtree_ops` on a random problem, else the ops."""

    def ops(root, logprobs):
        return ddtree_ops(root, logprobs, N, K)

    if backend is not None:
        def kern(root, logprobs):
            lp = mx.where(mx.isnan(logprobs), -mx.inf, logprobs)
            ids, top = top_k(lp, K)
            return run_build(backend, top, ids, root, N)

        try:
            rng = np.random.default_rng(D * 131 + K)
            x = rng.standard_normal((D, V)).astype(np.float32) * 3
            lp = mx.array(x - np.log(np.exp(x).sum(-1, keepdims=True)))
            root = mx.array([1], mx.uint32)
            got, want = kern(root, lp), ops(root, lp)
            parents = np.array(got[1])
            if _paths(got[0], parents) == _paths(want[0], want[1]) and \
                    np.array_equal(np.array(got[2]), depths_of(parents.astype(np.int64))) and \
                    np.array_equal(np.array(got[3]), ancestors_of(parents)):
                return _compile(kern)
            _warn("DDTree build", ValueError("its tree differs from the MLX-ops build"))
        except Exception as e:  # a build failure surfaces at eval time
            _warn("DDTree build", e)
    return _compile(ops)


@functools.lru_cache(maxsize=None)
def _walk_fn(T, backend):
    """The compiled walk of T nodes on `backend` (None: no kernel): the kernel where it agreed
    with `walk_ops` on random trees and choices, else the ops."""
    if backend is not None:
        def kern(choice, tokens, parents, depths, visible):
            return run_walk(backend, choice, tokens, parents)

        try:
            rng = np.random.default_rng(T)
            agree = True
            for _ in range(4):
                parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, T)], np.int64)
                tokens = rng.integers(0, 3, T).astype(np.uint32)
                choice = rng.integers(0, 3, T).astype(np.uint32)
                args = (mx.array(choice), mx.array(tokens), mx.array(parents.astype(np.int32)),
                        mx.array(depths_of(parents).astype(np.int32)), mx.array(ancestors_of(parents)))
                c0, p0, e0 = kern(*args)
                c1, p1, e1 = walk_ops(*args)
                n = c1.item()
                agree = agree and c0.item() == n and np.array_equal(np.array(p0)[:n], np.array(p1)[:n]) \
                    and np.array_equal(np.array(e0)[:n], np.array(e1)[:n])
            if agree:
                return _compile(kern)
            _warn("tree walk", ValueError("its path differs from the MLX-ops walk"))
        except Exception as e:
            _warn("tree walk", e)
    return _compile(walk_ops)


def best_first(root, logprobs, budget, topk):
    """DDTree's tree from device values alone (`ddtree_ops`' contract): one kernel on a GPU."""
    D, V = logprobs.shape
    D = min(D, budget)
    K = min(topk, budget, V)
    return _build_fn(D, V, K, min(budget, prefixes(D, K)), _backend())(root, logprobs[:D])


def walk(choice, tokens, parents, depths, visible):
    """A tree round's walk (`walk_ops`' contract): one kernel on a GPU."""
    return _walk_fn(tokens.shape[0], _backend())(choice, tokens, parents, depths, visible)
