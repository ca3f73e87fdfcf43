"""The model drafter's on-device EAGLE-2 re-rank equals the host builder's choice."""
import numpy as np
import mlx.core as mx
import pytest

from mlx_treespec.builders import Eagle2Builder
from mlx_treespec.drafters.model import keep_best, lane_candidates
from mlx_treespec.tree import DraftTree


def _paths(tokens, parents):
    tree = DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64))
    return {tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(tree.size)}


@pytest.mark.parametrize("seed", range(40))
def test_keep_best_matches_eagle2_builder(seed):
    rng = np.random.default_rng(seed)
    K, S = int(rng.integers(1, 5)), int(rng.integers(1, 7))
    n_cand = K + (S - 1) * K * K
    budget = int(rng.integers(1, min(n_cand, 63) + 1))
    builder = Eagle2Builder(7, K, budget)
    for s in range(S):
        rows = 1 if s == 0 else K
        # distinct tokens per row (top-K); coarse log-probs make ties, all exact in float32
        tokens = np.stack([rng.permutation(50)[:K] for _ in range(rows)])
        logprobs = -rng.integers(0, 6, size=(rows, K)) / 8.0
        parent_scores = np.zeros(1) if s == 0 else builder.cand_scores[builder.lanes]
        new = (parent_scores[:, None] + logprobs).reshape(-1)
        lanes = np.argsort(-new, kind="stable")[:K]  # the drafter's own lane pick
        builder.add_step(tokens, logprobs, lanes=lanes)
    host_tree, cand_ids = builder.build()
    sel, parents, depths, tokens, anc = keep_best(
        7, mx.array(builder.cand_tokens), mx.array(builder.cand_scores.astype(np.float32)),
        mx.array(builder.cand_parents), builder.cand_depths, budget)
    assert sorted(np.array(sel).tolist()) == sorted(cand_ids[1:].tolist())
    parents, tokens = np.array(parents), np.array(tokens)
    assert (parents[1:] < np.arange(1, len(parents))).all() and parents[0] == -1
    assert _paths(tokens, parents) == _paths(host_tree.tokens, host_tree.parents)
    device_tree = DraftTree(tokens.astype(np.int64), parents)
    assert np.array_equal(np.array(anc), device_tree.ancestor_mask())
    assert np.array_equal(np.array(depths), device_tree.depths)
    # the spine (path to the best-ranked deepest candidate) is nodes 1..d: a contiguous commit
    d = device_tree.max_depth
    assert np.array_equal(parents[: d + 1], np.arange(d + 1) - 1)
    order = np.lexsort((cand_ids[1:], -builder.cand_scores[cand_ids[1:]]))
    deepest = max(builder.cand_depths[cand_ids[1:]])
    best_deep = next(c for c in cand_ids[1:][order] if builder.cand_depths[c] == deepest)
    assert np.array(sel).tolist()[d - 1] == best_deep


def test_keep_best_nan_scores_rank_last():
    scores = mx.array([-1.0, float("nan"), -0.5, -2.0])
    sel, parents, depths, tokens, _ = keep_best(
        1, mx.array([10, 11, 12, 13]), scores, mx.array([-1, -1, -1, -1]), np.ones(4, np.int32), 3)
    assert sorted(np.array(sel).tolist()) == [0, 2, 3]
    assert np.array(sel).tolist()[0] == 2  # the best one leads (all are at depth 1)
    assert sorted(np.array(tokens).tolist()[1:]) == [10, 12, 13]


@pytest.mark.parametrize("G", [1, 3])
def test_lane_candidates_score_as_eagle2_scores_each_lane(G):
    # after the ranked lane steps each lane goes on by its own argmax; its steps' candidates are
    # each lane's top K, scored as EAGLE-2 scores a candidate (the lane's score so far plus the
    # token's log-prob, at most 0), the argmax in its top-K slot, its parent the lane's node
    # (the argmax of the step before); an argmax tied beyond the top K still takes a slot
    rng = np.random.default_rng(G)
    L, K, V, first = 2, 3, 9, 7
    logits = rng.normal(size=(G, L, V)).astype(np.float32)
    logits[-1, 1, :5] = 2.0  # five tie for the top: the argmax (token 0) must still be kept
    argmax = logits.argmax(-1)
    lane_scores, lane_cands = np.array([-0.5, -1.25], np.float32), np.array([3, 5], np.int32)
    tok, score, parent, ids = (np.array(a) for a in lane_candidates(
        mx.array(lane_scores), mx.array(lane_cands), mx.array(logits), mx.array(argmax), first, K))
    tok, score, parent = tok.reshape(G, L, K), score.reshape(G, L, K), parent.reshape(G, L, K)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    running, node = lane_scores.astype(np.float64), lane_cands
    for g in range(G):
        for i in range(L):
            assert len(set(tok[g, i].tolist())) == K and argmax[g, i] in tok[g, i]
            # the lane's K best (up to ties at the K-th)
            assert lp[g, i, tok[g, i]].min() >= np.sort(lp[g, i])[-K] - 1e-6
            np.testing.assert_allclose(score[g, i], running[i] + np.minimum(lp[g, i, tok[g, i]], 0), atol=1e-5)
            assert (parent[g, i] == node[i]).all()
            slot = tok[g, i].tolist().index(argmax[g, i])
            assert ids[g, i] == first + (g * L + i) * K + slot
        running = running + np.minimum(lp[g, np.arange(L), argmax[g]], 0)
        node = ids[g]


CACHE_SHAPES = [dict(draft_block_size=4), dict(tree_topk=3, tree_depth=4, tree_budget=12),
                dict(tree_topk=4, tree_depth=6, tree_budget=16, tree_lanes=1),
                dict(tree_topk=4, tree_depth=5, tree_budget=20, tree_lanes=1),
                dict(tree_topk=3, tree_depth=4, tree_budget=12, tree_lanes=2),
                dict(tree_topk=3, tree_depth=4, tree_budget=21, tree_lanes=2)]  # (fixed lanes)


@pytest.mark.parametrize("family,shape", [("qwen3", s) for s in CACHE_SHAPES]
                         + [("qwen3_5", s) for s in CACHE_SHAPES[:3] + CACHE_SHAPES[-1:]])
def test_draft_cache_holds_what_plain_decoding_builds(family, shape):
    # after every run the drafter's cache holds exactly the emitted text minus its pending
    # tokens, as a plain forward of that text builds it (bitwise on CPU); for a hybrid drafter
    # its recurrent and conv states too (rolled back by replaying the accepted tokens)
    import tiny
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_treespec import make_drafter, tree_generate_step

    target = tiny.build(tiny.CONFIGS[family])
    draft = tiny.perturbed(target)
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 9).tolist()
    drafter = make_drafter(draft, **shape)
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=60)]
    text = (prompt + out)[: len(prompt) + len(out) - len(drafter.pending)]
    assert (prompt + out)[len(text):] == drafter.pending
    ref = make_prompt_cache(draft)
    draft(mx.array(text)[None], cache=ref)
    for ours, theirs in zip(drafter.cache, ref):
        if type(ours).__name__ == "ArraysCache":
            assert mx.array_equal(ours[0], theirs[0]) and mx.array_equal(ours[1], theirs[1])
            continue
        assert ours.offset == theirs.offset == len(text)
        assert mx.array_equal(ours.keys[..., : len(text), :], theirs.keys[..., : len(text), :])
        assert mx.array_equal(ours.values[..., : len(text), :], theirs.values[..., : len(text), :])


def test_one_lane_full_budget_is_the_ranked_tree():
    # with a budget that keeps every candidate, the fixed spine-and-siblings layout proposes the
    # tree EAGLE-2's re-rank would: the same root paths, the spine first
    import tiny
    from mlx_treespec.drafters.model import ModelDrafter

    target = tiny.build(tiny.CONFIGS["qwen3"])
    draft = tiny.perturbed(target)
    prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, 9).tolist()
    fixed = ModelDrafter(draft, topk=4, depth=5, budget=20, lanes=1)
    ranked = ModelDrafter(draft, topk=4, depth=5, budget=20, lanes=1)
    ranked._lanes_and_siblings = lambda root, logits, rnd, depth, budget: ranked._ranked_siblings(
        root, *ranked._spine(logits, rnd, depth), rnd, budget)
    fixed.prefill(prompt)
    ranked.prefill(prompt)
    for root in np.random.default_rng(2).integers(0, tiny.VOCAB, 6).tolist():
        a, b = fixed.draft(root, 10), ranked.draft(root, 10)
        assert a.layout.parents is not None and b.layout.parents is None  # the fixed layout needs no re-rank
        ta, pa = np.array(a.tokens), a.layout.host_parents()
        assert _paths(ta, pa) == _paths(np.array(b.tokens), b.layout.host_parents())
        assert np.array_equal(pa[:6], np.arange(6) - 1)  # the spine is nodes 1..5
        tree = DraftTree(ta.astype(np.int64), pa)
        assert np.array_equal(np.array(a.layout.device[2]), tree.ancestor_mask())
        assert np.array_equal(np.array(a.layout.device[1]), tree.depths)
        for d in (fixed, ranked):  # nothing accepted: the next root follows this one
            d.commit(a if d is fixed else b, np.array([0]), [root])


def test_lanes_parents_layout():
    # one lane: the spine, then each step's runners-up (the one-lane tree); two lanes: lane 0 is
    # the spine (nodes 1..S), lane 1 follows, then the root's other children and each step's
    # leaves, lane by lane; every candidate of EAGLE-2's count is a node
    from mlx_treespec.drafters.model import keeps_every_candidate, lanes_parents
    from mlx_treespec.tree import eagle2_candidates

    assert lanes_parents(3, 2).tolist() == [-1, 0, 1, 2, 0, 1, 2]
    assert lanes_parents(3, 3, 2).tolist() == [-1, 0, 1, 2, 0, 4, 5, 0, 1, 1, 4, 4, 2, 2, 5, 5]
    for S, K, L in [(1, 2, 2), (4, 3, 2), (5, 4, 3), (6, 4, 1)]:
        p = lanes_parents(S, K, L)
        assert len(p) == 1 + eagle2_candidates(K, L, S)
        assert np.array_equal(p[: S + 1], np.arange(S + 1) - 1)  # spine first
        tree = DraftTree(np.arange(len(p)), p)
        assert tree.depths.max() == S and (np.bincount(p[1:], minlength=len(p)) <= K).all()
        assert keeps_every_candidate(K, L, S, len(p) - 1) and not keeps_every_candidate(K, L, S, len(p) - 2)
