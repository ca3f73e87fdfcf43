"""mlx_treespec.attention: the tree-attention kernel against MLX's masked attention.

The same cases run the kernel itself where a CUDA GPU is the default device (the H200 runs this
file: bench/RESULTS.md) and its body in tests/msl_check.py's CPU emulator elsewhere (128
cooperative threads a block, each warp's mma done from its lanes' fragments). Everything past
`end` and the mask before `hist` are NaN: the kernel must never read them.
"""
import os
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_treespec import attention, verify

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msl_check  # noqa: E402

ON_GPU = attention._backend_is_cuda()


def tree_rows(R, rng):
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, R)]
    seen = np.eye(R, dtype=bool)
    for i in range(R):
        if parents[i] >= 0:
            seen[i] |= seen[parents[i]]
    return seen


def problem(dtype, D, Hkv, G, R, W, hist, seed=0):
    """q, k, v, the additive mask, bounds, and the float32 reference over the visible keys."""
    rng = np.random.default_rng(seed)
    end = hist + R
    q = rng.standard_normal((1, Hkv * G, R, D)).astype(np.float32)
    k = rng.standard_normal((1, Hkv, W, D)).astype(np.float32)
    v = rng.standard_normal((1, Hkv, W, D)).astype(np.float32)
    visible = np.zeros((R, W), bool)
    visible[:, :hist] = True
    visible[:, hist:end] = tree_rows(R, rng)
    want = mx.fast.scaled_dot_product_attention(
        *(mx.array(a).astype(dtype).astype(mx.float32) for a in (q, k[:, :, :end], v[:, :, :end])),
        scale=D ** -0.5, mask=mx.array(visible[:, :end]))
    low = float(mx.finfo(dtype).min)
    mask = np.where(visible, 0.0, low).astype(np.float32)
    mask[:, :hist] = np.nan  # the kernel reads the mask in [hist, end) only
    mask[:, end:] = np.nan
    k[:, :, end:] = np.nan  # ... and no key or value row from `end` on
    v[:, :, end:] = np.nan
    arrays = [mx.array(a).astype(dtype) for a in (q, k, v, mask)]
    return arrays, [hist, end], want


def attend(q, k, v, mask, bounds, scale):
    if ON_GPU:
        assert attention.usable(q.dtype, q.shape[-1])
        return attention.tree_attention(q, k, v, mask, mx.array(bounds, mx.int32), scale)
    if not msl_check.have_gxx():
        pytest.fail("g++ is required for the kernel emulation")
    return msl_check.emulate_tree_attention(q, k, v, mask, bounds, scale, attention.splits_for(k.shape[2]),
                                            attention.KEY_TILE)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("D,Hkv,G,R,W,hist", [
    (64, 2, 3, 13, 256, 200),    # one split; the demo target's heads (6 over 2)
    (128, 1, 4, 32, 2048, 1500),  # four splits, the last one partly past `end`
    (64, 1, 1, 1, 512, 0),       # one row, no history: the row sees itself only
    (128, 2, 4, 17, 512, 300),   # 68 rows a group: a second block of rows, mostly empty
    (64, 1, 2, 8, 1024, 500),    # splits that start past `end`: they add nothing
    (64, 1, 2, 8, 16384, 6000),  # the most splits (32), 20 of them past `end`
    (64, 1, 2, 32, 2048, 500),   # the round's columns across a split boundary (512)
], ids=["one-split", "four-splits", "no-history", "row-tiles", "empty-split", "most-splits", "across-splits"])
def test_kernel_is_masked_attention(dtype, D, Hkv, G, R, W, hist):
    (q, k, v, mask), bounds, want = problem(dtype, D, Hkv, G, R, W, hist)
    got = attend(q, k, v, mask, bounds, D ** -0.5).astype(mx.float32)
    assert got.shape == want.shape and not mx.isnan(got).any().item()
    # the probabilities reach the tensor cores in 16 bits: ~1.2e-3 at most in bf16 here, ~2e-4 in f16
    tol = 4e-3 if dtype == mx.bfloat16 else 1e-3
    assert mx.abs(got - want).max().item() < tol


def test_kernel_source_compiles_for_the_h200():
    sources = [s for _, s in msl_check.attention_cuda_sources()]
    assert len(sources) == 12  # (f16, bf16) x (64, 128) x (direct, split, merge)
    if not msl_check.have_nvcc():
        pytest.skip("nvcc not found: the CUDA source was generated, not compiled")
    ok, err = msl_check.check_cuda(sources)
    assert ok, err
    assert not msl_check.check_cuda(sources[0].replace("ts_mma<Bf16>(s[n]", "ts_mma<Bf16>(s"))[0]


def test_splits_grow_with_the_buffer_and_stop_at_the_cap():
    assert [attention.splits_for(w) for w in (64, 512, 1024, 8192, 1 << 20)] == [1, 1, 2, 16, 32]


def test_it_is_never_used_off_cuda():
    if ON_GPU:
        pytest.skip("the device has CUDA")
    assert not attention.usable(mx.float16, 64) and not verify.kernel_fits([mx.zeros((1, 2, 256, 64), mx.float16)])


def test_fits_takes_checked_variants_and_shapes_the_merge_can_grid(monkeypatch):
    # `fits` runs inside traces, where nothing may be checked: it only reads what `usable`
    # checked, and refuses row counts past the merge's grid (65535 block rows)
    monkeypatch.setattr(attention, "MIN_WIDTH", 0)
    monkeypatch.setattr(attention, "_checked", {(mx.float16, 64): True, (mx.float16, 128): False})

    def shapes(D, R, Hq=4, W=256):
        q = mx.zeros((1, Hq, R, D), mx.float16)
        k = mx.zeros((1, 2, W, D), mx.float16)
        return q, k, k, mx.zeros((R, W), mx.float16)

    assert attention.fits(*shapes(64, 8))
    assert not attention.fits(*shapes(128, 8))  # checked and refused
    assert not attention.fits(*shapes(64, 8)[:3], mx.zeros((8, 256), mx.bfloat16))  # another dtype
    assert attention.fits(*shapes(64, 16383, W=8)) and not attention.fits(*shapes(64, 16384, W=8))  # 4 heads
    # the width bound: a buffer narrower than MIN_WIDTH takes the kernel in a drafter's steps
    # (`steps`) of up to STEP_ROWS query rows only (a chain step's one row), never in a
    # target's forward
    monkeypatch.setattr(attention, "MIN_WIDTH", 512)
    assert attention.STEP_ROWS == 1
    assert attention.fits(*shapes(64, 1), steps=True) and not attention.fits(*shapes(64, 2), steps=True)  # W 256
    assert not attention.fits(*shapes(64, 1))
    assert attention.fits(*shapes(64, 2, W=512)) and attention.fits(*shapes(64, 1, W=512))
    assert not attention.fits(*shapes(128, 1), steps=True)  # still a checked variant only
