"""Drafters propose a draft tree rooted at the last emitted token.

The round loop speaks to every drafter through three calls:

- `prefill(prompt)`: the prompt's tokens, the last of which is the first root;
- `draft(root, max_depth) -> Draft`: a tree rooted at `root` (the last emitted token), at most
  `max_depth` deep (0: no draft, the round is a plain decoding step);
- `commit(draft, path, emitted)`: the walk's accepted node path (root first) and the tokens it
  emitted (accepted drafts, then the target's token; the last one is the next root).

A `Draft` holds the topology on the host and the tokens as an mx array, so a model drafter's
tokens never need a host sync before the verify (the walk fetches them with the target's choices).
"""
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import mlx.core as mx


@dataclass
class Draft:
    parents: np.ndarray  # int [n], parents[0] == -1
    tokens: mx.array  # uint32 [n], tokens[0] is the root
    requested_budget: int = 0
    requested_depth: int = 0
    extra: Any = field(default=None, repr=False)  # the drafter's own bookkeeping for commit

    @property
    def size(self):
        return len(self.parents)


def root_only(root):
    return Draft(np.array([-1], np.int32), mx.array([root], mx.uint32))
