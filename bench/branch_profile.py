"""Where a --tree-branches round's time goes on the device (demo pair): draft() with a sync per
spine step or none, batch-row steps with and without reading a probability, and the commit.

    python bench/branch_profile.py [--tokens 128] [--reps 20]
"""
import statistics
import time

import numpy as np
import mlx.core as mx
from mlx_lm.utils import load

from mlx_treespec.drafters.branch import BranchDrafter
from mlx_treespec.generate import resolve_model_path


REPS = 20


def timeit(fn, reps=None, warm=3):
    reps = REPS if reps is None else reps
    ts = []
    for _ in range(reps + warm):
        t = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ts[warm:])


def main():
    draft, _ = load(resolve_model_path("demo-drafter"))
    hist = (np.arange(201) % 97).tolist()
    for R, P in [(1, 0.0), (2, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]:
        d = BranchDrafter(draft, topk=3, depth=8, rows=R, fork_below=P)
        d.prefill(hist)
        box = []

        def run_draft():
            d.pending = [5]
            dr = d.draft(5, 63)
            mx.eval(dr.arrays())
            box.append(dr)

        def run_commit():
            dr = box.pop()
            d.commit(dr, np.arange(4), [1, 2, 3, 4])  # three spine nodes and a bonus
            mx.eval([c.state for c in d.cache])
            for c in d.cache:
                c.trim(4)

        ds, cs = [], []
        for _ in range(REPS + 3):
            ds.append(timeit(run_draft, 1, 0))
            cs.append(timeit(run_commit, 1, 0))
        print(f"R={R} P={P}: draft() {statistics.median(ds[3:]):.2f} ms, commit {statistics.median(cs[3:]):.2f} ms", flush=True)
    for R in (1, 2, 4):
        d = BranchDrafter(draft, topk=1, depth=8, rows=R, fork_below=0.0)
        d.prefill(hist)
        tok = mx.zeros((R, 1), mx.uint32)

        def steps(read):
            for _ in range(8):
                logits = d._step(tok)
                if read:
                    mx.exp(logits[0].astype(mx.float32).max()).item()
            mx.eval(logits)
            for c in d.cache:
                c.trim(8)

        print(f"R={R}: 8 batch steps queued {timeit(lambda: steps(False)):.2f} ms, "
              f"with a .item() each {timeit(lambda: steps(True)):.2f} ms", flush=True)


def loop_split(tokens):
    from mlx_treespec.generate import RoundStats, make_drafter, tree_generate_step

    target, tok = load(resolve_model_path("demo"))
    draft, _ = load(resolve_model_path("demo-drafter"))
    prompt = tok.encode("def parse(text):\n    ")
    for opts in [dict(draft_block_size=8), dict(tree_topk=3, tree_depth=8, tree_branches=1),
                 dict(tree_topk=3, tree_depth=8, tree_branches=2, tree_fork_below=0.6),
                 dict(tree_topk=3, tree_depth=8, tree_branches=2, tree_fork_below=1.0)]:
        for _ in range(2):  # the first run warms up
            st = RoundStats()
            list(tree_generate_step(prompt, target, make_drafter(draft, **opts), max_tokens=tokens, stats=st))
        s = st.summary()
        print(f"{opts}: round {s['round_ms']:.2f} ms, draft {s['draft_ms_per_round']:.2f}, "
              f"sync {s['sync_ms_per_round']:.2f}, walk {s['walk_ms_per_round']:.2f}, "
              f"emitted/verify {s['emitted_per_verify']:.2f}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    REPS = args.reps
    loop_split(args.tokens)
    main()
