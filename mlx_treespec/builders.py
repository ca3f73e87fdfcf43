"""Draft-tree builders: pure functions from draft log-probabilities to trees.

Shared conventions:
  * A score is a cumulative log-probability; the root scores 0.
  * Per-token log-probabilities are clamped at 0 (``min(lp, 0)``). A positive
    log-probability is numerical noise, and letting it through would make a
    child outscore its parent, which breaks both the tree invariant and the
    prefix-closure argument the builders rely on.
  * Floating-point addition of a value <= 0 never increases a score (rounding
    is monotone), so ``fl(parent + lp) <= parent`` exactly, not just roughly.
"""

from __future__ import annotations

import heapq

import numpy as np

from .tree import MAX_NODES, DraftTree, as_int_array, check_int, check_token


def _check_budget(budget) -> int:
    return check_int(budget, "budget (draft nodes, excluding the root)", 0, MAX_NODES - 1)


def _as_float_array(values, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold real log-probabilities, got dtype {array.dtype}")
    return array.astype(np.float64)


def _rank_order(scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Indices sorting candidates best first: higher score, then lower id, NaN last."""
    nan = np.isnan(scores)
    # NaN is replaced in the score key so the sort never compares NaNs; the
    # isnan key (primary) already puts them last.
    return np.lexsort((ids, np.where(nan, 0.0, -scores), nan))


# ---------------------------------------------------------------------------
# chain


def chain_tree(root_token, tokens, logprobs=None) -> DraftTree:
    """A chain: root, then ``tokens`` in order. Scores are cumulative when
    ``logprobs`` (one per draft token) is given; NaN log-probs count as -inf."""
    root_token = check_token(root_token)
    tokens = as_int_array(tokens, "tokens")
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D (the draft tokens after the root), got shape {tokens.shape}")
    all_tokens = np.concatenate([[root_token], tokens])
    scores = None
    if logprobs is not None:
        logprobs = _as_float_array(logprobs, "logprobs")
        if logprobs.shape != tokens.shape:
            raise ValueError(
                f"logprobs has shape {logprobs.shape} but tokens has shape {tokens.shape}; "
                "give one log-probability per draft token (none for the root)"
            )
        scores = np.concatenate([[0.0], np.cumsum(_clean(logprobs))])
    return DraftTree.chain(all_tokens, scores)


# ---------------------------------------------------------------------------
# EAGLE-2 dynamic expansion


class Eagle2Builder:
    """EAGLE-2's dynamic draft tree, built one drafter step at a time.

    Every top-K child the drafter proposes becomes a *candidate* with a global
    id in order of creation (row-major within a step). After each step the best
    K candidates created in that step become the lanes the drafter expands
    next. ``build()`` keeps the best ``budget`` candidates of all steps.

    Ranking everywhere: higher score first, ties to the lower candidate id,
    NaN scores last. NaN scores stay NaN in ``cand_scores`` (so the drafter
    sees what it produced) and become -inf in the built tree's scores.
    """

    def __init__(self, root_token, topk, budget):
        self.root_token = check_token(root_token)
        self.topk = check_int(topk, "topk", 1)
        self.budget = _check_budget(budget)
        self.num_steps = 0
        empty_int = np.zeros(0, dtype=np.int64)
        self._tokens = empty_int
        self._parents = empty_int
        self._depths = empty_int
        self._scores = np.zeros(0, dtype=np.float64)
        self._lanes = empty_int

    @property
    def cand_tokens(self) -> np.ndarray:
        return self._readonly(self._tokens)

    @property
    def cand_parents(self) -> np.ndarray:
        """Candidate id of each candidate's parent; -1 for the root's children."""
        return self._readonly(self._parents)

    @property
    def cand_depths(self) -> np.ndarray:
        """Tree depth of each candidate; 1 for the root's children."""
        return self._readonly(self._depths)

    @property
    def cand_scores(self) -> np.ndarray:
        return self._readonly(self._scores)

    @property
    def lanes(self) -> np.ndarray:
        """Candidate ids returned by the last ``add_step`` (empty before step 0)."""
        return self._readonly(self._lanes)

    @property
    def num_candidates(self) -> int:
        return int(self._tokens.shape[0])

    @staticmethod
    def _readonly(array: np.ndarray) -> np.ndarray:
        view = array.view()
        view.setflags(write=False)
        return view

    def add_step(self, topk_tokens, topk_logprobs, lanes=None) -> np.ndarray:
        """Record one drafter step; return the next lanes (candidate ids, best first).

        Step 0 takes ``[1, K]`` (the root's top-K). Step s >= 1 takes ``[L, K]``
        where row j expands lane j of the array the previous call returned.
        ``lanes``, when given, are the next lanes as positions among this step's
        candidates (row-major): a drafter that ranks on the device passes the
        choice it already expanded, so the recorded tree is the one it drafted.
        """
        k = self.topk
        expected_rows = 1 if self.num_steps == 0 else int(self._lanes.shape[0])
        topk_tokens = np.asarray(topk_tokens)
        topk_logprobs = np.asarray(topk_logprobs)
        expected_shape = (expected_rows, k)
        for name, array in (("topk_tokens", topk_tokens), ("topk_logprobs", topk_logprobs)):
            if array.shape != expected_shape:
                which = "the root's top-K" if self.num_steps == 0 else "one row per lane returned by the previous add_step"
                raise ValueError(
                    f"step {self.num_steps}: {name} has shape {array.shape}, expected "
                    f"{expected_shape} ({which}, K={k} columns)"
                )
        tokens = as_int_array(topk_tokens, "topk_tokens").reshape(-1)
        if tokens.size and tokens.min() < 0:
            raise ValueError(f"step {self.num_steps}: topk_tokens holds a negative token id")
        logprobs = _as_float_array(topk_logprobs, "topk_logprobs")

        if self.num_steps == 0:
            parent_ids = np.array([-1], dtype=np.int64)
            parent_scores = np.zeros(1)
            parent_depths = np.zeros(1, dtype=np.int64)
        else:
            parent_ids = self._lanes
            parent_scores = self._scores[parent_ids]
            parent_depths = self._depths[parent_ids]
        # np.minimum propagates NaN, so a NaN log-prob yields a NaN score.
        new_scores = (parent_scores[:, None] + np.minimum(logprobs, 0.0)).reshape(-1)
        first_id = self.num_candidates
        new_ids = np.arange(first_id, first_id + new_scores.shape[0], dtype=np.int64)

        self._tokens = np.concatenate([self._tokens, tokens])
        self._parents = np.concatenate([self._parents, np.repeat(parent_ids, k)])
        self._depths = np.concatenate([self._depths, np.repeat(parent_depths + 1, k)])
        self._scores = np.concatenate([self._scores, new_scores])
        if lanes is None:
            self._lanes = new_ids[_rank_order(new_scores, new_ids)[:k]]
        else:
            lanes = as_int_array(lanes, "lanes").reshape(-1)
            if lanes.size > k or (lanes.size and (lanes.min() < 0 or lanes.max() >= new_ids.size)):
                raise ValueError(f"step {self.num_steps}: lanes must be at most {k} positions in "
                                 f"0..{new_ids.size - 1}, got {lanes.tolist()}")
            self._lanes = new_ids[lanes]
        self.num_steps += 1
        return self._lanes.copy()

    def build(self):
        """Keep the best ``budget`` candidates; return ``(DraftTree, cand_ids)``.

        The kept set is prefix-closed: a non-NaN child scores <= its parent and
        has a larger id, so the parent ranks first; a NaN parent has only NaN
        children (NaN propagates), which rank by id, parent first. As a guard,
        a candidate whose parent was not kept is dropped (never triggered by
        the ranking above, so the tree has exactly min(budget, candidates)
        draft nodes).

        Nodes are numbered depth-first, best child first, so following first
        children from the root visits 0, 1, 2, ...; ``cand_ids[i]`` is the
        candidate id of node i (-1 for the root).
        """
        ids = np.arange(self.num_candidates, dtype=np.int64)
        order = _rank_order(self._scores, ids)
        rank = np.empty_like(ids)
        rank[order] = ids
        kept = np.zeros(self.num_candidates, dtype=bool)
        for c in np.sort(order[: self.budget]):  # ascending id: parents first
            parent = self._parents[c]
            kept[c] = parent == -1 or kept[parent]

        kept_ids = np.flatnonzero(kept)
        children: dict[int, list[int]] = {int(c): [] for c in kept_ids}
        children[-1] = []
        for c in kept_ids[np.argsort(rank[kept_ids])]:  # best first
            children[int(self._parents[c])].append(int(c))

        cand_ids = [-1]
        parents = [-1]
        stack = [(c, 0) for c in reversed(children[-1])]
        while stack:
            c, parent_node = stack.pop()
            node = len(cand_ids)
            cand_ids.append(c)
            parents.append(parent_node)
            stack.extend((child, node) for child in reversed(children[c]))

        cand_ids = np.array(cand_ids, dtype=np.int64)
        draft = cand_ids[1:]
        tokens = np.concatenate([[self.root_token], self._tokens[draft]])
        scores = np.concatenate([[0.0], self._scores[draft]])
        scores[np.isnan(scores)] = -np.inf
        return DraftTree(tokens, parents, scores), cand_ids


def eagle2_tree(root_token, step_topk_tokens, step_topk_logprobs, topk, budget) -> DraftTree:
    """Run ``Eagle2Builder`` over recorded steps (step s rows follow the lanes
    the builder chose at step s - 1) and return the built tree."""
    if len(step_topk_tokens) != len(step_topk_logprobs):
        raise ValueError(
            f"got {len(step_topk_tokens)} token steps but {len(step_topk_logprobs)} "
            "log-prob steps; give one (tokens, logprobs) pair per drafter step"
        )
    builder = Eagle2Builder(root_token, topk, budget)
    for tokens, logprobs in zip(step_topk_tokens, step_topk_logprobs):
        builder.add_step(tokens, logprobs)
    return builder.build()[0]


# ---------------------------------------------------------------------------
# best-first from per-position marginals (DDTree)


def _clean(values):
    """Clamp log-probs at 0 and count NaN as -inf (the best-first/chain rule)."""
    values = np.asarray(values, dtype=np.float64)
    return np.where(np.isnan(values), -np.inf, np.minimum(values, 0.0))


def _top_tokens(row: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``width`` best tokens of one raw row, best first, by cleaned value,
    ties to the lower id. Returns (token ids, cleaned values).

    Works on the raw row to avoid cleaning a whole vocabulary: cleaning is
    monotone, so the cut is found on raw values (argpartition puts NaN last)
    and the ties at the cut are filled by ascending id, which argpartition
    alone would not guarantee.
    """
    vocab = row.shape[0]
    if width >= vocab:
        chosen = np.arange(vocab)
    else:
        cut = float(_clean(row[np.argpartition(-row, width - 1)[width - 1]]))
        if cut == 0.0:  # every value >= 0 cleans to 0: one tie group
            above, at_cut = np.zeros(0, dtype=np.int64), np.flatnonzero(row >= 0)
        elif cut == -np.inf:  # -inf and NaN both clean to -inf
            finite_or_more = row > -np.inf
            above, at_cut = np.flatnonzero(finite_or_more), np.flatnonzero(~finite_or_more)
        else:
            above, at_cut = np.flatnonzero(row > cut), np.flatnonzero(row == cut)
        chosen = np.sort(np.concatenate([above, at_cut[: width - above.shape[0]]]))
    values = _clean(row[chosen])
    order = np.argsort(-values, kind="stable")
    return chosen[order], values[order]


def best_first_tree(root_token, logprobs, budget, topk=None) -> DraftTree:
    """DDTree: the ``budget`` most probable prefixes under per-position marginals.

    ``logprobs[d]`` is the log-probability of each token at draft position d+1,
    independent of the prefix. A prefix's score is the left-to-right sum of its
    tokens' (clamped, NaN -> -inf) log-probabilities.

    Determinism: within a position, tokens rank by log-prob, ties to the lower
    token id; ``topk`` keeps the first ``topk`` of that ranking. Among prefixes,
    equal scores break by the prefix's rank tuple (r_1, ..., r_d) compared
    lexicographically, a prefix before its extensions. The result is exactly the
    first ``budget`` prefixes in that total order; nodes are numbered in pop
    order, which gives parents[i] < i (a child is pushed after its parent pops).
    """
    root_token = check_token(root_token)
    budget = _check_budget(budget)
    logprobs = _as_float_array(logprobs, "logprobs")
    if logprobs.ndim != 2:
        raise ValueError(
            f"logprobs must be [depth, vocab] (one row of marginals per draft position), "
            f"got shape {logprobs.shape}"
        )
    if topk is not None:
        topk = check_int(topk, "topk", 1)
    depth, vocab = logprobs.shape
    if vocab == 0 and depth > 0:
        raise ValueError("logprobs has an empty vocabulary axis; need at least one token per position")
    # A rank r at one position needs r earlier siblings popped, so no more than
    # `budget` tokens per position can ever be used; nor more than `budget` positions.
    width = min(vocab, budget, topk if topk is not None else vocab)
    depth = min(depth, budget)
    ranked = []  # per position: (token ids, cleaned values); filled on first use,
    # since a peaked distribution rarely needs all positions of a long block

    def ranked_at(d):
        while len(ranked) <= d:
            ranked.append(_top_tokens(logprobs[len(ranked)], width))
        return ranked[d]

    tokens = [root_token]
    parents = [-1]
    scores = [0.0]
    # heap entry: (-score, rank tuple, parent node, position index, rank)
    heap = [(-ranked_at(0)[1][0], (0,), 0, 0, 0)] if depth and width else []
    while heap and len(tokens) <= budget:
        neg_score, ranks, parent, d, r = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ranked[d][0][r]))
        parents.append(parent)
        scores.append(-neg_score)
        if r + 1 < width:
            sibling_score = scores[parent] + ranked[d][1][r + 1]
            heapq.heappush(heap, (-sibling_score, ranks[:-1] + (r + 1,), parent, d, r + 1))
        if d + 1 < depth:
            child_score = -neg_score + ranked_at(d + 1)[1][0]
            heapq.heappush(heap, (-child_score, ranks + (0,), node, d + 1, 0))
    return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int32), np.array(scores))


# ---------------------------------------------------------------------------
# static (fixed topology) trees


def _check_branching(branching) -> tuple[int, ...]:
    branching = tuple(branching)
    for d, b in enumerate(branching):
        check_int(b, f"branching[{d}] (children per node at depth {d + 1})", 1)
    return tuple(int(b) for b in branching)


def static_topology(branching) -> np.ndarray:
    """Parents of the full tree where every depth-(d) node has branching[d]
    children; nodes numbered breadth-first. ``()`` is the root alone."""
    branching = _check_branching(branching)
    level = np.array([0], dtype=np.int32)
    parents = [np.array([-1], dtype=np.int32)]
    count = 1
    for b in branching:
        count += level.shape[0] * b
        if count > MAX_NODES:
            raise ValueError(
                f"branching {branching} gives more than MAX_NODES={MAX_NODES} nodes "
                "(root included); use fewer children per node or fewer depths"
            )
        children = np.repeat(level, b)
        first = sum(p.shape[0] for p in parents)
        parents.append(children)
        level = np.arange(first, first + children.shape[0], dtype=np.int32)
    return np.concatenate(parents)


def static_tree(root_token, branching, token_table) -> DraftTree:
    """A fixed topology filled from ``token_table[depth, width]``: the c-th child
    (0-based) of any node at depth d-1 gets ``token_table[d-1][c]``."""
    root_token = check_token(root_token)
    branching = _check_branching(branching)
    parents = static_topology(branching)
    table = as_int_array(token_table, "token_table")
    if table.ndim != 2:
        raise ValueError(f"token_table must be [depth, width], got shape {table.shape}")
    if table.shape[0] < len(branching):
        raise ValueError(
            f"token_table has {table.shape[0]} rows but branching has {len(branching)} "
            "depths; give one row of candidate tokens per depth"
        )
    for d, b in enumerate(branching):
        if table.shape[1] < b:
            raise ValueError(
                f"token_table has width {table.shape[1]} but depth {d + 1} needs {b} "
                "children per node; widen the table"
            )
    n = parents.shape[0]
    depths = np.zeros(n, dtype=np.int64)
    child_rank = np.zeros(n, dtype=np.int64)
    next_rank = np.zeros(n, dtype=np.int64)
    for i in range(1, n):  # breadth-first: siblings are numbered in order.
        p = parents[i]
        depths[i] = depths[p] + 1
        child_rank[i] = next_rank[p]
        next_rank[p] += 1
    tokens = np.empty(n, dtype=np.int64)
    tokens[0] = root_token
    tokens[1:] = table[depths[1:] - 1, child_rank[1:]]
    return DraftTree(tokens, parents)
