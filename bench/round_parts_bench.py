"""Where a tree round's time goes: host time to build each part's graph, and its synced time.

    python bench/round_parts_bench.py [--model demo] [--draft-model demo-drafter]
                                      [--loop-prompts 8] [--loop-tokens 256] [--out parts.json]

For each part of a round (drafter steps, whole drafts of each kind, lane selection, EAGLE-2
re-rank, sibling pick, target verifies through host parents or device rows, with a held token,
host-to-device arrays, cache commits, one-token steps over batch rows and whole drafts of
branches in batch rows) it reports the median over repeats of (a) the host time to
build the part's graph (no evaluation), and (b) the wall time of building and evaluating it
alone. On a launch-bound pair the host column is the part's cost to the round whenever the
device has no queued work to hide it behind. Last, whole loops on held-out prompts with the
draft queued before the verify is built or not (median tok/s and round ms).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlx_treespec.cache import commit_appended
from mlx_treespec.drafters import Draft
from mlx_treespec.drafters.branch import BranchDrafter
from mlx_treespec.drafters.model import ModelDrafter, _logprobs, _top_k, keep_best
from mlx_treespec.generate import _verify, resolve_model_path
from mlx_treespec.verify import TreeRound

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def measure(build, reps, after=None):
    host, wall = [], []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        host.append(1e3 * (t1 - t0))
        wall.append(1e3 * (t2 - t0))
        if after is not None:
            after(out)
    return statistics.median(host[2:]), statistics.median(wall[2:])


def loop_variants(target, tokenizer, draft, rows, n_prompts, n=256):
    """Whole rounds of the real loop on held-out prompts, the draft queued before the verify is
    built or not, variants interleaved per prompt: median tok/s and round ms."""
    import mlx_treespec.generate as gen
    from bench_loop import load_prompts, timed
    from mlx_treespec.generate import RoundStats, make_drafter, tree_generate_step

    prompts = load_prompts(tokenizer, n_prompts)
    shapes = {"chain 8": dict(draft_block_size=8),
              "spine 7 + siblings (K=4)": dict(tree_topk=4, tree_depth=7, tree_budget=28, tree_lanes=1),
              "spine 10 + siblings (K=3)": dict(tree_topk=3, tree_depth=10, tree_budget=30, tree_lanes=1)}
    variants = [(name, queue) for name in shapes for queue in (False, True)]
    got = {v: ([], []) for v in variants}
    for i, p in enumerate([prompts[0]] + prompts):  # the first prompt warms up
        for name, queue in variants:
            gen.QUEUE_DRAFT = queue
            st = RoundStats()
            _, tps = timed(t for t, _, _ in tree_generate_step(
                p, target, make_drafter(draft, **shapes[name]), max_tokens=n, stats=st))
            if i:
                got[(name, queue)][0].append(tps)
                got[(name, queue)][1].append(st.summary()["round_ms"])
    gen.QUEUE_DRAFT = True
    for (name, queue), (tps, ms) in got.items():
        label = f"loop, {name}, draft {'queued' if queue else 'not queued'} before verify"
        rows[label] = dict(tok_s=statistics.median(tps), round_ms=statistics.median(ms))
        print(f"{label:64s} {rows[label]['tok_s']:8.1f} tok/s, round {rows[label]['round_ms']:6.2f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft-model", default="demo-drafter")
    ap.add_argument("--history", type=int, default=200)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--loop-prompts", type=int, default=8)
    ap.add_argument("--loop-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target, tokenizer = load(resolve_model_path(args.model))
    draft, _ = load(resolve_model_path(args.draft_model))
    hist = mx.array(np.arange(args.history) % 97)[None]
    tc, dc = make_prompt_cache(target), make_prompt_cache(draft)
    target(hist, cache=tc)
    draft(hist, cache=dc)
    mx.eval([c.state for c in tc + dc])
    K, S, B = 4, 6, 24
    rows = {}

    def part(name, fn, after=None):
        rows[name] = measure(fn, args.reps, after)
        print(f"{name:48s} host {rows[name][0]:7.3f} ms   synced {rows[name][1]:7.3f} ms", flush=True)

    def chain_forward(model, cache, n):
        """A round of one forward over a chain of n nodes, committed away."""
        def run():
            rnd = TreeRound(model, cache)
            out = rnd.forward(mx.arange(n).astype(mx.uint32), np.arange(n) - 1)
            rnd.commit([])
            return out
        return run

    def drafter_lanes():
        rnd = TreeRound(draft, dc)
        rnd.forward(mx.array([5], mx.uint32), [-1])
        vis = mx.array(rnd.ancestors)
        lanes = mx.zeros((K,), mx.int32)
        rows_ = mx.concatenate([vis[lanes], mx.eye(K, dtype=mx.bool_)], axis=1)
        out = rnd.forward_rows(mx.arange(K).astype(mx.uint32), 1, rows_)
        rnd.commit([])
        return out

    logits = mx.random.normal((K, draft.args.vocab_size))
    mx.eval(logits)

    def lane_select():
        idx, lp = _top_k(_logprobs(logits), K)
        scores = (mx.zeros((K,))[:, None] + mx.minimum(lp, 0)).reshape(-1)
        choice = mx.argsort(-scores)[:K]
        return idx.reshape(-1)[choice], scores[choice], choice // K

    n_cand = K + (S - 1) * K * K
    c_tok = mx.array(np.arange(n_cand) % 100)
    c_sc = -mx.abs(mx.random.normal((n_cand,)))
    c_par = mx.array(np.concatenate([[-1] * K, np.repeat(np.arange(n_cand - K * K) , K)[: n_cand - K]]))
    c_dep = np.concatenate([np.ones(K, np.int32)] + [np.full(K * K, s + 1, np.int32) for s in range(1, S)])
    mx.eval(c_tok, c_sc, c_par)

    def rerank():
        return list(keep_best(3, c_tok, c_sc, c_par, c_dep, B))

    _, tp, td, tt, anc = keep_best(3, c_tok, c_sc, c_par, c_dep, B)
    mx.eval(tp, td, tt, anc)

    def verify_tree():
        rnd = TreeRound(target, tc)
        out = rnd.forward_rows(tt, td, anc)
        rnd.commit([])
        return out

    def commit(keep):
        def run():
            base = tc[0].offset
            for c in tc:
                commit_appended(c, base, keep)
                c.offset = base
            return [c.keys for c in tc] + [c.values for c in tc]
        return run

    part("sync round trip (one tiny op)", lambda: mx.array(1) + 1)
    part("drafter step, 1 token (plain call)", chain_forward(draft, dc, 1))
    for R in (2, 3, 4):  # what --tree-branches R pays per draft step
        rc = make_prompt_cache(draft)
        draft(mx.broadcast_to(hist, (R, hist.shape[1])), cache=rc)
        mx.eval([c.state for c in rc])

        def batch_step(R=R, rc=rc):
            out = draft(mx.arange(R).astype(mx.uint32)[:, None], cache=rc)
            for c in rc:
                c.trim(1)
            return out

        part(f"drafter step, 1 token x {R} batch rows (plain call)", batch_step)
    part("drafter step, 2 tokens (padded on GPU)", chain_forward(draft, dc, 2))
    part(f"drafter lane step, {K} tokens (forward_rows)", drafter_lanes)
    part(f"lane selection (top-{K}, argsort)", lane_select)
    part(f"EAGLE-2 re-rank (keep_best, {n_cand} cands, budget {B})", rerank)
    part("target verify, 1 token (plain call)", chain_forward(target, tc, 1))
    part("target verify, chain of 9 (padded on GPU)", chain_forward(target, tc, 9))

    def rows_forward(model, cache, n, rows_of):
        """One forward over n nodes through forward_rows, topology made on the device."""
        rows_ = rows_of(n)

        def run():
            rnd = TreeRound(model, cache)
            out = rnd.forward_rows(mx.arange(n).astype(mx.uint32), mx.arange(n, dtype=mx.int32), rows_)
            rnd.commit([])
            return out
        return run

    causal = {}

    def causal_rows(n):
        if n not in causal:
            causal[n] = mx.tril(mx.ones((n, n), mx.bool_))
            mx.eval(causal[n])
        return causal[n]

    part("target verify, chain of 9 (forward_rows, rows on device)", rows_forward(target, tc, 9, causal_rows))
    part("drafter step, 2 tokens (forward_rows, rows on device)", rows_forward(draft, dc, 2, causal_rows))
    host9 = np.arange(9, dtype=np.int32)
    part("host -> device: mx.array of 9 int32, + 1", lambda: mx.array(host9) + 1)
    part("device: mx.arange(9) + 1", lambda: mx.arange(9, dtype=mx.int32) + 1)
    part(f"target verify, tree of {B + 1} (forward_rows)", verify_tree)
    host_parents = np.array(tp)

    def verify_tree_host():
        rnd = TreeRound(target, tc)
        out = rnd.forward(tt, host_parents)
        rnd.commit([])
        return out

    part(f"target verify, tree of {B + 1} (forward, host parents)", verify_tree_host)

    held_draft = Draft(host_parents, tt, depths=td, visible=anc)
    held_tok = tt[3:4]  # a held token is a slice of the last round's tokens

    def verify_held():
        rnd = TreeRound(target, tc)
        out = _verify(rnd, held_draft, held_tok)[0]
        rnd.commit([])
        return out

    part(f"target verify, 1 held token + tree of {B + 1}", verify_held)

    spine_logits = mx.random.normal((S, draft.args.vocab_size)).astype(mx.float16)
    spine = mx.argmax(spine_logits, axis=-1)
    mx.eval(spine_logits, spine)

    def sibling_pick():  # what a one-lane tree adds to a chain's drafting, for all S steps at once
        masked = mx.put_along_axis(spine_logits, spine[:, None].astype(mx.int32),
                                   mx.array(-mx.inf, spine_logits.dtype), axis=-1)
        return mx.argpartition(-masked, kth=K - 2, axis=-1)[:, : K - 1].reshape(-1)

    part(f"sibling pick (top-{K - 1} runners-up of {S} steps)", sibling_pick)

    def whole_draft(name, queue=None, **shape):
        """A drafter's whole draft() from one pending root (its first forward included), then
        the round dropped so every repeat starts from the same cache."""
        d = ModelDrafter(draft, cache=dc, **shape)
        if queue is not None:
            d.queue_steps = queue
        rounds = []

        def build():
            d.pending = [5]
            dr = d.draft(5, 63)
            rounds.append(dr.extra[0])
            return dr.arrays()

        part(name, build, lambda _: rounds.pop().commit([]))

    whole_draft("drafter draft(): chain of 6, each step queued", queue=True, topk=1, depth=6)
    whole_draft("drafter draft(): chain of 6, evaluated once", queue=False, topk=1, depth=6)
    whole_draft("drafter draft(): chain of 8", topk=1, depth=8)
    whole_draft("drafter draft(): spine 6 + siblings (K=4, B=24)", topk=4, depth=6, budget=24, lanes=1)
    whole_draft("drafter draft(): spine 8 + siblings (K=4, B=32)", topk=4, depth=8, budget=32, lanes=1)
    whole_draft("drafter draft(): spine 10, ranked (K=4, B=24)", topk=4, depth=10, budget=24, lanes=1)
    whole_draft("drafter draft(): EAGLE-2 K=4 S=6 B=24, each step queued", queue=True, topk=4, depth=6, budget=24)
    whole_draft("drafter draft(): EAGLE-2 K=4 S=6 B=24, evaluated once", queue=False, topk=4, depth=6, budget=24)
    for R, P, words in [(2, 1.0, "forked at step 0"), (3, 1.0, "forked at steps 0-1"),
                        (3, 0.0, "never forked: a sync per step")]:
        d = BranchDrafter(draft, topk=3, depth=8, rows=R, fork_below=P)
        d.prefill(np.arange(args.history + 1) % 97)
        drafts = []

        def build(d=d):
            d.pending = [5]
            drafts.append(d.draft(5, 63))
            return drafts[-1].arrays()

        part(f"drafter draft(): branches K=3 S=8 R={R}, {words}", build,
             lambda _, d=d: d.commit(drafts.pop(), np.array([0]), [5]))
    loop_variants(target, tokenizer, draft, rows, args.loop_prompts, args.loop_tokens)
    part("commit, accepted path contiguous", commit(np.arange(5)))
    part("commit, accepted path gathered", commit(np.array([0, 2, 7, 11, 20])))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({k: v if isinstance(v, dict) else dict(host_ms=v[0], synced_ms=v[1])
                       for k, v in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
