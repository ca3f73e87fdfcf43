"""The exactness probe: exact on CPU for chains and trees (two families), detects a perturbed
verify, check_speculation's error names the figures, and reports are memoized.

Tiny random models (tests/tiny.py) of two families; the demo target too when it is shipped.
"""
import warnings
from pathlib import Path

import numpy as np
import pytest
import mlx.core as mx

import tiny
import mlx_treespec
from mlx_treespec import probe
from mlx_treespec.tree import chain_parents  # n nodes, root included
from mlx_treespec.probe import (
    InexactError,
    check_speculation,
    probe_exactness,
    representative_tree_parents,
)

FAMILIES = ["qwen3", "gemma3"]  # full KV caches; rotating caches (gemma3 window 8 < history 32)
HAND_TREE = np.array([-1, 0, 1, 1, 0, 4, 2, 6, 6, 3])


@pytest.fixture(scope="module")
def models():
    return {f: tiny.build(tiny.CONFIGS[f]) for f in FAMILIES}


def topologies():
    return [chain_parents(7), representative_tree_parents(3, 4, 15), HAND_TREE]


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_exact_on_cpu_chain_and_tree(models, family):
    model = models[family]
    report = probe_exactness(model, topologies(), n_inputs=2, history=32, memo=False)
    assert report.device == "cpu" and report.dtype == "float32"
    assert [t.shape for t in report.topologies] == ["chain", "tree", "tree"]
    for t in report.topologies:
        assert t.flips == 0
        assert t.max_abs_diff == 0.0  # bit-exact, not merely close
        assert t.exact and t.checked == t.nodes * 2
    assert report.exact and report.flips == 0
    assert "0 argmax flips" in report.message()
    assert check_speculation(model, topologies(), n_inputs=2).exact


def _flip_node_1(logits):
    # push a token that is not the argmax of node 1 far above the rest
    row = logits[1]
    other = (int(mx.argmax(row).item()) + 1) % row.shape[-1]
    return logits.at[1, other].add(1e4)


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_detects_a_perturbed_verify(models, family):
    model = models[family]
    tree = representative_tree_parents(2, 3, 6)
    report = probe_exactness(model, [tree], n_inputs=3, perturb=_flip_node_1)
    t = report.topologies[0]
    assert t.flips == 3  # node 1 of each of the 3 inputs
    assert t.max_abs_diff >= 1e4 * 0.99
    assert not t.exact and not report.exact
    with pytest.raises(InexactError) as err:
        check_speculation(model, [tree], n_inputs=3, perturb=_flip_node_1)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "\n" not in msg
    assert f"verify of {len(tree)} nodes differs from one-token decoding on cpu" in msg
    assert f"3 argmax flips in {3 * len(tree)} nodes" in msg
    assert "max |dlogit| 1e+04" in msg
    assert "--allow-inexact" in msg
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = check_speculation(model, [tree], allow_inexact=True, n_inputs=3, perturb=_flip_node_1)
    assert rep.flips == 3
    assert any("argmax flip" in str(w.message) for w in caught)


def test_a_difference_with_no_flip_is_not_bitwise_on_cpu(models):
    # on CPU a verify must be bitwise one-token decoding: a tiny difference that flips no argmax
    # still fails the probe, and the message says so (not "matches")
    model = models[FAMILIES[0]]
    report = probe_exactness(model, [representative_tree_parents(2, 3, 6)], n_inputs=1,
                             perturb=lambda logits, *a: logits.at[1].add(1e-5))
    assert report.flips == 0 and not report.exact
    assert "is not bitwise one-token decoding on cpu" in report.message() and "matches" not in report.message()


def test_probe_memoizes_per_model_device_dtype_topology(models, monkeypatch):
    model = models["qwen3"]
    probe.clear_memo()
    chain = chain_parents(6)
    first = probe_exactness(model, [chain], n_inputs=2)
    assert not first.topologies[0].cached

    def boom(*a, **k):
        raise AssertionError("the memoized topology was probed again")

    monkeypatch.setattr(probe, "_decode_tree", boom)
    again = probe_exactness(model, [chain], n_inputs=2)
    t0, t1 = first.topologies[0], again.topologies[0]
    assert t1.cached
    assert (t1.flips, t1.max_abs_diff, t1.checked, t1.parents) == (t0.flips, t0.max_abs_diff, t0.checked, t0.parents)
    # another topology, another model, or a perturbed probe is not served from the memo
    with pytest.raises(AssertionError, match="probed again"):
        probe_exactness(model, [chain_parents(5)], n_inputs=2)
    with pytest.raises(AssertionError, match="probed again"):
        probe_exactness(models["gemma3"], [chain], n_inputs=2)
    with pytest.raises(AssertionError, match="probed again"):
        probe_exactness(model, [chain], n_inputs=2, perturb=lambda l: l)
    # a cast of the weights changes the memo key (dtype)
    assert probe.weights_dtype(model) == "float32"


def test_representative_tree_and_invalid_topologies():
    p = representative_tree_parents(4, 5, 31)
    assert len(p) == 32 and p[0] == -1 and (p[1:] < np.arange(1, 32)).all()
    assert list(representative_tree_parents(1, 4, 4)) == [-1, 0, 1, 2, 3]  # K = 1 is the chain
    with pytest.raises(ValueError):
        probe_exactness(None, [[0, 1]])


DEMO = Path(mlx_treespec.__file__).parent / "demo" / "target"


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="the demo target is not shipped yet")
def test_probe_exact_on_demo_target():
    from mlx_lm import load

    model = load(str(DEMO))[0]
    report = probe_exactness(model, [chain_parents(5), representative_tree_parents(2, 4, 8)], n_inputs=1)
    print(f"probe ran on the demo target ({report.dtype})")
    assert report.flips == 0 and report.exact


def _near_tie(logits):
    """Every token but each row's argmax raised to 0.01 below it: no argmax moves, draws do."""
    top = mx.max(logits, axis=-1, keepdims=True)
    return mx.where(logits == top, logits, top - 0.01)


def test_a_sampled_probe_counts_draw_flips(models):
    # at temp > 0 the probe compares each node's draw at its position (sampling.make_node_sampler):
    # a verify whose runners-up crowd the top flips no argmax (a greedy probe passes it) but
    # flips draws, and the error says so
    from mlx_treespec.sampling import make_node_sampler

    model = models[FAMILIES[0]]
    tree = representative_tree_parents(2, 3, 6)
    assert probe_exactness(model, [tree], n_inputs=2, perturb=_near_tie).flips == 0
    sampler = make_node_sampler(temp=1.0, seed=0)
    report = probe_exactness(model, [tree], n_inputs=2, perturb=_near_tie, sampler=sampler)
    assert report.flips > 0 and report.topologies[0].kind == "draw"
    with pytest.raises(InexactError, match="draw flip"):
        check_speculation(model, [tree], n_inputs=2, perturb=_near_tie, sampler=sampler)
    # unperturbed, on CPU: bitwise, no draw flips (and a greedy sampler probes argmaxes)
    assert probe_exactness(model, [tree], n_inputs=2, sampler=sampler, memo=False).exact
    assert probe_exactness(model, [tree], n_inputs=1, sampler=make_node_sampler(), memo=False).topologies[0].kind == "argmax"
