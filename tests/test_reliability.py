"""A round is a transaction, and an abandoned stream leaves mlx-lm's cache: after a consumer
stops early or any stage of a round raises, a prompt cache holds the prompt and every token
delivered, every layer at one offset, and a next turn from it is exact (CPU, tiny models)."""
import gc
import weakref

import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import tiny
import mlx_treespec.loop as loop
import mlx_treespec.verify as verify
from mlx_treespec import RoundStats, make_drafter, tree_generate_step
from mlx_treespec.cache import cache_kind
from mlx_treespec.drafters.lookup import LookupDrafter

N = 48


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            cfg = dict(tiny.CONFIGS["qwen3"], head_dim=32) if name == "qwen3-kv32" else tiny.CONFIGS[name]
            target = tiny.build(cfg)
            cache[name] = (target, tiny.perturbed(target))
        return cache[name]

    return get


# (target, cache options, drafter maker)
CASES = {
    "chain": ("qwen3", {}, lambda d: make_drafter(d, draft_block_size=4)),
    "tree": ("qwen3", {}, lambda d: make_drafter(d, tree_topk=4, tree_lanes=1, tree_depth=6)),
    "eagle2": ("qwen3", {}, lambda d: make_drafter(d, tree_topk=3, tree_depth=4, tree_budget=12)),
    "lookup": ("qwen3", {}, lambda d: LookupDrafter(budget=8, max_depth=8)),
    "merged": ("qwen3", {}, lambda d: make_drafter(d, draft_block_size=4, draft_lookup=4)),
    "rotating": ("qwen3", dict(max_kv_size=16), lambda d: make_drafter(d, tree_topk=2, tree_depth=3, tree_budget=6)),
    "quantized": ("qwen3-kv32", dict(kv_bits=8, kv_group_size=32, quantized_kv_start=20),
                  lambda d: make_drafter(d, draft_block_size=4)),
    "hybrid": ("qwen3_5", {}, lambda d: tiny.SiblingDrafter(d, depth=3)),
    "plain": ("qwen3", {}, lambda d: None),
    "adaptive": ("qwen3", {}, lambda d: _adaptive(d)),
}


def _adaptive(draft):
    """Adaptive drafting switching through every arm (3-token plain stretches included)."""
    from test_adaptive import Scripted, flat
    from mlx_treespec.drafters.model import ModelDrafter

    class Short(Scripted):
        def _restart(self):
            super()._restart()
            self.stretch = 3

    return Short(["primary", "plain", "host"], primary=ModelDrafter(draft, topk=2, depth=3, budget=6),
                 host=LookupDrafter(8, 6), costs=(1.0, flat(1.0)))


def repetitive(n=6, seed=0):
    motif = np.random.default_rng(seed).integers(1, tiny.VOCAB, n).tolist()
    return motif * 3


def mlx_cache_after(target, prompt, delivered, opts):
    """The cache mlx-lm's own loop leaves after delivering `delivered` tokens from `prompt`."""
    cache = make_prompt_cache(target, max_kv_size=opts.get("max_kv_size"))
    out = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=len(delivered), prompt_cache=cache,
                                       **_mlx(opts))]
    assert out == delivered
    return cache


def check_cache_holds(target, cache, prompt, delivered, opts, follow=(3, 5, 7)):
    """Every layer at one offset, that of prompt + delivered, recurrent states (bitwise) those of
    mlx-lm's cache after the same tokens, and a next turn from the cache emits what mlx-lm emits
    from the cache its own loop leaves."""
    offsets = {c.offset for c in cache if cache_kind(c) in ("append", "rotating")}
    assert offsets == {len(prompt) + len(delivered)}, (offsets, len(prompt) + len(delivered))
    ref_cache = mlx_cache_after(target, prompt, delivered, opts)
    for i, (c, r) in enumerate(zip(cache, ref_cache)):
        assert type(c) is type(r), f"layer {i}: {type(c).__name__}, mlx-lm's {type(r).__name__}"  # quantized when mlx-lm's is
        if cache_kind(c) == "arrays":
            assert all(mx.array_equal(a, b).item() for a, b in zip(c.cache, r.cache)), f"layer {i}'s state"
    ours = [t for t, _ in generate_step(mx.array(list(follow)), target, max_tokens=12, prompt_cache=cache,
                                        **_mlx(opts))]
    ref = [t for t, _ in generate_step(mx.array(list(follow)), target, max_tokens=12, prompt_cache=ref_cache,
                                       **_mlx(opts))]
    assert ours == ref


def _mlx(opts):
    return {k: v for k, v in opts.items() if k != "max_kv_size"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("k", [1, 3, 10])
def test_abandoned_stream_leaves_prompt_plus_delivered(models, case, k):
    name, opts, make = CASES[case]
    target, draft = models(name)
    prompt = repetitive()
    cache = make_prompt_cache(target, max_kv_size=opts.get("max_kv_size"))
    steps = tree_generate_step(prompt, target, make(draft), max_tokens=N, prompt_cache=cache, **opts)
    got = []
    for t, _, _ in steps:
        got.append(t)
        if len(got) == k:
            break
    steps.close()
    check_cache_holds(target, cache, prompt, got, opts)


class Fault(Exception):
    pass


FIRED = []


def _raise_on(n, exc=Fault):
    calls = {"n": 0}

    def maybe():
        calls["n"] += 1
        if calls["n"] == n:
            FIRED.append(exc)
            raise exc("injected")

    return maybe


class BoomLayer:
    """Stands in for a target layer: raises on its n-th call after arming, else delegates."""

    def __init__(self, inner, n, exc):
        self.inner, self.maybe, self.armed = inner, _raise_on(n, exc), False

    def __call__(self, *a, **kw):
        if self.armed:
            self.maybe()
        return self.inner(*a, **kw)

    def __getattr__(self, name):  # is_linear & co.
        return getattr(self.inner, name)


def layer_list(target):
    """The list the model iterates (qwen3_5's `layers` property returns a fresh slice)."""
    return getattr(target, "language_model", target).model.layers


STAGES = ["prefill", "draft", "drafter_commit", "forward", "interrupt", "walk", "commit", "record", "first_record"]


class RaisingStats(RoundStats):
    """Stats whose n-th record raises: in a plain stretch that is after the next token's forward
    was queued and before this token is delivered (the caches then hold one token not delivered)."""

    def __init__(self, n):
        super().__init__()
        self.maybe = _raise_on(n, KeyboardInterrupt)

    def record(self, **kw):
        self.maybe()
        super().record(**kw)


@pytest.mark.parametrize("case,stage", [(c, s) for c in CASES for s in STAGES
                                        if c != "plain" or s in ("forward", "interrupt", "record", "first_record")])
def test_a_round_that_raises_lands_nowhere(models, monkeypatch, case, stage):
    name, opts, make = CASES[case]
    FIRED.clear()
    target, draft = models(name)
    drafter = make(draft)
    prompt = repetitive(seed=1)
    cache = make_prompt_cache(target, max_kv_size=opts.get("max_kv_size"))
    layers = layer_list(target)
    boom = None
    if stage == "prefill":
        monkeypatch.setattr(drafter, "prefill", lambda *a, **kw: _raise_on(1)())
    elif stage == "draft":
        real, maybe = drafter.draft, _raise_on(4)
        monkeypatch.setattr(drafter, "draft", lambda *a: (maybe(), real(*a))[1])
    elif stage == "drafter_commit":
        real, maybe = drafter.commit, _raise_on(3)
        monkeypatch.setattr(drafter, "commit", lambda *a: (real(*a), maybe())[0])
    elif stage in ("forward", "interrupt"):
        boom = BoomLayer(layers[-1], 3, KeyboardInterrupt if stage == "interrupt" else Fault)
        layers[-1] = boom
    elif stage == "walk":
        real_walk, maybe = loop.greedy_walk, _raise_on(3)
        monkeypatch.setattr(loop, "greedy_walk", lambda *a, **kw: (maybe(), real_walk(*a, **kw))[1])
    elif stage == "commit":
        # inside a commit, after some layers were written: the round is put back whole
        maybe = _raise_on(5)
        for name in ("commit_appended", "commit_rotating"):
            real = getattr(verify, name)
            monkeypatch.setattr(verify, name, lambda *a, real=real: (real(*a), maybe())[0])
    stats = RaisingStats({"record": 3, "first_record": 1}[stage]) if "record" in stage else None
    got = []
    try:
        steps = tree_generate_step(prompt, target, drafter, max_tokens=N, prompt_cache=cache, stats=stats, **opts)
        for t, _, _ in steps:
            got.append(t)
            if boom is not None:
                boom.armed = True
    except (Fault, KeyboardInterrupt):
        pass
    finally:
        if boom is not None:
            layers[-1] = boom.inner
        monkeypatch.undo()
    assert len(FIRED) == 1, "the fault never fired"
    check_cache_holds(target, cache, prompt, got, opts)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("prompt_len", [1, 5])
def test_quantized_kv_from_the_first_token(models, bits, prompt_len):
    target, draft = models("qwen3-kv32")
    prompt = repetitive()[:prompt_len]
    kw = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=0)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N, **kw)]
    out = [t for t, _, _ in tree_generate_step(prompt, target, make_drafter(draft, tree_topk=2, tree_depth=3),
                                               max_tokens=N, **kw)]
    assert out == ref


def test_quantized_kv_over_a_prefilled_cache_past_the_start(models):
    # a cache already past quantized_kv_start but not yet quantized: the first round verifies
    # nothing past the root (plain decoding quantizes after its first step)
    target, draft = models("qwen3-kv32")
    prompt = repetitive()
    kw = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=8)
    outs = []
    for drafter in (None, make_drafter(draft, draft_block_size=4)):
        cache = make_prompt_cache(target)
        target(mx.array(prompt[:12])[None], cache=cache)
        outs.append([t for t, _, _ in tree_generate_step(prompt[12:], target, drafter, max_tokens=N,
                                                         prompt_cache=cache, **kw)])
    cache = make_prompt_cache(target)
    target(mx.array(prompt[:12])[None], cache=cache)
    ref = [t for t, _ in generate_step(mx.array(prompt[12:]), target, max_tokens=N, prompt_cache=cache, **kw)]
    assert outs[0] == outs[1] == ref


def test_layer_skip_self_speculation_is_exact():
    # a draft model that shares modules with its target (its first layer): the rope modules
    # are re-classed once and read the forward that is running
    import copy

    target = tiny.build(dict(tiny.CONFIGS["qwen3"], num_hidden_layers=4))
    draft = copy.copy(target)
    draft.model = copy.copy(target.model)
    draft.model.layers = target.model.layers[:1]
    prompt = repetitive()
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N)]
    for shape in (dict(draft_block_size=3), dict(tree_topk=3, tree_depth=3, tree_budget=9)):
        stats = RoundStats()
        out = [t for t, _, _ in tree_generate_step(prompt, target, make_drafter(draft, **shape), max_tokens=N,
                                                   stats=stats)]
        assert out == ref and sum(stats.accepted) > 0


@pytest.mark.parametrize("max_kv", [5, 6, 8])
def test_windows_smaller_than_a_round(models, max_kv):
    # a round cannot reach past the window plain decoding keeps: the round shrinks to fit
    target, draft = models("qwen3")
    prompt = repetitive()[:3]
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=40, max_kv_size=max_kv)]
    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step(prompt, target, make_drafter(draft, tree_topk=2, tree_depth=6),
                                               max_tokens=40, max_kv_size=max_kv, stats=stats)]
    assert out == ref and max(stats.depth) <= max_kv - 4 - 1


def test_a_window_with_no_room_for_a_draft_is_a_clear_error(models):
    # mlx-lm keeps the first 4 tokens of a rotating cache: max_kv_size 4 leaves no window
    target, draft = models("qwen3")
    with pytest.raises(ValueError, match="raise --max-kv-size above 4") as e:
        next(tree_generate_step([1, 2, 3], target, make_drafter(draft, draft_block_size=2), max_kv_size=4))
    assert len(str(e.value).splitlines()) == 1
    ref = [t for t, _ in generate_step(mx.array([1, 2, 3]), target, max_tokens=20, max_kv_size=4)]
    assert [t for t, _, _ in tree_generate_step([1, 2, 3], target, None, max_tokens=20, max_kv_size=4)] == ref


def test_low_level_api_refuses_an_unsupported_target():
    from test_support import MAMBA2, build

    target = build(dict(MAMBA2, vocab_size=tiny.VOCAB))
    draft = tiny.build(tiny.CONFIGS["qwen3"])
    steps = tree_generate_step([1, 2, 3], target, make_drafter(draft, draft_block_size=2), max_tokens=4)
    with pytest.raises(ValueError, match="cannot verify draft trees"):
        next(steps)


@pytest.mark.parametrize("prompt,needle", [
    ([1, tiny.VOCAB], "outside the vocabulary"), ([-1, 2], "outside the vocabulary"),
    ([10 ** 6], "outside the vocabulary"), ([1.0, 2.0], "integers"),
    (mx.array([[1, 2, 3]]), "1-D"), (np.array([[1, 2]]), "1-D"), ([], "empty"), ([[1, 2]], "flat"),
    (mx.array([1.5, 2.0]), "integers"),
])
def test_bad_prompts_are_one_line_errors(models, prompt, needle):
    target, draft = models("qwen3")
    for drafter in (None, make_drafter(draft, draft_block_size=2)):
        with pytest.raises(ValueError, match=needle) as e:
            next(tree_generate_step(prompt, target, drafter, max_tokens=4))
        assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("kw,needle", [
    (dict(max_tokens=10.5), "max_tokens"), (dict(max_tokens=-2), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(stop_tokens=5), "stop_tokens"), (dict(top_k="3"), "top_k"), (dict(seed=1.0), "seed"),
    # (an id past the vocabulary was written past a logits row: the process crashed)
    (dict(temp=1.0, xtc_probability=0.5, xtc_special_tokens=[1000]), "xtc_special_tokens entry 1000"),
    (dict(temp=1.0, xtc_probability=0.5, xtc_special_tokens=[-1]), "xtc_special_tokens"),
    (dict(xtc_special_tokens=7), "xtc_special_tokens"), (dict(xtc_probability="0.5"), "xtc_probability"),
    (dict(xtc_threshold=0.7), "xtc_threshold"),
    (dict(temp=1e-39), "float32 reciprocal"), (dict(temp=1e46), "float32 reciprocal"),  # (every draw was token 0)
])
def test_options_of_the_wrong_type(models, kw, needle):
    target, _ = models("qwen3")
    with pytest.raises(ValueError, match=needle):
        next(tree_generate_step([1, 2, 3], target, None, **kw))


def test_numpy_integers_are_options(models):
    target, draft = models("qwen3")
    d = make_drafter(draft, tree_topk=np.int64(2), tree_depth=np.int32(3), tree_budget=np.int64(6))
    out = [t for t, _, _ in tree_generate_step(np.array([1, 2, 3]), target, d, max_tokens=np.int64(8),
                                               stop_tokens=[np.int64(7)])]
    assert 1 <= len(out) <= 8
    for bad, needle in ((dict(tree_depth="4"), "--tree-depth"), (dict(tree_topk=2.0), "--tree-topk"),
                        (dict(tree_topk=3, tree_depth=0), "--tree-depth"),
                        (dict(draft_block_size=4, tree_budget=1000), "--tree-budget"),
                        (dict(tree_depth=4, tree_budget=8), "--tree-budget")):
        with pytest.raises(ValueError, match=needle):
            make_drafter(draft, **bad)


def test_a_reused_drafter_starts_fresh(models):
    target, draft = models("qwen3")
    prompt = repetitive()
    drafter = make_drafter(draft, draft_block_size=4)
    accepted = []
    for _ in range(3):
        stats = RoundStats()
        list(tree_generate_step(prompt, target, drafter, max_tokens=N, stats=stats))
        accepted.append(sum(stats.accepted))
    assert accepted[0] == accepted[1] == accepted[2] > 0


def test_no_reference_cycle_keeps_a_round_alive(models, monkeypatch):
    target, draft = models("qwen3")
    rounds = []
    real_init = verify.TreeRound.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        rounds.append(weakref.ref(self))

    monkeypatch.setattr(verify.TreeRound, "__init__", init)
    gc.disable()
    try:
        for drafter in (make_drafter(draft, draft_block_size=4), make_drafter(draft, tree_topk=3, tree_depth=4),
                        LookupDrafter(8, 8)):
            list(tree_generate_step(repetitive(), target, drafter, max_tokens=N))
        del drafter
        alive = sum(r() is not None for r in rounds)
    finally:
        gc.enable()
    assert len(rounds) > 10 and alive <= 2  # the last round of the last drafter may still be referenced


def test_long_run_memory_is_bounded(models):
    # 1200 tokens with a tree drafter over a rotating target cache: active memory grows by the
    # draft model's own KV cache (plain, as mlx-lm's drafter's) and nothing else per round; the
    # figures are printed for bench/RESULTS.md
    target, draft = models("qwen3")
    drafter = make_drafter(draft, tree_topk=3, tree_lanes=1, tree_depth=6)
    marks = {}
    for i, _ in enumerate(tree_generate_step(repetitive(), target, drafter, max_tokens=1200, max_kv_size=64)):
        if i + 1 in (300, 1200):
            mx.eval()
            marks[i + 1] = (mx.get_active_memory(), drafter.cache[0].keys.shape[2])
    (m1, rows1), (m4, rows4) = marks[300], marks[1200]
    kv_row = sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in drafter.cache)
    print(f"active memory after 300 tokens {m1 / 1e6:.3f} MB, after 1200 {m4 / 1e6:.3f} MB "
          f"(draft KV buffers grew {(rows4 - rows1) * kv_row / 1e6:.3f} MB)")
    assert m4 - m1 <= (rows4 - rows1) * kv_row + 128 * 1024


def test_under_a_launch_an_error_leaves_the_pending_tokens_out(models, monkeypatch):
    # under mlx.launch a generation that an error unwinds does not forward its pending tokens
    # into the prompt cache (the error may be a process that is gone: the forward would wait for
    # ever), so the cache holds a prefix of what was delivered; the consumer's stop still
    # settles, also when the generation is consumed inside an `except` block
    monkeypatch.setattr(loop, "in_launch", lambda: True)
    target, draft = models("qwen3")
    prompt = repetitive()

    def run(stop_after, fail=False, inside_except=False):
        drafter = make_drafter(draft, draft_block_size=3)
        if fail:
            boom, draft_fn = _raise_on(3, RuntimeError), drafter.draft
            drafter.draft = lambda *a: (boom(), draft_fn(*a))[1]
        cache, got = make_prompt_cache(target), []
        gen = tree_generate_step(prompt, target, drafter, max_tokens=40, prompt_cache=cache)
        try:
            for t, _, _ in gen:
                got.append(t)
                if len(got) == stop_after:
                    break
        except RuntimeError:
            pass
        gen.close()
        return cache[0].offset, len(got)

    offset, n = run(5)  # the consumer stopped: prompt + delivered
    assert offset == len(prompt) + n
    try:
        raise KeyError("the caller is handling an exception")
    except KeyError:
        offset, n = run(5)
    assert offset == len(prompt) + n
    offset, n = run(40, fail=True)  # the drafter failed in its third round
    assert n > 0 and offset < len(prompt) + n


def test_an_accepted_draft_cut_by_a_stop_token_is_flagged_drafted(models):
    """A target that drafts for itself: every drafted token is accepted, and mlx-lm flags each
    from_draft, the stop token that ends the emission inside the accepted path too."""
    target, _ = models("qwen3")
    prompt = repetitive(seed=2)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=3)]
    assert ref[2] not in ref[:2]  # (the stop is the third token)
    out = list(tree_generate_step(prompt, target, tiny.SiblingDrafter(target, depth=5, width=1), max_tokens=N,
                                  stop_tokens=[ref[2]]))
    assert [t for t, _, _ in out] == ref
    assert [d for _, _, d in out] == [True, True, True]
    stats = RoundStats()  # the round's stats count what the flags count
    list(tree_generate_step(prompt, target, tiny.SiblingDrafter(target, depth=5, width=1), max_tokens=N,
                            stop_tokens=[ref[2]], stats=stats))
    assert stats.accepted == [3] and stats.emitted == [3]


@pytest.mark.parametrize("start", [20, 22])
def test_a_stream_stopped_at_the_quantization_boundary_leaves_a_quantized_cache(models, start):
    """A round cut short by the consumer commits its delivered tokens without the round's
    quantize; the cache is still mlx-lm's, quantized from `quantized_kv_start` on."""
    name, opts, make = CASES["quantized"]
    opts = dict(opts, quantized_kv_start=start)
    target, draft = models(name)
    prompt = repetitive()
    cache = make_prompt_cache(target)
    steps = tree_generate_step(prompt, target, make(draft), max_tokens=N, prompt_cache=cache, **opts)
    got = []
    for t, _, _ in steps:
        got.append(t)
        if len(prompt) + len(got) == start:
            break
    steps.close()
    check_cache_holds(target, cache, prompt, got, opts)


def test_an_error_after_a_queued_forward_crossed_the_quantization_start_restores_the_plain_caches(models):
    """The queued forward of a plain stretch that reaches `quantized_kv_start` quantizes: mlx-lm's
    `to_quantized` replaces the list's entries. An error before that token is delivered puts the
    plain caches back in the list (their attributes were written into the new objects)."""
    target, _ = models("qwen3-kv32")
    prompt, n = list(range(1, 11)), 4  # the 4th token's record raises; its forward reached the start
    opts = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=len(prompt) + n)
    cache = make_prompt_cache(target)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=20, prompt_cache=cache,
                                          stats=RaisingStats(n), **opts):
            got.append(t)
    assert len(got) == n - 1
    check_cache_holds(target, cache, prompt, got, opts)


@pytest.mark.parametrize("where", ["buffer_grew", "rows_moved", "recurrent_prepare"])
def test_a_commit_that_fails_is_put_back_and_not_committed_again(models, monkeypatch, where):
    """A commit that raises puts the round back (`TreeRound.abort`), and the rows it wrote in
    place may be gone: the round is not committed a second time from them; every delivered
    token is pending and lands at the end. Three ways a second commit read what was gone: the
    verify grew the buffer (the old one came back), a moved path's gather ran in place
    (kv_bits), a recurrent layer's commit failed while being prepared (nothing was put back)."""
    import mlx_treespec.gdn as gdn

    name = {"buffer_grew": "qwen3", "rows_moved": "qwen3-kv32", "recurrent_prepare": "qwen3_5"}[where]
    target, draft = models(name)
    opts, fired = {}, []
    if where == "buffer_grew":  # a 250-token prompt: the round that crosses 256 rows grew the buffer
        prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 250).tolist()
        drafter = make_drafter(draft, draft_block_size=4)
        real = verify.commit_appended

        def commit(cache, base, keep):
            real(cache, base, keep)
            if base <= 256 < base + len(keep) and not fired:
                fired.append(base)
                raise KeyboardInterrupt("injected")
        monkeypatch.setattr(verify, "commit_appended", commit)
    elif where == "rows_moved":  # (kv_bits: the path's rows are gathered into place, not re-run)
        prompt, drafter = repetitive(seed=1), tiny.SiblingDrafter(draft, depth=4)
        opts = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=1000)
        real = verify.commit_appended

        def commit(cache, base, keep):
            real(cache, base, keep)
            k = np.asarray(keep)
            moved = np.flatnonzero(k != np.arange(len(k)))
            if not fired and len(moved) >= 2 and k[moved[0]] < len(k):  # a move reads a row another writes
                fired.append(k.tolist())
                raise KeyboardInterrupt("injected")
        monkeypatch.setattr(verify, "commit_appended", commit)
    else:
        prompt, drafter = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist(), tiny.SiblingDrafter(draft, depth=3)
        real = gdn.gdn_layer_commit

        def commit(*a, **kw):
            fired.append(1)
            if len(fired) > 4:  # from the third round on every preparation fails
                raise Fault("injected")
            return real(*a, **kw)
        monkeypatch.setattr(gdn, "gdn_layer_commit", commit)
    cache = make_prompt_cache(target)
    got = []
    with pytest.raises((KeyboardInterrupt, Fault)):
        for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=40, prompt_cache=cache, **opts):
            got.append(t)
    monkeypatch.undo()
    assert fired
    check_cache_holds(target, cache, prompt, got, opts)


def test_kv_bits_over_caches_it_cannot_quantize_is_a_one_line_error(models):
    """mlx-lm fails at its first quantize (a rotating layer's to_quantized, a tuple's item
    assignment), after tokens were delivered; here the request is refused before anything runs."""
    gemma = tiny.build(tiny.CONFIGS["gemma3"])  # (sliding-window layers: rotating caches)
    with pytest.raises(ValueError, match="drop kv_bits"):
        next(tree_generate_step([1, 2, 3], gemma, None, kv_bits=8))
    target, _ = models("qwen3-kv32")
    with pytest.raises(ValueError, match="as a list"):
        next(tree_generate_step([1, 2, 3], target, None, kv_bits=8, prompt_cache=tuple(make_prompt_cache(target))))


@pytest.mark.parametrize("case", ["chain", "tree", "adaptive", "plain"])
def test_the_stats_count_every_token_delivered_when_the_consumer_stops(models, case):
    """stream_generate stops reading at its last token: that round was cut short, and its
    tokens still count (`--verbose` printed rounds for fewer tokens than it generated)."""
    name, opts, make = CASES[case]
    target, draft = models(name)
    stats = RoundStats()
    steps = tree_generate_step(repetitive(), target, make(draft), max_tokens=N, stats=stats)
    for k, _ in enumerate(steps, 1):
        if k == 13:
            break
    steps.close()
    assert sum(stats.emitted) == 13 and sum(stats.accepted) <= 13


def test_without_a_seed_each_sampled_generation_draws_its_own(models):
    """mlx-lm's sampled text differs from call to call; a fixed default seed gave one text."""
    target, _ = models("qwen3")
    runs = {tuple(t for t, _, _ in tree_generate_step([1, 2, 3], target, None, max_tokens=16, temp=1.0))
            for _ in range(3)}
    assert len(runs) > 1
    same = {tuple(t for t, _, _ in tree_generate_step([1, 2, 3], target, None, max_tokens=16, temp=1.0, seed=7))
            for _ in range(2)}
    assert len(same) == 1


def test_host_drafter_options_of_the_wrong_type_are_one_line_errors():
    from mlx_treespec.drafters.suffix import SuffixDrafter

    for make, needle in ((lambda: LookupDrafter(max_matches="3"), "max_matches"),
                         (lambda: LookupDrafter(max_matches=2.5), "max_matches"),
                         (lambda: LookupDrafter(ngram_max="4"), "ngram_max"),
                         (lambda: LookupDrafter(branches=1.5), "branches"),
                         (lambda: SuffixDrafter(max_match="3"), "max_match"),
                         (lambda: SuffixDrafter(index_depth=2.5), "index_depth"),
                         (lambda: SuffixDrafter(min_prob="0.1"), "min_prob")):
        with pytest.raises(ValueError, match=needle):
            make()


def test_two_threads_generating_at_once_each_get_their_models_tokens():
    # what a tree forward's re-classed modules read (verify._Context) and the joined projections'
    # outputs (join._MEMO) are per thread: two threads generating with two models at once raised
    # in rope (one thread's positions read by the other's forward) or could mix rows. Set in one
    # thread, neither is seen by another; and two threads x 3 generations each (the interpreter
    # switching threads every 10 us) get plain decoding's tokens
    import sys
    import threading

    import mlx_treespec.join as join

    seen = {}

    def other():
        seen["positions"], seen["memo"] = verify._CTX.positions, join._MEMO.outputs

    with join.running():
        verify._CTX.positions = mx.arange(3)
        try:
            t = threading.Thread(target=other)
            t.start()
            t.join()
        finally:
            verify._CTX.positions = None
    assert seen == {"positions": None, "memo": None}
    pairs = []
    for seed in (0, 7):
        target = tiny.build(tiny.CONFIGS["qwen3"], seed=seed)
        pairs.append((target, tiny.perturbed(target)))
    prompt = np.random.default_rng(6).integers(0, tiny.VOCAB, 12).tolist()
    refs = [[t for t, _ in generate_step(mx.array(prompt), m, max_tokens=32)] for m, _ in pairs]
    got = {0: [], 1: []}

    def work(i):
        target, draft = pairs[i]
        for _ in range(3):
            try:
                got[i].append([t for t, _, _ in tree_generate_step(
                    prompt, target, make_drafter(draft, target=target, tree_budget=8), max_tokens=32)])
            except Exception as e:  # (raised in the thread: reported below)
                got[i].append(repr(e))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert got == {0: [refs[0]] * 3, 1: [refs[1]] * 3}
