"""A small mlx-lm model as drafter: chains (topk=1) and EAGLE-2 dynamic trees (topk=K).

Each step forwards the current lanes on the draft model over its own cache, with the tree mask
(through the same TreeRound the target uses), and expands them from the draft logits. A chain is
the tree with one lane: its tokens stay on the device (no host sync until the walk), its forwards
are plain one-token steps, and its commit is a trim, as in mlx-lm's speculative loop.
"""
import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..builders import Eagle2Builder
from ..cache import cache_kind
from ..verify import TreeRound
from . import Draft, root_only


def _logprobs(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _top_k(logprobs, k):
    idx = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
    return idx, mx.take_along_axis(logprobs, idx, axis=-1)


class ModelDrafter:
    def __init__(self, model, topk=1, depth=4, budget=None, cache=None, prefill_step_size=2048):
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if any(cache_kind(c) == "arrays" for c in make_prompt_cache(model)):
            # lanes of later steps would need recurrent states of earlier lanes
            raise ValueError("the draft model has recurrent layers; use an attention-only drafter")
        self.model = model
        self.topk = topk
        self.depth = depth
        self.budget = depth if budget is None else budget
        self.cache = cache
        self.prefill_step_size = prefill_step_size
        self.pending = []  # emitted tokens not yet in the draft cache; the last is the root

    def prefill(self, prompt):
        if self.cache is None:
            self.cache = make_prompt_cache(self.model)
        prompt = [int(t) for t in prompt]
        body, self.pending = prompt[:-1], prompt[-1:]
        for i in range(0, len(body), self.prefill_step_size):
            self.model(mx.array(body[i : i + self.prefill_step_size])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def draft(self, root, max_depth):
        depth = min(self.depth, max_depth)
        # the builder can keep at most K + (S - 1) K^2 candidates; a chain keeps all of its S
        budget = depth if self.topk == 1 else min(
            self.budget, self.topk + (depth - 1) * self.topk**2
        )
        if depth == 0 or budget == 0:
            return root_only(root)
        # The pending tokens (the last is the root) are round nodes too: they always stay.
        rnd = TreeRound(self.model, self.cache)
        p = len(self.pending)
        logits = rnd.forward(mx.array(self.pending, mx.uint32), np.arange(p) - 1)[-1:]
        if self.topk == 1:
            return self._chain(root, logits, rnd, depth)
        return self._tree(root, logits, rnd, depth, budget)

    def _chain(self, root, logits, rnd, depth):
        root_node = rnd.size - 1
        toks = [mx.argmax(logits, axis=-1).astype(mx.uint32)]
        for s in range(1, depth):
            logits = rnd.forward(toks[-1], [root_node + s - 1])
            toks.append(mx.argmax(logits, axis=-1).astype(mx.uint32))
            mx.async_eval(toks[-1])
        tokens = mx.concatenate([mx.array([root], mx.uint32)] + toks)
        parents = np.arange(depth + 1, dtype=np.int32) - 1
        # tree node i (1 <= i < depth) was forwarded as round node root_node + i; the last was not
        forwarded = np.arange(depth + 1, dtype=np.int64) + root_node
        forwarded[0] = forwarded[-1] = -1
        return Draft(parents, tokens, depth, depth, (rnd, forwarded, root_node))

    def _tree(self, root, logits, rnd, depth, budget):
        """EAGLE-2 with lane selection on the device: one host sync, after the last step.

        Lanes' visibility rows are built on the device too, except over rotating draft caches,
        whose key layout needs the lanes' parents on the host (one sync per step there).
        """
        K = self.topk
        root_node = rnd.size - 1
        root_depth = int(rnd.depths[root_node])
        idx, lp = _top_k(_logprobs(logits), K)  # the root's children: the first lanes, in order
        steps = [(idx, lp, mx.arange(K))]
        lane_tokens, lane_scores = idx[0], mx.minimum(lp[0], 0)
        lane_parents = mx.full((K,), root_node)  # round node each lane hangs from
        visible = mx.array(rnd.ancestors) if rnd.all_append else None  # [m, m] over round nodes
        firsts = []
        for s in range(1, depth):
            first = rnd.size
            if visible is None:
                logits = rnd.forward(lane_tokens.astype(mx.uint32), np.array(lane_parents))
            else:
                rows = mx.concatenate([visible[lane_parents], mx.eye(K, dtype=mx.bool_)], axis=1)
                logits = rnd.forward_rows(lane_tokens.astype(mx.uint32), root_depth + s, rows)
                visible = mx.concatenate(
                    [mx.concatenate([visible, mx.zeros((first, K), mx.bool_)], axis=1), rows], axis=0)
            firsts.append(first)
            idx, lp = _top_k(_logprobs(logits), K)
            scores = (lane_scores[:, None] + mx.minimum(lp, 0)).reshape(-1)
            choice = mx.argsort(-scores)[:K]  # the next lanes among this step's K*K candidates
            steps.append((idx, lp, choice))
            lane_tokens, lane_scores = idx.reshape(-1)[choice], scores[choice]
            lane_parents = first + choice // K
            mx.async_eval(lane_tokens, lane_scores, lane_parents)
        mx.eval(steps)
        builder = Eagle2Builder(root, K, budget)
        cand_round = {}
        for s, (idx, lp, choice) in enumerate(steps):
            lanes = builder.add_step(np.array(idx), np.array(lp.astype(mx.float32)), lanes=np.array(choice))
            if s + 1 < len(steps):  # these lanes were forwarded at step s + 1
                for r, c in enumerate(lanes):
                    cand_round[int(c)] = firsts[s] + r
        tree, cand_ids = builder.build()
        forwarded = np.array([cand_round.get(int(c), -1) for c in cand_ids], np.int64)
        tokens = mx.array(tree.tokens.astype(np.uint32))
        return Draft(tree.parents, tokens, budget, depth, (rnd, forwarded, root_node))

    def commit(self, draft, path, emitted):
        if draft.extra is None:  # nothing was forwarded: the root is still pending
            self.pending = self.pending + list(emitted)
            return
        rnd, forwarded, root_node = draft.extra
        keep = list(range(root_node + 1))  # the pending tokens, root included
        for node in path[1:]:
            if forwarded[node] < 0:
                break
            keep.append(int(forwarded[node]))
        rnd.commit(keep)
        self.pending = list(emitted[len(keep) - root_node - 1 :])
