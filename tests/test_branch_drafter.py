"""Branches drafted as batch rows of the draft model (`--tree-branches`): the layout, exact
output, a draft cache whose every row holds the emitted text, and the errors (CPU)."""
import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import tiny
from mlx_treespec.drafters.branch import BranchDrafter, branch_layout, max_nodes
from mlx_treespec.generate import RoundStats, make_drafter, main, tree_generate_step
from mlx_treespec.tree import DraftTree

N = 200
SHAPES = {
    "k3s6r2": dict(tree_topk=3, tree_depth=6, tree_branches=2),
    "k1s5r3-always": dict(tree_topk=1, tree_depth=5, tree_branches=3, tree_fork_below=1.0),
    "k4s6r4": dict(tree_topk=4, tree_depth=6, tree_branches=4, tree_fork_below=0.9),
    "k2s8r2-never": dict(tree_topk=2, tree_depth=8, tree_branches=2, tree_fork_below=0.0),
}


@pytest.fixture(scope="module")
def pairs():
    cache = {}

    def get(family, variant="f32"):
        if (family, variant) not in cache:
            cfg = dict(tiny.CONFIGS[family], **({"head_dim": 32} if variant == "kv8" else {}))
            target = tiny.build(cfg)
            # a sliding-window target gets an attention-only drafter of the same vocabulary
            draft = tiny.perturbed(target) if family not in ("gemma3", "gemma4") else tiny.perturbed(
                tiny.build(tiny.CONFIGS["qwen3"]), noise=0.0)
            if variant == "bf16":
                target.set_dtype(mx.bfloat16)
                draft.set_dtype(mx.bfloat16)
            cache[(family, variant)] = (target, draft)
        return cache[(family, variant)]

    return get


def prompt_tokens(seed=0, n=12):
    return np.random.default_rng(seed).integers(0, tiny.VOCAB, n).tolist()


class Recorder(BranchDrafter):
    """Counts rounds whose accepted path runs into a branch's body, and checks every row of the
    draft cache after each commit against a fresh forward of the text it should hold."""

    def __init__(self, *a, check_cache=False, **kw):
        super().__init__(*a, **kw)
        self.into_branch = 0
        self.forks = 0
        self.fork_steps = set()
        self.check_cache = check_cache
        self.text = []

    def prefill(self, prompt):
        super().prefill(prompt)
        self.text = list(prompt)

    def commit(self, draft, path, emitted):
        if draft.extra is not None:
            S, forks, order, _ = draft.extra
            self.forks += len(forks)
            self.fork_steps.add(forks)
            self.into_branch += any(order[n][0] > 0 and order[n][1] > forks[order[n][0] - 1] for n in path[1:])
        super().commit(draft, path, emitted)
        self.text += list(emitted)
        if self.check_cache:
            held = self.text[: len(self.text) - len(self.pending)]
            assert self.text[len(held):] == self.pending
            ref = make_prompt_cache(self.model)
            self.model(mx.broadcast_to(mx.array(held)[None], (self.rows, len(held))), cache=ref)
            for ours, theirs in zip(self.cache, ref):
                assert ours.offset == theirs.offset == len(held)
                assert mx.array_equal(ours.keys[..., : len(held), :], theirs.keys[..., : len(held), :])
                assert mx.array_equal(ours.values[..., : len(held), :], theirs.values[..., : len(held), :])


def recorder(draft, shape, **kw):
    return Recorder(draft, topk=shape.get("tree_topk", 1), depth=shape["tree_depth"],
                    rows=shape["tree_branches"], fork_below=shape.get("tree_fork_below", 0.6), **kw)


def test_layout_by_hand():
    # spine of 4, two runners-up per step, a branch forked at step 1: its head is the first
    # runner-up of step 1 (a child of spine node 1), its body hangs below it
    parents, order = branch_layout(4, 3, (1,))
    assert parents.tolist() == [-1, 0, 1, 2, 3, 0, 0, 1, 1, 2, 2, 3, 3, 7, 13]
    assert order[7] == (1, 1) and order[13] == (1, 2) and order[14] == (1, 3)
    assert order[1:5] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert all(o == (-1, -1) for i, o in enumerate(order) if i in (5, 6, 8, 9, 10, 11, 12))
    # K = 1: a branch head alone where the spine forked
    parents, order = branch_layout(3, 1, (0, 2))
    assert parents.tolist() == [-1, 0, 1, 2, 0, 2, 4, 6]
    assert order[4] == (1, 0) and order[5] == (2, 2) and order[6] == (1, 1) and order[7] == (1, 2)


@pytest.mark.parametrize("seed", range(30))
def test_layout_is_a_tree_whose_row_nodes_sit_at_their_step(seed):
    rng = np.random.default_rng(seed)
    S, K, R = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
    forks = tuple(sorted(rng.choice(max(S - 1, 1), size=min(R - 1, max(S - 1, 0)), replace=False).tolist())) if S > 1 else ()
    parents, order = branch_layout(S, K, forks)
    tree = DraftTree(np.zeros(len(parents), np.int64), parents)  # valid: parents[i] < i
    assert len(parents) <= max_nodes(K, S, R)
    for node, (r, s) in enumerate(order):
        if r >= 0:
            assert tree.depths[node] == s + 1
            # the path to a row node is row r's tokens: row 0's up to the fork, then its own
            for anc in tree.path_to(node)[1:]:
                ra, sa = order[anc]
                assert ra == (r if r > 0 and sa >= forks[r - 1] else 0)
    assert sum(1 for r, _ in order if r > 0) == sum(S - f for f in forks)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "phi3", "mistral", "qwen3_moe", "gemma3"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_identical_to_mlx_lm(pairs, family, shape):
    target, draft = pairs(family)
    prompt = prompt_tokens()
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N)]
    stats = RoundStats()
    drafter = recorder(draft, SHAPES[shape])
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=N, stats=stats)]
    assert out == ref
    assert len(set(ref)) >= 5 and sum(stats.accepted) > 0
    if SHAPES[shape].get("tree_fork_below") == 0.0:
        assert drafter.forks == 0
    if SHAPES[shape].get("tree_fork_below") == 1.0:  # the first steps, whatever the probabilities
        assert drafter.fork_steps <= {(0, 1), (0,), ()} and (0, 1) in drafter.fork_steps
    if shape == "k1s5r3-always" and family != "gemma3":  # gemma3's drafter is an unrelated model
        assert drafter.into_branch > 0, "no round accepted into a branch: the commit's row copy is untested"


@pytest.mark.parametrize("variant,kw", [("bf16", {}), ("f32", dict(max_kv_size=16)),
                                        ("kv8", dict(kv_bits=8, kv_group_size=32, quantized_kv_start=40))])
def test_greedy_identical_variants(pairs, variant, kw):
    target, draft = pairs("qwen3", variant)
    prompt = prompt_tokens(2, n=20)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N, **kw)]
    out = [t for t, _, _ in tree_generate_step(prompt, target, make_drafter(draft, **SHAPES["k3s6r2"]),
                                               max_tokens=N, **kw)]
    assert out == ref


@pytest.mark.parametrize("shape", ["k3s6r2", "k1s5r3-always"])
def test_every_row_of_the_draft_cache_holds_the_emitted_text(pairs, shape):
    # after each commit, bitwise what a fresh forward of the text builds, on every row: the
    # accepted row's K/V were copied over the rows that forked away from it
    target, draft = pairs("qwen3")
    drafter = recorder(draft, SHAPES[shape], check_cache=True)
    out = [t for t, _, _ in tree_generate_step(prompt_tokens(4), target, drafter, max_tokens=120)]
    assert len(out) == 120 and drafter.into_branch > 0


def test_bad_shapes_are_refused(pairs):
    target, draft = pairs("qwen3")
    for kw, words in [(dict(tree_branches=0), "1..8"), (dict(tree_branches=9), "1..8"),
                      (dict(tree_branches=2, tree_fork_below=1.5), "probability in 0..1"),
                      (dict(tree_branches=8, tree_topk=4, tree_depth=12), "at most 64 fit"),
                      (dict(tree_branches=2, tree_budget=8), "not --draft-block-size, --tree-budget"),
                      (dict(tree_branches=2, tree_lanes=1), "not --draft-block-size, --tree-budget"),
                      (dict(tree_fork_below=0.5, draft_block_size=4), "not --draft-block-size")]:
        with pytest.raises(ValueError, match=words):
            make_drafter(draft, **kw)
    sliding = tiny.build(tiny.CONFIGS["gemma3"])
    with pytest.raises(ValueError, match="plain KV caches.*RotatingKVCache.*--tree-branches 1"):
        make_drafter(sliding, tree_branches=2)


def test_cli_branch_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--drafter", "lookup", "--tree-branches", "2", "--max-tokens", "4"])
    assert e.value.code == 2
    assert "need a draft model" in capsys.readouterr().err
    main(["--tree-topk", "3", "--tree-depth", "6", "--tree-branches", "2", "--max-tokens", "24",
          "--verbose", "T"])
    out = capsys.readouterr().out
    assert out.count("==========") == 2 and "emitted/verify" in out


def test_probe_topology_is_the_largest_layout(pairs):
    # the GPU exactness probe verifies the biggest tree a round of this shape can send
    _, draft = pairs("qwen3")
    for K, S, R in [(3, 8, 2), (1, 5, 3), (4, 6, 4), (2, 1, 3)]:
        d = BranchDrafter(draft, topk=K, depth=S, rows=R, fork_below=1.0)
        parents = d.probe_parents()
        DraftTree(np.zeros(len(parents), np.int64), parents)
        forks = min(R - 1, S - 1)
        assert len(parents) == 1 + S * K + sum(S - f for f in range(forks)) - (forks if K > 1 else 0)
        assert len(parents) <= max_nodes(K, S, R)


@pytest.mark.parametrize("K,S,R,P", [(3, 6, 3, 1.0), (1, 5, 3, 1.0), (2, 6, 2, 1.0), (4, 5, 4, 0.9), (3, 4, 1, 1.0)])
def test_every_node_s_children_are_its_best_draft_tokens(pairs, K, S, R, P):
    # each node's children are the draft model's top tokens after its path (as many as it has:
    # K at spine nodes, K + 1 where a branch forks with K = 1, one in a branch), and a branch
    # starts from the best token after the spine's: checked over several rounds of a generation
    target, draft = pairs("qwen3")
    drafter = BranchDrafter(draft, topk=K, depth=S, rows=R, fork_below=P)
    prompt = prompt_tokens(6)
    checked = 0

    def logits_after(path_tokens):
        return draft(mx.array(path_tokens)[None])[0, -1].astype(mx.float32)

    original = drafter.draft

    def checking_draft(root, max_depth):
        nonlocal checked
        d = original(root, max_depth)
        text = emitted[:-1]  # the context before the root (node 0 is the last emitted token)
        assert emitted[-1] == root
        tree = DraftTree(np.array(d.tokens).astype(np.int64), d.host_parents())
        for node in range(tree.size):
            kids = list(tree.children(node))
            if not kids:
                continue
            lg = np.array(logits_after(text + tree.tokens[tree.path_to(node)].tolist()))
            got = sorted(lg[tree.tokens[kids]].tolist(), reverse=True)
            assert got == sorted(lg, reverse=True)[: len(kids)], f"node {node}"
            assert len(set(tree.tokens[kids].tolist())) == len(kids)
            checked += 1
        _, forks, order, _ = d.extra if d.extra is not None else (0, (), [(-1, -1)], 0)
        for node, (r, s) in enumerate(order):
            if r > 0 and s == forks[r - 1]:  # a branch head: the best of its spine step's others
                sib = [c for c in tree.children(tree.parents[node]) if order[c][0] != 0]
                lg = np.array(logits_after(text + tree.tokens[tree.path_to(int(tree.parents[node]))].tolist()))
                assert lg[tree.tokens[node]] == max(lg[tree.tokens[sib]])
        return d

    drafter.draft = checking_draft
    emitted = list(prompt)  # the draft runs after the previous round's tokens were consumed
    for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=40):
        emitted.append(t)
    assert checked > 0
