"""A head's static tree (static_tree.py): its layout and drafting plan from rank paths, exact
output through the round loop and queued rounds (the same root paths, position by position), the
fit, the file in the head's folder, and the options that select it."""
import json

import numpy as np
import pytest

import tiny
from test_head_drafter import N, LaneOracle, _round_loop_then_queued, assert_same_root_paths, plain
from test_heads import make_eagle3, make_mtp
from mlx_treespec import RoundStats, make_drafter, tree_generate_step
from mlx_treespec.drafters.eagle3 import load_eagle3
from mlx_treespec.drafters.head import HeadDrafter
from mlx_treespec.spec import DraftSpec
from mlx_treespec.static_tree import (StaticTree, best_rank_tree, fit_static_tree, load_static_paths,
                                      rank_rounds, save_static_paths, static_tree)

# the shape of a fitted tree: a spine, a lane from the root's second child and one from the
# spine's second node, leaves of rank 1 and 4
PATHS = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (4,), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 1))


def test_layout_and_plan():
    t = StaticTree(PATHS)
    # nodes by depth, then ranks: a parent before its children
    assert t.paths[:3] == ((0,), (1,), (4,)) and t.size == 11 and t.depth == 4 and t.topk == 5
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 6, 7]
    assert t.ranks.tolist() == [0, 0, 1, 4, 0, 1, 0, 0, 1, 0, 0, 0]
    # step 0 forwards the root; step s the depth-s nodes with children, padded to the width
    assert [r.tolist() for r in t.rows] == [[0], [1, 2, -1], [4, 5, 6], [7, -1, -1]]
    assert t.width == 3 and t.row_of.tolist() == [0, 0, 1, -1, 0, 1, 2, 0, -1, -1, -1, -1]
    # each node's token among the steps' candidates stacked (step 0's row, then W rows a step): (row, rank)
    assert t.source.tolist() == [[0, 0], [0, 1], [0, 4], [1, 0], [1, 1], [2, 0], [4, 0], [4, 1], [5, 0],
                                 [6, 0], [7, 0]]
    seen = t.visible_rows()  # [steps - 1, W, step rows]: its ancestors' rows and its own
    assert seen.shape == (3, 3, 9)
    assert np.flatnonzero(seen[2, 0]).tolist() == [0, 3, 6]  # (0, 0, 0): (0,), (0, 0), itself
    assert np.flatnonzero(seen[1, 2]).tolist() == [1, 5]  # (1, 0): (1,), itself
    assert np.flatnonzero(seen[2, 1]).tolist() == [7]  # padding: itself only
    assert t.within(2).paths == ((0,), (1,), (4,), (0, 0), (0, 1), (1, 0))
    assert static_tree(PATHS, 3) is static_tree(PATHS, 3) and static_tree(PATHS, 3).paths == ((0,), (1,), (0, 0))


@pytest.mark.parametrize("paths, n, says", [
    (((0, 0), (0,)), None, "before its parent"), (((0,), (0,)), None, "repeats"),
    (((0,), (8,)), None, "ranks are 0..7"), (((0,),), 2, "has 1 paths"), ((), None, "of 0 nodes")])
def test_bad_paths_are_refused(paths, n, says):
    with pytest.raises(ValueError, match=says):
        StaticTree(paths, n)


class StaticOracle(LaneOracle):
    """LaneOracle's rounds (the target's own tokens along one root path, off the spine at some
    steps) over a static tree, in the round loop and queued (`static_ahead`)."""

    def static_ahead(self, root, rows, count, path=None):
        if rows is not None:
            self.text += np.array(path[1 : count.item()]).tolist() + [int(root.item())]
        return self._oracle(super().static_ahead(root, rows, count, path), queued=True)


@pytest.mark.parametrize("kind, hand_back", [("mtp-qwen3_5_tied", None), ("eagle3-safeailab", 3)])
def test_queued_static_trees_draft_what_the_round_loop_drafts(tmp_path, monkeypatch, kind, hand_back):
    # queued (the GPU path, here on CPU), a static tree is drafted in one compiled call: the
    # slots, then each step's rows over their parents' output hidden states, each row's ranked
    # candidates naming its children. Its trees propose the round loop's root paths, position by
    # position, through accepted paths off the spine and a hand-back; tokens are plain decoding's
    # (the MTP case over a hybrid target)
    family, name = kind.split("-", 1)
    head, target = (make_mtp(tmp_path, name)[:2] if family == "mtp" else make_eagle3(tmp_path, name)[:2])
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()
    opts = dict(static=StaticTree(PATHS))
    host, queued, stats = _round_loop_then_queued(StaticOracle, head, target, prompt, opts, hand_back, monkeypatch)
    assert host.ahead == host.static_ahead and host.queues_trees
    assert all(n == 12 for n, k in zip(stats.nodes, stats.drafter) if k == "queued")
    assert_same_root_paths(host, queued, stats, hand_back, depth=4)


@pytest.mark.parametrize("queued", [False, True])
def test_static_trees_are_plain_decoding(tmp_path, monkeypatch, queued):
    # trees of one node, of one lane, of leaves only, and the fitted shape, through the round
    # loop (near max_tokens: the tree cut to the depth left) and queued: plain decoding's tokens
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: queued)
    head, target = make_eagle3(tmp_path, "safeailab")[:2]
    prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, 12).tolist()
    ref = plain(target, prompt)
    for paths in (((0,),), ((0,), (0, 0), (0, 0, 0)), ((0,), (1,), (2,)), PATHS):
        stats = RoundStats()
        out = [t for t, _, _ in tree_generate_step(prompt, target, HeadDrafter(head, static=StaticTree(paths)),
                                                   max_tokens=N, stats=stats)]
        assert out == ref, paths
        assert (stats.drafter[0] == "queued") == queued, paths


def test_fit_save_load_and_options(tmp_path):
    head, target = make_eagle3(tmp_path, "safeailab")[:2]
    folder = tmp_path / "safeailab"
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, tiny.VOCAB, 10).tolist() for _ in range(2)]
    paths, emitted, chain = fit_static_tree(target, head, prompts, nodes=12, depth=4, max_tokens=24)
    # a tree in the order taken: every prefix of it is a tree; at least the chain's rounds
    assert len(paths) == 12 and all(StaticTree(paths, n) for n in range(1, 13))
    assert emitted > chain == 1.0  # (a random head: its chain is never accepted, its fitted paths are)
    save_static_paths(folder, paths, meta=dict(note="test"))
    assert load_static_paths(folder) == tuple(paths)
    loaded = load_eagle3(str(folder), target)
    assert loaded.static_paths == tuple(paths)
    spec = DraftSpec.parse("eagle3-static:8")
    assert spec == DraftSpec.from_options("eagle3", tree_static=8) and DraftSpec.parse(spec.arm) == spec
    assert spec.label == "eagle3 static tree N=8" and spec.requested_nodes == 9
    drafter = spec.build(loaded)
    assert drafter.static.size == 8 and drafter.static.paths == StaticTree(paths, 8).paths
    assert len(drafter.probe_parents()) == 9
    d = make_drafter(str(folder), drafter="eagle3", target=target, tree_static=12)
    assert d.static.size == 12
    # refusals name the fix
    with pytest.raises(ValueError, match="give at most 12"):
        DraftSpec.parse("eagle3-static:13").build(loaded)
    with pytest.raises(ValueError, match="no fitted static tree"):
        DraftSpec.parse("eagle3-static:4").build(head if head.static_paths is None else None)
    with pytest.raises(ValueError, match="--drafter mtp or eagle3"):
        DraftSpec.from_options("model", tree_static=4)
    with pytest.raises(ValueError, match="is the whole shape"):
        DraftSpec.from_options("eagle3", tree_static=4, tree_depth=3)
    (folder / "static_tree.json").write_text(json.dumps(dict(paths=[[0, 0], [0]])))
    with pytest.raises(ValueError, match="fit it again"):
        load_static_paths(folder)


def test_rank_rounds_and_the_best_static_tree():
    # one prompt, 8 round-start positions: the head's second choice is right at depth 1 half the time
    seqs = [(0, 0), (1, 0), (0, 0), (1, 0), (0, 5), (1, 5), (5, 0), (0, 0)]
    chain = {(0,), (0, 0)}
    emitted, starts = rank_rounds([seqs], chain)
    # rounds start at 0 (accepts 2: emits 3), 3 (rank 1: emits 1), 4 (emits 2), 6 (emits 1), 7 (emits 3)
    assert starts == [seqs[0], seqs[3], seqs[4], seqs[6], seqs[7]]
    assert emitted == (3 + 1 + 2 + 1 + 3) / 5
    assert best_rank_tree(starts, 2, cap=8) == [(0,), (0, 0)]  # (0,) at 3 starts, (0, 0) at 2, (1,) at 1
    # a parent before its children: (1, 0) only under (1,); in the order taken
    assert best_rank_tree([(1, 0), (1, 0), (0, 3)], 2, cap=8) == [(1,), (1, 0)]
    assert best_rank_tree([(8, 0)], 3, cap=8) == []  # rank cap: no node holds it
    emitted, _ = rank_rounds([[(1, 0), (1, 0), (0, 0)]], {(1,), (1, 0)})
    assert emitted == 3.0  # the first round emits 3 and ends the prompt
