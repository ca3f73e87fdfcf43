"""mlx_treespec.gdn on CPU: tree recurrence, tree conv, whole-layer tree forward and commit.

Everything recurrent is compared BITWISE (mx.array_equal) with mlx-lm's own code run along
each root-to-node path; the GPU kernels are checked for syntax (Metal via the mock header,
the CUDA twin via nvcc) since they cannot run here.
"""
import os
import sys
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_ops

from mlx_treespec import gdn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msl_check  # noqa: E402

mx.set_default_device(mx.cpu)


def random_parents(n, rng, p_root=0.0):
    """Random topological parent list; node 0 is a root, others root with prob. p_root."""
    out = [-1]
    for i in range(1, n):
        out.append(-1 if rng.random() < p_root else int(rng.integers(0, i)))
    return out


def leaves(parents):
    p = np.asarray(parents)
    has_child = np.zeros(len(p), bool)
    has_child[p[p >= 0]] = True
    return np.nonzero(~has_child)[0]


def make_inputs(T, B=1, Hk=2, Hv=4, Dk=32, Dv=16, gvec=False, seed=0, dtype=mx.float32):
    mx.random.seed(seed)
    ks = mx.random.split(mx.random.key(seed), 7)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0]).astype(dtype)
    k = (mx.random.normal((B, T, Hk, Dk), key=ks[1]) / Dk**0.5).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype)
    gshape = (B, T, Hv, Dk) if gvec else (B, T, Hv)
    g = mx.random.uniform(0.5, 1.0, gshape, key=ks[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=ks[4]).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk), key=ks[5])
    return q, k, v, g, beta, state


def path_reference(inputs, path):
    """mlx-lm's gated_delta_ops along one root-first path: (y [B, L, Hv, Dv], final state)."""
    q, k, v, g, beta, state = inputs
    ix = mx.array(np.asarray(path, dtype=np.int32))
    return gated_delta_ops(q[:, ix], k[:, ix], v[:, ix], g[:, ix], beta[:, ix], state)


PARENT_LISTS = {
    "example": [-1, 0, 1, 1, 0, 4],
    "chain": list(range(-1, 11)),
    "fan16_roots": [-1] * 16,
    "fan16_under0": [-1] + [0] * 16,
    "several_roots": [-1, 0, -1, 2, -1, 0, 1, 3, 4, 4],
    "random20": random_parents(20, np.random.default_rng(1)),
    "random40_roots": random_parents(40, np.random.default_rng(2), p_root=0.15),
    "random64": random_parents(64, np.random.default_rng(3)),
}


# ---------------------------------------------------------------------------------------------
# Recurrence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gvec", [False, True], ids=["scalar_g", "perkey_g"])
@pytest.mark.parametrize("name", list(PARENT_LISTS))
def test_tree_recurrence_matches_every_root_path(name, gvec):
    parents = PARENT_LISTS[name]
    T = len(parents)
    inputs = make_inputs(T, gvec=gvec, seed=T)
    y, states = gdn.tree_gated_delta_ops(*inputs, parents, return_states="all")
    mx.eval(y, states)
    checked = np.zeros(T, bool)
    for leaf in leaves(parents):
        path = gdn.root_path(parents, int(leaf))
        y_ref, s_ref = path_reference(inputs, path)
        for j, node in enumerate(path):
            assert mx.array_equal(y[:, node], y_ref[:, j]), (name, node)
            checked[node] = True
        assert mx.array_equal(states[:, leaf], s_ref), (name, leaf)
    assert checked.all()
    # The "last" state (used by commits) is node T-1's state.
    _, last = gdn.tree_gated_delta_ops(*inputs, parents, return_states="last")
    assert mx.array_equal(last, states[:, T - 1])


def test_tree_recurrence_internal_states_batch2_hv_eq_hk_dk64():
    parents = [-1, 0, 1, 1, 0, 4, -1, 6]
    inputs = make_inputs(len(parents), B=2, Hk=4, Hv=4, Dk=64, Dv=8, seed=7)
    y, states = gdn.tree_gated_delta_ops(*inputs, parents, return_states="all")
    for i in range(len(parents)):
        y_ref, s_ref = path_reference(inputs, gdn.root_path(parents, i))
        assert mx.array_equal(y[:, i], y_ref[:, -1])
        assert mx.array_equal(states[:, i], s_ref)


def test_flattened_recurrence_is_not_the_tree():
    """Guard on the comparison itself: running the tree as a chain gives different outputs."""
    parents = PARENT_LISTS["example"]
    inputs = make_inputs(len(parents), seed=3)
    y_tree, _ = gdn.tree_gated_delta_ops(*inputs, parents)
    y_flat, _ = gated_delta_ops(*inputs)
    assert not mx.array_equal(y_tree, y_flat)
    assert mx.array_equal(y_tree[:, :3], y_flat[:, :3])  # nodes 0,1,2 are a chain prefix


@pytest.mark.parametrize("gvec", [False, True])
def test_chain_given_as_tree_equals_chain_recurrence(gvec):
    T = 13
    inputs = make_inputs(T, gvec=gvec, seed=11)
    y_ref, s_ref = gated_delta_ops(*inputs)
    y, s = gdn.tree_gated_delta_ops(*inputs, gdn.chain_parents(T), return_states="last")
    assert mx.array_equal(y, y_ref) and mx.array_equal(s, s_ref)
    # The dispatcher runs the reference on CPU, kernel requested or not.
    y2, s2 = gdn.tree_gated_delta(*inputs, gdn.chain_parents(T), True, return_final_state=True)
    assert mx.array_equal(y2, y_ref) and mx.array_equal(s2, s_ref)
    y3, none = gdn.tree_gated_delta(*inputs, gdn.chain_parents(T))
    assert none is None and mx.array_equal(y3, y_ref)


def test_tree_plan_is_reusable_and_equivalent():
    parents = PARENT_LISTS["random20"]
    plan = gdn.tree_plan(parents)
    assert gdn.tree_plan(plan) is plan
    inputs = make_inputs(len(parents), seed=21)
    y1, s1 = gdn.tree_gated_delta_ops(*inputs, parents, return_states="all")
    y2, s2 = gdn.tree_gated_delta_ops(*inputs, plan, return_states="all")
    y3, s3 = gdn.tree_gated_delta_ops(*inputs, plan, return_states="all")  # memoized tables
    assert mx.array_equal(y1, y2) and mx.array_equal(y2, y3) and mx.array_equal(s1, s3)
    assert plan.kernel_table()[0] is plan.kernel_table()[0]
    table, n_slots = gdn.tree_kernel_table(parents)
    assert np.array_equal(np.array(plan.kernel_table()[0]), table) and plan.kernel_table()[1] == n_slots
    with pytest.raises(ValueError):
        gdn.tree_gated_delta_ops(*make_inputs(5), plan)  # wrong number of nodes
    arr = np.array(parents, dtype=np.int64)
    gdn.tree_plan(arr)
    arr[1] = 0  # the caller's array stays writable (the plan keeps its own copy)


def test_committed_state_untouched_and_none_state():
    parents = [-1, 0, 0]
    q, k, v, g, beta, state = make_inputs(3, seed=5)
    before = np.array(state)
    gdn.tree_gated_delta(q, k, v, g, beta, state, parents)
    assert np.array_equal(np.array(state), before)
    y0, _ = gdn.tree_gated_delta(q, k, v, g, beta, None, parents)
    yz, _ = gdn.tree_gated_delta(q, k, v, g, beta, mx.zeros_like(state), parents)
    assert mx.array_equal(y0, yz)


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_kernel_build_failure_falls_back_with_one_warning(monkeypatch, backend):
    """On this CPU host the kernels cannot run: pretend the device is a GPU and check the
    fallback is the reference, announced once with its cost."""
    monkeypatch.setattr(gdn, "kernel_backend", lambda: backend)
    monkeypatch.setattr(gdn, "_variant_status", {})
    parents = [-1, 0, 0, 2]
    inputs = make_inputs(4, seed=9)
    y_ref, _ = gdn.tree_gated_delta_ops(*inputs, parents)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y, _ = gdn.tree_gated_delta(*inputs, parents)
        y2, _ = gdn.tree_gated_delta(*inputs, parents)
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and backend in msgs[0] and "0.1 ms per token" in msgs[0]
    assert "\n" not in msgs[0]
    assert mx.array_equal(y, y_ref) and mx.array_equal(y2, y_ref)


# ---------------------------------------------------------------------------------------------
# Host tables (the kernel's schedule)
# ---------------------------------------------------------------------------------------------


@st.composite
def parent_lists(draw, max_nodes=64):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]


def brute_branch_points(parents, order=None):
    """Node j is a branch point iff it has a child that is not visited right after it."""
    n = len(parents)
    order = list(range(n)) if order is None else list(order)
    nxt = {order[t]: order[t + 1] for t in range(n - 1)}
    return np.array(
        [any(parents[c] == j and nxt.get(j) != c for c in range(n)) for j in range(n)],
        dtype=bool,
    )


def brute_dfs(parents):
    n = len(parents)
    out = []

    def visit(j):
        out.append(j)
        for c in range(n):
            if parents[c] == j:
                visit(c)

    for r in range(n):
        if parents[r] == -1:
            visit(r)
    return out


def simulate_schedule(parents):
    """Run the kernel's step protocol on symbolic states (the node a state is after, -1 =
    committed); return {node: the state it starts from}, the nodes in step order, n_slots."""
    order, load, store, n_slots = gdn.tree_schedule(parents)
    regs = None
    slots = [None] * n_slots
    starts = {}
    for t, i in enumerate(order):
        if load[t] == gdn.LOAD_COMMITTED:
            regs = -1
        elif load[t] >= 0:
            regs = slots[load[t]]
        else:
            assert load[t] == gdn.LOAD_CONTINUE and t > 0
        starts[int(i)] = regs
        regs = int(i)
        if store[t] >= 0:
            slots[store[t]] = int(i)
    return starts, [int(i) for i in order], n_slots


@settings(max_examples=300, deadline=None)
@given(parent_lists())
def test_branch_point_table_vs_brute_force(parents):
    n = len(parents)
    # The brief's definition (index order): a child other than node j + 1.
    assert np.array_equal(gdn.branch_points(parents), brute_branch_points(parents))
    order, load, store, n_slots = gdn.tree_schedule(parents)
    assert order.tolist() == brute_dfs(parents) == gdn.dfs_order(parents).tolist()
    bp = brute_branch_points(parents, order)
    assert np.array_equal(gdn.branch_points(parents, order), bp)
    assert np.array_equal(store >= 0, bp[order])  # stores exactly at branch points
    starts, visited, _ = simulate_schedule(parents)
    assert sorted(visited) == list(range(n))
    assert all(starts[i] == parents[i] for i in range(n))  # each node starts from its parent
    # Depth-first order never needs more slots than the index order's branch points.
    assert n_slots <= int(bp.sum()) <= int(brute_branch_points(parents).sum())
    table, s = gdn.tree_kernel_table(parents)
    assert table.dtype == np.int32 and table[0] == n and table[1] == s == n_slots
    assert np.array_equal(table[2::3], order) and np.array_equal(table[3::3], load)
    assert np.array_equal(table[4::3], store)


def test_schedule_examples():
    # 0 has children 1 and 4, 1 has children 2 and 3: both are branch points.
    order, load, store, n = gdn.tree_schedule([-1, 0, 1, 1, 0, 4])
    assert order.tolist() == [0, 1, 2, 3, 4, 5]
    assert load.tolist() == [-1, -2, -2, store[1], store[0], -2]
    assert n == 2 and (store >= 0).tolist() == [True, True, False, False, False, False]
    # A chain never reloads and needs no scratch.
    order, load, store, n = gdn.tree_schedule(gdn.chain_parents(9))
    assert load.tolist() == [-1] + [-2] * 8 and (store == -1).all() and n == 0
    # A fan of roots reloads the committed state every time, no scratch either.
    order, load, store, n = gdn.tree_schedule([-1] * 5)
    assert load.tolist() == [-1] * 5 and n == 0
    # Breadth-first numbering: fan-out 2 then chains. Depth-first steps reload only twice.
    parents = [-1, 0, 0, 1, 2, 3, 4]
    order, load, store, n = gdn.tree_schedule(parents)
    assert order.tolist() == [0, 1, 3, 5, 2, 4, 6]
    assert int((load == gdn.LOAD_CONTINUE).sum()) == 5 and n == 1
    assert int(gdn.branch_points(parents).sum()) == 5  # index order would store 5 states
    # Slots are reused: two sibling subtrees with a branch point each need 1 slot at a time.
    parents = [-1, 0, 0, -1, 3, 3]
    order, load, store, n = gdn.tree_schedule(parents)
    assert n == 1 and simulate_schedule(parents)[0] == dict(enumerate(parents))
    with pytest.raises(ValueError):
        gdn.check_parents([-1, 1])
    with pytest.raises(ValueError):
        gdn.check_parents([0])


@settings(max_examples=100, deadline=None)
@given(parent_lists(max_nodes=30), st.integers(1, 5))
def test_conv_window_index_vs_brute_force(parents, K):
    idx = gdn.conv_window_index(parents, K)
    for i in range(len(parents)):
        path = gdn.root_path(parents, i).tolist()
        seq = list(range(K - 1)) + [K - 1 + j for j in path]  # committed rows, then the path
        assert idx[i].tolist() == seq[-K:]


# ---------------------------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------------------------


def make_conv(C=24, K=4, seed=0, bias=False):
    mx.random.seed(seed)
    conv = nn.Conv1d(C, C, K, bias=bias, groups=C, padding=0)
    conv_state = mx.random.normal((2, K - 1, C))
    return conv, conv_state


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", ["example", "several_roots", "random20", "fan16_under0"])
def test_tree_conv_matches_every_root_path(name, bias):
    parents = PARENT_LISTS[name]
    T = len(parents)
    conv, conv_state = make_conv(seed=T, bias=bias)
    qkv = mx.random.normal((2, T, conv_state.shape[-1]))
    out = gdn.tree_conv1d(conv.weight, conv_state, qkv, parents,
                          bias=conv.bias if bias else None)
    for i in range(T):
        ix = mx.array(gdn.root_path(parents, i).astype(np.int32))
        ref = conv(mx.concatenate([conv_state, qkv[:, ix]], axis=1))
        assert mx.array_equal(out[:, i], ref[:, -1]), (name, i)


def test_tree_conv_chain_equals_plain_conv_and_differs_from_flat():
    conv, conv_state = make_conv(seed=4)
    T = 9
    qkv = mx.random.normal((2, T, conv_state.shape[-1]))
    ref = conv(mx.concatenate([conv_state, qkv], axis=1))
    assert mx.array_equal(gdn.tree_conv1d(conv.weight, conv_state, qkv, gdn.chain_parents(T)), ref)
    tree = gdn.tree_conv1d(conv.weight, conv_state, qkv, [-1, 0, 0, 1, 2, 3, 4, 5, 6])
    assert not mx.array_equal(tree, ref)
    win = gdn.tree_conv_inputs(conv_state, qkv, [-1, 0, 0, 1, 2, 3, 4, 5, 6], 4)
    assert win.shape == (2, T, 4, conv_state.shape[-1])
    assert mx.array_equal(win[:, 2, -2], qkv[:, 0]) and mx.array_equal(win[:, 2, :2], conv_state[:, 1:])


# ---------------------------------------------------------------------------------------------
# Whole layer: tree forward and commit by replay vs plain one-token decoding
# ---------------------------------------------------------------------------------------------

COMMON = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=64,
    max_position_embeddings=512, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
    tie_word_embeddings=False,
)
LAYER_CONFIGS = {
    "qwen3_5_dk32": dict(COMMON, model_type="qwen3_5", linear_key_head_dim=32),
    "qwen3_next_dk64": dict(
        COMMON, model_type="qwen3_next", linear_key_head_dim=64, num_experts=0,
        num_experts_per_tok=0, decoder_sparse_step=1, shared_expert_intermediate_size=0,
        mlp_only_layers=[], moe_intermediate_size=0, rope_theta=10000.0,
        partial_rotary_factor=0.25,
    ),
}


def build_layer(cfg, seed=0):
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    inner = model.language_model.model if cfg["model_type"] == "qwen3_5" else model.model
    layer = inner.layers[0].linear_attn
    # Perturb the parameters left at constants by __init__ (norm weight, dt_bias).
    params = [(n, p + 0.3 * mx.random.normal(p.shape)) for n, p in tree_flatten(layer.parameters())
              if n in ("dt_bias", "norm.weight")]
    layer.update(tree_unflatten(params))
    layer.eval()
    mx.eval(layer.parameters())
    return layer


def plain_decode(layer, cache, x, path):
    """One token at a time through the mlx-lm layer along path; returns outputs and cache."""
    c = ArraysCache(2)
    c[0], c[1] = cache[0], cache[1]
    outs = [layer(x[:, int(j) : int(j) + 1], None, c) for j in path]
    return mx.concatenate(outs, axis=1), c


@pytest.mark.parametrize("cfg_name", list(LAYER_CONFIGS))
def test_layer_tree_forward_and_commit_equal_plain_decoding(cfg_name):
    layer = build_layer(LAYER_CONFIGS[cfg_name])
    D = LAYER_CONFIGS[cfg_name]["hidden_size"]
    mx.random.seed(1)
    cache = ArraysCache(2)
    layer(mx.random.normal((1, 3, D)), None, cache)  # prime with 3 plain tokens
    mx.eval(cache[0], cache[1])
    c0, c1 = cache[0], cache[1]

    parents = [-1, 0, 1, 1, 0, 4, 5, 6, -1, 2]
    x = mx.random.normal((1, len(parents), D))
    out, payload = gdn.gdn_layer_tree_forward(layer, x, cache, parents)
    mx.eval(out)
    assert cache[0] is c0 and cache[1] is c1  # the tree forward does not write the cache

    for leaf in leaves(parents):
        path = gdn.root_path(parents, int(leaf))
        ref, _ = plain_decode(layer, cache, x, path)
        for j, node in enumerate(path):
            assert mx.array_equal(out[:, node], ref[:, j]), (cfg_name, node)

    # Flattened decoding differs (guard on the comparison).
    flat, _ = plain_decode(layer, cache, x, range(len(parents)))
    assert not mx.array_equal(out, flat)

    # Commit: a long path (longer than K-1 = 3) and a one-token path (shorter than K-1).
    for path in ([0, 4, 5, 6, 7], [8], [0, 1, 2, 9]):
        _, ref_cache = plain_decode(layer, cache, x, path)
        c = ArraysCache(2)
        c[0], c[1] = cache[0], cache[1]
        gdn.gdn_layer_commit(layer, c, payload, np.array(path))
        for a, b in ((c[0], ref_cache[0]), (c[1], ref_cache[1])):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert mx.array_equal(a, b), (cfg_name, path)
        assert c.lengths is None and c.left_padding is None

    with pytest.raises(ValueError):
        gdn.gdn_layer_commit(layer, ArraysCache(2), payload, np.array([0, 2]))  # not a chain
    with pytest.raises(ValueError):
        gdn.gdn_layer_commit(layer, ArraysCache(2), payload, np.array([1, 2]))  # not a root


@pytest.mark.parametrize("cfg_name", list(LAYER_CONFIGS))
def test_replay_prefix_of_a_chain_is_the_commit_of_each_prefix(cfg_name):
    # rounds queued ahead commit a chain's recurrent states with the accepted count a device
    # value, from the states a scan over device parents keeps: they equal the commit's (plain
    # decoding's) for every count, bitwise
    from mlx_treespec.queued import replay_prefix

    layer = build_layer(LAYER_CONFIGS[cfg_name], seed=4)
    D = LAYER_CONFIGS[cfg_name]["hidden_size"]
    mx.random.seed(5)
    cache = ArraysCache(2)
    layer(mx.random.normal((1, 3, D)), None, cache)
    T = 6
    x = mx.random.normal((1, T, D))
    _, payload = gdn.gdn_layer_tree_forward(layer, x, cache, gdn.chain_plan(T))
    _, kept = gdn.gdn_layer_tree_forward(layer, x, cache, gdn.DevicePlan(mx.arange(-1, T - 1, dtype=mx.int32)))
    for count in range(1, T + 1):
        conv, state = replay_prefix({0: kept}, mx.array(count, mx.int32))[0]
        c = ArraysCache(2)
        c[0], c[1] = cache[0], cache[1]
        gdn.gdn_layer_commit(layer, c, payload, np.arange(count))
        for a, b in ((conv, c[0]), (state, c[1])):
            assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b), count


def test_layer_on_fresh_cache():
    """cache[0] / cache[1] None (no prefill): zeros are used, as the layer does."""
    cfg = LAYER_CONFIGS["qwen3_5_dk32"]
    layer = build_layer(cfg, seed=2)
    mx.random.seed(3)
    parents = [-1, 0, 0, -1]
    x = mx.random.normal((1, 4, cfg["hidden_size"]))
    cache = ArraysCache(2)
    out, payload = gdn.gdn_layer_tree_forward(layer, x, cache, parents)
    assert cache[0] is None and cache[1] is None
    for leaf in (1, 2, 3):
        path = gdn.root_path(parents, leaf)
        ref, ref_cache = plain_decode(layer, cache, x, path)
        assert mx.array_equal(out[:, leaf], ref[:, -1])
    gdn.gdn_layer_commit(layer, cache, payload, [0, 2])
    _, ref_cache = plain_decode(layer, ArraysCache(2), x, [0, 2])
    assert mx.array_equal(cache[0], ref_cache[0]) and mx.array_equal(cache[1], ref_cache[1])


# ---------------------------------------------------------------------------------------------
# Kernel sources: Metal (mock-header syntax check) and the CUDA twin
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metal_sources():
    return msl_check.traced_metal_sources(msl_check.trace_gdn_metal_variants)


def test_metal_kernel_every_variant_compiles(metal_sources):
    if not msl_check.have_gxx():
        pytest.fail("g++ is required for the Metal syntax check")
    variants = list(msl_check.gdn_variants())
    assert len(metal_sources) == len(variants) == 24
    body = gdn.kernel_body()
    for _, src in metal_sources:
        assert body in src and "thread_position_in_threadgroup" in src
    ok, err = msl_check.check_metal([s for _, s in metal_sources])
    assert ok, err


def test_metal_check_rejects_a_broken_kernel(metal_sources):
    bad = metal_sources[0][1].replace("TS_WARP_SUM(out)", "TS_WARP_SUMM(out)")
    assert not msl_check.check_metal(bad)[0]


def test_cuda_twin_assembles_the_same_body():
    body = gdn.kernel_body()
    name, src = msl_check.cuda_twin_source(mx.bfloat16, 128, 128, 16, 32, False, True)
    assert body in src and gdn.CUDA_PRELUDE in src and "__shfl_xor_sync" in src
    assert "__nv_bfloat16* y" in src and "constexpr bool GVec = false;" in src
    assert gdn.kernel_source("cuda").endswith(body) and gdn.kernel_source("metal").endswith(body)
    if not msl_check.have_nvcc():
        pytest.skip("nvcc not found: CUDA twin text checked, not compiled")
    sources = [s for _, s in msl_check.gdn_cuda_sources()]
    ok, err = msl_check.check_cuda(sources)
    assert ok, err
    assert not msl_check.check_cuda(src.replace("TS_WARP_SUM(out)", "TS_WARP_SUMM(out)"))[0]


# ---------------------------------------------------------------------------------------------
# The kernel body itself, run on the CPU (msl_check's emulator: 32 cooperative lanes per warp,
# the CUDA twin's xor-butterfly warp sum). Float32; reduction order differs from the ops
# reference, so this is a tolerance check (the bitwise contract is the ops path's).
# ---------------------------------------------------------------------------------------------

EMU_CASES = [
    ("example", False, 64, 2, 4), ("example", True, 64, 2, 4), ("chain", False, 128, 2, 4),
    ("fan16_roots", True, 32, 1, 2), ("fan16_under0", False, 64, 4, 4),
    ("several_roots", True, 64, 2, 4), ("random40_roots", False, 64, 2, 4),
    ("random64", True, 64, 1, 4),
]


@pytest.mark.parametrize("name,gvec,Dk,Hk,Hv", EMU_CASES)
def test_kernel_body_emulated_matches_reference(name, gvec, Dk, Hk, Hv):
    if not msl_check.have_gxx():
        pytest.fail("g++ is required for the kernel emulation")
    parents = PARENT_LISTS[name]
    inputs = make_inputs(len(parents), B=2, Hk=Hk, Hv=Hv, Dk=Dk, Dv=8, gvec=gvec, seed=Dk)
    y_ref, s_ref = gdn.tree_gated_delta_ops(*inputs, parents, return_states="last")
    y, final = msl_check.emulate_tree_kernel(*inputs, parents, store_final=True)
    np.testing.assert_allclose(y, np.array(y_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final, np.array(s_ref), rtol=1e-4, atol=1e-5)
    if name != "chain":  # the same body on the flattened order would be wrong
        y_flat, _ = gated_delta_ops(*inputs)
        assert not np.allclose(y, np.array(y_flat), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Device parents (a tree built on the device: gdn.DevicePlan)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["example", "chain", "several_roots", "random40_roots", "random64"])
def test_device_plan_equals_the_host_plan(name):
    # a tree whose parents are a device array (no host schedule): the ops path runs node by node
    # and keeps every node's state; its outputs, and each node's state, are the host plan's
    # along every root path, bitwise on CPU; the conv windows the same rows
    parents = PARENT_LISTS[name]
    inputs = make_inputs(len(parents), B=2, gvec=name == "example", seed=3)
    plan = gdn.DevicePlan(mx.array(parents, mx.int32))
    y, states = gdn.tree_gated_delta(*inputs, plan, return_all_states=True)
    y_ref, states_ref = gdn.tree_gated_delta_ops(*inputs, parents, return_states="all")
    assert mx.array_equal(y, y_ref).item() and mx.array_equal(states, states_ref).item()
    for K in (1, 2, 4):
        assert np.array(plan.conv_index(K)).tolist() == gdn.conv_window_index(parents, K).reshape(-1).tolist()


@pytest.mark.parametrize("name,gvec", [("example", True), ("several_roots", False), ("random64", False)])
def test_kernel_body_over_a_device_plan_keeps_every_node(name, gvec):
    # the kernel body (emulated on CPU) over a device-built table, every node in its own scratch
    # slot: the outputs and every node's state are the ops reference's
    if not msl_check.have_gxx():
        pytest.fail("g++ is required for the kernel emulation")
    parents = PARENT_LISTS[name]
    inputs = make_inputs(len(parents), B=2, Hk=2, Hv=4, Dk=64, Dv=8, gvec=gvec, seed=5)
    y, states = msl_check.emulate_tree_kernel(*inputs, gdn.DevicePlan(mx.array(parents, mx.int32)))
    y_ref, states_ref = gdn.tree_gated_delta_ops(*inputs, parents, return_states="all")
    np.testing.assert_allclose(y, np.array(y_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(states, np.array(states_ref), rtol=1e-4, atol=1e-5)
