"""The benchmark runner the sweep and bench/run.py share: prompts, interleaved arms, spreads,
timing, and the record of where a run happened.

Every prompt runs every arm in turn, in an order that rotates with the prompt, after a warm-up
of every arm, so drift (thermals, other load) falls on all arms alike; figures are medians over
prompts with their spread. Nothing here is on the decoding path.
"""
from __future__ import annotations

import gzip
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import mlx.core as mx

from .loop import RoundStats, tree_generate_step

__all__ = ["load_prompts", "encode_prompts", "generate_once", "interleave", "spread", "ratio_interval", "first_divergence",
           "run_meta", "PROMPT_SETS", "DERIVED_SETS"]

_BENCH = Path(__file__).resolve().parents[1] / "bench"
# Named prompt sets (bench/*.json): the demo pair's held-out training split, and source text the
# demo models never saw in training (this project's own code, written after they were trained)
PROMPT_SETS = {"heldout": "heldout_prompts.json.gz", "unseen": "unseen_prompts.json.gz", "train": "train_prompts.json.gz"}


def _editing():
    """A repetitive editing workload: each unseen excerpt, then the excerpt begun again (its
    first third), as a rewrite of code the context holds."""
    return [t + "\n\n" + t[: len(t) // 3] for t in load_prompts("unseen")]


def _long():
    """Four long documents (~11k demo tokens each, past the demo pair's 2,048-token training
    length): the unseen and held-out sets concatenated in four orders."""
    u, h = load_prompts("unseen"), load_prompts("heldout")
    return ["\n\n".join(d) for d in (u + h + u, h + u + h, u[::-1] + h + u[::-1], h[::-1] + u + h[::-1])]


# Sets derived from the named ones
DERIVED_SETS = {"editing": _editing, "long": _long}


def load_prompts(path):
    """Prompt texts from a named set ('heldout', 'unseen'), a JSON file (.json or .json.gz: a list of strings, of
    {"prompt": ...}, or {"prompts": [...]}), or a text file with one prompt per line;
    'editing' and 'long' are derived from them (DERIVED_SETS)."""
    if str(path) in DERIVED_SETS:
        return DERIVED_SETS[str(path)]()
    if str(path) in PROMPT_SETS:
        path = _BENCH / PROMPT_SETS[str(path)]
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [line for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        data = data.get("prompts", [])
    out = [d if isinstance(d, str) else d.get("prompt") for d in data if isinstance(d, (str, dict))]
    out = [t for t in out if isinstance(t, str)]
    if not out:
        raise ValueError(f"{path}: no prompts found (expected a JSON list of strings)")
    return out


def encode_prompts(tokenizer, texts):
    out = []
    for t in texts:
        add_special = tokenizer.bos_token is None or not t.startswith(tokenizer.bos_token)
        out.append(tokenizer.encode(t, add_special_tokens=add_special))
    return out


def generate_once(target, drafter, prompt, max_tokens, stop_tokens=(), **sampling):
    """One generation (greedy; `sampling`: tree_generate_step's temp, seed, ...): (tokens,
    RoundStats, decode seconds). The clock starts at the first token (prefill excluded) and
    stops at the last."""
    stats = RoundStats()
    out, t_first = [], None
    for tok, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=max_tokens,
                                        stop_tokens=stop_tokens, stats=stats, **sampling):
        out.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter()
    dt = time.perf_counter() - t_first if t_first is not None else 0.0
    return out, stats, dt


def record(prompt_index, order, prompt, out, stats, decode_s):
    """The per-run figures: tok/s counts the tokens after the first over the decode time."""
    s = stats.summary()
    drafted = int(sum(stats.nodes) - stats.rounds)
    rec = dict(prompt=prompt_index, order=order, prompt_tokens=len(prompt), tokens=len(out),
               decode_s=decode_s, tok_s=(len(out) - 1) / decode_s if decode_s > 0 else float("nan"),
               wall_ms_per_round=1e3 * decode_s / max(stats.rounds, 1),
               drafted_nodes=drafted, accepted=int(sum(stats.accepted)),
               acceptance=(sum(stats.accepted) / drafted) if drafted else None)
    rec.update(s)
    if stats.round_ms:  # where a run's time went when one round stalls (a trace, a new kernel)
        i = int(np.argmax(stats.round_ms))
        rec["slowest_round"] = dict(index=i, ms=stats.round_ms[i], nodes=stats.nodes[i], held=stats.held[i],
                                    drafter=stats.drafter[i] if i < len(stats.drafter) else "")
    return rec


def arm_orders(n):
    """The arms' order on each prompt, cycling: a Williams design, where over one cycle every
    arm runs in every position equally often and follows every other arm equally often (a
    plain rotation has each arm always follow the same one, so whatever an arm leaves behind,
    its garbage, its memory, a warm cache, weighs on one arm alone). n rows for an even n,
    2n for an odd one (the rows and their mirrors)."""
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(a + r) % n for a in first] for r in range(n)]
    return rows + ([row[::-1] for row in rows] if n % 2 else [])


def interleave(names: Sequence[str], prompts: Sequence, run: Callable, *, warmup: Optional[Callable] = None,
               max_seconds=None, log=None, progress=None) -> Dict[str, List]:
    """`run(name, prompt_index, order)` for every arm name on every prompt, in the order of
    `arm_orders` for that prompt, after `warmup(name)` for every arm. With `max_seconds`, no
    prompt starts after that many seconds (every arm keeps the same prompts). Returns {name:
    [results]}."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    names = list(names)
    if warmup is not None:
        for name in names:
            warmup(name)
            if progress:
                progress(f"warm-up {name}")
    results = {n: [] for n in names}
    orders = arm_orders(len(names))
    start = time.perf_counter()
    for i in range(len(prompts)):
        if max_seconds is not None and i > 0 and time.perf_counter() - start > max_seconds:
            log(f"time budget of {max_seconds:g} s spent: {i} of {len(prompts)} prompts ran")
            break
        for pos, a in enumerate(orders[i % len(orders)]):
            results[names[a]].append(run(names[a], i, pos))
            if progress:
                progress(f"prompt {i + 1}/{len(prompts)} {names[a]}")
    return results


def spread(values):
    """Median, min, max, quartiles and count of the finite values (None if there are none)."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None
    a = np.array(vals)
    return dict(median=float(np.median(a)), min=float(a.min()), max=float(a.max()),
                q1=float(np.percentile(a, 25)), q3=float(np.percentile(a, 75)), n=len(vals))


def ratio_interval(ratios, level=0.9, draws=4000, seed=0):
    """The geometric mean of per-prompt speed ratios and its `level` bootstrap interval over the
    prompts (a percentile interval of resampled geometric means; seeded: a saved run renders the
    same figures again). Whether one arm is robustly faster than another reads off `lo` > 1.
    None where there are no finite positive ratios."""
    logs = np.log([float(r) for r in ratios if r is not None and math.isfinite(r) and r > 0])
    if logs.size == 0:
        return None
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, logs.size, (draws, logs.size))].mean(axis=1)
    tail = 100 * (1 - level) / 2
    return dict(geomean=float(np.exp(logs.mean())), lo=float(np.exp(np.percentile(means, tail))),
                hi=float(np.exp(np.percentile(means, 100 - tail))), level=level, n=int(logs.size))


def first_divergence(a, b):
    """The first index where two token lists differ (None: equal over the shorter)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_meta(**kw):
    """Where and on what a run happened: commit, versions, device, time."""
    def version(name):
        try:
            import importlib.metadata as md

            return md.version(name)
        except Exception:
            return None

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=root, timeout=10).stdout.strip() or None
        # a copy of the tree (a device run) may carry an older .git: then the files differ from it
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, cwd=root, timeout=10).stdout.strip())
    except Exception:
        commit, dirty = None, None
    info = {}
    try:
        info = {k: str(v) for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except Exception:
        pass
    return dict(time=time.strftime("%Y-%m-%d %H:%M:%S"), commit=commit, tree_differs_from_commit=dirty,
                device=str(mx.default_device().type).split(".")[-1], device_info=info,
                mlx=version("mlx"), mlx_lm=version("mlx-lm"), python=platform.python_version(),
                argv=sys.argv[1:], **kw)
