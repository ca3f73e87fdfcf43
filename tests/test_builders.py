import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mlx_treespec.builders import (
    Eagle2Builder,
    best_first_tree,
    chain_tree,
    eagle2_tree,
    static_topology,
    static_tree,
)
from mlx_treespec.tree import MAX_NODES, DraftTree

FAST = settings(max_examples=100, deadline=None)


def assert_valid_tree(tree):
    assert isinstance(tree, DraftTree)
    assert tree.parents[0] == -1
    assert all(0 <= tree.parents[i] < i for i in range(1, tree.size))
    if tree.scores is not None:
        assert not np.isnan(tree.scores).any()
        assert all(tree.scores[i] <= tree.scores[tree.parents[i]] for i in range(1, tree.size))


def token_path(tree, i):
    return tuple(int(t) for t in tree.tokens[tree.path_to(i)[1:]])


# ---------------------------------------------------------------------------
# chain_tree


def test_chain_tree_scores_are_cumulative_and_clamped():
    tree = chain_tree(7, [1, 2, 3, 4], [-0.5, 0.25, -1.0, np.nan])
    assert tree.is_chain
    assert tree.tokens.tolist() == [7, 1, 2, 3, 4]
    assert tree.scores.tolist() == [0.0, -0.5, -0.5, -1.5, -np.inf]
    assert chain_tree(7, []).size == 1
    assert chain_tree(7, [1, 2]).scores is None


@pytest.mark.parametrize(
    "args, message",
    [
        ((7, [1, 2], [-0.5]), "give one log-probability per draft token"),
        ((-1, [1, 2]), "root_token must be a non-negative"),
        ((7.0, [1, 2]), "root_token must be an int"),
        ((7, [1.5, 2]), "tokens must hold integers"),
        ((7, [[1, 2]]), "tokens must be 1-D"),
        ((7, list(range(MAX_NODES))), "MAX_NODES"),
    ],
)
def test_chain_tree_invalid_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        chain_tree(*args)


# ---------------------------------------------------------------------------
# EAGLE-2: an independent brute-force reference


def rank_key(score, cand_id):
    # higher score first, ties to the lower id, NaN last
    return (1, 0.0, cand_id) if math.isnan(score) else (0, -score, cand_id)


def child_score(parent_score, logprob):
    if math.isnan(parent_score) or math.isnan(logprob):
        return math.nan
    return parent_score + (logprob if logprob < 0 else 0.0)


def reference_eagle2(model, topk, steps, budget):
    """Enumerate every candidate of every step with its token path and score."""
    candidates = []  # (token path, score, id)
    lanes = [((), 0.0)]
    lane_ids_per_step = []
    for _ in range(steps):
        created = []
        for path, score in lanes:
            tokens, logprobs = model(path)
            for token, logprob in zip(tokens, logprobs):
                cand = (path + (int(token),), child_score(score, float(logprob)), len(candidates))
                candidates.append(cand)
                created.append(cand)
        best = sorted(created, key=lambda c: rank_key(c[1], c[2]))[:topk]
        lane_ids_per_step.append([c[2] for c in best])
        lanes = [(c[0], c[1]) for c in best]
    kept = sorted(candidates, key=lambda c: rank_key(c[1], c[2]))[:budget]
    return candidates, lane_ids_per_step, kept


def make_model(seed, topk, vocab=50, tweak=None):
    """A fake drafter: deterministic top-K (distinct tokens, sorted log-probs) per token path."""

    def model(path):
        rng = np.random.default_rng([seed, len(path), *path])
        tokens = rng.choice(vocab, size=topk, replace=False)
        logprobs = np.sort(np.log(rng.dirichlet(np.ones(vocab)))[:topk])[::-1].copy()
        if tweak is not None:
            logprobs = tweak(path, rng, logprobs)
        return tokens, logprobs

    return model


def drive_builder(model, root, topk, steps, budget):
    builder = Eagle2Builder(root, topk, budget)
    cand_paths = []
    lanes_seen = []
    lanes = None
    step_tokens, step_logprobs = [], []
    for step in range(steps):
        lane_paths = [()] if step == 0 else [cand_paths[c] for c in lanes]
        rows = [model(p) for p in lane_paths]
        tokens = np.stack([r[0] for r in rows])
        logprobs = np.stack([r[1] for r in rows])
        step_tokens.append(tokens)
        step_logprobs.append(logprobs)
        for path, row in zip(lane_paths, tokens):
            cand_paths.extend(path + (int(t),) for t in row)
        lanes = builder.add_step(tokens, logprobs)
        lanes_seen.append(lanes.tolist())
    return builder, cand_paths, lanes_seen, (step_tokens, step_logprobs)


def check_against_reference(model, topk, steps, budget, root=3):
    builder, cand_paths, lanes_seen, steps_data = drive_builder(model, root, topk, steps, budget)
    candidates, ref_lanes, kept = reference_eagle2(model, topk, steps, budget)

    assert builder.num_candidates == len(candidates) == topk + (steps - 1) * topk * topk
    assert lanes_seen == ref_lanes
    assert cand_paths == [c[0] for c in candidates]
    assert builder.cand_tokens.tolist() == [c[0][-1] for c in candidates]
    assert builder.cand_depths.tolist() == [len(c[0]) for c in candidates]
    for c, score in zip(candidates, builder.cand_scores):
        assert (math.isnan(score) and math.isnan(c[1])) or score == c[1]
    path_to_id = {c[0]: c[2] for c in candidates}
    for c, parent in zip(candidates, builder.cand_parents):
        assert parent == (-1 if len(c[0]) == 1 else path_to_id[c[0][:-1]])

    # the reference's kept set is prefix-closed: the builder needs no repair
    kept_paths = {c[0] for c in kept}
    assert all(p[:-1] in kept_paths for p in kept_paths if len(p) > 1)

    tree, cand_ids = builder.build()
    assert_valid_tree(tree)
    assert tree.size == 1 + min(budget, len(candidates))
    assert tree.tokens[0] == root and cand_ids[0] == -1
    got = {(token_path(tree, i), float(tree.scores[i])) for i in range(1, tree.size)}
    expected = {(c[0], -math.inf if math.isnan(c[1]) else c[1]) for c in kept}
    assert got == expected
    for i in range(1, tree.size):
        assert cand_paths[cand_ids[i]] == token_path(tree, i)
    check_depth_first_best_first(tree, cand_ids, builder.cand_scores)
    assert eagle2_tree(root, *steps_data, topk, budget) == tree
    return tree, builder


def check_depth_first_best_first(tree, cand_ids, cand_scores):
    def key(node):
        return rank_key(float(cand_scores[cand_ids[node]]), int(cand_ids[node]))

    for i in range(tree.size):
        kids = tree.children(i)
        assert [key(k) for k in kids] == sorted(key(k) for k in kids)  # best child first
    # depth-first pre-order: visiting children in index order enumerates 0..n-1
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(tree.children(node)))
    assert order == list(range(tree.size))
    # the leading chain 0, 1, 2, ... follows the best child; node 1 is the best node
    node = 0
    while tree.children(node):
        assert tree.children(node)[0] == node + 1
        node += 1
    if tree.size > 1:
        assert min(range(1, tree.size), key=key) == 1


@pytest.mark.parametrize("topk, steps, budget", [(1, 5, 5), (4, 4, 15), (8, 5, 63), (3, 6, 19), (2, 2, 6)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eagle2_matches_brute_force(topk, steps, budget, seed):
    tree, _ = check_against_reference(make_model(seed, topk), topk, steps, budget)
    if topk == 1:
        assert tree.is_chain


def test_eagle2_topk1_is_the_chain():
    model = make_model(5, 1)
    builder, cand_paths, _, _ = drive_builder(model, 3, 1, 6, 4)
    tree, cand_ids = builder.build()
    assert tree.is_chain
    assert cand_ids.tolist() == [-1, 0, 1, 2, 3]
    assert token_path(tree, 4) == cand_paths[3]


def test_eagle2_near_ties():
    def tweak(path, rng, logprobs):
        base = -1.0 - 0.1 * len(path)
        return np.array([base, base - 1e-12, base, base - 2e-12])

    check_against_reference(make_model(0, 4, tweak=tweak), 4, 4, 15)
    check_against_reference(make_model(0, 4, tweak=tweak), 4, 3, 40)


def test_eagle2_child_tied_with_parent():
    def tweak(path, rng, logprobs):
        return np.array([0.0, 0.0, -0.5])

    tree, builder = check_against_reference(make_model(1, 3, tweak=tweak), 3, 4, 12)
    # every node's score is 0 or below: ties everywhere, broken by candidate id
    scores = builder.cand_scores
    assert scores[0] == 0.0 and scores[3] == 0.0  # candidate 3 is a child of 0 with logprob 0


def test_eagle2_positive_logprobs_are_clamped():
    def tweak(path, rng, logprobs):
        return np.array([0.5, 1e-9, -0.25])

    tree, builder = check_against_reference(make_model(2, 3, tweak=tweak), 3, 3, 10)
    scores = builder.cand_scores
    parents = builder.cand_parents
    for c in range(builder.num_candidates):
        parent_score = 0.0 if parents[c] == -1 else scores[parents[c]]
        assert scores[c] <= parent_score
    assert scores[0] == 0.0 and scores[1] == 0.0 and scores[2] == -0.25


@pytest.mark.parametrize("budget", [5, 13, 40])
def test_eagle2_nan_rows(budget):
    def tweak(path, rng, logprobs):
        if len(path) == 1 and path[0] % 2 == 0:
            return np.full_like(logprobs, np.nan)  # a whole NaN row
        if len(path) == 2:
            logprobs = logprobs.copy()
            logprobs[1] = np.nan  # a single NaN entry
        return logprobs

    tree, builder = check_against_reference(make_model(3, 3, tweak=tweak), 3, 4, budget)
    assert np.isnan(builder.cand_scores).any()


def test_eagle2_nan_root_row_keeps_a_tree():
    def tweak(path, rng, logprobs):
        return np.full_like(logprobs, np.nan) if path == () else logprobs

    tree, _ = check_against_reference(make_model(4, 2, tweak=tweak), 2, 3, 10)
    assert np.all(tree.scores[1:] == -np.inf)


def test_eagle2_budget_larger_than_candidates_keeps_all():
    tree, _ = check_against_reference(make_model(6, 2), 2, 3, 50)
    assert tree.size == 1 + 2 + 2 * 4


def test_eagle2_budget_zero_and_no_steps_give_root_only():
    builder = Eagle2Builder(9, 3, 0)
    builder.add_step([[1, 2, 3]], [[-1.0, -2.0, -3.0]])
    tree, cand_ids = builder.build()
    assert tree.size == 1 and cand_ids.tolist() == [-1]
    tree, cand_ids = Eagle2Builder(9, 3, 10).build()
    assert tree.tokens.tolist() == [9] and cand_ids.tolist() == [-1]


def test_eagle2_candidate_arrays_are_read_only():
    builder = Eagle2Builder(9, 2, 4)
    lanes = builder.add_step([[1, 2]], [[-1.0, -2.0]])
    assert lanes.tolist() == [0, 1]
    assert builder.cand_parents.tolist() == [-1, -1]
    assert builder.cand_depths.tolist() == [1, 1]
    for array in (builder.cand_tokens, builder.cand_parents, builder.cand_depths, builder.cand_scores, builder.lanes):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0
    lanes[0] = 5  # the returned lanes are the caller's copy
    assert builder.lanes.tolist() == [0, 1]


def test_eagle2_lanes_rank_within_the_step_only():
    builder = Eagle2Builder(0, 2, 6)
    builder.add_step([[1, 2]], [[-1.0, -3.0]])
    lanes = builder.add_step([[3, 4], [5, 6]], [[-5.0, -6.0], [-0.1, -0.2]])
    # step 1 candidates: 2:(-6) 3:(-7) 4:(-3.1) 5:(-3.2) -> best two are 4, 5
    assert lanes.tolist() == [4, 5]
    assert builder.cand_parents.tolist() == [-1, -1, 0, 0, 1, 1]
    assert builder.cand_depths.tolist() == [1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Eagle2Builder(0, 0, 5), "topk must be >= 1"),
        (lambda: Eagle2Builder(0, 2, MAX_NODES), "budget"),
        (lambda: Eagle2Builder(0, 2, -1), "budget"),
        (lambda: Eagle2Builder(-4, 2, 5), "root_token"),
        (lambda: Eagle2Builder(0, 2, 5).add_step([[1, 2], [3, 4]], [[0.0, 0.0], [0.0, 0.0]]), "expected \\(1, 2\\)"),
        (lambda: Eagle2Builder(0, 2, 5).add_step([[1, 2, 3]], [[0.0, 0.0, 0.0]]), "expected \\(1, 2\\)"),
        (lambda: Eagle2Builder(0, 2, 5).add_step([[1, 2]], [[0.0]]), "topk_logprobs has shape"),
        (lambda: Eagle2Builder(0, 2, 5).add_step([[1.0, 2.0]], [[0.0, 0.0]]), "topk_tokens must hold integers"),
        (lambda: Eagle2Builder(0, 2, 5).add_step([[1, -2]], [[0.0, 0.0]]), "negative token"),
        (lambda: Eagle2Builder(0, 2, 5).add_step([[1, 2]], [["a", "b"]]), "real log-probabilities"),
        (lambda: eagle2_tree(0, [[[1, 2]]], [], 2, 5), "one \\(tokens, logprobs\\) pair"),
    ],
)
def test_eagle2_invalid_inputs(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_eagle2_later_step_needs_one_row_per_lane():
    builder = Eagle2Builder(0, 2, 5)
    builder.add_step([[1, 2]], [[-1.0, -2.0]])
    with pytest.raises(ValueError, match="one row per lane"):
        builder.add_step([[1, 2]], [[-1.0, -2.0]])


# ---------------------------------------------------------------------------
# best-first (DDTree)


def clean(logprobs):
    return np.where(np.isnan(logprobs), -np.inf, np.minimum(logprobs, 0.0))


def brute_force_prefixes(logprobs, topk=None):
    """Every prefix with its score and rank tuple (the documented tie-break)."""
    depth, vocab = logprobs.shape
    values = clean(logprobs)
    ranks = [np.argsort(-values[d], kind="stable") for d in range(depth)]
    rank_of = [{int(t): r for r, t in enumerate(ranks[d])} for d in range(depth)]
    allowed = [set(ranks[d][: topk or vocab].tolist()) for d in range(depth)]
    prefixes = []
    for length in range(1, depth + 1):
        for seq in itertools.product(range(vocab), repeat=length):
            if not all(t in allowed[d] for d, t in enumerate(seq)):
                continue
            score = 0.0
            for d, t in enumerate(seq):
                score += values[d][t]
            prefixes.append((seq, score, tuple(rank_of[d][t] for d, t in enumerate(seq))))
    prefixes.sort(key=lambda p: (-p[1], p[2]))
    return prefixes


@FAST
@given(
    st.integers(2, 4),
    st.integers(1, 4),
    st.integers(1, MAX_NODES - 1),
    st.one_of(st.none(), st.integers(1, 4)),
    st.integers(0, 2**32 - 1),
)
def test_best_first_is_top_budget_prefixes(vocab, depth, budget, topk, seed):
    logprobs = np.log(np.random.default_rng(seed).dirichlet(np.ones(vocab), size=depth))
    prefixes = brute_force_prefixes(logprobs, topk)
    if budget < len(prefixes):
        assume(prefixes[budget - 1][1] != prefixes[budget][1])  # no tie at the cut
    tree = best_first_tree(11, logprobs, budget, topk=topk)
    assert_valid_tree(tree)
    assert tree.tokens[0] == 11 and tree.scores[0] == 0.0
    expected = {(p[0], p[1]) for p in prefixes[:budget]}
    got = {(token_path(tree, i), float(tree.scores[i])) for i in range(1, tree.size)}
    assert got == expected
    assert all(tree.scores[i + 1] <= tree.scores[i] for i in range(tree.size - 1))  # pop order


@FAST
@given(
    st.integers(2, 4),
    st.integers(1, 4),
    st.integers(1, MAX_NODES - 1),
    st.one_of(st.none(), st.integers(1, 4)),
    # repeated values, 0, positive (clamped to 0), -inf and NaN (counted as -inf) all tie
    st.lists(st.sampled_from([-0.5, -1.0, -2.0, -np.inf, 0.0, 0.3, np.nan]), min_size=16, max_size=16),
)
def test_best_first_ties_follow_the_documented_rule(vocab, depth, budget, topk, values):
    logprobs = np.array(values[: vocab * depth]).reshape(depth, vocab)
    tree = best_first_tree(11, logprobs, budget, topk=topk)
    assert tree == best_first_tree(11, logprobs.copy(), budget, topk=topk)  # deterministic
    prefixes = brute_force_prefixes(logprobs, topk)
    # ties break by rank tuple, so the pop order IS the brute-force order
    assert [token_path(tree, i) for i in range(1, tree.size)] == [p[0] for p in prefixes[:budget]]


def test_best_first_uniform_ties_prefer_lower_token_ids():
    logprobs = np.full((3, 5), np.log(0.2))
    tree = best_first_tree(0, logprobs, 7)
    assert [token_path(tree, i) for i in range(1, 8)] == [(0,), (1,), (2,), (3,), (4,), (0, 0), (0, 1)]


def test_best_first_tie_at_the_top_k_cut_on_a_large_vocab():
    logprobs = np.full((2, 1000), -10.0)
    logprobs[:, [900, 400, 7]] = -1.0  # three-way tie for the top
    # budget 2 < tie size: the cut keeps the lowest ids among the tied tokens
    tree = best_first_tree(0, logprobs, 2)
    assert [token_path(tree, i) for i in range(1, 3)] == [(7,), (400,)]
    tree = best_first_tree(0, logprobs, 5)
    assert [token_path(tree, i) for i in range(1, 6)] == [(7,), (400,), (900,), (7, 7), (7, 400)]
    tree = best_first_tree(0, logprobs, 4, topk=2)
    assert [token_path(tree, i) for i in range(1, 5)] == [(7,), (400,), (7, 7), (7, 400)]


def test_best_first_topk1_is_the_argmax_chain():
    rng = np.random.default_rng(0)
    logprobs = np.log(rng.dirichlet(np.ones(30), size=6))
    tree = best_first_tree(2, logprobs, 20, topk=1)
    assert tree.is_chain
    assert tree.tokens[1:].tolist() == np.argmax(logprobs, axis=1).tolist()
    assert np.allclose(tree.scores[1:], np.cumsum(logprobs.max(axis=1)))


def test_best_first_budget_beyond_all_prefixes_keeps_all():
    logprobs = np.log(np.array([[0.7, 0.3], [0.6, 0.4]]))
    tree = best_first_tree(0, logprobs, 63)
    assert tree.size == 1 + 2 + 4
    assert best_first_tree(0, logprobs, 0).size == 1
    assert best_first_tree(0, np.zeros((0, 5)), 10).size == 1


def test_best_first_nan_and_positive_logprobs():
    logprobs = np.array([[np.nan, 0.5, -1.0], [-0.1, np.nan, -2.0]])
    tree = best_first_tree(0, logprobs, 9)
    assert_valid_tree(tree)
    assert token_path(tree, 1) == (1,) and tree.scores[1] == 0.0  # 0.5 clamped to 0
    # token 0 is NaN at position 1, so it ranks with -inf and is kept last
    assert token_path(tree, tree.size - 1) == (0,)
    assert all(tree.scores[i] == -np.inf for i in range(1, tree.size) if token_path(tree, i)[0] == 0)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, np.zeros(5), 4), {}, "\\[depth, vocab\\]"),
        ((0, np.zeros((2, 5)), MAX_NODES), {}, "budget"),
        ((0, np.zeros((2, 5)), 4), {"topk": 0}, "topk must be >= 1"),
        ((-1, np.zeros((2, 5)), 4), {}, "root_token"),
        ((0, np.zeros((2, 0)), 4), {}, "empty vocabulary"),
        ((0, np.array([["a"]]), 4), {}, "real log-probabilities"),
    ],
)
def test_best_first_invalid_inputs(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        best_first_tree(*args, **kwargs)


# ---------------------------------------------------------------------------
# static trees


def test_static_topology_breadth_first():
    parents = static_topology((3, 2, 1))
    assert parents.dtype == np.int32
    assert parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9]
    assert static_topology(()).tolist() == [-1]
    assert static_topology((63,)).shape == (64,)
    assert static_topology((2, 2, 2, 2, 2)).shape == (63,)


@FAST
@given(st.lists(st.integers(1, 4), min_size=0, max_size=6))
def test_static_tree_tokens_follow_the_table(branching):
    count = 1
    level = 1
    for b in branching:
        level *= b
        count += level
    if count > MAX_NODES:
        with pytest.raises(ValueError, match="MAX_NODES"):
            static_topology(branching)
        return
    table = np.arange(len(branching) * 4).reshape(len(branching), 4) + 100
    tree = static_tree(5, branching, table)
    assert_valid_tree(tree)
    assert tree.size == count and tree.tokens[0] == 5
    depths = tree.depths.tolist()
    assert depths == sorted(depths)  # breadth-first
    for i in range(1, tree.size):
        assert len(tree.children(i)) == (branching[depths[i]] if depths[i] < len(branching) else 0)
        c = tree.children(int(tree.parents[i])).index(i)
        assert tree.tokens[i] == table[depths[i] - 1][c]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, (16, 16)), "more than MAX_NODES"),
        ((0, (MAX_NODES,)), "more than MAX_NODES"),
        ((0, (2, 0)), "branching\\[1\\]"),
        ((0, (2, 1.5)), "branching\\[1\\]"),
    ],
)
def test_static_topology_invalid(args, message):
    with pytest.raises(ValueError, match=message):
        static_tree(args[0], args[1], np.zeros((2, 64), dtype=np.int64))
    with pytest.raises(ValueError, match=message):
        static_topology(args[1])


@pytest.mark.parametrize(
    "table, message",
    [
        (np.zeros((1, 3), dtype=np.int64), "has 1 rows but branching has 2"),
        (np.zeros((2, 2), dtype=np.int64), "width 2 but depth 1 needs 3"),
        (np.zeros((2, 3)), "token_table must hold integers"),
        (np.zeros(3, dtype=np.int64), "\\[depth, width\\]"),
        (-np.ones((2, 3), dtype=np.int64), "negative token"),
    ],
)
def test_static_tree_invalid_table(table, message):
    with pytest.raises(ValueError, match=message):
        static_tree(0, (3, 2), table)


# ---------------------------------------------------------------------------
# every builder yields parents[i] < i


@FAST
@given(st.integers(1, 8), st.integers(1, 6), st.integers(0, MAX_NODES - 1), st.integers(0, 1000))
def test_every_builder_yields_valid_trees(topk, steps, budget, seed):
    model = make_model(seed, topk)
    builder, _, _, _ = drive_builder(model, 1, topk, steps, budget)
    tree, _ = builder.build()
    assert_valid_tree(tree)
    logprobs = np.log(np.random.default_rng(seed).dirichlet(np.ones(10), size=steps))
    assert_valid_tree(best_first_tree(1, logprobs, budget, topk=topk))
    assert_valid_tree(chain_tree(1, np.arange(steps), logprobs[:, 0]))


def test_eagle2_given_lanes_are_recorded_as_chosen():
    # a drafter ranking on the device passes its own lane choice; the builder records that tree
    b = Eagle2Builder(root_token=0, topk=2, budget=6)
    b.add_step([[5, 6]], [[-0.1, -0.2]], lanes=[1, 0])
    assert b.lanes.tolist() == [1, 0]
    lanes = b.add_step([[7, 8], [9, 10]], [[-0.3, -0.4], [-0.5, -0.6]], lanes=[3, 0])
    # row 0 expanded candidate 1 (token 6), row 1 candidate 0 (token 5)
    assert b.cand_parents.tolist() == [-1, -1, 1, 1, 0, 0]
    assert lanes.tolist() == [5, 2]
    with pytest.raises(ValueError, match="lanes"):
        b.add_step([[1, 2], [3, 4]], [[-1.0, -1.0], [-1.0, -1.0]], lanes=[4])
    tree, cand_ids = b.build()
    assert tree.size == 7 and (tree.parents[1:] < np.arange(1, 7)).all()
