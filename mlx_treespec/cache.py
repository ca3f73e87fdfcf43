"""KV-cache bookkeeping for tree rounds: commit of the accepted path, rotating layouts.

A tree forward writes every node's K/V (or, for rotating caches, keeps them aside); after the walk
only the accepted root path may stay. The functions here turn a layer cache into exactly the
cache that plain one-token decoding of the accepted tokens would have built.
"""
from typing import NamedTuple

import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

__all__ = [
    "committed_offset",
    "leading_run",
    "commit_appended",
    "commit_rotating",
    "rotating_slot_positions",
    "rotating_plan",
    "rotating_layout",
    "cache_kind",
    "snapshot",
    "restore",
]


def committed_offset(caches):
    """Tokens the caches hold (recurrent caches carry no offset: read it off an attention one)."""
    for c in caches:
        if cache_kind(c) in ("append", "rotating"):
            return c.offset
    raise ValueError("the model has no attention cache to read its position from")


def cache_kind(cache):
    """'append' for caches that take tree K/V in place, 'rotating', 'arrays', or None."""
    if isinstance(cache, (KVCache, QuantizedKVCache)):
        return "append"
    if isinstance(cache, RotatingKVCache):
        return "rotating"
    if type(cache).__name__ == "ArraysCache":
        return "arrays"
    return None


class Snapshot(NamedTuple):
    objects: list  # the list's cache objects (mlx-lm's quantize replaces an entry)
    attributes: list  # each one's attributes, by reference


def snapshot(caches):
    """What `restore` needs to put `caches` back: the list's cache objects and each one's
    attributes by reference.

    mx arrays are values, so a reference is a snapshot, with two exceptions that need none: a
    write in place past a cache's offset (append caches: dead rows), and a one-token write in
    place into a rotating buffer's next slot, the slot plain decoding overwrites next (no query
    at a later position sees what it held). Writes inside the live part of a buffer go to a
    fresh buffer first (`commit_rotating`). The objects are kept because mlx-lm's quantize
    replaces a list entry (`to_quantized`) rather than changing it."""
    attributes = []
    for c in caches:
        attrs = dict(vars(c))
        if isinstance(attrs.get("cache"), list):  # ArraysCache: entries are replaced, not the list
            attrs["cache"] = list(attrs["cache"])
        attributes.append(attrs)
    return Snapshot(list(caches), attributes)


def restore(caches, saved):
    """Put caches back as `snapshot` found them (every layer at one offset again): the list's
    entries too, where a quantize replaced one."""
    for i, (c, attrs) in enumerate(zip(saved.objects, saved.attributes)):
        if caches[i] is not c:
            caches[i] = c
        vars(c).clear()
        vars(c).update(attrs)
        if isinstance(attrs.get("cache"), list):
            c.cache = list(attrs["cache"])


def leading_run(keep):
    """How many of the kept round nodes `keep` already sit where plain decoding puts them
    (keep[i] == i): the part of an accepted path a commit keeps by a trim."""
    keep = np.asarray(keep)
    off = np.flatnonzero(keep != np.arange(len(keep)))
    return int(off[0]) if off.size else len(keep)


def commit_appended(cache, base, keep):
    """Keep round nodes `keep` (indices into the K/V appended at `base`) as positions base, base+1...

    `keep` is increasing and keep[i] >= i, so the gather reads every row before it is overwritten;
    MLX evaluates the gather before the scatter in any case.
    """
    keep = np.asarray(keep, dtype=np.int64)
    m = len(keep)
    if m and (keep != np.arange(m)).any():
        idx = mx.array(base + keep.astype(np.int32))
        if isinstance(cache, QuantizedKVCache):
            for parts in (cache.keys, cache.values):
                for a in parts:
                    a[..., base : base + m, :] = a[..., idx, :]
        else:
            cache.keys[..., base : base + m, :] = cache.keys[..., idx, :]
            cache.values[..., base : base + m, :] = cache.values[..., idx, :]
    cache.offset = base + m


def commit_rotating(cache, keys, values, keep):
    """Write round nodes `keep` (rows of keys/values [B, H, m, D]) one token at a time.

    One-token updates take RotatingKVCache's in-place path, the one plain decoding takes, so the
    buffer, its rotation index and its offset come out identical to plain decoding's. The
    writes go to fresh buffers, so a snapshot taken before still holds the committed ones.
    """
    if cache.keys is not None:
        cache.keys, cache.values = mx.array(cache.keys), mx.array(cache.values)
    for j in np.asarray(keep, dtype=np.int64).tolist():
        cache.update_and_fetch(keys[:, :, j : j + 1, :], values[:, :, j : j + 1, :])


def rotating_slot_positions(offset, idx, size, keep):
    """Token position held by each slot of a RotatingKVCache buffer; -1 for a slot never written.

    Holds for every state mlx-lm's RotatingKVCache reaches: temporal order after a concatenating
    update (idx == size), growth (idx == offset < size) and rotation (size == max_size): slot s in
    [keep, idx) holds offset - idx + s, slot s >= idx holds the previous lap.
    """
    s = np.arange(size, dtype=np.int64)
    pos = np.where(s < idx, offset - idx + s, offset - idx + s - (size - keep))
    pos = np.where((s >= keep) & (pos < keep), -1, pos)
    sink = s < keep
    pos[sink] = np.where(s[sink] < offset, s[sink], -1)
    return pos


def rotating_plan(offset, idx, size, keep, max_size, steps, grow=256):
    """Emulate `steps` one-token RotatingKVCache updates on slot bookkeeping only.

    Returns (src, pos, write_slot, visible_len): src[s] is the index into the current buffer of
    the history entry that ends up in slot s (-1 for none), pos[s] its position, write_slot[d]
    the slot the token of step d lands in, visible_len[d] how many leading slots step d attends.
    Mirrors RotatingKVCache._update_in_place line for line (pinned by tests/test_cache.py).
    """
    src = np.arange(size, dtype=np.int64)
    pos = rotating_slot_positions(offset, idx, size, keep)
    src = np.where(pos >= 0, src, -1)
    write_slot, visible_len = [], []
    for _ in range(steps):
        if offset >= size and size < max_size:
            new = min(grow, max_size - offset)
            src = np.concatenate([src, np.full(new, -1)])
            pos = np.concatenate([pos, np.full(new, -1)])
            size += new
            idx = offset
        trim = size - max_size
        if trim > 0:
            src = np.concatenate([src[:keep], src[trim + keep :]])
            pos = np.concatenate([pos[:keep], pos[trim + keep :]])
            size = max_size
            idx = max_size
        if idx == max_size:
            idx = keep
        write_slot.append(idx)
        offset += 1
        idx += 1
        visible_len.append(min(offset, size))
    return src, pos, np.array(write_slot, np.int64), np.array(visible_len, np.int64)


def rotating_layout(state, depths, ancestors, window=None):
    """Key order and visibility for tree nodes over a RotatingKVCache, matching plain decoding.

    state: (offset, idx, size, keep, max_size, grow) of the committed cache (size: rows of its
    buffer); depths: round depth of each node (position = offset + depth); ancestors: bool
    [m, m] ancestor-or-self among the round nodes. Returns (order, visible): order indexes
    concat([buffer, round K/V]); visible is bool [m, len(order)], one row per round node.

    Keys are laid out slot by slot: each slot's history entry, then the round nodes written to
    that slot, shallow first. A query sees at most one entry per slot (the one plain decoding would
    have there after its step), so its visible keys come in plain decoding's slot order and the
    attention sums run in the same order.
    """
    offset, idx, size, keep, max_size, grow = state
    buffer_len = size
    depths = np.asarray(depths, np.int64)
    m = len(depths)
    steps = int(depths.max()) + 1 if m else 0
    src, pos, write_slot, visible_len = rotating_plan(
        offset, idx, size, keep, max_size, steps, grow
    )
    n_slots = len(src)
    # Entries: (slot, round depth or -1, source row, round node or -1, position)
    e_slot, e_depth, e_src, e_node, e_pos = [], [], [], [], []
    by_depth = [np.flatnonzero(depths == d) for d in range(steps)]
    writes_at = [[] for _ in range(n_slots)]
    for d, s in enumerate(write_slot):
        writes_at[s].append(d)
    for s in range(n_slots):
        if src[s] >= 0:
            e_slot.append(s), e_depth.append(-1), e_src.append(src[s])
            e_node.append(-1), e_pos.append(pos[s])
        for d in writes_at[s]:
            for j in by_depth[d]:
                e_slot.append(s), e_depth.append(d), e_src.append(buffer_len + j)
                e_node.append(j), e_pos.append(offset + d)
    e_slot, e_depth, e_node, e_pos = map(np.array, (e_slot, e_depth, e_node, e_pos))
    # latest[s, d]: depth of the last write to slot s at or before step d (-1: none)
    latest = np.full((n_slots, max(steps, 1)), -1, np.int64)
    for d, s in enumerate(write_slot):
        latest[s, d:] = d
    qd = depths
    vis = e_slot[None, :] < visible_len[qd][:, None]
    vis &= e_depth[None, :] == latest[e_slot[None, :], qd[:, None]]
    tree_entry = e_node >= 0
    anc = np.ones((m, len(e_node)), bool)
    anc[:, tree_entry] = ancestors[:, e_node[tree_entry]]
    vis &= anc
    if window is not None and window < max_size:
        qpos = offset + qd
        applies = qpos >= window
        vis &= ~applies[:, None] | (qpos[:, None] - e_pos[None, :] < window)
    return np.array(e_src, np.int64), vis
