"""Why verify reads whole KV buffers on CUDA: a T-token forward over a key length never seen
before vs over a buffer whose length only changes when it grows.

    python bench/kv_shapes_bench.py [--config bench/configs/qwen3_0.6b.json] [--rounds 40]

Each round appends T tokens and drops them again but one (like a round that accepts one token),
so the used key length grows by one per round. Prints median ms per forward for: plain decoding
(T=1), a T-token causal forward over the used rows (what mlx-lm's chain verify does), and a
T-token TreeRound forward over the whole buffer with a mask.
"""
import argparse
import json
import statistics
import time

import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_treespec.costmodel import build_from_config
from mlx_treespec.verify import TreeRound


def run(model, mode, T, rounds, history=200):
    cache = make_prompt_cache(model)
    model(mx.array(np.arange(history) % 1000)[None], cache=cache)
    mx.eval([c.state for c in cache])
    toks = mx.array(np.arange(T, dtype=np.uint32) + 7)
    times = []
    for r in range(rounds):
        t = time.perf_counter()
        if mode == "plain":
            mx.eval(model(toks[None, :1], cache=cache))
        else:
            rnd = TreeRound(model, cache, pad_keys=(mode == "padded"))
            mx.eval(rnd.forward(toks, np.arange(T) - 1))
            rnd.commit([0])
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times[3:]), times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench/configs/qwen3_0.6b.json")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--T", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    model = build_from_config(cfg, dtype="bfloat16")
    res = {}
    for mode in ("plain", "used_rows", "padded", "plain", "used_rows", "padded"):
        med, times = run(model, mode, args.T, args.rounds)
        res.setdefault(mode, []).append(med)
        print(f"{mode:10s} T={1 if mode == 'plain' else args.T}: median {med:.3f} ms/forward "
              f"(first rounds {', '.join(f'{x:.1f}' for x in times[:4])})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
