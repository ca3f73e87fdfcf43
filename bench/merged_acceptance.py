"""Emitted per verify of draft-model trees with a prompt-lookup chain under the same root
(`--draft-lookup N`) against the model's chains and trees and lookup alone, on the demo pair
(any device: acceptance does not depend on timing); each arm's output checked against plain
decoding.

    python bench/merged_acceptance.py [--prompts 6] [--tokens 128]
"""
import argparse
import json
import os
import time

from mlx_lm.utils import load

from mlx_treespec.drafters.lookup import LookupDrafter
from mlx_treespec.generate import RoundStats, make_drafter, resolve_model_path, tree_generate_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--lookup", default="4,8,16", help="lookup sizes to merge")
    args = ap.parse_args()
    model, tok = load(resolve_model_path("demo"))
    dm = load(resolve_model_path("demo-drafter"))[0]
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout_prompts.json")) as f:
        texts = json.load(f)
    texts = texts["prompts"] if isinstance(texts, dict) else texts
    texts = [t if isinstance(t, str) else t.get("prompt", t.get("text")) for t in texts][: args.prompts]
    prompts = [tok.encode(t) for t in texts]

    def run(mk):
        em, rounds, nodes, alone, outs = 0, 0, 0, 0, []
        for p in prompts:
            st = RoundStats()
            d = mk()
            outs.append([t for t, _, _ in tree_generate_step(p, model, d, max_tokens=args.tokens, stats=st)])
            em, rounds, nodes = em + sum(st.emitted), rounds + st.rounds, nodes + sum(st.nodes)
            alone += getattr(d, "rounds_alone", 0)
        return outs, em / rounds, nodes / rounds, alone / rounds

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
