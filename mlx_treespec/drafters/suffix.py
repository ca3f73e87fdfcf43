"""SuffixDecoding-style drafting: frequent continuations of the longest matching suffix, as a tree.

`SuffixIndex` is a suffix trie of bounded depth D over one or more token sequences (the prompt
and generated text of a generation, and optionally earlier prompts and outputs of the process):
every substring of length <= D of every sequence is a path from the trie's root, and each trie
node counts the occurrences of its substring (``count``) and remembers the global clock of the
most recent one (``last``, for ties). A `SuffixCursor` appends to one sequence: it holds the trie
nodes of that sequence's current suffixes of length 0..D, so appending a token walks each of them
one child down (creating the child if needed): O(D) per token, never a rebuild.

Drafting (`SuffixDrafter.draft`): the longest suffix of the stream (length k <= ``max_match``,
k < D) whose trie node has a child, i.e. an earlier occurrence with a known continuation, is the
match; the tree grows best-first from it on the empirical probability of a path, the product of
``count(child) / count(parent)`` along it, cut to ``budget`` nodes, ``max_depth`` (and D - k)
levels, and optionally ``min_prob``. Children rank by count, ties to the most recent. The
probability never increases from a node to its child, so the best-first set is prefix-closed.
No match: ``root_only`` (a plain decoding step).

A shared `SuffixIndex` passed to several drafters (or one drafter across generations) keeps what
they saw, so an agent loop that re-reads its own earlier outputs finds them: each generation is a
new sequence of the index (no n-gram spans two sequences).
"""
from __future__ import annotations

import heapq
from typing import Callable, Hashable, List, Optional, Tuple

import numpy as np

from ..tree import MAX_NODES, DraftTree, check_int
from . import check_branches, check_budget_depth, host_draft, host_probe_parents

__all__ = ["SuffixIndex", "SuffixCursor", "expand_best_first", "SuffixDrafter"]


class SuffixIndex:
    """A suffix trie of depth ``depth`` with occurrence counts, shared by any number of sequences."""

    def __init__(self, depth: int = 32):
        self.depth = check_int(depth, "index_depth (a match and one continuation token)", 2)
        self.children: List[dict] = [{}]  # node -> {token: child node}
        self.count: List[int] = [0]  # occurrences of the node's substring
        self.last: List[int] = [0]  # clock of its most recent occurrence (end token)
        self.clock = 0  # tokens appended over all sequences

    def sequence(self, tokens=()) -> "SuffixCursor":
        """Start a new sequence (optionally with its first tokens); returns its cursor."""
        cur = SuffixCursor(self)
        cur.extend(tokens)
        return cur

    def add_sequence(self, tokens) -> None:
        """Index a finished sequence (e.g. an earlier output of an agent loop)."""
        self.sequence(tokens)

    def ranked_children(self, node, limit: Optional[int] = None) -> List[Tuple[int, int, int]]:
        """(token, child, count) of ``node``'s children, most frequent first, ties to the most recent."""
        items = self.children[node].items()
        count, last = self.count, self.last
        keyf = lambda tc: (count[tc[1]], last[tc[1]])
        ranked = heapq.nlargest(limit, items, key=keyf) if limit is not None else sorted(items, key=keyf, reverse=True)
        return [(t, c, count[c]) for t, c in ranked]


class SuffixCursor:
    """The append end of one sequence in a `SuffixIndex`."""

    def __init__(self, index: SuffixIndex):
        self.index = index
        self.active = [0]  # active[k]: the trie node of the sequence's suffix of length k
        self.length = 0
        self.last_token: Optional[int] = None

    def append(self, token: int):
        idx = self.index
        token = int(token)
        idx.clock += 1
        clock = idx.clock
        children, count, last = idx.children, idx.count, idx.last
        count[0] += 1
        new = [0]
        for node in self.active[: idx.depth]:  # suffixes shorter than D grow by one token
            child = children[node].get(token)
            if child is None:
                child = len(count)
                children[node][token] = child
                children.append({})
                count.append(0)
                last.append(0)
            count[child] += 1
            last[child] = clock
            new.append(child)
        self.active = new
        self.length += 1
        self.last_token = token

    def extend(self, tokens):
        for t in tokens:
            self.append(t)

    def match(self, max_match: int) -> Tuple[int, int]:
        """(k, node): the longest suffix (1 <= k <= max_match, k < D) with a continuation; (0, -1) if none."""
        children = self.index.children
        for k in range(min(max_match, len(self.active) - 1, self.index.depth - 1), 0, -1):
            node = self.active[k]
            if children[node]:
                return k, node
        return 0, -1


def expand_best_first(root: int, start: Hashable, ranked_children: Callable, count: Callable,
                      budget: int, max_depth: int, min_prob: float = 0.0,
                      branches: Optional[int] = None) -> DraftTree:
    """Grow a tree below trie node ``start`` best-first on path probability.

    ``ranked_children(node, limit)`` gives ``(token, child, count)`` best first;
    ``count(node)`` the node's occurrence count. A draft node's probability is its parent's
    times ``count(child) / count(parent)``; pops are in descending probability, ties to the
    earlier push (which follows the children's ranking); nodes are numbered in pop order.
    ``branches`` caps the children kept per node (1: a chain, the most frequent continuation).
    """
    check_branches(branches)
    budget = min(int(budget), MAX_NODES - 1)
    tokens, parents = [int(root)], [-1]
    heap, seq = [], 0
    taken = [0]  # children kept per tree node
    width = budget if branches is None else min(budget, branches)

    def push(node, prob, tree_parent, depth):
        nonlocal seq
        if depth > max_depth:
            return
        total = count(node)
        for t, child, c in ranked_children(node, width):
            p = prob * (c / total)
            if p < min_prob:
                break  # children are ranked by count: the rest are no likelier
            heapq.heappush(heap, (-p, seq, child, t, tree_parent, depth))
            seq += 1

    push(start, 1.0, 0, 1)
    while heap and len(tokens) <= budget:
        neg_p, _, child, t, tree_parent, depth = heapq.heappop(heap)
        if branches is not None and taken[tree_parent] >= branches:
            continue
        taken[tree_parent] += 1
        taken.append(0)
        node = len(tokens)
        tokens.append(int(t))
        parents.append(tree_parent)
        push(child, -neg_p, node, depth + 1)
    return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int32))


class SuffixDrafter:
    """SuffixDecoding-style tree drafter (``--drafter suffix``); no model.

    ``budget`` counts draft nodes (root excluded, at most ``MAX_NODES - 1``), ``max_depth`` caps the depth.
    ``index``: a `SuffixIndex` to share across drafters and generations (each ``prefill`` starts a
    new sequence in it and what is emitted stays indexed); None: a private index per generation
    of depth ``index_depth``. ``max_match`` caps the matched suffix length; ``min_prob`` drops
    draft nodes whose path probability is below it; ``branches=1`` gives a chain (the most
    frequent continuation; use it with ``budget == max_depth``).
    """

    def __init__(self, budget: int = 16, max_depth: int = 8, index: Optional[SuffixIndex] = None,
                 max_match: int = 16, min_prob: float = 0.0, index_depth: int = 32,
                 branches: Optional[int] = None):
        check_budget_depth(budget, max_depth)
        check_int(max_match, "max_match", 1)
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float, np.integer, np.floating)) \
                or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.budget = int(budget)
        self.max_depth = int(max_depth)
        if index is not None and not isinstance(index, SuffixIndex):
            raise ValueError(f"index= shares a SuffixIndex between drafters, got {type(index).__name__}")
        self.shared = index is not None
        self.index = index if index is not None else SuffixIndex(index_depth)
        self.index_depth = self.index.depth
        self.max_match = int(max_match)
        self.min_prob = float(min_prob)
        check_branches(branches)
        self.branches = branches
        self.cursor: Optional[SuffixCursor] = None
        self.last_match = 0  # length of the last draft's matched suffix (0: none)

    capture = ()

    def reset(self):
        """A private index starts over; a shared one keeps what it indexed (that is its use)."""
        if not self.shared:
            self.index = SuffixIndex(self.index_depth)
        self.cursor, self.last_match = None, 0

    def prefill(self, prompt):
        self.reset()
        self.cursor = self.index.sequence(int(t) for t in prompt)

    def probe_parents(self):
        return host_probe_parents(self.branches, self.budget, self.max_depth)

    def tree(self, root, max_depth):
        """The draft as a host tree (numpy, no device array; the root alone where nothing matches)."""
        cur = self.cursor
        if cur is None or cur.last_token != int(root):
            raise ValueError(f"root {root} is not the last token the drafter saw: call prefill/commit first")
        self.last_match = 0
        k, node = cur.match(self.max_match)
        depth = self.asked_depth = min(self.max_depth, int(max_depth), self.index.depth - k)
        if k == 0 or depth <= 0 or self.budget == 0:
            return DraftTree.root_only(root)
        self.last_match = k
        idx = self.index
        return expand_best_first(root, node, idx.ranked_children, idx.count.__getitem__, self.budget, depth,
                                 self.min_prob, self.branches)

    def draft(self, root, max_depth):
        tree = self.tree(root, max_depth)
        return host_draft(root, tree, self.budget, self.asked_depth)

    def commit(self, draft, path, emitted):
        self.cursor.extend(int(t) for t in emitted)
