"""The verify's masks are the tree core's masks (mask.py), generalized to rounds of several forwards."""
import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import tiny
from mlx_treespec.mask import bool_mask_with_history
from mlx_treespec.tree import DraftTree
from mlx_treespec.verify import TreeRound


def _round_over_nine_tokens(pad, monkeypatch):
    """A tiny qwen3 with 9 tokens of history, a 7-node tree, and a round over that cache
    (`pad`: the GPU's whole-buffer path)."""
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: pad)
    model = tiny.build(tiny.CONFIGS["qwen3"])
    cache = make_prompt_cache(model)
    model(mx.array([list(range(9))]), cache=cache)
    tree = DraftTree(np.arange(7) + 3, np.array([-1, 0, 1, 1, 0, 4, 2]))
    return model, cache, tree, TreeRound(model, cache)


def visible(mask, pad):
    """A verify mask as booleans. The GPU path (`pad`) hands attention one additive mask per
    round (0 where visible, the dtype's lowest value elsewhere); the CPU path a boolean one."""
    if not pad:
        assert mask.dtype == mx.bool_
        return np.array(mask)
    assert mask.dtype == mx.float32  # the tiny model's keys' dtype
    values = np.array(mask)
    assert set(np.unique(values).tolist()) <= {0.0, float(np.finfo(np.float32).min)}
    return values == 0


@pytest.mark.parametrize("pad", [False, True])
def test_single_forward_mask_is_mask_py(pad, monkeypatch):
    model, cache, tree, rnd = _round_over_nine_tokens(pad, monkeypatch)
    parents = tree.parents
    seen = {}
    real = rnd._append_mask

    def spy(window):
        seen["mask"] = real(window)
        return seen["mask"]

    rnd._append_mask = spy
    rnd.forward(mx.array(tree.tokens.astype(np.uint32)), parents)
    expected = np.array(bool_mask_with_history(tree, 9))
    got = visible(seen["mask"], pad)
    assert got[:7, : expected.shape[1]].tolist() == expected.tolist()
    if pad:  # the padded tail is hidden and the width is the whole buffer
        assert got.shape[1] == cache[0].keys.shape[2] and not got[:7, expected.shape[1]:].any()
        # 7 nodes run as 8 rows: the filler row sees the history and itself only
        assert got.shape[0] == 8 and got[7, :9].all() and got[7, 9 + 7] and got[7].sum() == 10
        assert cache[0].offset == 9 + 7  # the filler's K/V are not counted
    else:
        assert got.shape == expected.shape


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("device_topology", [False, True])
def test_windowed_append_mask_is_mask_py(pad, device_topology, monkeypatch):
    # a sliding-window layer over an append cache: the windowed mask of mask.py, whether the
    # tree came with host parents or (forward_rows) device depths and rows only
    model, cache, tree, rnd = _round_over_nine_tokens(pad, monkeypatch)
    parents = tree.parents
    tokens = mx.array(tree.tokens.astype(np.uint32))
    if device_topology:
        rnd.forward_rows(tokens, mx.array(tree.depths.astype(np.int32)), mx.array(tree.ancestor_mask()))
    else:
        rnd.forward(tokens, parents)
    for window in (3, 5):
        expected = np.array(bool_mask_with_history(tree, 9, window=window))
        got = visible(rnd._append_mask(window), pad)
        assert got[:7, : expected.shape[1]].tolist() == expected.tolist()
        assert not got[:7, expected.shape[1]:].any()
        if pad:  # the filler row: the history and itself, whatever the window
            assert got.shape[0] == 8 and got[7, :9].all() and got[7, 9 + 7] and got[7].sum() == 10
    rnd.abort()


def test_cached_array_is_a_copy_keyed_by_value():
    from mlx_treespec.verify import cached_array

    a = np.array([[True, False], [True, True]])
    first = cached_array(a)
    assert np.array_equal(np.array(first), a)
    assert cached_array(a.copy()) is first  # same dtype, shape and bytes: the same device array
    a[0, 1] = True  # the cached array is a copy: later edits of the host array do not reach it
    assert not np.array(first)[0, 1]
    assert cached_array(a) is not first and np.array(cached_array(a))[0, 1]
    assert cached_array(np.zeros(2, np.int32)) is not cached_array(np.zeros(2, np.int64))
