"""Where the round loop's wall time goes, arm by arm, on fresh prompts (demo pair): host time
to build the draft, host time to build the verify, waiting in the round's sync, walk and
commits; then the same arms with the draft evaluated alone (its device time apart).

    python bench/round_split.py [--prompts 5] [--tokens 256] [--arms NAME=OPTS;...]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import mlx.core as mx
from mlx_lm.utils import load

from mlx_treespec.generate import RoundStats, make_drafter, resolve_model_path, tree_generate_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import load_prompts  # noqa: E402

ARMS = {
    "chain k=6": dict(draft_block_size=6),
    "chain k=8": dict(draft_block_size=8),
    "tree K3 L1 S8": dict(tree_topk=3, tree_depth=8, tree_budget=24, tree_lanes=1),
    "rows K3 S8 R1": dict(tree_topk=3, tree_depth=8, tree_branches=1),
    "rows K3 S8 R3": dict(tree_topk=3, tree_depth=8, tree_branches=3, tree_fork_below=1.0),
    "rows K1 S8 R3": dict(tree_topk=1, tree_depth=8, tree_branches=3, tree_fork_below=1.0),
}


def one(target, draft, prompt, opts, tokens, sync_timing):
    stats = RoundStats()
    t = time.perf_counter()
    n = sum(1 for _ in tree_generate_step(prompt, target, make_drafter(draft, **opts), max_tokens=tokens,
                                          stats=stats, sync_timing=sync_timing))
    wall = time.perf_counter() - t
    mean = lambda xs: float(np.mean(xs)) if len(xs) else float("nan")
    verify_host = [v - s - w for v, s, w in zip(stats.verify_ms, stats.sync_ms, stats.walk_ms)]
    return dict(tps=n / wall, epv=stats.summary()["emitted_per_verify"], round=mean(stats.round_ms),
                draft=mean(stats.draft_ms), verify_host=mean(verify_host), sync=mean(stats.sync_ms),
                walk=mean(stats.walk_ms), rounds=stats.rounds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    target, tok = load(resolve_model_path("demo"))
    draft, _ = load(resolve_model_path("demo-drafter"))
    prompts = load_prompts(tok, args.prompts + 1)
    arms = {k: ARMS[k] for k in args.arms.split(",")}
    for opts in arms.values():  # warm-up
        one(target, draft, prompts[-1], opts, 48, False)
        one(target, draft, prompts[-1], opts, 48, True)
    res = {(k, m): [] for k in arms for m in (False, True)}
    for i, p in enumerate(prompts[:-1]):
        for k, opts in arms.items():
            for m in (False, True):
                res[(k, m)].append(one(target, draft, p, opts, args.tokens, m))
    print(f"device {mx.default_device()}; {args.prompts} prompts x {args.tokens} tokens; medians over prompts of "
          f"per-round means (ms)\n")
    print("| arm | tok/s | emitted/verify | round | draft build (host) | verify build (host) | sync wait | "
          "walk + commits | draft evaluated alone: draft ms | its round |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med = lambda rs, key: statistics.median(r[key] for r in rs)
    for k in arms:
        q, s = res[(k, False)], res[(k, True)]
        print(f"| {k} | {med(q, 'tps'):.1f} | {med(q, 'epv'):.2f} | {med(q, 'round'):.2f} | {med(q, 'draft'):.2f} | "
              f"{med(q, 'verify_host'):.2f} | {med(q, 'sync'):.2f} | {med(q, 'walk'):.2f} | {med(s, 'draft'):.2f} | "
              f"{med(s, 'round'):.2f} |", flush=True)


if __name__ == "__main__":
    main()
