"""Temporary: the tree-attention kernel's tile/split choices against cuDNN, one layer x n_layers."""
import statistics
import sys
import time

import numpy as np
import mlx.core as mx

from mlx_treespec import attention as at


def forms(Hq, Hkv, D, dtype, ctx, T=32, layers=36, reps=7):
    W = -(-(ctx + T + 512) // 1024) * 1024
    q = mx.random.normal((1, Hq, T, D)).astype(dtype)
    k = mx.random.normal((1, Hkv, W, D)).astype(dtype)
    v = mx.random.normal((1, Hkv, W, D)).astype(dtype)
    used = ctx + T
    tree = np.tril(np.ones((T, T), bool))
    tree[T // 2:, : T // 4] = False
    rows = np.concatenate([np.ones((T, ctx), bool), tree, np.zeros((T, W - used), bool)], axis=1)
    add = mx.where(mx.array(rows), mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
    bounds = mx.array([ctx, used], mx.int32)
    ku, vu = k[:, :, :used], v[:, :, :used]
    scale = D ** -0.5
    mx.eval(q, k, v, add, bounds, ku, vu)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=add)
    out = {}

    def timed(name, f):
        ts, hs = [], []
        for r in range(reps + 1):
            t0 = time.perf_counter()
            ys = [f() for _ in range(layers)]
            t1 = time.perf_counter()
            mx.eval(ys)
            t2 = time.perf_counter()
            if r:
                ts.append(1e3 * (t2 - t0))
                hs.append(1e3 * (t1 - t0))
        out[name] = (statistics.median(ts), statistics.median(hs))

    timed("causal", lambda: mx.fast.scaled_dot_product_attention(q, ku, vu, scale=scale, mask="causal"))
    timed("additive whole", lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=add))
    for kt in (32, 64):
        for sk in (256, 512, 1024):
            for ms in (32,):
                at.KEY_TILE, at.SPLIT_KEYS, at.MAX_SPLITS = kt, sk, ms
                y = at.tree_attention(q, k, v, add, bounds, scale)
                err = mx.abs(y.astype(mx.float32) - ref.astype(mx.float32)).max().item()
                timed(f"kernel kt{kt} sk{sk} ms{ms} (err {err:.3f})",
                      lambda: at.tree_attention(q, k, v, add, bounds, scale))
    return out


for label, (Hq, Hkv, D, dtype, layers) in [] if "long" in sys.argv else {"8B bf16": (32, 8, 128, mx.bfloat16, 36),
                                           "demo f16": (6, 2, 64, mx.float16, 8)}.items():
    for ctx in (300, 1024, 8192, 32768):
        res = forms(Hq, Hkv, D, dtype, ctx, layers=layers)
        print(f"## {label} ctx {ctx} (ms for {layers} layers: total, host)")
        for name, (t, h) in sorted(res.items(), key=lambda kv: kv[1][0]):
            print(f"  {t:8.3f} {h:8.3f}  {name}")
        sys.stdout.flush()


if "long" in sys.argv:  # the model's verify with the kernel from MIN_WIDTH keys on, per candidate
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run as bench_run

    out = sys.argv[sys.argv.index("long") + 1]
    for mw in (0, 16384):
        at.MIN_WIDTH = mw
        bench_run.main(["long", "--config", "bench/configs/qwen3_8b.json", "--contexts", "1024,8192,32768",
                        "--q-bits", "0,4", "--repeats", "5", "--out", f"{out}/long_8b_min{mw}"])
        bench_run.main(["long", "--config", "demo", "--contexts", "1024,8192,32768", "--repeats", "5",
                        "--out", f"{out}/long_demo_min{mw}"])
