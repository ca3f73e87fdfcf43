"""Sweep draft shapes on one target/drafter pair: chains against trees, at temperature 0.

    python -m mlx_treespec.sweep --model T --draft-model D [--prompts FILE] [--max-tokens 128]
        [--blocks 1,2,4,8] [--tree-topk 2,4] [--tree-depth auto] [--budgets 1,2,4,8]
        [--arms lookup:8:4,suffix:8:4,tree:2:4:8,chain:4] [--out DIR]
        [--cost-model] [--cost-model-config CFG.json [--cost-model-draft-config CFG.json]
         --dtype bfloat16 --q-bits 0,4 [--acceptance-from sweep.json]]

Arms: plain decoding (drafter None), linear blocks (a chain of k) and EAGLE-2 trees (top-K lanes x
depth S x budget B; budgets default to the blocks, so every chain has a tree of its node count),
plus model-free drafters (lookup, suffix) when installed. Every prompt runs every arm in turn, in
an order that rotates with the prompt, after a warm-up of every arm, so drift (thermals, other
load) falls on all arms alike; each figure is the median over prompts with its spread. Timing
starts at the first token (prefill excluded).

Writes under --out: sweep.md (the table), sweep.json (every figure, per arm and per prompt) and
sweep.png (tok/s and emitted per verify against nodes verified per round; chain vs tree).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import mlx.core as mx

from . import costmodel
from .generate import check_vocab
from .harness import (encode_prompts, generate_once, interleave, load_prompts, record, run_meta,
                      spread)
from .probe import device_name, probe_exactness, weights_dtype
from .spec import DraftSpec

__all__ = ["Arm", "parse_arm", "grid_arms", "run_sweep", "summarize", "format_table", "compute_bar",
           "plot", "pair_cost_model", "project", "main", "BUILTIN_PROMPTS"]

PROJECTION = "projection"

BUILTIN_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\ndef list_files(root):\n    out = []\n    for dirpath, dirnames, filenames in os.walk(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    "def parse_args(argv=None):\n    import argparse\n\n    parser = argparse.ArgumentParser(description=__doc__)\n    parser.add_argument(\n",
    "def merge_sort(values):\n    if len(values) <= 1:\n        return values\n    mid = len(values) // 2\n    left = merge_sort(values[:mid])\n",
    "    def __repr__(self):\n        return f\"{type(self).__name__}({self.name!r})\"\n\n    def __eq__(self, other):\n",
]

# ---------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    """One sweep arm: a DraftSpec, named and labelled for the table and the plot."""

    spec: DraftSpec

    def __getattr__(self, name):  # topk, depth, budget, lanes, lookup, trust: the spec's
        return getattr(self.spec, name)

    @property
    def kind(self):  # plain | chain | tree | lookup | suffix | dflash | adaptive (a lookup chain makes a tree)
        s = self.spec
        if s.drafter == "none":
            return "plain"
        if s.adaptive:
            return "adaptive"
        if s.drafter == "model":
            return "chain" if s.is_chain and not s.lookup else "tree"
        return s.drafter

    @property
    def block(self):
        return self.spec.depth if self.kind == "chain" else 0

    @property
    def name(self):
        s = self.spec
        if self.kind == "plain":
            return "plain"
        if self.kind == "chain":
            return f"chain{s.depth}"
        if self.kind == "tree":
            lanes = "" if s.lanes == s.topk else f"-l{s.lanes}"
            lookup = (f"+lu{s.lookup}" + (f"@{s.trust}" if s.trust else "")) if s.lookup else ""
            return f"tree-k{s.topk}{lanes}-d{s.depth}-b{s.budget}{lookup}"
        return s.arm.replace(":", "-")

    @property
    def shape(self):
        return "plain decode" if self.kind == "plain" else self.spec.label

    @property
    def series(self):
        """Which curve the arm is on: a chain or tree with a lookup chain under its root is
        plotted apart ("tree + lookup"), at the nodes it verifies."""
        if self.kind == "tree" and self.spec.lookup:
            return "tree + lookup"
        return {"plain": "plain", "chain": "chain", "tree": "tree", "adaptive": "adaptive"}.get(self.kind, "model-free")

    def params(self):
        s = self.spec
        return dict(block=self.block, topk=s.topk, depth=s.depth, budget=s.budget, lanes=s.lanes,
                    lookup=s.lookup, trust=s.trust)

    def make(self, draft_model):
        """A fresh drafter for one run (None for plain decoding)."""
        return self.spec.build(draft_model)

    def topology(self):
        """Parents probed for this arm: the largest layout a round of it sends."""
        return self.spec.probe_parents()

    @property
    def probe_shape(self):
        return f"largest layout of {self.shape} ({len(self.topology())} nodes)"


def parse_arm(text):
    """An arm string (mlx_treespec.spec's grammar) as an Arm; SystemExit naming the grammar."""
    try:
        return Arm(DraftSpec.parse(text))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def auto_depths(budget):
    return sorted({d for d in (2, budget // 2, budget) if 2 <= d <= budget})


def grid_arms(blocks=(1, 2, 4, 8), topks=(2, 4), depths=None, budgets=None, extra=()):
    """Plain, one chain per block, and the trees of topks x depths x budgets worth running.

    Budgets default to the blocks (a tree of each chain's node count). Skipped: budget 1 (the
    chain of 1), depth > budget (the tree cannot reach it), and budgets beyond what K lanes
    can propose in S steps (K + (S-1) K^2: the drafter would cap them).
    """
    arms = [parse_arm("plain")] + [parse_arm(f"chain:{k}") for k in blocks]
    budgets = list(blocks) if budgets is None else list(budgets)
    for K in topks:
        for B in budgets:
            for S in (depths if depths else auto_depths(B)):
                if B < 2 or S < 1 or S > B or B > K + (S - 1) * K * K:
                    continue
                arms.append(parse_arm(f"tree:{K}:{S}:{B}"))
    arms += list(extra)
    seen, out = set(), []
    for a in arms:
        if a.name not in seen:
            seen.add(a.name)
            out.append(a)
    return out


# ---------------------------------------------------------------------------- running


class ProgressBar:
    """A plain stderr text bar: [#####-----] done/total label."""

    def __init__(self, total, stream=None, width=28, enabled=True):
        self.total, self.done = max(total, 1), 0
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def step(self, label=""):
        self.done += 1
        if not self.enabled:
            return
        fill = int(self.width * self.done / self.total)
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        self.stream.write(f"\r[{'#' * fill}{'-' * (self.width - fill)}] {self.done}/{self.total} "
                          f"{el:5.0f}s eta {eta:4.0f}s {label[:40]:<40}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_sweep(target, draft_model, prompts: Sequence[Sequence[int]], arms: Sequence[Arm], *,
              max_tokens=128, stop_tokens=(), warmup_tokens=32, probe_inputs=3, probe_history=32,
              progress=True, save_rounds=False, max_seconds=None, log=None):
    """Run every arm on every prompt (interleaved, rotating order) after a warm-up.

    With `max_seconds`, no new prompt starts once that much time has passed since the warm-up
    (every arm finishes the prompt in progress, so all arms keep the same prompts).
    Returns {"arms": [...], "prompts_run": n} with per-arm probe figures, per-prompt runs and
    medians/spreads.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    arms = list(arms)
    if not any(a.kind == "plain" for a in arms):
        arms.insert(0, parse_arm("plain"))
    if not prompts:
        raise ValueError("no prompts to run")
    if draft_model is None and any(a.spec.needs_draft_model for a in arms):
        raise ValueError("chain and tree arms need a draft model")
    by_name = {a.name: a for a in arms}

    # exactness probe of every arm's shape (memoized per topology)
    probes = {}
    if probe_inputs > 0:
        log(f"probing exactness of {len(arms)} arm shapes ({probe_inputs} inputs each)...")
        for a in arms:
            rep = probe_exactness(target, [a.topology()], n_inputs=probe_inputs, history=probe_history)
            d = rep.topologies[0].to_dict()
            d.update(device=rep.device, dtype=rep.dtype, probed_shape=a.probe_shape)
            d.pop("per_input", None)
            probes[a.name] = d

    bar = ProgressBar(len(arms) * (len(prompts) + 1), enabled=progress)
    outputs = {a.name: [] for a in arms}

    def warmup(name):
        generate_once(target, by_name[name].make(draft_model), prompts[0], min(max_tokens, warmup_tokens),
                      stop_tokens)

    def run(name, i, order):
        out, stats, decode_s = generate_once(target, by_name[name].make(draft_model), prompts[i],
                                             max_tokens, stop_tokens)
        rec = record(i, order, prompts[i], out, stats, decode_s)
        if save_rounds:
            rec["rounds_raw"] = dict(accepted=stats.accepted, emitted=stats.emitted, nodes=stats.nodes,
                                     depth=stats.depth, draft_ms=stats.draft_ms,
                                     verify_ms=stats.verify_ms, round_ms=stats.round_ms)
        outputs[name].append(out)
        return rec

    runs = interleave([a.name for a in arms], prompts, run, warmup=warmup, max_seconds=max_seconds,
                      log=log, progress=bar.step)
    prompts_run = len(runs["plain"])
    plain = {rec["prompt"]: (rec, out) for rec, out in zip(runs["plain"], outputs["plain"])}
    result = []
    for a in arms:
        recs = runs[a.name]  # in prompt order
        for rec, out in zip(recs, outputs[a.name]):
            ref_rec, ref_out = plain[rec["prompt"]]
            rec["same_as_plain"] = out == ref_out
            rec["ratio_vs_plain"] = rec["tok_s"] / max(ref_rec["tok_s"], 1e-9)
        entry = dict(name=a.name, kind=a.kind, shape=a.shape, series=a.series, params=a.params(),
                     requested_nodes=a.requested_nodes, probe=probes.get(a.name), runs=recs)
        entry.update(summarize(recs))
        result.append(entry)
    return {"arms": result, "prompts_run": prompts_run}


METRICS = ["acceptance", "emitted_per_verify", "accepted_per_round", "nodes_per_round",
           "draft_ms_per_round", "verify_ms_per_round", "round_ms", "wall_ms_per_round", "tok_s",
           "ratio_vs_plain", "requested_budget", "effective_budget", "requested_depth",
           "effective_depth", "tokens", "rounds", "decode_s"]


def summarize(runs):
    """Median over prompts of every metric, with min/max/IQR; plus the count of identical outputs."""
    spreads = {m: spread([r.get(m) for r in runs]) for m in METRICS}
    median = {m: (s["median"] if s else None) for m, s in spreads.items()}
    return dict(median=median, spread=spreads,
                same_as_plain=f"{sum(bool(r.get('same_as_plain')) for r in runs)}/{len(runs)}")


# ---------------------------------------------------------------------------- reporting


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _ms(entry, metric, fmt="{:.2f}"):
    s = entry["spread"].get(metric)
    if not s:
        return "-"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def _probe_cell(p):
    if not p:
        return "-"
    if p["flips"]:
        return f"{p['flips']} flips/{p['checked']}, Δ≤{p['max_abs_diff']:.2g}"
    if p["max_abs_diff"] == 0:
        return f"exact ({p['checked']})"
    return f"0 flips/{p['checked']}, Δ≤{p['max_abs_diff']:.2g}"


def format_table(sweep, cost_model=None):
    """The Markdown table: one row per arm (medians over prompts, min–max in brackets)."""
    model_col = bool(cost_model and cost_model.get("pair"))
    by_name = {a["name"]: a for a in (cost_model or {}).get("pair", {}).get("arms", [])}
    head = ["arm", "shape", "budget req/eff", "depth req/eff", "nodes/round", "acceptance",
            "emitted/verify", "draft ms/round", "verify ms/round", "round ms", "tok/s",
            "x plain", "= plain", "probe (flips/nodes)"]
    if model_col:
        head.append("tok/s (cost model)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in sweep["arms"]:
        m = a["median"]
        if a["kind"] == "plain":
            req_b = req_d = "-"
        else:
            req_b = f"{_f(m['requested_budget'], '{:.0f}')}/{_f(m['effective_budget'], '{:.2f}')}"
            req_d = f"{_f(m['requested_depth'], '{:.0f}')}/{_f(m['effective_depth'], '{:.2f}')}"
        row = [a["name"], a["shape"], req_b, req_d, _f(m["nodes_per_round"]),
               _f(m["acceptance"], "{:.3f}"), _ms(a, "emitted_per_verify", "{:.2f}"),
               _f(m["draft_ms_per_round"]), _f(m["verify_ms_per_round"]), _ms(a, "round_ms"),
               _ms(a, "tok_s", "{:.1f}"), _ms(a, "ratio_vs_plain"), a["same_as_plain"],
               _probe_cell(a.get("probe"))]
        if model_col:
            c = by_name.get(a["name"], {})
            row.append(_f(c.get("model_tok_s"), "{:.1f}"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _bar_rows(sweep):
    rows = []
    for a in sweep["arms"]:
        m = a["median"]
        rows.append(dict(name=a["name"], kind=a["kind"], block=a["params"]["block"],
                         budget=a["requested_nodes"] - 1, nodes=m["nodes_per_round"],
                         E=m["emitted_per_verify"], R=m["round_ms"], tok_s=m["tok_s"],
                         draft_ms=m["draft_ms_per_round"], verify_ms=m["verify_ms_per_round"]))
    return rows


def _slope(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len({x for x, _ in pts}) < 2:
        return None
    return float(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0])


def compute_bar(rows, label="bar"):
    """The emitted-per-verify a tree must beat to outrun the best chain, at its node count.

    tok/s = E / R, so a tree with round time R_tree beats the best chain (E_chain, R_chain) iff
    E_tree > E_chain * R_tree / R_chain. R_tree is the measured round time of the best tree with
    the chain's node count (or, failing that, of the best tree run).
    """
    chains = [r for r in rows if r["kind"] == "chain" and r["E"] and r["R"]]
    trees = [r for r in rows if r["kind"] == "tree" and r["E"] and r["R"]]
    spec = [r for r in rows if r["kind"] in ("chain", "tree")]
    per_node = dict(verify_ms_per_node=_slope([r["nodes"] for r in spec], [r["verify_ms"] for r in spec]),
                    draft_ms_per_node=_slope([r["nodes"] for r in spec], [r["draft_ms"] for r in spec]))
    if not chains:
        return f"{label}: no chain arm was run, so there is no bar to set", dict(per_node, bar=None)
    best = max(chains, key=lambda r: r["tok_s"] or 0)
    N = best["block"] + 1
    same = [t for t in trees if t["budget"] == best["block"]]
    pool = same
    if not same and trees:  # the trees nearest in node count
        gap = min(abs(t["budget"] - best["block"]) for t in trees)
        pool = [t for t in trees if abs(t["budget"] - best["block"]) == gap]
    head = f"(best chain: k={best['block']}, E={best['E']:.3f}, R={best['R']:.2f} ms)"
    info = dict(per_node, best_chain=best["name"], chain_nodes=N, E_chain=best["E"],
                R_chain=best["R"])
    for t in trees:
        t_bar = best["E"] * t["R"] / best["R"]
        t.update(bar=t_bar, wins=t["E"] > t_bar)
    info["trees"] = [dict(name=t["name"], nodes=t["nodes"], E=t["E"], R=t["R"], bar=t["bar"],
                          wins=t["wins"]) for t in trees]
    if not pool:
        X = best["E"]
        info.update(bar=X, R_tree=None, best_tree=None, wins=None)
        return (f"{label}: a tree of {N} nodes must emit > {X:.3f} per verify {head}, if its round "
                f"costs the chain's; no tree arm was run"), info
    bt = max(pool, key=lambda r: r["tok_s"] or 0)
    X = best["E"] * bt["R"] / best["R"]
    wins = bt["E"] > X
    n_tree = N if same else bt["budget"] + 1
    note = "" if same else f" [no tree of {N} nodes was run; nearest: budget {bt['budget']}]"
    info.update(bar=X, R_tree=bt["R"], best_tree=bt["name"], E_tree=bt["E"], wins=wins)
    return (f"{label}: a tree of {n_tree} nodes must emit > {X:.3f} per verify {head}; best tree: "
            f"{bt['name']} (R={bt['R']:.2f} ms) emits {bt['E']:.3f} -> {'wins' if wins else 'loses'}"
            f"{note}"), info


def _tag(arm):
    """A point's label in the plot: k for a chain, K S [L] for a tree, + the lookup's nodes."""
    p = arm["params"]
    if arm["kind"] == "chain":
        return f"k{p['block']}"
    if arm["kind"] != "tree":
        return arm["name"]
    lanes = p.get("lanes") or p["topk"]
    tag = f"K{p['topk']}S{p['depth']}" + ("" if lanes == p["topk"] else f"L{lanes}")
    return tag + (f"+lu{p['lookup']}" if p.get("lookup") else "")


def plot(sweep, path, title=""):
    """tok/s and emitted/verify against nodes verified per round; chain and tree series.

    Returns the path, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"chain": dict(marker="o", linestyle="-"), "tree": dict(marker="^", linestyle="none"),
              "tree + lookup": dict(marker="v", linestyle="none"), "model-free": dict(marker="s", linestyle="none")}
    for ax, metric, ylabel in ((axes[0], "tok_s", "tok/s"), (axes[1], "emitted_per_verify", "emitted per verify")):
        for series, style in styles.items():
            arms = sorted([a for a in sweep["arms"] if a["series"] == series],
                          key=lambda a: a["median"]["nodes_per_round"] or 0)
            if not arms:
                continue
            xs = [a["median"]["nodes_per_round"] for a in arms]
            ys = [a["spread"][metric]["median"] for a in arms]
            lo = [a["spread"][metric]["median"] - a["spread"][metric]["min"] for a in arms]
            hi = [a["spread"][metric]["max"] - a["spread"][metric]["median"] for a in arms]
            ax.errorbar(xs, ys, yerr=[lo, hi], label=series, capsize=3, **style)
            if metric == "tok_s":
                for a, x, y in zip(arms, xs, ys):
                    ax.annotate(_tag(a), (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
        plain = [a for a in sweep["arms"] if a["kind"] == "plain"]
        if plain:
            ax.axhline(plain[0]["spread"][metric]["median"], color="gray", linestyle="--",
                       label="plain decode")
        ax.set_xlabel("nodes verified per round (root included)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle((title + "\n" if title else "") + "points: medians over prompts; bars: their min-max",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- cost model


def _arm_plan(a):
    p = a["params"]
    depth = p["block"] if a["kind"] == "chain" else p["depth"]
    return costmodel.draft_plan(a["kind"], depth, p.get("lanes") or p["topk"])


def pair_cost_model(target, draft_model, sweep, *, history=256, repeats=5, log=None):
    """Verify/draft curves of the measured pair, fitted, and the sweep explained by them.

    Per arm: modeled draft and verify ms, the residual (measured wall ms per round - modeled:
    host work, syncs), and the tok/s the model gives with one overhead for all arms (the median
    residual), against the measured tok/s.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    log("cost model: timing the target's verify and the drafter's steps...")
    vfit = costmodel.fit_curve(costmodel.time_verify(target, history=history, repeats=repeats))
    dfit = (costmodel.fit_curve(costmodel.time_draft(draft_model, history=history, repeats=repeats))
            if draft_model is not None else None)
    arms = []
    for a in sweep["arms"]:
        m = a["median"]
        nodes = m["nodes_per_round"] or a["requested_nodes"]
        d, v, mod = costmodel.round_cost(_arm_plan(a), nodes, vfit, dfit)
        arms.append(dict(name=a["name"], kind=a["kind"], nodes=nodes, plan=_arm_plan(a),
                         emitted_per_verify=m["emitted_per_verify"], model_draft_ms=d,
                         model_verify_ms=v, measured_wall_ms_per_round=m["wall_ms_per_round"],
                         measured_tok_s=m["tok_s"],
                         residual_ms=(m["wall_ms_per_round"] or 0) - mod))
    overhead = float(np.median([x["residual_ms"] for x in arms])) if arms else 0.0
    for x in arms:
        r = x["model_draft_ms"] + x["model_verify_ms"] + overhead
        x["model_round_ms"] = r
        x["model_tok_s"] = 1e3 * (x["emitted_per_verify"] or 1.0) / max(r, 1e-9)
        x["model_rel_err"] = (x["model_tok_s"] - x["measured_tok_s"]) / max(x["measured_tok_s"], 1e-9)
        x["overhead_ms"] = max(x["residual_ms"], 0.0)  # the per-arm overhead projections carry over
    return dict(verify=vfit.to_dict(), draft=dfit.to_dict() if dfit else None,
                common_overhead_ms=overhead, history=history, repeats=repeats, arms=arms,
                max_abs_rel_err=max((abs(x["model_rel_err"]) for x in arms), default=0.0))


def project(sweep, verify_fit, draft_fit, overheads, label):
    """Project every arm's tok/s from its measured acceptance onto other cost curves."""
    rows = []
    for a in sweep["arms"]:
        m = a["median"]
        nodes = m["nodes_per_round"] or a["requested_nodes"]
        E = m["emitted_per_verify"] or 1.0
        plan = _arm_plan(a)
        ov = overheads.get(a["name"], 0.0)
        d, v, r = costmodel.round_cost(plan, nodes, verify_fit, draft_fit, ov)
        rows.append(dict(name=a["name"], kind=a["kind"], shape=a["shape"], params=a["params"],
                         requested_nodes=a["requested_nodes"], nodes=nodes, emitted_per_verify=E,
                         plan=plan, overhead_ms=ov,
                         projection_draft_ms=d, projection_verify_ms=v, projection_round_ms=r,
                         projection_tok_s=1e3 * E / max(r, 1e-9)))
    plain = next((x for x in rows if x["kind"] == "plain"), None)
    for x in rows:
        x["projection_ratio_vs_plain"] = (x["projection_tok_s"] / plain["projection_tok_s"]) if plain else None
    bar_rows = [dict(name=x["name"], kind=x["kind"], block=x["params"]["block"],
                     budget=x["requested_nodes"] - 1, nodes=x["nodes"], E=x["emitted_per_verify"],
                     R=x["projection_round_ms"], tok_s=x["projection_tok_s"],
                     draft_ms=x["projection_draft_ms"], verify_ms=x["projection_verify_ms"]) for x in rows]
    bar_text, bar = compute_bar(bar_rows, label=f"bar ({PROJECTION}, {label})")
    return rows, bar_text, bar


def format_projection_table(rows, label):
    head = ["arm", "shape", "nodes/round", "emitted/verify (measured)", f"draft ms ({PROJECTION})",
            f"verify ms ({PROJECTION})", "overhead ms", f"round ms ({PROJECTION})",
            f"tok/s ({PROJECTION})", f"x plain ({PROJECTION})"]
    lines = [f"### {PROJECTION}: {label}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in rows:
        lines.append("| " + " | ".join([
            x["name"], x["shape"], _f(x["nodes"]), _f(x["emitted_per_verify"], "{:.3f}"),
            _f(x["projection_draft_ms"]), _f(x["projection_verify_ms"]), _f(x["overhead_ms"]),
            _f(x["projection_round_ms"]), _f(x["projection_tok_s"], "{:.1f}"),
            _f(x["projection_ratio_vs_plain"])]) + " |")
    return "\n".join(lines)


def _parse_q_bits(text):
    out = []
    for t in str(text).split(","):
        t = t.strip().lower()
        if t in ("", "0", "none", "no"):
            out.append(None)
        else:
            out.append(_int(t, "--q-bits"))
    return out or [None]


def projections(sweep, pair, args, draft_model, log):
    """--cost-model-config: random-weight models from configs, their curves, the projections."""
    results, texts = [], []
    draft_fits = {}  # (dtype, q_bits) -> fit of the config drafter, built once per variant
    overheads = {x["name"]: x["overhead_ms"] for x in (pair or {}).get("arms", [])}
    if not overheads:
        log("cost model: no measured overheads for this acceptance profile (run the sweep with "
            "--cost-model): projecting with 0 ms overhead per round")
    for cfg_path in args.cost_model_config:
        cfg = costmodel.load_config(cfg_path)
        for q in _parse_q_bits(args.q_bits):
            variant = f"{args.dtype}" + (f", {q}-bit (group {args.q_group_size})" if q else "")
            label = f"{Path(cfg_path).stem} {variant}"
            log(f"cost model: building {label} with random weights...")
            try:
                res, text = _project_variant(sweep, args, cfg_path, cfg, q, label, variant,
                                             draft_fits, draft_model, pair, overheads, log)
            except Exception as e:  # one variant failing must not lose the others
                log(f"cost model: {label} failed: {type(e).__name__}: {e}")
                res = dict(label=PROJECTION, name=label, target_config=str(cfg_path),
                           error=f"{type(e).__name__}: {e}")
                text = f"### {PROJECTION}: {label}\n\nfailed: {res['error']}"
                mx.clear_cache()
            results.append(res)
            texts.append(text)
    return results, texts


def _project_variant(sweep, args, cfg_path, cfg, q, label, variant, draft_fits, draft_model, pair,
                     overheads, log):
    """One config x quantization variant: build, time, fit, project."""
    t0 = time.perf_counter()
    target = costmodel.build_from_config(cfg, args.dtype, q, args.q_group_size)
    built_s = time.perf_counter() - t0
    vfit = costmodel.fit_curve(costmodel.time_verify(target, history=args.cost_history,
                                                     repeats=args.cost_repeats))
    t_params = costmodel.n_params(target)
    del target
    mx.clear_cache()
    draft_label, dfit = None, None
    if args.cost_model_draft_config:
        if (args.dtype, q) not in draft_fits:
            log(f"cost model: building the drafter {Path(args.cost_model_draft_config).stem} "
                f"{variant} with random weights...")
            dcfg = costmodel.load_config(args.cost_model_draft_config)
            dm = costmodel.build_from_config(dcfg, args.dtype, q, args.q_group_size)
            draft_fits[(args.dtype, q)] = costmodel.fit_curve(costmodel.time_draft(
                dm, history=args.cost_history, repeats=args.cost_repeats))
            del dm
            mx.clear_cache()
        dfit = draft_fits[(args.dtype, q)]
        draft_label = f"{Path(args.cost_model_draft_config).stem} {variant} (random weights)"
    elif draft_model is not None:
        dfit = costmodel.fit_curve(costmodel.time_draft(draft_model, history=args.cost_history,
                                                        repeats=args.cost_repeats))
        draft_label = "the measured drafter"
    elif pair and pair.get("draft"):
        dfit = costmodel.CostFit.from_dict(pair["draft"])
        draft_label = "the measured drafter (curve from the acceptance file)"
    if draft_label:
        label += f" + draft {draft_label.split(' (')[0]}"
    rows, bar_text, bar = project(sweep, vfit, dfit, overheads, label)
    result = dict(label=PROJECTION, name=label, target_config=str(cfg_path), target_params=t_params,
                  dtype=args.dtype, q_bits=q, q_group_size=args.q_group_size if q else None,
                  draft=draft_label, build_s=built_s, verify=vfit.to_dict(),
                  draft_fit=dfit.to_dict() if dfit else None,
                  acceptance_source=sweep.get("meta", {}).get("acceptance_source", "this sweep"),
                  arms=rows, bar=bar, bar_line=bar_text,
                  assumptions=("random weights: costs only; acceptance (emitted per verify, nodes "
                               "per round) is the measured pair's; per-arm host overhead is the "
                               "measured pair's residual"))
    text = (format_projection_table(rows, label) + "\n\n"
            + f"verify fit ({PROJECTION}): {vfit.describe()}\n"
            + (f"draft fit ({PROJECTION}): {dfit.describe()}\n" if dfit else "")
            + bar_text)
    return result, text


# ---------------------------------------------------------------------------- CLI


def _demo_path(name):
    from .cli import resolve_model_path

    return resolve_model_path({"target": "demo", "drafter": "demo-drafter"}[name])


def _int(text, what):
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"{what}: expected an integer, got {text!r}") from None


def _ints(text, what):
    if text is None:
        return None
    t = str(text).strip().lower()
    if t in ("", "none", "no"):
        return []
    if t == "auto":
        return None
    return [_int(x, what) for x in t.split(",") if x.strip()]


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_treespec.sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (mlx-lm folder or repo); default: the demo target")
    p.add_argument("--draft-model", default=None, help="drafter; default: the demo drafter")
    p.add_argument("--prompts", default=None,
                   help="JSON list of prompt strings, or a named set: 'heldout' (the demo's held-out "
                        "training split, the default), 'unseen' (text the demo never saw); built-in "
                        "Python snippets where bench/ is not installed")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end a generation at the tokenizer's EOS (default: always generate --max-tokens, "
                        "so every run measures the same length)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new prompt after this many seconds of sweeping (all arms keep the "
                        "same prompts)")
    p.add_argument("--blocks", default="1,2,4,8", help="chain lengths (draft tokens); 'none' for no chains")
    p.add_argument("--tree-topk", default="2,4", help="tree lanes K; 'none' for no trees")
    p.add_argument("--tree-depth", default="auto", help="tree depths S; 'auto': {2, B/2, B} per budget")
    p.add_argument("--budgets", default=None, help="tree budgets (draft nodes); default: the blocks")
    p.add_argument("--arms", default="", help="extra arms: plain, chain:K, tree:K:S[:B[:L]] (L: lanes), lookup:B:D, "
                        "suffix:B:D; a chain or tree may end in +lookupN[@T] (--draft-lookup N, "
                        "--draft-lookup-trust T)")
    p.add_argument("--out", default="bench/out/sweep", help="folder for sweep.md, sweep.json, sweep.png")
    p.add_argument("--plot-from", default=None,
                   help="only (re)draw sweep.png under --out from a sweep JSON (e.g. one written "
                        "where matplotlib was missing)")
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument("--probe-inputs", type=int, default=3, help="exactness probe inputs per arm (0: skip)")
    p.add_argument("--save-rounds", action="store_true", help="also store per-round figures in the JSON")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("cost model")
    g.add_argument("--cost-model", action="store_true",
                   help="time verify vs T and draft vs lanes on the pair and explain the sweep with them")
    g.add_argument("--cost-model-config", action="append", default=[],
                   help="mlx-lm config.json of a target to price with random weights (repeatable); "
                        "its numbers are projections")
    g.add_argument("--cost-model-draft-config", default=None,
                   help="mlx-lm config.json of the drafter to price (default: the measured drafter)")
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"],
                   help="weight dtype of config-built models")
    g.add_argument("--q-bits", default="0",
                   help="quantize config-built models (e.g. 4; a list like 0,4 projects each)")
    g.add_argument("--q-group-size", type=int, default=64)
    g.add_argument("--acceptance-from", default=None,
                   help="a sweep JSON whose measured acceptance to project (skips the sweep)")
    g.add_argument("--cost-history", type=int, default=256, help="committed tokens under the timed forwards")
    g.add_argument("--cost-repeats", type=int, default=5)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.plot_from:
        data = json.loads(Path(args.plot_from).read_text())
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = data.get("meta", {})
        title = (f"{Path(str(meta.get('model'))).name} + {Path(str(meta.get('draft_model'))).name} on "
                 f"{meta.get('device')}, {meta.get('num_prompts')} prompts x {meta.get('max_tokens')} "
                 "tokens, temp 0")
        written = plot(data, Path(args.out) / "sweep.png", title=title)
        if written is None:
            raise SystemExit("matplotlib is not installed: pip install matplotlib")
        print(f"wrote {written}")
        return data
    extra = [parse_arm(s) for s in args.arms.split(",") if s.strip()]
    blocks = _ints(args.blocks, "--blocks") or []
    topks = _ints(args.tree_topk, "--tree-topk") or []
    depths = _ints(args.tree_depth, "--tree-depth")
    budgets = _ints(args.budgets, "--budgets") if args.budgets is not None else None
    arms = grid_arms(blocks, topks, depths, budgets, extra)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.acceptance_from and not args.cost_model_config:
        raise SystemExit("--acceptance-from only serves --cost-model-config projections")
    for cfg_path in args.cost_model_config + ([args.cost_model_draft_config] if args.cost_model_draft_config else []):
        try:  # fail before the sweep, not after it
            costmodel.load_config(cfg_path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"cannot read the cost-model config {cfg_path}: {e}") from None
    _parse_q_bits(args.q_bits)

    from mlx_lm import load

    target = draft_model = None
    if args.acceptance_from:
        data = json.loads(Path(args.acceptance_from).read_text())
        sweep = dict(meta=dict(data.get("meta", {}), acceptance_source=str(args.acceptance_from)),
                     arms=data["arms"])
        pair = (data.get("cost_model") or {}).get("pair")
        if args.draft_model and not args.cost_model_draft_config:
            draft_model = load(args.draft_model)[0]
        json_path, md_path = out_dir / "projection.json", out_dir / "projection.md"
        doc = dict(meta=run_meta(acceptance_from=str(args.acceptance_from)), arms=sweep["arms"],
                   cost_model=dict(pair=pair, projections=[]))
        md = [f"# {PROJECTION}s from {args.acceptance_from}", ""]
    else:
        model_path = args.model or _demo_path("target")
        draft_path = args.draft_model or _demo_path("drafter")
        need_draft = any(a.spec.needs_draft_model for a in arms)
        for what, p, given in (("target", model_path, args.model),
                               ("drafter", draft_path if need_draft else None, args.draft_model)):
            if p is not None and not given and not Path(p).exists():
                raise SystemExit(f"the demo {what} is not at {p}: pass --model and --draft-model")
        log(f"loading {model_path} and {draft_path}...")
        target, tokenizer = load(model_path)
        if need_draft:
            draft_model = load(draft_path)[0]
            check_vocab(target, draft_model)
        pfile = args.prompts or "heldout"
        try:
            texts = load_prompts(pfile)
        except (OSError, ValueError) as e:
            if args.prompts:
                raise SystemExit(f"cannot read the prompts {pfile}: {e}") from None
            texts, pfile = list(BUILTIN_PROMPTS), None  # an install without bench/: built-in snippets
        if args.num_prompts:
            texts = texts[: args.num_prompts]
        prompts = encode_prompts(tokenizer, texts)
        stop = sorted(int(t) for t in tokenizer.eos_token_ids) if args.stop_at_eos else []
        log(f"{len(arms)} arms x {len(prompts)} prompts ({pfile or 'built-in prompts'}), "
            f"{args.max_tokens} tokens each, temp 0, on {device_name()}")
        sweep = run_sweep(target, draft_model, prompts, arms, max_tokens=args.max_tokens,
                          stop_tokens=stop, warmup_tokens=args.warmup_tokens,
                          probe_inputs=args.probe_inputs, progress=not args.no_progress,
                          save_rounds=args.save_rounds, max_seconds=args.max_seconds, log=log)
        if sweep["prompts_run"] < len(prompts):
            texts, prompts = texts[: sweep["prompts_run"]], prompts[: sweep["prompts_run"]]
        sweep["meta"] = run_meta(model=model_path, draft_model=draft_path if need_draft else None,
                              target_dtype=weights_dtype(target),
                              draft_dtype=weights_dtype(draft_model) if draft_model is not None else None,
                              prompts_file=str(pfile) if pfile else None, num_prompts=len(prompts),
                              max_tokens=args.max_tokens, stop_at_eos=args.stop_at_eos,
                              arms=[a.name for a in arms],
                              interleaved="each prompt runs every arm, order rotated by the prompt index",
                              spread="min-max over prompts (q1/q3 in the JSON)")
        sweep["prompts"] = [dict(text=t, tokens=len(p)) for t, p in zip(texts, prompts)]
        pair = None
        if args.cost_model:
            pair = pair_cost_model(target, draft_model, sweep, history=args.cost_history,
                                   repeats=args.cost_repeats, log=log)
        json_path, md_path = out_dir / "sweep.json", out_dir / "sweep.md"
        doc = dict(meta=sweep["meta"], prompts=sweep["prompts"], arms=sweep["arms"],
                   cost_model=dict(pair=pair, projections=[]) if (pair or args.cost_model_config) else None)
        table = format_table(sweep, doc["cost_model"])
        bar_text, bar = compute_bar(_bar_rows(sweep))
        doc["bar"] = dict(bar, line=bar_text)
        title = (f"{Path(model_path).name} + {Path(draft_path).name} on {device_name()}, "
                 f"{len(prompts)} prompts x {args.max_tokens} tokens, temp 0")
        md = [f"# Sweep: {title}", "", table, "", bar_text]
        per = bar
        if per.get("verify_ms_per_node") is not None:
            md.append(f"measured cost per extra node (fit across arms): verify "
                      f"{per['verify_ms_per_node']:+.3f} ms, draft {per['draft_ms_per_node']:+.3f} ms")
        if pair:
            md += ["", f"cost model (measured pair): verify {costmodel.CostFit.from_dict(pair['verify']).describe()}"]
            if pair["draft"]:
                md.append(f"cost model (measured pair): draft {costmodel.CostFit.from_dict(pair['draft']).describe()}")
            md.append(f"common overhead {pair['common_overhead_ms']:.2f} ms/round; model tok/s within "
                      f"{100 * pair['max_abs_rel_err']:.0f}% of measured across arms")
        print("\n".join(md), flush=True)
        png = out_dir / "sweep.png"
        written = plot(sweep, png, title=title)
        doc["outputs"] = dict(table=str(md_path), json=str(json_path), plot=str(written) if written else None)
        if written is None:
            msg = ("matplotlib is not installed: no plot was written (pip install matplotlib, or the "
                   "'bench' extra); the table and the JSON were written")
            print(msg, flush=True)
            md.append(msg)
            doc["outputs"]["plot_missing"] = msg
        md_path.write_text("\n".join(md) + "\n")
        json_path.write_text(json.dumps(doc, indent=1, default=_json_default))

    if args.cost_model_config:
        results, texts = projections(sweep, pair, args, draft_model, log)
        doc.setdefault("cost_model", None)
        if doc["cost_model"] is None:
            doc["cost_model"] = dict(pair=pair, projections=[])
        doc["cost_model"]["projections"] = results
        block = "\n\n".join(texts)
        print("\n" + block, flush=True)
        md.append("")
        md.append(block)
        md_path.write_text("\n".join(md) + "\n")
        json_path.write_text(json.dumps(doc, indent=1, default=_json_default))
    plot_path = (doc.get("outputs") or {}).get("plot")
    print(f"wrote {md_path}, {json_path}" + (f", {plot_path}" if plot_path else ""), file=sys.stderr)
    return doc


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


if __name__ == "__main__":
    main()
