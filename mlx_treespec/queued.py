"""Rounds queued ahead: chain and tree rounds with no host sync between them.

The round loop (loop.py) syncs once a round: the host walks what the target verified before it
builds the next round, so the device idles while Python works. A draft made from device values
alone (a drafter's `ahead`) needs nothing of the host, so round r + 1 is queued before the host
reads round r's tokens, as mlx-lm's generate_step queues the next token before it reads this
one: a chain's walk is a prefix match, a tree's runs on the device (device_tree.walk), and the
next round re-runs a tree's accepted path instead of moving K/V rows. A hybrid's recurrent
layers keep every row's state (`gdn.DevicePlan`) and commit by a read at the accepted count.
Stopping is decided on the host one round late; rows past the committed offset are dead.
The contract, where it runs (`can_queue`) and the hand-over to and from the round loop
(`queue_more`, `handed_back`, `requeue`): docs/design.md, "Chains queued ahead" and "Trees
queued ahead".
"""
import time

import numpy as np
import mlx.core as mx

from . import verify
from .cache import cache_kind
from .device_tree import walk
from .draft import Draft
from .tree import depths_of
from .verify import compiled_forward, grown, kernel_fits, whole_buffer_forward, width_step
from .walk import cut_at_stop

__all__ = ["can_queue", "queued_rounds"]


def can_queue(drafter, caches, kv_bits):
    """Whether a generation's rounds may be queued ahead (see the module docstring)."""
    return (getattr(drafter, "ahead", None) is not None and kv_bits is None
            and verify.pad_keys_default() and any(type(c).__name__ == "KVCache" for c in caches)
            and all(_queueable(c) for c in caches))


def _queueable(cache):
    """A plain KV cache, or a recurrent layer's state (the gate admits GatedDeltaNet layers only),
    holding the prompt."""
    if type(cache).__name__ == "KVCache":
        return cache.keys is not None
    return (cache_kind(cache) == "arrays" and cache[1] is not None and cache.lengths is None
            and cache.left_padding is None)


def queued_rounds(model, caches, drafter, prompt, hidden, capture, max_tokens, choose, stop_tokens, stats, land,
                  resume=None):
    """Yields (token, logprobs, from_draft) as loop.tree_generate_step; `choose` is the target's
    token at a node (sampling.make_node_sampler: greedy, or a draw keyed by the node's
    position, so a queued round's draws are plain sampled decoding's). `land(token, failed)`
    forwards a delivered token the caches do not hold (the prompt cache's rule; `failed`: an
    error, not the consumer's stop, ends the generation). `resume`: (root, tokens emitted
    so far) where the round loop handed the generation over (None: from the prompt). Returns
    None at the end of the generation, or (root, tokens emitted) where the drafter's
    `queue_more` handed it back: the caches then hold every emitted token but `root`, and no
    token is held."""
    root, n = resume if resume is not None else (prompt[-1], 0)
    scans = frozenset(i for i, c in enumerate(caches) if cache_kind(c) == "arrays")  # recurrent layers
    # per layer: K/V buffers, or a recurrent layer's (conv state, recurrent state)
    keys = [c[0] if i in scans else c.keys for i, c in enumerate(caches)]
    values = [c[1] if i in scans else c.values for i, c in enumerate(caches)]
    kv = sorted(set(range(len(caches))) - scans)  # attention layers
    first_kv = kv[0]
    kernel = kernel_fits([k for i, k in enumerate(keys) if i not in scans])
    ahead, eager = drafter.ahead, whole_buffer_forward(model, capture, scans, kernel)
    drafting = getattr(ahead, "__self__", None)  # the drafter whose `ahead` it is: its forwards per draft
    settled = {i: (keys[i], values[i]) for i in scans}  # recurrent states at the host's `start`
    start = caches[first_kv].offset  # host: rows the caches hold (all but `root`, the pending token)
    # the most rows the rounds queued so far may have committed: the host's `start`, then what
    # the rounds it has not read may commit at most (room is made for a round's rows past it)
    bound = start
    consts = {}  # a round's constants per (width, rows): the rounds are host-bound
    in_place = None  # tree rounds: whether they commit their paths in place (`_spine_first`)
    draw = getattr(drafter, "draw", None)  # at temp > 0: the drafter guesses draws from the root's position
    chosen = _chooser(choose)

    def mask_constants(width, T, dtype):
        key = (width, T, dtype)
        if key not in consts:
            consts[key] = (mx.arange(width)[None], mx.arange(T, dtype=mx.int32), mx.array(0, dtype),
                           mx.array(mx.finfo(dtype).min, dtype), mx.array([0, 0, T], mx.int32),
                           mx.arange(-1, T - 1, dtype=mx.int32))
        return consts[key]

    def queue(dev_root, rows, count, dev_start, path=None):
        """One round on the device: draft, verify, walk, commit. `dev_start`: the root's column.
        A tree round after a tree round first re-runs what that round left out of place (`path`:
        its accepted path's tokens, root first, the first `count` accepted): a tree of any shape
        re-runs the whole path from the committed offset and hangs from its end; a spine-first
        tree (`_spine_first`: its path is in place but for an accepted leaf) re-runs the path's
        last node at its own column, just before the root."""
        nonlocal keys, values, bound, in_place
        if draw is not None:  # the root's position: after the re-run path's accepted rows, where one leads
            draw.position = dev_start + count if path is not None and not in_place else dev_start
        # draft (a tree round's drafter also reads the path the previous tree round accepted)
        drafted = ahead(dev_root, rows, count) if path is None else ahead(dev_root, rows, count, path)
        tree = isinstance(drafted, Draft)
        # a tree round commits at most its depth + 1 (Draft.depth bounds the tree's depths: a
        # re-run path is that many rows)
        most = min(drafted.depth, drafted.tokens.shape[0] - 1) + 1 if tree else None
        if tree:
            spine = _spine_first(drafted.layout)
            if in_place is None:  # (a drafter's trees keep one kind: each round commits the last)
                in_place = spine
            elif spine != in_place:
                raise ValueError("queued tree rounds changed kind (spine-first or not) between rounds")
            if in_place:  # the last path's last node (the first round: none), then the tree
                m = 0 if path is None else 1
                tokens = drafted.tokens if path is None else \
                    mx.concatenate([mx.take(path, (count - 1).reshape(1)), drafted.tokens])
            else:
                if path is None:  # (the first round re-runs nothing: the same shapes, none accepted)
                    path, count = mx.zeros((most,), mx.uint32), mx.array(0, mx.int32)
                m = path.shape[0]
                tokens = mx.concatenate([path, drafted.tokens])
        else:
            m, tokens = 0, mx.concatenate([dev_root, drafted])
        T = tokens.shape[0]  # the rows this round writes, from `at`
        at = dev_start - m if in_place else dev_start
        width = keys[first_kv].shape[2]
        # room for this round's rows, in width_step() steps (a prefill's buffer is mlx-lm's
        # width: its first rounds would be shapes of their own, each a trace and checks)
        if bound + T > width or width % width_step():
            keys = [k if i in scans else grown(k, bound + T) for i, k in enumerate(keys)]
            values = [v if i in scans else grown(v, bound + T) for i, v in enumerate(values)]
        columns, steps, zero, low, spans, chain = mask_constants(keys[first_kv].shape[2], T, keys[first_kv].dtype)
        if tree:
            parents, depths, visible = drafted.layout.device
            if in_place:
                offsets, seen, own, scan_parents = _spine_rows(drafted.layout.parents, m)
                positions, mask = _spine_layout(columns, at, offsets, seen, own, zero, low)
            else:
                positions, mask = _replay_layout(columns, steps, dev_start, count, depths, visible, zero, low)
                scan_parents = _replay_parents(parents, m, count) if scans else None
        else:  # the history and the chain before each row
            positions = dev_start + steps
            mask = mx.where(columns <= positions[:, None], zero, low)
        # written at `at`; every row sees the columns before it, none from at + T on
        args = (tokens, positions, mask, at + spans, keys, values)
        if scans:  # recurrent layers keep every row's state: a chain; a tree's rows after their parents
            args += (scan_parents if tree else chain,)

        def reference():
            out, h, k, v = eager(*args)
            return out, (h[0][:T] if h else None), k, v

        res = compiled_forward(model, capture, T, args, reference, kernel, scans)  # verify
        logits, rows, keys, values = reference() if res is None else res[0]
        if tree:                                                                              # walk
            choice = chosen(logits[m:], positions[m:])
            count_now, order, choice = walk(choice, drafted.tokens, parents, depths, visible)  # path first
        else:
            choice = chosen(logits, positions)
            count_now = mx.sum(mx.cumprod((drafted == choice[:-1]).astype(mx.int32))) + 1
        # commit: no K/V row moves (a chain's accepted rows are the first `count_now`; a tree's
        # path is re-run by the next round: a gather per layer costs more launches than the
        # rows). Recurrent layers: the states after the round's chain's committed rows (a
        # re-run path's accepted ones; a spine-first round's through its path's last node but
        # one, which the next round re-runs)
        payloads = {i: keys[i] for i in scans}
        states = replay_prefix(payloads, (count_now - 1 + m if in_place else count) if tree else count_now)
        for i, (conv, state) in states.items():
            keys[i], values[i] = conv, state
        if tree:
            logits = logits[m:][order]
            rows = None if rows is None else rows[m:][order]
            bound += most
            shape = (drafted.tokens.shape[0], drafted.depth, drafted.budget)
            return (choice[count_now - 1].reshape(1), rows, count_now,
                    dev_start + (count_now if in_place else count), drafted.tokens[order[:most]]), \
                (logits, choice, count_now, payloads, states, shape, m, most)
        bound += T
        return (choice[count_now - 1].reshape(1), rows, count_now, dev_start + count_now), \
            (logits, choice, count_now, payloads, states, (T, T - 1, T - 1), m, T)

    more = getattr(drafter, "queue_more", None)
    delivered, accepted, handed, everything, failed = 0, 0, False, [], False
    trees = False  # the rounds are trees (their recurrent states lag a round: see `settled`)
    try:  # (from the first call: an error anywhere still lands the pending root)
        verify.install(model)  # per-token RoPE positions
        if resume is None:
            drafter.prefill(prompt, hidden)
        else:
            drafter.requeue(root)
        nxt, out = queue(mx.array([root], mx.uint32), None, None, mx.array(start, mx.int32))
        trees = len(nxt) == 5  # (a tree round hands the next its path to re-run)
        mx.async_eval(out[1], out[2])
        tic = time.perf_counter()
        read = getattr(drafter, "queued_read", None)
        first = n  # tokens emitted before this stretch of queued rounds
        while True:
            logits, choice, count, payloads, states, shape, rerun, _ = out
            nxt, out = queue(*nxt)  # round r + 1, queued before round r is read
            mx.async_eval(out[1], out[2])
            ts = time.perf_counter()
            accepted = count.item() - 1
            emitted = np.array(choice)[: accepted + 1].tolist()
            toc = time.perf_counter()
            emitted = cut_at_stop(emitted if max_tokens < 0 else emitted[: max_tokens - n], stop_tokens)
            nodes, depth, budget = shape
            stats.record(accepted=min(accepted, len(emitted)), emitted=len(emitted), nodes=nodes, depth=depth, held=0,
                         budget=budget, requested_depth=depth, draft_ms=0.0,
                         verify_ms=1e3 * (toc - tic), round_ms=1e3 * (toc - tic),
                         sync_ms=1e3 * (toc - ts), walk_ms=0.0, draft_forwards=getattr(drafting, "forwards", 1),
                         drafter="queued")
            ms, tic = 1e3 * (toc - tic), toc
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            delivered = 0
            for i, t in enumerate(emitted):
                delivered = i + 1
                yield t, logprobs[i], i < accepted
            n += len(emitted)
            everything += emitted
            if len(emitted) < accepted + 1 or emitted[-1] in stop_tokens or n == max_tokens:
                break
            start, root, delivered = start + accepted + 1, emitted[-1], -1  # round r is whole
            # (a tree's path is committed by the round after it: round r + 1, queued above; a
            # spine-first path's last node is its first row; taken at the end, where needed)
            settled = (out[3], 1) if in_place else out[4] if trees else states
            bound = start + out[-1]  # (round r + 1 is under way: it may commit this many)
            if read is not None:
                read(n - first)
            if more is not None and not more(emitted, ms):
                handed = True
                break
    except GeneratorExit:
        raise
    except BaseException:
        failed = True  # an error, not the consumer's stop: `land` may not forward (loop._may_settle)
        raise
    finally:
        # the caches: every row a delivered token needs; rows queued past them are dead
        if delivered > 0:
            kept = min(delivered, accepted)  # accepted drafts delivered are in the rows
            pending = None if delivered <= accepted else emitted[accepted]
            start, root = start + kept + 1, pending
            if in_place:  # the path's last node is round r + 1's first row; a prefix is r's own
                settled = (out[3], 1) if kept == accepted else (payloads, rerun + kept + 1)
            elif trees:  # round r's path is round r + 1's re-run (`out`: queued before r was read)
                settled = out[4] if kept == accepted else (out[3], kept + 1)
            else:
                settled = states if kept == accepted else (payloads, kept + 1)
        if isinstance(settled, tuple):  # (payloads, n): the states after their chain's first n rows
            settled = replay_prefix(settled[0], mx.array(settled[1], mx.int32))
        for i, c in enumerate(caches):
            if i in scans:
                c[0], c[1] = settled[i]
            else:
                c.keys, c.values, c.offset = keys[i], values[i], start
        if root is not None and not handed:
            land(root, failed)
    if handed:  # the queued round past this one wrote only rows a round may write (dead past `start`)
        try:
            drafter.handed_back(start, everything)
        except BaseException:  # (the caches lack the root, the last token delivered: it lands)
            land(root, True)
            raise
        return root, n
    return None


def _chooser(choose):
    """(logits, positions) -> the target's token after each row: the argmax of its
    log-probabilities in the model's dtype, as mlx-lm's greedy step takes it (the logits'
    own argmax differs where two logits round to one bfloat16 log-probability: mlx-lm takes
    the lower id), or `choose`'s draw at the row's position."""
    if choose.greedy:
        return lambda logits, positions: mx.argmax(
            logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1).astype(mx.uint32)
    return choose


def _spine_length(parents):
    """S where a tree's nodes 0..S are a chain in row order (its spine), node 0 the root."""
    return int(np.cumprod(parents[1:] == np.arange(len(parents) - 1)).sum())


_SPINE_FIRST = {}  # id(layout) -> (layout, whether it is spine-first): fixed layouts repeat


def _spine_first(layout):
    """Whether a tree's nodes 0..S are its spine and each other node hangs from one of them (a
    one-lane tree; a chain): each node's ancestors are then the rows up to its parent's, so a
    path lands in place as a chain's does, but for an accepted leaf (its last node)."""
    p = layout.parents
    if p is None:  # (ranked on the device: any shape)
        return False
    hit = _SPINE_FIRST.get(id(layout))
    if hit is None or hit[0] is not layout:
        if len(_SPINE_FIRST) >= 64:
            _SPINE_FIRST.clear()
        S = _spine_length(p)
        hit = _SPINE_FIRST[id(layout)] = (layout, bool((p[S + 1:] <= S).all()))
    return hit[1]


_SPINE_ROWS = {}  # (parents, re-run rows) -> `_spine_rows`' device constants


def _spine_rows(parents, m):
    """A spine-first tree's row constants after m (0 or 1) re-run rows, as offsets from the
    round's first column: each row's position, the last column of the prefix it sees (a spine
    node: itself; a leaf: its parent), its own column; and its recurrent layers' parents (the
    re-run row from the committed state, the root after it)."""
    key = (parents.tobytes(), m)
    hit = _SPINE_ROWS.get(key)
    if hit is None:
        if len(_SPINE_ROWS) >= 64:
            _SPINE_ROWS.clear()
        n = len(parents)
        seen = np.where(np.arange(n) <= _spine_length(parents), np.arange(n), parents)
        head = np.zeros(m, np.int32)
        hit = _SPINE_ROWS[key] = tuple(mx.array(a.astype(np.int32)) for a in (
            np.concatenate([head, m + depths_of(parents)]), np.concatenate([head, m + seen]), np.arange(m + n),
            np.concatenate([head - 1, np.where(parents < 0, m - 1, parents + m)])))
    return hit


@mx.compile
def _spine_layout(columns, at, offsets, seen, own, zero, low):
    """A spine-first round's positions and additive mask, its rows written from column `at`:
    each row sees the columns up to at + seen and its own."""
    rel = columns - at
    return at + offsets, mx.where((rel <= seen[:, None]) | (rel == own[:, None]), zero, low)


@mx.compile
def _tree_mask(rel, visible, zero, low):
    """The additive mask of a tree round written at the columns where `rel` (column - start,
    [1, W]) is 0..T-1: every column before them, and among them each row's ancestors and itself
    (`visible` [T, T])."""
    T = visible.shape[0]
    seen = mx.take(visible, mx.clip(rel[0], 0, T - 1), axis=1)  # [T, W]
    return mx.where((rel < 0) | ((rel < T) & seen), zero, low)


@mx.compile
def _replay_layout(columns, steps, start, count, depths, visible, zero, low):
    """A tree round's positions and additive mask ([1, W] columns, `steps` 0..R-1 over its R
    rows): the previous round's path re-run as a chain at start.. (its m = R - T rows, the
    first `count` accepted), then the T tree nodes at positions start + count + depth, each
    seeing the history, the path's accepted rows, and its ancestors and itself."""
    T = visible.shape[0]
    m = steps.shape[0] - T
    r = steps[:m]
    positions = mx.concatenate([start + r, start + count + depths])
    chain = mx.concatenate([r[None] <= r[:, None], mx.zeros((m, T), mx.bool_)], axis=1)
    tree = mx.concatenate([mx.broadcast_to(r[None] < count, (T, m)), visible.astype(mx.bool_)], axis=1)
    return positions, _tree_mask(columns - start, mx.concatenate([chain, tree]), zero, low)


def _replay_parents(parents, m, count):
    """A tree round's parents for its recurrent layers (mx int32 [m + T]): the re-run path as a
    chain from the committed state, the tree's root after its `count`-th row (the committed
    state where count is 0), the tree's other nodes after their parents."""
    chain = mx.arange(-1, m - 1, dtype=mx.int32)
    return mx.concatenate([chain, mx.where(parents < 0, count - 1, parents + m).astype(mx.int32)])


def replay_prefix(payloads, n):
    """Per recurrent layer, the (conv state, recurrent state) after the first `n` (mx int32) rows
    of a round's chain (a chain round's, or a tree round's re-run path), what one-token decoding
    of those tokens leaves: from the forward's kept node states (`gdn.DevicePlan`) and the conv
    window ending at row n - 1."""
    out = {}
    for i, payload in payloads.items():
        keep = payload["conv_state"].shape[1]
        conv = mx.take(mx.concatenate([payload["conv_state"], payload["qkv"]], axis=1),
                       n + mx.arange(keep, dtype=mx.int32), axis=1)
        after = mx.take(payload["states"], mx.maximum(n - 1, 0).reshape(1), axis=1)[:, 0]
        out[i] = conv, mx.where(n > 0, after, payload["state"])
    return out
