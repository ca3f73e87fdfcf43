"""Device diagnosis of --tree-branches rounds: round time by variant over several prompts
(forks read from the probability or fixed), and batch-row steps at growing history.

    python bench/branch_diag.py [--prompts 5] [--tokens 256]

(The figures in bench/RESULTS.md, section 1b, came from this script at commit 54fc6dc, whose
variants also compared a re-run commit, since removed.)"""
import argparse
import statistics
import sys
import time

import numpy as np
import mlx.core as mx
from mlx_lm.utils import load

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from bench_loop import load_prompts, timed
from mlx_treespec.drafters.branch import BranchDrafter
from mlx_treespec.generate import RoundStats, make_drafter, resolve_model_path, tree_generate_step

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=5)
ap.add_argument("--tokens", type=int, default=256)
args = ap.parse_args()
target, tok = load(resolve_model_path("demo"))
draft, _ = load(resolve_model_path("demo-drafter"))
for R in (1, 2):
    for hist in (128, 250, 300, 600):
        d = BranchDrafter(draft, topk=1, depth=8, rows=R, fork_below=1.0)
        d.prefill((np.arange(hist) % 97).tolist())
        x = mx.zeros((R, 1), mx.uint32)
        ts = []
        for i in range(15):
            t = time.perf_counter()
            mx.eval(d._step(x))
            ts.append(1e3 * (time.perf_counter() - t))
            for c in d.cache:
                c.trim(1)
        print(f"batch step R={R} history {hist}: {statistics.median(ts[3:]):.3f} ms", flush=True)
prompts = load_prompts(tok, args.prompts)
variants = {"chain 8": lambda: make_drafter(draft, draft_block_size=8),
            "K3L1S8": lambda: make_drafter(draft, tree_topk=3, tree_depth=8, tree_lanes=1)}
for R, P in [(2, 0.6), (2, 1.0), (3, 0.7), (3, 1.0)]:
    def mk(R=R, P=P):
        return BranchDrafter(draft, topk=3, depth=8, rows=R, fork_below=P)
    variants[f"R{R} P={P}"] = mk
res = {k: [] for k in variants}
for i, p in enumerate([prompts[0]] + prompts):
    for k, mk in variants.items():
        st = RoundStats()
        _, tps = timed(t for t, _, _ in tree_generate_step(p, target, mk(), max_tokens=args.tokens, stats=st))
        s = st.summary()
        if i:
            res[k].append((tps, s["round_ms"], s["draft_ms_per_round"], s["sync_ms_per_round"], s["emitted_per_verify"]))
for k, v in res.items():
    m = [statistics.median(x) for x in zip(*v)]
    print(f"{k:24s} tok/s {m[0]:.1f} round {m[1]:.2f} draft {m[2]:.2f} sync {m[3]:.2f} e/v {m[4]:.2f}", flush=True)
