"""A head's static tree: the rank paths its target accepts most often, fitted once, drafted the
same way every round (EAGLE-1's and Medusa's static trees, fitted from the ranks the target's
own tokens take among the head's candidates, as Sequoia fits its trees).

A node is a rank path (r1, ..., rd): the root's r1-th best child, then that node's r2-th best
child, and so on; all zeros is the head's chain. A round drafts the tree depth by depth: step
s forwards every node of depth s that has children, all in one forward of `width` rows, and
their children are the ranks the tree names among each row's best tokens. Nothing is ranked on
the device, no candidate is dropped, and the layout is the same every round. Where a head's
best candidates beyond its chain are worth a node, they get one, and a lane of their own where
their own continuations are (bench/RESULTS.md, "Static trees").

The file: `static_tree.json` in the head's folder, {"paths": [[0], [1], [0, 0], ...]}: the paths
in the order they were fitted (the most often accepted first, a path after its parent), so the
first N of them are a tree of N nodes (`--tree-static N`). `fit_static_tree` writes it.
"""
import collections
import functools
import json
import os

import numpy as np
import mlx.core as mx

from .tree import MAX_NODES, check_int

__all__ = ["StaticTree", "load_static_paths", "save_static_paths", "fit_static_tree", "head_ranks",
           "rank_rounds", "best_rank_tree", "FILE"]

FILE = "static_tree.json"
MAX_RANK = 8  # a path's ranks are 0..MAX_RANK - 1: past that, a head's candidate is seldom the target's


class StaticTree:
    """The first `n` of a fitted tree's `paths` as a draft layout.

    Nodes: 0 the root, then the paths by depth, then by ranks (a parent before its children).
    `parents`, `ranks` (each node's rank among its parent's children), `depth`, `topk` (the
    largest rank + 1). The drafting plan: `rows[s]` the nodes step s forwards (step 0: the root;
    later steps `width` rows, -1 where a row is padding, real rows first), `row_of[n]` the row
    node n is forwarded in (-1: a leaf), `inputs[s - 1]` step s's rows' (parent row, rank)
    among the last step's candidates, and `source[n - 1]` where node n's token is among the steps'
    ranked candidates stacked ([1 + (depth - 1) * width, topk]: step 0's row, then each later
    step's `width`): (row, rank)."""

    def __init__(self, paths, n=None):
        paths = [tuple(int(r) for r in p) for p in paths]
        n = len(paths) if n is None else n
        if not 1 <= n <= min(len(paths), MAX_NODES - 1):
            raise ValueError(f"a static tree of {n} nodes: this one has {len(paths)} paths, and a round "
                             f"verifies at most {MAX_NODES - 1} draft nodes")
        paths = paths[:n]
        known = set()
        for p in paths:
            if not p or min(p) < 0 or max(p) >= MAX_RANK:
                raise ValueError(f"static tree path {list(p)}: ranks are 0..{MAX_RANK - 1}, at least one")
            if p in known or (len(p) > 1 and p[:-1] not in known):
                raise ValueError(f"static tree path {list(p)} repeats or comes before its parent "
                                 f"{list(p[:-1])}: the paths must list a parent before its children, once")
            known.add(p)
        self.paths = tuple(sorted(paths, key=lambda p: (len(p), p)))
        node = {p: i + 1 for i, p in enumerate(self.paths)}
        node[()] = 0
        self.size = n
        self.parents = np.array([-1] + [node[p[:-1]] for p in self.paths], np.int64)
        self.ranks = np.array([0] + [p[-1] for p in self.paths], np.int64)
        self.depths = np.array([0] + [len(p) for p in self.paths], np.int64)
        self.depth = int(self.depths.max())
        self.topk = int(self.ranks.max()) + 1
        expanded = sorted(set(int(p) for p in self.parents[1:]))
        by_depth = [[e for e in expanded if self.depths[e] == s] for s in range(self.depth)]
        self.width = max(len(r) for r in by_depth[1:]) if self.depth > 1 else 1
        self.row_of = np.full(n + 1, -1, np.int64)
        self.rows = []
        for s, nodes in enumerate(by_depth):
            self.row_of[nodes] = np.arange(len(nodes))
            self.rows.append(np.array(nodes + [-1] * ((1 if s == 0 else self.width) - len(nodes)), np.int64))
        # step s's rows (s >= 1): the row of each one's parent among the last step's candidates
        # and its rank there (padding: 0, 0), as mx int32 [width] each, made once
        self.inputs = []
        for s in range(1, self.depth):
            nodes = self.rows[s]
            real = nodes >= 0
            node = np.maximum(nodes, 0)
            self.inputs.append(tuple(mx.array(np.where(real, a, 0).astype(np.int32))
                                     for a in (self.row_of[self.parents[node]], self.ranks[node])))
        first_row = [0] + [1 + (s - 1) * self.width for s in range(1, self.depth)]
        self.source = np.array([(first_row[self.depths[q]] + self.row_of[q], r)
                                for q, r in zip(self.parents[1:], self.ranks[1:])], np.int64).reshape(-1, 2)
        self.token_source = tuple(mx.array(a.astype(np.int32)) for a in self.source.T)  # (rows, ranks), made once

    def within(self, depth):
        """The nodes at most `depth` deep, as a tree of their own (a round near max_tokens)."""
        return _within(self, depth)

    def visible_rows(self):
        """For each step s >= 1, which step rows each of its rows sees: its ancestors' and its
        own (bool [depth - 1, width, (depth - 1) * width]; a padding row sees itself)."""
        S, W = self.depth, self.width
        seen = np.zeros((max(S - 1, 1), W, max(S - 1, 1) * W), bool)
        for s in range(1, S):
            for i, n in enumerate(self.rows[s]):
                seen[s - 1, i, (s - 1) * W + i] = True
                q = int(self.parents[n]) if n >= 0 else 0
                while q > 0:
                    d = int(self.depths[q])
                    seen[s - 1, i, (d - 1) * W + self.row_of[q]] = True
                    q = int(self.parents[q])
        return seen


@functools.lru_cache(maxsize=64)
def _within(tree, depth):
    return StaticTree([p for p in tree.paths if len(p) <= depth])


@functools.lru_cache(maxsize=64)
def _first(paths, n):
    return StaticTree(paths, n)


def static_tree(paths, n):
    """The first `n` of `paths` (a tuple of tuples) as a StaticTree, made once per (paths, n)."""
    return _first(tuple(tuple(p) for p in paths), n)


def ranked_top(logits, k):
    """Each row's k best tokens, best first (logits [R, V] -> uint32 [R, k]): the ranks a static
    tree names (equal logits: either order). One sort of the row, read backwards (a view): MLX
    partitions by sorting too, and a negation or a cast would be a kernel of its own a step."""
    return mx.argsort(logits, axis=-1)[:, ::-1][:, :k]


# ---------------------------------------------------------------------------- the file


def load_static_paths(folder):
    """The fitted paths in a head folder's static_tree.json, or None where it has none."""
    path = os.path.join(str(folder), FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            paths = json.load(f)["paths"]
        paths = tuple(tuple(check_int(r, "a static tree rank", 0, MAX_RANK - 1) for r in p) for p in paths)
        StaticTree(paths)  # checks the order
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a static tree ({e}): fit it again (mlx_treespec.static_tree."
                         "fit_static_tree) or delete it") from None
    return paths


def save_static_paths(folder, paths, meta=None):
    StaticTree(paths)
    with open(os.path.join(str(folder), FILE), "w") as f:
        json.dump(dict(paths=[list(p) for p in paths], **(meta or {})), f, indent=None)
        f.write("\n")


# ---------------------------------------------------------------------------- fitting


def head_ranks(target, head, prompt, max_tokens, depth, cap=MAX_RANK):
    """Per position of the target's greedy continuation of `prompt` (a round may start at any):
    the rank of the target's next token at each of `depth` head steps drafted along the target's
    own tokens (each step over its parent's output hidden, as a chain that matched so far),
    capped at `cap`."""
    from mlx_lm.generate import generate_step
    from .verify import capturing

    s = list(prompt) + [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=max_tokens)]
    with capturing(target, head.capture) as cap_:
        target(mx.array(s)[None])
        rows = cap_.hidden()
    mtp = getattr(head, "target_hidden", None)
    rows = mtp(rows) if mtp is not None else rows
    flag = (lambda first: {}) if mtp is not None else (lambda first: dict(first=first))
    cache = head.make_cache()
    logits = head(mx.array(s[1:])[None], cache=cache, hidden=rows[:-1][None], **flag(True))[0]
    hidden, K, V = head.out_hidden[0], cache[0].keys, cache[0].values  # slot t predicts s[t + 2]
    out = []
    for t in range(max(len(prompt) - 2, 0), len(s) - depth - 1):  # (depth `depth` reads s[t + 1 + depth])
        c = head.make_cache()[0]
        c.keys, c.values, c.offset = K[:, :, : t + 1], V[:, :, : t + 1], t + 1
        lg, h, ranks = logits[t], hidden[t : t + 1], []
        for d in range(1, depth + 1):
            true = s[t + 1 + d]
            ranks.append(min(int(mx.sum(lg > lg[true]).item()), cap))
            if d < depth:
                lg = head(mx.array([[true]]), cache=[c], hidden=h[None], **flag(False))[0, 0]
                h = head.out_hidden[0]
        out.append(tuple(ranks))
    return out


def rank_rounds(per_prompt, tree):
    """Rounds as the loop runs them over each prompt's rank sequences (`head_ranks`), drafting the
    tree (a set of rank paths: the chain is {(0,), (0, 0), ...}): each round accepts its longest
    path in the tree and the next starts after the tokens it emitted. -> (emitted per verify,
    the rank sequences the rounds started at)."""
    emitted, starts = 0, []
    for seqs in per_prompt:
        t = 0
        while t < len(seqs):
            r, a = seqs[t], 0
            while a < len(r) and r[: a + 1] in tree:
                a += 1
            starts.append(r)
            emitted += a + 1
            t += a + 1
    return emitted / max(len(starts), 1), starts


def best_rank_tree(starts, n, cap=MAX_RANK):
    """The n rank paths most often accepted at these round starts, a parent before its
    children, in the order taken (a child is never accepted more often than its parent; ties go
    to the shallower, then lower ranks)."""
    count = collections.Counter(r[:d] for r in starts for d in range(1, len(r) + 1) if r[d - 1] < cap)
    tree = []
    taken = set()
    for k in sorted(count, key=lambda k: (-count[k], len(k), k)):
        if len(tree) == n:
            break
        if all(k[:d] in taken for d in range(1, len(k))):
            tree.append(k)
            taken.add(k)
    return tree


def _filled(paths, n, depth):
    """`paths`, then (where the text accepted fewer than n distinct paths) the chain's, then the
    chain's runners-up by rank and depth, up to n: a fit always gives the tree asked for."""
    out, taken = list(paths), set(paths)
    spare = [(0,) * d for d in range(1, depth + 1)] + \
        [(0,) * d + (r,) for r in range(1, MAX_RANK) for d in range(depth)]
    for p in spare:
        if len(out) >= n:
            break
        if p not in taken and (len(p) == 1 or p[:-1] in taken):
            out.append(p)
            taken.add(p)
    return out


def fit_static_tree(target, head, prompts, nodes=48, depth=14, max_tokens=128, refits=3):
    """The static tree of `nodes` rank paths a head's target accepts most often on `prompts`
    (token lists; text like what it will draft for, not the text it is measured on), fitted as
    the loop runs: the head's ranks of the target's greedy tokens (`head_ranks`), then the
    paths most often accepted at the rounds' starts, refit to the starts that tree's own
    rounds reach. Returns (paths in the order taken, emitted per verify in the fit's rounds,
    the chain of `depth`'s)."""
    nodes = check_int(nodes, "nodes", 1, MAX_NODES - 1)
    per_prompt = [head_ranks(target, head, p, max_tokens, depth) for p in prompts]
    chain, starts = rank_rounds(per_prompt, {(0,) * d for d in range(1, depth + 1)})
    best, best_paths = -1.0, None
    for _ in range(refits):
        paths = _filled(best_rank_tree(starts, nodes), nodes, depth)
        emitted, starts = rank_rounds(per_prompt, set(paths))
        if emitted > best:
            best, best_paths = emitted, paths
    return best_paths, best, chain
