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
import numpy as np
import mlx.core as mx

from ..tree import MAX_NODES, DraftTree
from ..verify import cached_array
from . import Draft, fixed_topology, root_only


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
        self._layouts = {}

    @property
    def depth(self):
        return self.base.depth

    def prefill(self, prompt):
        self.base.prefill(prompt)
        self.extra.prefill(prompt)

    def draft(self, root, max_depth):
        e = self.extra.draft(root, max_depth)  # first: its host array is made before anything is queued
        alone = self.trust > 0 and e.size > 1 and self.extra.last_match >= self.trust
        self.rounds_alone += alone
        b = root_only(root) if alone else self.base.draft(root, max_depth)
        nb = b.size
        m = min(e.size - 1, MAX_NODES - nb)
        if m <= 0:
            return Draft(b.parents, b.tokens, b.requested_budget, b.requested_depth, (b, e, nb),
                         depths=b.depths, visible=b.visible, pending=b.pending)
        e_parents = np.asarray(e.host_parents()[1 : m + 1], np.int64)
        shifted = np.where(e_parents == 0, 0, e_parents + nb - 1)  # lookup node i -> nb + i - 1
        tokens = mx.concatenate([b.tokens, e.tokens[1 : m + 1]])
        if b.on_device:  # the model's topology is on the device: extend it there
            e_tree = DraftTree(np.zeros(m + 1, np.int64), np.concatenate([[-1], e_parents]))
            e_vis = e_tree.ancestor_mask()[1:]  # [m, m + 1]: lookup rows over root + lookup nodes
            parents = mx.concatenate([b.parents.astype(mx.int32), cached_array(shifted.astype(np.int32))])
            depths = mx.concatenate([b.depths.astype(mx.int32), cached_array(e_tree.depths[1:].astype(np.int32))])
            lower = mx.concatenate([cached_array(e_vis[:, :1]), mx.zeros((m, nb - 1), mx.bool_),
                                    cached_array(e_vis[:, 1:])], axis=1)
            upper = mx.concatenate([b.visible, mx.zeros((nb, m), mx.bool_)], axis=1)
            visible = mx.concatenate([upper, lower], axis=0)
        else:
            parents = np.concatenate([np.asarray(b.parents, np.int64), shifted])
            key = parents.tobytes()
            if key not in self._layouts:
                if len(self._layouts) >= 256:  # a lookup tree (not the CLI's chain) varies its shape
                    self._layouts.clear()
                self._layouts[key] = fixed_topology(parents)
            _, depths, visible = self._layouts[key]
        return Draft(parents, tokens, b.requested_budget + m, b.requested_depth, (b, e, nb),
                     depths=depths, visible=visible, pending=b.pending)

    def commit(self, draft, path, emitted):
        b, e, nb = draft.extra
        path = np.asarray(path)
        cut = int(np.argmax(path >= nb)) if (path >= nb).any() else len(path)
        self.base.commit(b, path[:cut], emitted)
        self.extra.commit(e, np.concatenate([[0], path[cut:] - nb + 1]) if cut < len(path) else path[:1], emitted)

    def probe_parents(self):
        """The base's largest layout with the lookup's whole budget as a chain under the root."""
        from ..probe import with_root_chain

        return with_root_chain(np.asarray(self.base.probe_parents(), np.int64), getattr(self.extra, "budget", 0))
