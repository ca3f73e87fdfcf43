#!/usr/bin/env python3
"""Evaluate the shipped demo models with mlx (CPU is fine).

    python bench/eval_demo_pair.py --json bench/demo_pair_eval.json

Reports, for ``mlx_treespec/demo/{target,drafter,hybrid}`` (or the folders given):

* held-out loss / perplexity on the held-out passages of ``bench/heldout_prompts.json``
  (the first ``--ppl-tokens`` tokens of each of the 50 passages, all positions scored
  except the first);
* greedy samples for a few fixed prompts;
* greedy chain acceptance of each drafter against each target.  For every held-out
  prompt the target's greedy continuation g (``--gen-tokens`` tokens, plus ``--max-k``
  more so the last round can be checked) is generated once.  At every position p the
  drafter, given the target's context ``prompt + g[:p]``, proposes up to ``--max-k``
  tokens greedily (autoregressively); ``m_p`` is the number of leading proposals equal
  to ``g[p:]`` (computed exactly from one teacher-forced drafter pass over prompt + g,
  see ``match_lengths``).  Speculative decoding with a chain of k tokens is then simulated:
  starting at p = 0, a round accepts ``a = min(m_p, k)`` tokens and the target adds one
  (p += a + 1), until p >= gen_tokens.  We report for k = 1..8 the mean accepted length
  per round, the tokens per target call (mean a + 1), and the per-position acceptance
  P(a >= i) and P(a >= i | a >= i - 1) for the chain positions i = 1..k.

The held-out loss is computed with the models as shipped (float16 weights and compute);
greedy decoding (samples and acceptance) runs with the float16 weights up-cast to
float32 (``--decode-dtype``) because mlx's float16 matrix-vector products are slow on
CPU.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]

SAMPLE_PROMPTS = ["def parse(", "import os\nimport sys\n\n\ndef main(",
                  "class Stack:\n    def __init__(self"]


def load(path):
    import mlx_lm

    return mlx_lm.load(str(path))


def heldout_loss(model, tok, texts, n_tokens, batch=10):
    seqs = [tok.encode(t)[:n_tokens] for t in texts]
    seqs = [s for s in seqs if len(s) == n_tokens]
    tot, cnt = 0.0, 0
    for i in range(0, len(seqs), batch):
        x = mx.array(seqs[i:i + batch])
        logits = model(x[:, :-1]).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(lp, x[:, 1:, None], axis=-1)
        tot += nll.sum().item()
        cnt += nll.size
    return tot / cnt, cnt, len(seqs)


def greedy(model, ids, n):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        t = mx.argmax(logits).item()
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


def match_lengths(drafter, prompt_ids, g, n_pos, max_k):
    """m_p for p < n_pos: how many leading tokens of the drafter's greedy chain, drafted
    from the context prompt + g[:p], equal g[p:], capped at max_k.

    While the chain matches, the drafter's context is exactly prompt + g[:q], so the i-th
    drafted token is the drafter's greedy prediction at position p + i - 1 of the single
    teacher-forced pass over prompt + g.  m_p is therefore the length of the run of
    positions q >= p where that prediction equals g[q]: one forward pass per prompt gives
    all chains (up to float rounding between a batched pass and incremental decoding)."""
    seq = list(prompt_ids) + list(g)
    logits = drafter(mx.array([seq[:-1]]))[0]
    P = len(prompt_ids)
    pred = np.array(mx.argmax(logits[P - 1:P - 1 + len(g)], axis=-1))
    ok = pred == np.array(g)
    ms = []
    for p in range(n_pos):
        m = 0
        while m < max_k and p + m < len(g) and ok[p + m]:
            m += 1
        ms.append(m)
    return ms


def simulate(ms_all, k, n_gen):
    acc = []
    for ms in ms_all:
        p = 0
        while p < n_gen:
            a = min(ms[p], k)
            acc.append(a)
            p += a + 1
    acc = np.array(acc)
    reach = [float((acc >= i).mean()) for i in range(1, k + 1)]
    cond = [float((acc >= i).sum() / max(1, (acc >= i - 1).sum())) for i in range(1, k + 1)]
    return dict(k=k, rounds=int(acc.size), mean_accepted=float(acc.mean()),
                tokens_per_target_call=float(acc.mean() + 1),
                p_accept_at_least=reach, p_accept_conditional=cond)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo = ROOT / "mlx_treespec" / "demo"
    ap.add_argument("--targets", nargs="+", default=[str(demo / "target"), str(demo / "hybrid")])
    ap.add_argument("--drafters", nargs="+", default=[str(demo / "drafter")])
    ap.add_argument("--prompts", default=str(ROOT / "bench" / "heldout_prompts.json.gz"))
    ap.add_argument("--n-prompts", type=int, default=50)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--ppl-tokens", type=int, default=128)
    ap.add_argument("--sample-tokens", type=int, default=48)
    ap.add_argument("--decode-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--json", default=None, help="write all results here")
    args = ap.parse_args()
    t0 = time.time()
    raw = Path(args.prompts).read_bytes()
    data = json.loads(gzip.decompress(raw) if args.prompts.endswith(".gz") else raw)
    prompts = [p["prompt"] for p in data["prompts"]][:args.n_prompts]
    texts = [t["text"] for t in data["texts"]]
    res = dict(config=vars(args), models={}, samples={}, acceptance={})
    models = {}
    for path in dict.fromkeys(args.targets + args.drafters):
        name = Path(path).name
        models[name] = load(path)
        m, tok = models[name]
        loss, n, ns = heldout_loss(m, tok, texts, args.ppl_tokens)
        m.set_dtype(getattr(mx, args.decode_dtype))
        nparams = sum(v.size for _, v in tree_flatten(m.parameters()))
        res["models"][name] = dict(path=str(path), parameters=int(nparams), heldout_loss=round(loss, 4),
                                   heldout_ppl=round(math.exp(loss), 3), scored_tokens=n, passages=ns)
        print(f"{name:18s} params {nparams / 1e6:6.3f}M  held-out loss {loss:.4f}  ppl {math.exp(loss):7.3f}"
              f"  ({n} tokens, {ns} passages)  [{time.time() - t0:.0f}s]", flush=True)
        res["samples"][name] = {}
        for sp in SAMPLE_PROMPTS:
            out = greedy(m, tok.encode(sp), args.sample_tokens)
            res["samples"][name][sp] = sp + tok.decode(out)
    for name, s in res["samples"].items():
        print(f"\n===== greedy samples: {name}")
        for sp, txt in s.items():
            print(txt)
            print("-----")
    for tpath in args.targets:
        tname = Path(tpath).name
        tm, tok = models[tname]
        trajs = [(tok.encode(p), greedy(tm, tok.encode(p), args.gen_tokens + args.max_k)) for p in prompts]
        print(f"\n[{time.time() - t0:.0f}s] {tname}: {len(trajs)} greedy trajectories", flush=True)
        for dpath in args.drafters:
            dname = Path(dpath).name
            dm, dtok = models[dname]
            ms_all = [match_lengths(dm, pids, g, args.gen_tokens, args.max_k) for pids, g in trajs]
            pos = np.array(ms_all)  # [prompts, positions]
            rows = [simulate(ms_all, k, args.gen_tokens) for k in range(1, args.max_k + 1)]
            res["acceptance"][f"{dname}->{tname}"] = dict(
                per_position_all_p=[float((pos >= i).mean()) for i in range(1, args.max_k + 1)],
                chains=rows)
            print(f"\n{dname} -> {tname}  (greedy; {len(prompts)} prompts x {args.gen_tokens} tokens) "
                  f"[{time.time() - t0:.0f}s]")
            print("  k | rounds | mean accepted | tokens/target call | P(a>=i), i=1..k")
            for r in rows:
                print(f"  {r['k']} | {r['rounds']:6d} | {r['mean_accepted']:13.3f} | "
                      f"{r['tokens_per_target_call']:18.3f} | "
                      + " ".join(f"{x:.3f}" for x in r["p_accept_at_least"]))
            print("  conditional acceptance at chain position i (k=%d): " % args.max_k
                  + " ".join(f"{x:.3f}" for x in rows[-1]["p_accept_conditional"]))
    res["seconds"] = round(time.time() - t0, 1)
    print(f"\ntotal {res['seconds']}s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
