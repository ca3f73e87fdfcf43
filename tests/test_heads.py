"""Drafting heads (MTP, EAGLE-3): the loaders read the published layouts; the loaded heads
compute the spec's forward (notes/heads_spec.md, checked against a plain-mx reference written
here); a tree forward over a head's cache gives each node the logits of decoding its root path
one token at a time, bitwise (CPU); every loader refusal is a one-line ValueError."""
import copy
import json
import os
import sys

import numpy as np
import pytest
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import tiny
from mlx_treespec.drafters import target_io
from mlx_treespec.drafters.eagle3 import load_eagle3
from mlx_treespec.drafters.mtp import NO_MTP, load_mtp
from mlx_treespec.verify import TreeRound, is_tree_module

F32 = mx.float32
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


# ------------------------------------------------------------------------------------------
# the reference: plain mx ops, straight from the spec (float32, whole sequences, no cache)

def rms(x, w, eps=1e-6):
    x = x.astype(F32)
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, rot, base):
    """x [L, heads, d]; non-traditional RoPE on the first `rot` dims at positions `pos`."""
    half = rot // 2
    inv = mx.power(base, -mx.arange(0, rot, 2, dtype=F32) / rot)
    ang = pos.astype(F32)[:, None] * inv[None, :]
    cos, sin = mx.cos(ang)[:, None, :], mx.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:rot]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], axis=-1)


def attend(q, k, v):
    """Causal GQA attention, q [L, nh, d], k/v [L, nkv, d] -> [L, nh * d]."""
    L, nh, d = q.shape
    g = nh // k.shape[1]
    k, v = mx.repeat(k, g, axis=1), mx.repeat(v, g, axis=1)
    s = mx.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    causal = mx.arange(L)[:, None] >= mx.arange(L)[None, :]
    s = mx.where(causal[None], s, -mx.inf)
    p = mx.softmax(s, axis=-1)
    return mx.einsum("hqk,khd->qhd", p, v).reshape(L, nh * d)


def lin(x, w):
    return x @ w.T


def glu(x, g, u, d):
    return lin(mx.sigmoid(lin(x, g)) * lin(x, g) * lin(x, u), d)


def ref_moe(W, p, y, n_experts, top_k):
    gates = mx.softmax(lin(y, W[p + "gate.weight"]), axis=-1)
    order = mx.argsort(-gates, axis=-1)[:, :top_k]
    chosen = mx.zeros_like(gates)
    chosen = mx.put_along_axis(chosen, order, mx.take_along_axis(gates, order, axis=-1), axis=-1)
    chosen = chosen / chosen.sum(axis=-1, keepdims=True)  # norm_topk_prob
    out = 0
    for e in range(n_experts):
        ge, ue, de = W[f"{p}e{e}.gate"], W[f"{p}e{e}.up"], W[f"{p}e{e}.down"]
        out = out + chosen[:, e : e + 1] * glu(y, ge, ue, de)
    shared = glu(y, W[p + "shared_expert.gate_proj.weight"], W[p + "shared_expert.up_proj.weight"],
                 W[p + "shared_expert.down_proj.weight"])
    return out + mx.sigmoid(lin(y, W[p + "shared_expert_gate.weight"])) * shared


def ref_mtp(W, E, head_w, tokens, hidden, nh, nkv, d, rot, base, moe=None):
    """heads_spec §2 over positions 0..L-1: W holds raw HF names without `mtp.`, norms
    zero-centred (1 + w); returns (logits, out_hidden)."""
    one = lambda k: 1.0 + W[k]
    L = tokens.shape[0]
    pos = mx.arange(L)
    u = lin(mx.concatenate([rms(E[tokens], one("pre_fc_norm_embedding.weight")),
                            rms(hidden, one("pre_fc_norm_hidden.weight"))], axis=-1), W["fc.weight"])
    p = "layers.0."
    x = rms(u, one(p + "input_layernorm.weight"))
    qg = lin(x, W[p + "self_attn.q_proj.weight"]).reshape(L, nh, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    q = rope(rms(q, one(p + "self_attn.q_norm.weight")), pos, rot, base)
    k = rope(rms(lin(x, W[p + "self_attn.k_proj.weight"]).reshape(L, nkv, d), one(p + "self_attn.k_norm.weight")),
             pos, rot, base)
    v = lin(x, W[p + "self_attn.v_proj.weight"]).reshape(L, nkv, d)
    a = attend(q, k, v) * mx.sigmoid(gate.reshape(L, nh * d))
    h = u + lin(a, W[p + "self_attn.o_proj.weight"])
    y = rms(h, one(p + "post_attention_layernorm.weight"))
    if moe is None:
        mlp = glu(y, W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"], W[p + "mlp.down_proj.weight"])
    else:
        mlp = ref_moe(W, p + "mlp.", y, *moe)
    o = rms(h + mlp, one("norm.weight"))
    return lin(o, head_w), o


def ref_eagle3(W, E, tokens, g, nh, nkv, d, base, flags=()):
    """heads_spec §3 (plus the speculators flags in `flags`) for rows with hidden g [L, H];
    returns (draft-vocab logits, out_hidden)."""
    L = tokens.shape[0]
    pos = mx.arange(L)
    p = "midlayer."
    gn = rms(g, W[p + "hidden_norm.weight"])
    x = mx.concatenate([rms(E[tokens], W[p + "input_layernorm.weight"]), gn], axis=-1)
    q = lin(x, W[p + "self_attn.q_proj.weight"]).reshape(L, nh, d)
    k = lin(x, W[p + "self_attn.k_proj.weight"]).reshape(L, nkv, d)
    v = lin(x, W[p + "self_attn.v_proj.weight"]).reshape(L, nkv, d)
    if "qk_norm" in flags:
        q, k = rms(q, W[p + "self_attn.q_norm.weight"]), rms(k, W[p + "self_attn.k_norm.weight"])
    z = (gn if "norm_before_residual" in flags else g) + lin(attend(rope(q, pos, d, base), rope(k, pos, d, base), v),
                                                            W[p + "self_attn.o_proj.weight"])
    y = rms(z, W[p + "post_attention_layernorm.weight"])
    out = z + glu(y, W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"], W[p + "mlp.down_proj.weight"])
    normed = rms(out, W["norm.weight"])
    return lin(normed, W["lm_head.weight"]), (normed if "norm_output" in flags else out)


def ref_fc(W, feats, flags=()):
    if "norm_before_fc" in flags:
        feats = rms(feats, W["input_norm.weight"])
    return lin(feats, W["fc.weight"])


# ------------------------------------------------------------------------------------------
# published layouts with random weights

def _normal(rng, *shape, std=0.2):
    return mx.array((rng.standard_normal(shape) * std).astype(np.float32))


def save_folder(path, config, tensors, index=False, name="model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / name), tensors)
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: name for k in tensors}}))
    return path


def mtp_tensors(rng, H, nh, nkv, d, inter, moe=None):
    """Raw HF `mtp.*` tensors (zero-centred norms: small w around 0). moe: None,
    ("per_expert", E, Im, Is) (Qwen3-Next) or ("fused", E, Im, Is) (Qwen3.5-MoE)."""
    n = lambda *s, std=0.2: _normal(rng, *s, std=std)
    zc = lambda k: _normal(rng, k, std=0.1)
    p = "mtp.layers.0."
    t = {"mtp.fc.weight": n(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": zc(H),
         "mtp.pre_fc_norm_hidden.weight": zc(H), "mtp.norm.weight": zc(H),
         p + "input_layernorm.weight": zc(H), p + "post_attention_layernorm.weight": zc(H),
         p + "self_attn.q_proj.weight": n(2 * nh * d, H), p + "self_attn.k_proj.weight": n(nkv * d, H),
         p + "self_attn.v_proj.weight": n(nkv * d, H), p + "self_attn.o_proj.weight": n(H, nh * d),
         p + "self_attn.q_norm.weight": zc(d), p + "self_attn.k_norm.weight": zc(d)}
    if moe is None:
        t.update({p + "mlp.gate_proj.weight": n(inter, H), p + "mlp.up_proj.weight": n(inter, H),
                  p + "mlp.down_proj.weight": n(H, inter)})
        return t
    kind, E, Im, Is = moe
    t[p + "mlp.gate.weight"] = n(E, H, std=1.0)
    t.update({p + "mlp.shared_expert.gate_proj.weight": n(Is, H), p + "mlp.shared_expert.up_proj.weight": n(Is, H),
              p + "mlp.shared_expert.down_proj.weight": n(H, Is), p + "mlp.shared_expert_gate.weight": n(1, H)})
    gates, ups, downs = [n(Im, H) for _ in range(E)], [n(Im, H) for _ in range(E)], [n(H, Im) for _ in range(E)]
    if kind == "per_expert":
        for e in range(E):
            t[f"{p}mlp.experts.{e}.gate_proj.weight"] = gates[e]
            t[f"{p}mlp.experts.{e}.up_proj.weight"] = ups[e]
            t[f"{p}mlp.experts.{e}.down_proj.weight"] = downs[e]
    else:
        t[p + "mlp.experts.gate_up_proj"] = mx.stack([mx.concatenate([g, u]) for g, u in zip(gates, ups)])
        t[p + "mlp.experts.down_proj"] = mx.stack(downs)
    return t


def ref_weights(tensors, moe=None):
    """The reference's view of raw mtp tensors: no prefix, experts as e{i}.{gate,up,down}."""
    W = {k[len("mtp."):]: v for k, v in tensors.items()}
    if moe is not None:
        E = moe[1]
        p = "layers.0.mlp."
        for e in range(E):
            if moe[0] == "per_expert":
                g, u, dn = (W[f"{p}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            else:
                gu = W[p + "experts.gate_up_proj"][e]
                g, u, dn = gu[: gu.shape[0] // 2], gu[gu.shape[0] // 2 :], W[p + "experts.down_proj"][e]
            W[f"{p}e{e}.gate"], W[f"{p}e{e}.up"], W[f"{p}e{e}.down"] = g, u, dn
    return W


def quantize_tensors(tensors, bits=4, group=32):
    """mlx-lm's quantized layout for every 2-D linear weight; returns (saved, dequantized)."""
    saved, deq = {}, {}
    for k, v in tensors.items():
        if v.ndim == 2 and k.endswith(".weight") and v.shape[-1] % group == 0 and v.shape[0] > 1:
            wq, s, b = mx.quantize(v, group_size=group, bits=bits)
            base = k[: -len(".weight")]
            saved.update({k: wq, base + ".scales": s, base + ".biases": b})
            deq[k] = mx.dequantize(wq, s, b, group_size=group, bits=bits)
        else:
            saved[k] = deq[k] = v
    return saved, deq


MTP_CASES = {
    # name: (target config, moe spec, quantized, index, mtp_hidden)
    "qwen3_5_tied": (dict(tiny.CONFIGS["qwen3_5"], tie_word_embeddings=True, rope_parameters=ROPE), None, False, True, "pre"),
    "qwen3_5_quantized": (dict(tiny.CONFIGS["qwen3_5"], rope_parameters=ROPE), None, True, False, None),
    "qwen3_next_moe": (tiny.CONFIGS["qwen3_next"], ("per_expert", 4, 64, 64), False, False, "post"),
    "qwen3_5_moe_fused": (dict(tiny.CONFIGS["qwen3_5"], model_type="qwen3_5_moe", rope_parameters=ROPE, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64),
                          ("fused", 4, 64, 64), False, True, None),
}


def make_mtp(tmp_path, name, seed=0):
    cfg, moe, quantized, index, kind = MTP_CASES[name]
    rng = np.random.default_rng(seed)
    target = tiny.build(cfg)
    H, nh, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    tensors = mtp_tensors(rng, H, nh, nkv, d, 96, moe)
    deq = tensors
    config = dict(cfg, mtp_num_hidden_layers=1)
    if kind is not None:
        config["mtp_hidden"] = kind
    if quantized:
        tensors, deq = quantize_tensors(tensors)
        config["quantization"] = {"group_size": 32, "bits": 4}
    folder = save_folder(tmp_path / name, config, tensors, index=index, name="model-mtp.safetensors")
    head = load_mtp(str(folder), target)
    lm = getattr(target, "language_model", target)
    E = lm.model.embed_tokens.weight
    head_w = E if cfg.get("tie_word_embeddings") else lm.lm_head.weight
    ref = lambda toks, hid: ref_mtp(ref_weights(deq, moe), E, head_w, toks, hid, nh, nkv, d, d // 4, 10000.0,
                                    moe=None if moe is None else (moe[1], cfg["num_experts_per_tok"]))
    return head, target, ref, kind or "post"


def close(a, b, tol=1e-4):
    a, b = np.array(a.astype(F32)), np.array(b.astype(F32))
    assert a.shape == b.shape
    assert np.allclose(a, b, atol=tol, rtol=tol), f"max abs diff {np.abs(a - b).max()}"


# ------------------------------------------------------------------------------------------
# MTP

@pytest.mark.parametrize("name", list(MTP_CASES))
def test_mtp_matches_reference(tmp_path, name):
    head, target, ref, kind = make_mtp(tmp_path, name)
    assert head.hidden_kind == kind
    rng = np.random.default_rng(1)
    H = head.args.hidden_size
    tokens = mx.array(rng.integers(0, tiny.VOCAB, 9).astype(np.uint32))
    hidden = _normal(rng, 9, H, std=1.0)
    want_logits, want_hidden = ref(tokens, hidden)
    # one pass over a fresh cache, and the same rows split over two calls on one cache
    cache = head.make_cache()
    close(head(tokens[None], cache=cache, hidden=hidden[None])[0], want_logits)
    close(head.out_hidden[0], want_hidden)
    cache = head.make_cache()
    first = head(tokens[None, :5], cache=cache, hidden=hidden[None, :5])
    head.pending_hidden = hidden[5:]  # the TreeRound route: hidden set before a plain call
    rest = head(tokens[None, 5:], cache=cache)
    assert head.pending_hidden is None  # used once
    close(mx.concatenate([first, rest], axis=1)[0], want_logits)
    assert cache[0].offset == 9


def _bench_run():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import run

    return run


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_joined_head_steps_are_the_separate_layers(tmp_path, kind):
    # a drafting head runs q/k/v and the MLP's gate/up as one matmul each (join.py: three
    # launches fewer a step); each output column is the same dot product, so on CPU the logits
    # and hidden are the separate layers' bit for bit
    from mlx_treespec.join import join, joined_groups, running

    if kind == "mtp":
        head, _, _, _ = make_mtp(tmp_path, "qwen3_5_tied")
        width, owners = head.args.hidden_size, {"layers.0.self_attn", "layers.0.mlp"}
    else:
        head, _, _, _, _, _ = make_eagle3(tmp_path, "safeailab")
        width, owners = 3 * H, {"midlayer.self_attn", "midlayer.mlp"}
    rng = np.random.default_rng(3)
    tokens = mx.array(rng.integers(0, tiny.VOCAB, 6).astype(np.uint32))
    hidden = _normal(rng, 6, width, std=1.0)

    def run():
        cache = head.make_cache()
        first = head(tokens[None, :4], cache=cache, hidden=hidden[None, :4])
        own = head.out_hidden[:, -2:] if kind == "eagle3" else hidden[None, 4:]  # (a later step's hidden)
        return mx.concatenate([first, head(tokens[None, 4:], cache=cache, hidden=own)], axis=1), head.out_hidden

    separate = run()
    names = sorted(k for k, _ in tree_flatten(head.parameters()))
    join(head)
    assert {owner for owner, _ in joined_groups(head)} == owners
    assert sorted(k for k, _ in tree_flatten(head.parameters())) == names  # (the checkpoint's names)
    with running():
        joined = run()
    assert all(mx.array_equal(a, b).item() for a, b in zip(joined, separate))


def test_eagle3_raw_weights_round_trip(tmp_path):
    # what bench/ship_heads.py saves from a loaded, quantized head (head.raw_weights(), the
    # SafeAILab names, plus d2t / t2d) loads back to it, joined or not
    from mlx_treespec.join import join

    head, target, W, _, _, _ = make_eagle3(tmp_path, "safeailab")
    nn.quantize(head, group_size=32, bits=4)
    join(head)
    raw = head.raw_weights()
    assert "midlayer.self_attn.k_proj.scales" in raw
    folder = save_folder(tmp_path / "again", safeailab_config(eagle_aux_hidden_state_layer_ids=[1, 3, 4],
                                                              quantization={"group_size": 32, "bits": 4}),
                         dict(raw, d2t=W["d2t"], t2d=W["t2d"]))
    again = load_eagle3(str(folder), target)
    want = dict(tree_flatten(head.parameters()))  # (quantized: compared as the loader dequantizes)
    got = dict(tree_flatten(again.parameters()))
    lin = head.midlayer.self_attn.k_proj
    assert mx.array_equal(got["midlayer.self_attn.k_proj.weight"],
                          mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=32, bits=4).astype(
                              got["midlayer.self_attn.k_proj.weight"].dtype)).item()
    assert {k for k in got} == {k.replace(".scales", ".weight") for k in want if not k.endswith(".biases")}


def path_of(parents, i):
    path = []
    while i != -1:
        path.append(i)
        i = parents[i]
    return path[::-1]


TREE = np.array([-1, 0, 1, 1, 0, 4, 2, 6, 3])


def check_tree_exact(head, prefill, step_kwargs, hidden_dim, seed=2):
    """A tree forward over the head's prefilled cache (hidden per node) equals, per node,
    decoding its root path one token at a time: logits and out_hidden, bitwise."""
    rng = np.random.default_rng(seed)
    cache = head.make_cache()
    prefill(cache)
    mx.eval([c.state for c in cache])
    committed = copy.deepcopy(cache)
    n = len(TREE)
    tokens = rng.integers(0, tiny.VOCAB, n).astype(np.uint32)
    hidden = _normal(rng, n, hidden_dim, std=1.0)
    rnd = TreeRound(head, cache)
    head.pending_hidden = hidden[None]
    for k, v in step_kwargs.items():
        setattr(head, "pending_" + k, v)
    logits = rnd.forward(mx.array(tokens), TREE)
    out_hidden = head.out_hidden[0]
    assert logits.shape[0] == n
    for i in range(n):
        c = copy.deepcopy(committed)
        for j in path_of(TREE, i):
            out = head(mx.array([[int(tokens[j])]]), cache=c, hidden=hidden[j][None, None], **step_kwargs)
        assert mx.array_equal(out[0, 0], logits[i]), f"node {i}: tree logits differ from decoding its path"
        assert mx.array_equal(head.out_hidden[0, 0], out_hidden[i]), f"node {i}: out_hidden differs"
    rnd.abort()
    assert cache[0].offset == committed[0].offset


def _pad(monkeypatch, pad):
    """pad: the GPU's layout (whole KV buffers, rows padded to a power of two with filler rows
    whose hidden the head pads), forced on CPU."""
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: pad)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("name", ["qwen3_5_tied", "qwen3_next_moe"])
def test_mtp_tree_forward_is_path_decoding(tmp_path, monkeypatch, name, pad):
    _pad(monkeypatch, pad)
    head, target, _, _ = make_mtp(tmp_path, name)
    H = head.args.hidden_size
    rng = np.random.default_rng(5)

    def prefill(cache):
        head(mx.array(rng.integers(0, tiny.VOCAB, (1, 7)).astype(np.uint32)), cache=cache,
             hidden=_normal(rng, 1, 7, H, std=1.0))

    check_tree_exact(head, prefill, {}, H)
    assert is_tree_module(head.layers[0].self_attn.rope)  # TreeRound re-classed mlx-lm's rope


def test_mtp_target_hidden_from_capture(tmp_path):
    # head.capture + head.target_hidden give the target's last hidden: post = after its norm
    head, target, _, kind = make_mtp(tmp_path, "qwen3_next_moe")
    from mlx_lm.models.cache import make_prompt_cache

    toks = mx.array([3, 1, 4, 1, 5], mx.uint32)
    rnd = TreeRound(target, make_prompt_cache(target), capture=head.capture)
    rnd.forward(toks, np.arange(5) - 1)
    assert kind == "post" and head.capture == (len(target.layers) - 1,)
    close(head.target_hidden(rnd.hidden), target.model(toks[None])[0], tol=1e-5)


def test_mtp_folder_still_loads_in_mlx_lm(tmp_path):
    # mlx-lm's qwen3_5 sanitize drops mtp.*: the folder with model-mtp.safetensors loads unchanged
    from pathlib import Path
    from mlx_lm.utils import load_model

    cfg = dict(tiny.CONFIGS["qwen3_5"], tie_word_embeddings=True, rope_parameters=ROPE)
    target = tiny.build(cfg)
    folder = save_folder(tmp_path / "t", dict(cfg, mtp_num_hidden_layers=1, mtp_hidden="post"),
                         dict(tree_flatten(target.parameters())))
    mx.save_safetensors(str(folder / "model-mtp.safetensors"),
                        mtp_tensors(np.random.default_rng(0), 64, 4, 2, 16, 96))
    # an mlx-lm index that does not list the added file: load_mtp reads it all the same
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k, _ in tree_flatten(target.parameters())}}))
    loaded, _ = load_model(Path(folder))
    toks = mx.array([[1, 2, 3, 4]])
    assert mx.array_equal(loaded(toks), target(toks))
    head = load_mtp(str(folder), loaded)
    assert head(toks, cache=head.make_cache(), hidden=mx.zeros((1, 4, 64))).shape == (1, 4, tiny.VOCAB)


def _one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_mtp_loader_errors(tmp_path):
    cfg = dict(tiny.CONFIGS["qwen3_5"], rope_parameters=ROPE)
    target = tiny.build(cfg)
    rng = np.random.default_rng(0)
    good = mtp_tensors(rng, 64, 4, 2, 16, 96)
    # no mtp.* weights: the fix is named
    plain = save_folder(tmp_path / "plain", cfg, {"model.norm.weight": mx.ones(64)})
    assert _one_line_error(lambda: load_mtp(str(plain), target), "no MTP layer") == NO_MTP
    _one_line_error(lambda: load_mtp(str(tmp_path / "nowhere"), target), "config.json")
    # a target of another family
    ok = save_folder(tmp_path / "ok", cfg, good)
    _one_line_error(lambda: load_mtp(str(ok), tiny.build(tiny.CONFIGS["qwen3"])), "qwen3_5")
    # more than one layer
    deep = save_folder(tmp_path / "deep", dict(cfg, mtp_num_hidden_layers=2), good)
    _one_line_error(lambda: load_mtp(str(deep), target), "only one MTP layer")
    two = dict(good, **{"mtp.layers.1.input_layernorm.weight": mx.zeros(64)})
    _one_line_error(lambda: load_mtp(str(save_folder(tmp_path / "two", cfg, two)), target), "one MTP layer")
    # a missing tensor, weights for another hidden size, a bad mtp_hidden
    missing = {k: v for k, v in good.items() if "k_norm" not in k}
    _one_line_error(lambda: load_mtp(str(save_folder(tmp_path / "miss", cfg, missing)), target), "k_norm")
    other = mtp_tensors(rng, 32, 4, 2, 16, 96)
    _one_line_error(lambda: load_mtp(str(save_folder(tmp_path / "other", cfg, other)), target), "hidden size")
    bad_kind = save_folder(tmp_path / "kind", dict(cfg, mtp_hidden="final"), good)
    _one_line_error(lambda: load_mtp(str(bad_kind), target), "mtp_hidden")


def test_mtp_norm_layout_is_read_from_the_values(tmp_path):
    # zero_centred=False reads norms as already shifted: the head differs from the raw reading
    # by exactly the +1 on every norm. Unsaid, the values decide: a folder whose mtp.* norms
    # were written shifted (vllm-mlx's add_mtp_weights.py: the same names) loads the raw
    # folder's head (it was shifted twice: norms near 2), and a median between 0 and 1 is a
    # one-line error naming zero_centred=
    from mlx_treespec.drafters.mtp import _is_norm

    head, target, ref, _ = make_mtp(tmp_path, "qwen3_5_tied")
    folder = tmp_path / "qwen3_5_tied"
    shifted = load_mtp(str(folder), target, zero_centred=False)
    a = dict(tree_flatten(head.parameters()))
    b = dict(tree_flatten(shifted.parameters()))
    for k in a:
        if a[k].ndim == 1:
            assert mx.allclose(a[k], b[k] + 1.0, atol=1e-6), k
        else:
            assert mx.array_equal(a[k], b[k]), k
    raw = mx.load(str(folder / "model-mtp.safetensors")) if (folder / "model-mtp.safetensors").exists() else \
        {k: v for k, v in mx.load(str(folder / "model.safetensors")).items() if k.startswith("mtp.")}
    cfg = dict(MTP_CASES["qwen3_5_tied"][0], mtp_num_hidden_layers=1)
    norm = lambda k, v: v.ndim == 1 and _is_norm(k[len("mtp."):])  # noqa: E731
    assert any(norm(k, v) for k, v in raw.items())
    plus = {k: v + 1.0 if norm(k, v) else v for k, v in raw.items()}
    c = dict(tree_flatten(load_mtp(str(save_folder(tmp_path / "shifted", cfg, plus)), target).parameters()))
    assert all(mx.allclose(a[k], c[k], atol=1e-6) for k in a)
    half = {k: v + 0.5 if norm(k, v) else v for k, v in raw.items()}
    _one_line_error(lambda: load_mtp(str(save_folder(tmp_path / "half", cfg, half)), target), "zero_centred=True")
    load_mtp(str(tmp_path / "half"), target, zero_centred=True)  # (said: loaded)


@pytest.mark.parametrize("name", ["qwen3_5_quantized", "qwen3_next_moe"])
def test_mtp_raw_weights_round_trip(tmp_path, name):
    # what a shipper saves from a loaded head (head.raw_weights()) loads back to the same head
    head, target, _, _ = make_mtp(tmp_path, name)
    cfg = MTP_CASES[name][0]
    folder = save_folder(tmp_path / "again", dict(cfg, mtp_hidden="pre"), head.raw_weights(),
                         name="model-mtp.safetensors")
    again = load_mtp(str(folder), target)
    a, b = dict(tree_flatten(head.parameters())), dict(tree_flatten(again.parameters()))
    assert a.keys() == b.keys() and all(mx.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert again.hidden_kind == "pre"


# ------------------------------------------------------------------------------------------
# EAGLE-3

EAGLE_TARGET = dict(tiny.CONFIGS["qwen3"], num_hidden_layers=8)
H, NH, NKV, D, INTER, VD = 64, 4, 2, 16, 128, 40


def eagle3_tensors(rng, flags=(), n_aux=3, vocab=tiny.VOCAB):
    n = lambda *s: _normal(rng, *s)
    nw = lambda k: 1.0 + _normal(rng, k, std=0.1)  # plain norms, around 1
    p = "midlayer."
    t = {"fc.weight": n(H, n_aux * H), p + "input_layernorm.weight": nw(H), p + "hidden_norm.weight": nw(H),
         p + "self_attn.q_proj.weight": n(NH * D, 2 * H), p + "self_attn.k_proj.weight": n(NKV * D, 2 * H),
         p + "self_attn.v_proj.weight": n(NKV * D, 2 * H), p + "self_attn.o_proj.weight": n(H, NH * D),
         p + "post_attention_layernorm.weight": nw(H), p + "mlp.gate_proj.weight": n(INTER, H),
         p + "mlp.up_proj.weight": n(INTER, H), p + "mlp.down_proj.weight": n(H, INTER), "norm.weight": nw(H),
         "lm_head.weight": n(VD, H)}
    if "qk_norm" in flags:
        t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = nw(D), nw(D)
    if "norm_before_fc" in flags:
        t["input_norm.weight"] = nw(n_aux * H)
    used = np.sort(rng.permutation(vocab)[:VD])
    t["d2t"] = mx.array((used - np.arange(VD)).astype(np.int64))
    t2d = np.zeros(vocab, bool)
    t2d[used] = True
    t["t2d"] = mx.array(t2d)
    return t, used


def safeailab_config(**extra):
    c = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=H, num_attention_heads=NH,
             num_key_value_heads=NKV, head_dim=D, intermediate_size=INTER, rms_norm_eps=1e-6, rope_theta=10000.0,
             vocab_size=tiny.VOCAB, draft_vocab_size=VD, target_hidden_size=H, num_hidden_layers=1,
             max_position_embeddings=4096, hidden_act="silu", tie_word_embeddings=False)
    c.update(extra)
    return c


def speculators_config(flags, ids):
    layer = dict(model_type="qwen3" if "qk_norm" in flags else "llama", hidden_size=H, num_attention_heads=NH,
                 num_key_value_heads=NKV, head_dim=D, intermediate_size=INTER, rms_norm_eps=1e-6,
                 rope_theta=10000.0, vocab_size=tiny.VOCAB, num_hidden_layers=1, max_position_embeddings=4096)
    c = dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3", transformer_layer_config=layer,
             draft_vocab_size=VD, target_hidden_size=None, eagle_aux_hidden_state_layer_ids=ids,
             speculators_config={"algorithm": "eagle3"})
    for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        c[f] = f in flags
    return c


EAGLE_CASES = {
    # name: (layout, flags, aux ids in the config, expected capture)
    "safeailab": ("safeailab", (), [1, 3, 4], (1, 3, 4)),
    "safeailab_default_ids": ("safeailab", (), None, (1, 3, 4)),
    "speculators": ("speculators", ("norm_before_residual", "norm_before_fc", "norm_output", "qk_norm"),
                    [2, 4, 6], (1, 3, 5)),
}


def make_eagle3(tmp_path, name, seed=0):
    layout, flags, ids, capture = EAGLE_CASES[name]
    rng = np.random.default_rng(seed)
    target = tiny.build(EAGLE_TARGET)
    tensors, used = eagle3_tensors(rng, flags)
    if layout == "safeailab":
        config = safeailab_config(**({} if ids is None else {"eagle_aux_hidden_state_layer_ids": ids}))
        saved = tensors
    else:
        config = speculators_config(flags, ids)
        saved = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    folder = save_folder(tmp_path / name, config, saved)
    head = load_eagle3(str(folder), target)
    assert head.capture == capture
    E = target.model.embed_tokens.weight
    return head, target, tensors, used, flags, E


@pytest.mark.parametrize("name", list(EAGLE_CASES))
def test_eagle3_matches_reference(tmp_path, name):
    head, target, W, used, flags, E = make_eagle3(tmp_path, name)
    rng = np.random.default_rng(1)
    L, l2 = 7, 3
    tokens = mx.array(rng.integers(0, tiny.VOCAB, L + l2).astype(np.uint32))
    feats = _normal(rng, L, 3 * H, std=1.0)  # first step: the target's 3 aux-layer outputs
    later = _normal(rng, l2, H, std=1.0)  # later steps: a hidden of the head's own
    g = mx.concatenate([ref_fc(W, feats, flags), later])
    want, want_hidden = ref_eagle3(W, E, tokens, g, NH, NKV, D, 10000.0, flags)
    cache = head.make_cache()
    a = head(tokens[None, :L], cache=cache, hidden=feats[None], first=True)
    ha = head.out_hidden
    head.pending_hidden, head.pending_first = later[None], False  # the TreeRound route
    b = head(tokens[None, L:], cache=cache)
    got = mx.concatenate([a, b], axis=1)[0]
    assert got.shape == (L + l2, tiny.VOCAB)
    close(got[:, mx.array(used)], want)  # draft ids land on their target ids
    off = np.ones(tiny.VOCAB, bool)
    off[used] = False
    assert np.all(np.isneginf(np.array(got)[:, off]))  # nothing else can be chosen
    assert np.array_equal(np.array(mx.argmax(got, axis=-1)), used[np.array(mx.argmax(want, axis=-1))])
    close(mx.concatenate([ha, head.out_hidden], axis=1)[0], want_hidden)
    # `first` inferred from the width when not given
    close(head(tokens[None, :L], cache=head.make_cache(), hidden=feats[None])[0], got[:L])


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("name", ["safeailab", "speculators"])
def test_eagle3_tree_forward_is_path_decoding(tmp_path, monkeypatch, name, pad):
    _pad(monkeypatch, pad)
    head, target, *_ = make_eagle3(tmp_path, name)
    rng = np.random.default_rng(5)

    def prefill(cache):  # the catch-up pass: target features
        head(mx.array(rng.integers(0, tiny.VOCAB, (1, 6)).astype(np.uint32)), cache=cache,
             hidden=_normal(rng, 1, 6, 3 * H, std=1.0), first=True)

    check_tree_exact(head, prefill, {"first": False}, H)
    assert is_tree_module(head.midlayer.self_attn.rope)


def test_eagle3_capture_reads_the_named_layers(tmp_path):
    # head.capture plugs into TreeRound's capture: the features are those layers' outputs
    head, target, *_ = make_eagle3(tmp_path, "safeailab")
    from mlx_lm.models.cache import make_prompt_cache

    toks = mx.array([[3, 1, 4, 1, 5]])
    rnd = TreeRound(target, make_prompt_cache(target), capture=head.capture)
    rnd.forward(toks[0].astype(mx.uint32), np.arange(5) - 1)
    feats = rnd.hidden
    assert feats.shape == (5, 3 * H)
    h = target.model.embed_tokens(toks)
    outs = []
    for layer in target.model.layers:
        h = layer(h, mask="causal", cache=None)
        outs.append(h)
    want = mx.concatenate([outs[i][0] for i in head.capture], axis=-1)
    close(feats, want, tol=1e-5)


def test_eagle3_over_the_whole_vocab_drafts_through_the_target_lm_head(tmp_path):
    # a head over the whole target vocab (d2t all zero) with no lm_head of its own: EAGLE-1/2's way,
    # the target's lm_head; with its own copy of that lm_head it computes the same logits, and an
    # identity d2t map scatters nothing
    target = tiny.build(EAGLE_TARGET)
    rng = np.random.default_rng(3)
    tensors, _ = eagle3_tensors(rng)
    V = tiny.VOCAB
    tensors.update(d2t=mx.zeros((V,), mx.int64), t2d=mx.ones((V,), mx.bool_))
    _, _, lm = target_io(target)
    own = dict(tensors, **{"lm_head.weight": lm(mx.eye(H)).T})  # the target's lm_head as a matrix
    tied = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    config = safeailab_config(draft_vocab_size=V)
    a = load_eagle3(str(save_folder(tmp_path / "own", config, own)), target)
    b = load_eagle3(str(save_folder(tmp_path / "tied", config, tied)), target)
    assert a._gather is None and "lm_head" in a and "lm_head" not in b
    tokens = mx.array(rng.integers(0, V, (1, 5)).astype(np.uint32))
    feats = _normal(rng, 1, 5, 3 * H, std=1.0)
    la, lb = (h(tokens, cache=h.make_cache(), hidden=feats, first=True) for h in (a, b))
    assert la.shape == lb.shape == (1, 5, V)
    np.testing.assert_allclose(np.array(la), np.array(lb), rtol=1e-5, atol=1e-5)

    def prefill(cache):
        b(mx.array(rng.integers(0, V, (1, 6)).astype(np.uint32)), cache=cache,
          hidden=_normal(rng, 1, 6, 3 * H, std=1.0), first=True)

    check_tree_exact(b, prefill, {"first": False}, H)
    narrow = {k: v for k, v in eagle3_tensors(rng)[0].items() if k != "lm_head.weight"}
    _one_line_error(lambda: load_eagle3(str(save_folder(tmp_path / "narrow", safeailab_config(), narrow)), target),
                    "no lm_head.weight, and a draft vocab of 40")


def test_eagle3_loader_errors(tmp_path):
    target = tiny.build(EAGLE_TARGET)
    rng = np.random.default_rng(0)
    tensors, _ = eagle3_tensors(rng)
    _one_line_error(lambda: load_eagle3(str(tmp_path / "nowhere"), target), "no config.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(safeailab_config()))
    _one_line_error(lambda: load_eagle3(str(empty), target), "no \\*.safetensors")
    wide = save_folder(tmp_path / "wide", safeailab_config(target_hidden_size=128), tensors)
    _one_line_error(lambda: load_eagle3(str(wide), target), "hidden size 128")
    deep = save_folder(tmp_path / "deep", safeailab_config(eagle_aux_hidden_state_layer_ids=[1, 3, 8]), tensors)
    _one_line_error(lambda: load_eagle3(str(deep), target), "beyond the target's 8 layers")
    shallow = tiny.build(dict(EAGLE_TARGET, num_hidden_layers=2))  # default ids need L >= 5
    ok = save_folder(tmp_path / "ok", safeailab_config(), tensors)
    _one_line_error(lambda: load_eagle3(str(ok), shallow), "beyond the target's 2 layers")
    bigger, _ = eagle3_tensors(rng, vocab=tiny.VOCAB + 8)
    vocab = save_folder(tmp_path / "vocab", safeailab_config(), bigger)
    _one_line_error(lambda: load_eagle3(str(vocab), target), "t2d has 104 entries")
    cfg_vocab = save_folder(tmp_path / "cfgvocab", safeailab_config(vocab_size=200), tensors)
    _one_line_error(lambda: load_eagle3(str(cfg_vocab), target), "vocab_size 200")
    two = dict(tensors, **{"fc.weight": _normal(rng, H, 2 * H)})
    _one_line_error(lambda: load_eagle3(str(save_folder(tmp_path / "two", safeailab_config(), two)), target),
                    "reads 128 features")
    spec = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    spec["layers.1.input_layernorm.weight"] = mx.ones(H)
    deep_draft = save_folder(tmp_path / "layers", speculators_config((), [2, 4, 5]), spec)
    _one_line_error(lambda: load_eagle3(str(deep_draft), target), "only one-layer")
    missing = {k: v for k, v in tensors.items() if k != "norm.weight"}
    _one_line_error(lambda: load_eagle3(str(save_folder(tmp_path / "miss", safeailab_config(), missing)), target),
                    "norm.weight")
    # a d2t that sends two draft ids to one target id, or of shape [Vd, 1] (it broadcast): refused
    d2t = np.array(tensors["d2t"])
    twice = dict(tensors, d2t=mx.array(np.concatenate([[d2t[1] + 1], d2t[1:]])))
    _one_line_error(lambda: load_eagle3(str(save_folder(tmp_path / "twice", safeailab_config(), twice)), target),
                    "two draft ids to one target id")
    column = dict(tensors, d2t=tensors["d2t"][:, None])
    _one_line_error(lambda: load_eagle3(str(save_folder(tmp_path / "column", safeailab_config(), column)), target),
                    "d2t has shape")


def _spec_with_own_embed(shape, seed=3):
    et, _ = eagle3_tensors(np.random.default_rng(0))
    spec = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in et.items()}
    spec["embed_tokens.weight"] = mx.random.normal(shape, key=mx.random.key(seed))
    return spec


def test_broken_head_folders_are_one_line_errors(tmp_path):
    """A weights file that is a git-lfs pointer, empty or cut short, a shard the index names that
    is not there, and an EAGLE-3 head's own embedding of the wrong shape or stored quantized:
    one line naming the fix (they were a MemoryError, struct.error, a RuntimeError, the wrong
    message, or a head that loaded and drafted from rows that do not exist)."""
    cfg = dict(tiny.CONFIGS["qwen3_5"], rope_parameters=ROPE)
    target, etarget = tiny.build(cfg), tiny.build(EAGLE_TARGET)
    good = mtp_tensors(np.random.default_rng(0), 64, 4, 2, 16, 96)
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 123456\n"
    for i, content in enumerate((pointer, b"", None)):
        folder = tmp_path / f"mtp{i}"
        save_folder(folder, cfg, good, name="model-mtp.safetensors")
        weights = folder / "model-mtp.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(content if content is not None else data[: len(data) - 64])
        with pytest.raises(ValueError, match="download the weights again") as e:
            load_mtp(str(folder), target)
        assert len(str(e.value).splitlines()) == 1
    folder = tmp_path / "index"
    save_folder(folder, cfg, good, name="model-mtp.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00009-of-00009.safetensors" for k in good}}))
    with pytest.raises(ValueError, match="named in the folder's index, is not there"):
        load_mtp(str(folder), target)
    for shape in ((40, H), (tiny.VOCAB, 32)):  # (the draft vocabulary's rows; another width)
        folder = tmp_path / f"embed{shape[0]}x{shape[1]}"
        save_folder(folder, dict(speculators_config((), [2, 4, 6]), embed_requires_grad=True),
                    _spec_with_own_embed(shape))
        with pytest.raises(ValueError, match="embed_tokens"):
            load_eagle3(str(folder), etarget)


def test_an_eagle3_head_with_its_own_embedding_keeps_it_when_bound_again(tmp_path):
    """bind (the way to pick up new target weights) kept the target's embedding, not the head's."""
    etarget = tiny.build(EAGLE_TARGET)
    save_folder(tmp_path, dict(speculators_config((), [2, 4, 6]), embed_requires_grad=True),
                _spec_with_own_embed((tiny.VOCAB, H)))
    head = load_eagle3(str(tmp_path), etarget)
    toks, feats = mx.array([[5, 7, 9]]), mx.random.normal((1, 3, 3 * H), key=mx.random.key(4))
    before = head(toks, hidden=feats, first=True)
    head.bind(etarget)
    assert head._embed.weight is not etarget.model.embed_tokens.weight
    assert mx.array_equal(before, head(toks, hidden=feats, first=True)).item()


def test_a_numpy_integer_draft_vocabulary_narrows_as_an_int(tmp_path):
    """narrowed(np.int64(n)) took n for one row id: the logits lost a dimension (and the view,
    cached under the same key as n, broke later calls with n)."""
    head = make_mtp(tmp_path, "qwen3_5_tied")[0]
    x = mx.random.normal((1, 2, 64))
    a = head.narrowed(np.int64(32))._logits(head._lm_head, x)
    assert a.shape == (1, 2, tiny.VOCAB)
    assert mx.array_equal(a, head.narrowed(32)._logits(head._lm_head, x)).item()


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_a_head_shipped_in_any_quantization_mode_runs_as_its_float_values(mode):
    """dequantize_linears dropped the mode: an mxfp4 / nvfp4 / mxfp8 head failed to load."""
    from mlx_treespec.drafters import dequantize_linears

    lin = nn.Linear(64, 32)
    q = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4, mode=mode)
    want = mx.dequantize(q.weight, q.scales, q.get("biases"), group_size=32, bits=4, mode=mode)
    holder = nn.Module()
    holder.proj, holder.norm = q, nn.RMSNorm(64)
    dequantize_linears(holder)
    assert isinstance(holder.proj, nn.Linear) and mx.array_equal(holder.proj.weight, want).item()
