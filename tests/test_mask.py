import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import create_causal_mask

from mlx_treespec.mask import additive_mask, additive_mask_with_history, bool_mask_with_history, positions
from mlx_treespec.tree import MAX_NODES, DraftTree

FAST = settings(max_examples=100, deadline=None)
OFFSETS = (0, 1, 7, 100)


@st.composite
def random_trees(draw, max_nodes=MAX_NODES):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return DraftTree(tokens, parents)


def chain(n):
    return DraftTree.chain(np.arange(n))


def test_chain_bool_mask_equals_mlx_lm_causal_mask():
    for n in range(1, MAX_NODES + 1):
        tree = chain(n)
        for offset in OFFSETS:
            ours = np.array(bool_mask_with_history(tree, offset))
            theirs = np.array(create_causal_mask(n, offset))
            assert ours.shape == theirs.shape == (n, offset + n)
            assert np.array_equal(ours, theirs), (n, offset)


def test_chain_windowed_bool_mask_equals_mlx_lm_causal_mask():
    for n in range(1, MAX_NODES + 1):
        tree = chain(n)
        for offset in OFFSETS:
            for window in (1, 2, 5, 64, 200):
                ours = np.array(bool_mask_with_history(tree, offset, window=window))
                theirs = np.array(create_causal_mask(n, offset, window_size=window))
                assert np.array_equal(ours, theirs), (n, offset, window)


def test_chain_additive_mask_equals_causal_additive_mask():
    for n in range(1, MAX_NODES + 1):
        causal = np.array(create_causal_mask(n, 0))
        expected = np.where(causal, 0.0, -np.inf).astype(np.float32)
        ours = additive_mask(chain(n))
        assert ours.dtype == mx.float32
        assert np.array_equal(np.array(ours), expected), n
        for offset in (1, 7):
            causal = np.array(create_causal_mask(n, offset, window_size=3))
            expected = np.where(causal, 0.0, -np.inf).astype(np.float32)
            ours = additive_mask_with_history(chain(n), offset, window=3)
            assert np.array_equal(np.array(ours), expected), (n, offset)


def test_small_tree_mask_by_hand():
    #     0
    #    / \
    #   1   2
    #   |
    #   3
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 0, 1])
    expected = np.array(
        [
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 0, 1],
        ],
        dtype=bool,
    )
    assert np.array_equal(np.array(bool_mask_with_history(tree, 2)), expected)
    # window 2: node 3 (position 4) sees only positions 3 and 4 -> node 1 and itself
    expected_window = np.array(
        [
            [0, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 0, 1, 0],
            [0, 0, 0, 1, 0, 1],
        ],
        dtype=bool,
    )
    assert np.array_equal(np.array(bool_mask_with_history(tree, 2, window=2)), expected_window)
    assert np.array(positions(tree, 2)).tolist() == [2, 3, 3, 4]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_additive_mask_dtype(dtype):
    tree = DraftTree([5, 6, 7], [-1, 0, 0])
    mask = additive_mask(tree, dtype)
    assert mask.dtype == dtype
    values = np.array(mask.astype(mx.float32))
    assert np.array_equal(values, np.where(tree.ancestor_mask(), 0.0, -np.inf))
    assert additive_mask_with_history(tree, 3, dtype).dtype == dtype


def test_positions_dtype_and_history_shape():
    tree = DraftTree([5, 6, 7], [-1, 0, 1])
    pos = positions(tree, 100)
    assert pos.dtype == mx.int32
    assert np.array(pos).tolist() == [100, 101, 102]
    assert bool_mask_with_history(tree, 0).shape == (3, 3)
    assert bool_mask_with_history(tree, 5).dtype == mx.bool_


@FAST
@given(random_trees(), st.integers(0, 20))
def test_random_tree_node_sees_exactly_its_ancestors(tree, offset):
    n = tree.size
    mask = np.array(bool_mask_with_history(tree, offset))
    assert mask.shape == (n, offset + n)
    assert mask[:, :offset].all()
    for i in range(n):
        assert set(np.flatnonzero(mask[i, offset:]).tolist()) == set(tree.path_to(i).tolist())
        kids = tree.children(i)
        for a in kids:
            for b in kids:
                if a != b:
                    assert not mask[a, offset + b]
    pos = np.array(positions(tree, offset))
    assert pos.tolist() == [offset + len(tree.path_to(i)) - 1 for i in range(n)]


@FAST
@given(random_trees(max_nodes=24), st.integers(0, 12), st.integers(1, 10))
def test_random_tree_window_rule_brute_force(tree, offset, window):
    n = tree.size
    mask = np.array(bool_mask_with_history(tree, offset, window=window))
    key_pos = list(range(offset)) + [offset + len(tree.path_to(j)) - 1 for j in range(n)]
    for i in range(n):
        path = set(tree.path_to(i).tolist())
        query_pos = offset + len(path) - 1
        for k in range(offset + n):
            topology_ok = k < offset or (k - offset) in path
            expected = topology_ok and not (query_pos - key_pos[k] > window - 1)
            assert mask[i, k] == expected, (i, k)
    assert mask[np.arange(n), offset + np.arange(n)].all()  # a node always sees itself: no all -inf row
    # the additive mask is derived from the boolean one
    additive = np.array(additive_mask_with_history(tree, offset, window=window))
    assert np.array_equal(additive, np.where(mask, 0.0, -np.inf).astype(np.float32))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: positions(t, -1), "offset"),
        (lambda t: positions(t, 1.5), "offset"),
        (lambda t: bool_mask_with_history(t, -3), "offset"),
        (lambda t: bool_mask_with_history(t, 2, window=0), "window must be >= 1"),
        (lambda t: bool_mask_with_history(t, 2, window=2.0), "window must be an int"),
        (lambda t: additive_mask(t, mx.int32), "floating dtype"),
        (lambda t: additive_mask_with_history(t, 1, mx.bool_), "floating dtype"),
        (lambda t: additive_mask_with_history(t, True), "offset"),
    ],
)
def test_invalid_mask_arguments_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call(DraftTree([1, 2], [-1, 0]))
