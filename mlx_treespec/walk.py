"""Acceptance: which root path of the draft tree the target agrees with.

One rule serves greedy and sampled decoding: ``target_tokens[i]`` is the token
the target chose after node i (argmax at temperature 0, a sample otherwise).
"""

from __future__ import annotations

import numpy as np

from .tree import DraftTree, as_int_array, check_int


def greedy_walk(tree: DraftTree, target_tokens, max_emit=None):
    """The deepest root path whose every token is the target's choice after its parent.

    Returns ``(path, emitted)`` as int64 arrays: ``path`` starts at node 0 and ends at the
    deepest node ``n`` such that each node on it (root excluded) holds the token the target chose
    after its parent (ties: the lowest ``n``); ``emitted`` is the tokens of ``path[1:]`` plus the
    target's token at the last path node (the bonus), so ``len(emitted) == len(path)``. Where
    siblings hold distinct tokens (every builder's trees) at most one child matches, and this is
    the descent that follows the matching child; where a merged draft holds one text twice (a
    draft model's branch and a lookup branch) the deeper agreement wins. ``max_emit`` truncates
    ``emitted`` only: ``path`` still says what the target verified, which the caller needs to
    keep the KV cache consistent.
    """
    target = np.asarray(target_tokens)
    if target.ndim != 1 or target.shape[0] != tree.size:
        raise ValueError(
            f"target_tokens has shape {target.shape}, expected ({tree.size},): one "
            "target token per tree node, in node order"
        )
    target = as_int_array(target, "target_tokens")
    if max_emit is not None:
        max_emit = check_int(max_emit, "max_emit", 0)

    tokens, parents = tree.tokens, tree.parents
    # agrees[i]: the whole path to node i is the target's choices (parents come first; plain
    # Python lists, as numpy scalar indexing costs more than the loop itself at 64 nodes)
    edge = (tokens[1:] == target[np.maximum(parents[1:], 0)]).tolist()
    agrees = [True]
    for e, p in zip(edge, parents[1:].tolist()):
        agrees.append(e and agrees[p])
    depth = np.where(agrees, tree.depths, -1)
    path = tree.path_to(int(np.argmax(depth))).astype(np.int64)  # argmax: the lowest of the deepest
    emitted = np.concatenate([tokens[path[1:]], target[path[-1:]]]).astype(np.int64)
    if max_emit is not None:
        emitted = emitted[:max_emit]
    return path, emitted


def cut_at_stop(emitted, stop_tokens):
    """The emission up to and including its first stop token (the round loop's and the queued
    rounds' one rule: a round's commit keeps exactly what it emitted)."""
    for i, t in enumerate(emitted):
        if t in stop_tokens:
            return emitted[: i + 1]
    return emitted
