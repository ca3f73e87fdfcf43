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


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("Hkv, G", [(2, 1), (2, 3)])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "additive by head"])
def test_unfused_attention_is_mlx_own_unfused_arithmetic(dtype, Hkv, G, mask_kind):
    # on CPU MLX's fused attention runs its own unfused arithmetic: bitwise the same there
    rng = np.random.default_rng(3)
    R, W, D = 5, 37, 16
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
               for s in ((1, Hkv * G, R, D), (1, Hkv, W, D), (1, Hkv, W, D)))
    visible = mx.array(np.concatenate([np.ones((R, 30), bool), tree_rows(R, rng), np.zeros((R, 2), bool)], 1))
    mask = visible if mask_kind == "bool" else mx.where(visible, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
    if mask_kind == "additive by head":
        mask = mx.broadcast_to(mask, (1, Hkv * G, R, W))
    got = attention.unfused_attention(q, k, v, mask, D ** -0.5)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
    assert got.shape == want.shape == (1, Hkv * G, R, D)
    if ON_GPU:
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2).item()
    else:
        assert mx.array_equal(got, want).item()


def test_unfused_takes_several_masked_rows_over_short_buffers_on_cuda_only(monkeypatch):
    def shapes(R, W=256, mask=True):
        q, k = mx.zeros((1, 4, R, 64), mx.float16), mx.zeros((1, 2, W, 64), mx.float16)
        return q, k, (mx.zeros((R, W), mx.float16) if mask else None)

    assert attention.unfused(*shapes(4)) == ON_GPU
    monkeypatch.setattr(attention, "_backend_is_cuda", lambda: True)
    assert attention.unfused(*shapes(4)) and attention.unfused(*shapes(65, W=attention.MIN_WIDTH - 1))
    assert not attention.unfused(*shapes(1))  # one row: MLX runs it unfused itself
    assert not attention.unfused(*shapes(4, W=attention.MIN_WIDTH))  # the kernel's or cuDNN's
    assert not attention.unfused(*shapes(4, mask=False))
    q, k, m = shapes(4)
    assert not attention.unfused(q, (k, k, k), m)  # a quantized cache's keys
    monkeypatch.setattr(attention, "_backend_is_cuda", lambda: False)
    assert not attention.unfused(*shapes(4))


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_tree_forwards_through_unfused_attention_are_plain_decoding(tmp_path, monkeypatch, kind):
    # what a CUDA GPU runs (the rule taken everywhere it applies): lane trees of a head over its
    # target, in the round loop and queued, still give plain decoding's tokens on CPU
    from mlx_lm.generate import generate_step

    import tiny
    from test_heads import make_eagle3, make_mtp
    from mlx_treespec import RoundStats, tree_generate_step
    from mlx_treespec.drafters.head import HeadDrafter

    calls = []
    real = attention.unfused_attention
    monkeypatch.setattr(attention, "_backend_is_cuda", lambda: True)
    monkeypatch.setattr(attention, "usable", lambda dtype, D: False)  # (no tree-attention kernel here)
    monkeypatch.setattr(attention, "unfused_attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    head, target = (make_mtp(tmp_path, "qwen3_5_tied") if kind == "mtp" else make_eagle3(tmp_path, "safeailab"))[:2]
    prompt = np.random.default_rng(2).integers(0, tiny.VOCAB, 12).tolist()
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=32)]
    for queued in (False, True):
        monkeypatch.setattr(verify, "pad_keys_default", lambda: queued)
        calls.clear()
        stats = RoundStats()
        drafter = HeadDrafter(head, topk=3, lanes=2, depth=4, budget=10)
        out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=32, stats=stats)]
        assert out == ref, queued
        assert (stats.drafter[0] == "queued") == queued
        assert 2 in calls and max(calls) > 2, calls  # the lane steps' rows and the verify's
