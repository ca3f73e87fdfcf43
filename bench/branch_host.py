"""Host time of each part of a --tree-branches draft() inside the round loop (demo pair, fresh
prompts): where the draft build's host time goes when nothing is evaluated in it.

    python bench/branch_host.py [--prompts 3] [--tokens 256]
"""
import argparse
import statistics
import sys
import time
from collections import defaultdict

from mlx_lm.utils import load

import mlx_treespec.drafters.branch as branch
from mlx_treespec.generate import RoundStats, make_drafter, resolve_model_path, tree_generate_step

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_loop import load_prompts  # noqa: E402

T = defaultdict(list)


def timed(name, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        T[name].append(1e3 * (time.perf_counter() - t))
        return out
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    target, tok = load(resolve_model_path("demo"))
    draft, _ = load(resolve_model_path("demo-drafter"))
    prompts = load_prompts(tok, args.prompts + 1)
    real_without = branch._without
    for name, kw in [("R1 K3", dict(tree_topk=3, tree_depth=8, tree_branches=1)),
                     ("R3 K3", dict(tree_topk=3, tree_depth=8, tree_branches=3, tree_fork_below=1.0)),
                     ("R3 K1", dict(tree_topk=1, tree_depth=8, tree_branches=3, tree_fork_below=1.0))]:
        for p in [prompts[-1]] + prompts[:-1]:
            T.clear()
            d = make_drafter(draft, **kw)
            d._step = timed("step (model call)", d._step)
            d._leaves = timed("leaves", d._leaves)
            d._layout = timed("layout", d._layout)
            d.draft = timed("draft() total", d.draft)
            d.commit = timed("commit", d.commit)
            branch._without = timed("_without", real_without)
            stats = RoundStats()
            for _ in tree_generate_step(p, target, d, max_tokens=args.tokens, stats=stats):
                pass
            branch._without = real_without
        n = stats.rounds
        parts = ", ".join(f"{k} {sum(v) / n:.2f} ({len(v) / n:.1f}/round, max {max(v):.2f})" for k, v in T.items())
        print(f"{name} (last prompt, {n} rounds), host ms per round: {parts}; round {statistics.mean(stats.round_ms):.2f}, "
              f"draft build + queue {statistics.mean(stats.draft_ms):.2f}, sync {statistics.mean(stats.sync_ms):.2f}",
              flush=True)


if __name__ == "__main__":
    main()
