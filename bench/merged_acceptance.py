"""Emitted per verify of draft-model trees with a prompt-lookup chain under the same root
(`--draft-lookup N`) against the model's chains and trees and lookup alone, on the demo pair
(any device: acceptance does not depend on timing); each arm's output checked against plain
decoding.

    python bench/merged_acceptance.py [--prompts 6] [--tokens 128]
"""
import argparse
import os
import sys
import time

from mlx_lm.utils import load

from mlx_treespec.drafters.lookup import LookupDrafter
from mlx_treespec.generate import make_drafter, resolve_model_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import load_prompts  # noqa: E402
from branch_acceptance import pooled  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--lookup", default="4,8,16", help="lookup sizes to merge")
    args = ap.parse_args()
    model, tok = load(resolve_model_path("demo"))
    dm = load(resolve_model_path("demo-drafter"))[0]
    prompts = load_prompts(tok, args.prompts)

    def run(mk):
        return pooled(model, prompts, mk, args.tokens)

    plain = run(lambda: None)[0]
    sizes = [int(n) for n in args.lookup.split(",")]
    arms = {"chain k=6": lambda: make_drafter(dm, draft_block_size=6),
            "chain k=8": lambda: make_drafter(dm, draft_block_size=8),
            "one-lane K3 S8": lambda: make_drafter(dm, tree_topk=3, tree_lanes=1, tree_depth=8, tree_budget=24),
            "lookup chain 8 (no model)": lambda: LookupDrafter(budget=8, max_depth=8, branches=1)}
    for n in sizes:
        arms[f"chain k=6 + lookup {n}"] = lambda n=n: make_drafter(dm, draft_block_size=6, draft_lookup=n)
        arms[f"chain k=8 + lookup {n}"] = lambda n=n: make_drafter(dm, draft_block_size=8, draft_lookup=n)
        arms[f"one-lane K3 S8 + lookup {n}"] = lambda n=n: make_drafter(
            dm, tree_topk=3, tree_lanes=1, tree_depth=8, tree_budget=24, draft_lookup=n)
    for trust in (2, 3, 4):
        arms[f"chain k=6 + lookup 8, trust {trust}"] = lambda t=trust: make_drafter(
            dm, draft_block_size=6, draft_lookup=8, draft_lookup_trust=t)
    for name, mk in arms.items():
        t = time.time()
        outs, ev, nodes, alone = run(mk)
        same = sum(o == q for o, q in zip(outs, plain))
        print(f"{name:30s} emitted/verify {ev:.3f}  nodes/round {nodes:.1f}  = plain {same}/{len(plain)}  "
              f"lookup alone {alone:.0%} of rounds  ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
