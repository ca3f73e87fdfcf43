"""The draft tree: an immutable, validated, numpy-backed token tree.

Node 0 is the root: the last emitted token, which the target has not yet
seen (it is not in the KV cache). Every other node is a draft token. Nodes are
numbered so that a parent always comes before its children
(``0 <= parents[i] < i``); every algorithm here relies on that to compute in a
single forward pass, and it rules out cycles without a graph search.

"budget" everywhere in the library counts draft nodes, excluding the root.

The module also holds the library's only host topology helpers (`check_parents`, `depths_of`,
`ancestors_of`, `root_path`, `chain_parents`): they take *round parents*, where -1 means "child
of the committed history" and may occur more than once (a forward of held tokens and a tree, a
GatedDeltaNet forest); a draft tree is the case with one -1, at node 0.
"""

from __future__ import annotations

import numpy as np

# The most nodes a round verifies, root included: DDTree's best-first trees kept gaining past 64
# nodes where a verify's rows cost little (bench/RESULTS.md at e45f48f, "DDTree past 64 nodes").
MAX_NODES = 256

_INT64_MAX = np.iinfo(np.int64).max


def _as_1d(values, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-D sequence (one entry per node), got shape "
            f"{array.shape}; flatten it or pass one tree at a time"
        )
    return array


def as_int_array(values, name: str, dtype=np.int64) -> np.ndarray:
    """Convert an integer sequence without silently accepting floats or bools.

    A float token id is almost always a bug upstream (logits passed instead of
    argmax, a mean taken somewhere); truncating it would hide that bug.
    """
    array = np.asarray(values)
    if array.size == 0 and array.dtype.kind in "iuf":
        return array.astype(dtype)  # np.asarray([]) is float64; nothing to misread
    if array.dtype.kind == "b":
        raise ValueError(
            f"{name} must hold integers, got booleans; convert with .astype(np.int64) "
            "only if the bools really are ids"
        )
    if array.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must hold integers, got dtype {array.dtype}; pass integer "
            "token ids / node indices, not floats or objects"
        )
    if array.dtype.kind == "u" and array.size and int(array.max()) > _INT64_MAX:
        raise ValueError(f"{name} holds a value larger than int64 can represent")
    return array.astype(dtype)


def check_int(value, name, low=None, high=None) -> int:
    """An integer argument (numpy integers accepted); bools, floats and strings refused by name:
    the library's one rule for integer options and arguments."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if low is not None and value < low or high is not None and value > high:
        span = f"in {low}..{high}" if low is not None and high is not None else \
            f">= {low}" if high is None else f"<= {high}"
        raise ValueError(f"{name} must be {span}, got {value}")
    return value


def check_token(token, name: str = "root_token") -> int:
    """One token id (an integer >= 0)."""
    token = check_int(token, name)
    if token < 0:
        raise ValueError(f"{name} must be a non-negative token id, got {token}")
    return token


class DraftTree:
    """An immutable draft tree. See the module docstring for the invariants."""

    __slots__ = ("_tokens", "_parents", "_scores", "_depths", "_ancestor_mask")

    def __init__(self, tokens, parents, scores=None):
        tokens = _as_1d(tokens, "tokens")
        parents = _as_1d(parents, "parents")
        n = tokens.shape[0]
        if n == 0:
            raise ValueError(
                "a draft tree needs at least the root node (node 0 = the last "
                "emitted token); got 0 tokens"
            )
        if n > MAX_NODES:
            raise ValueError(
                f"draft tree has {n} nodes, more than MAX_NODES={MAX_NODES}; "
                f"lower the budget to at most {MAX_NODES - 1} draft nodes"
            )
        if parents.shape[0] != n:
            raise ValueError(
                f"tokens and parents lengths differ ({n} vs {parents.shape[0]}); "
                "give exactly one parent per node (-1 for the root)"
            )
        tokens = as_int_array(tokens, "tokens")
        parents = as_int_array(parents, "parents")
        negative_tokens = np.flatnonzero(tokens < 0)
        if negative_tokens.size:
            i = int(negative_tokens[0])
            raise ValueError(
                f"node {i} has negative token {int(tokens[i])}; token ids must be >= 0"
            )
        if parents[0] != -1:
            raise ValueError(
                f"parents[0] must be -1 (node 0 is the root), got {int(parents[0])}"
            )
        _check_parents(parents)

        if scores is not None:
            scores = _as_1d(scores, "scores")
            if scores.shape[0] != n:
                raise ValueError(
                    f"tokens and scores lengths differ ({n} vs {scores.shape[0]}); "
                    "give one cumulative log-probability per node, or scores=None"
                )
            if scores.dtype.kind not in "iuf":
                raise ValueError(
                    f"scores must be real numbers (cumulative log-probabilities), "
                    f"got dtype {scores.dtype}"
                )
            # + 0.0 turns -0.0 into 0.0 so that equal trees hash equal.
            scores = scores.astype(np.float64) + 0.0
            nan_nodes = np.flatnonzero(np.isnan(scores))
            if nan_nodes.size:
                raise ValueError(
                    f"node {int(nan_nodes[0])} has a NaN score; replace NaN "
                    "log-probabilities (e.g. with -inf) before building the tree"
                )
            increasing = np.flatnonzero(scores[1:] > scores[parents[1:]]) + 1
            if increasing.size:
                i = int(increasing[0])
                raise ValueError(
                    f"node {i} has score {float(scores[i])!r} above its parent "
                    f"{int(parents[i])}'s score {float(scores[parents[i]])!r}; scores are "
                    "cumulative log-probabilities and must not increase along a "
                    "path (clamp per-token log-probabilities at 0)"
                )
            scores.setflags(write=False)

        parents = parents.astype(np.int32)
        depths = depths_of(parents).astype(np.int32)
        for array in (tokens, parents, depths):
            array.setflags(write=False)
        set_slot = object.__setattr__
        set_slot(self, "_tokens", tokens)
        set_slot(self, "_parents", parents)
        set_slot(self, "_scores", scores)
        set_slot(self, "_depths", depths)
        set_slot(self, "_ancestor_mask", None)

    @classmethod
    def chain(cls, tokens, scores=None) -> "DraftTree":
        """A linear tree: tokens[0] is the root, node i's parent is i - 1."""
        n = np.asarray(tokens).shape[0] if np.ndim(tokens) >= 1 else 0
        return cls(tokens, np.arange(-1, n - 1, dtype=np.int32), scores)

    def __setattr__(self, name, value):
        raise AttributeError("DraftTree is immutable; build a new tree instead")

    def __delattr__(self, name):
        raise AttributeError("DraftTree is immutable")

    def __reduce__(self):
        # The default slots pickling calls setattr, which immutability forbids.
        return (DraftTree, (self._tokens, self._parents, self._scores))

    # -- contents ---------------------------------------------------------

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens

    @property
    def parents(self) -> np.ndarray:
        return self._parents

    @property
    def scores(self) -> np.ndarray | None:
        return self._scores

    @staticmethod
    def root_only(root) -> "DraftTree":
        """No proposal: the root alone (a host drafter that matched nothing)."""
        return DraftTree(np.array([int(root)], np.int64), np.array([-1], np.int32))

    @property
    def depths(self) -> np.ndarray:
        return self._depths

    @property
    def size(self) -> int:
        return int(self._tokens.shape[0])

    @property
    def budget(self) -> int:
        return self.size - 1

    @property
    def max_depth(self) -> int:
        return int(self._depths.max())

    @property
    def is_chain(self) -> bool:
        return bool(np.array_equal(self._parents[1:], np.arange(self.size - 1)))

    # -- structure --------------------------------------------------------

    def _check_node(self, i, name: str = "node") -> int:
        # Negative indices are refused rather than wrapped: -1 means "no
        # parent" in this library, so wrapping it to the last node hides bugs.
        i = check_int(i, f"{name} (a node index)")
        if not 0 <= i < self.size:
            raise ValueError(
                f"{name} {i} is out of range for a tree of {self.size} nodes "
                f"(valid: 0..{self.size - 1})"
            )
        return int(i)

    def children(self, i) -> tuple:
        i = self._check_node(i)
        return tuple(int(c) for c in np.flatnonzero(self._parents == i))

    def path_to(self, i) -> np.ndarray:
        return root_path(self._parents, self._check_node(i))

    def ancestor_mask(self) -> np.ndarray:
        """bool [n, n]: row i is True at i's ancestors and i itself."""
        if self._ancestor_mask is None:
            mask = ancestors_of(self._parents)
            mask.setflags(write=False)
            object.__setattr__(self, "_ancestor_mask", mask)
        return self._ancestor_mask

    def is_ancestor_or_self(self, a, b) -> bool:
        a = self._check_node(a, "a")
        b = self._check_node(b, "b")
        return bool(self.ancestor_mask()[b, a])

    # -- value semantics --------------------------------------------------

    def __eq__(self, other):
        if not isinstance(other, DraftTree):
            return NotImplemented
        if (self._scores is None) != (other._scores is None):
            return False
        return (
            np.array_equal(self._tokens, other._tokens)
            and np.array_equal(self._parents, other._parents)
            and (self._scores is None or np.array_equal(self._scores, other._scores))
        )

    def __hash__(self):
        scores = None if self._scores is None else self._scores.tobytes()
        return hash((self._tokens.tobytes(), self._parents.tobytes(), scores))

    def __len__(self):
        return self.size

    def __repr__(self):
        parts = [
            f"size={self.size}",
            f"max_depth={self.max_depth}",
            f"tokens={self._tokens.tolist()}",
            f"parents={self._parents.tolist()}",
        ]
        if self._scores is not None:
            parts.append("scores=[" + ", ".join(f"{s:.4g}" for s in self._scores) + "]")
        return "DraftTree(" + ", ".join(parts) + ")"


def _check_parents(parents: np.ndarray) -> None:
    index = np.arange(parents.shape[0])
    bad = np.flatnonzero((parents[1:] < 0) | (parents[1:] >= index[1:])) + 1
    if not bad.size:
        return
    i = int(bad[0])
    p = int(parents[i])
    if p < 0:
        raise ValueError(
            f"node {i} has negative parent {p}; only the root (node 0) has parent "
            "-1, every other node needs a parent index in [0, i)"
        )
    if p == i:
        raise ValueError(
            f"node {i} is its own parent (self parent); give it a parent index in "
            f"[0, {i})"
        )
    raise ValueError(
        f"node {i} has forward parent {p} (parents must satisfy parents[i] < i); "
        "renumber nodes so every parent comes before its children "
        "(breadth-first or depth-first order does this)"
    )


# ---------------------------------------------------------------------------- host topology


def check_parents(parents, n=None) -> np.ndarray:
    """Round parents as int64: -1 (a child of the committed history) or an earlier node."""
    p = np.asarray(parents, dtype=np.int64).reshape(-1)
    if n is not None and p.size != n:
        raise ValueError(f"parents has {p.size} entries, expected {n}")
    if np.any(p < -1) or np.any(p >= np.arange(p.size)):
        raise ValueError(f"parents must be topological: -1 <= parents[i] < i (got {p.tolist()})")
    return p


def check_draft_parents(parents) -> np.ndarray:
    """A draft tree's parents as int64: 1..MAX_NODES nodes, node 0 the only root."""
    p = check_parents(parents)
    if not 1 <= p.size <= MAX_NODES or p[0] != -1 or (p[1:] < 0).any():
        raise ValueError(f"a draft tree has 1..{MAX_NODES} nodes, node 0 its only root (parent -1); "
                         f"got parents {p.tolist()}")
    return p


def depths_of(parents) -> np.ndarray:
    """int64 depth of every node; a node with parent -1 has depth 0 (parents come first)."""
    p = check_parents(parents).tolist()
    d = [0] * len(p)
    for i, q in enumerate(p):
        if q >= 0:
            d[i] = d[q] + 1
    return np.array(d, dtype=np.int64)


def ancestors_of(parents) -> np.ndarray:
    """bool [n, n]: row i is True at i's ancestors and at i (parents' rows are final first)."""
    p = check_parents(parents)
    mask = np.zeros((p.size, p.size), dtype=bool)
    for i, q in enumerate(p.tolist()):
        if q >= 0:
            mask[i] = mask[q]
        mask[i, i] = True
    return mask


def root_path(parents, i) -> np.ndarray:
    """Nodes from the first node with parent -1 down to node i, that one first (int64)."""
    p = check_parents(parents)
    out = []
    i = int(i)
    while i >= 0:
        out.append(i)
        i = int(p[i])
    return np.array(out[::-1], dtype=np.int64)


def preorder(parents) -> np.ndarray:
    """A depth-first order of the nodes, each node's children in their id order: `order[j]` is
    the old id of new node j (node 0 first). Where children come in rank order (best-first
    trees), the best child's chain takes ids 1, 2, ... : the path a target most often accepts
    sits at consecutive positions, so its commit is a trim (no K/V row moves, nothing re-run)."""
    p = check_parents(parents).tolist()
    children = [[] for _ in p]
    roots = []
    for i, q in enumerate(p):
        (children[q] if q >= 0 else roots).append(i)
    order, stack = [], roots[::-1]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(children[i][::-1])
    return np.array(order, dtype=np.int64)


def relabel(parents, order) -> np.ndarray:
    """The parents of the same tree with node `order[j]` renamed j (order puts parents first)."""
    p = check_parents(parents)
    order = np.asarray(order, np.int64)
    new_id = np.empty(len(order), np.int64)
    new_id[order] = np.arange(len(order))
    old = p[order]
    return np.where(old < 0, -1, new_id[np.maximum(old, 0)])


def chain_parents(n) -> np.ndarray:
    """The parents of a chain of n nodes: [-1, 0, 1, ..., n - 2] (int64)."""
    return np.arange(-1, int(n) - 1, dtype=np.int64)


def eagle2_candidates(topk, lanes, depth) -> int:
    """The candidates an EAGLE-2 tree of `depth` steps chooses its nodes from: the root's `topk`
    children, then `topk` children of each of `lanes` nodes at every later step."""
    return topk + (depth - 1) * lanes * topk
