"""Prompt-lookup drafting as a tree: the continuations of earlier n-gram matches, merged.

The drafter keeps the token stream (prompt, then every emitted token) and an n-gram index of it:
a dict from each n-gram (``ngram_min <= n <= ngram_max``) to the positions where it ends, in
stream order. Appending a token adds ``ngram_max - ngram_min + 1`` entries, so the index is
updated per emitted token, never rebuilt.

At draft time the suffix ending at the root is looked up for the longest n with an earlier
occurrence (``backoff=True`` also adds shorter-n matches at positions not already taken). The
tokens that followed each match (most recent match first, at most ``max_matches`` of them, each
at most ``max_depth`` long) are merged into one prefix tree (a trie: a shared prefix is one
node), and the best ``budget`` trie nodes are kept. A node ranks by

1. the longest match length among the continuations through it,
2. the total weight (count) of the continuations through it,
3. recency: the rank of its most recent continuation (lower first),
4. depth (shallower first), then creation order,

a key that never improves from a node to its child (the child's continuations are a subset of
its parent's), so the top ``budget`` nodes are prefix-closed and a best-first pop over the trie
finds exactly them. With ``branches=1`` every node keeps only its best child: the tree is a chain,
the single best continuation (the classic prompt-lookup chain).

No match: ``draft`` returns ``root_only`` and the round is a plain decoding step.

Everything is on the host (numpy and Python); the tokens go to the device once per round.
"""
from __future__ import annotations

import heapq
from itertools import islice
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..tree import MAX_NODES, DraftTree, check_int
from . import check_branches, check_budget_depth, host_draft, host_probe_parents

__all__ = ["NgramIndex", "ngram_matches", "merge_continuations", "LookupDrafter"]


class NgramIndex:
    """The token stream and a dict n-gram -> end positions (ascending), n in [ngram_min, ngram_max]."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        check_int(ngram_max, "ngram_max", 1)
        check_int(ngram_min, "ngram_min", 1)
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got ngram_min={ngram_min}, ngram_max={ngram_max}")
        self.ngram_max = int(ngram_max)
        self.ngram_min = int(ngram_min)
        self.tokens: List[int] = []
        self.ends: Dict[Tuple[int, ...], List[int]] = {}

    def __len__(self):
        return len(self.tokens)

    def append(self, token: int):
        """Add one token: O(ngram_max) new index entries (one per n that fits)."""
        toks = self.tokens
        toks.append(int(token))
        end = len(toks) - 1
        for n in range(self.ngram_min, min(self.ngram_max, len(toks)) + 1):
            self.ends.setdefault(tuple(toks[-n:]), []).append(end)

    def extend(self, tokens):
        for t in tokens:
            self.append(t)

    def get(self, key, default=()):
        return self.ends.get(key, default)


def ngram_matches(index, context: Sequence[int], n: int, max_matches: Optional[int] = None) -> List[int]:
    """End positions of the earlier occurrences of ``context``'s last n tokens, most recent first.

    ``index`` maps n-gram tuples to ascending end positions in ``context`` (an ``NgramIndex`` or a
    plain dict). The occurrence ending at the last position (the suffix itself, which has no
    continuation yet) is skipped; the continuation of a match ending at ``p`` is
    ``context[p + 1:]``.
    """
    if n < 1 or n > len(context):
        return []
    last = len(context) - 1
    ends = index.get(tuple(int(t) for t in context[-n:]), ())
    found = (p for p in reversed(ends) if p < last)
    return list(found if max_matches is None else islice(found, max_matches))


def merge_continuations(root: int, continuations, budget: int, max_depth: Optional[int] = None, *,
                        weights=None, lengths=None, branches: Optional[int] = None) -> DraftTree:
    """Merge token continuations into one prefix tree rooted at ``root``; keep the best ``budget``.

    ``continuations`` are token lists in recency order (index 0 most recent); ``weights`` (> 0,
    default 1 each) are their frequency contributions and ``lengths`` (default all equal) their
    match lengths. Each is cut to ``max_depth`` tokens. Trie nodes rank as the module docstring
    says; nodes are numbered in best-first pop order (``parents[i] < i``). ``branches`` caps the
    children kept per node (1: a chain following the best child).
    """
    budget = min(int(budget), MAX_NODES - 1)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    check_branches(branches)
    m = len(continuations)
    unit = weights is None
    weights = [1.0] * m if weights is None else [float(w) for w in weights]
    lengths = [0] * m if lengths is None else [int(x) for x in lengths]
    if len(weights) != m or len(lengths) != m:
        raise ValueError(f"got {m} continuations, {len(weights)} weights and {len(lengths)} lengths")
    if any(not w > 0 for w in weights):
        raise ValueError("weights must be > 0 (a continuation's frequency contribution)")

    # identical continuations (a text that loops: every match continues alike) walk one trie
    # path: each is walked once, carrying their summed weight, longest match and first rank,
    # which are the fields the walks would have left (the same trie, nodes in the same order).
    # Only with unit weights: float sums in another order could break a tie differently
    walks: List[list] = []  # [tokens, weight, match length, rank], in rank order
    seen: Dict[tuple, list] = {}
    for rank, cont in enumerate(continuations):
        cut = tuple(int(t) for t in list(cont)[: max_depth if max_depth is not None else len(cont)])
        if unit and cut in seen:
            entry = seen[cut]
            entry[1] += weights[rank]
            entry[2] = max(entry[2], lengths[rank])
        else:
            walks.append([cut, weights[rank], lengths[rank], rank])
            seen[cut] = walks[-1]

    # the trie: node 0 is the root; per node its token, depth, children and ranking fields
    kids: List[Dict[int, int]] = [{}]
    tok = [int(root)]
    depth = [0]
    best_len = [0]
    weight = [0.0]
    first = [m]
    for cont, w, length, rank in walks:
        node = 0
        for t in cont:
            child = kids[node].get(t)
            if child is None:
                child = len(tok)
                kids[node][t] = child
                kids.append({})
                tok.append(t)
                depth.append(depth[node] + 1)
                best_len.append(length)
                weight.append(0.0)
                first.append(rank)
            node = child
            best_len[node] = max(best_len[node], length)
            weight[node] += w
            first[node] = min(first[node], rank)

    def key(c):
        return (-best_len[c], -weight[c], first[c], depth[c], c)

    tokens, parents = [int(root)], [-1]
    taken = [0]  # children kept per tree node
    heap = [(key(c), c, 0) for c in kids[0].values()]
    heapq.heapify(heap)
    while heap and len(tokens) <= budget:
        _, c, parent = heapq.heappop(heap)
        if branches is not None and taken[parent] >= branches:
            continue
        taken[parent] += 1
        node = len(tokens)
        tokens.append(tok[c])
        parents.append(parent)
        taken.append(0)
        for g in kids[c].values():
            heapq.heappush(heap, (key(g), g, node))
    return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int32))


class LookupDrafter:
    """Prompt-lookup tree drafter (``--drafter lookup``); no model.

    ``budget`` counts draft nodes (root excluded, at most ``MAX_NODES - 1``); ``max_depth`` caps the tree depth;
    ``branches=1`` gives the chain of the single best continuation (use it with
    ``budget == max_depth`` for the classic prompt-lookup chain).
    """

    def __init__(self, budget: int = 16, max_depth: int = 8, ngram_max: int = 4, ngram_min: int = 1,
                 max_matches: int = 16, branches: Optional[int] = None, backoff: bool = False):
        check_budget_depth(budget, max_depth)
        check_int(max_matches, "max_matches", 1)
        check_branches(branches)
        NgramIndex(ngram_max, ngram_min)  # validates the n range
        self.budget = int(budget)
        self.max_depth = int(max_depth)
        self.ngram_max = int(ngram_max)
        self.ngram_min = int(ngram_min)
        self.max_matches = int(max_matches)
        self.branches = branches
        self.backoff = bool(backoff)
        self.index = NgramIndex(ngram_max, ngram_min)
        self.last_match = 0  # n of the last draft's match (0: none), for stats and tests

    capture = ()

    def reset(self):
        self.index = NgramIndex(self.ngram_max, self.ngram_min)
        self.last_match = 0

    def prefill(self, prompt):
        self.reset()
        self.index.extend(int(t) for t in prompt)

    def probe_parents(self):
        return host_probe_parents(self.branches, self.budget, self.max_depth)

    def continuations(self, depth):
        """(continuations, match lengths) for the current suffix, most recent first."""
        ctx = self.index.tokens
        conts, lens, seen = [], [], set()
        for n in range(min(self.ngram_max, len(ctx)), self.ngram_min - 1, -1):
            for p in ngram_matches(self.index, ctx, n, self.max_matches - len(conts) + len(seen)):
                if p in seen:
                    continue
                seen.add(p)
                conts.append(ctx[p + 1 : p + 1 + depth])
                lens.append(n)
                if len(conts) >= self.max_matches:
                    return conts, lens
            if conts and not self.backoff:
                break
        return conts, lens

    def match_length(self):
        """The longest n-gram ending the text with an earlier occurrence (0: none): what
        `draft` would match, without building its tree (a few dict lookups)."""
        ctx = self.index.tokens
        for n in range(min(self.ngram_max, len(ctx)), self.ngram_min - 1, -1):
            if ngram_matches(self.index, ctx, n, 1):
                return n
        return 0

    def tree(self, root, max_depth):
        """The draft as a host tree (numpy, no device array; the root alone where nothing matches)."""
        ctx = self.index.tokens
        if not ctx or ctx[-1] != int(root):
            raise ValueError(f"root {root} is not the last token the drafter saw: call prefill/commit first")
        depth = min(self.max_depth, int(max_depth))
        self.last_match = 0
        conts, lens = self.continuations(depth) if depth > 0 and self.budget > 0 else ([], [])
        if not conts:
            return DraftTree.root_only(root)
        self.last_match = max(lens)
        return merge_continuations(root, conts, self.budget, depth, lengths=lens, branches=self.branches)

    def draft(self, root, max_depth):
        return host_draft(root, self.tree(root, max_depth), self.budget, min(self.max_depth, int(max_depth)))

    def commit(self, draft, path, emitted):
        self.index.extend(int(t) for t in emitted)
