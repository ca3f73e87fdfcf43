"""DFlash block drafters and DDTree trees: exact output, the capture contract, the budget rule,
one draft forward per round, the published format and its errors (CPU, tiny models)."""
import json

import numpy as np
import pytest
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import tiny
from mlx_treespec import RoundStats, make_drafter, tree_generate_step
from mlx_treespec.builders import best_first_tree
from mlx_treespec.tree import preorder, root_path
from mlx_treespec.drafters.dflash import DFlashDrafter, DFlashModel, bind_dflash, load_dflash
from mlx_treespec.verify import capturing

N = 64


def dflash_config(target_cfg, layers=2, block=8, layer_ids=None, mask=5):
    H = target_cfg["hidden_size"]
    n = target_cfg["num_hidden_layers"]
    return dict(model_type="qwen3", architectures=["DFlashDraftModel"], hidden_size=H, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=H // 4, intermediate_size=2 * H,
                rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=target_cfg["vocab_size"],
                max_position_embeddings=4096, tie_word_embeddings=False, block_size=block,
                num_target_layers=n,
                dflash_config=dict(target_layer_ids=layer_ids or list(range(n)), mask_token_id=mask))


def save_random(folder, cfg, seed=3, scale=3.0):
    """A DFlash drafter with random weights, in the published layout."""
    mx.random.seed(seed)
    m = DFlashModel(cfg)
    m.update(tree_map(lambda p: p * scale if p.ndim >= 2 else p, m.parameters()))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(m.parameters())))
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


class OracleDFlash(tiny.FollowsText, DFlashDrafter):
    """A DFlash drafter whose block logits are replaced by the target's own greedy continuation
    at some positions (noise elsewhere), so rounds accept drafts: the whole path (capture, one
    forward, context writes) still runs, and exactness is tested with real acceptance. Its
    rounds go through the round loop (QueuedOracle, QueuedTreeOracle: rounds queued ahead)."""

    ahead = None

    def _block_logits(self, root):
        logits = super()._block_logits(root)
        cache = make_prompt_cache(self.target)
        out = self.target(mx.array(self.text)[None], cache=cache)[0, -1]
        truth = []
        for _ in range(self.block - 1):
            truth.append(int(mx.argmax(out)))
            out = self.target(mx.array([[truth[-1]]]), cache=cache)[0, -1]
        boost = np.zeros(logits.shape, np.float32)
        for k, t in enumerate(truth, start=1):  # right at a random prefix, then as often wrong
            if self.rng.random() < 0.8:
                boost[k, t] = 50.0
        return logits + mx.array(boost)


@pytest.fixture(scope="module")
def targets():
    cache = {}

    def get(family):
        if family not in cache:  # "qwen3-kv32": head_dim 32, a group size KV quantization takes
            cfg = dict(tiny.CONFIGS["qwen3"], head_dim=32) if family == "qwen3-kv32" else tiny.CONFIGS[family]
            cache[family] = tiny.build(cfg)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache = {}

    def get(family, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            cfg = dflash_config(tiny.CONFIGS[family], **kw)
            cache[key] = save_random(tmp_path_factory.mktemp(f"dflash_{family}"), cfg)
        return cache[key]

    return get


def prompt_tokens(seed=0, n=12):
    return np.random.default_rng(seed).integers(0, tiny.VOCAB, n).tolist()


def plain(model, prompt, n=N, **kw):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kw)]


def speculative(target, drafter, prompt, n=N, **kw):
    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=n, stats=stats, **kw)]
    return out, stats


SHAPES = {"chain7": dict(topk=1, depth=7), "chain3": dict(topk=1, depth=3), "ddtree12": dict(budget=12),
          "ddtree31": dict(budget=31)}
FAMILIES = ["qwen3", "llama", "mistral", "qwen2", "qwen3_moe", "phi3", "gemma3", "gemma4", "qwen3_5",
            "qwen3_next"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", ["chain7", "ddtree31"])
def test_greedy_identical_to_mlx_lm(targets, folders, family, shape):
    target = targets(family)
    bound = bind_dflash(folders(family), target)
    prompt = prompt_tokens()
    ref = plain(target, prompt)
    out, stats = speculative(target, OracleDFlash(bound, target, **SHAPES[shape]), prompt)
    assert out == ref
    assert sum(stats.accepted) > 0 and any(a < d for a, d in zip(stats.accepted, stats.depth))
    # one draft forward per round that drafts, whatever the tree (the last round may draft none)
    assert {f for f, d in zip(stats.draft_forwards, stats.requested_depth) if d} == {1}


@pytest.mark.parametrize("variant", ["rotating", "kv8", "random-weights"])
@pytest.mark.parametrize("shape", ["chain3", "ddtree12"])
def test_greedy_identical_caches_and_published_weights(targets, folders, variant, shape):
    target = targets("qwen3-kv32" if variant == "kv8" else "qwen3")
    prompt = prompt_tokens(1, n=20)
    kw = dict(max_kv_size=16) if variant == "rotating" else (
        dict(kv_bits=8, kv_group_size=32, quantized_kv_start=30) if variant == "kv8" else {})
    ref = plain(target, prompt, **kw)
    if variant == "random-weights":  # the loader's own drafter, no oracle: little is accepted
        drafter = make_drafter(folders("qwen3"), drafter="dflash", target=target,
                               **({"draft_block_size": 3} if shape == "chain3" else {"tree_budget": 12}))
    else:
        drafter = OracleDFlash(bind_dflash(folders("qwen3"), target), target, **SHAPES[shape])
    out, stats = speculative(target, drafter, prompt, **kw)
    assert out == ref
    if variant != "random-weights":
        assert sum(stats.accepted) > 0


def test_sampled_equals_plain_sampled(targets, folders):
    target = targets("qwen3")
    prompt = prompt_tokens(2)
    for seed in (0, 1):
        kw = dict(temp=0.8, top_p=0.95, seed=seed)
        ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=N, **kw)]
        out, stats = speculative(target, OracleDFlash(bind_dflash(folders("qwen3"), target), target, budget=12),
                                 prompt, **kw)
        assert out == ref and sum(stats.accepted) > 0


class DrawSpy(DFlashDrafter):
    """Keeps each round's block logits and root position with what it drafted from them."""

    def _block_logits(self, root):
        self.last = super()._block_logits(root)
        return self.last

    def _ahead_logits(self, root, rows, count):
        self.last = super()._ahead_logits(root, rows, count)
        return self.last

    def _seen(self, drafted):
        position = None if self.draw is None else int(np.array(self.draw.position))
        self.rounds.append((position, self.last, drafted))
        return drafted

    def draft(self, root, max_depth):  # (a tree's: its `ranked`)
        drafted = super().draft(root, max_depth)
        return self._seen(drafted) if self.topk == 1 else drafted

    def chain_ahead(self, root, rows, count):
        return self._seen(super().chain_ahead(root, rows, count))

    def ranked(self, root, depth):
        return self._seen(super().ranked(root, depth))


@pytest.mark.parametrize("queued", [False, True])
def test_sampled_dflash_drafts_guess_the_draw(targets, folders, monkeypatch, queued):
    # at temp > 0 a DFlash chain is the target's draws' guess: block position k picked by the
    # sampler's scores at the position where the target draws the token k places after the root
    # (the root's position + k - 1), through the round loop and in rounds queued ahead (the GPU
    # path, here on CPU); greedy, by the logits. DDTree ranks by the block's marginals either
    # way. Tokens are plain (sampled) decoding's
    from mlx_treespec.sampling import make_node_sampler
    import mlx_treespec.verify as verify

    if queued:
        monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    target = targets("qwen3")
    prompt = prompt_tokens(5)
    kw = dict(temp=0.8, top_p=0.95, seed=4)
    choose = make_node_sampler(**kw)
    shapes = [dict(topk=1, depth=7)] + ([] if queued else [dict(budget=12)])
    for shape, sampling in [(s, k) for s in shapes for k in (kw, {})]:
        d = DrawSpy(bind_dflash(folders("qwen3"), target), **shape)
        d.rounds = []
        out, stats = speculative(target, d, prompt, **sampling)
        assert out == [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=N, **sampling)]
        assert d.rounds and (set(stats.drafter) == {"queued"}) == queued, stats.drafter
        if sampling:  # each round's root: the prompt's last token, then every token emitted since
            # (a queued run drafts one round past the last verified; a last round of no depth
            # forwards no block)
            positions = [p for p, _, _ in d.rounds][: stats.rounds]
            roots = len(prompt) - 1 + np.cumsum([0] + list(stats.emitted[:-1]))
            assert len(positions) >= stats.rounds - 1 and positions == roots[: len(positions)].tolist()
        differ = 0
        for position, logits, drafted in d.rounds:
            block = logits[1 : 1 + d.depth].astype(mx.float32)
            if sampling:
                drawn = choose.scores(block, position + mx.arange(d.depth, dtype=mx.int32), choose.seed)
                differ += int((mx.argmax(drawn, -1) != mx.argmax(block, -1)).any().item())
            else:
                assert position is None
                drawn = block
            want = drawn if d.topk == 1 else block
            if d.topk == 1:
                chain = np.array(drafted if isinstance(drafted, mx.array) else drafted.tokens[1:]).tolist()
                assert chain == np.array(mx.argmax(want, -1)).tolist()[: len(chain)]  # (near the end: fewer)
            else:  # (ranked: the top-k ids of each position, best first)
                ids = drafted[0]
                assert (ids[:, 0] == np.array(mx.argmax(want, -1))[: len(ids)]).all()
        assert (differ > 0) == bool(sampling)  # (the draw is not the argmax at some positions)


class Recorder(DFlashDrafter):
    """Keeps every hidden row the loop hands over (prefill, then each commit's path rows)."""

    def prefill(self, prompt, hidden=None):
        super().prefill(prompt, hidden)
        self.rows, self.text = [hidden], list(prompt[:-1])

    def commit(self, draft, path, emitted, hidden=None):
        super().commit(draft, path, emitted, hidden)
        self.rows.append(hidden)
        self.text += [int(t) for t in np.array(draft.tokens)[path]]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma3"])
def test_capture_rows_are_the_target_layer_outputs_of_the_accepted_tokens(targets, folders, family):
    # the capture contract: prefill hands the rows of every prompt token but the last; each
    # commit the rows of the path's nodes (root first); together they are, bitwise, the layer
    # outputs plain decoding computes for the same tokens (the prompt: its prefill forward)
    target = targets(family)
    d = Recorder(bind_dflash(folders(family), target), budget=12)
    prompt = prompt_tokens(3, n=15)
    out = [t for t, _, _ in tree_generate_step(prompt, target, d, max_tokens=40)]
    got = mx.concatenate(d.rows)
    assert d.text == (prompt + out)[: len(d.text)] and len(d.text) == got.shape[0]
    cache, want = make_prompt_cache(target), []
    with capturing(target, d.capture) as cap:
        target(mx.array(prompt[:-1])[None], cache=cache)
        want.append(cap.take())
        for t in d.text[len(prompt) - 1 :]:
            target(mx.array([[t]]), cache=cache)
            want.append(cap.take())
    assert mx.array_equal(got, mx.concatenate(want))


def test_cached_block_equals_the_reference_forward(targets, folders):
    # the drafter's whole-buffer cache with padded context rows computes what one forward of
    # the whole context computes (the published semantics)
    target = targets("qwen3")
    bound = bind_dflash(folders("qwen3"), target)
    d = DFlashDrafter(bound, topk=1, depth=7)
    rng = np.random.default_rng(0)
    width = len(bound.model.target_layer_ids) * 64
    feats = [mx.array(rng.standard_normal((11, width)).astype(np.float32))]
    d.prefill(prompt_tokens(n=12), feats[0])
    for n_new, root in ((3, 7), (8, 9), (1, 4), (5, 2)):
        got = d._block_logits(root)
        want = bound.model.block_logits(target, mx.concatenate(feats), root)
        assert mx.allclose(got, want, atol=1e-4).item()
        feats.append(mx.array(rng.standard_normal((n_new, width)).astype(np.float32)))
        d.commit(None, None, None, feats[-1])


def test_ddtree_is_the_best_first_tree_of_the_block(targets, folders):
    # the budget rule: the tree is the `budget` most probable prefixes of the block's marginals
    # (best_first_tree), at most B - 1 deep, exactly budget + 1 nodes, up to MAX_NODES; the
    # default twice the block's predictions, at most 63 (larger trees only where asked for)
    from mlx_treespec.drafters.dflash import default_budget

    target = targets("qwen3")
    bound = bind_dflash(folders("qwen3"), target)
    assert DFlashDrafter(bound).budget == default_budget(bound.model.block_size) == 2 * bound.model.block_size - 1
    assert default_budget(16) == 31 and default_budget(33) == 63 == default_budget(200)
    for budget in (5, 12, 31, 255):
        d = DFlashDrafter(bound, budget=budget)
        d.prefill(prompt_tokens(n=9), mx.zeros((8, len(bound.model.target_layer_ids) * 64)))
        length = d.length
        draft = d.draft(17, 63)
        d.length, d.pending = length, None
        logits = d._block_logits(17)[1:].astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        want = best_first_tree(17, lp, budget)
        assert draft.size == budget + 1 == want.size
        assert paths(draft.layout.parents, np.array(draft.tokens)) == paths(want.parents, want.tokens)
        assert want.max_depth <= bound.model.block_size - 1
        # numbered depth-first, children best first: the most probable chain is nodes 0, 1, 2, ...
        parents, tokens = draft.layout.parents, np.array(draft.tokens)
        assert np.array_equal(preorder(parents), np.arange(draft.size))
        chain, d = [0], 0
        while (parents == chain[-1]).any():
            kids = np.flatnonzero(parents == chain[-1])
            chain.append(int(kids[np.argmax(lp[d, tokens[kids]])]))
            d += 1
        assert chain == list(range(len(chain)))


def test_held_tokens_never_push_a_tree_into_the_next_row_bucket(targets, folders, monkeypatch):
    # the GPU path (whole buffers, power-of-two rows): a DDTree of 31 nodes + root fills its 32
    # rows, so a round with held tokens drops the tree's last nodes rather than run 64 rows; the
    # tokens stay plain decoding's
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    target = targets("qwen3")
    bound = bind_dflash(folders("qwen3"), target)
    prompt = prompt_tokens(seed=4)
    out, stats = speculative(target, OracleDFlash(bound, target, seed=2, budget=31), prompt)
    assert out == plain(target, prompt)
    rows = [h + n for h, n in zip([0] + stats.held[:-1], stats.nodes)]
    assert max(rows) <= 32
    assert any(h and n < 32 for h, n in zip([0] + stats.held[:-1], stats.nodes)), "no round held a token"


def _compiled_store(target):
    return target.__dict__.get("_treespec_compiled_verify")


def _runs_eagerly_because(target, folders, reason):
    """A DDTree generation's tokens are plain decoding's, every round eager for `reason`."""
    bound = bind_dflash(folders("qwen3"), target)
    prompt = prompt_tokens(seed=6)
    out, _ = speculative(target, OracleDFlash(bound, target, seed=3, budget=12), prompt)
    assert out == plain(target, prompt)
    store = _compiled_store(target)
    assert reason in store["off"] and store["trusted_runs"] == 0
    target.__dict__.pop("_treespec_compiled_verify", None)


def test_compiled_verify_is_the_eager_verify(targets, folders, monkeypatch):
    # the GPU path's verify runs as one compiled function; each shape's first CHECKS calls are
    # checked bitwise against the eager forward, and then it is trusted: tokens stay plain
    # decoding's, DDTree (device-ranked) and chain alike
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    target = targets("qwen3")
    target.__dict__.pop("_treespec_compiled_verify", None)
    bound = bind_dflash(folders("qwen3"), target)
    prompt = prompt_tokens(seed=6)
    for shape in (dict(budget=31), dict(topk=1, depth=7)):
        out, _ = speculative(target, OracleDFlash(bound, target, seed=3, **shape), prompt)
        assert out == plain(target, prompt)
    store = _compiled_store(target)
    assert store["off"] is None and store["trusted_runs"] > 0
    assert max(store["checked"].values()) == verify.CHECKS  # a shape is checked, then trusted


@pytest.mark.parametrize("compiled,eager,eager_host,wins", [
    (2, 1, 0, 3), ([2, 2, 1], [1, 1, 2], 0, 2), ([1, 1, 2], [2, 2, 1], 0, 1), (3, 2, 2, 0)],
    ids=["eager-faster", "eager-faster-twice", "eager-faster-once", "eager-faster-host-bound"])
def test_a_shape_whose_eager_verify_was_faster_runs_eagerly(targets, folders, monkeypatch, compiled, eager,
                                                            eager_host, wins):
    # every check but the first times both forwards, their host parts counted twice; where the
    # eager one won most of them (the H200's long key buffers), that shape runs eagerly from
    # then on: no compiled round is trusted, tokens stay plain decoding's. One win of three (a
    # GPU's jitter) does not decide, nor a synced win bought with host work
    import mlx_treespec.verify as verify
    from conftest import check_clock

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    monkeypatch.setattr(verify, "_clock", check_clock(compiled=compiled, eager=eager, eager_host=eager_host))
    returned = []
    real = verify.compiled_forward

    def recorded(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(verify, "compiled_forward", recorded)
    target = targets("qwen3")
    target.__dict__.pop("_treespec_compiled_verify", None)
    bound = bind_dflash(folders("qwen3"), target)
    prompt = prompt_tokens(seed=6)
    out, _ = speculative(target, OracleDFlash(bound, target, seed=3, budget=31), prompt)
    assert out == plain(target, prompt)
    store = _compiled_store(target)
    assert store["off"] is None and store["eager"] and max(store["checked"].values()) == verify.CHECKS
    runs_eagerly = wins >= 2  # the majority of the three timed checks
    assert set(store["eager_wins"].values()) == {wins}  # each shape's checks met the script in turn
    assert all(v == runs_eagerly for v in store["eager"].values()), store["eager_wins"]
    if runs_eagerly:  # checked, then never run compiled: the shape came back, the eager path
        assert store["trusted_runs"] == 0 and any(r is None for r in returned)
    else:
        assert store["trusted_runs"] > 0
    target.__dict__.pop("_treespec_compiled_verify", None)


def test_compiled_verify_never_runs_stale_weights(targets, folders, monkeypatch):
    # a trace holds the weights it was traced with: after an update the next generation traces
    # (and checks) again, so its tokens are the updated model's
    import mlx_treespec.verify as verify
    from mlx.utils import tree_map

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    target = tiny.build(tiny.CONFIGS["qwen3"], seed=3)
    bound = bind_dflash(folders("qwen3"), target)
    prompt = prompt_tokens(seed=6)
    out, _ = speculative(target, OracleDFlash(bound, target, seed=3, budget=12), prompt)
    assert out == plain(target, prompt) and _compiled_store(target)["trusted_runs"] > 0
    target.update(tree_map(lambda w: w * 1.3, target.parameters()))
    want = plain(target, prompt)
    assert want != out  # the update changes the tokens
    out, _ = speculative(target, OracleDFlash(bound, target, seed=3, budget=12), prompt)
    assert out == want
    w = target.model.layers[0].mlp.down_proj.weight
    w[...] = w * 1.5  # in place: the same array object
    want = plain(target, prompt)
    assert want != out
    out, _ = speculative(target, OracleDFlash(bound, target, seed=3, budget=12), prompt)
    assert out == want and _compiled_store(target)["trusted_runs"] > 0
    # a module set on the model since (as quantizing its lm_head would): its arrays are read
    # (the trace's inputs hold the model's entries, not the model: they follow it)
    trusted = _compiled_store(target)["trusted_runs"]
    old = target.lm_head
    target.lm_head = nn.Linear(old.weight.shape[1], old.weight.shape[0], bias=False)
    target.lm_head.weight = old.weight[::-1]
    want = plain(target, prompt)
    assert want != out
    out, _ = speculative(target, OracleDFlash(bound, target, seed=3, budget=12), prompt)
    assert out == want and _compiled_store(target)["trusted_runs"] > trusted
    # an array set at the model's top since: the forward reads it from the model, so the trace
    # takes the model itself as its input (a copy of its entries would hold it as a constant)
    target.bias_hack = mx.array(0.0)
    out, _ = speculative(target, OracleDFlash(bound, target, seed=3, budget=12), prompt)
    assert out == want and _compiled_store(target)["own"] is target


def test_queued_greedy_rounds_pick_mlx_lm_s_token_at_bfloat16_ties(folders, monkeypatch):
    # mlx-lm's greedy step takes the argmax of the log-probabilities in the model's dtype:
    # where two logits round to one bfloat16 log-probability it takes the lower id. Queued
    # rounds took the logits' own argmax, and left mlx-lm's text there
    import mlx_treespec.verify as verify
    from mlx_treespec.queued import _chooser
    from mlx_treespec.sampling import make_node_sampler

    row = mx.array([[0.01, 0.0101] + [0.0] * (tiny.VOCAB - 2)], mx.bfloat16)
    greedy = make_node_sampler(0.0)
    assert _chooser(greedy)(row, None).tolist() == greedy(row, None).tolist() == [0]
    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    target = tiny.build(tiny.CONFIGS["qwen3"], scale=0.3)  # small logits: ties in bfloat16
    target.set_dtype(mx.bfloat16)
    prompt = list(range(20, 40))
    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step(prompt, target, QueuedOracle(bind_dflash(folders("qwen3"), target),
                                                                           target, budget=12),
                                               max_tokens=48, stats=stats)]
    assert out == plain(target, prompt, n=48) and stats.drafter[0] == "queued"


def test_a_tied_target_s_drafter_bound_again_reuses_its_trace(folders):
    # a tied target's lm_head is a new bound method of its embedding at each bind: the block's
    # trace is kept by module (it was traced again at every bind, each trace kept)
    target = tiny.build(dict(tiny.CONFIGS["qwen3"], tie_word_embeddings=True))
    model = load_dflash(folders("qwen3"))
    for _ in range(3):
        DFlashDrafter(bind_dflash(model, target), topk=1, depth=4)
    assert len(model.__dict__["_treespec_compiled"]) == 1


@pytest.mark.parametrize("tied", [False, True])
def test_a_dflash_model_bound_to_target_after_target_keeps_none_alive(folders, tied):
    """The block's trace is kept on the DFlash model and holds a target's embedding and lm_head
    weakly; an entry whose target is gone is dropped (every freed target's modules stayed)."""
    import gc
    import weakref

    model = load_dflash(folders("qwen3"))
    refs = []
    for i in range(3):
        target = tiny.build(dict(tiny.CONFIGS["qwen3"], tie_word_embeddings=tied), seed=i)
        drafter = DFlashDrafter(bind_dflash(model, target), topk=1, depth=4)
        prompt = prompt_tokens(seed=i)
        assert [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=12)] == \
            plain(target, prompt, n=12)
        refs.append((weakref.ref(target), weakref.ref(target.model.embed_tokens)))
        del target, drafter
        gc.collect()
    assert not any(r() for pair in refs for r in pair)
    assert len(model.__dict__["_treespec_compiled"]) <= 1  # (the last, dropped at the next bind)


def test_an_error_inside_the_compiled_verify_is_raised_not_hidden(targets, folders, monkeypatch):
    # only what stops a trace (an offset read, an array evaluated) sends a round to the eager
    # path; any other error propagates and the round lands nowhere
    import mlx_lm.models.qwen3 as qwen3
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    real = qwen3.Attention.__call__

    def breaks_when_traced(self, x, mask=None, cache=None):
        if isinstance(cache, verify._TracedAppend):
            raise RuntimeError("a fault inside the model")
        return real(self, x, mask=mask, cache=cache)

    monkeypatch.setattr(qwen3.Attention, "__call__", breaks_when_traced)
    target = targets("qwen3")
    target.__dict__.pop("_treespec_compiled_verify", None)
    bound = bind_dflash(folders("qwen3"), target)
    want = plain(target, prompt_tokens(seed=6))
    with pytest.raises(RuntimeError, match="a fault inside the model"):
        speculative(target, OracleDFlash(bound, target, seed=3, budget=12), prompt_tokens(seed=6))
    assert plain(target, prompt_tokens(seed=6)) == want  # the failed trace left no placeholder behind
    target.__dict__.pop("_treespec_compiled_verify", None)


def test_compiled_verify_that_differs_from_eager_is_never_used(targets, folders, monkeypatch):
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    target = targets("qwen3")
    target.__dict__.pop("_treespec_compiled_verify", None)
    real = verify._compiled

    def off_by_a_little(model, capture, kernel=False, scans=frozenset()):
        fn, store = real(model, capture, kernel, scans)
        if fn is None:
            return fn, store

        def wrong(*args):
            out, *rest = fn(*args)
            return (out + 1e-3, *rest)

        return wrong, store

    monkeypatch.setattr(verify, "_compiled", off_by_a_little)
    _runs_eagerly_because(target, folders, "differs")


def test_compiled_verify_steps_aside_where_the_model_reads_its_offset(targets, folders, monkeypatch):
    # a model reading its cache offset outside RoPE would bake one round's offset into the
    # trace: the trace stops there and every round runs eagerly
    import mlx_lm.models.qwen3 as qwen3
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    real = qwen3.Attention.__call__

    def reads_offset(self, x, mask=None, cache=None):
        _ = cache.offset + 0
        return real(self, x, mask=mask, cache=cache)

    monkeypatch.setattr(qwen3.Attention, "__call__", reads_offset)
    target = targets("qwen3")
    target.__dict__.pop("_treespec_compiled_verify", None)
    _runs_eagerly_because(target, folders, "offset")


def paths(parents, tokens):
    """A tree as the set of its root paths' token tuples (the same tree in any numbering)."""
    out = set()
    for i in range(len(parents)):
        out.add(tuple(int(tokens[j]) for j in root_path(parents, i)))
    return out


def test_loader_errors_name_the_fix(tmp_path, targets, folders):
    target = targets("qwen3")
    cfg = dflash_config(tiny.CONFIGS["qwen3"])
    cases = [
        (dict(cfg, hidden_size=32, head_dim=8), "hidden size"),
        (dict(cfg, vocab_size=tiny.VOCAB + 1), "vocabulary"),
        (dict(cfg, dflash_config=dict(target_layer_ids=[0, 5], mask_token_id=5)), "target layers"),
        (dict(cfg, dflash_config=dict(target_layer_ids=[0, 1])), "mask_token_id"),
        (dict(cfg, dflash_config=dict(target_layer_ids=[0, 1], mask_token_id=tiny.VOCAB)), "mask token"),
    ]
    for i, (bad, needle) in enumerate(cases):
        folder = tmp_path / f"bad{i}"
        if "mask_token_id" in bad["dflash_config"]:
            save_random(folder, bad)
        else:
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=needle) as e:
            bind_dflash(str(folder), target)
        assert len(str(e.value).splitlines()) == 1
    with pytest.raises(ValueError, match="config.json"):
        load_dflash(str(tmp_path))
    with pytest.raises(ValueError, match="not both"):
        make_drafter(folders("qwen3"), drafter="dflash", target=target, draft_block_size=3, tree_budget=8)
    with pytest.raises(ValueError, match="--tree-topk"):
        make_drafter(folders("qwen3"), drafter="dflash", target=target, tree_topk=3)
    bound = bind_dflash(folders("qwen3"), target)
    for kw, needle in ((dict(budget=-1), "budget"), (dict(topk=1, depth=-3), "depth"), (dict(topk=2.5), "topk")):
        with pytest.raises(ValueError, match=f"DFlashDrafter {needle}"):  # (an MLX error naming none, before)
            DFlashDrafter(bound, **kw)


class QueuedOracle(OracleDFlash):
    """OracleDFlash for rounds queued ahead: the chain is the target's own greedy continuation
    at some positions, the drafter's device chain elsewhere (its forward and context writes
    run every round). It reads the device values it is handed (a test may sync). It queues
    chains whatever its tree shape (its round-loop rounds draft that shape)."""

    queues_trees = False

    @property
    def ahead(self):
        return self.chain_ahead

    def chain_ahead(self, root, rows, count):
        real = np.array(DFlashDrafter.chain_ahead(self, root, rows, count)).tolist()
        if rows is not None:  # the last round's accepted drafts, then its target token (root)
            self.text += self.last[: count.item() - 1] + [int(np.array(root)[0])]
        cache = make_prompt_cache(self.target)
        out = self.target(mx.array(self.text)[None], cache=cache)[0, -1]
        self.last = []
        for r in real:
            t = int(mx.argmax(out))
            self.last.append(t if self.rng.random() < 0.8 else r)
            out = self.target(mx.array([[t]]), cache=cache)[0, -1]
        return mx.array(self.last, mx.uint32)


class QueuedTreeOracle(tiny.FollowsText, DFlashDrafter):
    """DDTree rounds queued ahead (the tree built on the device) over a block that puts the
    target's own greedy continuation first at some positions and second at others, so the
    target accepts paths off the tree's spine too (rows the next round re-runs). It reads the
    device values it is handed (a test may sync)."""

    truth = ()

    def _ahead_logits(self, root, rows, count):
        logits = super()._ahead_logits(root, rows, count)
        if rows is not None:  # the last round emitted the first `count` of its truth
            self.text += self.truth[: count.item()]
        cache = make_prompt_cache(self.target)
        out = self.target(mx.array(self.text)[None], cache=cache)[0, -1]
        self.truth = []
        for _ in range(self.block):
            self.truth.append(int(mx.argmax(out)))
            out = self.target(mx.array([[self.truth[-1]]]), cache=cache)[0, -1]
        host = np.array(logits.astype(mx.float32))
        for k, t in enumerate(self.truth[: self.block - 1], start=1):
            u, top = self.rng.random(), host[k].max()
            host[k, t] = top + 50.0 if u < 0.55 else (top - 0.01 if u < 0.85 else host[k, t])
        return mx.array(host).astype(logits.dtype)


class QueuedSpineOracle(QueuedTreeOracle):
    """QueuedTreeOracle's block drafted as a one-lane tree: a spine of each position's best and
    its two runners-up as leaves (spine-first: queued.py commits its paths in place and re-runs
    only an accepted leaf), the target's continuation second at some positions, so paths end
    at leaves too."""

    def tree_ahead(self, root, rows, count, path=None):
        from mlx_treespec.draft import Draft
        from mlx_treespec.drafters.model import lanes_layout, runners_up

        logits = self._ahead_logits(root, rows, count)[1 : self.depth + 1]
        chain = mx.argmax(logits, axis=-1).astype(mx.uint32)
        tokens = mx.concatenate([root.reshape(1).astype(mx.uint32), chain, runners_up(logits, chain, 3)])
        return Draft(tokens, lanes_layout(self.depth, 3, 1), budget=3 * self.depth,
                     depth=self.depth, forwards=1)


def tree_oracle(shape, bound, target, seed):
    """A queued tree drafter: DDTree's (on the device: its path re-run) or a one-lane tree's."""
    oracle = QueuedSpineOracle if shape == "spine" else QueuedTreeOracle
    return oracle(bound, target, seed=seed, budget=12)


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU's whole-buffer verify (where rounds are queued ahead), on CPU."""
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)


@pytest.mark.parametrize("family,n", [("qwen3", 12), ("qwen3", 1000), ("llama", 12), ("phi3", 12),
                                      ("qwen3_moe", 12), ("qwen3_5", 12), ("qwen3_next", 12)])
def test_queued_chain_rounds_are_plain_decoding(targets, folders, gpu_path, family, n):
    # chains on the GPU path run queued ahead (walk and commit on the device, no host sync
    # between rounds): the tokens are plain decoding's, with real acceptance; a 1000-token
    # prompt grows the buffers (width 1024) inside the generation
    target = targets(family)
    target.__dict__.pop("_treespec_compiled_verify", None)
    prompt = prompt_tokens(5, n=n)
    d = QueuedOracle(bind_dflash(folders(family), target), target, topk=1, depth=7)
    out, stats = speculative(target, d, prompt)
    assert out == plain(target, prompt)
    assert d._queued is not None, "the rounds did not run queued"
    assert sum(stats.accepted) > 0 and any(a < 7 for a in stats.accepted)
    if family in ("qwen3", "qwen3_5", "qwen3_next"):  # the hybrids' recurrent layers too
        store = _compiled_store(target)
        assert store["off"] is None and store["trusted_runs"] > 0, "the queued verify did not run compiled"
    target.__dict__.pop("_treespec_compiled_verify", None)


@pytest.mark.parametrize("family", ["qwen3_5"])  # (a hybrid: attention and recurrent layers)
def test_queued_sampled_rounds_are_plain_sampled_decoding(targets, folders, gpu_path, family):
    # at temp > 0 DFlash's chains, DDTree's trees and one-lane trees queue too (the verify's draw
    # at each row's position, on the device; DFlash drafts its own tokens): the tokens are
    # plain sampled decoding's, hybrids' recurrent layers included
    target = targets(family)
    prompt = prompt_tokens(4)
    kw = dict(temp=0.8, top_p=0.95, seed=2)
    ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=N, **kw)]
    for shape in ("chain", "ddtree", "spine"):
        bound = bind_dflash(folders(family), target)
        d = QueuedOracle(bound, target, topk=1, depth=7) if shape == "chain" else tree_oracle(shape, bound, target, 1)
        out, stats = speculative(target, d, prompt, **kw)
        queued = [n for n, k in zip(stats.nodes, stats.drafter) if k == "queued"]
        assert out == ref and queued and (max(queued) > 8) == (shape != "chain"), (shape, queued)


@pytest.mark.parametrize("family,what", [("qwen3_5", "payload"), ("qwen3", "buffers")])
def test_a_compiled_verify_whose_state_for_later_rounds_differs_runs_eagerly(targets, folders, gpu_path, monkeypatch,
                                                                             family, what):
    # later rounds read the K/V buffers a verify wrote and the commit scans the recurrent layers'
    # payloads again: a compiled forward is trusted only where those equal the eager forward's
    # too, not the logits alone (here only the eager forward's beta, or its buffers, differ)
    import mlx_treespec.queued as queued

    real = queued.whole_buffer_forward

    def perturbed(*a, **kw):
        fwd = real(*a, **kw)

        def eager(*args):
            out, hidden, keys, values = fwd(*args)
            if what == "payload":
                keys = [dict(k, beta=k["beta"] * 0.5) if isinstance(k, dict) else k for k in keys]
            else:
                keys = [k if isinstance(k, dict) else k * 2 for k in keys]
            return out, hidden, keys, values
        return eager

    monkeypatch.setattr(queued, "whole_buffer_forward", perturbed)  # the eager twin queued.py builds
    target = targets(family)
    target.__dict__.pop("_treespec_compiled_verify", None)
    d = QueuedOracle(bind_dflash(folders(family), target), target, topk=1, depth=7)
    speculative(target, d, prompt_tokens(5), n=12)
    store = _compiled_store(target)
    assert store["off"] == "the compiled forward differs from the eager one" and store["trusted_runs"] == 0
    target.__dict__.pop("_treespec_compiled_verify", None)


@pytest.mark.parametrize("family,shape", [("qwen3", "chain"), ("qwen3_5", "chain"), ("qwen3", "tree"),
                                          ("qwen3_5", "tree"), ("qwen3", "spine"), ("qwen3_5", "spine")])
@pytest.mark.parametrize("end", ["cut after 1", "cut after 5", "max_tokens 13", "stop token"])
def test_queued_rounds_end_with_prompt_plus_delivered(targets, folders, gpu_path, end, family, shape):
    # stopping is decided on the host a round late: the round queued past the end leaves no
    # trace, and a prompt cache holds the prompt and every delivered token (mlx-lm's rule);
    # a hybrid's recurrent states included (a cut inside a round: its prefix replayed); a tree
    # round's path is written by the round queued after it, always queued before the host reads
    from test_reliability import check_cache_holds, mlx_cache_after

    target = targets(family)
    prompt = prompt_tokens(7)
    ref = plain(target, prompt)
    kw = dict(max_tokens=13) if end == "max_tokens 13" else dict(max_tokens=N)
    if end == "stop token":
        kw["stop_tokens"] = [ref[9]]
    cache = make_prompt_cache(target)
    bound = bind_dflash(folders(family), target)
    d = QueuedOracle(bound, target, seed=1, topk=1, depth=7) if shape == "chain" else \
        tree_oracle(shape, bound, target, seed=1)
    steps = tree_generate_step(prompt, target, d, prompt_cache=cache, **kw)
    got = []
    for t, _, _ in steps:
        got.append(t)
        if end.startswith("cut") and len(got) == int(end.split()[-1]):
            break
    steps.close()
    want = {"max_tokens 13": ref[:13], "stop token": ref[: ref.index(ref[9]) + 1]}.get(end, ref[: len(got)])
    assert got == want and d._queued is not None
    # the K/V rows a round committed (a tree's path re-run by the next round) are bitwise mlx-lm's (CPU)
    for c, r in zip(cache, mlx_cache_after(target, prompt, got, {})):
        if type(c).__name__ == "KVCache":
            n = r.offset
            assert mx.array_equal(c.keys[..., :n, :], r.keys[..., :n, :]).item()
            assert mx.array_equal(c.values[..., :n, :], r.values[..., :n, :]).item()
    check_cache_holds(target, cache, prompt, got, {})


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_tree_verifies_through_the_kernel_route_are_plain_decoding(targets, folders, gpu_path, contract_kernel,
                                                                    family):
    # DDTree rounds through the round loop: the compiled verify (qwen3) and the eager one with
    # the GatedDeltaNet scans (qwen3_5) hand every attention layer the round's bounds
    target = targets(family)
    target.__dict__.pop("_treespec_compiled_verify", None)
    prompt = prompt_tokens(6)
    out, stats = speculative(target, OracleDFlash(bind_dflash(folders(family), target), target, seed=3, budget=31),
                             prompt)
    assert out == plain(target, prompt) and max(stats.accepted) > 1
    assert contract_kernel and max(contract_kernel) > 1
    if family == "qwen3":
        store = _compiled_store(target)
        assert store["trusted_runs"] > 0 and any(key[1] for key in store["fns"])  # traced with the kernel
    target.__dict__.pop("_treespec_compiled_verify", None)


def test_a_kernel_route_that_fails_to_set_up_leaves_no_round_state(targets, folders, gpu_path, contract_kernel,
                                                                    monkeypatch):
    # the eager verify (qwen3_5) raising while it hands out the kernel's bounds: the round
    # raises, and no later forward sees its positions or mask
    import mlx_treespec.verify as verify

    class Fault(Exception):
        pass

    def fail(self):
        raise Fault

    target = targets("qwen3_5")
    monkeypatch.setattr(verify.TreeRound, "_bounds", fail)
    with pytest.raises(Fault):
        speculative(target, OracleDFlash(bind_dflash(folders("qwen3_5"), target), target, seed=3, budget=31),
                    prompt_tokens(6))
    assert verify._CTX.positions is None and verify._CTX.attend is None
    monkeypatch.undo()
    prompt = prompt_tokens(4)
    assert target(mx.array(prompt)[None]).argmax(-1)[0, -1].item() == plain(target, prompt, n=1)[0]


@pytest.mark.parametrize("family,shape", [("qwen3", "chain"), ("qwen3_5", "chain"), ("qwen3", "tree"),
                                          ("qwen3", "spine")])
def test_queued_rounds_through_the_kernel_route_are_plain_decoding(targets, folders, gpu_path, contract_kernel,
                                                                    family, shape):
    # queued chains and trees: the bounds are (the device's start, start + the round's rows)
    target = targets(family)
    prompt = prompt_tokens(5)
    bound = bind_dflash(folders(family), target)
    d = QueuedOracle(bound, target, topk=1, depth=7) if shape == "chain" else \
        tree_oracle(shape, bound, target, seed=2)
    out, stats = speculative(target, d, prompt)
    assert out == plain(target, prompt) and d._queued is not None
    assert contract_kernel and sum(stats.accepted) > 0


@pytest.mark.parametrize("shape", ["tree", "spine"])
@pytest.mark.parametrize("family,n", [("qwen3", 12), ("qwen3", 1000), ("llama", 12), ("qwen3_moe", 12),
                                      ("qwen3_5", 12), ("qwen3_next", 12)])
def test_queued_tree_rounds_are_plain_decoding(targets, folders, gpu_path, monkeypatch, family, n, shape):
    # DDTree rounds queued ahead: the tree built, walked and committed on the device (the
    # accepted path re-run by the next round's forward), no host sync between rounds; the tokens
    # are plain decoding's, with paths accepted off the spine; a 1000-token prompt grows the
    # buffers inside the generation; the hybrids' recurrent layers scan the re-run path and the
    # tree from device parents (gdn.DevicePlan) and commit from the states the scan kept
    import mlx_treespec.queued as queued

    walks, real = [], queued.walk
    monkeypatch.setattr(queued, "walk", lambda *a: walks.append(real(*a)) or walks[-1])
    in_place, layout = [], queued._spine_layout  # (a one-lane tree's rounds commit in place)
    monkeypatch.setattr(queued, "_spine_layout", lambda *a: in_place.append(a[0]) or layout(*a))
    target = targets(family)
    target.__dict__.pop("_treespec_compiled_verify", None)
    prompt = prompt_tokens(5, n=n)
    d = tree_oracle(shape, bind_dflash(folders(family), target), target, seed=4)
    stats = RoundStats()
    got = [(t, lp) for t, lp, _ in tree_generate_step(prompt, target, d, max_tokens=N, stats=stats)]
    want = list(generate_step(mx.array(prompt), target, max_tokens=N))
    assert [t for t, _ in got] == [t for t, _ in want]
    # the logprobs of each token are the target's at the node the path took (bitwise on CPU)
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(got, want))
    assert set(stats.drafter) == {"queued"} and set(stats.nodes) == {13 if shape == "tree" else 1 + 3 * d.depth}
    assert max(stats.accepted) > 1
    off_spine = [np.array(p)[: c.item()].tolist() != list(range(c.item())) for c, p, _ in walks]
    assert any(off_spine), "no round accepted a path off the tree's spine"
    assert len(in_place) == (len(walks) if shape == "spine" else 0)
    if family in ("qwen3", "qwen3_5", "qwen3_next"):
        store = _compiled_store(target)
        assert store["off"] is None and store["trusted_runs"] > 0, "the queued verify did not run compiled"
    target.__dict__.pop("_treespec_compiled_verify", None)


@pytest.mark.parametrize("shape", [dict(topk=1, depth=7), dict(budget=31)])
def test_queued_rounds_grow_buffers_with_the_context_not_the_rounds(targets, folders, gpu_path, shape):
    # a queued round reserves room for its rows past what may be committed; the host's bound on
    # that follows what it reads, so the target's and the drafter's buffers stay within a width
    # step of the context (a bound grown by a round's rows every round left a 32-node tree's
    # target buffer 14336 wide at 612 rows)
    from mlx_treespec.verify import width_step

    target = targets("qwen3")
    prompt = prompt_tokens(5)
    cache = make_prompt_cache(target)
    d = DFlashDrafter(bind_dflash(folders("qwen3"), target), **shape)
    out = [t for t, _, _ in tree_generate_step(prompt, target, d, max_tokens=300, prompt_cache=cache)]
    assert out == plain(target, prompt, n=300) and d._queued is not None
    step, T = width_step(), 32
    kv = [c for c in cache if c.keys is not None]
    assert all(c.keys.shape[2] <= -(-(c.offset + 2 * T) // step) * step for c in kv), \
        [(c.offset, c.keys.shape[2]) for c in kv]
    L0 = d._queued[0].item()
    assert d.keys[0].shape[2] <= -(-(L0 + 3 * d.block) // step) * step, (L0, d.keys[0].shape[2])


@pytest.mark.parametrize("kernel", ["agrees", "wrong tree", "wrong walk"])
def test_queued_trees_through_the_kernels_glue(targets, folders, gpu_path, monkeypatch, kernel):
    # the GPU route of device_tree.py on CPU: its build and walk kernels are the emulated bodies
    # (msl_check, g++), run eagerly; a generation is plain decoding through them, and a kernel
    # that disagrees with the MLX ops at its first-use check warns and is not used
    import warnings

    import msl_check
    from mlx_treespec import device_tree

    if not msl_check.have_gxx():
        pytest.fail("g++ is required for the kernel emulation")
    calls = []

    def build(backend, lp, ids, root, N):
        D, K = lp.shape
        T = N + 1
        out = msl_check.emulate_single_thread(
            "ddtree_build.inc", dict(D=D, K=K, N=N),
            [("lp", np.array(lp)), ("ids", np.array(ids)), ("root", np.array(root))],
            [("tokens", np.uint32, (T,)), ("parents", np.int32, (T,)), ("depths", np.int32, (T,)),
             ("anc", np.bool_, (T, T))])
        calls.append("build")
        if kernel == "wrong tree":
            out[0][-1] += 1  # a token the ops did not rank there
        return [mx.array(a) for a in out]

    def walk(backend, choice, tokens, parents):
        T = tokens.shape[0]
        count, path, emitted = msl_check.emulate_single_thread(
            "tree_walk.inc", dict(T=T),
            [("choice", np.array(choice)), ("tokens", np.array(tokens)), ("parents", np.array(parents))],
            [("count", np.int32, (1,)), ("path", np.int32, (T,)), ("emitted", np.uint32, (T,))])
        calls.append("walk")
        if kernel == "wrong walk":
            count = count * 0 + 1  # accepts nothing
        return mx.array(count).reshape(()), mx.array(path), mx.array(emitted)

    monkeypatch.setattr(device_tree, "_backend", lambda: "cuda")
    monkeypatch.setattr(device_tree, "run_build", build)
    monkeypatch.setattr(device_tree, "run_walk", walk)
    monkeypatch.setattr(device_tree, "_compile", lambda f: f)
    device_tree._build_fn.cache_clear()
    device_tree._walk_fn.cache_clear()
    target = targets("qwen3")
    prompt = prompt_tokens(5)
    d = QueuedTreeOracle(bind_dflash(folders("qwen3"), target), target, seed=4, budget=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, stats = speculative(target, d, prompt, n=24)
    assert out == plain(target, prompt, n=24) and set(stats.drafter) == {"queued"} and max(stats.accepted) > 1
    warned = [str(w.message) for w in caught if "kernel is not used" in str(w.message)]
    if kernel == "agrees":
        assert not warned and calls.count("build") > 1 and calls.count("walk") > 4  # past the checks
    else:
        assert len(warned) == 1 and ("build" if kernel == "wrong tree" else "walk") in warned[0]
        assert calls.count("build" if kernel == "wrong tree" else "walk") == (1 if kernel == "wrong tree" else 4)
    device_tree._build_fn.cache_clear()
    device_tree._walk_fn.cache_clear()


def test_queued_tree_rounds_hand_the_drafter_the_accepted_paths_rows(targets, folders, gpu_path, monkeypatch):
    # the next block reads the last verify's captured rows along its accepted path: after queued
    # tree rounds (some paths off the spine), the drafter's context holds the target's rows of
    # the prompt and the emitted tokens in order, as a prefill over the same text writes them
    import mlx_treespec.queued as queued

    walks, real = [], queued.walk
    monkeypatch.setattr(queued, "walk", lambda *a: walks.append(real(*a)) or walks[-1])
    target = targets("qwen3")
    prompt = prompt_tokens(5)
    bound = bind_dflash(folders("qwen3"), target)
    d = QueuedTreeOracle(bound, target, seed=4, budget=12)
    out, stats = speculative(target, d, prompt, n=40)
    assert out == plain(target, prompt, n=40) and max(stats.accepted) > 1
    assert any(np.array(p)[: c.item()].tolist() != list(range(c.item())) for c, p, _ in walks)
    text = prompt + plain(target, prompt, n=40 + d.block)  # (the round queued past the end read on)
    L0 = d._queued[0].item()
    assert len(prompt) + 40 - 1 <= L0 <= len(text)
    with capturing(target, d.capture) as cap:
        target(mx.array(text[:L0])[None])
        hidden = cap.hidden()
    fresh = DFlashDrafter(bound, budget=12)
    fresh.prefill(text[: L0 + 1], hidden)
    for got, want in zip(d.keys + d.values, fresh.keys + fresh.values):
        assert mx.allclose(got[:, :, :L0], want[:, :, :L0], atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("shape", ["tree", "spine"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_queued_tree_rounds_hand_back_to_the_round_loop(targets, folders, gpu_path, monkeypatch, family, shape):
    # queued DDTree rounds that hand back (`queue_more`) after a few rounds: the round loop goes
    # on from the caches they leave, the last round's path re-run by the round queued past it
    # (a hybrid's recurrent states: that round's re-run path's, not the round's own); one-lane
    # trees hand back after a round whose path ended at a leaf, which only the round queued
    # past it puts in place
    import mlx_treespec.queued as queued

    walks, real = [], queued.walk
    monkeypatch.setattr(queued, "walk", lambda *a: walks.append(real(*a)) or walks[-1])
    in_place, layout = [], queued._spine_layout
    monkeypatch.setattr(queued, "_spine_layout", lambda *a: in_place.append(a[0]) or layout(*a))

    class HandsBack(QueuedSpineOracle if shape == "spine" else QueuedTreeOracle):
        rounds = 0

        def queue_more(self, tokens, ms):
            self.rounds += 1
            if shape == "tree":
                return self.rounds < 3
            c, p, _ = walks[-2]  # the round just read (the last walk is the round queued past it)
            return np.array(p)[: c.item()].tolist() == list(range(c.item()))  # on the spine: go on

    target = targets(family)
    prompt = prompt_tokens(5)
    d = HandsBack(bind_dflash(folders(family), target), target, seed=4, budget=12)
    out, stats = speculative(target, d, prompt)
    assert out == plain(target, prompt)
    n = d.rounds
    assert (n == 3 if shape == "tree" else n >= 1) and len(stats.drafter) > n + 1
    assert stats.drafter[:n] == ["queued"] * n and "queued" not in stats.drafter[n:]
    assert max(stats.accepted[:n]) > 0 and len(in_place) == (len(walks) if shape == "spine" else 0)
