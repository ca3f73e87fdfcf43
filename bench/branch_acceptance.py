"""Emitted per verify of branch drafts against chains and trees on the demo pair (any device:
acceptance does not depend on timing), each arm's output checked against plain decoding.

    python bench/branch_acceptance.py [--prompts 6] [--tokens 128]

Prints, per arm, the pooled emitted per verify (all tokens / all rounds) and how many prompts
gave plain decoding's tokens.
"""
import argparse
import os
import sys
import time

from mlx_lm.utils import load

from mlx_treespec.drafters.branch import BranchDrafter
from mlx_treespec.generate import RoundStats, make_drafter, resolve_model_path, tree_generate_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import load_prompts  # noqa: E402


def pooled(model, prompts, make, tokens):
    """Every prompt through a fresh drafter from `make` (None: plain decoding): the outputs, the
    pooled emitted per verify, nodes per round, and the share of rounds a merged drafter's lookup
    drafted alone."""
    em = rounds = nodes = alone = 0
    outs = []
    for p in prompts:
        st, d = RoundStats(), make()
        outs.append([t for t, _, _ in tree_generate_step(p, model, d, max_tokens=tokens, stats=st)])
        em, rounds, nodes = em + sum(st.emitted), rounds + st.rounds, nodes + sum(st.nodes)
        alone += getattr(d, "rounds_alone", 0)
    return outs, em / rounds, nodes / rounds, alone / rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    model, tok = load(resolve_model_path("demo"))
    dm = load(resolve_model_path("demo-drafter"))[0]
    prompts = load_prompts(tok, args.prompts)

    def run(mk):
        return pooled(model, prompts, mk, args.tokens)[:2]

    plain, _ = run(lambda: None)
    arms = {"chain k=8": lambda: make_drafter(dm, draft_block_size=8),
            "one-lane K3 S8": lambda: make_drafter(dm, tree_topk=3, tree_lanes=1, tree_depth=8),
            "EAGLE-2 K4 L2 S8 B32": lambda: make_drafter(dm, tree_topk=4, tree_lanes=2, tree_depth=8, tree_budget=32)}
    for R, Ps in [(2, (0.3, 0.5, 0.7, 0.9, 1.0)), (3, (0.3, 0.5, 0.7, 0.9, 1.0)), (4, (0.5, 0.7))]:
        for P in Ps:
            arms[f"branches K3 S8 R={R} P={P}"] = lambda R=R, P=P: BranchDrafter(dm, topk=3, depth=8, rows=R, fork_below=P)
    for name, mk in arms.items():
        t = time.time()
        outs, ev = run(mk)
        same = sum(o == q for o, q in zip(outs, plain))
        print(f"{name:28s} emitted/verify {ev:.3f}  = plain {same}/{len(plain)}  ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
