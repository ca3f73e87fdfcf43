#!/usr/bin/env python3
"""Check that the torch heads of bench/train_heads.py and the MLX drafters compute one function.

    python bench/check_heads.py [--only mtp_post,eagle3_target] [--std 0.05] [--tol 1e-3]

For every head of train_heads.HEADS (the five demo heads): build the torch module with random
weights (matrices N(0, std); norms around their identity: w ~ N(0, 0.1) for zero-centred
norms, 1 + N(0, 0.1) for plain ones; every float rounded to float16 first, so the float16
export loses nothing), export it with train_heads' exporter, load the folder with the MLX
loader (mlx_treespec.drafters.mtp.load_mtp, eagle3.load_eagle3, dflash.load_dflash), cast both
sides to float32 and run them on the same random inputs against the shipped demo target
(qwen3) or hybrid (qwen3_5):

- MTP: `step(tokens, hidden)` vs `head(tokens, cache, hidden)`, and a second pass fed the
  first pass's out_hidden;
- EAGLE-3: the first step (fc of random 3-layer features) and a later step (first=False, fed
  the first step's output), draft-vocab logits mapped to target ids through d2t (a random
  sorted draft vocab is set first);
- DFlash: `forward_block(ctx_feats, root)` vs `DFlashModel.block_logits(target, ctx, root)`
  (skipped with a note where mlx_treespec/drafters/dflash.py is absent).

Prints the max abs logit (and hidden) difference and the argmax agreement per head; exits 1 if
any difference exceeds --tol (float32: expect ~1e-5).
"""
import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _kind_source(th, name, cfg):
    """(kind, demo model) of a head: train_heads.TRAIN where it says, else from the name."""
    spec = getattr(th, "TRAIN", {}).get(name, {})
    kind = spec.get("kind") or next((k for k in ("dflash", "mtp", "eagle3") if k in name), None)
    source = spec.get("source") or ("hybrid" if ("hybrid" in name or kind == "mtp") else "target")
    return kind, source


def randomize(model, std, zero_centred, gen):
    """Random weights, every float exactly representable in float16 (also 1 + w for
    zero-centred norms, which the MLX loader forms in float16)."""
    import torch

    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif zero_centred:
                w = torch.randn(p.shape, generator=gen) * 0.1
                p.copy_((1.0 + w).half().float() - 1.0)
            else:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
            p.copy_(p.half().float())


def diff(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def agree(a, b):
    return int((np.asarray(a).argmax(-1) == np.asarray(b).argmax(-1)).sum()), int(np.asarray(a).shape[0])


def check_mtp(th, name, cfg, target, embed_w, folder, rng, T):
    import mlx.core as mx
    import torch
    from mlx_treespec.drafters.mtp import load_mtp

    model = th.build_mtp(cfg).eval()
    randomize(model, ARGS.std, True, torch.Generator().manual_seed(ARGS.seed))
    th.export_mtp(model, cfg, folder)
    head = load_mtp(str(folder), target)
    head.set_dtype(mx.float32)
    H = cfg["hidden_size"]
    tokens = rng.integers(0, embed_w.shape[0], T)
    hidden = rng.standard_normal((T, H)).astype(np.float32)
    rows = []
    for step in range(2):
        with torch.no_grad():
            t_logits, t_hidden = model.step(torch.from_numpy(tokens), torch.from_numpy(hidden), embed_w)
        m_logits = head(mx.array(tokens.astype(np.uint32))[None], cache=head.make_cache(),
                        hidden=mx.array(hidden)[None])[0]
        rows.append((f"pass {step + 1}", diff(t_logits, m_logits), diff(t_hidden, head.out_hidden[0]),
                     agree(t_logits.numpy(), np.array(m_logits))))
        hidden = t_hidden.numpy()  # the next pass is fed the first one's output
    return rows


def check_eagle3(th, name, cfg, target, embed_w, folder, rng, T):
    import mlx.core as mx
    import torch
    from mlx_treespec.drafters.eagle3 import load_eagle3

    model = th.build_eagle3(cfg).eval()
    randomize(model, ARGS.std, False, torch.Generator().manual_seed(ARGS.seed))
    V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
    model.set_draft_vocab(np.sort(rng.permutation(V)[:Vd]).tolist())
    th.export_eagle3(model, cfg, folder)
    head = load_eagle3(str(folder), target)
    head.set_dtype(mx.float32)
    ids = model.draft_ids().numpy()
    H = cfg["hidden_size"]
    n_aux = len(head.capture)
    tokens = rng.integers(0, V, T)
    hidden = rng.standard_normal((T, n_aux * cfg.get("target_hidden_size", H))).astype(np.float32)
    rows = []
    for first in (True, False):
        with torch.no_grad():
            t_logits, t_hidden = model.step(torch.from_numpy(tokens), torch.from_numpy(hidden), embed_w, first)
        full = head(mx.array(tokens.astype(np.uint32))[None], cache=head.make_cache(),
                    hidden=mx.array(hidden)[None], first=first)[0]
        m_logits = np.array(full)[:, ids]  # target ids of the draft vocab, in draft order
        off = np.ones(V, bool)
        off[ids] = False
        assert np.isneginf(np.array(full)[:, off]).all(), "target ids outside the draft vocab must be -inf"
        rows.append(("first step" if first else "later step", diff(t_logits, m_logits),
                     diff(t_hidden, head.out_hidden[0]), agree(t_logits.numpy(), m_logits)))
        hidden = t_hidden.numpy()
    return rows


def check_dflash(th, name, cfg, target, embed_w, folder, rng, T):
    import mlx.core as mx
    import torch

    try:
        from mlx_treespec.drafters.dflash import load_dflash
    except ImportError:
        print(f"{name}: skipped (mlx_treespec/drafters/dflash.py is not there)")
        return None
    model = th.build_dflash(cfg).eval()
    randomize(model, ARGS.std, False, torch.Generator().manual_seed(ARGS.seed))
    th.export_dflash(model, cfg, folder)
    drafter = load_dflash(str(folder))
    drafter.set_dtype(mx.float32)
    n = len(cfg["dflash_config"]["target_layer_ids"])
    feats = rng.standard_normal((T, n * cfg["hidden_size"])).astype(np.float32)
    root = int(rng.integers(0, embed_w.shape[0]))
    with torch.no_grad():
        t_logits = model.forward_block(torch.from_numpy(feats), root, embed_w)
    m_logits = drafter.block_logits(target, mx.array(feats), root)
    return [("block", diff(t_logits, m_logits), None, agree(t_logits.numpy(), np.array(m_logits)))]


CHECKS = {"mtp": check_mtp, "eagle3": check_eagle3, "dflash": check_dflash}


def main(argv=None):
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated head names (default: all)")
    p.add_argument("--std", type=float, default=0.05, help="std of the random weight matrices")
    p.add_argument("--tol", type=float, default=1e-3, help="max abs difference allowed (float32)")
    p.add_argument("--tokens", type=int, default=24, help="sequence / context length")
    p.add_argument("--seed", type=int, default=0)
    ARGS = p.parse_args(argv)

    import mlx.core as mx
    import torch
    from mlx_lm.utils import load_model
    from mlx_treespec.demo import demo_path

    try:
        import train_heads as th
    except ImportError as e:
        print(f"bench/train_heads.py cannot be imported ({e}): nothing to check")
        return 2
    only = set(filter(None, ARGS.only.split(",")))
    targets, failed, checked = {}, [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in th.HEADS.items():
            if only and name not in only:
                continue
            kind, source = _kind_source(th, name, cfg)
            if kind not in CHECKS:
                print(f"{name}: skipped (unknown head kind {kind!r})")
                continue
            if source not in targets:
                model, _ = load_model(Path(demo_path(source)))
                model.set_dtype(mx.float32)
                targets[source] = model
            target = targets[source]
            lm = getattr(target, "language_model", target)
            embed_w = torch.from_numpy(np.array(lm.model.embed_tokens.weight.astype(mx.float32)))
            rng = np.random.default_rng(ARGS.seed)
            rows = CHECKS[kind](th, name, cfg, target, embed_w, Path(tmp) / name, rng, ARGS.tokens)
            if rows is None:
                continue
            checked += 1
            for what, d_logits, d_hidden, (hit, n) in rows:
                bad = d_logits > ARGS.tol or (d_hidden is not None and d_hidden > ARGS.tol)
                hid = "" if d_hidden is None else f"  max|d out_hidden| {d_hidden:.2e}"
                print(f"{name:14s} {what:10s}  max|d logits| {d_logits:.2e}{hid}  argmax {hit}/{n}"
                      f"  {'FAIL' if bad else 'ok'}")
                if bad:
                    failed.append(f"{name} ({what})")
    if failed:
        print(f"DISAGREE beyond {ARGS.tol}: {', '.join(failed)}")
        return 1
    print(f"{checked} heads agree within {ARGS.tol}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
