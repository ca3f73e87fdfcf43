"""Drafters propose a draft tree rooted at the last emitted token.

The round loop speaks to every drafter through three calls:

- `prefill(prompt)`: the prompt's tokens, the last of which is the first root;
- `draft(root, max_depth) -> Draft`: a tree rooted at `root` (the last emitted token), at most
  `max_depth` deep (0: no draft, the round is a plain decoding step);
- `commit(draft, path, emitted)`: the walk's accepted node path (root first) and the tokens it
  emitted (accepted drafts, then the target's token; the last one is the next root).

A `Draft` holds its tokens as an mx array, so a model drafter's tokens never need a host sync
before the verify (the walk fetches them with the target's choices). Its topology is on the host
(numpy parents), or, for a drafter that ranks on the device, on the device: parents, depths and
the ancestor-or-self rows as mx arrays, fetched by the walk's one sync (`Draft.arrays`).
"""
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import mlx.core as mx

from ..tree import MAX_NODES, DraftTree


@dataclass
class Draft:
    parents: Any  # int [n], parents[0] == -1: numpy, or an mx array when built on the device
    tokens: mx.array  # uint32 [n], tokens[0] is the root
    requested_budget: int = 0
    requested_depth: int = 0
    extra: Any = field(default=None, repr=False)  # the drafter's own bookkeeping for commit
    depths: Optional[mx.array] = None  # int32 [n], with device parents
    visible: Optional[mx.array] = None  # bool [n, n] ancestors-or-self, with device parents
    pending: tuple = ()  # the drafter's device arrays its commit reads (fetched with the walk)

    @property
    def on_device(self):
        return isinstance(self.parents, mx.array)

    @property
    def size(self):
        return int(self.parents.shape[0])

    def host_parents(self):
        """The parents as numpy (a host sync when they were built on the device)."""
        return np.array(self.parents).astype(np.int64) if self.on_device else self.parents

    def arrays(self):
        """Every device array the walk fetches in its one sync."""
        return [self.tokens] + ([self.parents] if self.on_device else []) + list(self.pending)


def check_budget_depth(budget, max_depth):
    """The bounds every model-free drafter shares: both count draft nodes, root excluded."""
    if not 0 <= budget <= MAX_NODES - 1:
        raise ValueError(f"budget counts draft nodes without the root: 0..{MAX_NODES - 1}, got {budget}")
    if not 0 <= max_depth <= MAX_NODES - 1:
        raise ValueError(f"max_depth must be in 0..{MAX_NODES - 1}, got {max_depth}")


def root_only(root):
    return Draft(np.array([-1], np.int32), mx.array([root], mx.uint32))


def fixed_topology(parents):
    """A layout the host knows before drafting: host parents, and the device depths and
    ancestor-or-self rows the verify reads (built once per layout, so a round spends no op on
    them)."""
    shape = DraftTree(np.zeros(len(parents), np.int64), parents)  # tokens do not matter
    return parents, mx.array(shape.depths.astype(np.int32)), mx.array(shape.ancestor_mask())
