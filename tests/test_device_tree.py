"""Trees from device values alone (mlx_treespec/device_tree.py): DDTree's build and the tree
walk as MLX ops (CPU) and as one-thread kernels (their shared body emulated on the CPU with g++;
the Metal source syntax-checked, the CUDA twin compiled with nvcc where it is installed)."""
import os
import sys

import numpy as np
import pytest
import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
import msl_check  # noqa: E402
from mlx_treespec import device_tree  # noqa: E402
from mlx_treespec.builders import best_first_tree  # noqa: E402
from mlx_treespec.tree import ancestors_of, depths_of, root_path  # noqa: E402


def paths(parents, tokens):
    """A tree as the set of its root paths' token tuples (the same tree in any numbering)."""
    return {tuple(int(tokens[j]) for j in root_path(parents, i)) for i in range(len(parents))}


def marginals(rng, D, V):
    x = rng.standard_normal((D, V)).astype(np.float32) * rng.uniform(0.5, 4.0, (D, 1)).astype(np.float32)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def emulate_build(lp, N, K):
    """The build kernel's body on the CPU, fed as device_tree feeds it: each position's K best."""
    ids = np.argsort(-lp, axis=-1, kind="stable")[:, :K]
    rng = np.random.default_rng(0)
    ids = np.take_along_axis(ids, rng.permuted(np.tile(np.arange(K), (lp.shape[0], 1)), axis=1), axis=1)  # any order
    top = np.take_along_axis(lp, ids, axis=-1).astype(np.float32)
    T = N + 1
    return msl_check.emulate_single_thread(
        "ddtree_build.inc", dict(D=lp.shape[0], K=K, N=N),
        [("lp", top), ("ids", ids.astype(np.uint32)), ("root", np.array([7], np.uint32))],
        [("tokens", np.uint32, (T,)), ("parents", np.int32, (T,)), ("depths", np.int32, (T,)),
         ("anc", np.bool_, (T, T))])


@pytest.mark.parametrize("budget,topk,depth", [(5, 0, 0), (12, 0, 0), (31, 0, 0), (31, 3, 0), (40, 2, 4), (63, 0, 0), (127, 0, 0), (255, 16, 0)])
def test_both_builds_are_the_best_first_tree(budget, topk, depth):
    # the tree queued rounds build is the budget rule's tree: the same root paths as the host's
    # best_first_tree over the same marginals (random: no ties), parents before children, and
    # ancestor rows and depths that are the parents'; (2, 4): fewer prefixes (2 + 4 + 8 + 16 =
    # 30) than the budget, all of them. The ops (CPU) and the kernel body (emulated) alike
    if not msl_check.have_gxx():
        pytest.fail("g++ is required for the kernel emulation")
    rng = np.random.default_rng(budget + topk)
    D = depth or 15
    K = min(topk or budget, budget, 97)
    N = min(budget, device_tree.prefixes(min(D, budget), K))
    for _ in range(2):
        lp = marginals(rng, D, 97)
        want = best_first_tree(7, lp, budget, topk=topk or None)
        ops = device_tree.ddtree_ops(mx.array([7], mx.uint32), mx.array(lp), budget, topk or budget)
        kern = emulate_build(lp[: min(D, budget)], N, K)
        for tokens, parents, depths, anc in ([np.array(a) for a in ops], kern):
            assert len(tokens) == want.size and paths(parents, tokens) == paths(want.parents, want.tokens)
            assert (parents[1:] < np.arange(1, len(parents))).all() and parents[0] == -1
            assert np.array_equal(depths, depths_of(parents)) and np.array_equal(anc, ancestors_of(parents))


def test_the_build_kernel_ranks_nan_and_positive_log_probabilities_as_the_host_does():
    # builders' clamp: a positive log-probability is 0 (a child never outscores its parent:
    # unclamped, position 1's +3 would put a deep path before the root's second child), NaN is
    # -inf; equal scores still give a tree of distinct siblings
    lp = np.array([[-1.0, -2.0], [3.0, -5.0], [-3.5, -6.0]], np.float32)
    tokens, parents, _, anc = emulate_build(lp, 3, 2)
    want = best_first_tree(7, lp, 3)
    assert paths(parents, tokens) == paths(want.parents, want.tokens) and max(want.depths) == 2
    lp = np.full((3, 4), -2.0, np.float32)
    lp[0, 1], lp[1, 2], lp[2, 0], lp[1, 0] = np.nan, 0.5, -0.1, np.nan
    tokens, parents, _, anc = emulate_build(lp, 9, 4)
    assert paths(parents, tokens) == paths(*(lambda t: (t.parents, t.tokens))(best_first_tree(7, lp, 9)))
    assert np.array_equal(anc, ancestors_of(parents))
    for p in set(parents[1:].tolist()):
        kids = tokens[parents == p]
        assert len(set(kids.tolist())) == len(kids)


def random_round(rng, T, vocab=3):
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, T)], np.int64)
    tokens = rng.integers(0, vocab, T).astype(np.uint32)
    for i in range(1, T):  # siblings hold distinct tokens, as every drafter's do
        while any(tokens[j] == tokens[i] for j in range(1, i) if parents[j] == parents[i]):
            tokens[i] = rng.integers(0, 10 * vocab)
    choice = rng.integers(0, vocab, T).astype(np.uint32)
    return parents, tokens, choice


def test_both_walks_accept_the_deepest_agreeing_path():
    # the host walk's answer (the deepest node whose every ancestor is the target's choice at
    # its parent), from the ops and from the kernel body: the count, the path in depth order,
    # the target's choices along it; every node appears once
    if not msl_check.have_gxx():
        pytest.fail("g++ is required for the kernel emulation")
    rng = np.random.default_rng(3)
    for T in (1, 2, 7, 32, 256):  # (256: MAX_NODES)
        for _ in range(12):
            parents, tokens, choice = random_round(rng, T)
            deepest = max((i for i in range(T) if all(
                tokens[j] == choice[parents[j]] for j in root_path(parents, i)[1:])),
                key=lambda i: (len(root_path(parents, i)), -i))
            want = root_path(parents, deepest)
            count, path, emitted = msl_check.emulate_single_thread(
                "tree_walk.inc", dict(T=T),
                [("choice", choice), ("tokens", tokens), ("parents", parents.astype(np.int32))],
                [("count", np.int32, (1,)), ("path", np.int32, (T,)), ("emitted", np.uint32, (T,))])
            ops = device_tree.walk_ops(mx.array(choice), mx.array(tokens), mx.array(parents.astype(np.int32)),
                                       mx.array(depths_of(parents).astype(np.int32)), mx.array(ancestors_of(parents)))
            for c, p, e in ((int(count[0]), path, emitted), tuple(np.array(a) for a in ops)):
                c = int(c)
                assert c == len(want) and list(p[:c]) == list(want) and sorted(p.tolist()) == list(range(T))
                assert np.array_equal(e, choice[p])


def test_metal_kernels_compile():
    if not msl_check.have_gxx():
        pytest.fail("g++ is required for the Metal syntax check")
    sources = msl_check.traced_metal_sources(msl_check.trace_device_tree_metal)
    assert len(sources) == 2
    for (_, src), body in zip(sources, ("ddtree_build.inc", "tree_walk.inc")):
        assert device_tree.kernel_text(body) in src
    ok, err = msl_check.check_metal([s for _, s in sources])
    assert ok, err
    assert not msl_check.check_metal(sources[1][1].replace("pth[k--] = i;", "pth[k--] = i"))[0]


def test_cuda_twins_compile():
    sources = [s for _, s in msl_check.device_tree_cuda_sources()]
    if not msl_check.have_nvcc():
        pytest.skip("nvcc is not installed (the CUDA twin is compiled on the H200 at first use)")
    ok, err = msl_check.check_cuda(sources)
    assert ok, err


@pytest.mark.parametrize("k", [1, 3, device_tree.ARGMAX_TOP_K, device_tree.ARGMAX_TOP_K + 3])
def test_top_k_is_each_rows_best_first_without_repeats(k):
    """`top_k` (argmaxes up to ARGMAX_TOP_K, argpartition past it) is each row's best k, best
    first, as a stable sort ranks them; `skip` leaves one id a row out; with ties, NaN and -inf in
    the row no id repeats (a lane's siblings must be distinct tokens)."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    ids, vals = device_tree.top_k(mx.array(x), k, ordered=True)
    assert ids.dtype == mx.uint32
    want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    assert np.array_equal(np.array(ids), want)
    assert np.array_equal(np.array(vals), np.take_along_axis(x, want, axis=-1))
    skip = want[:, 0]
    ids, _ = device_tree.top_k(mx.array(x), k, skip=mx.array(skip.astype(np.uint32)), ordered=True)
    assert np.array_equal(np.array(ids), np.argsort(-x, axis=-1, kind="stable")[:, 1:k + 1])
    # unordered past ARGMAX_TOP_K: the same set
    ids, _ = device_tree.top_k(mx.array(x), k)
    assert np.array_equal(np.sort(np.array(ids), axis=-1), np.sort(want, axis=-1))
    # a row of ties, NaN and -inf: k distinct ids, the numbers first (ties: the lower id)
    row = np.full((1, k + 4), -np.inf, np.float32)
    row[0, 1], row[0, 2], row[0, 3] = 0.5, np.nan, 0.5
    ids = np.array(device_tree.top_k(mx.array(row), k + 3, skip=mx.array([0], mx.uint32))[0])[0]
    assert len(set(ids.tolist())) == k + 3 and 0 not in ids.tolist()
    if k + 3 <= device_tree.ARGMAX_TOP_K:
        assert ids[:2].tolist() == [1, 3]
