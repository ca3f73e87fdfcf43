import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_treespec.tree import MAX_NODES, DraftTree, preorder, relabel, root_path

FAST = settings(max_examples=100, deadline=None)


@st.composite
def random_trees(draw, max_nodes=MAX_NODES):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return DraftTree(tokens, parents)


def example_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    return DraftTree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2], [0.0, -0.5, -1.0, -0.7, -2.0, -1.5])


def test_example_tree_structure():
    tree = example_tree()
    assert tree.size == 6 and tree.budget == 5 and len(tree) == 6
    assert tree.tokens.dtype == np.int64 and tree.parents.dtype == np.int32
    assert tree.scores.dtype == np.float64
    assert tree.depths.dtype == np.int32
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.max_depth == 2
    assert tree.children(0) == (1, 2)
    assert tree.children(1) == (3, 4)
    assert tree.children(5) == ()
    assert tree.path_to(0).tolist() == [0]
    assert tree.path_to(4).tolist() == [0, 1, 4]
    assert tree.path_to(5).tolist() == [0, 2, 5]
    assert tree.is_ancestor_or_self(1, 4)
    assert tree.is_ancestor_or_self(4, 4)
    assert tree.is_ancestor_or_self(0, 5)
    assert not tree.is_ancestor_or_self(4, 1)
    assert not tree.is_ancestor_or_self(3, 4)
    assert not tree.is_ancestor_or_self(1, 5)
    assert not tree.is_chain
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=bool,
    )
    assert np.array_equal(tree.ancestor_mask(), expected)


def test_arrays_are_read_only_and_copied_from_inputs():
    tokens = np.array([1, 2, 3])
    parents = np.array([-1, 0, 0])
    scores = np.array([0.0, -1.0, -2.0])
    tree = DraftTree(tokens, parents, scores)
    tokens[1] = 99
    parents[2] = 1
    scores[1] = -5.0
    assert tree.tokens.tolist() == [1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 0]
    assert tree.scores.tolist() == [0.0, -1.0, -2.0]
    for array in (tree.tokens, tree.parents, tree.scores, tree.depths, tree.ancestor_mask()):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1


def test_tree_is_immutable():
    tree = example_tree()
    with pytest.raises(AttributeError, match="immutable"):
        tree.tokens = np.array([1])
    with pytest.raises(AttributeError, match="immutable"):
        tree._tokens = np.array([1])
    with pytest.raises(AttributeError):
        tree.new_attribute = 1


def test_ancestor_mask_is_cached():
    tree = example_tree()
    assert tree.ancestor_mask() is tree.ancestor_mask()


def test_equality_and_hash_by_contents():
    a = example_tree()
    b = example_tree()
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != DraftTree(a.tokens, a.parents)  # scores differ (None)
    assert a != DraftTree([10, 11, 12, 13, 14, 16], a.parents, a.scores)
    assert a != DraftTree(a.tokens, [-1, 0, 0, 1, 2, 2], a.scores)
    assert a != DraftTree(a.tokens, a.parents, [0.0, -0.5, -1.0, -0.7, -2.0, -1.6])
    assert a != "not a tree"


def test_negative_zero_score_hashes_like_zero():
    a = DraftTree([1, 2], [-1, 0], [0.0, 0.0])
    b = DraftTree([1, 2], [-1, 0], [-0.0, -0.0])
    assert a == b and hash(a) == hash(b)


def test_pickle_and_copy_roundtrip():
    tree = example_tree()
    assert pickle.loads(pickle.dumps(tree)) == tree
    assert copy.deepcopy(tree) == tree
    assert copy.copy(tree) == tree


def test_repr_is_readable():
    text = repr(example_tree())
    assert text.startswith("DraftTree(")
    assert "tokens=[10, 11, 12, 13, 14, 15]" in text
    assert "parents=[-1, 0, 0, 1, 1, 2]" in text
    assert "scores=[0, -0.5" in text
    assert "scores" not in repr(DraftTree([1], [-1]))


def test_chain():
    tree = DraftTree.chain([7, 8, 9], [0.0, -1.0, -1.0])
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.is_chain
    assert tree.depths.tolist() == [0, 1, 2]
    assert tree.children(1) == (2,)
    assert DraftTree.chain([7]).is_chain
    assert DraftTree([1, 2, 3], [-1, 0, 1]).is_chain
    assert not DraftTree([1, 2, 3], [-1, 0, 0]).is_chain


def test_accepts_lists_numpy_ints_and_uint():
    tree = DraftTree(np.array([3, 4], dtype=np.uint32), np.array([-1, 0], dtype=np.int8), [0, -1])
    assert tree.tokens.dtype == np.int64 and tree.scores.dtype == np.float64
    assert DraftTree([np.int64(1), 2], [-1, 0]).tokens.tolist() == [1, 2]


def test_max_nodes_tree_is_allowed_and_infinite_scores_are_allowed():
    tree = DraftTree.chain(np.arange(MAX_NODES))
    assert tree.size == MAX_NODES and tree.max_depth == MAX_NODES - 1
    tree = DraftTree([1, 2, 3], [-1, 0, 1], [0.0, -np.inf, -np.inf])
    assert tree.scores[2] == -np.inf


@pytest.mark.parametrize(
    "tokens, parents, scores, message",
    [
        ([], [], None, "at least the root"),
        (list(range(MAX_NODES + 1)), list(range(-1, MAX_NODES)), None, f"more than MAX_NODES={MAX_NODES}"),
        ([1, 2, 3], [-1, 0], None, "lengths differ"),
        ([1, 2, 3], [0, 0, 0], None, "parents[0] must be -1"),
        ([1, 2, 3], [-1, 0, 5], None, "node 2 has forward parent 5"),
        ([1, 2, 3, 4], [-1, 3, 0, 0], None, "node 1 has forward parent 3"),
        ([1, 2, 3], [-1, 0, 2], None, "node 2 is its own parent"),
        ([1, 2, 3], [-1, 0, -1], None, "node 2 has negative parent -1"),
        ([1, 2, 3], [-1, -3, 0], None, "node 1 has negative parent -3"),
        ([1.0, 2.0], [-1, 0], None, "tokens must hold integers, got dtype float64"),
        ([True, False], [-1, 0], None, "tokens must hold integers, got booleans"),
        (np.array([1, "a"], dtype=object), [-1, 0], None, "tokens must hold integers, got dtype object"),
        ([1, 2], [-1.0, 0.0], None, "parents must hold integers"),
        ([1, -2], [-1, 0], None, "node 1 has negative token -2"),
        ([1, 2, 3], [-1, 0, 0], [0.0, -1.0, np.nan], "node 2 has a NaN score"),
        ([1, 2, 3], [-1, 0, 1], [0.0, -1.0, -0.5], "node 2 has score -0.5 above its parent 1"),
        ([1, 2], [-1, 0], [0.0, 0.5], "node 1 has score 0.5 above its parent 0"),
        ([1, 2], [-1, 0], [0.0], "tokens and scores lengths differ"),
        ([1, 2], [-1, 0], ["a", "b"], "scores must be real numbers"),
        ([[1, 2]], [[-1, 0]], None, "tokens must be a 1-D"),
        (5, [-1], None, "tokens must be a 1-D"),
        ([1, 2], [[-1, 0]], None, "parents must be a 1-D"),
        ([1, 2], [-1, 0], [[0.0, -1.0]], "scores must be a 1-D"),
    ],
)
def test_invalid_trees_raise_value_error_naming_the_problem(tokens, parents, scores, message):
    with pytest.raises(ValueError) as info:
        DraftTree(tokens, parents, scores)
    assert message in str(info.value)


def test_chain_rejects_bad_inputs():
    with pytest.raises(ValueError, match="at least the root"):
        DraftTree.chain([])
    with pytest.raises(ValueError, match="1-D"):
        DraftTree.chain([[1, 2]])
    with pytest.raises(ValueError, match="above its parent"):
        DraftTree.chain([1, 2], [-1.0, 0.0])


@pytest.mark.parametrize("bad", [-1, 6, 1.0, True, None])
def test_node_index_out_of_range_raises(bad):
    tree = example_tree()
    for call in (lambda: tree.children(bad), lambda: tree.path_to(bad),
                 lambda: tree.is_ancestor_or_self(bad, 0), lambda: tree.is_ancestor_or_self(0, bad)):
        with pytest.raises(ValueError, match="node index|out of range"):
            call()


@FAST
@given(random_trees())
def test_random_tree_structure_matches_brute_force(tree):
    n = tree.size
    parents = tree.parents
    assert all(0 <= parents[i] < i for i in range(1, n))
    mask = tree.ancestor_mask()
    for i in range(n):
        # walk up by hand: independent of path_to and of the forward pass
        chain = [i]
        while chain[-1] != 0:
            chain.append(int(parents[chain[-1]]))
        assert tree.path_to(i).tolist() == chain[::-1]
        assert tree.depths[i] == len(chain) - 1
        assert set(np.flatnonzero(mask[i]).tolist()) == set(chain)
        assert tree.children(i) == tuple(j for j in range(n) if parents[j] == i)
    assert tree.max_depth == max(tree.depths)
    a, b = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    for x, y in zip(a.ravel()[:200], b.ravel()[:200]):
        assert tree.is_ancestor_or_self(int(x), int(y)) == (int(x) in tree.path_to(int(y)).tolist())
    assert tree.is_chain == all(parents[i] == i - 1 for i in range(1, n))


@FAST
@given(random_trees())
def test_siblings_never_ancestors_of_each_other(tree):
    mask = tree.ancestor_mask()
    for i in range(tree.size):
        kids = tree.children(i)
        for a in kids:
            for b in kids:
                if a != b:
                    assert not mask[a, b]


@given(random_trees())
@FAST
def test_preorder_renumbers_the_same_tree_depth_first(tree):
    order = preorder(tree.parents)
    parents = relabel(tree.parents, order)
    assert sorted(order.tolist()) == list(range(tree.size))
    assert (parents[1:] < np.arange(1, tree.size)).all() and parents[0] == -1  # parents first
    # the same tree: every node's root path maps to the old node's root path
    for j, i in enumerate(order):
        assert order[root_path(parents, j)].tolist() == root_path(tree.parents, i).tolist()
    # depth first, children in their old id order: a node's subtree is a run of ids after it
    assert np.array_equal(preorder(parents), np.arange(tree.size))
