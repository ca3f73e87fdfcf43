"""Random combinations of the options, seeded: each is exact or refused in one line (CPU).

The other tests pin each option on its own and in the pairs that interact; here a seeded draw
combines them (family, weight dtype, drafter kind and shape, prompt length, KV quantization or
a rotating window, prefill chunks, stop tokens, a second turn over the same prompt cache,
sampling filters), as a user's call would. Greedy, the tokens are `mlx_lm`'s `generate_step`'s;
sampled, this library's plain sampled decoding's with the same seed; the prompt caches end at
the same offsets. A refusal must be a one-line ValueError.
"""
import random

import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import tiny
from mlx_treespec import RoundStats, make_drafter, tree_generate_step
from mlx_treespec.tree import eagle2_candidates

SEEDS = range(48)
_PAIRS = {}


def pair(family, variant):
    if (family, variant) not in _PAIRS:
        _PAIRS[family, variant] = tiny.pair(family, variant)
    return _PAIRS[family, variant]


def draw(seed):
    r = random.Random(seed)
    family = r.choice(list(tiny.CONFIGS))
    variant = r.choice(["f32", "f32", "bf16", "q4", "kv8"])
    if variant == "bf16" and ("moe" in family or "next" in family or family == "gemma4"):
        variant = "f32"  # (MLX's CPU gather matmul takes float32 only)
    if variant == "q4" and family in ("gemma4", "phi3") or variant == "kv8" and family in ("gemma3", "gemma4"):
        variant = "f32"  # (a width 32 does not divide; mlx-lm quantizes no rotating cache)
    kind = r.choice(["chain", "tree", "tree", "lanes", "default", "lookup", "suffix"])
    shape = {}
    if kind == "chain":
        shape = dict(draft_block_size=r.randint(1, 10))
    elif kind in ("tree", "lanes"):
        topk, depth = r.randint(2, 5), r.randint(1, 8)
        lanes = 1 if kind == "tree" else r.randint(1, topk)
        shape = dict(tree_topk=topk, tree_depth=depth, tree_lanes=lanes)
        if r.random() < 0.7:
            shape["tree_budget"] = r.randint(1, min(eagle2_candidates(topk, lanes, depth), 60))
        if r.random() < 0.2:
            shape["draft_lookup"] = r.randint(1, 8)
    elif kind in ("lookup", "suffix") and r.random() < 0.5:
        shape = dict(tree_budget=r.randint(1, 24), tree_depth=r.randint(1, 10))
    options = {}
    if variant == "kv8":
        options.update(kv_bits=r.choice([4, 8]), kv_group_size=32, quantized_kv_start=r.choice([0, 5, 20, 60]))
    elif r.random() < 0.3:
        options["max_kv_size"] = r.choice([16, 24, 40, 64])
    if r.random() < 0.3:
        options["prefill_step_size"] = r.choice([1, 3, 7])
    sampling = {}
    if r.random() < 0.35:
        sampling = dict(temp=r.choice([0.3, 0.7, 1.0, 1.5]), seed=r.randint(0, 9))
        if r.random() < 0.4:
            sampling["top_p"] = r.choice([0.5, 0.9])
        if r.random() < 0.3:
            sampling["top_k"] = r.choice([1, 5, 20])
        if r.random() < 0.3:
            sampling["min_p"] = r.choice([0.05, 0.2])
    n_prompt = r.choice([1, 2, 3, r.randint(4, 40)])
    prompt = np.random.default_rng(seed).integers(0, tiny.VOCAB, n_prompt).tolist()
    n = r.choice([1, 2, 5, r.randint(6, 60)])
    stops = r.sample(range(tiny.VOCAB), r.choice([0, 0, 1, 3]))
    turns = [prompt] + ([np.random.default_rng(seed + 100).integers(0, tiny.VOCAB, r.randint(1, 6)).tolist()]
                        if r.random() < 0.3 else [])
    return family, variant, kind, shape, options, sampling, turns, n, stops


def reference(target, prompt, n, cache, stops, options, sampling):
    if sampling:
        return [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=n, prompt_cache=cache,
                                                    stop_tokens=stops, **options, **sampling)]
    out = []
    for t, _ in generate_step(mx.array(prompt), target, max_tokens=n, prompt_cache=cache, **options):
        out.append(int(t))
        if out[-1] in stops:  # (tree_generate_step emits the stop token, then ends)
            break
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_combination_is_exact_or_refused(seed):
    family, variant, kind, shape, options, sampling, turns, n, stops = draw(seed)
    target, draft = pair(family, variant)
    try:
        drafter = make_drafter(draft if kind not in ("lookup", "suffix") else None,
                               drafter=kind if kind in ("lookup", "suffix") else None, target=target, **shape)
    except ValueError as e:  # (a shape the options refuse: a one-line error is the right outcome)
        assert "\n" not in str(e) and str(e)
        return
    window = options.pop("max_kv_size", None)
    ours, theirs = make_prompt_cache(target, max_kv_size=window), make_prompt_cache(target, max_kv_size=window)
    stats = RoundStats()
    for prompt in turns:
        want = reference(target, prompt, n, theirs, stops, options, sampling)
        got = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=n, prompt_cache=ours,
                                                   stop_tokens=stops, stats=stats, **options, **sampling)]
        assert got == want, (family, variant, kind, shape, options, sampling)
        for a, b in zip(ours, theirs):  # the caches hold the same tokens
            assert getattr(a, "offset", None) == getattr(b, "offset", None)


def test_the_combinations_draw_speculation_that_is_accepted_and_refused():
    # the draw is not degenerate: most combinations run (a few shapes are refused) and cover
    # every drafter kind, sampled and greedy, quantized and rotating caches, second turns
    draws = [draw(s) for s in SEEDS]
    assert {d[2] for d in draws} == {"chain", "tree", "lanes", "default", "lookup", "suffix"}
    assert sum(bool(d[5]) for d in draws) >= 8 and sum("kv_bits" in d[4] for d in draws) >= 4
    assert sum("max_kv_size" in d[4] for d in draws) >= 4 and sum(len(d[6]) == 2 for d in draws) >= 6
