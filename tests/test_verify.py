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


def test_rope_of_many_rows_goes_in_pieces_of_the_same_values(monkeypatch):
    # MLX's CUDA rope kernel fails to launch 128+ rows x ceil(heads / 4) under 32 rotary dims
    # (verify.rope_rows_per_call); a tree forward's per-token rope goes in pieces there, each
    # row rotated as one-token decoding rotates it (CPU, bitwise)
    import mlx.nn as nn
    from mlx_treespec import verify

    assert [verify.rope_rows_per_call(d, h) for d, h in ((16, 4), (16, 16), (24, 2), (16, 256))] == [64, 16, 64, 1]
    assert verify.rope_rows_per_call(32, 64) is None
    calls = []
    base = nn.RoPE.__call__
    monkeypatch.setattr(nn.RoPE, "__call__", lambda self, x, offset=0: calls.append(x.shape[0]) or base(self, x, offset))

    class Attn(nn.Module):
        def __init__(self, dims):
            super().__init__()
            self.rope = nn.RoPE(dims, base=10000.0)

    x = mx.random.normal((1, 4, 150, 64), key=mx.random.key(0))
    positions = mx.arange(150, dtype=mx.int32) + 7
    for dims, pieces in ((16, [64, 64, 22]), (64, [150])):
        m = Attn(dims)
        verify.install(m)
        calls.clear()
        verify._CTX.positions = positions
        try:
            got = m.rope(x)
        finally:
            verify._CTX.positions = None
        assert calls == pieces
        want = mx.concatenate([mx.fast.rope(x[:, :, i : i + 1], dims, traditional=False, base=10000.0, scale=1.0,
                                            offset=7 + i) for i in range(150)], axis=2)
        assert mx.array_equal(got, want).item()
