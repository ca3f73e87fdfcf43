"""A draft model whose batch rows are a tree's branches: every step is one plain one-token forward.

A tree's second path costs the draft model extra rows in each step (tree rows with a mask, 2-3x a
one-token step on MLX CUDA for a tiny drafter, bench/RESULTS.md section 2). Here the draft cache
holds the context `rows` times (batch rows), so every path is a plain causal decode over its own
row: a step runs all rows through the same kernels as a chain's step, and no mask is built.

Row 0 drafts the spine (greedy steps, a chain). Row r >= 1 mirrors it until the r-th spine step
whose top draft probability is below `fork_below` (1: the first R - 1 steps, with nothing read
back); there it takes the runner-up token and then follows its own greedy steps: a branch. Each
spine step's K - 1 runners-up are leaves, as in the one-lane tree (the runner-up a branch starts
from is that leaf, with the branch below it). The host reads one probability per spine step until every row has forked (none with
`fork_below` = 1), so the tree's topology is known on the host, and the verify gets cached device
depths and ancestor rows per layout.

Measured on the H200 (bench/RESULTS.md, section 1b): each host read costs the round ~1.6 ms
and a multi-token forward over batch rows is far slower than one-token steps, so the default
forks without reading and the pending tokens go in one at a time.

Commit trims every row to the accepted nodes already forwarded and copies the accepted row's
K/V over the other rows where they differ, so all rows hold the same context again.
"""
import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..tree import MAX_NODES
from ..verify import cached_array
from . import Draft, fixed_topology, root_only


class BranchDrafter:
    """`rows` batch rows of the draft model (1: a chain with siblings), `topk` - 1 runners-up per
    spine step as leaves, `depth` steps, forks where the spine's top probability < `fork_below`."""

    def __init__(self, model, topk=1, depth=4, rows=2, fork_below=0.5, prefill_step_size=2048):
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not 1 <= rows <= 8:
            raise ValueError(f"rows (--tree-branches) must be in 1..8, got {rows}")
        if not 0.0 <= fork_below <= 1.0:
            raise ValueError(f"fork_below (--tree-fork-below) is a probability in 0..1, got {fork_below}")
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        nodes = max_nodes(topk, depth, rows)
        if nodes > MAX_NODES:
            raise ValueError(
                f"a tree of topk {topk}, depth {depth} and {rows} branches can reach {nodes} nodes; "
                f"at most {MAX_NODES} fit: lower --tree-depth, --tree-topk or --tree-branches")
        kinds = {type(c).__name__ for c in make_prompt_cache(model) if not isinstance(c, KVCache)}
        if kinds:
            # a row copy at commit needs plain append caches (no window, no recurrent state)
            raise ValueError(f"--tree-branches needs a draft model with plain KV caches; this one has "
                             f"{', '.join(sorted(kinds))}: use --tree-branches 1 or another drafter")
        self.model = model
        self.topk = topk
        self.depth = depth
        self.rows = rows
        self.fork_below = fork_below
        self.budget = nodes - 1  # the most draft nodes a round can have
        self.prefill_step_size = prefill_step_size
        self.cache = None
        self.pending = []  # emitted tokens not yet in the draft cache; the last is the root
        self._layouts = {}

    def prefill(self, prompt):
        self.cache = make_prompt_cache(self.model)
        prompt = [int(t) for t in prompt]
        body, self.pending = prompt[:-1], prompt[-1:]
        for i in range(0, len(body), self.prefill_step_size):
            chunk = mx.array(body[i : i + self.prefill_step_size], mx.uint32)
            self.model(mx.broadcast_to(chunk[None], (self.rows, chunk.shape[0])), cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def _step(self, tokens):
        """One forward of `tokens` [rows, T] on every row; the last position's logits [rows, V]."""
        return self.model(tokens, cache=self.cache)[:, -1, :]

    def draft(self, root, max_depth):
        S, K, R = min(self.depth, max_depth), self.topk, self.rows
        if S == 0:
            return root_only(root)
        pending = mx.array(self.pending, mx.uint32)
        # one token at a time: a multi-token forward over batch rows takes a much slower path
        # on MLX CUDA (a round's draft ~10x a chain's, bench/RESULTS.md section 1b)
        for i in range(pending.shape[0]):
            logits = self._step(mx.broadcast_to(pending[i : i + 1][None], (R, 1)))
        forks = []  # spine step of each forked row, rows 1.. in order
        spine, steps, heads = [], [], {}  # row 0's token, all rows' tokens, step -> branch head
        spine_logits = []  # row 0's logits per step: its leaves are picked once, after the loop
        for s in range(S):
            best = mx.argmax(logits, axis=-1)  # [R]: each row's greedy token
            spine.append(best[:1])
            if K > 1:
                spine_logits.append(logits[:1])
            if len(forks) < R - 1 and s < S - 1 and self._uncertain(logits[0]):
                # a fork at the last step would be a leaf only; the head is row 0's runner-up
                forks.append(s)
                heads[s] = mx.argmax(_without(logits[0], best[:1]), keepdims=True)
            # row r's token: row 0's until its fork, the runner-up at it, its own greedy after
            src = [0] + [(r if forks[r - 1] < s else R) if r <= len(forks) else 0 for r in range(1, R)]
            if any(src):
                tok = mx.concatenate([best, heads.get(s, best[:1])])[cached_array(np.array(src, np.int32))]
            else:
                tok = mx.broadcast_to(best[:1], (R,))
            steps.append(tok)
            if s < S - 1:
                logits = self._step(tok[:, None])
        parents, depths, visible, order = self._layout(S, tuple(forks))
        parts = [pending[-1:], mx.concatenate(spine)]
        if K > 1:
            parts.append(self._leaves(mx.concatenate(spine_logits), spine, heads))
        elif heads:  # with no leaves, the runners-up branches start from are nodes of their own
            parts.append(mx.concatenate([heads[f] for f in forks]))
        table = mx.stack(steps)  # [S, R]: row r's token at each step
        for r, f in enumerate(forks, start=1):
            if f + 1 < S:
                parts.append(table[f + 1 :, r])
        tokens = mx.concatenate(parts)
        return Draft(parents, tokens, self.budget, S, (S, tuple(forks), order, len(self.pending)),
                     depths=depths, visible=visible)

    def _uncertain(self, logits):
        """Does row 0 fork here? Its top probability below `fork_below` (a host read); with
        `fork_below` 1 every step is uncertain and nothing is read."""
        if self.fork_below >= 1:
            return True
        x = logits.astype(mx.float32)
        return mx.exp(x.max() - mx.logsumexp(x)).item() < self.fork_below

    def _leaves(self, logits, spine, heads):
        """The K - 1 runners-up of each spine step ([S * (K - 1)], step by step), from row 0's
        logits [S, V], in one pass after the loop. At a fork step the first is the branch's head
        (picked during the loop), the others are the best after it."""
        S, n = logits.shape[0], self.topk - 1
        first = mx.concatenate([heads.get(s, spine[s]) for s in range(S)])  # [S]
        masked = _without(logits, mx.stack([mx.concatenate(spine), first], axis=1))
        top = mx.argpartition(-masked, kth=n - 1, axis=-1)[:, :n]
        if heads and n > 1:  # a fork step keeps its best n - 1 after the head: rank them
            top = mx.take_along_axis(top, mx.argsort(-mx.take_along_axis(masked, top, axis=-1), axis=-1), axis=-1)
        cols = np.array([list(range(n)) if s in heads else list(range(1, n + 1)) for s in range(S)], np.int32)
        both = mx.concatenate([first[:, None], top.astype(first.dtype)], axis=1)  # [S, 1 + n]
        return mx.take_along_axis(both, cached_array(cols), axis=-1).reshape(-1)

    def _layout(self, S, forks):
        """Host parents, device depths and ancestor rows, and each node's (row, step), for a
        spine of S, its K - 1 leaves per step and branches forked at `forks` (cached)."""
        hit = self._layouts.get((S, forks))
        if hit is None:
            parents, order = branch_layout(S, self.topk, forks)
            hit = self._layouts[(S, forks)] = fixed_topology(parents) + (order,)
        return hit

    def probe_parents(self):
        """The largest layout a round can verify (forks at the first steps): the exactness
        probe's topology for this drafter."""
        S = self.depth
        return branch_layout(S, self.topk, tuple(range(min(self.rows - 1, max(S - 1, 0)))))[0]

    def commit(self, draft, path, emitted):
        if draft.extra is None:  # nothing was forwarded: the root is still pending
            self.pending = self.pending + list(emitted)
            return
        S, forks, order, p = draft.extra
        # accepted nodes whose token some row forwarded: (row, step) with step < S - 1, a prefix
        row, kept = 0, 0
        for node in path[1:]:
            r, s = order[node]
            if r < 0 or s >= S - 1:
                break
            row, kept = r, kept + 1
        base = self.cache[0].offset - (S - 1)  # where this round's first draft token went
        for c in self.cache:
            c.trim(S - 1 - kept)
        # rows that forked before `kept` differ from `row` there; the row's own fork too
        differ = [f for r, f in enumerate(forks, start=1) if r != row] + ([forks[row - 1]] if row else [])
        lo = min(differ, default=kept)
        if lo < kept:
            a, b = base + lo, base + kept
            for c in self.cache:
                c.keys[:, :, a:b, :] = c.keys[row : row + 1, :, a:b, :]
                c.values[:, :, a:b, :] = c.values[row : row + 1, :, a:b, :]
        self.pending = list(emitted[kept:])


def _without(logits, tokens):
    """`logits` [..., V] with the `tokens` ([...] or [..., m]) at -inf."""
    idx = tokens.astype(mx.int32)
    idx = idx if idx.ndim == logits.ndim else idx[..., None]
    return mx.put_along_axis(logits, idx, mx.array(-mx.inf, logits.dtype), axis=-1)


def max_nodes(topk, depth, rows):
    """The most nodes (root included) a draft of this shape can have: every branch forked at
    step 0."""
    if depth == 0:
        return 1
    return 1 + depth * topk + (rows - 1) * (depth - 1 + (1 if topk == 1 else 0))


def branch_layout(S, K, forks):
    """Parents of a branch draft's nodes, and each node's (row, step) ((-1, -1) for a leaf no row
    forwarded). Nodes: the root; the spine 1..S (node i at depth i, step i - 1 of row 0); the K - 1
    runners-up of each spine step s as children of spine node s (with K = 1, a branch head alone);
    then each branch's body, in row order. Row r's head is the first runner-up of step forks[r-1]."""
    parents = [-1] + list(range(S))
    order = [(-1, -1)] + [(0, s) for s in range(S)]
    head = {f: r for r, f in enumerate(forks, start=1)}
    head_node = {}
    for s in range(S):
        n_leaves = K - 1 if K > 1 else (1 if s in head else 0)
        for j in range(n_leaves):
            if j == 0 and s in head:
                head_node[head[s]] = len(parents)
                order.append((head[s], s))
            else:
                order.append((-1, -1))
            parents.append(s)  # spine node s (the root when s == 0) is step s's parent
    for r, f in enumerate(forks, start=1):
        prev = head_node[r]
        for s in range(f + 1, S):
            parents.append(prev)
            order.append((r, s))
            prev = len(parents) - 1
    return np.array(parents, np.int64), order
