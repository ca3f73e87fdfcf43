#!/usr/bin/env python3
"""Model-free drafters (prompt lookup, suffix) against plain decoding: emitted/verify and tok/s.

Workloads (deterministic; held-out Python source):

  * ``edit``: an excerpt of a held-out file (from its first top-level ``def``/``class``, cut at a
    line end to ``--context-tokens``), then ``"\\n# edited copy\\n"``, then the excerpt's first
    ``--edit-lines`` lines with one identifier renamed (the most frequent non-keyword identifier
    of those lines). A model that copies continues with the rest of the excerpt: the greedy
    continuation largely repeats the context with small edits.
  * ``plain``: a ~``--plain-chars`` prompt from a seeded line start of the same files (ordinary
    continuation, where lookups hit only on the text's own repetitions).

Held-out files: ``--source-dir`` (``.py`` files under it), or by default the interpreter's
standard library under the rule of ``bench/train_demo_pair.py``
(``int(sha1("stdlib/" + relpath)) % 50 == 0``, so none of them trained the demo models), sorted
by that hash, files of at least 3000 characters with a top-level ``def`` or ``class``; or the
2000-character held-out passages of ``--heldout-json bench/heldout_prompts.json``.

Arms: ``plain`` (mlx-lm's own ``generate_step``, the baseline), ``lookup_chain`` (``LookupDrafter``
with ``budget == depth == --chain-depth`` and ``branches=1``: the single best continuation),
``lookup_tree`` and ``suffix_tree`` (``--tree-budget`` nodes, ``--tree-depth`` deep), all through
``tree_generate_step`` at temperature 0 with ``stats=RoundStats()``, exactly ``--max-tokens``
tokens (no stop token). Every arm's output is checked token for token against ``plain``.
After a warm-up of every arm, each prompt runs every arm once, the arm order rotated per prompt
(interleaved, so drift spreads over the arms). Per workload and arm it reports medians over
prompts of emitted tokens per target verify, end-to-end tok/s (prefill included; the drafters'
index building is part of it), and the speedup (plain's wall time / the arm's, per prompt); plus
mean nodes per round and draft ms per round. Prints a Markdown table; ``--out`` writes JSON.

GPU:   python bench/model_free_bench.py --model mlx_treespec/demo/target --out bench/out/model_free.json
CPU smoke test (tiny random model, char tokens, < 1 min):  python bench/model_free_bench.py --quick

The demo target was trained on 512-token windows: the defaults keep prompt + output below that
(``--context-tokens 224 --max-tokens 192``); raise them for larger targets.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import keyword
import os
import platform
import re
import statistics
import sys
import sysconfig
import time
import builtins

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import mlx.core as mx  # noqa: E402

from mlx_treespec.drafters.lookup import LookupDrafter  # noqa: E402
from mlx_treespec.drafters.suffix import SuffixDrafter  # noqa: E402
from mlx_treespec.generate import RoundStats, tree_generate_step  # noqa: E402

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mlx_treespec", "demo", "target")
HELDOUT_MOD = 50
ARMS = ["plain", "lookup_chain", "lookup_tree", "suffix_tree"]
EDIT_MARK = "\n# edited copy\n"
TOP_DEF = re.compile(r"^(def|class) ", re.M)
IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
SKIP_NAMES = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


# --------------------------------------------------------------------------- held-out files


def _readable(path, min_chars):
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
        return None
    if len(text) < min_chars or "\x00" in text or max(map(len, text.split("\n"))) > 1000:
        return None
    return text


def heldout_files(source_dir=None, n=8, min_chars=3000):
    """[(relpath, text)]: the first n held-out files, sorted by sha1(relpath)."""
    if source_dir is not None:
        root, prefix, held = os.path.abspath(source_dir), "", lambda rel: True
    else:
        root, prefix = os.path.realpath(sysconfig.get_paths()["stdlib"]), "stdlib/"
        held = lambda rel: int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_MOD == 0
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in filenames:
            if f.endswith(".py"):
                rel = prefix + os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                if held(rel):
                    rels.append(rel)
    rels.sort(key=lambda r: hashlib.sha1(r.encode()).hexdigest())
    out = []
    for rel in rels:
        text = _readable(os.path.join(root, rel[len(prefix):]), min_chars)
        if text is not None and TOP_DEF.search(text):  # code, not a data module
            out.append((rel, text))
        if len(out) == n:
            break
    return out


# --------------------------------------------------------------------------- workloads


def excerpt(text, encode, max_tokens):
    """Lines from the first top-level def/class, as many as fit in max_tokens."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.startswith(("def ", "class "))), 0)
    out = ""
    for line in lines[start:]:
        if out and len(encode(out + line)) > max_tokens:
            break
        out += line
    return out


def rename_target(head, body):
    """The most frequent (in body) non-keyword identifier of head, ties to first appearance."""
    names = [m.group() for m in IDENT.finditer(head)]
    names = [w for w in dict.fromkeys(names) if w not in SKIP_NAMES and len(w) >= 3]
    if not names:
        return None
    counts = {w: len(re.findall(rf"\b{re.escape(w)}\b", body)) for w in names}
    return max(names, key=lambda w: (counts[w], -names.index(w)))


def edit_prompt(text, encode, context_tokens, edit_lines):
    body = excerpt(text, encode, context_tokens)
    head = "".join(body.splitlines(keepends=True)[:edit_lines])
    name = rename_target(head, body)
    if name is not None:
        head = re.sub(rf"\b{re.escape(name)}\b", name + "_new", head)
    return body + EDIT_MARK + head, name


def plain_prompt(text, chars, seed):
    rng = np.random.default_rng(seed)
    starts = [0] + [i + 1 for i, c in enumerate(text[: max(1, len(text) - 2 * chars)]) if c == "\n"]
    starts = [s for s in starts if text[s : s + 1] not in ("\n", "")] or [0]
    s = int(starts[rng.integers(len(starts))])
    end = text.find("\n", s + chars)
    return text[s : (len(text) if end < 0 else end + 1)]


def workloads(files, encode, args):
    edit, plain = [], []
    for i, (rel, text) in enumerate(files):
        p, name = edit_prompt(text, encode, args.context_tokens, args.edit_lines)
        edit.append(dict(path=rel, renamed=name, tokens=encode(p)))
        plain.append(dict(path=rel, tokens=encode(plain_prompt(text, args.plain_chars, seed=i))))
    return {"edit": edit, "plain": plain}


# --------------------------------------------------------------------------- models


class CharTokenizer:
    """--quick: one token per character (code point mod the vocabulary)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def encode(self, text):
        return [ord(c) % self.vocab for c in text]


def tiny_model(vocab=96):
    """A tiny random float32 qwen3 (as tests/tiny.py: weights x3 so the argmax moves)."""
    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes

    cfg = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
               vocab_size=vocab, max_position_embeddings=4096, rope_theta=10000.0,
               tie_word_embeddings=False)
    mx.random.seed(0)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    model.update(tree_map(lambda p: p * 3.0 if p.ndim >= 2 else p, model.parameters()))
    model.eval()
    mx.eval(model.parameters())
    return model


# --------------------------------------------------------------------------- arms


def make_drafter(arm, args):
    if arm == "lookup_chain":
        return LookupDrafter(budget=args.chain_depth, max_depth=args.chain_depth, branches=1)
    if arm == "lookup_tree":
        return LookupDrafter(budget=args.tree_budget, max_depth=args.tree_depth)
    if arm == "suffix_tree":
        return SuffixDrafter(budget=args.tree_budget, max_depth=args.tree_depth)
    raise ValueError(arm)


def run_arm(arm, model, prompt, max_tokens, args):
    if arm == "plain":
        from mlx_lm.generate import generate_step

        tic = time.perf_counter()
        out = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]
        wall = time.perf_counter() - tic
        return out, wall, dict(emitted_per_verify=1.0, nodes_per_round=1.0, draft_ms_per_round=0.0,
                               rounds=len(out))
    stats = RoundStats()
    drafter = make_drafter(arm, args)
    tic = time.perf_counter()
    out = [int(t) for t, _, _ in tree_generate_step(prompt, model, drafter, max_tokens=max_tokens, stats=stats)]
    wall = time.perf_counter() - tic
    s = stats.summary()
    return out, wall, {k: s[k] for k in ("emitted_per_verify", "nodes_per_round", "draft_ms_per_round",
                                           "rounds", "prompt_ms")}


def bench(model, loads, args, log):
    arms = args.arms
    # warm-up: every arm once on the first prompt (compiles, allocates), discarded
    first = next(iter(loads.values()))[0]["tokens"]
    for arm in arms:
        run_arm(arm, model, first, min(args.max_tokens, 32), args)
    results = {}
    k = 0
    for wname, prompts in loads.items():
        rows = []
        for i, p in enumerate(prompts):
            order = arms[k % len(arms):] + arms[: k % len(arms)]
            k += 1
            runs = {}
            for arm in order:
                out, wall, fig = run_arm(arm, model, p["tokens"], args.max_tokens, args)
                runs[arm] = dict(out=out, wall_s=wall, **fig)
            ref = runs["plain"]["out"] if "plain" in runs else None
            row = dict(path=p["path"], prompt_tokens=len(p["tokens"]), order=order, arms={})
            for arm, r in runs.items():
                out = r.pop("out")
                r["tokens"] = len(out)
                r["tok_s"] = len(out) / r["wall_s"]
                r["exact"] = ref is None or out == ref
                if ref is not None:
                    r["speedup"] = runs["plain"]["wall_s"] / r["wall_s"]
                row["arms"][arm] = r
            rows.append(row)
            log(f"{wname} {i}: {p['path']} ({len(p['tokens'])} prompt tokens) " + ", ".join(
                f"{a} {row['arms'][a]['emitted_per_verify']:.2f}/v {row['arms'][a]['tok_s']:.1f} tok/s"
                + ("" if row["arms"][a]["exact"] else " MISMATCH") for a in arms))
        summary = {}
        for arm in arms:
            vals = [r["arms"][arm] for r in rows]
            med = lambda key: statistics.median(v[key] for v in vals) if all(key in v for v in vals) else None
            summary[arm] = dict(
                emitted_per_verify=med("emitted_per_verify"), tok_s=med("tok_s"), speedup=med("speedup"),
                nodes_per_round=statistics.mean(v["nodes_per_round"] for v in vals),
                draft_ms_per_round=statistics.mean(v["draft_ms_per_round"] for v in vals),
                exact=sum(v["exact"] for v in vals), prompts=len(vals),
            )
        results[wname] = dict(summary=summary, prompts=rows)
    return results


def table(results, arms):
    lines = ["| workload | arm | emitted/verify | tok/s | speedup vs plain | nodes/round | draft ms/round | exact |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "-" if x is None else format(x, f)
    for wname, res in results.items():
        for arm in arms:
            s = res["summary"][arm]
            lines.append(f"| {wname} | {arm} | {fmt(s['emitted_per_verify'], '.2f')} | {fmt(s['tok_s'], '.1f')} | "
                         f"{fmt(s['speedup'], '.2f')}x | {s['nodes_per_round']:.1f} | {s['draft_ms_per_round']:.2f} | "
                         f"{s['exact']}/{s['prompts']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=f"mlx-lm model folder (default: {DEFAULT_MODEL})")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke test: tiny random model and char tokens (unless --model), small sizes")
    ap.add_argument("--source-dir", default=None, help="held-out .py files (default: the stdlib held-out split)")
    ap.add_argument("--heldout-json", default=None,
                    help="use the 'texts' of a heldout_prompts.json (bench/train_demo_pair.py) as the files")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--context-tokens", type=int, default=224, help="edit workload: excerpt length")
    ap.add_argument("--edit-lines", type=int, default=4, help="edit workload: lines of the edited copy in the prompt")
    ap.add_argument("--plain-chars", type=int, default=200, help="plain workload: prompt length in characters")
    ap.add_argument("--chain-depth", type=int, default=8)
    ap.add_argument("--tree-budget", type=int, default=32)
    ap.add_argument("--tree-depth", type=int, default=8)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}")
    ap.add_argument("--workloads", default="edit,plain")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arms {bad}; choose from {ARMS}")
    if args.quick:
        args.prompts = min(args.prompts, 2)
        args.max_tokens = min(args.max_tokens, 48)
        args.context_tokens = min(args.context_tokens, 400)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)

    if args.quick and args.model is None:
        model, vocab = tiny_model(), 96
        encode = CharTokenizer(vocab).encode
        model_name = "tiny random qwen3 (char tokens)"
    else:
        from mlx_lm import load

        path = args.model or DEFAULT_MODEL
        if not os.path.exists(os.path.join(path, "config.json")) and not args.model:
            ap.error(f"no model at {path}: pass --model (an mlx-lm folder or Hugging Face repo) or --quick")
        model, tokenizer = load(path)
        encode = tokenizer.encode
        model_name = path
    if args.heldout_json:
        with open(args.heldout_json) as f:
            files = list({t["path"]: t["text"] for t in json.load(f)["texts"]}.items())[: args.prompts]
    else:
        files = heldout_files(args.source_dir, n=args.prompts)
    if not files:
        ap.error("no held-out source files found; pass --source-dir")
    loads = workloads(files, encode, args)
    loads = {w: loads[w] for w in args.workloads.split(",") if w}
    log(f"model: {model_name}; {len(files)} files; device {mx.default_device()}")
    results = bench(model, loads, args, log)
    md = table(results, args.arms)
    print(md)
    mismatches = sum(res["summary"][a]["prompts"] - res["summary"][a]["exact"]
                     for res in results.values() for a in args.arms)
    if mismatches:
        print(f"\nWARNING: {mismatches} runs differ from plain greedy decoding", file=sys.stderr)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        cfg = {k: v for k, v in vars(args).items()}
        with open(args.out, "w") as f:
            json.dump(dict(model=model_name, device=str(mx.default_device()), platform=platform.platform(),
                           mlx=mx.__version__, config=cfg, files=[r for r, _ in files], results=results,
                           markdown=md), f, indent=1)
        log(f"wrote {args.out}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
