"""A draft model's tree and a prompt-lookup tree under one root: one verify for both.

On a small target a verify costs about the same for 2 to 64 rows (bench/RESULTS.md, section 3),
so draft nodes that cost no draft-model step are nearly free. A prompt-lookup drafter proposes
continuations of earlier occurrences of the text's last n-gram (host only: no device work, its
tokens go to the device before anything of the round is queued); its nodes hang from the root
beside the model's. Where both propose the same text the tree holds it twice: the walk accepts
the deepest path the target agrees with (walk.py), so a duplicate costs a verify row, never a
token, and whichever drafter agreed longer decides the round.

With `trust` n > 0, a round whose lookup matched the text's last n tokens or more drafts with
the lookup alone: the draft model spends nothing that round (its pending tokens wait for the
next model draft, which forwards them in one pass).

Commit: the model drafter sees the accepted path up to its first lookup node (what it did not
forward is pending for it, as after any leaf), the lookup drafter sees the emitted tokens.
"""
from dataclasses import dataclass

import numpy as np
import mlx.core as mx

from ..draft import Draft, Layout
from ..sampling import draw_of
from ..tree import MAX_NODES, ancestors_of, depths_of
from ..verify import cached_array


@dataclass
class MergedState:
    """The two drafts a merged draft was made of, and where the lookup's nodes begin."""

    base: Draft
    extra: Draft
    first_extra: int


def merge(b, e):
    """`b`'s tree with `e`'s nodes under the same root, after `b`'s (cut to fit `MAX_NODES`):
    one verify for both; the state (`MergedState`) tells whose nodes are whose."""
    nb = b.size
    m = min(e.size - 1, MAX_NODES - nb)
    state = MergedState(b, e, nb)
    if m <= 0:
        return Draft(b.tokens, b.layout, state, fetch=b.fetch, budget=b.budget, depth=b.depth,
                     forwards=b.forwards)
    e_parents = np.asarray(e.layout.host_parents()[1 : m + 1], np.int64)
    shifted = np.where(e_parents == 0, 0, e_parents + nb - 1)  # lookup node i -> nb + i - 1
    tokens = mx.concatenate([b.tokens, e.tokens[1 : m + 1]])
    if b.layout.parents is None:  # the model's topology is on the device: extend it there
        e_all = np.concatenate([[-1], e_parents])
        e_vis = ancestors_of(e_all)[1:]  # [m, m + 1]: lookup rows over root + lookup nodes
        b_parents, b_depths, b_visible = b.layout.device
        parents = mx.concatenate([b_parents.astype(mx.int32), cached_array(shifted.astype(np.int32))])
        depths = mx.concatenate([b_depths.astype(mx.int32), cached_array(depths_of(e_all)[1:].astype(np.int32))])
        lower = mx.concatenate([cached_array(e_vis[:, :1]), mx.zeros((m, nb - 1), mx.bool_),
                                cached_array(e_vis[:, 1:])], axis=1)
        upper = mx.concatenate([b_visible, mx.zeros((nb, m), mx.bool_)], axis=1)
        layout = Layout.on_device(parents, depths, mx.concatenate([upper, lower], axis=0))
    else:
        layout = Layout.fixed(np.concatenate([b.layout.parents, shifted]))
    return Draft(tokens, layout, state, fetch=b.fetch, budget=b.budget + m, depth=b.depth,
                 forwards=b.forwards)


class MergedDrafter:
    """`base` (a draft-model drafter) with the nodes of `extra` (a host drafter, e.g. prompt
    lookup) under the same root, cut to fit `MAX_NODES`; with `trust` n > 0, `extra` alone where
    its match is at least n tokens long (`extra.last_match`)."""

    def __init__(self, base, extra, trust=0):
        if trust < 0:
            raise ValueError(f"trust (--draft-lookup-trust) is an n-gram length >= 0, got {trust}")
        self.base = base
        self.extra = extra
        self.trust = trust
        self.rounds_alone = 0  # rounds the lookup drafted alone
        self.capture = tuple(getattr(base, "capture", ()))

    @property
    def depth(self):
        return self.base.depth

    draw = draw_of("base")

    def reset(self):
        self.base.reset()
        self.extra.reset()
        self.rounds_alone = 0

    def prefill(self, prompt, *hidden):
        self.rounds_alone = 0
        self.base.prefill(prompt, *hidden)
        self.extra.prefill(prompt)

    def draft(self, root, max_depth):
        e = self.extra.draft(root, max_depth)  # first: its host array is made before anything is queued
        alone = self.trust > 0 and e.size > 1 and self.extra.last_match >= self.trust
        self.rounds_alone += alone
        b = Draft.root_only(root) if alone else self.base.draft(root, max_depth)
        return merge(b, e)

    def commit(self, draft, path, emitted, *hidden):
        st = draft.state
        path = np.asarray(path)
        nb = st.first_extra
        cut = int(np.argmax(path >= nb)) if (path >= nb).any() else len(path)
        # (a head pairs each emitted token with its target row, the lookup's accepted nodes' too)
        self.base.commit(st.base, path[:cut], emitted, *hidden)
        self.extra.commit(st.extra, np.concatenate([[0], path[cut:] - nb + 1]) if cut < len(path) else path[:1],
                          emitted)

    def probe_parents(self):
        """The base's largest layout with the lookup's whole budget as a chain under the root."""
        from ..probe import with_root_chain

        return with_root_chain(np.asarray(self.base.probe_parents(), np.int64), self.extra.budget)
