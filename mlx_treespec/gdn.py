"""GatedDeltaNet (recurrent) layers under a draft tree.

A draft tree is a parent list: ``parents[i] < i`` (topological order) and ``parents[i] == -1``
means node i hangs off the *committed* state (the cache). Running a recurrence over the
flattened tree would carry state from a node into its sibling; here node i always starts from
the state after its parent.

Pieces:

* host-side tree tables (pure numpy): depth levels, root paths, branch points, the kernel's
  scratch-slot schedule, the conv windows;
* :func:`tree_gated_delta_ops`: MLX-ops reference, depth level by depth level, calling
  mlx-lm's own ``_gated_delta_step_ops``; on CPU bitwise equal to ``gated_delta_ops`` run
  along every root-to-node path;
* one kernel body (``metal_kernels/gdn_tree.inc``) compiled as a Metal kernel and as a CUDA
  twin, and :func:`tree_gated_delta` which dispatches between kernel and reference;
* :func:`tree_conv1d`: the short causal depthwise conv over a tree;
* :func:`gdn_layer_tree_forward` / :func:`gdn_layer_commit`: a whole mlx-lm ``qwen3_5`` /
  ``qwen3_next`` GatedDeltaNet layer over a tree without touching its cache, and the commit of
  an accepted root path by replay.
"""
from __future__ import annotations

import functools
import heapq
import warnings
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import kernel_backend, kernel_text
from .tree import chain_parents, depths_of, preorder, root_path
from .tree import check_parents as _check_parents


def _load_mlx_lm_gated_delta():
    """mlx-lm's models/gated_delta.py. Importing ``mlx_lm`` pulls in transformers & co.; where
    that fails (e.g. a GPU image with other versions), load the file itself: it needs mlx only."""
    try:
        from mlx_lm.models import gated_delta

        return gated_delta
    except Exception:
        import importlib.util
        import os
        import sys

        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or not spec.submodule_search_locations:
            raise
        path = os.path.join(list(spec.submodule_search_locations)[0], "models", "gated_delta.py")
        name = "mlx_treespec._mlx_lm_gated_delta"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = mod
        mod_spec.loader.exec_module(mod)
        return mod


mlx_lm_gated_delta = _load_mlx_lm_gated_delta()
_gated_delta_step_ops = mlx_lm_gated_delta._gated_delta_step_ops
compute_g = mlx_lm_gated_delta.compute_g
normalize_qk = mlx_lm_gated_delta.normalize_qk

__all__ = [
    "DevicePlan",
    "check_parents",
    "TreePlan",
    "tree_plan",
    "chain_parents",
    "tree_levels",
    "root_path",
    "dfs_order",
    "branch_points",
    "tree_schedule",
    "tree_kernel_table",
    "conv_window_index",
    "tree_gated_delta_ops",
    "tree_gated_delta",
    "tree_conv_inputs",
    "tree_conv1d",
    "gdn_layer_tree_forward",
    "gdn_layer_commit",
    "forkable",
    "kernel_body",
    "kernel_backend",
]

# Slot codes of the kernel's schedule (see metal_kernels/gdn_tree.inc).
LOAD_CONTINUE = -2  # parent is node i-1: keep the registers
LOAD_COMMITTED = -1  # parent is -1: reload the committed state
NO_STORE = -1

FALLBACK_COST = "about 0.1 ms per token per layer on an H200"


# --------------------------------------------------------------------------------------------
# Host-side tree tables (numpy)
# --------------------------------------------------------------------------------------------


def check_parents(parents, n: Optional[int] = None) -> np.ndarray:
    """Validate round parents (tree.check_parents), or take a :class:`TreePlan`'s."""
    if isinstance(parents, TreePlan):
        if n is not None and parents.size != n:
            raise ValueError(f"tree plan has {parents.size} nodes, expected {n}")
        return parents.parents
    return _check_parents(parents, n)


def tree_levels(parents) -> List[np.ndarray]:
    """Node indices grouped by depth (ascending inside a level)."""
    d = depths_of(check_parents(parents))
    if d.size == 0:
        return []
    return [np.nonzero(d == k)[0] for k in range(int(d.max()) + 1)]


def dfs_order(parents) -> np.ndarray:
    """Depth-first visiting order (`tree.preorder`). The kernel walks the tree in this order:
    every node but a parent's first child then continues from the registers, whatever order
    the nodes were numbered in (a breadth-first numbering would reload at every node)."""
    return preorder(check_parents(parents))


def branch_points(parents, order=None) -> np.ndarray:
    """Boolean mask (by node) of the nodes whose state the kernel must keep in scratch.

    With the nodes visited in ``order`` (default: index order 0..n-1), node j is a branch
    point when it has a child other than the node visited right after it: that child runs
    after the registers have moved on, so it reloads j's state.
    """
    p = check_parents(parents)
    n = p.size
    order = np.arange(n) if order is None else np.asarray(order, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)  # node visited right after each node
    nxt[order[:-1]] = order[1:]
    bp = np.zeros(n, dtype=bool)
    c = np.arange(n)
    sel = (p >= 0) & (nxt[np.maximum(p, 0)] != c)
    bp[p[sel]] = True
    return bp


def tree_schedule(parents) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Scratch schedule of the tree kernel: ``(order, load, store, n_slots)``.

    Step t of the kernel runs node ``order[t]`` (depth-first order, :func:`dfs_order`).
    ``load[t]`` is LOAD_CONTINUE (-2: the parent ran at step t-1), LOAD_COMMITTED (-1: parent
    -1) or the scratch slot holding the parent's state; ``store[t]`` is the slot the node's
    state is written to (branch points only) or -1. A slot is freed when its last reader has
    loaded it (a step loads before it stores, so it may reuse the slot it just read).
    """
    p = check_parents(parents)
    n = p.size
    order = dfs_order(p)
    step = np.empty(n, dtype=np.int64)
    step[order] = np.arange(n)
    bp = branch_points(p, order)
    last_reader = np.full(n, -1, dtype=np.int64)  # by node: last step that reloads it
    for t in range(n):
        c = order[t]
        if p[c] >= 0 and (t == 0 or order[t - 1] != p[c]):
            last_reader[p[c]] = max(last_reader[p[c]], t)
    load = np.empty(n, dtype=np.int32)
    store = np.full(n, NO_STORE, dtype=np.int32)
    slot_of = np.full(n, -1, dtype=np.int64)
    free: List[int] = []
    n_slots = 0
    for t in range(n):
        i = order[t]
        par = p[i]
        if par < 0:
            load[t] = LOAD_COMMITTED
        elif t > 0 and order[t - 1] == par:
            load[t] = LOAD_CONTINUE
        else:
            s = int(slot_of[par])
            load[t] = s
            if last_reader[par] == t:
                heapq.heappush(free, s)
        if bp[i]:
            if free:
                s = heapq.heappop(free)
            else:
                s = n_slots
                n_slots += 1
            slot_of[i] = s
            store[t] = s
    return order, load, store, n_slots


def tree_kernel_table(parents) -> Tuple[np.ndarray, int]:
    """The kernel's int32 ``tree`` input and S (number of scratch slots).

    Layout: ``{T, S, node_0, load_0, store_0, node_1, load_1, store_1, ...}`` per step.
    """
    order, load, store, n_slots = tree_schedule(parents)
    table = np.empty(2 + 3 * load.size, dtype=np.int32)
    table[0] = load.size
    table[1] = n_slots
    table[2::3] = order
    table[3::3] = load
    table[4::3] = store
    return table, n_slots


def conv_window_index(parents, kernel_size: int) -> np.ndarray:
    """Rows of ``concat([conv_state, qkv], axis=1)`` forming each node's conv window.

    Row r < K-1 is committed conv-state row r; row K-1+j is node j's input. Node i's window is
    (oldest first) its K-1 nearest ancestors' inputs, then its own; when its root path is
    shorter than K it starts with the most recent committed rows.
    """
    p = check_parents(parents)
    K = int(kernel_size)
    n = p.size
    idx = np.empty((n, K), dtype=np.int32)
    for i in range(n):
        rows = []
        j = i
        while j >= 0 and len(rows) < K:
            rows.append(K - 1 + j)
            j = int(p[j])
        L = len(rows)
        # Committed rows L-1 .. K-2 fill the front when the path is shorter than K.
        idx[i, : K - L] = np.arange(L - 1, K - 1)
        idx[i, K - L :] = rows[::-1]
    return idx


class TreePlan:
    """One draft tree's host-side tables, built once and shared by every layer of a forward.

    Every function here that takes ``parents`` also takes a plan; passing the plan avoids
    rebuilding the tables (a few Python loops over the nodes) and re-uploading them per layer.
    """

    def __init__(self, parents):
        self.parents = check_parents(parents).copy()
        self.parents.setflags(write=False)
        self.size = int(self.parents.size)
        self._memo: Dict[Any, Any] = {}

    def _memoize(self, key, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def levels(self) -> List[np.ndarray]:
        return self._memoize("levels", lambda: tree_levels(self.parents))

    def ops_tables(self):
        """Per level: (node indices, positions of their parents in the previous level), both
        as int32 mx arrays, and the inverse permutation from level order back to node order."""

        def build():
            levels = self.levels()
            pos = np.empty(self.size, dtype=np.int64)
            for nodes in levels:
                pos[nodes] = np.arange(nodes.size)
            per_level = [
                (mx.array(nodes.astype(np.int32)),
                 mx.array(pos[self.parents[nodes]].astype(np.int32)) if d else None)
                for d, nodes in enumerate(levels)
            ]
            inv = mx.array(np.argsort(np.concatenate(levels)).astype(np.int32))
            return per_level, inv

        return self._memoize("ops", build)

    def kernel_table(self) -> Tuple[mx.array, int]:
        """The kernel's ``tree`` input (int32 mx array) and its number of scratch slots."""

        def build():
            table, n_slots = tree_kernel_table(self.parents)
            return mx.array(table), n_slots

        return self._memoize("kernel", build)

    def conv_index(self, kernel_size: int) -> mx.array:
        """:func:`conv_window_index` flattened, as an int32 mx array."""
        return self._memoize(
            ("conv", int(kernel_size)),
            lambda: mx.array(conv_window_index(self.parents, kernel_size).reshape(-1)),
        )


def tree_plan(parents, n: Optional[int] = None) -> TreePlan:
    """``parents`` as a :class:`TreePlan` (returned as is if it already is one)."""
    if isinstance(parents, (TreePlan, DevicePlan)):
        if n is not None and parents.size != n:
            raise ValueError(f"tree plan has {parents.size} nodes, expected {n}")
        return parents
    return TreePlan(check_parents(parents, n))


@functools.lru_cache(maxsize=128)
def chain_plan(n: int) -> TreePlan:
    """Cached plan of a chain of n nodes (commits replay chains)."""
    return TreePlan(chain_parents(n))


class DevicePlan:
    """A tree whose parents live on the device (mx int32 [T], parents[i] < i, -1 the committed
    state): a round queued ahead builds its tree there, so no host table can be made. The
    kernel keeps every node's state (scratch slot t is node t: T slots, no schedule), which also
    gives the state after any node (`tree_gated_delta(..., return_all_states=True)`); the conv
    windows are gathered along the parent links with ops. Validity is the builder's contract
    (`device_tree.best_first` numbers parents first)."""

    def __init__(self, parents: mx.array):
        self.parents = parents.astype(mx.int32)
        self.size = int(parents.shape[0])
        self._memo: Dict[Any, Any] = {}

    def kernel_table(self) -> Tuple[mx.array, int]:
        if "kernel" not in self._memo:
            T, p = self.size, self.parents
            t = mx.arange(T, dtype=mx.int32)
            load = mx.where((p == t - 1) & (p >= 0), LOAD_CONTINUE, p)  # (-1: the committed state)
            steps = mx.stack([t, load, t], axis=1).reshape(-1)  # node t at step t, stored in slot t
            self._memo["kernel"] = (mx.concatenate([mx.array([T, T], mx.int32), steps]), T)
        return self._memo["kernel"]

    def conv_index(self, kernel_size: int) -> mx.array:
        """:func:`conv_window_index`, flattened, from the device parents."""
        K = int(kernel_size)
        if ("conv", K) not in self._memo:
            p = self.parents
            node = mx.arange(self.size, dtype=mx.int32)
            rows, held = [], []
            for _ in range(K):  # the node, then its ancestors (-1 once past the root)
                held.append(node >= 0)
                rows.append(node)
                node = mx.where(node >= 0, mx.take(p, mx.maximum(node, 0)), -1)
            L = mx.sum(mx.stack(held).astype(mx.int32), axis=0)  # the root path's length, at most K
            # lag s: ancestor s's input, or committed rows from the newest back where the path ends
            cols = [mx.where(h, K - 1 + r, K - 2 - s + L) for s, (h, r) in enumerate(zip(held, rows))]
            self._memo[("conv", K)] = mx.stack(cols[::-1], axis=1).reshape(-1).astype(mx.int32)
        return self._memo[("conv", K)]


# --------------------------------------------------------------------------------------------
# MLX-ops reference
# --------------------------------------------------------------------------------------------


def tree_gated_delta_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array],
    parents,
    *,
    return_states: Optional[str] = None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """Gated-delta recurrence over a tree with MLX ops, one depth level at a time.

    Shapes as mlx-lm's ``gated_delta_ops``: q, k ``[B, T, Hk, Dk]``; v ``[B, T, Hv, Dv]``;
    g ``[B, T, Hv]`` or ``[B, T, Hv, Dk]``; beta ``[B, T, Hv]``; state ``[B, Hv, Dv, Dk]``
    (the committed state, not modified; None means zeros).

    Every step is mlx-lm's ``_gated_delta_step_ops`` on the nodes of one level (batched as
    ``[level_size * B, ...]``) starting from their parents' states, so on CPU y is bitwise what
    ``gated_delta_ops`` gives along each root-to-node path.

    ``return_states``: None -> ``(y, None)``; ``"last"`` -> also the state after node T-1
    ``[B, Hv, Dv, Dk]``; ``"all"`` -> every node's state ``[B, T, Hv, Dv, Dk]``.
    """
    if return_states not in (None, "last", "all"):
        raise ValueError(f"return_states must be None, 'last' or 'all', not {return_states!r}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    plan = tree_plan(parents, T)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat_factor := Hv // Hk) > 1:
        q = mx.repeat(q, repeat_factor, -2)
        k = mx.repeat(k, repeat_factor, -2)
    if isinstance(plan, DevicePlan):
        return _device_tree_gated_delta_ops(q, k, v, g, beta, state, plan, return_states)
    if T == 0:
        y = mx.zeros((B, 0, Hv, Dv), dtype=q.dtype)
        extra = {None: None, "last": state, "all": mx.zeros((B, 0, Hv, Dv, Dk), state.dtype)}
        return y, extra[return_states]

    per_level, inv = plan.ops_tables()

    ys, states = [], []
    prev = None
    last = None
    for d, (idx, parent_pos) in enumerate(per_level):
        m = int(idx.size)

        def take(x):  # [B, T, ...] -> [m * B, ...], node-major
            xs = mx.swapaxes(mx.take(x, idx, axis=1), 0, 1)
            return xs.reshape(m * B, *x.shape[2:])

        if d == 0:
            s = mx.broadcast_to(state[None], (m, *state.shape))
        else:
            s = mx.take(prev, parent_pos, axis=0)
        s = s.reshape(m * B, Hv, Dv, Dk)
        y, s = _gated_delta_step_ops(take(q), take(k), take(v), take(g), take(beta), s)
        prev = s.reshape(m, B, Hv, Dv, Dk)
        ys.append(y.reshape(m, B, Hv, Dv))
        if return_states == "all":
            states.append(prev)
        if return_states == "last" and plan.levels()[d][-1] == T - 1:
            last = prev[m - 1]

    y = mx.swapaxes(mx.take(mx.concatenate(ys, axis=0), inv, axis=0), 0, 1)
    if return_states == "all":
        allst = mx.swapaxes(mx.take(mx.concatenate(states, axis=0), inv, axis=0), 0, 1)
        return y, allst
    return y, last


def _device_tree_gated_delta_ops(q, k, v, g, beta, state, plan, return_states):
    """`tree_gated_delta_ops` over a :class:`DevicePlan`: node by node in index order (parents
    first), each from its parent's state gathered at a device index; the same step per node,
    so the same values (bitwise on CPU)."""
    B, T = q.shape[:2]
    Hv, Dv = v.shape[-2:]
    states = state[None]  # [1 + nodes so far, B, Hv, Dv, Dk]: the committed state first
    ys = []
    for t in range(T):
        s = mx.take(states, plan.parents[t] + 1, axis=0)
        y, s = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        ys.append(y)
        states = mx.concatenate([states, s[None]])
    y = mx.stack(ys, axis=1) if ys else mx.zeros((B, 0, Hv, Dv), dtype=q.dtype)
    extra = {None: None, "last": states[-1], "all": mx.swapaxes(states[1:], 0, 1)}
    return y, extra[return_states]


# --------------------------------------------------------------------------------------------
# The kernel: one body, a Metal kernel and a CUDA twin
# --------------------------------------------------------------------------------------------

KERNEL_NAME = "treespec_gdn_tree"
KERNEL_INPUTS = ["q", "k", "v", "g", "beta", "state_in", "tree"]
KERNEL_OUTPUTS = ["y", "scratch", "state_out"]

# The prelude goes in the kernel *source* (MLX's Metal generator adds a thread attribute to the
# signature only when its name appears in the source); helpers and macros go in the header.
METAL_PRELUDE = """\
  // ---- Metal prelude (mlx_treespec.gdn) ----
  const int ts_lane = static_cast<int>(thread_position_in_threadgroup.x);
  const int ts_row = static_cast<int>(thread_position_in_grid.y);
  const int ts_head = static_cast<int>(thread_position_in_grid.z);
  // ---- body: metal_kernels/gdn_tree.inc ----
"""
METAL_HEADER = """\
// mlx_treespec.gdn Metal portability header
#ifndef TS_WARP_SUM
#define TS_WARP_SUM(x) simd_sum(x)
#endif
"""

CUDA_PRELUDE = """\
  // ---- CUDA prelude (mlx_treespec.gdn) ----
  const int ts_lane = static_cast<int>(threadIdx.x);
  const int ts_row = static_cast<int>(blockIdx.y * blockDim.y + threadIdx.y);
  const int ts_head = static_cast<int>(blockIdx.z * blockDim.z + threadIdx.z);
  // ---- body: metal_kernels/gdn_tree.inc ----
"""
CUDA_HEADER = """\
// mlx_treespec.gdn CUDA portability header
#ifndef MLX_TREESPEC_GDN_CUDA_HEADER
#define MLX_TREESPEC_GDN_CUDA_HEADER
// Warp sum as an explicit ascending xor butterfly (mlx-lm's gated_delta.py notes this is the
// tree simd_sum lowers to on current Apple GPUs).
__device__ __forceinline__ float ts_warp_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  x += __shfl_xor_sync(0xffffffffu, x, 16);
  return x;
}
#define TS_WARP_SUM(x) ts_warp_sum(x)
#endif
"""


@functools.lru_cache(maxsize=None)
def kernel_body() -> str:
    """Text of metal_kernels/gdn_tree.inc (the kernel body shared by both backends)."""
    return kernel_text("gdn_tree.inc")


def kernel_source(backend: str) -> str:
    """Prelude + body handed to mx.fast.{metal,cuda}_kernel as ``source``."""
    prelude = {"metal": METAL_PRELUDE, "cuda": CUDA_PRELUDE}[backend]
    return prelude + kernel_body()


def kernel_header(backend: str) -> str:
    return {"metal": METAL_HEADER, "cuda": CUDA_HEADER}[backend]


@functools.lru_cache(maxsize=None)
def _make_kernel(backend: str):
    if backend == "metal":
        return mx.fast.metal_kernel(
            name=KERNEL_NAME,
            input_names=KERNEL_INPUTS,
            output_names=KERNEL_OUTPUTS,
            source=kernel_source("metal"),
            header=kernel_header("metal"),
        )
    if backend == "cuda":
        return mx.fast.cuda_kernel(
            name=KERNEL_NAME,
            input_names=KERNEL_INPUTS,
            output_names=KERNEL_OUTPUTS,
            source=kernel_source("cuda"),
            header=kernel_header("cuda"),
        )
    raise ValueError(f"unknown kernel backend {backend!r}")


def _kernel_template(q, v, g, store_final: bool):
    _, _, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    return [
        ("InT", q.dtype),
        ("Dk", int(Dk)),
        ("Dv", int(Dv)),
        ("Hk", int(Hk)),
        ("Hv", int(Hv)),
        ("GVec", bool(g.ndim == 4)),
        ("StoreFinal", bool(store_final)),
    ]


def run_tree_kernel(
    backend: str,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    parents,
    *,
    store_final: bool = False,
    all_states: bool = False,
    verbose: bool = False,
    stream=None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """Call the tree kernel of ``backend`` ('metal' or 'cuda') directly; returns (y, final), or
    with ``all_states`` (a :class:`DevicePlan`: slot t holds node t) (y, every node's state
    ``[B, T, Hv, Dv, Dk]``)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Dk % 32 or Hv % Hk or g.ndim not in (3, 4):
        raise ValueError(f"tree kernel needs Dk % 32 == 0 and Hv % Hk == 0 (Dk={Dk}, "
                         f"Hk={Hk}, Hv={Hv}, g.ndim={g.ndim})")
    table, n_slots = tree_plan(parents, T).kernel_table()
    state = state.astype(mx.float32)
    kernel = _make_kernel(backend)
    kwargs = {} if stream is None else {"stream": stream}
    y, _scratch, final = kernel(
        inputs=[q, k, v, g, beta, state, table],
        template=_kernel_template(q, v, g, store_final),
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[
            (B, T, Hv, Dv),
            (B * Hv, n_slots, Dv, Dk) if n_slots > 0 else (1,),
            (B, Hv, Dv, Dk) if store_final else (1,),
        ],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
        verbose=verbose,
        **kwargs,
    )
    if all_states:
        if not isinstance(parents, DevicePlan):
            raise ValueError("every node's state is kept for a DevicePlan only")
        return y, mx.swapaxes(_scratch.reshape(B, Hv, T, Dv, Dk), 1, 2)
    return y, (final if store_final else None)


_variant_status: Dict[tuple, bool] = {}


def _variant_builds(backend: str, q, k, v, g, beta, store_final: bool) -> bool:
    """Build (and run once, on a 1-token problem) this kernel variant; warn once if it fails."""
    Hk, Dk = q.shape[2:]
    Hv, Dv = v.shape[2:]
    key = (backend, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, g.ndim, Dk, Dv, Hk, Hv,
           store_final)
    ok = _variant_status.get(key)
    if ok is None:
        try:
            z = lambda shape, dt: mx.zeros(shape, dtype=dt)  # noqa: E731
            probe = run_tree_kernel(
                backend,
                z((1, 1, Hk, Dk), q.dtype),
                z((1, 1, Hk, Dk), k.dtype),
                z((1, 1, Hv, Dv), v.dtype),
                z((1, 1, Hv, Dk) if g.ndim == 4 else (1, 1, Hv), g.dtype),
                z((1, 1, Hv), beta.dtype),
                z((1, Hv, Dv, Dk), mx.float32),
                [-1],
                store_final=store_final,
            )
            mx.eval([a for a in probe if a is not None])
            ok = True
        except Exception as e:  # a JIT failure surfaces at eval time
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            warnings.warn(
                f"mlx_treespec: tree GatedDeltaNet {backend} kernel failed to build ({msg}); "
                f"falling back to the MLX-ops reference, {FALLBACK_COST}",
                RuntimeWarning,
                stacklevel=3,
            )
            ok = False
        _variant_status[key] = ok
    return ok


def tree_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array],
    parents,
    use_kernel: bool = True,
    *,
    return_final_state: bool = False,
    return_all_states: bool = False,
) -> Tuple[mx.array, Optional[mx.array]]:
    """Tree gated-delta recurrence: the kernel on a Metal/CUDA GPU, the ops reference otherwise.

    Returns ``(y, final)``: y ``[B, T, Hv, Dv]`` (dtype of q) and, when ``return_final_state``,
    the float32 state after node T-1 (for a chain: after the whole chain), when
    ``return_all_states`` (a :class:`DevicePlan`) every node's state ``[B, T, Hv, Dv, Dk]``,
    else None. The committed ``state`` is never modified.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    parents = tree_plan(parents, T)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    backend = kernel_backend() if use_kernel else None
    if (
        backend is not None
        and T > 0
        and Dk >= 32
        and Dk % 32 == 0
        and Hv % Hk == 0
        and g.ndim in (3, 4)
        and _variant_builds(backend, q, k, v, g, beta, return_final_state)
    ):
        return run_tree_kernel(backend, q, k, v, g, beta, state, parents,
                               store_final=return_final_state and not return_all_states,
                               all_states=return_all_states)
    return tree_gated_delta_ops(
        q, k, v, g, beta, state, parents,
        return_states="all" if return_all_states else ("last" if return_final_state else None),
    )


# --------------------------------------------------------------------------------------------
# Short causal conv over a tree
# --------------------------------------------------------------------------------------------


def tree_conv_inputs(conv_state: mx.array, qkv: mx.array, parents, kernel_size: int) -> mx.array:
    """Each node's conv input window ``[B, T, K, C]`` (oldest first, node last).

    ``conv_state`` ``[B, K-1, C]`` holds the K-1 most recent committed inputs; ``qkv``
    ``[B, T, C]`` the tree's inputs. Node i's window comes from its ancestors (and the
    committed rows when its root path is shorter than K), never from its flattened
    predecessors.
    """
    B, T, C = qkv.shape
    K = int(kernel_size)
    if conv_state.shape[1] != K - 1:
        raise ValueError(f"conv_state has {conv_state.shape[1]} rows, expected {K - 1}")
    idx = tree_plan(parents, T).conv_index(K)
    ext = mx.concatenate([conv_state, qkv], axis=1)
    win = mx.take(ext, idx, axis=1)
    return win.reshape(B, T, K, C)


def tree_conv1d(
    conv_weight: mx.array,
    conv_state: mx.array,
    qkv: mx.array,
    parents,
    bias: Optional[mx.array] = None,
) -> mx.array:
    """Depthwise causal conv over a tree: ``out [B, T, C]``.

    ``conv_weight`` is an ``nn.Conv1d(C, C, K, groups=C)`` weight ``[C, K, 1]``. Every node's
    K-long window is one row of a ``[B*T, K, C]`` batch run through ``mx.conv1d`` exactly as
    ``nn.Conv1d.__call__`` does, so along any root path it equals the layer's conv over
    ``concat([conv_state, qkv])`` (bitwise on CPU; tested).
    """
    C, K, _ = conv_weight.shape
    B, T, _ = qkv.shape
    win = tree_conv_inputs(conv_state, qkv, parents, K).reshape(B * T, K, C)
    y = mx.conv1d(win, conv_weight, 1, 0, 1, C)
    if bias is not None:
        y = y + bias
    return y.reshape(B, T, C)


# --------------------------------------------------------------------------------------------
# Whole GatedDeltaNet layer (mlx-lm qwen3_5 / qwen3_next)
# --------------------------------------------------------------------------------------------


def _project(layer, x):
    """The layer's input projections, op for op: (qkv, z, b, a)."""
    B, S, _ = x.shape
    if hasattr(layer, "in_proj_qkvz"):  # qwen3_next
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(x), layer.in_proj_ba(x)
        )
        qkv = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
        )
    else:  # qwen3_5 (tensor-parallel: this process's heads; the projections are sharded)
        qkv = layer.in_proj_qkv(x)
        z = layer.in_proj_z(x).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
        b = layer.in_proj_b(x)
        a = layer.in_proj_a(x)
    return qkv, z, b, a


def forkable(layer) -> bool:
    """Whether a GatedDeltaNet layer has the layout this tree forward reads (mlx-lm's qwen3_5 /
    qwen3_next: fused input projections and one depthwise conv1d); olmo_hybrid's, with separate
    q/k/v projections and convolutions, has not."""
    return (hasattr(layer, "in_proj_qkv") or hasattr(layer, "in_proj_qkvz")) and hasattr(layer, "conv1d")


def _check_cache(cache):
    if cache is None:
        return
    if getattr(cache, "lengths", None) is not None:
        raise NotImplementedError("tree decoding does not support ArraysCache.lengths")
    lp = getattr(cache, "left_padding", None)
    if lp is not None and bool(mx.any(lp > 0).item()):
        raise NotImplementedError("tree decoding needs an unpadded cache (left_padding > 0)")


def gdn_layer_tree_forward(layer, x: mx.array, cache, parents,
                           prior: Optional[Dict[str, Any]] = None) -> Tuple[mx.array, Dict[str, Any]]:
    """Run a GatedDeltaNet layer over a flattened draft tree without writing its cache.

    ``x`` ``[B, T, D]`` holds the tree's nodes in topological order. Returns the layer output
    for every node ``[B, T, D]`` (what plain decoding along the node's root path produces at
    that node; bitwise on CPU) and the replay payload for :func:`gdn_layer_commit`.

    ``parents``: round parents, or their :class:`TreePlan` (built once for a forward's layers).
    ``prior``: the payload of the round's earlier forwards through this layer (a draft model
    forwards each draft step over the nodes before it). The new nodes then continue that
    round: ``parents`` index all its nodes (the prior ones first), -1 the committed state; the
    scan runs over the whole round so each new node starts from its parent's state, and the
    payload returned covers every node of the round.
    """
    _check_cache(cache)
    B, S, _ = x.shape
    first = 0 if prior is None else prior["parents"].size
    if prior is not None and isinstance(parents, DevicePlan):
        raise ValueError("a tree with device parents is forwarded in one pass (no prior)")
    if prior is not None:
        new = parents.parents if isinstance(parents, TreePlan) else np.asarray(parents, np.int64)
        parents = np.concatenate([prior["parents"], new])
    plan = tree_plan(parents, first + S)  # (a plan as is: one per forward serves every layer)
    parents = plan.parents
    K = layer.conv_kernel_size
    conv = layer.conv1d
    if conv.weight.shape[1] != K or (conv.weight.ndim == 3 and conv.weight.shape[2] != 1):
        raise ValueError("expected a depthwise conv1d of kernel size conv_kernel_size")

    qkv, z, b, a = _project(layer, x)
    if prior is not None:
        qkv = mx.concatenate([prior["qkv"], qkv], axis=1)

    if prior is not None:
        conv_state = prior["conv_state"]
    elif cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, K - 1, layer.conv_dim), dtype=x.dtype)
    bias = conv["bias"] if "bias" in conv else None
    conv_out = nn.silu(tree_conv1d(conv.weight, conv_state, qkv, plan, bias=bias))[:, first:]

    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    state = cache[1] if cache is not None else None
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)

    # gated_delta_update's preamble, op for op.
    beta = mx.sigmoid(b)
    g = compute_g(layer.A_log, a, layer.dt_bias)
    if prior is not None:  # the round's earlier nodes (row-wise ops: the same values as then)
        state = prior["state"]
        q, k, v, g, beta = (mx.concatenate([prior[n], t], axis=1)
                            for n, t in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta)))
    if state is None:
        Hk, Dk = q.shape[2:]
        Hv, Dv = v.shape[2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    use_kernel = not layer.training

    on_device = isinstance(plan, DevicePlan)  # (every node's state kept: queued.py's commit reads them)
    y, states = tree_gated_delta(q, k, v, g, beta, state, plan, use_kernel, return_all_states=on_device)
    y = y[:, first:]

    out = layer.norm(y, z)
    out = layer.out_proj(out.reshape(B, S, -1))
    if getattr(layer, "sharding_group", None) is not None:  # mlx-lm's tensor parallelism (model.shard)
        out = mx.distributed.all_sum(out, group=layer.sharding_group)

    payload = {
        "parents": parents,
        "qkv": qkv,
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "beta": beta,
        "conv_state": conv_state,
        "state": state,
        "use_kernel": use_kernel,
    }
    if on_device:
        payload["states"] = states
    return out, payload


def gdn_layer_commit(layer, cache, payload: Dict[str, Any], path, apply: bool = True):
    """Advance ``cache`` over the accepted root path ``path`` (node indices, root first).

    With ``apply=False`` the new states are computed and a function that writes them is
    returned (a round's commit prepares every layer before it writes any).

    Leaves the cache exactly as plain one-token-at-a-time decoding of the path's tokens through
    the layer would: conv state = the last K-1 conv inputs along the path (committed rows in
    front when the path is shorter), recurrent state = the chain recurrence from the committed
    state (through the tree kernel on a GPU: a chain is a tree), ``cache.advance(len(path))``.
    """
    _check_cache(cache)
    parents = payload["parents"]
    path = np.asarray(path, dtype=np.int64).reshape(-1)
    L = int(path.size)
    if L == 0:
        return None if apply else (lambda: None)
    if np.any(path < 0) or np.any(path >= parents.size):
        raise ValueError(f"path {path.tolist()} has nodes outside the tree")
    if parents[path[0]] != -1 or np.any(parents[path[1:]] != path[:-1]):
        raise ValueError(f"path {path.tolist()} is not a root-first chain of the tree")

    idx = mx.array(path.astype(np.int32))
    n_keep = layer.conv_kernel_size - 1
    conv_input = mx.concatenate([payload["conv_state"], mx.take(payload["qkv"], idx, axis=1)],
                                axis=1)
    new_conv = mx.contiguous(conv_input[:, -n_keep:, :])

    sel = lambda a: mx.take(a, idx, axis=1)  # noqa: E731
    _, new_state = tree_gated_delta(
        sel(payload["q"]), sel(payload["k"]), sel(payload["v"]), sel(payload["g"]),
        sel(payload["beta"]), payload["state"], chain_plan(L), payload["use_kernel"],
        return_final_state=True,
    )

    def write():
        cache[0] = new_conv
        cache[1] = new_state
        cache.advance(L)

    if not apply:
        return write
    write()
