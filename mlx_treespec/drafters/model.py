"""A small mlx-lm model as drafter: chains (topk=1) and EAGLE-2 dynamic trees (topk=K).

Each step forwards the current lanes on the draft model over its own cache, with the tree mask
(through the same TreeRound the target uses), and expands them from the draft logits; lanes,
re-rank and the tree's topology stay on the device, so the round's one host sync is the walk's.
Lanes are ranked at the first lane step (`ranked_lane_steps`), then each goes on by its own
argmax (docs/design.md, "Lanes ranked once"); a budget that keeps every candidate ranks
nothing: the root's best L children are the lanes (`lanes_parents`, "Fixed lanes").
A chain is the tree with one lane and one child per node: plain one-token steps, a trim for
commit, as in mlx-lm's speculative loop. One lane with K children is that chain plus its best
siblings as leaves.

A hybrid draft model (GatedDeltaNet layers, e.g. a small qwen3_5 for a qwen3_5 target) drafts
the same shapes: each step's nodes start from their parents' recurrent states (the round's
tree scan over every node so far), and commit replays the accepted tokens from the committed
state (gdn.gdn_layer_commit). Its lanes' parents are read on the host (one sync a ranked lane
step, as over rotating draft caches).
"""
import functools
from dataclasses import dataclass

import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..cache import cache_kind
from ..device_tree import top_k
from ..draft import Draft, Layout
from ..spec import DEFAULT_DEPTH
from ..support import tree_support
from ..tree import chain_parents, eagle2_candidates
from ..verify import TreeRound, cached_array


def _logprobs(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def keep_best(root, tokens, scores, parents, depths, budget):
    """EAGLE-2's re-rank on the device: the best `budget` candidates as a tree.

    Candidates (ids 0..C-1 in order of creation) have `tokens`, cumulative `scores`, `parents`
    (candidate id, -1 for the root's children) and `depths` (numpy: known when drafting
    starts). Rank: higher score first, ties to the lower id, NaN as -inf; a child never
    outranks its parent (its score is <= the parent's and its id larger), so the kept set is a
    tree. Numbering: the root, then the spine (the path to the best-ranked deepest kept
    candidate) in depth order, then the other nodes by ascending id, so parents come first and a
    round that accepts along the spine commits without moving any K/V.
    Returns (candidate id of nodes 1..budget, parents, depths, tokens, ancestors-or-self rows).
    """
    n_cand, n = int(scores.shape[0]), budget + 1
    # (index constants made once per shape: an arange or eye is a launch of its own each round)
    ids = cached_array(np.arange(n_cand, dtype=np.int32))
    nodes = cached_array(np.arange(n, dtype=np.int32))
    minus_one, zero = cached_array(np.full(1, -1, np.int32)), cached_array(np.zeros(1, np.int32))
    score = scores.astype(mx.float32)
    score = mx.where(mx.isnan(score), -mx.inf, score)
    beats = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None]) & (ids[None, :] < ids[:, None]))
    rank = beats.sum(axis=1)  # how many candidates beat this one: a permutation of 0..C-1
    sel = mx.sort(mx.where(rank < budget, ids, n_cand + ids))[:budget]  # ascending ids
    node_of = mx.zeros((n_cand,), mx.int32)
    node_of[sel] = nodes[1:]
    cand_parent = parents[sel]
    tree_parents = mx.concatenate([minus_one, mx.where(
        cand_parent < 0, 0, node_of[mx.maximum(cand_parent, 0)]).astype(mx.int32)])
    cand_depths = cached_array(np.asarray(depths, np.int32))
    tree_depths = mx.concatenate([zero, cand_depths[sel]])
    # ancestors-or-self: reachability along parent links, by squaring (paths double each time)
    reach = cached_array(np.eye(n, dtype=np.float32)) + (tree_parents[:, None] == nodes[None, :]).astype(mx.float32)
    for _ in range(int(np.max(depths, initial=1) - 1).bit_length()):
        reach = mx.minimum(reach @ reach, 1.0)
    anc = reach > 0
    # renumber: the spine first
    leaf = 1 + mx.argmax(cand_depths[sel] * (n_cand + 1) - rank[sel])
    key = mx.where(anc[leaf], tree_depths, n + nodes)
    perm = mx.argsort(key)
    new_of = mx.zeros((n,), mx.int32)
    new_of[perm] = nodes
    moved = tree_parents[perm]
    tree_parents = mx.where(moved < 0, -1, new_of[mx.maximum(moved, 0)])
    sel = mx.concatenate([minus_one, sel])[perm][1:]
    root = root if isinstance(root, mx.array) else mx.array([root], mx.uint32)
    tree_tokens = mx.concatenate([root, tokens.astype(mx.uint32)[sel]])
    return sel, tree_parents, tree_depths[perm], tree_tokens, anc[perm][:, perm]


def lanes_parents(S, K, L=1):
    """The fixed layout of L lanes of S steps, every sibling kept: the root; each lane's nodes at
    depths 1..S, lane after lane (lane 0, the argmax chain, is nodes 1..S: the spine); the
    root's other K - L children; then each step's K - 1 runners-up of each lane's node, step by
    step, lane by lane (`lane_tree`'s token order)."""
    parents = [-1]
    for j in range(L):
        parents += [0] + list(range(1 + j * S, (j + 1) * S))
    parents += [0] * (K - L)
    for s in range(1, S):
        for j in range(L):
            parents += [j * S + s] * (K - 1)
    return np.array(parents, np.int64)


@functools.lru_cache(maxsize=None)
def lanes_layout(S, K, L):
    """`lanes_parents`' Layout, built once per shape (every round of a fixed lane tree drafts it,
    in the round loop and queued alike)."""
    return Layout.fixed(lanes_parents(S, K, L))


def kept_nodes(topk, lanes, depth, budget):
    """The draft nodes a tree of `depth` steps keeps: at most its candidates; a chain keeps all
    of its `depth`."""
    return depth if topk == 1 else min(budget, eagle2_candidates(topk, lanes, depth))


def keeps_every_candidate(topk, lanes, depth, budget):
    """Whether a tree of this shape is the fixed layout of `lanes_parents`: its budget keeps
    every candidate, so nothing is ranked. Its lanes are the root's best `lanes` children, each
    going on by its own argmax (a chain too: topk 1)."""
    return budget >= eagle2_candidates(topk, lanes, depth)


def keeps_lanes_only(topk, lanes, depth, budget, ranked):
    """Whether an EAGLE-2 tree of this shape keeps its lanes' own nodes and nothing else: its
    budget is exactly the root's `topk` children and each lane's node at depths 2..`depth`
    (two lanes or more, one ranked step), so nothing is left to rank (`lanes_only_tree`).
    Ranking every candidate (`keep_best`) emitted 3-5% more a verify on CPU, but a queued
    round's re-rank launches some 70 kernels more (bench/RESULTS.md, "Lane trees that keep
    their lanes"); any other budget ranks them."""
    return lanes >= 2 and depth >= 3 and ranked == 1 and budget == topk + lanes * (depth - 1)


@functools.lru_cache(maxsize=None)
def lanes_only_tree(K, L, S):
    """`tree(root, children, entered, choice, depth2, later)`: the tree `keeps_lanes_only`
    keeps, as device arrays (tokens, parents, depths, ancestors-or-self rows). Numbering: the
    root, its K children (`children`, candidate order), then depth by depth each lane's node
    (lane order: `depth2`, the lanes' tokens after the ranked step, then `later` [S - 2, L],
    each lane's argmax steps). `entered` [L]: the children the lanes entered the ranked step
    from; `choice` [L]: the lanes' picks among its L * K candidates (lane choice // K's
    children). Only the depth-2 nodes' parents depend on the round."""
    n = 1 + K + L * (S - 1)
    lane = np.full(n, -1)
    lane[1 + K:] = np.tile(np.arange(L), S - 1)
    depths = np.concatenate([[0], np.ones(K, np.int64), np.repeat(np.arange(2, S + 1), L)]).astype(np.int32)
    parents = np.concatenate([[-1], np.zeros(K + L, np.int64), 1 + K + np.arange(L * (S - 2))]).astype(np.int32)
    anc = np.eye(n, dtype=bool)
    anc[:, 0] = True
    for i in range(1 + K + L, n):  # a lane's node sees its lane's nodes before it (and the root)
        anc[i] |= anc[parents[i]]
    head, tail = mx.array(parents[: 1 + K]), mx.array(parents[1 + K + L:])
    static, row_lane, in_lane = mx.array(anc), mx.array(np.maximum(lane, 0).astype(np.int32)), mx.array(lane >= 0)
    columns, depths = mx.array(np.arange(n, dtype=np.int32)), mx.array(depths)

    def tree(root, children, entered, choice, depth2, later):
        below = 1 + mx.take(entered, choice // K).astype(mx.int32)  # each lane's child of the root
        tokens = mx.concatenate([root, children, depth2, later.reshape(-1)]).astype(mx.uint32)
        anc = static | (in_lane[:, None] & (columns[None] == mx.take(below, row_lane)[:, None]))
        return tokens, mx.concatenate([head, below, tail]), depths, anc

    return tree


def root_children(logits, K, L):
    """The root's children in a fixed lane tree of L >= 2 lanes (logits [1, V]): the root's best
    K, best first: the lanes' first tokens [L], then its other K - L children (leaves)."""
    best = top_k(logits[0], K, ordered=True)[0]
    return best[:L], best[L:]


def runners_up(logits, taken, K):
    """Each row's best K - 1 tokens but its argmax token `taken` (logits [N, V], taken [N]),
    row by row, mx uint32 [N * (K - 1)]."""
    return top_k(logits, K - 1, skip=taken)[0].reshape(-1)


def lane_tree(logits, toks, others, K):
    """A fixed lane tree's draft tokens in `lanes_parents`' order (the root excluded): `toks`
    [S, L] (each depth's lane tokens, lane 0's the argmax chain), `logits` [1 + (S - 1) L, V]
    (the root's, then each step's lanes': step by step, lane by lane; their argmaxes are the
    lanes' next tokens) and `others` (`root_children`'; None for one lane, whose root leaves
    are ranked with its steps')."""
    lanes = toks.T.reshape(-1)  # lane after lane
    if K == 1:
        return lanes
    if others is None:
        return mx.concatenate([lanes, runners_up(logits, toks[:, 0], K)])
    steps = [runners_up(logits[1:], toks[1:].reshape(-1), K)] if toks.shape[0] > 1 else []
    return mx.concatenate([lanes, others] + steps)


def lane_candidates(lane_scores, lane_cands, logits, tokens, first, K):
    """The candidates of G lane steps in which each lane went on by its own argmax, from their
    logits at once (the round loop's `_tree` and the queued `lanes_ahead` both call this, so
    both rank the same scores).

    `lane_scores` [L]: each lane's score entering the first of the steps; `lane_cands` [L]: the
    candidate id of the node each lane forwarded there; `logits` [G, L, V]: the steps' logits;
    `tokens` [G, L]: their argmaxes (each lane's next node); `first`: the first candidate id of
    those steps. Each lane's K best tokens are its candidates, its argmax among them (in its top-K
    slot; in slot 0 if more than K tie for the top) and scored as EAGLE-2 scores any candidate:
    the lane's score plus the token's log-prob (at most 0). Returns the candidates' tokens,
    scores, parents (row-major: step, lane, K) and the candidate id of each step's argmax [G, L].
    """
    G, L = tokens.shape
    tokens = tokens.astype(mx.int32)
    lp = _logprobs(logits)
    idx, top = top_k(lp, K)  # [G, L, K]
    hit = idx == tokens[..., None]
    slot = mx.where(hit.any(axis=-1), mx.argmax(hit, axis=-1), 0).astype(mx.int32)
    in_slot = cached_array(np.arange(K, dtype=np.int32)) == slot[..., None]
    taken = mx.take_along_axis(lp, tokens[..., None], axis=-1)  # [G, L, 1]
    idx = mx.where(in_slot, tokens[..., None], idx)
    step = mx.minimum(mx.where(in_slot, taken, top), 0)
    # each step's lane score: the entering score plus the argmaxes' log-probs before it
    before = mx.cumsum(mx.minimum(taken[..., 0], 0), axis=0, inclusive=False)  # [G, L]
    scores = lane_scores[None, :, None] + before[..., None] + step
    ids = first + cached_array(np.arange(0, G * L * K, K, dtype=np.int32).reshape(G, L)) + slot  # the argmaxes
    parents = mx.concatenate([lane_cands.reshape(1, L).astype(mx.int32), ids[:-1]])
    parents = mx.broadcast_to(parents[..., None], (G, L, K))
    return idx.reshape(-1), scores.reshape(-1), parents.reshape(-1), ids


def model_probe_parents(topk, lanes, depth, budget):
    """The topology the GPU exactness probe verifies for a draft model of this shape: its fixed
    layout where the budget keeps every candidate (a chain; one lane with all its siblings),
    else the EAGLE-2 tree a fairly confident drafter of this shape builds."""
    if topk == 1:
        return chain_parents(depth + 1)
    if keeps_every_candidate(topk, lanes, depth, budget):
        return lanes_parents(depth, topk, lanes)
    from ..probe import representative_tree_parents

    return representative_tree_parents(topk, depth, budget)


@dataclass
class ModelDraftState:
    """What a draft forwarded on the draft model, for its commit: the draft cache's round,
    the round node each draft node was forwarded as (-1: not forwarded; numpy, or an mx array
    fetched by the walk's sync), and the round node of the root."""

    rnd: TreeRound
    forwarded: object
    root_node: int


class ModelDrafter:
    """`topk` children per expanded node, `lanes` nodes expanded per step (EAGLE-2: lanes = topk;
    lanes = 1 expands only the best candidate, a chain of one-token steps whose siblings ride
    along as leaves), `depth` steps, `budget` draft nodes kept. Shapes are checked and
    defaulted by `DraftSpec`; this class takes them as given."""

    capture = ()  # reads no target hidden state
    # EAGLE-2's lanes are re-ranked at this many lane steps, then each lane goes on by its own
    # argmax: the re-rank after the first lane step is what buys most of EAGLE-2's tokens, and an
    # argmax step costs a chain step where a ranked one adds the ranking's kernels
    # (bench/RESULTS.md, "Lanes ranked once")
    ranked_lane_steps = 1

    def __init__(self, model, topk=1, depth=DEFAULT_DEPTH, budget=None, prefill_step_size=2048, lanes=None):
        # its steps fork over the round's tree as a target's verify does; positions a tree cannot
        # give per token only make its drafts poorer (the target decides every token)
        blockers = [b for b in tree_support(model) if not b.positions]
        if blockers:
            raise ValueError("the draft model cannot draft trees (" + "; ".join(map(str, blockers))
                             + "): use a draft model of attention and GatedDeltaNet layers")
        self.model = model
        self.recurrent = any(cache_kind(c) == "arrays" for c in make_prompt_cache(model))
        self.topk = topk
        self.lanes = topk if lanes is None else lanes
        self.depth = depth
        self.budget = depth if budget is None else budget
        self.prefill_step_size = prefill_step_size
        self.cache = None
        self.pending = []  # emitted tokens not yet in the draft cache; the last is the root
        # at temp > 0 the loop's sampling.Draw (set per generation): steps pick their tokens by
        # the draw's scores of their logits, not the logits (`_scores`)
        self.draw = None

    def reset(self):
        self.cache, self.pending = None, []

    def reshape(self, topk, lanes, depth, budget):
        """Draft trees of this shape from the next draft on (an adaptive default's sampled shape,
        set per generation: AdaptiveDrafter.draw)."""
        self.topk, self.lanes, self.depth, self.budget = topk, lanes, depth, budget

    def prefill(self, prompt):
        self.reset()
        self.cache = make_prompt_cache(self.model)
        prompt = [int(t) for t in prompt]
        body, self.pending = prompt[:-1], prompt[-1:]
        for i in range(0, len(body), self.prefill_step_size):
            self.model(mx.array(body[i : i + self.prefill_step_size])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def draft(self, root, max_depth):
        depth = min(self.depth, max_depth)
        budget = kept_nodes(self.topk, self.lanes, depth, self.budget)
        if depth == 0 or budget == 0:
            return Draft.root_only(root)
        if self.recurrent and len(self.pending) > 2:
            # a recurrent layer scans every node of the round at each draft step: the text that
            # piled up (a plain stretch's) goes into the caches first, leaving the root
            self.model(mx.array(self.pending[:-1])[None], cache=self.cache)
            self.pending = self.pending[-1:]
        # The pending tokens (the last is the root) are round nodes too: they always stay.
        rnd = TreeRound(self.model, self.cache)
        try:
            p = len(self.pending)
            pending = mx.array(self.pending, mx.uint32)
            logits = self._forward(rnd, pending, np.arange(p) - 1)[-1:]
            if keeps_every_candidate(self.topk, self.lanes, depth, budget):  # nothing to rank
                return self._lanes_and_siblings(pending[-1:], logits, rnd, depth, budget)
            if self.lanes == 1:
                rows, toks = self._spine(logits, rnd, depth)
                return self._ranked_siblings(pending[-1:], rows, toks, rnd, budget)
            return self._tree(pending[-1:], logits, rnd, depth, budget)
        except BaseException:
            rnd.abort()
            raise

    def _forward(self, rnd, tokens, parents=None, depth=None, rows=None, feeds=None):
        """One draft forward over the round: host `parents`, or device visibility `rows` at
        `depth`. `feeds`: the round nodes each new node continues from (a head drafter reads
        their output hidden state; None for a round's first forward, the pending tokens)."""
        if rows is None:
            return rnd.forward(tokens, parents)
        return rnd.forward_rows(tokens, depth, rows)

    def _scores(self, logits, depth):
        """What a step ranks the tokens after its nodes by (rows at `depth` from the root): their
        logits, or at temp > 0 the draw's scores of them (sampling.Draw: the target's noise at
        their positions), so the step's best token is its guess of the target's draw."""
        return logits if self.draw is None else self.draw.at(logits, depth)

    def _spine(self, logits, rnd, depth):
        """Greedy one-token steps from the root: each step's scores (`_scores`) and best token."""
        logits = self._scores(logits, 0)
        rows, toks = self._lanes(rnd, depth, mx.argmax(logits, axis=-1).astype(mx.uint32))
        return [logits] + rows, toks

    def _lanes(self, rnd, depth, first):
        """Fixed lanes from the root (the round's last node): `first` [L] the lanes' tokens at
        depth 1; each later step forwards every lane's last node, and each lane goes on by its
        own argmax. Returns the steps' scores (`_scores`: [L, V] at depths 1..depth-1) and each
        depth's lane tokens [L]."""
        L = first.shape[0]
        parents = [rnd.size - 1] * L
        rows, toks = [], [first]
        for s in range(1, depth):
            logits = self._scores(self._forward(rnd, toks[-1], parents, feeds=parents), s)
            parents = list(range(rnd.size - L, rnd.size))
            rows.append(logits)
            toks.append(mx.argmax(logits, axis=-1).astype(mx.uint32))
        return rows, toks

    def probe_parents(self):
        return model_probe_parents(self.topk, self.lanes, self.depth, self.budget)

    def _lanes_and_siblings(self, root, logits, rnd, depth, budget):
        """A tree whose budget keeps every candidate (`keeps_every_candidate`): the root's best L
        children, each going on by its own argmax, and every step's K - 1 runners-up (the
        root's K - L) as leaves. A fixed topology (`lanes_parents`): nothing is ranked and the
        host knows the parents without a sync. One lane is the chain (K = 1) or the chain with
        its siblings."""
        S, K, L = depth, self.topk, self.lanes
        root_node = rnd.size - 1
        if L == 1:  # (`_spine`: what a chain drafts, and what the tests' oracles replace)
            rows, toks = self._spine(logits, rnd, S)
            others = None
        else:
            logits = self._scores(logits, 0)
            first, others = root_children(logits, K, L)
            rows, toks = self._lanes(rnd, S, first)
            rows = [logits] + rows
        tokens = mx.concatenate([root, lane_tree(mx.concatenate(rows), mx.stack(toks), others, K)])
        layout = lanes_layout(S, K, L)
        # lane j's node at depth d (1 <= d < S) was forwarded at step d, as round node
        # root_node + 1 + (d - 1) L + j; nothing else was
        forwarded = np.full(layout.size, -1, np.int64)
        for j in range(L):
            forwarded[1 + j * S : (j + 1) * S] = root_node + 1 + np.arange(S - 1) * L + j
        return Draft(tokens, layout, ModelDraftState(rnd, forwarded, root_node), budget=budget, depth=S, forwards=S)

    def _ranked_siblings(self, root, rows, toks, rnd, budget):
        """One lane with a budget below S * K: the chain's steps' top-K, ranked at once on the
        device (EAGLE-2's re-rank); the chain is the spine."""
        K, S = self.topk, len(toks)
        root_node = rnd.size - S  # the spine forwarded S - 1 nodes after the root
        chain = mx.concatenate(toks).astype(mx.int32)  # [S]
        lp = _logprobs(mx.concatenate(rows))  # [S, V]
        idx, top = top_k(lp, K)
        # the chain token is its step's lane: put it in its row's slot (it is there already
        # unless more than K tokens tie for the top)
        hit = idx == chain[:, None]
        slot = mx.where(hit.any(axis=1), mx.argmax(hit, axis=1), 0).astype(mx.int32)
        in_slot = mx.arange(K)[None, :] == slot[:, None]
        chain_lp = mx.take_along_axis(lp, chain[:, None], axis=1)  # [S, 1]
        idx = mx.where(in_slot, chain[:, None], idx)
        step = mx.minimum(mx.where(in_slot, chain_lp, top), 0)
        lane_score = mx.concatenate([mx.zeros((1,)), mx.cumsum(mx.minimum(chain_lp[:-1, 0], 0))])
        scores = (lane_score[:, None] + step).reshape(-1)
        lanes = mx.arange(S, dtype=mx.int32) * K + slot  # candidate id of each step's lane
        parents = mx.concatenate([mx.full((K,), -1, mx.int32), mx.repeat(lanes[:-1], K)])
        depths = np.repeat(np.arange(1, S + 1, dtype=np.int32), K)
        sel, tree_parents, tree_depths, tree_tokens, anc = keep_best(
            root, idx.reshape(-1), scores, parents, depths, budget)
        # lane s (s < S - 1) was forwarded at step s + 1, as round node root_node + 1 + s
        round_of = mx.full((S * K,), -1, mx.int32)
        if S > 1:
            round_of[lanes[:-1]] = mx.arange(root_node + 1, root_node + S, dtype=mx.int32)
        tree_round = mx.concatenate([mx.full((1,), -1, mx.int32), round_of[sel]])
        return Draft(tree_tokens, Layout.on_device(tree_parents, tree_depths, anc),
                     ModelDraftState(rnd, tree_round, root_node), fetch=(tree_round,), budget=budget, depth=S,
                     forwards=S)

    def _tree(self, root, logits, rnd, depth, budget):
        """EAGLE-2 lanes (L >= 2), ranked on the device: the host sees the tree only at the
        walk's sync.

        Candidates get ids in order of creation (row-major within a step). The root's best L
        children are the first lanes; the first lane step's best L candidates of its L * K are
        the next (EAGLE-2's re-rank, at `ranked_lane_steps` steps); from then on each lane goes on
        by its own argmax, a chain step's work, and those steps' candidates are scored at once
        (`lane_candidates`). The tree keeps the best `budget` of all candidates (higher score,
        then lower id), numbered as `keep_best` says. Lanes' visibility rows are built on the
        device too, except over rotating draft caches, whose key layout needs the lanes'
        parents on the host (one sync per ranked step there). A budget of exactly the lanes'
        nodes keeps them and nothing is scored after the ranked step (`keeps_lanes_only`).
        """
        K, L = self.topk, self.lanes
        root_node = rnd.size - 1
        root_depth = int(rnd.depths[root_node])
        idx, lp = top_k(_logprobs(self._scores(logits, 0)), K)  # the root's children, the first candidates
        step_scores = mx.minimum(lp[0], 0)
        choice = mx.arange(K) if L == K else mx.argsort(-step_scores)[:L]
        lane_tokens, lane_scores = idx[0][choice], step_scores[choice]
        lane_cands = choice  # candidate id of each lane
        lane_parents = mx.full((L,), root_node)  # round node each lane hangs from
        tokens, scores, parents = [idx.reshape(-1)], [step_scores], [mx.full((K,), -1)]
        cand_depths = [np.ones(K, np.int32)]
        forwarded, forwarded_at = [], []  # candidates run as lanes, and their round nodes
        visible = cached_array(rnd.ancestors) if rnd.all_append else None  # [m, m] over round nodes
        n_cand = K
        entering = None  # the argmax steps': the lanes' scores and candidate ids entering them, their first id
        argmax_logits, argmax_tokens = [], []
        for s in range(1, depth):
            first = rnd.size
            if visible is None:
                logits = self._forward(rnd, lane_tokens.astype(mx.uint32), np.array(lane_parents),
                                       feeds=lane_parents)
            else:
                rows = mx.concatenate([visible[lane_parents], mx.eye(L, dtype=mx.bool_)], axis=1)
                logits = self._forward(rnd, lane_tokens.astype(mx.uint32), depth=root_depth + s, rows=rows,
                                       feeds=lane_parents)
                visible = mx.concatenate(
                    [mx.concatenate([visible, mx.zeros((first, L), mx.bool_)], axis=1), rows], axis=0)
            logits = self._scores(logits, s)
            forwarded_at.append(mx.arange(first, first + L))
            cand_depths.append(np.full(L * K, s + 1, np.int32))
            if s > self.ranked_lane_steps:  # each lane by its own argmax
                if entering is None:
                    entering = (lane_scores, lane_cands, n_cand)
                    forwarded.append(lane_cands)
                argmax_logits.append(logits)
                lane_tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
                argmax_tokens.append(lane_tokens)
                lane_parents = cached_array(np.arange(first, first + L))  # each lane its own parent
                n_cand += L * K
                continue
            forwarded.append(lane_cands)
            idx, lp = top_k(_logprobs(logits), K)
            step_scores = (lane_scores[:, None] + mx.minimum(lp, 0)).reshape(-1)
            tokens.append(idx.reshape(-1))
            scores.append(step_scores)
            parents.append(mx.repeat(lane_cands, K))
            choice = mx.argsort(-step_scores)[:L]  # the next lanes among this step's L*K
            lane_tokens, lane_scores = idx.reshape(-1)[choice], step_scores[choice]
            lane_cands = n_cand + choice
            lane_parents = first + choice // K
            n_cand += L * K
        if keeps_lanes_only(K, L, depth, budget, self.ranked_lane_steps):
            # the children, the lanes after the ranked step (`forwarded[1]`, candidates K..), then
            # the argmax steps' tokens; a node's round row: where its lane forwarded it
            tree_tokens, tree_parents, tree_depths, anc = lanes_only_tree(K, L, depth)(
                root, tokens[0], forwarded[0], forwarded[1] - K, tokens[1][forwarded[1] - K],
                mx.stack(argmax_tokens))
            child_round = mx.full((K,), -1, mx.int32)
            child_round[forwarded[0]] = forwarded_at[0]
            tree_round = mx.concatenate([mx.full((1,), -1, mx.int32), child_round, *forwarded_at[1:],
                                         mx.full((L,), -1, mx.int32)])
            return Draft(tree_tokens, Layout.on_device(tree_parents, tree_depths, anc),
                         ModelDraftState(rnd, tree_round, root_node), fetch=(tree_round,), budget=budget,
                         depth=depth, forwards=depth)
        if entering is not None:
            c_tok, c_score, c_parent, argmax_ids = lane_candidates(
                entering[0], entering[1], mx.stack(argmax_logits), mx.stack(argmax_tokens), entering[2], K)
            tokens.append(c_tok)
            scores.append(c_score)
            parents.append(c_parent)
            forwarded.extend(argmax_ids[:-1])  # each argmax was its lane's node a step later
        sel, tree_parents, tree_depths, tree_tokens, anc = keep_best(
            root, mx.concatenate(tokens), mx.concatenate(scores), mx.concatenate(parents),
            np.concatenate(cand_depths), budget)
        round_of = mx.full((n_cand,), -1, mx.int32)
        if forwarded:
            round_of[mx.concatenate(forwarded)] = mx.concatenate(forwarded_at).astype(mx.int32)
        tree_round = mx.concatenate([mx.full((1,), -1, mx.int32), round_of[sel]])
        return Draft(tree_tokens, Layout.on_device(tree_parents, tree_depths, anc),
                     ModelDraftState(rnd, tree_round, root_node), fetch=(tree_round,), budget=budget,
                     depth=depth, forwards=depth)

    def commit(self, draft, path, emitted):
        state = draft.state
        if state is None:  # nothing was forwarded: the root is still pending
            self.pending = self.pending + list(emitted)
            return
        forwarded = np.array(state.forwarded)  # fetched by the walk's sync when built on the device
        keep = list(range(state.root_node + 1))  # the pending tokens, root included
        for node in path[1:]:
            if forwarded[node] < 0:
                break
            keep.append(int(forwarded[node]))
        state.rnd.keep(keep)
        self.pending = list(emitted[len(keep) - state.root_node - 1 :])
