"""A one-layer drafting head over the target's hidden states (an MTP layer, an EAGLE-3 head) as a
drafter: its chains and EAGLE-2 trees.

The head drafts like a small draft model (drafters/model.py: the same spine, siblings, lanes and
re-rank, through the same TreeRound over its own KV cache), with one input more: each node's
hidden state. A round's first forward runs the pending slots, one per token the target emitted
since the last draft: slot t takes the token at t + 1 and the target's hidden state at t (the
rows the loop captured), so its last slot predicts the first draft token. Every later node takes
its own token and the head's output hidden state at its parent. Only first-pass slots stay in
the head's cache: deeper nodes were computed from the head's own hidden states, which the next
round replaces with the target's.

Every shape also drafts from device values alone, for rounds queued ahead (queued.py):
`chain_ahead` writes the previous round's slots at a device offset (slot j: the token after row
j of the previous round's accepted path over the target's row j; the accepted count says which
are real, the last is the root's) and takes `depth` one-token steps after them, all in one
compiled function over whole K/V buffers (verify.whole_buffer_forward with the head as the
model); `tree_ahead` drafts a tree that keeps every candidate (fixed lanes: model.lanes_parents),
the same steps over each lane's row with their runners-up as leaves; `lanes_ahead` drafts any other tree
(EAGLE-2 lanes, ranked once, then each lane its own argmax) as the round loop's `_tree` does, a
compiled call a step. Step rows land after
the real slots and are overwritten by the next round's, as the round loop's head cache keeps
only first-pass slots. The compiled drafts are kept on the head (`_drafts`), shared by every
drafter over it, and see the head through a weak proxy: a library call makes a drafter per
generation, and each used to keep its drafts in itself, closures over it (a reference cycle:
its KV buffers waited for the garbage collector) traced again every generation.
"""
import functools
import weakref

import numpy as np
import mlx.core as mx

from ..draft import Draft, Layout
from ..spec import DEFAULT_DEPTH
from ..verify import grown, install, kernel_fits, whole_buffer_forward
from ..device_tree import top_k
from . import aranges
from .model import (ModelDrafter, _logprobs, keep_best, keeps_every_candidate, keeps_lanes_only, kept_nodes,
                    lane_candidates, lane_tree, lanes_layout, lanes_only_tree, root_children)

__all__ = ["HeadDrafter"]


def _additive(visible, dtype):
    """An attention mask from visibility (bool): 0 where seen, the dtype's lowest value elsewhere."""
    return mx.where(visible, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))


def _causal(columns, positions, dtype):
    """The additive mask of rows at `positions` written at their own columns: each sees the
    columns up to its own."""
    return _additive(columns[None] <= positions[:, None], dtype)


def _picker(draw):
    """`pick(logits, at, depth)`: what a queued step ranks its tokens by (ModelDrafter._scores
    inside a compiled draft; `at`, an input: the root's position and the draw's seed): the
    logits, or the draw's scores of them."""
    if draw is None:
        return lambda logits, at, depth: logits
    return lambda logits, at, depth: draw.at(logits, depth, at)


@functools.lru_cache(maxsize=64)
def _lane_spans(steps, lanes):
    """Each lane step's `start` less the base column (`whole_buffer_forward`): written at s L;
    every row sees the columns before s (one lane: its ancestors) or before the base (lanes:
    only their own rows after it); none from (s + 1) L on."""
    s = np.arange(steps)
    return mx.array(np.stack([s * lanes, s if lanes == 1 else 0 * s, (s + 1) * lanes], 1).astype(np.int32))


_NO_DRAW = (mx.array(0, mx.int32), mx.array(0, mx.uint32))  # a greedy draft's `at` (not read)


def _forget_samplers(store, key):
    """Where a draft is compiled for a new sampler setting (`key`), drops those compiled for
    other settings (a setting is a trace constant; the last one is what generations reuse).
    Kept meanwhile: a greedy generation compiles nothing new and drops none."""
    own = key[-1] if isinstance(key, tuple) and callable(key[-1]) else None
    for k in [k for k in store if isinstance(k, tuple) and k[0] in ("_compiled_ahead", "_compiled_lanes")
              and callable(k[-1]) and k[-1] is not own]:
        del store[k]


def _set_hidden(head, rows, first):
    """The head's next forward reads `rows` as its hidden-state input (`first`: target rows,
    through the head's first pass; else its own output hidden states)."""
    head.pending_hidden = rows
    if hasattr(head, "pending_first"):
        head.pending_first = first


def _slots(head, forward, tokens, slot_rows, count, L0, keys, values, ranges):
    """The slots' forward at L0.. (inside a compiled function): the last real slot's logits
    [1, V] and output hidden [1, H], then the K and V buffers (lists of one)."""
    P = tokens.shape[0]
    positions = L0 + ranges[1]
    _set_hidden(head, slot_rows, first=True)
    logits, _, ks, vs = forward(tokens, positions, _causal(ranges[0], positions, keys.dtype),
                                L0 + mx.array([0, 0, P], mx.int32), [keys], [values])
    last = (count - 1).reshape(1)
    return mx.take(logits, last, axis=0), mx.take(head.out_hidden[0], last, axis=0), ks, vs


class HeadDrafter(ModelDrafter):
    """`head`: an MTPHead or Eagle3Head bound to its target (drafters/mtp.py, drafters/eagle3.py);
    the shape options are a draft model's (`topk`, `lanes`, `depth`, `budget`); `vocab`: draft
    over that many token ids only (HeadModule.narrowed; 0: the whole vocabulary)."""

    def __init__(self, head, topk=1, depth=DEFAULT_DEPTH, budget=None, lanes=None, vocab=0,
                 prefill_step_size=2048):
        head = head.narrowed(vocab)
        super().__init__(head, topk=topk, depth=depth, budget=budget, lanes=lanes,
                         prefill_step_size=prefill_step_size)
        self.capture = tuple(head.capture)
        self.first_pass = getattr(head, "target_hidden", None)  # MTP: the target's final norm, if trained so

    def reset(self):
        super().reset()
        self.pending_hidden = None  # target rows of the pending slots [n, H or n*H]
        self._node_hidden = None  # the head's output hidden state of each round node [m, H]
        # rounds queued ahead: {L0: slots held (device), bound: a host bound on L0, entry: L0 after
        # the host's pending slots, prev: the last queued round's tokens, last: its slots' rows
        # and the count of them that are real}
        self._queued = None

    def _target_rows(self, hidden):
        return self.first_pass(hidden) if self.first_pass is not None else hidden

    def prefill(self, prompt, hidden=None):
        """The first pass over the prompt: slot t = (prompt[t + 1], the target's row t); the last
        slot stays pending, so the first draft runs it."""
        self.reset()
        if hidden is None:
            raise ValueError("a head drafter reads the target's hidden states: the loop passes them "
                             "(drafter.capture)")
        self.cache = self.model.make_cache()
        prompt = [int(t) for t in prompt]
        rows = self._target_rows(hidden) if hidden.shape[0] else hidden
        body = len(prompt) - 2  # slots 0 .. n-3 go in now
        self._first_pass(prompt[1 : body + 1], rows[: max(body, 0)])
        # pending: the last slot (the prompt's last token over the target's row n-2); a one-token
        # prompt has no row: its first draft has nothing to continue from
        if len(prompt) >= 2:
            self.pending, self.pending_hidden = prompt[-1:], rows[-1:]
        else:
            self.pending, self.pending_hidden = prompt[-1:], None

    def _first_pass(self, tokens, rows):
        """Slots (token t over the target's row t) into the head's cache, prefill_step_size at a time."""
        for i in range(0, len(tokens), self.prefill_step_size):
            j = min(i + self.prefill_step_size, len(tokens))
            self._set_hidden(rows[i:j], first=True)
            self.model(mx.array(tokens[i:j])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def _set_hidden(self, rows, first):
        _set_hidden(self.model, rows, first)

    def draft(self, root, max_depth):
        if self.pending_hidden is None:  # nothing to continue from (a one-token prompt)
            return Draft.root_only(root)
        return super().draft(root, max_depth)

    def _forward(self, rnd, tokens, parents=None, depth=None, rows=None, feeds=None):
        if feeds is None:  # the round's first pass: the pending slots over the target's rows
            self._set_hidden(self.pending_hidden, first=True)
            self._node_hidden = None
        else:
            feeds = feeds if isinstance(feeds, mx.array) else mx.array(np.asarray(feeds, np.int32))
            self._set_hidden(self._node_hidden[feeds], first=False)
        logits = super()._forward(rnd, tokens, parents, depth, rows, feeds)
        out = self.model.out_hidden[0][: tokens.shape[0]]
        self._node_hidden = out if self._node_hidden is None else mx.concatenate([self._node_hidden, out])
        return logits

    def commit(self, draft, path, emitted, hidden=None):
        # keep the first-pass slots only; every emitted token is a pending slot over its
        # target row (the root's, then the accepted nodes')
        state = draft.state
        if state is not None:
            state.rnd.keep(list(range(state.root_node + 1)))
            self.pending, self.pending_hidden = list(emitted), self._target_rows(hidden)
        elif self.pending_hidden is None:  # a one-token prompt: the root had no slot
            self.pending, self.pending_hidden = list(emitted), self._target_rows(hidden)
        else:  # nothing forwarded: the slots pile up
            self.pending = self.pending + list(emitted)
            self.pending_hidden = mx.concatenate([self.pending_hidden, self._target_rows(hidden)])

    # ------------------------------------------------------------------ rounds queued ahead

    @property
    def ahead(self):
        """`chain_ahead` for a chain, `tree_ahead` for a tree that keeps every candidate (fixed
        lanes), `lanes_ahead` for any other tree (queued.py)."""
        if self.topk == 1:
            return self.chain_ahead
        return self.tree_ahead if keeps_every_candidate(self.topk, self.lanes, self.depth, self.budget) \
            else self.lanes_ahead

    @property
    def queues_trees(self):
        """`ahead` drafts trees (every head tree queues: a fixed layout or EAGLE-2's, both built
        on the device)."""
        return self.topk > 1

    def chain_ahead(self, root, rows, count, path=None):
        """A chain of `depth` head steps from device values alone: `root` (mx uint32 [1]), the
        previous queued round's captured target rows along its accepted path `rows` (None in the
        first round: the host's pending slots go in) of which the first `count` (mx int32) were
        accepted, and that path's tokens `path` (root first; None: the previous round's chain).
        Returns the chain, mx uint32 [depth]."""
        return self._steps_ahead(root, rows, count, path, "chain")[0]

    def tree_ahead(self, root, rows, count, path=None):
        """The fixed lane tree from device values alone (`chain_ahead`'s arguments): its lanes,
        and each step's `topk - 1` runners-up as leaves, as the round loop drafts it
        (`ModelDrafter._lanes_and_siblings`)."""
        toks, logits, others = self._steps_ahead(root, rows, count, path, "tree")
        tokens = mx.concatenate([root.reshape(1).astype(mx.uint32), lane_tree(logits, toks, others, self.topk)])
        return Draft(tokens, lanes_layout(self.depth, self.topk, self.lanes), budget=self.budget,
                     depth=self.depth, forwards=self.depth)

    def lanes_ahead(self, root, rows, count, path=None):
        """The EAGLE-2 tree (`lanes` nodes expanded a step, the best `budget` candidates kept, or
        the lanes' own nodes: `keeps_lanes_only`) from
        device values alone (`chain_ahead`'s arguments): the round loop's `_tree` (a one-lane
        tree's spine is its steps' best candidate, where `_ranked_siblings` takes the argmax:
        they differ on exact ties only), each step one call of a compiled function."""
        tokens, layout = self._steps_ahead(root, rows, count, path, "lanes")
        return Draft(tokens, layout, budget=self._lanes_budget(), depth=self.depth, forwards=self.depth)

    def _lanes_budget(self):
        """The draft nodes an EAGLE-2 tree of `depth` steps keeps (`draft`'s rule at full depth)."""
        return kept_nodes(self.topk, self.lanes, self.depth, self.budget)

    def _steps_ahead(self, root, rows, count, path, kind):
        """The slots of the previous round's path, then the steps. `kind` "chain": (the chain of
        `depth` steps, mx uint32 [depth], None); "tree": (each depth's lane tokens [depth, L],
        the logits they came from [1 + (depth - 1) L, V], the root's other children or None:
        `lane_tree`'s inputs); "lanes": (the EAGLE-2 tree's tokens, its device Layout)."""
        q, c = self._queued, self.cache[0]
        lanes = 1 if kind == "chain" else self.lanes
        if q is None:  # the host's pending slots (the last is the root's); none: a one-token prompt
            n = 0 if self.pending_hidden is None else len(self.pending)
            if n > self.depth + 1:
                # slots piled up in rounds the head did not draft (an adaptive drafter's lookup
                # rounds): all but a round's worth go in as prefill does, so the compiled
                # function sees one slot count (each new count was a trace and a compile)
                k = n - self.depth - 1
                self._first_pass(self.pending[:k], self.pending_hidden[:k])
                self.pending, self.pending_hidden, n = self.pending[k:], self.pending_hidden[k:], self.depth + 1
            q = self._queued = dict(L0=mx.array(c.offset, mx.int32), bound=c.offset, entry=c.offset + n)
            if n == 0:
                # (no row to continue from: any guess is exact)
                chain = mx.zeros((self.depth,), mx.uint32)
                q.update(prev=mx.concatenate([root.reshape(1).astype(mx.uint32), chain]), last=None)
                if kind == "lanes":  # the root, a chain of zeros, the rest of the budget on the
                    # root as tokens 1.. (siblings distinct, as the walk asks)
                    nodes = self._lanes_budget() + 1
                    S = min(self.depth, nodes - 1)
                    parents = np.concatenate([np.arange(-1, S), np.zeros(nodes - S - 1, np.int64)])
                    leaves = mx.arange(1, nodes - S, dtype=mx.uint32)
                    tokens = mx.concatenate([root.reshape(1).astype(mx.uint32), chain[:S], leaves])
                    # (on the device only, as every later lane tree's: queued rounds keep one
                    # commit rule, and this layout would read as spine-first)
                    return tokens, Layout.on_device(*Layout.fixed(parents).device)
                if kind == "tree":  # every lane a chain of zeros, its first token its number, and
                    # leaves ranked from logits of zeros over topk + lanes tokens (siblings distinct)
                    L, K, S = self.lanes, self.topk, self.depth
                    toks = mx.concatenate([mx.arange(L, dtype=mx.uint32)[None], mx.zeros((S - 1, L), mx.uint32)])
                    others = None if L == 1 else mx.arange(L, K, dtype=mx.uint32)
                    return toks, mx.zeros((1 + (S - 1) * L, K + L)), others
                return chain, None
            P = self.depth + 1  # padded to a round's slot count: one trace for both
            tokens = mx.array(self.pending + [0] * (P - n), mx.uint32)
            slot_rows = mx.pad(self.pending_hidden, ((0, P - n), (0, 0)))
            count = mx.array(n, mx.int32)
        else:  # slot j: the token after row j of the path (the last accepted one's: the root)
            prev = q["prev"] if path is None else path
            P = prev.shape[0]
            tokens = mx.where(aranges(P)[0] == count - 1, root.astype(mx.uint32),
                              mx.concatenate([prev[1:], prev[:1]]))
            slot_rows = self._target_rows(rows[:P])
        P = tokens.shape[0]
        keys, values = self._buffers(q["bound"] + P + self.depth * lanes)
        ranges = aranges(keys.shape[2], P, max(self.depth - 1, 1), self.topk)
        at = _NO_DRAW if self.draw is None else (self.draw.position, self.draw.seed)  # (the queue's)
        out = self._ahead_fn(kind)(tokens, slot_rows, count, q["L0"], keys, values, ranges, at)
        c.keys, c.values = out[-2:]
        first = out[0]
        q.update(L0=q["L0"] + count, bound=q["bound"] + P, last=(slot_rows, count))
        self.forwards = self.depth
        if kind == "lanes":  # (a tree round's next slots are its accepted path: `path`)
            q["prev"] = mx.zeros((P,), mx.uint32)
            root = root.reshape(1).astype(mx.uint32)
            return mx.concatenate([root, first[1:]]), Layout.on_device(*out[1:4])
        spine = first if kind == "chain" else first[:, 0]
        q["prev"] = mx.concatenate([root.reshape(1).astype(mx.uint32), spine])
        return out[:-2]

    def _buffers(self, rows):
        """The head cache's K/V buffers with room for `rows` rows (made where the cache holds none)."""
        c = self.cache[0]
        if c.keys is None:
            at = next(m for _, m in self.model.named_modules() if hasattr(m, "o_proj") and hasattr(m, "rope"))
            n_kv = getattr(at, "num_key_value_heads", None) or at.n_kv
            k = at.k_proj  # (what makes the keys)
            dtype = getattr(k, "scales", k.weight).dtype  # (a quantized head's weight is uint32)
            c.keys = c.values = mx.zeros((1, n_kv, 0, at.head_dim), dtype)
        return grown(c.keys, rows), grown(c.values, rows)

    def _ahead_fn(self, kind):
        """The slots' forward and `depth` steps: (slot tokens [P], their target rows, real slots,
        L0, K, V, the root's position and the draw's seed (read at temp > 0: `ModelDrafter._scores`)) -> `kind`'s
        outputs (`_steps_ahead`: a chain, or a fixed lane tree's lane tokens, scores and root
        leaves; or the EAGLE-2 tree's tokens, root 0, parents, depths, ancestor rows), then K
        and V. A chain or fixed lane tree is one compiled function (traced per slot count and
        buffer width, and per sampler setting: constants of the trace, the seed an input); so is an
        EAGLE-2 tree that keeps its lanes (`keeps_lanes_only`); another EAGLE-2 tree calls
        `_lanes_fns`' compiled functions, one a step."""
        key, store = self._ahead_key(kind), self._drafts
        fn = store.get(key)
        if fn is not None:
            return fn
        _forget_samplers(store, key)
        install(self.model)
        # (the head's store holds the draft: a weak reference in it leaves the head no cycle)
        head, depth, K, L = weakref.proxy(self.model), self.depth, self.topk, (1 if kind == "chain" else self.lanes)
        # (the tree-attention kernel where the verify's rule takes it, and in a chain's one-row
        # steps at any width: `kernel_fits`, `attention.fits`)
        forward = whole_buffer_forward(head, (), kernel=kernel_fits([self.cache[0].keys]), steps=True)
        pick = _picker(self.draw)

        def chain(tokens, slot_rows, count, L0, keys, values, ranges, at):
            # (a fixed lane tree's L lanes too: every step forwards each lane's last node, a chain
            # step's kernels over L rows; lane j's step s row is column base + s L + j)
            root_logits, hidden, ks, vs = _slots(head, forward, tokens, slot_rows, count, L0, keys, values, ranges)
            root_logits = pick(root_logits, at, 0)
            if L == 1:
                tok, others = mx.argmax(root_logits, axis=-1).astype(mx.uint32), None
            else:
                tok, others = root_children(root_logits, K, L)
                hidden = mx.broadcast_to(hidden, (L, hidden.shape[-1]))
            toks, rows = [tok], [root_logits]
            # every step's positions, masks and bounds at once: a step then slices them (views),
            # where making its own would launch three kernels a step. A row sees the columns
            # before the base and its own lane's step rows up to its own
            base = L0 + count
            pos = base + ranges[2]
            rel = (ranges[0] - base)[None, None]  # [1, 1, W]
            lane = ranges[3][:L][None, :, None]  # [1, L, 1]
            last = ranges[2][:, None, None] * L + lane  # [S - 1, L, 1]: each row's own column
            masks = _additive((rel < 0) | ((rel <= last) & (rel % L == lane)), keys.dtype)
            spans = base + _lane_spans(max(depth - 1, 1), L)
            for s in range(depth - 1):  # each step over its parents' output hidden, after the real slots
                _set_hidden(head, hidden, first=False)
                step_at = pos[s : s + 1] if L == 1 else mx.broadcast_to(pos[s : s + 1], (L,))
                logits, _, ks, vs = forward(tok, step_at, masks[s], spans[s], ks, vs)
                hidden = head.out_hidden[0]
                logits = pick(logits, at, s + 1)
                tok = mx.argmax(logits, axis=-1).astype(mx.uint32)
                toks.append(tok)
                rows.append(logits)
            if kind == "chain":
                return mx.concatenate(toks), None, ks[0], vs[0]
            return mx.stack(toks), mx.concatenate(rows), others, ks[0], vs[0]

        def lanes(tokens, slot_rows, count, L0, keys, values, ranges, at):
            # ModelDrafter._tree's steps: step s (1..S-1) forwards the L lanes at depth s
            # (position base + s - 1) into columns base + (s - 1) L.., each seeing the history
            # and the real slots (the columns before base) and, among the R step rows, its
            # ancestors and itself. Each step is one call of one compiled function whose arrays
            # keep their shapes from step to step (the step is an input): unrolled, every step's
            # shapes differed and each was a kernel compile of its own on a fresh GPU (minutes).
            # A tree that keeps its lanes compiles this whole function: its argmax steps share
            # one shape
            start, step, argmax_inputs, argmax_step, rank, steps = lanes_fns
            state, first, ks, vs = start(tokens, slot_rows, count, L0, keys, values, ranges, at)
            later, own = [], ()
            for own_rows, offsets in steps:
                state, made, ks, vs = step(own_rows, offsets, state, ks, vs)
                later.append(made)
            if len(steps) < depth - 1:  # steps past the ranked ones: each lane by its own argmax
                masks, positions, starts, drawn_at = argmax_inputs(state, ks)
                toks, hidden, logits, argmaxes = state[4], state[7], [], []
                for g in range(masks.shape[0]):  # (slices of arrays made once: views)
                    toks, hidden, made, ks, vs = argmax_step(masks[g], positions[g], starts[g], toks, hidden,
                                                             ks, vs, (drawn_at[g], at[1]))
                    logits.append(made)
                    argmaxes.append(toks)
                own = (state[5], state[6], logits, argmaxes)
            return (*rank(first, later, own), ks[0], vs[0])

        if kind != "lanes":
            fn = store[key] = mx.compile(chain)
            return fn
        lanes_fns = self._lanes_fns(forward)
        # a tree that keeps its lanes grows no candidate list: every step after the ranked one
        # has the same shapes, so the whole draft is one compiled call, as a chain's (each
        # step's call was host time of its own in a queued round)
        whole = keeps_lanes_only(K, L, depth, self._lanes_budget(), self.ranked_lane_steps)
        fn = store[key] = mx.compile(lanes) if whole else lanes
        return fn

    def _ahead_key(self, kind):
        """Where `_ahead_fn` keeps `kind`'s compiled draft in `_drafts`: per shape (an adaptive
        default's differs by temperature: `reshape`; an EAGLE-2 tree's by its budget and ranked
        steps too) and sampler setting."""
        lanes = (self.budget, self.ranked_lane_steps) if kind == "lanes" else ()
        return ("_compiled_ahead", kind, self.topk, self.lanes, self.depth) + lanes + (
            () if self.draw is None else (self.draw.scores,))

    @property
    def _drafts(self):
        """The compiled queued drafts of this head, by `_ahead_key` (and `_lanes_fns`' key): kept
        on the head and shared by every drafter over it (module docstring); a draft
        vocabulary's copy of it (`narrowed`) has its own, gone with it."""
        return self.model.__dict__.setdefault("_treespec_drafts", {})

    def _lanes_fns(self, forward):
        """`_ahead_fn`'s EAGLE-2 tree as compiled functions and each step's constants: `start`
        (the slots' forward and the root's children: the lanes' state), `step` (one ranked
        step of the lanes; it gives out that step's candidates), `argmax_inputs` (the masks,
        positions and bounds of every later step, at once), `argmax_step` (one step in which
        each lane goes on by its own argmax: a chain step's work over L rows) and `rank` (the
        argmax steps' candidates, then keep_best over every candidate; where the budget is the
        lanes' own nodes, `lanes_only_tree`). The state: the base
        column, the round's column masks (history; step rows; each column's step row), the
        lanes' tokens, scores, candidate ids, parents' output hidden and visible step rows
        [L, R]. A ranked step's candidates: tokens and scores [L * K] and the lanes' candidate
        ids [L] (their parents).

        Queued rounds are host-bound on a GPU, and every kernel a step launches costs host time:
        what does not change within a round (its column masks, the argmax steps' masks) is made
        once in `start` or `argmax_inputs`, what does not change between rounds (each step's
        own rows, offsets) once per drafter, and the candidates are joined once in `rank`
        rather than written a step at a time."""
        key, store = ("_compiled_lanes",) + self._ahead_key("lanes")[2:], self._drafts
        fns = store.get(key)
        if fns is not None:
            return fns
        _forget_samplers(store, key)
        head, S, K, L = weakref.proxy(self.model), self.depth, self.topk, self.lanes  # (as `_ahead_fn`'s)
        budget = self._lanes_budget()
        pick = _picker(self.draw)
        R = (S - 1) * L  # step rows
        ranked = min(self.ranked_lane_steps, S - 1)

        def start(tokens, slot_rows, count, L0, keys, values, ranges, at):
            logits, hidden, ks, vs = _slots(head, forward, tokens, slot_rows, count, L0, keys, values, ranges)
            idx, lp = top_k(_logprobs(pick(logits, at, 0)), K)  # the root's children
            scores = mx.minimum(lp[0], 0)
            choice = ranges[3] if L == K else mx.argsort(-scores)[:L]
            base = (L0 + count).astype(mx.int32)
            rel = ranges[0] - base  # the step rows' columns are 0..R-1
            state = (base, rel < 0, (rel >= 0) & (rel < R), mx.clip(rel, 0, R - 1),
                     idx[0][choice].astype(mx.uint32), scores[choice], choice.astype(mx.int32),
                     mx.broadcast_to(hidden, (L, hidden.shape[-1])), mx.zeros((L, R), mx.bool_), at)
            return state, (idx[0].astype(mx.uint32), scores.astype(mx.float32)), ks, vs

        def step(own, offsets, state, ks, vs):
            # own: [L, R] each lane's own step row; offsets: the forward's `start` less the base
            # column (its first step row, 0, R), its position less the base, its first candidate id
            base, history, window, column, lane_tokens, lane_scores, lane_cands, lane_hidden, lane_seen, at = state
            rows = lane_seen | own  # [L, R]
            mask = _additive(history[None] | (window[None] & mx.take(rows, column, axis=1)), ks[0].dtype)
            _set_hidden(head, lane_hidden, first=False)
            logits, _, ks, vs = forward(lane_tokens, mx.broadcast_to(base + offsets[3], (L,)), mask,
                                        base + offsets[:3], ks, vs)
            idx, lp = top_k(_logprobs(pick(logits, at, offsets[3] + 1)), K)  # (the lanes' depth: step s)
            scores = (lane_scores[:, None] + mx.minimum(lp, 0)).reshape(-1)
            choice = mx.argsort(-scores)[:L]  # the next lanes among this step's L * K
            parent = choice // K
            state = (base, history, window, column, idx.reshape(-1)[choice].astype(mx.uint32), scores[choice],
                     (offsets[4] + choice).astype(mx.int32), head.out_hidden[0][parent], rows[parent], at)
            return state, (idx.reshape(-1).astype(mx.uint32), scores.astype(mx.float32), lane_cands), ks, vs

        # the argmax steps (ranked + 1 .. S - 1): step s's lane i writes step row (s - 1) L + i
        # and sees what its lane saw entering them, and its own rows of these steps up to s
        argmax_steps = np.arange(ranked + 1, S)
        own_after = np.zeros((len(argmax_steps), L, R), bool)
        for g, s in enumerate(argmax_steps):
            for t in argmax_steps[: g + 1]:
                own_after[g, np.arange(L), (t - 1) * L + np.arange(L)] = True
        own_after = mx.array(own_after)
        argmax_offsets = mx.array(np.stack([(argmax_steps - 1) * L, 0 * argmax_steps, R + 0 * argmax_steps], 1)
                                  .astype(np.int32).reshape(-1, 3))
        argmax_positions = mx.array(np.repeat((argmax_steps - 1)[:, None], L, 1).astype(np.int32))

        def argmax_inputs(state, ks):
            base, history, window, column, _, _, _, _, lane_seen, at = state
            rows = lane_seen[None] | own_after  # [G, L, R]
            visible = history[None, None] | (window[None, None] & mx.take(rows, column, axis=2))
            # (the draw's positions: step s's lanes are at depth s)
            return _additive(visible, ks[0].dtype), base + argmax_positions, base + argmax_offsets, \
                at[0] + argmax_positions + 1

        def argmax_step(mask, positions, bounds, lane_tokens, lane_hidden, ks, vs, drawn_at):
            _set_hidden(head, lane_hidden, first=False)
            logits, _, ks, vs = forward(lane_tokens, positions, mask, bounds, ks, vs)
            logits = pick(logits, drawn_at, 0)
            return mx.argmax(logits, axis=-1).astype(mx.uint32), head.out_hidden[0], logits, ks, vs

        depths = np.concatenate([np.ones(K, np.int32), np.repeat(np.arange(2, S + 1, dtype=np.int32), L * K)])

        def rank_every(first, later, own):
            # candidates in creation order: the root's K children, then each step's L * K (the
            # children of that step's lanes, K each)
            c_tok = [first[0]] + [t for t, _, _ in later]
            c_score = [first[1]] + [c for _, c, _ in later]
            c_parent = [mx.full((K,), -1, mx.int32)]
            if later:
                lanes = mx.stack([p for _, _, p in later])[:, :, None]  # [steps, L, 1]
                c_parent.append(mx.broadcast_to(lanes, (len(later), L, K)).reshape(-1))
            if own:
                tok, score, parent, _ = lane_candidates(own[0], own[1], mx.stack(own[2]), mx.stack(own[3]),
                                                        K + len(later) * L * K, K)
                c_tok.append(tok.astype(mx.uint32))
                c_score.append(score.astype(mx.float32))
                c_parent.append(parent)
            _, parents, tree_depths, tokens, anc = keep_best(
                mx.zeros((1,), mx.uint32), mx.concatenate(c_tok), mx.concatenate(c_score),
                mx.concatenate(c_parent), depths, budget)
            return tokens, parents, tree_depths, anc

        def rank_lanes(first, later, own):  # (`keeps_lanes_only`: the lanes are the tree)
            choice = own[1] - K
            return lanes_only_tree(K, L, S)(mx.zeros((1,), mx.uint32), first[0], later[0][2], choice,
                                            mx.take(later[0][0], choice), mx.stack(own[3]))

        rank = rank_lanes if keeps_lanes_only(K, L, S, budget, self.ranked_lane_steps) else rank_every

        # each ranked step's constants, made once (a host array each round waits on the queue to
        # be copied, and one made inside a step is a launch of its own)
        steps = []
        for s in range(1, ranked + 1):
            own = np.zeros((L, R), bool)
            own[np.arange(L), (s - 1) * L + np.arange(L)] = True
            first = (s - 1) * L
            steps.append((mx.array(own), mx.array([first, 0, R, s - 1, K + first * K], mx.int32)))
        fns = store[key] = (mx.compile(start), mx.compile(step), mx.compile(argmax_inputs),
                            mx.compile(argmax_step), mx.compile(rank), steps)
        return fns

    def queued_read(self, emitted):
        """The host read queued rounds that emitted `emitted` tokens, and the next round's
        chain is queued: it wrote their slots, so the head holds entry + emitted of them."""
        if self._queued is not None:
            self._queued["bound"] = self._queued["entry"] + emitted

    def handed_back(self, start, tokens):
        """Queued rounds ended having emitted `tokens` (the last the next root); the round loop
        drafts next. The round queued past the end wrote every slot, the root's too: the root's
        goes back to pending (the round loop's first pass runs it), over its target row."""
        q, c = self._queued, self.cache[0]
        c.offset = q["entry"] + len(tokens) - 1
        slot_rows, count = q["last"]
        self.pending = [int(tokens[-1])]
        self.pending_hidden = mx.take(slot_rows, (count - 1).reshape(1), axis=0)
        self._queued = None

    def requeue(self):
        """Rounds are queued again: the next chain starts from the host's pending slots."""
        self._queued = None
