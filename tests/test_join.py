"""Joined projections (mlx_treespec/join.py): linear layers that read one input run as one
matmul inside the library's forwards, bit for bit their own on CPU, and never stale."""
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step

import tiny
from mlx_treespec import RoundStats, tree_generate_step
from mlx_treespec import join as joining
from mlx_treespec.drafters.model import ModelDrafter

PROMPT = [5, 17, 42, 8, 63, 11, 29]

# family -> the groups a tiny model of it joins (one per layer each)
JOINS = {
    "qwen3": {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")},
    "qwen2": {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")},  # (q/k/v with biases)
    "qwen3_5": {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
    "qwen3_next": {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkvz", "in_proj_ba")},
}


def _quantized(model):
    nn.quantize(model, group_size=32, bits=4)
    return model


@pytest.mark.parametrize("family,quantize", [(f, False) for f in JOINS] + [("qwen3", True), ("qwen3_5", True)])
def test_joined_forward_is_the_separate_forward(family, quantize):
    # each joined column is the layer's own dot product: on CPU the logits are bit for bit the
    # separate layers', in a library forward and outside one; the parameters keep their names
    model = tiny.build(tiny.CONFIGS[family])
    if quantize:
        _quantized(model)
    tokens = mx.array(PROMPT)[None]
    separate = model(tokens)
    names = sorted(k for k, _ in tree_flatten(model.parameters()))
    joining.join(model)
    assert {names for _, names in joining.joined_groups(model)} == JOINS[family]
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == names
    with joining.running():
        joined = model(tokens)
    assert mx.array_equal(joined, separate).item()
    assert mx.array_equal(model(tokens), separate).item()  # (mlx-lm's own forward, as before)


def test_a_group_runs_one_matmul_per_input(monkeypatch):
    model = tiny.build(tiny.CONFIGS["qwen3"])
    groups = joining.join(model)
    calls = []
    matmul = joining._Group.matmul
    monkeypatch.setattr(joining._Group, "matmul", lambda self, x: calls.append(self) or matmul(self, x))
    model(mx.array(PROMPT)[None])
    assert calls == []  # outside a library forward: every layer its own
    with joining.running():
        model(mx.array(PROMPT)[None])
    assert len(calls) == len(groups) == 2 * tiny.CONFIGS["qwen3"]["num_hidden_layers"]
    assert {id(g) for g in calls} == {id(g) for g in groups}


def _generate(target, draft):
    stats = RoundStats()
    drafter = ModelDrafter(draft, topk=2, depth=3)
    out = [int(t) for t, _, _ in tree_generate_step(PROMPT, target, drafter, max_tokens=24, stats=stats)]
    return out, stats


def _plain(model):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=24)]


def test_new_weights_join_again():
    # weights set after a join (an update, a load) leave its joint stale: the next generation
    # joins again, and its tokens are the new weights' own
    target = tiny.build(tiny.CONFIGS["qwen3"])
    draft = tiny.perturbed(target)
    out, stats = _generate(target, draft)
    assert out == _plain(target) and sum(stats.accepted) > 0
    before = joining.join(target)
    target.update(tree_map(lambda w: w * 0.9 if w.ndim == 2 else w, target.parameters()))
    assert not any(g.intact() for g in before)
    again, _ = _generate(target, draft)
    assert again == _plain(target) and again != out
    assert all(g.intact() for g in joining.join(target)) and joining.join(target)[0] is not before[0]


def test_a_stale_joint_is_never_run():
    """Weights set after a join and before the next generation joins again (a TreeRound driven
    directly, a draft model the loop does not join, a deep copy re-weighted): each layer runs
    its own weights (the stale joint ran the old ones, and the tree forward was not decoding)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_treespec.verify import TreeRound

    model = tiny.build(tiny.CONFIGS["qwen3"])
    TreeRound(model, make_prompt_cache(model))  # installs it (and joins it, once)
    model.update(tree_map(lambda w: w * 1.1 if w.ndim == 2 else w, model.parameters()))
    prompt, tokens, parents = list(range(3, 12)), [5, 9, 2, 7], [-1, 0, 0, 1]
    caches = make_prompt_cache(model)
    model(mx.array([prompt]), cache=caches)
    rnd = TreeRound(model, caches)
    logits = rnd.forward(mx.array(tokens, mx.uint32), parents)
    for node, path in ((1, [5, 9]), (2, [5, 2]), (3, [5, 9, 7])):  # each node: its root path decoded
        ref = make_prompt_cache(model)
        model(mx.array([prompt]), cache=ref)
        for t in path:
            want = model(mx.array([[t]]), cache=ref)[0, -1]
        assert mx.array_equal(logits[node], want).item()


def test_layers_that_cannot_be_one_matmul_stay_apart():
    # joined, a float16 layer's output would be promoted to float32; a bias on some layers,
    # quantization on some or at different bits, another input width: each stays as it is
    def owner(*kv):
        m = nn.Module()
        m.q_proj = nn.QuantizedLinear(64, 32, bias=False) if isinstance(kv[0], nn.QuantizedLinear) else \
            nn.Linear(64, 32, bias=False)
        m.k_proj, m.v_proj = kv
        return m

    half = nn.Linear(64, 16, bias=False)
    half.set_dtype(mx.float16)
    quant = lambda bits=4: nn.QuantizedLinear(64, 16, bias=False, bits=bits)  # noqa: E731
    plain = lambda **kw: nn.Linear(kw.get("width", 64), 16, bias=kw.get("bias", False))  # noqa: E731
    for kv in [(plain(), half), (plain(), plain(bias=True)), (plain(), quant()), (plain(), plain(width=32)),
               (quant(), quant(8))]:
        assert joining.join(owner(*kv)) == []
    m = owner(quant(), quant())
    assert len(joining.join(m)) == 1
    x = mx.random.normal((1, 3, 64))
    with joining.running():
        q, k = m.q_proj(x), m.k_proj(x)
    assert q.shape == (1, 3, 32) and mx.array_equal(k, nn.QuantizedLinear.__call__(m.k_proj, x)).item()


def test_a_layer_in_no_group_joins_one_later_and_runs_its_own_arithmetic(monkeypatch):
    # `join` re-classes a float layer in no group (few rows as products inside a library
    # forward: join.few_rows); where its group becomes joinable later (its dtype set to the
    # others'), it joins as any layer does, and runs the group's columns, or its own matmul
    # outside a library forward (no recursion between the two re-classings)
    m = nn.Module()
    m.q_proj, m.k_proj, m.v_proj = (nn.Linear(64, n, bias=False) for n in (32, 16, 16))
    m.v_proj.set_dtype(mx.float16)
    assert joining.join(m) == [] and type(m.k_proj).__name__ == "RowsLinear"
    assert joining._base(m.k_proj) is nn.Linear
    m.v_proj.set_dtype(mx.float32)
    m.__dict__.pop("_treespec_joined")  # (a later join)
    assert len(joining.join(m)) == 1 and joining._base(m.k_proj) is nn.Linear
    x = mx.random.normal((1, 3, 64))
    own = x @ m.k_proj.weight.T
    assert mx.array_equal(m.k_proj(x), own).item()
    with joining.running():
        assert mx.array_equal(m.k_proj(x), own).item()
    # inside a library forward a few rows run as products where asked (forced on CPU: float32)
    monkeypatch.setattr(joining, "_products_here", lambda x, w: x.dtype == w.dtype == mx.float32)
    m.o_proj = nn.Linear(64, 8, bias=False)
    m.__dict__.pop("_treespec_joined")  # (a new layer: joined again, as new weights are)
    joining.join(m)
    calls = []
    few = joining.few_rows
    monkeypatch.setattr(joining, "few_rows", lambda x, w: calls.append(x.shape) or few(x, w))
    with joining.running():
        y, k = m.o_proj(x), m.k_proj(x)
    assert calls == [(1, 3, 64), (1, 3, 64)] and y.shape == (1, 3, 8) and k.shape == (1, 3, 16)
    m.o_proj(x)
    assert len(calls) == 2  # (outside a library forward: nn.Linear's own call)


def test_a_tied_lm_head_runs_its_few_rows_as_products_inside_a_library_forward(monkeypatch):
    # a head's logits through a tied target's embedding (`join.projected`): a few rows as
    # products inside a library forward only (forced on CPU: float32); an Embedding's own
    # arithmetic outside one, and for a quantized embedding always
    embed = nn.Embedding(32, 64)
    x = mx.random.normal((1, 3, 64))
    monkeypatch.setattr(joining, "_products_here", lambda x, w: x.dtype == w.dtype == mx.float32)
    calls = []
    few = joining.few_rows
    monkeypatch.setattr(joining, "few_rows", lambda x, w: calls.append(w.shape) or few(x, w))
    own = embed.as_linear(x)
    assert mx.allclose(joining.projected(embed.as_linear, x), own).item() and calls == []
    with joining.running():
        y = joining.projected(embed.as_linear, x)
        quant = nn.QuantizedEmbedding(32, 64)
        joining.projected(quant.as_linear, x)
    assert calls == [(32, 64)] and y.shape == (1, 3, 32)
    assert mx.allclose(y, own, rtol=1e-5, atol=1e-5).item()
