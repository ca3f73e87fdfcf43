"""A one-layer drafting head over the target's hidden states (an MTP layer, an EAGLE-3 head) as a
drafter: its chains and EAGLE-2 trees.

The head drafts like a small draft model (drafters/model.py: the same spine, siblings, lanes and
re-rank, through the same TreeRound over its own KV cache), with one input more: each node's
hidden state. A round's first forward runs the pending slots, one per token the target emitted
since the last draft: slot t takes the token at t + 1 and the target's hidden state at t (the
rows the loop captured), so its last slot predicts the first draft token. Every later node takes
its own token and the head's output hidden state at its parent. Only first-pass slots stay in
the head's cache: deeper nodes were computed from the head's own hidden states, which the next
round replaces with the target's.
"""
import numpy as np
import mlx.core as mx

from ..draft import Draft
from .model import ModelDrafter

__all__ = ["HeadDrafter"]


class HeadDrafter(ModelDrafter):
    """`head`: an MTPHead or Eagle3Head bound to its target (drafters/mtp.py, drafters/eagle3.py);
    the shape options are a draft model's (`topk`, `lanes`, `depth`, `budget`)."""

    def __init__(self, head, topk=1, depth=8, budget=None, lanes=None, prefill_step_size=2048):
        super().__init__(head, topk=topk, depth=depth, budget=budget, lanes=lanes,
                         prefill_step_size=prefill_step_size)
        self.capture = tuple(head.capture)
        self.first_pass = getattr(head, "target_hidden", None)  # MTP: the target's final norm, if trained so

    def reset(self):
        super().reset()
        self.pending_hidden = None  # target rows of the pending slots [n, H or n*H]
        self._node_hidden = None  # the head's output hidden state of each round node [m, H]

    def _target_rows(self, hidden):
        return self.first_pass(hidden) if self.first_pass is not None else hidden

    def prefill(self, prompt, hidden=None):
        """The first pass over the prompt: slot t = (prompt[t + 1], the target's row t); the last
        slot stays pending, so the first draft runs it."""
        self.reset()
        if hidden is None:
            raise ValueError("a head drafter reads the target's hidden states: the loop passes them "
                             "(drafter.capture)")
        self.cache = self.model.make_cache()
        prompt = [int(t) for t in prompt]
        rows = self._target_rows(hidden) if hidden.shape[0] else hidden
        body = len(prompt) - 2  # slots 0 .. n-3 go in now
        for i in range(0, max(body, 0), self.prefill_step_size):
            j = min(i + self.prefill_step_size, body)
            self._set_hidden(rows[i:j], first=True)
            self.model(mx.array(prompt[i + 1 : j + 1])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        # pending: the last slot (the prompt's last token over the target's row n-2); a one-token
        # prompt has no row: its first draft has nothing to continue from
        if len(prompt) >= 2:
            self.pending, self.pending_hidden = prompt[-1:], rows[-1:]
        else:
            self.pending, self.pending_hidden = prompt[-1:], None

    def _set_hidden(self, rows, first):
        self.model.pending_hidden = rows
        if hasattr(self.model, "pending_first"):
            self.model.pending_first = first

    def draft(self, root, max_depth):
        if self.pending_hidden is None:  # nothing to continue from (a one-token prompt)
            return Draft.root_only(root)
        return super().draft(root, max_depth)

    def _forward(self, rnd, tokens, parents=None, depth=None, rows=None, feeds=None):
        if feeds is None:  # the round's first pass: the pending slots over the target's rows
            self._set_hidden(self.pending_hidden, first=True)
            self._node_hidden = None
        else:
            feeds = feeds if isinstance(feeds, mx.array) else mx.array(np.asarray(feeds, np.int32))
            self._set_hidden(self._node_hidden[feeds], first=False)
        logits = super()._forward(rnd, tokens, parents, depth, rows, feeds)
        out = self.model.out_hidden[0][: tokens.shape[0]]
        self._node_hidden = out if self._node_hidden is None else mx.concatenate([self._node_hidden, out])
        return logits

    def commit(self, draft, path, emitted, hidden=None):
        # keep the first-pass slots only; every emitted token is a pending slot over its
        # target row (the root's, then the accepted nodes')
        state = draft.state
        if state is not None:
            state.rnd.keep(list(range(state.root_node + 1)))
            self.pending, self.pending_hidden = list(emitted), self._target_rows(hidden)
        elif self.pending_hidden is None:  # a one-token prompt: the root had no slot
            self.pending, self.pending_hidden = list(emitted), self._target_rows(hidden)
        else:  # nothing forwarded: the slots pile up
            self.pending = self.pending + list(emitted)
            self.pending_hidden = mx.concatenate([self.pending_hidden, self._target_rows(hidden)])
