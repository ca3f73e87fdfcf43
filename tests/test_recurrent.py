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


def test_recurrent_drafter_refused_in_tree_mode(pair):
    target, draft = pair("qwen3_5")
    for shape in (dict(draft_block_size=3), dict(tree_topk=2, tree_depth=3, tree_budget=6)):
        with pytest.raises(ValueError, match="attention-only"):
            make_drafter(draft, **shape)
