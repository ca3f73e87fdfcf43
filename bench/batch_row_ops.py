"""What a batch row costs each op of a one-token draft step (demo drafter shapes, float16):
every op queued N times with one sync, per op ms, for B = 1..4 batch rows; and the whole
drafter step over a B-row cache.

    python bench/batch_row_ops.py [--reps 200]
"""
import argparse
import time

import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlx_treespec.generate import resolve_model_path


def per_op(fn, reps):
    outs = [fn() for _ in range(3)]
    mx.eval(outs)
    t = time.perf_counter()
    outs = [fn() for _ in range(reps)]
    mx.eval(outs)
    return 1e3 * (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    draft, _ = load(resolve_model_path("demo-drafter"))
    dt = mx.float16
    H, Hk, D, E, F, V, L = 4, 2, 64, 256, 768, 4096, 300
    w = {n: mx.random.normal((o, i)).astype(dt) * 0.02 for n, (o, i) in
         dict(q=(E, E), up=(F, E), down=(E, F), head=(V, E)).items()}
    mx.eval(w)
    print(f"device {mx.default_device()}; ms per op, {args.reps} queued, one sync\n")
    print("| op | B=1 | B=2 | B=3 | B=4 |")
    print("|---|---|---|---|---|")
    rows = {}
    for B in (1, 2, 3, 4):
        x = mx.random.normal((B, 1, E)).astype(dt)
        xf = mx.random.normal((B, 1, F)).astype(dt)
        q = mx.random.normal((B, H, 1, D)).astype(dt)
        kbuf = mx.random.normal((B, Hk, 512, D)).astype(dt)
        vbuf = mx.random.normal((B, Hk, 512, D)).astype(dt)
        g = mx.ones((E,), dt)
        mx.eval(x, xf, q, kbuf, vbuf, g)
        ops = {
            "linear 256->256": lambda: x @ w["q"].T,
            "linear 256->768": lambda: x @ w["up"].T,
            "linear 768->256": lambda: xf @ w["down"].T,
            "lm head 256->4096": lambda: x @ w["head"].T,
            "linear 256->768, row by row": lambda: mx.concatenate([x[b : b + 1] @ w["up"].T for b in range(B)]),
            "linear 256->768, rows as tokens [1, B, E]": lambda: x.reshape(1, B, E) @ w["up"].T,
            "rms_norm": lambda: mx.fast.rms_norm(x, g, 1e-6),
            "rope (int offset)": lambda: mx.fast.rope(q, D, traditional=False, base=10000.0, scale=1.0, offset=L),
            "sdpa T=1 over 300 of 512 keys": lambda: mx.fast.scaled_dot_product_attention(
                q, kbuf[:, :, :L], vbuf[:, :, :L], scale=D ** -0.5),
            "sdpa T=1, batch rows folded into heads": lambda: mx.fast.scaled_dot_product_attention(
                q.reshape(1, B * H, 1, D), kbuf.reshape(1, B * Hk, 512, D)[:, :, :L],
                vbuf.reshape(1, B * Hk, 512, D)[:, :, :L], scale=D ** -0.5),
            "argmax over vocab": lambda: mx.argmax(mx.broadcast_to(x[:, 0, :1], (B, V)) + 0, axis=-1),
        }
        for name, fn in ops.items():
            rows.setdefault(name, []).append(per_op(fn, args.reps))
        cache = make_prompt_cache(draft)
        draft(mx.broadcast_to(mx.array(np.arange(L) % 97)[None], (B, L)), cache=cache)
        mx.eval([c.state for c in cache])
        tok = mx.zeros((B, 1), mx.uint32)

        def step():
            out = draft(tok, cache=cache)[:, -1, :]
            for c in cache:
                c.trim(1)
            return out

        rows.setdefault("drafter step (B-row cache)", []).append(per_op(step, max(args.reps // 4, 1)))
    for name, v in rows.items():
        print(f"| {name} | " + " | ".join(f"{t:.4f}" for t in v) + " |", flush=True)


if __name__ == "__main__":
    main()
