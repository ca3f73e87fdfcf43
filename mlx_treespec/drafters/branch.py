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
        spine, runners, steps = [], [], []  # per step: row 0's token, its runners-up, all rows' tokens
        heads = []  # the runner-up each branch starts from
        for s in range(S):
            best = mx.argmax(logits, axis=-1).astype(mx.uint32)  # [R]: each row's greedy token
            free = len(forks) < R - 1 and s < S - 1  # a fork at the last step would be a leaf only
            if K > 1 or free:  # row 0's runners-up, best first ([0] heads a branch forked here)
                n = max(K - 1, 1)
                row0 = mx.put_along_axis(logits[0], best[:1].astype(mx.int32),
                                         mx.array(-mx.inf, logits.dtype), axis=-1)
                top = mx.argpartition(-row0, kth=n - 1)[:n]
                top = top[mx.argsort(-row0[top])].astype(mx.uint32)
                if K > 1:
                    runners.append(top[: K - 1])
            if free:
                if self.fork_below >= 1:  # every step is uncertain: no probability to read
                    fork = True
                else:
                    lse = mx.logsumexp(logits[0].astype(mx.float32))
                    fork = mx.exp(logits[0].astype(mx.float32).max() - lse).item() < self.fork_below
                if fork:
                    forks.append(s)
                    heads.append(top[:1])
            # row r's token: row 0's until its fork, the runner-up at it, its own greedy after
            src = [0] + [(r if forks[r - 1] < s else R) if r <= len(forks) else 0 for r in range(1, R)]
            if any(src):
                tok = mx.concatenate([best, top[:1]])[cached_array(np.array(src, np.int32))]
            else:
                tok = mx.broadcast_to(best[:1], (R,))
            spine.append(best[:1])
            steps.append(tok)
            if s < S - 1:
                logits = self._step(tok[:, None])
        parents, depths, visible, order = self._layout(S, tuple(forks))
        table = mx.stack(steps)  # [S, R]: row r's token at each step
        parts = [pending[-1:], mx.concatenate(spine)]
        if K > 1:
            parts.append(mx.concatenate(runners))
        elif heads:  # with no leaves, the runners-up branches start from are nodes of their own
            parts.append(mx.concatenate(heads))
        for r, f in enumerate(forks, start=1):
            if f + 1 < S:
                parts.append(table[f + 1 :, r])
        tokens = mx.concatenate(parts)
        return Draft(parents, tokens, self.budget, S, (S, tuple(forks), order, len(self.pending)),
                     depths=depths, visible=visible)

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
