"""Hybrid GatedDeltaNet targets (qwen3_5, qwen3_next) verify trees exactly, end to end (CPU)."""
import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import tiny
from mlx_treespec import RoundStats, make_drafter, tree_generate_step

HYBRIDS = ["qwen3_5", "qwen3_next", "qwen3_next_dense"]
SHAPES = [(1, 1), (4, 1), (3, 2), (5, 3)]  # (depth, siblings per depth)


@pytest.fixture(scope="module")
def pair():
    built = {}

    def get(family):
        if family not in built:
            target = tiny.build(tiny.CONFIGS[family])
            built[family] = (target, tiny.perturbed(target))
        return built[family]

    return get


def prompt_tokens(seed=0, n=12):
    return np.random.default_rng(seed).integers(0, tiny.VOCAB, n).tolist()


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("depth,width", SHAPES)
def test_hybrid_greedy_identical_to_mlx_lm(pair, family, depth, width):
    target, draft = pair(family)
    prompt = prompt_tokens()
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=100)]
    stats = RoundStats()
    drafter = tiny.SiblingDrafter(draft, depth, width)
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=100, stats=stats)]
    assert out == ref
    assert len(set(ref)) >= 5
    assert sum(stats.accepted) > 0
    assert any(a < d for a, d in zip(stats.accepted, stats.depth))


def states(cache):
    out = []
    for c in cache:
        if type(c).__name__ == "ArraysCache":
            out += [c[0], c[1]]
        else:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_recurrent_and_conv_state_equal_plain_decoding_each_round(pair, family):
    target, draft = pair(family)
    prompt = prompt_tokens(1)
    for n in (1, 2, 5, 9, 16, 30):  # ends of different rounds
        ours = make_prompt_cache(target)
        drafter = tiny.SiblingDrafter(draft, 4, 2)
        out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=n, prompt_cache=ours)]
        ref_cache = make_prompt_cache(target)
        ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=n, prompt_cache=ref_cache)]
        assert out == ref
        for a, b in zip(states(ours), states(ref_cache)):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert mx.array_equal(a, b)


def test_hybrid_target_with_attention_drafter(pair):
    # the shipped pairing: a hybrid target and an attention-only drafter of the same vocabulary
    target, _ = pair("qwen3_5")
    draft = tiny.build(tiny.CONFIGS["qwen3"], seed=5)
    prompt = prompt_tokens(2)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=60)]
    for shape in (dict(draft_block_size=3), dict(tree_topk=3, tree_depth=3, tree_budget=10),
                  dict(draft_block_size=3, draft_lookup=6), dict(draft_block_size=3, draft_lookup=6, draft_lookup_trust=1)):
        drafter = make_drafter(draft, **shape)
        out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=60)]
        assert out == ref


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_round_of_several_forwards_is_path_decoding(pair, family):
    # a draft model's round: later forwards hang nodes from earlier ones; each node's logits are
    # plain decoding of its root path (bitwise on CPU), and keeping a path leaves the caches as
    # plain decoding of it leaves them
    from mlx_treespec import TreeRound

    model, _ = pair(family)
    prompt = prompt_tokens(3)
    forwards = [([5, 9, 2], [-1, 0, 1]), ([7, 3], [2, 1]), ([1, 8, 4], [3, 4, 0])]
    tokens = sum((t for t, _ in forwards), [])
    parents = sum((p for _, p in forwards), [])

    def committed():
        c = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=c)
        mx.eval([x.state for x in c])
        return c

    def path(i):
        return path(parents[i]) + [i] if i >= 0 else []

    caches = committed()
    rnd = TreeRound(model, caches)
    logits = mx.concatenate([rnd.forward(mx.array(t, mx.uint32), p) for t, p in forwards])
    for i in range(len(tokens)):
        ref = committed()
        out = model(mx.array([tokens[j] for j in path(i)])[None], cache=ref)[0, -1]
        assert mx.array_equal(logits[i], out), i
    keep = path(6)  # 0, 1, 4, 6: across three forwards
    rnd.keep(keep)
    ref = committed()
    model(mx.array([tokens[j] for j in keep])[None], cache=ref)
    for a, b in zip(states(caches), states(ref)):
        assert a.shape == b.shape and mx.array_equal(a, b)


HYBRID_DRAFT_SHAPES = [dict(draft_block_size=3), dict(tree_topk=3, tree_lanes=1, tree_depth=4),
                       dict(tree_topk=3, tree_depth=3, tree_budget=10), dict(draft_block_size=3, draft_lookup=6)]


@pytest.mark.parametrize("target_family,kw", [("qwen3_5", {}), ("qwen3", {}), ("qwen3", dict(max_kv_size=16)),
                                              ("qwen3", dict(kv_bits=8, kv_group_size=32, quantized_kv_start=30))])
def test_hybrid_draft_model_is_exact(pair, target_family, kw):
    # a small qwen3_5 drafts for a hybrid target and for an attention target (same vocabulary):
    # chains, one-lane and EAGLE-2 trees, beside a lookup; rotating and 8-bit target caches
    head_dim = 32 if "kv_bits" in kw else 16  # 8-bit KV groups of 32
    target = pair("qwen3_5")[0] if target_family == "qwen3_5" else tiny.build(
        dict(tiny.CONFIGS["qwen3"], head_dim=head_dim), seed=5)
    draft = pair("qwen3_5")[1]
    prompt = prompt_tokens(4, n=20)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=50, **kw)]
    for shape in HYBRID_DRAFT_SHAPES if not kw else HYBRID_DRAFT_SHAPES[1:3]:
        stats = RoundStats()
        out = [t for t, _, _ in tree_generate_step(prompt, target, make_drafter(draft, **shape), max_tokens=50,
                                                   stats=stats, **kw)]
        assert out == ref, shape
        if target_family == "qwen3_5":
            assert sum(stats.accepted) > 0 and stats.summary()["draft_forwards_per_round"] > 1


def test_a_hybrid_drafter_that_is_the_target_is_accepted_whole(pair):
    # a wrong recurrent state after a commit (a rollback that kept a rejected token, a replay
    # from the wrong state) would cost acceptance: the target's own weights must be accepted whole
    target, _ = pair("qwen3_5")
    twin = tiny.perturbed(target, noise=0.0)
    prompt = prompt_tokens(5)
    for shape, depth in ((dict(draft_block_size=3), 3), (dict(tree_topk=2, tree_lanes=1, tree_depth=4), 4)):
        stats = RoundStats()
        list(tree_generate_step(prompt, target, make_drafter(twin, **shape), max_tokens=41, stats=stats))
        assert stats.accepted[:-1] == [depth] * (stats.rounds - 1), (shape, stats.accepted)


def test_a_drafter_whose_layers_cannot_fork_is_refused_naming_them():
    from test_support import MAMBA2, build

    with pytest.raises(ValueError, match="cannot draft trees") as e:
        make_drafter(build(MAMBA2), draft_block_size=3)
    assert "layer 0" in str(e.value) and "Mamba2" in str(e.value)
