import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_treespec.tree import MAX_NODES, DraftTree
from mlx_treespec.walk import greedy_walk

FAST = settings(max_examples=150, deadline=None)


def mlx_lm_chain_accept(draft_tokens, target_tokens, max_tokens=None):
    """mlx-lm speculative_generate_step's accept loop, rewritten: accept while
    draft[n] == target[n], then emit the target's token at the stop point."""
    emitted = []
    n = 0
    while n < len(draft_tokens):
        if target_tokens[n] != draft_tokens[n]:
            break
        emitted.append(target_tokens[n])
        n += 1
        if max_tokens is not None and len(emitted) == max_tokens:
            return n, emitted
    if max_tokens is None or len(emitted) < max_tokens:
        emitted.append(target_tokens[n])
    return n, emitted


def test_chain_walk_matches_mlx_lm_at_every_accept_length():
    rng = np.random.default_rng(0)
    for num_draft in list(range(0, 65)) + [MAX_NODES - 1]:  # every length to 64, and the longest
        draft = rng.integers(0, 1000, size=num_draft).tolist()
        tree = DraftTree.chain([7] + draft)
        for accept in range(num_draft + 1):
            target = draft[:accept] + [1000 + accept]  # 1000+ never matches a draft token
            target += rng.integers(0, 1000, size=num_draft - accept).tolist()
            n, expected = mlx_lm_chain_accept(draft, target)
            assert n == accept
            path, emitted = greedy_walk(tree, target)
            assert path.tolist() == list(range(accept + 1))
            assert emitted.tolist() == expected
            assert len(emitted) == len(path)


def test_chain_walk_max_emit_matches_mlx_lm_max_tokens():
    draft = [3, 4, 5, 6]
    tree = DraftTree.chain([1] + draft)
    for accept in range(len(draft) + 1):
        target = draft[:accept] + [99] * (len(draft) + 1 - accept)
        for max_emit in range(1, len(draft) + 3):  # mlx-lm has max_tokens >= 1
            n, expected = mlx_lm_chain_accept(draft, target, max_tokens=max_emit)
            path, emitted = greedy_walk(tree, target, max_emit=max_emit)
            assert emitted.tolist() == expected
            # max_emit never truncates the path: it still records what the target verified
            assert path.tolist() == list(range(accept + 1))
        path, emitted = greedy_walk(tree, target, max_emit=0)
        assert emitted.tolist() == [] and path.tolist() == list(range(accept + 1))


def test_tree_walk_by_hand():
    #        0(t=1)
    #      /   |    \
    #   1(5)  2(6)  3(6)
    #    |     |
    #   4(7)  5(8)
    tree = DraftTree([1, 5, 6, 6, 7, 8], [-1, 0, 0, 0, 1, 2])
    path, emitted = greedy_walk(tree, [6, 0, 8, 0, 0, 42])
    assert path.tolist() == [0, 2, 5]  # 2 and 3 both match; only 2 goes on
    assert emitted.tolist() == [6, 8, 42]
    path, emitted = greedy_walk(tree, [9, 0, 0, 0, 0, 0])
    assert path.tolist() == [0] and emitted.tolist() == [9]
    path, emitted = greedy_walk(tree, np.array([5, 7, 0, 0, 11, 0]), max_emit=2)
    assert path.tolist() == [0, 1, 4] and emitted.tolist() == [5, 7]
    assert path.dtype == np.int64 and emitted.dtype == np.int64
    # the same text twice (a merged draft): the deeper agreement wins, not the lower index
    path, emitted = greedy_walk(tree, [6, 0, 0, 0, 0, 0])
    assert path.tolist() == [0, 2] and emitted.tolist() == [6, 0]  # equal depth: the lower id
    tree = DraftTree([1, 6, 6, 7, 8], [-1, 0, 0, 2, 3])
    path, emitted = greedy_walk(tree, [6, 7, 7, 8, 9])
    assert path.tolist() == [0, 2, 3, 4] and emitted.tolist() == [6, 7, 8, 9]


def test_walk_accepts_mx_array_targets():
    tree = DraftTree([1, 5, 6], [-1, 0, 1])
    path, emitted = greedy_walk(tree, mx.array([5, 6, 9]))
    assert path.tolist() == [0, 1, 2] and emitted.tolist() == [5, 6, 9]


@st.composite
def trees_and_targets(draw):
    n = draw(st.integers(1, MAX_NODES))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    tree = DraftTree(tokens, parents)
    # bias targets toward a child's token so walks go deep
    target = []
    for i in range(n):
        kids = tree.children(i)
        if kids and draw(st.booleans()):
            target.append(tokens[draw(st.sampled_from(kids))])
        else:
            target.append(draw(st.integers(0, 4)))
    return tree, target


@FAST
@given(trees_and_targets(), st.one_of(st.none(), st.integers(0, 70)))
def test_random_walk_is_one_root_path_following_the_rule(tree_and_target, max_emit):
    tree, target = tree_and_target
    path, emitted = greedy_walk(tree, target, max_emit=max_emit)
    path = path.tolist()
    assert path[0] == 0
    assert path == tree.path_to(path[-1]).tolist()  # one root path
    def agrees(n):
        p = tree.path_to(n).tolist()
        return all(tree.tokens[b] == target[a] for a, b in zip(p, p[1:]))

    assert agrees(path[-1])
    # no agreeing node is deeper, nor as deep with a lower id
    best = min((n for n in range(tree.size) if agrees(n)), key=lambda n: (-tree.depths[n], n))
    assert path[-1] == best
    full = [int(tree.tokens[i]) for i in path[1:]] + [target[path[-1]]]
    assert len(full) == len(path)
    assert emitted.tolist() == (full if max_emit is None else full[:max_emit])


@pytest.mark.parametrize(
    "target, max_emit, message",
    [
        ([1, 2], None, "expected \\(3,\\)"),
        ([1, 2, 3, 4], None, "expected \\(3,\\)"),
        ([[1, 2, 3]], None, "expected \\(3,\\)"),
        ([1.0, 2.0, 3.0], None, "target_tokens must hold integers"),
        ([1, 2, 3], -1, "max_emit must be >= 0"),
        ([1, 2, 3], 2.0, "max_emit must be an int"),
    ],
)
def test_invalid_walk_inputs_raise(target, max_emit, message):
    with pytest.raises(ValueError, match=message):
        greedy_walk(DraftTree([1, 5, 6], [-1, 0, 1]), target, max_emit=max_emit)
