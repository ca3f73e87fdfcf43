#!/usr/bin/env python3
"""Tree GatedDeltaNet kernel: correctness and timing at Qwen3.5-like layer shapes.

B=1, Hk=16, Hv=32, Dk=Dv=128, bf16 q/k/v/beta, float32 g and state (as mlx-lm's layer builds
them: normalize_qk, compute_g, sigmoid). For N in {1, 4, 8, 16, 32, 64} and three trees of N
nodes (a chain; "fan4": fan-out 4 at the root then 4 chains, numbered breadth-first as a
drafter emits them; a random tree), it measures

  * max |y_kernel - y_ops| (and the final state on chains) against the MLX-ops reference
    (mlx_treespec.gdn.tree_gated_delta_ops, itself bitwise equal on CPU to mlx-lm's
    gated_delta_ops along each root path);
  * median wall time (mx.eval + perf_counter, after warm-ups) of the tree kernel on each tree,
    of the ops reference on the same trees, and of mlx-lm's
    gated_delta_update(..., use_kernel=False) on a chain of N (what CUDA runs today);

then prints a Markdown table and the ratios behind the bars (bushy tree <= 1.3x chain through
the same kernel; >= 20x faster than the ops reference at N=16), and writes JSON to --out.

GPU (MLX CUDA build, or Metal):  python bench/gdn_kernel_bench.py --out bench/out/gdn.json
Local smoke test (ops vs ops):    python bench/gdn_kernel_bench.py --device cpu --quick
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

from mlx_treespec import gdn  # noqa: E402

# mlx-lm's gated_delta module (loaded from its file if `import mlx_lm` itself fails).
compute_g = gdn.mlx_lm_gated_delta.compute_g
gated_delta_update = gdn.mlx_lm_gated_delta.gated_delta_update
normalize_qk = gdn.mlx_lm_gated_delta.normalize_qk

B, HK, HV, DK, DV = 1, 16, 32, 128, 128


def fan4_parents(n: int) -> list:
    """Root, 4 children of the root, then each of the 4 branches continues as a chain;
    numbered breadth-first (node i >= 5 continues node i - 4)."""
    p = [-1]
    for i in range(1, n):
        p.append(0 if i <= 4 else i - 4)
    return p[:n]


def random_parents(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def make_inputs(n: int, seed: int):
    ks = mx.random.split(mx.random.key(seed), 8)
    dt = mx.bfloat16
    q = mx.random.normal((B, n, HK, DK), key=ks[0]).astype(dt)
    k = mx.random.normal((B, n, HK, DK), key=ks[1]).astype(dt)
    q, k = normalize_qk(q, k, inv_scale=DK**-0.5, eps=1e-6)
    v = mx.random.normal((B, n, HV, DV), key=ks[2]).astype(dt)
    a = mx.random.normal((B, n, HV), key=ks[3]).astype(dt)
    b = mx.random.normal((B, n, HV), key=ks[4]).astype(dt)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (HV,), key=ks[5]))
    dt_bias = mx.random.normal((HV,), key=ks[6]) * 0.5
    state = mx.random.normal((B, HV, DV, DK), key=ks[7]) * 0.1
    g = compute_g(A_log, a, dt_bias)
    beta = mx.sigmoid(b)
    mx.eval(q, k, v, a, b, A_log, dt_bias, state, g, beta)
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, g=g,
                beta=beta)


def timed(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def timed_queued(fn, reps: int, warmup: int, queue: int = 16) -> float:
    """Per-call time with `queue` calls queued before one sync, as the layers of a forward
    queue: launch latency overlaps, so this is closer to the device's own time per call."""
    for _ in range(warmup):
        mx.eval(fn())
    ts = []
    for _ in range(max(3, reps // 4)):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(queue)])
        ts.append((time.perf_counter() - t0) * 1e3 / queue)
    return statistics.median(ts)


def max_abs(a, b) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--quick", action="store_true", help="N in {1,4,16}, 3 reps")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    args = ap.parse_args(argv)

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    sizes = [1, 4, 16] if args.quick else [1, 4, 8, 16, 32, 64]
    reps = args.reps or (3 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)

    backend = gdn.kernel_backend()
    if args.device == "gpu" and backend is None:
        print("no Metal/CUDA GPU backend: use --device cpu", file=sys.stderr)
        return 2
    label = f"{backend} kernel" if backend else "ops (CPU: no kernel)"

    def kernel(inp, parents, final=False):
        if backend is None:  # CPU: what the dispatcher runs, i.e. the ops reference
            return gdn.tree_gated_delta(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                        inp["state"], parents, return_final_state=final)
        # Call the kernel directly: a build failure raises instead of falling back.
        return gdn.run_tree_kernel(backend, inp["q"], inp["k"], inp["v"], inp["g"],
                                   inp["beta"], inp["state"], parents, store_final=final)

    def ops(inp, parents, final=False):
        return gdn.tree_gated_delta_ops(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                        inp["state"], parents,
                                        return_states="last" if final else None)

    def mlxlm_chain(inp):
        return gated_delta_update(inp["q"], inp["k"], inp["v"], inp["a"], inp["b"],
                                  inp["A_log"], inp["dt_bias"], inp["state"], use_kernel=False)

    # Does the dispatcher pick the kernel (no build failure)?
    probe = make_inputs(2, 0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mx.eval(gdn.tree_gated_delta(probe["q"], probe["k"], probe["v"], probe["g"],
                                     probe["beta"], probe["state"], [-1, 0])[0])
    fallback = [str(x.message) for x in w]
    if fallback:
        print("WARNING:", fallback[0])

    rows = []
    t_start = time.perf_counter()
    for n in sizes:
        inp = make_inputs(n, seed=n)
        # Plans (host tables, uploaded once) are built outside the timings, as a forward
        # builds one per tree and shares it across all layers.
        trees = {"chain": gdn.tree_plan(gdn.chain_parents(n)), "fan4": gdn.tree_plan(fan4_parents(n)),
                 "random": gdn.tree_plan(random_parents(n, seed=1000 + n))}
        row = {"N": n}
        for name, parents in trees.items():
            y_k, _ = kernel(inp, parents)
            y_o, _ = ops(inp, parents)
            row[f"err_{name}"] = max_abs(y_k, y_o)
            row[f"slots_{name}"] = int(parents.kernel_table()[1])
            row[f"depth_{name}"] = len(parents.levels())
            row[f"kernel_{name}_ms"] = timed(lambda: kernel(inp, parents)[0], reps, warmup)
            row[f"ops_{name}_ms"] = timed(lambda: ops(inp, parents)[0], reps, warmup)
            row[f"kernel_{name}_queued_ms"] = timed_queued(lambda: kernel(inp, parents)[0], reps, warmup)
            row[f"ops_{name}_queued_ms"] = timed_queued(lambda: ops(inp, parents)[0], reps, warmup)
        # Chain: final state (the commit's replay) and mlx-lm's own path.
        _, s_k = kernel(inp, trees["chain"], final=True)
        _, s_o = ops(inp, trees["chain"], final=True)
        y_m, s_m = mlxlm_chain(inp)
        row["err_chain_state"] = max_abs(s_k, s_o)
        row["err_chain_vs_mlxlm"] = max_abs(kernel(inp, trees["chain"])[0], y_m)
        row["kernel_chain_final_ms"] = timed(lambda: kernel(inp, trees["chain"], True), reps,
                                             warmup)
        row["mlxlm_chain_ms"] = timed(lambda: mlxlm_chain(inp), reps, warmup)
        rows.append(row)
        print(f"  N={n} done ({time.perf_counter() - t_start:.1f} s)", file=sys.stderr)

    # ---- report ----
    hdr = ["N", "kernel chain", "kernel fan4", "kernel random", "ops chain", "ops fan4",
           "ops random", "mlx-lm chain (use_kernel=False)", "fan4/chain", "random/chain",
           "ops/kernel (chain, fan4, random)", "max |dy| (chain, fan4, random)",
           "max |dstate| chain"]
    print(f"\n### GatedDeltaNet tree recurrence, {label}, B={B} Hk={HK} Hv={HV} Dk={DK} "
          f"Dv={DV}, bf16 inputs, f32 state; median of {reps} (ms)\n")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        kc, kf, kr = r["kernel_chain_ms"], r["kernel_fan4_ms"], r["kernel_random_ms"]
        print("| " + " | ".join([
            str(r["N"]), f"{kc:.3f}", f"{kf:.3f}", f"{kr:.3f}", f"{r['ops_chain_ms']:.3f}",
            f"{r['ops_fan4_ms']:.3f}", f"{r['ops_random_ms']:.3f}", f"{r['mlxlm_chain_ms']:.3f}",
            f"{kf / kc:.2f}x", f"{kr / kc:.2f}x",
            f"{r['ops_chain_ms'] / kc:.1f}x, {r['ops_fan4_ms'] / kf:.1f}x, "
            f"{r['ops_random_ms'] / kr:.1f}x",
            f"{r['err_chain']:.2e}, {r['err_fan4']:.2e}, {r['err_random']:.2e}",
            f"{r['err_chain_state']:.2e}",
        ]) + " |")

    print("\nQueued: per-call ms with 16 calls queued before one sync (as a forward's layers queue)\n")
    print("| N | kernel chain | kernel fan4 | kernel random | ops chain | ops fan4 | ops random | "
          "fan4/chain | random/chain | ops/kernel (chain, fan4, random) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kq = [r[f"kernel_{t}_queued_ms"] for t in ("chain", "fan4", "random")]
        oq = [r[f"ops_{t}_queued_ms"] for t in ("chain", "fan4", "random")]
        print(f"| {r['N']} | " + " | ".join(f"{x:.4f}" for x in kq + oq) + f" | {kq[1] / kq[0]:.2f}x | "
              f"{kq[2] / kq[0]:.2f}x | " + ", ".join(f"{o / k:.1f}x" for o, k in zip(oq, kq)) + " |")

    bushy = max(max(r["kernel_fan4_ms"], r["kernel_random_ms"]) / r["kernel_chain_ms"]
                for r in rows)
    bushy_q = max(max(r["kernel_fan4_queued_ms"], r["kernel_random_queued_ms"]) / r["kernel_chain_queued_ms"]
                  for r in rows)
    r16 = next((r for r in rows if r["N"] == 16), None)
    bars = {"bushy_over_chain_max": bushy, "bushy_bar_ok": bushy <= 1.3,
            "bushy_over_chain_max_queued": bushy_q, "bushy_bar_ok_queued": bushy_q <= 1.3}
    if r16 is not None:
        sp = {t: r16[f"ops_{t}_ms"] / r16[f"kernel_{t}_ms"] for t in ("chain", "fan4", "random")}
        bars.update({
            "speedup_vs_ops_N16": sp,
            "speedup_vs_mlxlm_chain_N16": r16["mlxlm_chain_ms"] / r16["kernel_chain_ms"],
            "speedup_bar_ok": min(sp.values()) >= 20.0,
        })
        spq = {t: r16[f"ops_{t}_queued_ms"] / r16[f"kernel_{t}_queued_ms"] for t in ("chain", "fan4", "random")}
        bars.update({"speedup_vs_ops_N16_queued": spq, "speedup_bar_ok_queued": min(spq.values()) >= 20.0})
    err = max(max(r["err_chain"], r["err_fan4"], r["err_random"]) for r in rows)
    bars["max_abs_err_y"] = err
    bars["max_abs_err_state"] = max(r["err_chain_state"] for r in rows)

    print("\n**Bars**" + ("" if backend else " (CPU smoke test, ops vs ops: the bars are for "
                                             "a GPU kernel)"))
    print(f"- bushy tree / chain through the same kernel, worst over N and trees: "
          f"{bushy:.2f}x (bar <= 1.3x: {'PASS' if bars['bushy_bar_ok'] else 'FAIL'})")
    if r16 is not None:
        sp = bars["speedup_vs_ops_N16"]
        print(f"- N=16 speed-up over the ops reference: chain {sp['chain']:.1f}x, fan4 "
              f"{sp['fan4']:.1f}x, random {sp['random']:.1f}x (bar >= 20x: "
              f"{'PASS' if bars['speedup_bar_ok'] else 'FAIL'}); over mlx-lm "
              f"gated_delta_update(use_kernel=False) on a chain: "
              f"{bars['speedup_vs_mlxlm_chain_N16']:.1f}x")
    print(f"- queued: bushy / chain worst {bushy_q:.2f}x (bar <= 1.3x: "
          f"{'PASS' if bars['bushy_bar_ok_queued'] else 'FAIL'})" + ("" if r16 is None else
          "; N=16 speed-up over the ops reference: " + ", ".join(
              f"{t} {v:.1f}x" for t, v in bars["speedup_vs_ops_N16_queued"].items())
          + f" (bar >= 20x: {'PASS' if bars['speedup_bar_ok_queued'] else 'FAIL'})"))
    print(f"- max |y_kernel - y_ops| = {err:.3e} (bf16 outputs); max |state| error on chains "
          f"= {bars['max_abs_err_state']:.3e}")
    if fallback:
        print(f"- dispatcher fell back to ops: {fallback[0]}")
    print(f"- total bench time {time.perf_counter() - t_start:.1f} s")

    result = {
        "device": str(mx.default_device()), "backend": backend, "label": label,
        "mlx": getattr(mx, "__version__", "?"), "python": platform.python_version(),
        "shapes": dict(B=B, Hk=HK, Hv=HV, Dk=DK, Dv=DV, dtype="bfloat16", state="float32"),
        "reps": reps, "warmup": warmup, "dispatcher_fallback": fallback, "rows": rows,
        "bars": bars,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
