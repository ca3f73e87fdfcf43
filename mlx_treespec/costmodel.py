"""Cost model: verify and draft cost curves, fitted, and tok/s projections per arm.

- `time_verify(model, Ts)`: ms of one `TreeRound.forward` of a chain of T nodes over a prefilled
  cache (mx.eval'd, median of a few; the round is dropped with `abort()`, so the cache state is
  the same for every measurement).
- `time_draft(model, lanes)`: ms of one drafter step forwarding `lanes` sibling nodes (one chain
  step when lanes == 1), the way `ModelDrafter` expands its lanes.
- `fit_curve(points)`: t(1) as measured and a least-squares line a + b*T through T >= 2; when
  that line misses a point by more than `tol`, piecewise-linear interpolation between the
  measured points is used instead (the line's max relative error is reported either way).
- `round_cost(arm, ...)`: draft_steps * draft_ms(lanes) + verify_ms(nodes) + overhead.
- `build_from_config(cfg, dtype, q_bits)`: an mlx-lm model with random weights from a config
  dict, to price a pairing that cannot be trained here. Anything computed from such a model is a
  *projection* and is labelled so wherever it is shown.
- `startup_costs(model)`: what the adaptive drafter (adaptive.py) starts from: plain decoding's
  ms per token (`time_plain`, pipelined) and the verify curve over `SHORT_HISTORY` rows,
  measured once per target shape, device and MLX version and kept on disk (`cost_cache_dir`).
- `costs_at(model, context)`: the same at a context of `context` rows: from `LONG_FROM` rows on,
  interpolated between the start-up fit and a second one over `LONG_HISTORY` rows (measured the
  first time a generation needs it, kept beside the first): attention's cost grows with the
  context, and faster for a verify of many rows than for one.
"""
from __future__ import annotations

import json
import os
import sys
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .verify import CHECKS, TreeRound, pad_keys_default

__all__ = [
    "CostFit",
    "fit_curve",
    "time_verify",
    "time_draft",
    "build_from_config",
    "load_config",
    "draft_plan",
    "round_cost",
    "time_plain",
    "startup_costs",
    "cost_cache_dir",
    "VERIFY_TS",
    "DRAFT_LANES",
]

VERIFY_TS = (1, 2, 4, 8, 16, 32, 64)
DRAFT_LANES = (1, 2, 4, 8, 16)


@dataclass
class CostFit:
    """ms as a function of T: t1 at T = 1; a + b*T (kind 'linear') or interpolation ('interp')."""

    points: Dict[int, float]
    t1: float
    a: float
    b: float
    kind: str  # 'linear' or 'interp'
    linear_max_rel_err: float  # the a + b*T line's worst miss over the measured points
    max_rel_err: float  # the model in use's worst miss over the measured points

    def __call__(self, T):
        return float(self.at(np.array([T], float))[0])

    def at(self, Ts):
        """ms at each T of an array (`__call__`'s rule, one numpy pass: an adaptive drafter
        tables every node count each time its fit is repriced)."""
        Ts = np.asarray(Ts, float)
        if self.kind == "linear":
            ms = self.a + self.b * Ts
        else:
            xs = np.array(sorted(self.points), float)
            ys = np.array([self.points[int(x)] for x in xs])
            # past the last point: the last segment's slope (or the line's), never falling
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else self.b
            ms = np.where(Ts >= xs[-1], ys[-1] + max(slope, 0.0) * (Ts - xs[-1]), np.interp(Ts, xs, ys))
        return np.where(Ts <= 1, self.t1, ms)

    def describe(self):
        line = f"t(1)={self.t1:.3f} ms, t(T)={self.a:.3f}+{self.b:.4f}*T ms for T>=2"
        if self.kind == "linear":
            return f"{line} (max rel err {100 * self.linear_max_rel_err:.1f}%)"
        return (f"{line} misses by up to {100 * self.linear_max_rel_err:.1f}%: "
                "interpolating the measured points instead")

    def to_dict(self):
        d = asdict(self)
        d["points"] = {str(k): v for k, v in sorted(self.points.items())}
        return d

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        d["points"] = {int(k): float(v) for k, v in d["points"].items()}
        return cls(**d)


def fit_curve(points, tol=0.10):
    """Fit t(1) and a + b*T (T >= 2) to {T: ms}; fall back to interpolation past `tol`."""
    points = {int(k): float(v) for k, v in points.items()}
    if not points:
        raise ValueError("no cost points to fit")
    Ts = sorted(points)
    t1 = points.get(1, points[Ts[0]])
    big = [T for T in Ts if T >= 2]
    if len(big) >= 2:
        b, a = np.polyfit(np.array(big, float), np.array([points[T] for T in big]), 1)
    elif big:
        a, b = points[big[0]], 0.0
    else:
        a, b = t1, 0.0
    a, b = float(a), float(b)

    def rel(pred, T):
        return abs(pred - points[T]) / max(points[T], 1e-9)

    lin_err = max([rel(a + b * T, T) for T in big] + [0.0])
    kind = "linear" if lin_err <= tol else "interp"
    return CostFit(points=points, t1=t1, a=a, b=b, kind=kind, linear_max_rel_err=lin_err,
                   max_rel_err=lin_err if kind == "linear" else 0.0)


def _prefilled(model, history, seed):
    vocab = int(model(mx.array([[0]]))[0, -1].shape[-1])
    rng = np.random.default_rng(seed)
    caches = make_prompt_cache(model)
    if history > 0:
        model(mx.array(rng.integers(0, vocab, history).tolist())[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches, vocab, rng


def _time_rows(model, caches, tokens, parents, repeats, warmup):
    times = []
    for r in range(warmup + repeats):
        rnd = TreeRound(model, caches, compiled=True)
        t0 = time.perf_counter()
        logits = rnd.forward(tokens, parents)
        mx.eval(logits)
        t1 = time.perf_counter()
        rnd.abort()  # drop the round: the cache is back to its prefilled state
        mx.eval([c.state for c in caches])
        if r >= warmup:
            times.append(1e3 * (t1 - t0))
    return statistics.median(times)


def _time_shapes(model, sizes, parents_of, history, repeats, warmup):
    caches, vocab, rng = _prefilled(model, history, 0)
    return {int(n): _time_rows(model, caches, mx.array(rng.integers(0, vocab, n).astype(np.uint32)),
                               parents_of(n), repeats, warmup) for n in sizes}


def time_verify(model, Ts: Sequence[int] = VERIFY_TS, history=256, repeats=5, warmup=2):
    """Median ms of a TreeRound forward of a chain of T nodes over `history` committed tokens."""
    return _time_shapes(model, Ts, lambda T: np.arange(T) - 1, history, repeats, warmup)


def time_draft(model, lanes: Sequence[int] = DRAFT_LANES, history=256, repeats=5, warmup=2):
    """Median ms of one draft step of `lanes` sibling nodes (a one-token step when lanes == 1)."""
    return _time_shapes(model, lanes, lambda L: np.full(L, -1), history, repeats, warmup)


# ---------------------------------------------------------------------------- models from configs


def load_config(path):
    cfg = json.loads(Path(path).read_text())
    if "model_type" not in cfg:
        raise ValueError(f"{path}: an mlx-lm config needs a model_type")
    return cfg


_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def build_from_config(cfg, dtype="bfloat16", q_bits=None, q_group_size=64, seed=0):
    """An mlx-lm model with random weights from a config dict (nothing is downloaded).

    Weights are materialized a few at a time in `dtype`, then quantized to `q_bits` (4, 8...)
    with nn.quantize when asked. Only for timing: the output is noise.
    """
    from mlx_lm.utils import _get_classes

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(_DTYPES[dtype])
    # evaluate in slices so the float32 initial values never all exist at once
    batch, size = [], 0
    for _, p in tree_flatten(model.parameters()):
        batch.append(p)
        size += p.size
        if size > 1 << 27:
            mx.eval(batch)
            batch, size = [], 0
    mx.eval(batch)
    object.__setattr__(model, "_treespec_n_params", n_params(model))  # before packing
    if q_bits:
        nn.quantize(model, group_size=q_group_size, bits=int(q_bits))
        mx.eval(model.parameters())
    model.eval()
    return model


def n_params(model):
    """Parameter count (of the unquantized model, for models from `build_from_config`)."""
    n = getattr(model, "_treespec_n_params", None)
    return n if n is not None else int(sum(p.size for _, p in tree_flatten(model.parameters())))


# ---------------------------------------------------------------------------- projections


def draft_plan(kind, depth=0, topk=1):
    """Drafter forwards of one round as [(rows, count)] for the model drafter (`topk`: the
    lanes expanded per step).

    A model-drafted round first forwards the tokens the draft cache lacks (the last round's
    bonus token, plus its deepest accepted draft when the whole draft was accepted: one row
    mostly), which yields the first draft step, then depth - 1 steps of `topk` lanes (one lane
    for a chain). Plain decoding and model-free drafters forward nothing on a draft model.
    """
    if kind not in ("chain", "tree") or depth < 1:
        return []
    lanes = 1 if kind == "chain" else topk
    plan = [(1, 1)]
    if depth > 1:
        plan.append((lanes, depth - 1))
    return plan


def round_cost(plan, nodes, verify_fit, draft_fit=None, overhead_ms=0.0):
    """(draft ms, verify ms, round ms) of one round from the fitted curves."""
    draft = sum(n * draft_fit(rows) for rows, n in plan) if plan and draft_fit is not None else 0.0
    verify = verify_fit(nodes)
    return draft, verify, draft + verify + overhead_ms


# ---------------------------------------------------------------------------- start-up costs


def time_plain(model, history=256, tokens=24, seed=0, own=False):
    """ms per token of pipelined plain decoding after `history` prompt tokens (a short run
    first warms up): mlx-lm's generate_step, or (`own`) this library's, the loop a plain
    stretch of adaptive drafting runs."""
    from mlx_lm.generate import generate_step

    from .loop import tree_generate_step

    vocab = int(model(mx.array([[0]]))[0, -1].shape[-1])
    prompt = mx.array(np.random.default_rng(seed).integers(0, vocab, history + 1).tolist())
    for n in (8, tokens):
        t_first = None
        steps = tree_generate_step(prompt, model, None, max_tokens=n) if own else \
            generate_step(prompt, model, max_tokens=n)
        for _ in steps:
            if t_first is None:
                t_first = time.perf_counter()
    return 1e3 * (time.perf_counter() - t_first) / (tokens - 1)


COSTS_FORMAT = 3  # what a kept fit measured (2: the compiled verify where it applies, our plain loop; 3: the tree-attention kernel from attention.MIN_WIDTH keys)


def _cost_key(model):
    """What a cost fit depends on: the target's shape and dtypes, the device, MLX's version."""
    import hashlib

    args = getattr(model, "args", None)
    cfg = {k: v for k, v in sorted(vars(args).items())} if args is not None else {}
    dtypes = sorted({str(p.dtype) for _, p in tree_flatten(model.parameters())})
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    text = json.dumps([COSTS_FORMAT, type(model).__module__, cfg, dtypes, n_params(model), str(mx.default_device()),
                       info.get("device_name", info.get("architecture", "")), mx.__version__],
                      default=str, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cost_cache_dir():
    """Where start-up cost fits are kept: $MLX_TREESPEC_CACHE, else ~/.cache/mlx_treespec."""
    return Path(os.environ.get("MLX_TREESPEC_CACHE") or Path.home() / ".cache" / "mlx_treespec") / "costs"


SHORT_HISTORY = 256  # the start-up fit's context (time_verify's and time_plain's default)
LONG_HISTORY, LONG_FROM = 8192, 2048  # the second fit's context; contexts that use it


def startup_costs(model):
    """(plain ms per token, verify CostFit over T nodes) of this target on this device over
    `SHORT_HISTORY` rows: measured once (a few dozen forwards) and kept on disk per model
    shape, device and MLX version."""
    return _fits(model, _cost_key(model), SHORT_HISTORY)


_FITS = {}  # (cost key, history) -> (plain ms, CostFit): what this process read or measured


def _fits(model, key, history):
    """The fit over `history` rows: this process's, else the kept file's, else measured and kept
    (a home that cannot be written measures once per process)."""
    if (key, history) in _FITS:
        return _FITS[(key, history)]
    path = cost_cache_dir() / f"{key}.json"
    try:
        d = json.loads(path.read_text())
        entry = d if history == SHORT_HISTORY else d["long"]
        if history != SHORT_HISTORY and entry["history"] != history:
            raise ValueError(f"kept over {entry['history']} rows")
        got = float(entry["plain_ms"]), CostFit.from_dict(entry["verify"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        try:
            d = json.loads(path.read_text())
            d = d if isinstance(d, dict) else {}
        except (OSError, ValueError):
            d = {}
        # (once per target shape, device and MLX version: tens of seconds, minutes on a slow CPU)
        print(f"mlx_treespec: timing this target's verify once, for adaptive drafting (kept in {path})",
              file=sys.stderr, flush=True)
        # (the verify's timed checks, then its compiled forwards: a GPU's path; a CPU's verify
        # is eager, warm after one forward a shape)
        warm = CHECKS if pad_keys_default() else 1
        verify = fit_curve(time_verify(model, VERIFY_TS, history=history, repeats=3, warmup=warm))
        got = time_plain(model, history=history, own=True), verify
        entry = {"plain_ms": got[0], "verify": verify.to_dict()}
        if history == SHORT_HISTORY:
            d.update(entry)
        else:
            d["long"] = {"history": history, **entry}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # (processes may write one file at once)
            tmp.write_text(json.dumps(d))
            tmp.replace(path)
        except OSError:  # a read-only home: measured again by the next process
            pass
    _FITS[(key, history)] = got
    return got


_AT = {}  # (cost key, LONG_HISTORY, context) -> costs_at's answer, for this process


def costs_at(model, context):
    """(plain ms per token, verify CostFit over T nodes) at a context of `context` rows: the
    start-up fit below `LONG_FROM`; from there on, each figure interpolated linearly in the
    context between the start-up fit (`SHORT_HISTORY` rows) and one over `LONG_HISTORY` rows,
    extrapolated past it, never below the start-up fit. The long fit is measured once, the
    first time it is asked for, and kept beside the start-up fit."""
    key = _cost_key(model)
    plain0, fit0 = _fits(model, key, SHORT_HISTORY)
    if context < LONG_FROM:
        return plain0, fit0
    at_key = (key, LONG_HISTORY, int(context))
    if at_key not in _AT:
        plain1, fit1 = _fits(model, key, LONG_HISTORY)
        f = (context - SHORT_HISTORY) / (LONG_HISTORY - SHORT_HISTORY)

        def at(a, b):
            return max(a + (b - a) * f, a)

        if len(_AT) >= 256:
            _AT.clear()
        _AT[at_key] = at(plain0, plain1), fit_curve({T: at(fit0(T), fit1(T)) for T in VERIFY_TS})
    return _AT[at_key]
