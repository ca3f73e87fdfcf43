"""Attention masks and positions for verifying a draft tree in one forward pass.

The tree's n nodes are appended after ``offset`` cached tokens. A node sees
every cached (history) token and, among the tree nodes, exactly its ancestors
and itself. Its position is ``offset + depth``: siblings share a position,
because they are alternative continuations of the same prefix.

Masks are built in numpy (vectorized) and converted to ``mx.array`` once.
Boolean masks use mlx-lm's convention: True = visible.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .tree import DraftTree, check_int


def _check_offset(offset) -> int:
    return check_int(offset, "offset (number of cached tokens)", 0)


def _check_window(window) -> int | None:
    return None if window is None else check_int(window, "window", 1)  # (a query always sees itself)


def _check_float_dtype(dtype) -> None:
    if not mx.issubdtype(dtype, mx.floating):
        raise ValueError(
            f"additive masks need a floating dtype (to hold -inf), got {dtype}; "
            "use bool_mask_with_history for a boolean mask"
        )


def positions(tree: DraftTree, offset) -> mx.array:
    """int32 [n]: the RoPE position of each node, ``offset + depth``."""
    offset = _check_offset(offset)
    return mx.array(offset + tree.depths.astype(np.int64), dtype=mx.int32)


def _visible(tree: DraftTree, offset: int, window: int | None) -> np.ndarray:
    query_pos = offset + tree.depths.astype(np.int64)
    history_visible = np.ones((tree.size, offset), dtype=bool)
    tree_visible = tree.ancestor_mask()
    if window is not None:
        # Sliding window, as in mlx-lm's create_causal_mask: a key at position
        # q is visible to a query at position p only when p - q < window.
        history_pos = np.arange(offset, dtype=np.int64)
        history_visible = (query_pos[:, None] - history_pos[None, :]) < window
        tree_visible = tree_visible & ((query_pos[:, None] - query_pos[None, :]) < window)
    return np.concatenate([history_visible, tree_visible], axis=1)


def bool_mask_with_history(tree: DraftTree, offset, window=None) -> mx.array:
    """bool [n, offset + n]: True where node i may attend to the key."""
    return mx.array(_visible(tree, _check_offset(offset), _check_window(window)))


def additive_mask_with_history(tree: DraftTree, offset, dtype=mx.float32, window=None) -> mx.array:
    """[n, offset + n]: 0 where visible, -inf elsewhere (same rule as the bool mask)."""
    _check_float_dtype(dtype)
    visible = _visible(tree, _check_offset(offset), _check_window(window))
    # float32 holds 0 and -inf exactly; casting to a narrower float keeps both.
    return mx.array(np.where(visible, np.float32(0.0), np.float32(-np.inf))).astype(dtype)


def additive_mask(tree: DraftTree, dtype=mx.float32) -> mx.array:
    """[n, n]: 0 at ancestors-or-self, -inf elsewhere (no history columns)."""
    return additive_mask_with_history(tree, 0, dtype)
