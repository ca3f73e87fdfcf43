"""Acceptance: which root path of the draft tree the target agrees with.

One rule serves greedy and sampled decoding: ``target_tokens[i]`` is the token
the target chose after node i (argmax at temperature 0, a sample otherwise).
"""

from __future__ import annotations

import numpy as np

from .tree import DraftTree, as_int_array


def greedy_walk(tree: DraftTree, target_tokens, max_emit=None):
    """Descend from the root while a child's token equals the target's choice.

    Returns ``(path, emitted)`` as int64 arrays: ``path`` starts at node 0 and
    at each step moves to the lowest-index matching child; ``emitted`` is the
    tokens of ``path[1:]`` plus the target's token at the last path node (the
    bonus), so ``len(emitted) == len(path)``. ``max_emit`` truncates
    ``emitted`` only: ``path`` still says what the target verified, which the
    caller needs to keep the KV cache consistent.
    """
    target = np.asarray(target_tokens)
    if target.ndim != 1 or target.shape[0] != tree.size:
        raise ValueError(
            f"target_tokens has shape {target.shape}, expected ({tree.size},): one "
            "target token per tree node, in node order"
        )
    target = as_int_array(target, "target_tokens")
    if max_emit is not None:
        if isinstance(max_emit, (bool, np.bool_)) or not isinstance(max_emit, (int, np.integer)):
            raise ValueError(f"max_emit must be an int or None, got {max_emit!r}")
        if max_emit < 0:
            raise ValueError(f"max_emit must be >= 0, got {max_emit}")

    tokens = tree.tokens
    parents = tree.parents
    path = [0]
    while True:
        node = path[-1]
        # flatnonzero is ascending, so [0] is the lowest-index matching child.
        matches = np.flatnonzero((parents == node) & (tokens == target[node]))
        if matches.size == 0:
            break
        path.append(int(matches[0]))
    path = np.array(path, dtype=np.int64)
    emitted = np.concatenate([tokens[path[1:]], target[path[-1:]]]).astype(np.int64)
    if max_emit is not None:
        emitted = emitted[:max_emit]
    return path, emitted
