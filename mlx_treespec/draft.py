"""What a drafter proposes (`Draft`, its `Layout`), and the calls the round loop makes of every
drafter (`Drafter`).

A round is draft -> verify -> walk -> commit. The loop asks the drafter for a tree rooted at the
last emitted token, verifies every node in one target forward, walks the target's choices down
the tree and tells the drafter what was accepted. A `Draft` keeps its tokens on the device, so a
model drafter's tokens never cost a host sync before the verify (the walk fetches them with the
target's choices, in the round's one sync).
"""
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np
import mlx.core as mx

from .tree import ancestors_of, check_draft_parents, depths_of

__all__ = ["Draft", "Layout", "Drafter", "check_drafter"]


class Layout:
    """A draft's topology, in the forms its readers need.

    - `parents`: numpy int64 [n] (parents[0] == -1), when the host knows the tree without a
      sync (fixed layouts, host drafters); None for a tree ranked on the device.
    - `device`: (parents int32 [n], depths int32 [n], ancestor-or-self rows bool [n, n]) as mx
      arrays, when the verify may read the tree from the device; None for a host drafter's
      tree whose shape changes every round (the verify builds its rows from `parents`).

    Layouts are values: build one with `fixed` (both forms, cached per distinct parents),
    `host` or `on_device`.
    """

    __slots__ = ("parents", "device")
    _fixed = {}

    def __init__(self, parents: Optional[np.ndarray], device: Optional[Tuple[mx.array, mx.array, mx.array]]):
        if parents is None and device is None:
            raise ValueError("a layout needs host parents, device arrays, or both")
        self.parents = parents
        self.device = device

    @classmethod
    def host(cls, parents) -> "Layout":
        return cls(check_draft_parents(parents), None)

    @classmethod
    def on_device(cls, parents: mx.array, depths: mx.array, visible: mx.array) -> "Layout":
        return cls(None, (parents, depths, visible))

    @classmethod
    def fixed(cls, parents) -> "Layout":
        """Both forms, built once per distinct parents (a drafter's fixed layouts repeat every
        round, so a round spends no op on its topology)."""
        parents = check_draft_parents(parents)
        key = parents.tobytes()
        hit = cls._fixed.get(key)
        if hit is None:
            if len(cls._fixed) >= 512:
                cls._fixed.clear()
            depths = depths_of(parents).astype(np.int32)
            device = (mx.array(parents.astype(np.int32)), mx.array(depths), mx.array(ancestors_of(parents)))
            hit = cls._fixed[key] = cls(parents, device)
        return hit

    @property
    def size(self) -> int:
        return len(self.parents) if self.parents is not None else int(self.device[0].shape[0])

    def host_parents(self) -> np.ndarray:
        """The parents as numpy: a host sync when the tree was ranked on the device."""
        if self.parents is not None:
            return self.parents
        return np.array(self.device[0]).astype(np.int64)

    def fetch(self) -> list:
        """The device arrays the walk must fetch to know the tree."""
        return [self.device[0]] if self.parents is None else []


_ROOT = Layout.fixed([-1])


@dataclass
class Draft:
    """A proposed tree: `tokens` (mx uint32 [n], tokens[0] the root) and its `layout`.

    `state` is the drafter's own record of what it forwarded, read back by its `commit` (each
    drafter has its own state type; None for a draft that forwarded nothing). `fetch` lists
    device arrays that commit reads: the loop fetches them in the walk's sync. `budget` and
    `depth` are what the drafter was asked for this round (RoundStats reports them beside what
    it proposed); `forwards` counts the draft-model forwards it ran (0 for a host drafter);
    `source` names what drafted it where a drafter picks among several (adaptive.py).
    """

    tokens: mx.array
    layout: Layout
    state: Any = None
    fetch: tuple = ()
    budget: int = 0
    depth: int = 0
    forwards: int = 0
    source: str = ""

    @property
    def size(self) -> int:
        return self.layout.size

    def arrays(self) -> list:
        """Every device array the walk fetches in its one sync."""
        return [self.tokens] + self.layout.fetch() + list(self.fetch)

    @staticmethod
    def root_only(root) -> "Draft":
        """No proposal: the round is one plain decoding step."""
        root = root if isinstance(root, mx.array) else mx.array([int(root)], mx.uint32)
        return Draft(root.reshape(1).astype(mx.uint32), _ROOT)


@runtime_checkable
class Drafter(Protocol):
    """The calls the round loop makes of a drafter.

    - `prefill(prompt)`: a new generation; the prompt's last token is the first root. It
      forgets anything a previous generation left (a drafter object may be reused).
    - `draft(root, max_depth) -> Draft`: a tree rooted at `root`, at most `max_depth` deep
      (0: root only).
    - `commit(draft, path, emitted)`: the walk's accepted node path (root first, numpy) and the
      tokens it emitted (accepted drafts, then the target's token, which is the next root).
    - `reset()`: drop every cache and index (prefill calls it).
    - `probe_parents()`: the largest layout a round of this drafter sends (the GPU exactness
      probe verifies it before any speculation).

    A drafter that reads the target's hidden states names the target layers in `capture` (a
    tuple of layer indices; absent or empty: none). Then the loop passes `hidden`, the
    concatenated outputs of those layers (mx [rows, len(capture) * hidden size]), to
    `prefill(prompt, hidden)` (one row per prompt token but the last) and to
    `commit(draft, path, emitted, hidden)` (one row per path node, the root first).

    A drafter that drafts from device values alone may offer `ahead` (None otherwise):
    `ahead(root, rows, count[, path])` (mx uint32 [1]; the last verify's captured rows along
    its accepted path, or None; mx int32 rows accepted; after a tree round, that path's tokens,
    root first) returns a chain (mx uint32 [depth]) or a tree (a `Draft` whose layout lives on
    the device; then `queues_trees` is True); the loop then queues rounds ahead (queued.py)
    where it can.
    """

    def prefill(self, prompt: Sequence[int]) -> None: ...

    def draft(self, root: int, max_depth: int) -> Draft: ...

    def commit(self, draft: Draft, path: np.ndarray, emitted: Sequence[int]) -> None: ...

    def reset(self) -> None: ...

    def probe_parents(self) -> np.ndarray: ...


def check_drafter(drafter):
    """Refuse an object that lacks the drafter calls, naming them."""
    missing = [m for m in ("prefill", "draft", "commit", "reset", "probe_parents")
               if not callable(getattr(drafter, m, None))]
    if missing:
        raise ValueError(f"drafter={type(drafter).__name__} lacks {', '.join(missing)}: a drafter "
                         "implements mlx_treespec.draft.Drafter (prefill, draft, commit, reset, "
                         "probe_parents)")
    capture = getattr(drafter, "capture", ())
    if not isinstance(capture, tuple) or not all(isinstance(i, int) for i in capture):
        raise ValueError(f"{type(drafter).__name__}.capture must be a tuple of target layer indices")
    return drafter
