"""Plain decode vs our chain vs mlx-lm's chain vs our best tree, measured in one run.

    python bench/bench_loop.py [--model demo] [--draft-model demo-drafter] [--prompts 20]
                               [--max-tokens 256] [--out bench/out/loop.json] [--quick]

Phase 1 picks, on a few prompts, the block size mlx-lm's chain runs at (it is slow: one run per
prompt only); phase 2 runs every arm on every prompt, interleaved (each prompt runs all arms, in
a rotating order, after a warm-up), so drift hits all arms alike, and the best chain and trees
are chosen on those runs. Figures are medians over prompts with min-max spread.

Also reported: Python overhead per round (round wall time minus the time the same forwards take
back to back with nothing else), the exactness probe's figures, and how many tokens each arm's
output agrees with plain decoding before the first difference (GPU kernels differ by row count).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlx_treespec.generate import RoundStats, make_drafter, resolve_model_path, tree_generate_step
from mlx_treespec.verify import TreeRound

BUILTIN_PROMPTS = [
    "def parse(", "import os\nimport sys\n\n\ndef main(", "class Config:\n    def __init__(self",
    "for i in range(", "    return self.", "with open(path) as f:\n", "def __repr__(self):\n",
    "try:\n    import numpy as np\nexcept ImportError:\n",
]


def load_prompts(tokenizer, n):
    path = os.path.join(os.path.dirname(__file__), "heldout_prompts.json")
    texts = BUILTIN_PROMPTS
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        data = data["prompts"] if isinstance(data, dict) else data
        texts = [d if isinstance(d, str) else d.get("prompt", d.get("text")) for d in data]
    texts = (texts * (n // len(texts) + 1))[:n]
    return [tokenizer.encode(t) for t in texts]


def timed(gen):
    """Run a token generator; tok/s counts from the first token to the last (no prefill)."""
    toks, t_first = [], None
    for t in gen:
        toks.append(int(t))
        if t_first is None:
            t_first = time.perf_counter()
    dt = time.perf_counter() - t_first
    return toks, (len(toks) - 1) / dt if dt > 0 else float("nan")


def run_arm(arm, prompt, target, draft, n):
    kind = arm["kind"]
    stats = RoundStats()
    if kind == "mlx_plain":
        toks, tps = timed(t for t, _ in generate_step(mx.array(prompt), target, max_tokens=n))
    elif kind == "mlx_chain":
        toks, tps = timed(t for t, _, _ in speculative_generate_step(
            mx.array(prompt), target, draft, num_draft_tokens=arm["k"], max_tokens=n))
    else:
        if kind == "lookup":
            from mlx_treespec.drafters.lookup import LookupDrafter

            drafter = LookupDrafter(budget=arm["n"], max_depth=arm["n"], branches=1)
        else:
            drafter = None if kind == "plain" else make_drafter(draft, **arm["opts"])
        toks, tps = timed(t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=n, stats=stats))
    s = stats.summary() if stats.rounds else {}
    return dict(tokens=toks, tps=tps, emitted_per_verify=s.get("emitted_per_verify", 1.0 if "plain" in kind else None),
                round_ms=s.get("round_ms"), nodes=s.get("nodes_per_round"), rounds=stats.rounds,
                sync_ms=s.get("sync_ms_per_round"), walk_ms=s.get("walk_ms_per_round"),
                held=s.get("held_per_round"),
                # draft-model steps per round: 0 in rounds a trusted lookup drafted alone
                steps=float(np.mean(stats.requested_depth)) if stats.rounds else None)


def interleaved(arms, prompts, target, draft, n, log, seconds=None):
    """Every arm on every prompt (rotating order); with `seconds`, no prompt starts after that
    many seconds (every arm keeps the same prompts)."""
    results = {a["name"]: [] for a in arms}
    run_arm(arms[0], prompts[0], target, draft, min(n, 32))  # warm-up: compile, allocate
    for a in arms:
        run_arm(a, prompts[0], target, draft, min(n, 32))
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        if seconds is not None and time.perf_counter() - start > seconds:
            log(f"time budget of {seconds} s spent: {i} of {len(prompts)} prompts")
            break
        order = arms[i % len(arms):] + arms[: i % len(arms)]
        for a in order:
            results[a["name"]].append(run_arm(a, p, target, draft, n))
        log(f"prompt {i + 1}/{len(prompts)} ({time.perf_counter() - start:.0f} s): " + ", ".join(
            f"{a['name'].replace('ours ', '')} {results[a['name']][-1]['tps']:.0f}" for a in arms))
    return results


def median_spread(xs):
    xs = [x for x in xs if x is not None and x == x]
    if not xs:
        return None, None, None
    return statistics.median(xs), min(xs), max(xs)


def forward_ms(model, n_nodes, parents=None, history=128, reps=10):
    """Time one verify forward of n_nodes over a `history`-token cache, nothing else in the loop."""
    cache = make_prompt_cache(model)
    model(mx.array(np.arange(history) % 100)[None], cache=cache)
    mx.eval([c.state for c in cache])
    parents = np.arange(n_nodes) - 1 if parents is None else parents
    toks = mx.array(np.arange(n_nodes, dtype=np.uint32) % 100)
    times = []
    for r in range(reps + 2):
        rnd = TreeRound(model, cache)
        t = time.perf_counter()
        mx.eval(rnd.forward(toks, parents))
        times.append(time.perf_counter() - t)
        rnd.commit([])
    return 1e3 * statistics.median(times[2:])


def batch_forward_ms(model, rows, history=128, reps=10):
    """Time one plain one-token forward over `rows` batch rows of a `history`-token cache."""
    cache = make_prompt_cache(model)
    model(mx.broadcast_to(mx.array(np.arange(history) % 100)[None], (rows, history)), cache=cache)
    mx.eval([c.state for c in cache])
    toks = mx.array(np.arange(rows, dtype=np.uint32) % 100)[:, None]
    times = []
    for r in range(reps + 2):
        t = time.perf_counter()
        mx.eval(model(toks, cache=cache))
        times.append(time.perf_counter() - t)
        for c in cache:
            c.trim(1)
    return 1e3 * statistics.median(times[2:])


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft-model", default="demo-drafter")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--select-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--blocks", default="1,2,3,4,5,6,8")
    ap.add_argument("--trees", default="2:3:6,2:4:8,3:4:12,4:4:16,2:6:12,3:5:15,4:5:24,4:6:32")
    ap.add_argument("--branch-trees", default="",
                    help="trees drafted with batch rows, K:S:R:P (topk, depth, rows, fork below)")
    ap.add_argument("--merged", default="",
                    help="draft-model drafts with a prompt-lookup chain under the root, BASE+N[@T]: BASE a "
                         "chain block size k or a tree K:S:B:L, N the lookup's nodes (--draft-lookup), T the "
                         "match length from which the lookup drafts alone (--draft-lookup-trust)")
    ap.add_argument("--lookup-chain", type=int, default=0,
                    help="also run prompt lookup alone (no draft model) as a chain of this many tokens")
    ap.add_argument("--seconds", type=float, default=None,
                    help="phase 2 starts no prompt after this many seconds (the report says how many ran)")
    ap.add_argument("--out", default="bench/out/loop.json")
    ap.add_argument("--quick", action="store_true", help="tiny run for a CPU smoke test")
    ap.add_argument("--queue-draft", type=int, choices=(0, 1), default=None,
                    help="queue the draft before building the verify (default: the library's)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.select_prompts, args.max_tokens = 2, 1, 24
        args.blocks, args.trees = "1,3", "2:3:6"
        args.branch_trees = "2:3:2:0.6"
        args.merged, args.lookup_chain = "3+4,2:3:6:1+4,3+4@3", 4
    log = lambda m: print(m, file=sys.stderr, flush=True)
    if args.queue_draft is not None:
        import mlx_treespec.generate as gen

        gen.QUEUE_DRAFT = bool(args.queue_draft)

    target, tok = load(resolve_model_path(args.model))
    draft, _ = load(resolve_model_path(args.draft_model))
    prompts = load_prompts(tok, args.prompts)
    device = str(mx.default_device())
    log(f"device {device}; {len(prompts)} prompts, {args.max_tokens} tokens")

    # Phase 1 (a few prompts): the block size for mlx-lm's chain
    blocks = [int(k) for k in args.blocks.split(",")]
    trees = [tuple(int(x) for x in s.split(":")) for s in args.trees.split(",")]
    trees = [t if len(t) == 4 else t + (t[0],) for t in trees]  # K:S:B[:L], lanes default K
    chains = [dict(name=f"ours chain k={k}", kind="tree", opts=dict(draft_block_size=k)) for k in blocks]
    tree_arms = [dict(name=f"ours tree K={K} L={L} S={S} B={B}", kind="tree",
                      opts=dict(tree_topk=K, tree_depth=S, tree_budget=B, tree_lanes=L))
                 for K, S, B, L in trees]
    for spec in filter(None, args.branch_trees.split(",")):
        K, S, R, P = spec.split(":")
        tree_arms.append(dict(name=f"ours tree K={K} S={S} R={R} P={P} (rows)", kind="tree",
                              opts=dict(tree_topk=int(K), tree_depth=int(S), tree_branches=int(R),
                                        tree_fork_below=float(P))))
    for spec in filter(None, args.merged.split(",")):
        base, n = spec.split("+")
        n, trust = (n.split("@") + ["0"])[:2]
        if ":" in base:
            K, S, B, L = (int(x) for x in base.split(":"))
            opts, name = dict(tree_topk=K, tree_depth=S, tree_budget=B, tree_lanes=L), f"tree K={K} L={L} S={S} B={B}"
        else:
            opts, name = dict(draft_block_size=int(base)), f"chain k={base}"
        tree_arms.append(dict(name=f"ours {name} + lookup {n}" + (f" trust {trust}" if int(trust) else ""),
                              kind="tree", opts=dict(opts, draft_lookup=int(n), draft_lookup_trust=int(trust))))
    extra_arms = []
    if args.lookup_chain:
        n = args.lookup_chain
        extra_arms.append(dict(name=f"lookup chain {n} (no draft model)", kind="lookup", n=n))
    sel = interleaved(chains, prompts[: args.select_prompts], target, draft, args.max_tokens, log)
    sel_tps = {k: median_spread([r["tps"] for r in v])[0] for k, v in sel.items()}
    k = max(chains, key=lambda a: sel_tps[a["name"]])["opts"]["draft_block_size"]
    log(f"mlx-lm's chain runs at k={k}")

    # Phase 2 (every prompt): every arm, interleaved; best chain and trees chosen on these runs
    arms = [dict(name="mlx-lm plain", kind="mlx_plain"), dict(name="ours plain", kind="plain"),
            dict(name=f"mlx-lm chain k={k}", kind="mlx_chain", k=k)] + chains + tree_arms + extra_arms
    res = interleaved(arms, prompts, target, draft, args.max_tokens, log, args.seconds)
    done = len(res[arms[0]["name"]])
    med = lambda n, key: median_spread([r[key] for r in res[n]])[0]
    best_chain = max(chains, key=lambda a: med(a["name"], "tps"))
    fastest = max(tree_arms, key=lambda a: med(a["name"], "tps"))
    widest = max(tree_arms, key=lambda a: med(a["name"], "emitted_per_verify"))
    both = [a for a in tree_arms if med(a["name"], "emitted_per_verify")
            >= 1.2 * med(best_chain["name"], "emitted_per_verify")]
    both = max(both, key=lambda a: med(a["name"], "tps")) if both else None

    base = median_spread([r["tps"] for r in res["mlx-lm plain"]])[0]
    rows, raw = [], {}
    for a in arms:
        rs = res[a["name"]]
        tps = median_spread([r["tps"] for r in rs])
        epv = median_spread([r["emitted_per_verify"] for r in rs])
        rms = median_spread([r["round_ms"] for r in rs])
        div = [first_divergence(r["tokens"], p["tokens"]) for r, p in zip(rs, res["mlx-lm plain"])]
        rows.append((a["name"], tps, epv, rms, div))
        raw[a["name"]] = dict(arm=a, runs=[{k2: v for k2, v in r.items() if k2 != "tokens"} for r in rs],
                              first_divergence=div)

    # Python overhead per round: round wall time minus the same forwards run back to back
    overhead = {}
    for a in chains + tree_arms:
        opts = a["opts"]
        rs = res[a["name"]]
        nodes = statistics.median([r["nodes"] for r in rs])
        steps = median_spread([r["steps"] for r in rs])[0]
        if "tree_branches" in opts:  # one-token steps over that many batch rows
            drafting = steps * batch_forward_ms(draft, opts["tree_branches"])
        else:
            drafting = steps * forward_ms(draft, opts.get("tree_lanes") or opts.get("tree_topk", 1))
        gpu = forward_ms(target, int(round(nodes))) + drafting
        overhead[a["name"]] = dict(round_ms=median_spread([r["round_ms"] for r in rs])[0],
                                   forwards_ms=gpu,
                                   sync_ms=median_spread([r["sync_ms"] for r in rs])[0],
                                   walk_ms=median_spread([r["walk_ms"] for r in rs])[0],
                                   held=median_spread([r["held"] for r in rs])[0])
        overhead[a["name"]]["python_ms"] = overhead[a["name"]]["round_ms"] - gpu

    print(f"\n## Verify loop on {device} ({done} of {len(prompts)} prompts x {args.max_tokens} tokens, temp 0)\n")
    print("| arm | tok/s (median, min-max) | x plain | emitted/verify | round ms | prompts identical to plain | first divergence (median) |")
    print("|---|---|---|---|---|---|---|")
    for name, tps, epv, rms, div in rows:
        same = sum(d is None for d in div)
        dvals = [d for d in div if d is not None]
        first = statistics.median(dvals) if dvals else "-"
        f = lambda t: "-" if t[0] is None else f"{t[0]:.2f} ({t[1]:.2f}-{t[2]:.2f})"
        print(f"| {name} | {f(tps)} | {tps[0] / base:.2f} | {f(epv)} | "
              f"{'-' if rms[0] is None else f'{rms[0]:.2f}'} | {same}/{len(div)} | {first} |")
    print("\nPython overhead per round (round wall time minus the same forwards back to back):")
    for name, o in overhead.items():
        print(f"- {name}: round {o['round_ms']:.2f} ms, forwards {o['forwards_ms']:.2f} ms, "
              f"overhead {o['python_ms']:.2f} ms (in the round: waiting on the device {o['sync_ms']:.2f} ms, "
              f"walk and commits {o['walk_ms']:.2f} ms; tokens re-run per round {o['held']:.2f})")
    chain_name, mlx_name = best_chain["name"], arms[2]["name"]
    print(f"\nBest chain (tok/s): {chain_name}; fastest tree: {fastest['name']}; tree emitting most per "
          f"verify: {widest['name']}; fastest tree emitting >= 1.2x the best chain per verify: "
          f"{both['name'] if both else '-'}")
    print(f"\nBars: ours chain k={k} / mlx-lm chain k={k} tok/s = "
          f"{med(f'ours chain k={k}', 'tps') / med(mlx_name, 'tps'):.3f} (>= 1.0)")
    for a in [t for i, t in enumerate([fastest, widest, both]) if t is not None and t not in [fastest, widest, both][:i]]:
        print(f"- {a['name']} / {chain_name}: emitted per verify "
              f"{med(a['name'], 'emitted_per_verify') / med(chain_name, 'emitted_per_verify'):.3f} (>= 1.2), "
              f"tok/s {med(a['name'], 'tps') / med(chain_name, 'tps'):.3f} (>= 1.0)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=device, args=vars(args), select=sel_tps, mlx_chain_k=k,
                       best_chain=chain_name, fastest_tree=fastest["name"], widest_tree=widest["name"],
                       fastest_tree_at_1_2x=both["name"] if both else None,
                       arms=raw, overhead=overhead), f, indent=1)


if __name__ == "__main__":
    main()
