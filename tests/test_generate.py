"""Greedy speculative output is the target's own greedy output, byte for byte (CPU).

Every family, chain and tree shapes, float32 / bfloat16 / 4-bit weights, an 8-bit KV cache, and
rotating caches that wrap many times, against mlx-lm's own `generate_step`.
"""
import copy

import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import tiny
from mlx_treespec import RoundStats, make_drafter, tree_generate_step
from mlx_treespec.verify import TreeRound

FAMILIES = tiny.ATTENTION
SHAPES = {
    "chain1": dict(draft_block_size=1),
    "chain4": dict(draft_block_size=4),
    "k2s1b2": dict(tree_topk=2, tree_depth=1, tree_budget=2),
    "k2s3b6": dict(tree_topk=2, tree_depth=3, tree_budget=6),
    "k3s6b31": dict(tree_topk=3, tree_depth=6, tree_budget=31),
    "k4s5b20": dict(tree_topk=4, tree_depth=5, tree_budget=20),
    "k4l1s6b16": dict(tree_topk=4, tree_depth=6, tree_budget=16, tree_lanes=1),  # chain + ranked siblings
    "k4l1s6b24": dict(tree_topk=4, tree_depth=6, tree_budget=24, tree_lanes=1),  # chain + all siblings
    "k3l2s4b12": dict(tree_topk=3, tree_depth=4, tree_budget=12, tree_lanes=2),
}
N = 128


@pytest.fixture(scope="module")
def pairs():
    cache = {}

    def get(family, variant="f32"):
        if (family, variant) not in cache:
            cache[family, variant] = tiny.pair(family, variant)
        return cache[family, variant]

    return get


def prompt_tokens(seed=0, n=12):
    return np.random.default_rng(seed).integers(0, tiny.VOCAB, n).tolist()


def plain(model, prompt, n=N, **kw):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kw)]


def speculative(model, draft, prompt, shape, n=N, **kw):
    stats = RoundStats()
    drafter = make_drafter(draft, **shape)
    out = [t for t, _, _ in tree_generate_step(prompt, model, drafter, max_tokens=n, stats=stats, **kw)]
    return out, stats


def assert_meaningful(ref, stats):
    # a reference that repeats one token, or a drafter always right or always wrong, proves little
    assert len(set(ref)) >= 5, "the tiny target does not vary its output"
    acc = stats.summary()["accepted_per_round"]
    assert 0 < sum(stats.accepted), "no draft was ever accepted"
    assert any(a < d for a, d in zip(stats.accepted, stats.depth)), "no draft was ever rejected"
    return acc


# every family at a chain, an EAGLE-2 tree and two lanes; every shape over full KV (qwen3),
# sliding windows (gemma3), shared KV (gemma4): a family's own ops are pinned node by node by
# `test_verify_logits_equal_path_decoding`, and the full grid cost CI 1.5 min
GRID = sorted({(s, f) for s in ("chain4", "k3s6b31", "k3l2s4b12") for f in FAMILIES}
              | {(s, f) for s in SHAPES for f in ("qwen3", "gemma3", "gemma4")})


@pytest.mark.parametrize("shape,family", GRID)
def test_greedy_identical_to_mlx_lm(pairs, family, shape):
    target, draft = pairs(family)
    prompt = prompt_tokens()
    ref = plain(target, prompt)
    out, stats = speculative(target, draft, prompt, SHAPES[shape])
    assert out == ref
    assert_meaningful(ref, stats)


# mlx-lm cannot quantize a rotating cache, so kv_bits is for families with full KV caches only
VARIANTS = [("qwen3", "bf16"), ("qwen3", "q4"), ("qwen3", "kv8"), ("llama", "kv8"),
            ("gemma3", "bf16"), ("gemma3", "q4")]


@pytest.mark.parametrize("family,variant", VARIANTS)
@pytest.mark.parametrize("shape", ["chain4", "k3s6b31"])
def test_greedy_identical_dtypes_and_quantized(pairs, variant, family, shape):
    target, draft = pairs(family, variant)
    prompt = prompt_tokens(1)
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=40) if variant == "kv8" else {}
    ref = plain(target, prompt, **kw)
    out, stats = speculative(target, draft, prompt, SHAPES[shape], **kw)
    assert out == ref
    assert_meaningful(ref, stats)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "phi3", "qwen3_moe"])
@pytest.mark.parametrize("shape", ["chain1", "chain4", "k2s3b6", "k4s5b20"])
def test_greedy_identical_rotating_cache_wrapping(pairs, family, shape):
    # max_kv_size 16 with mlx-lm's 4 kept tokens: the buffer rotates every 12 tokens, ~11 times
    target, draft = pairs(family)
    prompt = prompt_tokens(2, n=20)
    ref = plain(target, prompt, max_kv_size=16)
    out, stats = speculative(target, draft, prompt, SHAPES[shape], max_kv_size=16)
    assert out == ref
    assert len(set(ref)) >= 5


def random_tree(rng, n):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    return np.array(parents)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_kv", [None, 12])
def test_verify_logits_equal_path_decoding(pairs, family, max_kv):
    target, _ = pairs(family)
    rng = np.random.default_rng(3)
    prompt = mx.array(prompt_tokens(3, n=30))
    parents = np.array([-1, 0, 1, 1, 0, 4, 2, 6, 6, 3])
    parents = np.concatenate([parents, random_tree(rng, 14)[1:] + 0])  # more branch points
    parents[10:] = [int(rng.integers(0, i)) for i in range(10, len(parents))]
    tokens = rng.integers(0, tiny.VOCAB, len(parents))
    cache = make_prompt_cache(target, max_kv_size=max_kv)
    target(prompt[None], cache=cache)
    mx.eval([c.state for c in cache])
    committed = copy.deepcopy(cache)
    logits = TreeRound(target, cache).forward(mx.array(tokens.astype(np.uint32)), parents)
    for i in range(len(parents)):
        path, j = [], i
        while j != -1:
            path.append(j)
            j = parents[j]
        c = copy.deepcopy(committed)
        for j in reversed(path):
            out = target(mx.array([[int(tokens[j])]]), cache=c)
        assert mx.array_equal(out[0, 0], logits[i]), f"node {i} differs from decoding its path"


def cache_state(c):
    name = type(c).__name__
    if name == "QuantizedKVCache":
        return [a[..., : c.offset, :] for a in c.keys + c.values], c.offset
    if name == "KVCache":
        return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]], c.offset
    # rotating: the whole buffer and its rotation index must match
    return [c.keys, c.values], (c.offset, c._idx)


@pytest.mark.parametrize("family,max_kv", [("qwen3", None), ("qwen3", 16), ("gemma3", None),
                                           ("gemma4", 16), ("qwen3_moe", None)])
@pytest.mark.parametrize("shape", ["chain4", "k3s6b31", "k4l1s6b24"])
def test_committed_cache_equals_plain_decoding(pairs, family, max_kv, shape):
    target, draft = pairs(family)
    prompt = prompt_tokens(4, n=15)
    ended_held = []
    for n in (1, 7, 23, 40):  # stops inside and at the end of rounds
        ours = make_prompt_cache(target, max_kv_size=max_kv)
        out, stats = speculative(target, draft, prompt, SHAPES[shape], n=n, prompt_cache=ours)
        ended_held.append(stats.held[-1])
        ref_cache = make_prompt_cache(target, max_kv_size=max_kv)
        ref = plain(target, prompt, n=n, prompt_cache=ref_cache)
        assert out == ref
        for a, b in zip(ours, ref_cache):
            (arrs_a, meta_a), (arrs_b, meta_b) = cache_state(a), cache_state(b)
            assert meta_a == meta_b
            for x, y in zip(arrs_a, arrs_b):
                assert mx.array_equal(x, y)
    if shape == "k4l1s6b24" and family == "qwen3" and max_kv is None:
        # some run ends with a token held for a next round that never comes: the last forward
        # (made for the prompt cache) takes it
        assert any(ended_held), ended_held


@pytest.mark.parametrize("shape", ["chain4", "k2s3b6", "k4s5b20"])
def test_sampled_tree_equals_plain_sampled(pairs, shape):
    target, draft = pairs("qwen3")
    prompt = prompt_tokens(5)
    seen = set()
    for seed in (0, 1, 2):
        kw = dict(temp=0.8, top_p=0.95, top_k=40, seed=seed)
        ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=120, **kw)]
        out, stats = speculative(target, draft, prompt, SHAPES[shape], n=120, **kw)
        assert out == ref
        assert sum(stats.accepted) > 0
        seen.add(tuple(ref))
    assert len(seen) == 3, "different seeds must sample different text"


def test_sampled_xtc_tree_equals_plain_sampled_xtc(pairs):
    # XTC's coin is keyed by (seed, position) like the draw: trees stay plain sampled decoding's
    # tokens, and the exclusion does change the text
    from mlx_treespec.sampling import apply_xtc_rows

    target, draft = pairs("qwen3")
    prompt = prompt_tokens(5)
    kw = dict(temp=0.7, seed=3, xtc_probability=0.6, xtc_threshold=0.1, xtc_special_tokens=[0])
    ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=100, **kw)]
    out, stats = speculative(target, draft, prompt, SHAPES["k2s3b6"], n=100, **kw)
    assert out == ref and sum(stats.accepted) > 0
    no_xtc = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=100, temp=0.7, seed=3)]
    assert no_xtc != ref
    # the rule itself: a row whose coin falls under the probability keeps the least likely token
    # above the threshold and everything below it; special tokens are never dropped
    lp = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    got = np.array(apply_xtc_rows(lp, mx.array([0.1, 0.9]), 0.5, 0.1, special_tokens=[0]))
    assert np.isfinite(got[0]).tolist() == [True, False, True, True]
    assert np.isfinite(got[1]).all()
    with pytest.raises(ValueError, match="xtc_threshold"):
        list(tree_generate_step(prompt, target, None, max_tokens=4, temp=0.7, xtc_threshold=0.9))


def test_sampled_min_p(pairs):
    target, draft = pairs("gemma3")
    prompt = prompt_tokens(6)
    kw = dict(temp=1.0, min_p=0.05, seed=7)
    ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=80, **kw)]
    out, _ = speculative(target, draft, prompt, SHAPES["k2s3b6"], n=80, **kw)
    assert out == ref


def whole_buffer_run(pairs, family, shape, monkeypatch):
    """The GPU path on CPU: attention reads whole KV buffers (the mask hides the unused tail),
    rows padded to a power of two. Returns the (first round node, filler rows) of each forward."""
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    forwards = []
    real = verify.TreeRound._run

    def run(self, tokens, first, positions=None):
        out = real(self, tokens, first, positions)
        forwards.append((first, self._pad))
        return out

    monkeypatch.setattr(verify.TreeRound, "_run", run)
    target, draft = pairs(family)
    prompt = prompt_tokens(7)
    ref = plain(target, prompt)
    out, stats = speculative(target, draft, prompt, SHAPES[shape])
    assert out == ref
    assert_meaningful(ref, stats)
    return forwards


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma4", "phi3"])
@pytest.mark.parametrize("shape", ["chain1", "chain4", "k3s6b31", "k4l1s6b24"])
def test_greedy_identical_reading_whole_buffers(pairs, family, shape, monkeypatch):
    whole_buffer_run(pairs, family, shape, monkeypatch)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_hybrids_pad_rows_reading_whole_buffers(pairs, family, monkeypatch):
    # a hybrid's fillers are leaves of their own in the GatedDeltaNet scans, masked out of
    # attention and dropped from the scan payload: the target's verifies pad, and the draft
    # model's three-lane steps (3 rows -> 4) continue a padded scan within their round
    forwards = whole_buffer_run(pairs, family, "k3s6b31", monkeypatch)
    assert any(pad for _, pad in forwards), "no forward had filler rows"
    assert any(first and pad for first, pad in forwards), "no forward continued a padded round"


@pytest.mark.parametrize("max_kv", [None, 16])
def test_drafterless_decoding_is_mlx_lm_generate_step(pairs, max_kv):
    # drafter=None runs mlx-lm's pipelined loop: same tokens, and a prompt cache left as mlx-lm
    # leaves it, whether the run ends at max_tokens or at a stop token
    target, _ = pairs("gemma3")
    prompt = prompt_tokens(3)
    ours, theirs = make_prompt_cache(target, max_kv_size=max_kv), make_prompt_cache(target, max_kv_size=max_kv)
    out = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=40, prompt_cache=ours)]
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=40, prompt_cache=theirs)]
    assert out == ref and len(set(ref)) > 3
    for a, b in zip(ours, theirs):
        assert a.offset == b.offset
        for x, y in zip(a.state, b.state):
            assert mx.array_equal(x, y)
    stop = ref[12]
    out = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=40, stop_tokens=[stop])]
    assert out == ref[: ref.index(stop) + 1]


@pytest.mark.parametrize("pad", [False, True])
def test_off_order_accepts_are_rerun_not_moved(pairs, monkeypatch, pad):
    # a path that leaves the node order (an accepted sibling) keeps its leading run in the
    # cache and runs the rest first in the next round: no K/V row moves, same tokens
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: pad)
    moved = []
    real = verify.commit_appended

    def spy(cache, base, keep):
        moved.append(bool((np.asarray(keep) != np.arange(len(keep))).any()))
        return real(cache, base, keep)

    monkeypatch.setattr(verify, "commit_appended", spy)
    target, draft = pairs("qwen3")
    prompt = prompt_tokens(8)
    ref = plain(target, prompt)
    out, stats = speculative(target, draft, prompt, SHAPES["k4l1s6b24"])
    assert out == ref
    assert sum(stats.held) > 0, "no sibling was ever accepted"
    assert moved and not any(moved)


def test_a_drafter_that_is_the_target_guesses_every_sampled_token(pairs):
    # at temp > 0 a drafter picks its tokens by the draw's scores of its own logits at the
    # positions the target draws at (sampling.Draw): a draft model that is the target draws
    # what the target draws, so every round accepts its whole chain and its trees' first lane
    # (pins the draw's positions; a root after held tokens: the queued head test's one-lane
    # tree, whose leaves end paths). A drafter that took
    # its logits' argmax instead guesses the target's argmax, which the draw often is not
    from mlx_treespec.drafters.model import ModelDrafter

    target, _ = pairs("qwen3")
    prompt = prompt_tokens(6)
    kw = dict(temp=1.0, top_p=0.9, seed=4)
    ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=N, **kw)]
    assert ref != plain(target, prompt), "the draw must differ from greedy decoding here"
    for shape in (dict(topk=1, depth=4), dict(topk=2, lanes=1, depth=4, budget=8), dict(topk=2, lanes=2, depth=3, budget=10)):
        stats = RoundStats()
        out = [t for t, _, _ in tree_generate_step(prompt, target, ModelDrafter(target, **shape), max_tokens=N,
                                                   stats=stats, **kw)]
        assert out == ref
        full = [a == d for a, d, e in zip(stats.accepted, stats.depth, stats.emitted)]
        assert all(full[:-1]), (shape, stats.accepted, stats.depth)  # (the last round: the tokens left)

    class ArgmaxDrafter(ModelDrafter):
        draw = property(lambda self: None, lambda self, draw: None)

    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step(prompt, target, ArgmaxDrafter(target, topk=1, depth=4), max_tokens=N,
                                               stats=stats, **kw)]
    assert out == ref and not all(a == d for a, d in zip(stats.accepted[:-1], stats.depth[:-1]))


def test_a_sampler_setting_is_compiled_once_whatever_the_seed():
    # the draw is compiled per setting with the seed an input: every generation of a setting
    # shares its traces (and a head's compiled drafts over them); seeds still draw apart
    from mlx_treespec.sampling import make_node_sampler

    a, b = make_node_sampler(temp=0.7, top_p=0.9, seed=1), make_node_sampler(temp=0.7, top_p=0.9, seed=2)
    assert a.scores is b.scores and make_node_sampler(temp=0.5, top_p=0.9, seed=1).scores is not a.scores
    logits, positions = mx.array(np.random.default_rng(0).normal(size=(64, 50)).astype(np.float32)), mx.arange(64)
    assert np.array(a(logits, positions)).tolist() != np.array(b(logits, positions)).tolist()
    assert np.array(a(logits, positions)).tolist() == np.array(make_node_sampler(temp=0.7, top_p=0.9, seed=1)(
        logits, positions)).tolist()
