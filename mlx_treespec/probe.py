"""Exactness probe: does a tree verify give the logits one-token decoding gives?

On CPU a tree verify is bit-exact (tests/test_generate.py pins it). On a GPU the T-row forward
may take other kernels than the one-token forward (GEMM vs GEMV, other reduction orders), so the
logits can differ in the last bits and, rarely, flip an argmax: greedy speculation would then no
longer reproduce plain greedy decoding token for token. The probe measures this on the model, the
device and the dtype actually in use:

- prefill a history (random or given) with mlx-lm's caches;
- for each topology, run one T-row verify (`TreeRound.forward`) from a copy of that state, and,
  from other copies, one-token decoding along every node's root path (each node is decoded once,
  from a copy of the cache after its parent);
- compare, per node, the argmax (with a sampler at temp > 0: the draw at the node's position,
  which a near-tie flips more often) and the largest absolute logit difference; repeat on
  `n_inputs` random inputs.

`check_speculation` turns the report into a start-up check: it raises `InexactError` when any
argmax flips (unless allowed).
"""
from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .builders import Eagle2Builder
from .tree import MAX_NODES, chain_parents, check_draft_parents, depths_of
from .verify import TreeRound

__all__ = [
    "ProbeReport",
    "TopologyProbe",
    "InexactError",
    "probe_exactness",
    "check_speculation",
    "representative_tree_parents",
    "clear_memo",
    "device_name",
    "weights_dtype",
]


class InexactError(ValueError):
    """A tree verify's argmax differs from one-token decoding on this model/device/dtype."""


@dataclass
class TopologyProbe:
    """Probe figures of one topology over all inputs."""

    parents: Tuple[int, ...]
    nodes: int  # nodes per verify (root included)
    depth: int
    n_inputs: int
    checked: int  # nodes compared in all (nodes x n_inputs)
    flips: int  # nodes whose argmax (sampled: draw) differs
    max_abs_diff: float  # max |verify logit - one-token logit| over all nodes and inputs
    exact: bool  # flips == 0 and (on CPU) max_abs_diff == 0
    per_input: List[Dict[str, float]] = field(default_factory=list)
    cached: bool = False  # True when this entry came from the memo
    kind: str = "argmax"  # what a flip is: "argmax", or "draw" (a sampler's, at temp > 0)

    @property
    def shape(self):
        return "chain" if all(p == i - 1 for i, p in enumerate(self.parents)) else "tree"

    def to_dict(self):
        d = asdict(self)
        d["parents"] = list(self.parents)
        d["shape"] = self.shape
        return d

    def describe(self, device):
        s = "" if self.flips == 1 else "s"
        return (f"verify of {self.nodes} nodes differs from one-token decoding on {device}: "
                f"{self.flips} {self.kind} flip{s} in {self.checked} nodes, "
                f"max |dlogit| {self.max_abs_diff:.3g}")


@dataclass
class ProbeReport:
    device: str
    dtype: str
    n_inputs: int
    history: int
    topologies: List[TopologyProbe]

    @property
    def flips(self):
        return sum(t.flips for t in self.topologies)

    @property
    def checked(self):
        return sum(t.checked for t in self.topologies)

    @property
    def max_abs_diff(self):
        return max((t.max_abs_diff for t in self.topologies), default=0.0)

    @property
    def exact(self):
        return all(t.exact for t in self.topologies)

    def worst(self):
        """The topology to blame: the most flips, then the most nodes, then the largest diff."""
        return max(self.topologies, key=lambda t: (t.flips, t.nodes, t.max_abs_diff), default=None)

    def message(self):
        """One line with the figures of the worst topology (and a count of the others)."""
        bad = [t for t in self.topologies if t.flips]
        kind = self.topologies[0].kind if self.topologies else "argmax"
        if not bad:
            w = self.worst()
            if w is None:
                return "no topology probed"
            if not self.exact:  # on CPU a verify must be bitwise: a difference with no flip yet
                return (f"verify is not bitwise one-token decoding on {self.device} ({self.dtype}): max "
                        f"|dlogit| {self.max_abs_diff:.3g} (0 {kind} flips in {self.checked} nodes; a near-tie "
                        "would flip)")
            return (f"verify matches one-token decoding on {self.device} ({self.dtype}): "
                    f"0 {kind} flips in {self.checked} nodes, max |dlogit| {self.max_abs_diff:.3g}")
        w = self.worst()
        msg = w.describe(self.device)
        if len(bad) > 1:
            msg += f" ({len(bad) - 1} other topolog{'y' if len(bad) == 2 else 'ies'} flip too)"
        return msg

    def to_dict(self):
        return dict(device=self.device, dtype=self.dtype, n_inputs=self.n_inputs,
                    history=self.history, exact=self.exact, flips=self.flips,
                    checked=self.checked, max_abs_diff=self.max_abs_diff,
                    topologies=[t.to_dict() for t in self.topologies])


# ---------------------------------------------------------------------------- topologies


def with_root_chain(parents, m):
    """`parents` with a chain of up to `m` more nodes hung from the root (a prompt-lookup
    chain beside a drafter's tree), cut to `MAX_NODES`."""
    parents = np.asarray(parents)
    m = max(min(m, MAX_NODES - len(parents)), 0)
    chain = np.arange(m, dtype=parents.dtype) + len(parents) - 1
    chain[:1] = 0
    return np.concatenate([parents, chain])


def representative_tree_parents(topk, depth, budget, decay=0.6):
    """The EAGLE-2 tree a drafter with geometric top-K probabilities would build.

    Rank r of every expansion gets log-probability log((1 - decay) * decay**r): the shape
    (how many nodes each depth gets) is that of a fairly confident drafter. Used to probe a
    tree arm's shape when no drafted tree is at hand.
    """
    if depth < 1 or budget < 1:
        return chain_parents(1)
    lps = np.log((1 - decay) * decay ** np.arange(topk))
    builder = Eagle2Builder(0, topk, min(budget, MAX_NODES - 1))
    lanes = builder.add_step(np.arange(topk)[None], lps[None])
    for _ in range(1, depth):
        n = len(lanes)
        lanes = builder.add_step(np.tile(np.arange(topk), (n, 1)), np.tile(lps, (n, 1)))
    return builder.build()[0].parents.astype(np.int32)


def _as_parents(topology):
    return check_draft_parents(topology.parents if hasattr(topology, "parents") else topology)


# ---------------------------------------------------------------------------- keys


def device_name(device=None):
    d = device if device is not None else mx.default_device()
    return str(d.type).split(".")[-1]


def weights_dtype(model):
    """The dtypes of the model's weights ('float32', 'bfloat16', 'uint32+float16' when quantized)."""
    names = sorted({str(v.dtype).split(".")[-1] for _, v in tree_flatten(model.parameters())})
    return "+".join(names) or "none"


# (id(model), device, dtype, topology bytes, n_inputs, history, seed)
#   -> (weakref to the model, TopologyProbe)
_MEMO: Dict[tuple, tuple] = {}


def clear_memo():
    _MEMO.clear()


def _vocab_size(model):
    return int(model(mx.array([[0]]))[0, -1].shape[-1])


def _decode_tree(model, committed, tokens, parents):
    """One-token decoding of every node from a copy of the cache after its parent."""
    n = len(parents)
    has_children = np.zeros(n, bool)
    has_children[parents[parents >= 0]] = True
    after = {}
    out = []
    for i in range(n):
        p = int(parents[i])
        c = copy.deepcopy(committed if p < 0 else after[p])
        logits = model(mx.array([[int(tokens[i])]]), cache=c)[0, -1]
        mx.eval(logits, [x.state for x in c])
        out.append(logits)
        if has_children[i]:
            after[i] = c
        # a parent's copy is needed until its last child ran
        if p >= 0 and not (parents[i + 1:] == p).any():
            after.pop(p, None)
    return mx.stack(out)


def _compare(verify, ref, sampler=None, positions=None):
    v = verify.astype(mx.float32)
    r = ref.astype(mx.float32)
    if sampler is None:
        flips = int(mx.sum(mx.argmax(v, axis=-1) != mx.argmax(r, axis=-1)).item())
    else:  # the draws from the model's own logits (the sampler casts them as decoding does)
        flips = int(mx.sum(sampler(verify, positions) != sampler(ref, positions)).item())
    diff = mx.abs(v - r)
    # NaN anywhere is a difference too
    bad = mx.isnan(v) != mx.isnan(r)
    d = float(mx.max(mx.where(mx.isnan(diff), mx.array(0.0), diff)).item())
    if bool(mx.any(bad).item()):
        d = float("inf")
    return flips, d


def probe_exactness(model, tree_parents_list, n_inputs=3, history=32, seed=0,
                    perturb: Optional[Callable] = None, memo=True, sampler=None) -> ProbeReport:
    """Compare one T-row tree verify with one-token decoding along each node's root path.

    tree_parents_list: parents arrays (or DraftTrees), one per topology, e.g. a chain and the
    configured tree. history: length of the random prompt prefilled first. perturb: test-only
    hook applied to the verify logits [T, V] before the comparison (never memoized). sampler:
    a sampled `sampling.make_node_sampler` (temp > 0): a flip is a node whose draw at its
    position differs (None, or a greedy one: its argmax). Returns a ProbeReport with one entry
    per topology.
    """
    sampler = None if sampler is None or sampler.greedy else sampler
    if n_inputs < 1:
        raise ValueError(f"n_inputs must be >= 1, got {n_inputs}")
    topologies = [_as_parents(t) for t in tree_parents_list]
    device = device_name()
    dtype = weights_dtype(model)
    if history < 1:
        raise ValueError(f"history must be >= 1, got {history}")

    draws = None if sampler is None else (id(sampler.scores), int(sampler.seed.item()))

    def key(parents):
        return (id(model), device, dtype, parents.astype(np.int64).tobytes(), n_inputs, history,
                seed, draws)

    results: List[Optional[TopologyProbe]] = [None] * len(topologies)
    todo = []
    for j, parents in enumerate(topologies):
        hit = _MEMO.get(key(parents)) if (memo and perturb is None) else None
        if hit is not None and hit[0]() is model:
            results[j] = hit[1]
        else:
            todo.append(j)

    if todo:
        vocab = _vocab_size(model)
        acc = {j: dict(flips=0, diff=0.0, per_input=[]) for j in todo}
        for i in range(n_inputs):
            rng = np.random.default_rng([seed, i])
            hist = rng.integers(0, vocab, history).tolist()
            committed = make_prompt_cache(model)
            if len(hist) > 1:
                model(mx.array(hist[:-1])[None], cache=committed)
                mx.eval([c.state for c in committed])
            root = hist[-1]
            for j in todo:
                parents = topologies[j]
                n = len(parents)
                # the same node tokens for a topology whatever else is probed alongside
                trng = np.random.default_rng([seed, i, 1])
                tokens = np.concatenate([[root], trng.integers(0, vocab, MAX_NODES - 1)])[:n]
                caches = copy.deepcopy(committed)
                logits = TreeRound(model, caches, compiled=True).forward(mx.array(tokens.astype(np.uint32)), parents)
                if perturb is not None:
                    logits = perturb(logits)
                mx.eval(logits)
                ref = _decode_tree(model, committed, tokens, parents)
                positions = mx.array((history - 1 + depths_of(parents)).astype(np.int32))  # (the root's: history - 1)
                flips, diff = _compare(logits, ref, sampler, positions)
                a = acc[j]
                a["flips"] += flips
                a["diff"] = max(a["diff"], diff)
                a["per_input"].append(dict(flips=flips, max_abs_diff=diff))
                del caches
        for j in todo:
            parents = topologies[j]
            a = acc[j]
            depth = int(depths_of(parents).max())
            exact = a["flips"] == 0 and (device != "cpu" or a["diff"] == 0.0)
            tp = TopologyProbe(parents=tuple(int(p) for p in parents), nodes=len(parents),
                               depth=depth, n_inputs=n_inputs, checked=len(parents) * n_inputs,
                               flips=a["flips"], max_abs_diff=a["diff"], exact=exact,
                               per_input=a["per_input"], kind="argmax" if sampler is None else "draw")
            results[j] = tp
            if memo and perturb is None:
                cached = copy.copy(tp)
                cached.cached = True
                _MEMO[key(parents)] = (weakref.ref(model), cached)

    return ProbeReport(device=device, dtype=dtype, n_inputs=n_inputs, history=history,
                       topologies=list(results))


def check_speculation(model, topologies, allow_inexact=False, **probe_kwargs) -> ProbeReport:
    """Probe `topologies` on `model`; raise InexactError when any argmax (sampled: draw) flips.

    With `allow_inexact`, a flip only warns. Returns the ProbeReport.
    """
    report = probe_exactness(model, topologies, **probe_kwargs)
    if report.flips:
        msg = report.message()
        if not allow_inexact:
            raise InexactError(msg + "; pass --allow-inexact to speculate anyway")
        warnings.warn(msg + "; speculating anyway (--allow-inexact)", RuntimeWarning, stacklevel=2)
    return report
