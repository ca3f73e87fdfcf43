"""Model-free drafters: prompt lookup (n-gram trie) and suffix (SuffixDecoding-style) trees.

Pure parts on hand-built token lists and against brute force; the incremental indexes against
rebuilds from scratch after every appended token; greedy output byte-identical to mlx-lm's
`generate_step` through the round loop; a round without a match verifies the root alone.
"""
import collections
import pathlib

import numpy as np
import pytest
import mlx.core as mx
from hypothesis import HealthCheck, given, settings, strategies as st
from mlx_lm.generate import generate_step

import tiny
from mlx_treespec.drafters.lookup import LookupDrafter, NgramIndex, merge_continuations, ngram_matches
from mlx_treespec.drafters.suffix import SuffixDrafter, SuffixIndex, expand_best_first
from mlx_treespec import RoundStats, tree_generate_step
from mlx_treespec.tree import MAX_NODES

DEMO = pathlib.Path(__file__).resolve().parents[1] / "mlx_treespec" / "demo" / "target"


def paths(tree):
    """The token path (root excluded) of every node, by node index."""
    out = [()]
    for i in range(1, tree.size):
        out.append(out[tree.parents[i]] + (int(tree.tokens[i]),))
    return out


def index_of(tokens, ngram_max=4, ngram_min=1):
    idx = NgramIndex(ngram_max, ngram_min)
    idx.extend(tokens)
    return idx


# --------------------------------------------------------------------------- n-gram lookup


def test_ngram_matches_most_recent_first_skipping_the_suffix_itself():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    idx = index_of(ctx)
    assert ngram_matches(idx, ctx, 3) == [6, 2]
    assert ngram_matches(idx, ctx, 3, max_matches=1) == [6]
    assert ngram_matches(idx, ctx, 4) == []  # (9|7|5, 1, 2, 3) never occurred before
    assert ngram_matches(idx, ctx, 1) == [6, 2]
    assert ngram_matches(idx, ctx, 13) == []  # longer than the context


def test_ngram_match_near_the_end_gives_a_short_continuation():
    ctx = [5, 6, 7, 5, 6]
    d = LookupDrafter(budget=10, max_depth=8)
    d.prefill(ctx)
    draft = d.draft(6, 8)
    # the match of (5, 6) ends at 1: its continuation is 7, 5, 6 (3 tokens, less than depth 8)
    assert d.last_match == 2
    assert np.array(draft.tokens).tolist() == [6, 7, 5, 6]
    assert draft.layout.parents.tolist() == [-1, 0, 1, 2]


def test_lookup_longest_n_wins_and_no_match_is_root_only():
    ctx = [1, 2, 3, 4, 8, 0, 2, 3, 4, 9, 1, 2, 3, 4]
    d = LookupDrafter(budget=10, max_depth=3)
    d.prefill(ctx)
    draft = d.draft(4, 63)
    # 4-gram (1,2,3,4) matched once (-> 8, 0, 2); the 3-gram's other continuation (9, ...) is left out
    assert d.last_match == 4
    assert np.array(draft.tokens).tolist() == [4, 8, 0, 2]
    # with backoff the shorter match's continuation becomes a second, lower-ranked branch
    d = LookupDrafter(budget=10, max_depth=3, backoff=True)
    d.prefill(ctx)
    draft = d.draft(4, 63)
    assert np.array(draft.tokens).tolist() == [4, 8, 0, 2, 9, 1, 2]
    assert draft.layout.parents.tolist() == [-1, 0, 1, 2, 0, 4, 5]
    d = LookupDrafter(budget=10, max_depth=3)
    d.prefill([10, 11, 12, 13])
    draft = d.draft(13, 63)
    assert draft.size == 1 and d.last_match == 0
    assert np.array(draft.tokens).tolist() == [13]


def test_merge_overlapping_continuations_shares_prefixes_and_ranks_by_count():
    conts = [[4, 6, 7], [4, 5, 1], [4, 6, 8], [2, 2, 2]]  # most recent first
    tree = merge_continuations(9, conts, budget=20)
    p = paths(tree)
    assert set(p) == {(), (4,), (4, 6), (4, 5), (4, 6, 7), (4, 6, 8), (4, 5, 1), (2,), (2, 2), (2, 2, 2)}
    assert len(p) == len(set(p))  # each shared prefix stored once
    # best-first: (4) count 3, (4,6) count 2, then count-1 nodes by recency: (4,6,7) rank 0 ...
    assert p[1:4] == [(4,), (4, 6), (4, 6, 7)]
    assert p[4] == (4, 5) and p[5] == (4, 5, 1) and p[6] == (4, 6, 8)
    # budget 3 keeps the three best; depth 1 keeps the first tokens only
    assert paths(merge_continuations(9, conts, budget=3)) == [(), (4,), (4, 6), (4, 6, 7)]
    assert set(paths(merge_continuations(9, conts, budget=20, max_depth=1))) == {(), (4,), (2,)}
    # branches=1: the single best continuation
    chain = merge_continuations(9, conts, budget=20, branches=1)
    assert chain.is_chain and paths(chain)[-1] == (4, 6, 7)
    # match length ranks before count
    tree = merge_continuations(9, conts, budget=1, lengths=[1, 1, 1, 3])
    assert paths(tree) == [(), (2,)]
    # weights count as frequency
    tree = merge_continuations(9, conts, budget=1, weights=[1, 1, 1, 5])
    assert paths(tree) == [(), (2,)]
    assert merge_continuations(9, [], budget=5).size == 1


@settings(max_examples=150, deadline=None)
@given(
    conts=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=7), min_size=0, max_size=8),
    lengths=st.lists(st.integers(1, 3), min_size=8, max_size=8),
    budget=st.integers(0, 70),
    depth=st.integers(1, 8),
)
def test_merge_budget_and_depth_cut_is_the_prefix_closed_top_set(conts, lengths, budget, depth):
    lengths = lengths[: len(conts)]
    tree = merge_continuations(7, conts, budget, depth, lengths=lengths)
    # brute force: every distinct prefix (<= depth) with its ranking key
    keys = {}
    for rank, c in enumerate(conts):
        for d in range(1, min(len(c), depth) + 1):
            pre = tuple(c[:d])
            bl, cnt, first = keys.get(pre, (0, 0, rank))
            keys[pre] = (max(bl, lengths[rank]), cnt + 1, min(first, rank))
    rank_key = {p: (-k[0], -k[1], k[2], len(p)) for p, k in keys.items()}
    got = paths(tree)
    assert got[0] == () and len(got) == len(set(got))
    kept = set(got[1:])
    assert len(kept) == min(budget, len(keys), MAX_NODES - 1)
    assert kept <= set(keys)
    assert tree.max_depth <= depth
    assert all(p[:-1] in kept or len(p) == 1 for p in kept), "not prefix-closed"
    if kept and len(kept) < len(keys):
        assert max(rank_key[p] for p in kept) <= min(rank_key[p] for p in set(keys) - kept)
    # numbering is pop order: keys never improve with the index
    ks = [rank_key[p] for p in got[1:]]
    assert ks == sorted(ks)


@settings(max_examples=60, deadline=None)
@given(stream=st.lists(st.integers(0, 3), min_size=1, max_size=60), nmin=st.integers(1, 3))
def test_ngram_index_incremental_equals_rebuild(stream, nmin):
    idx = NgramIndex(4, nmin)
    for j, t in enumerate(stream):
        idx.append(t)
        ctx = stream[: j + 1]
        naive = collections.defaultdict(list)
        for end in range(len(ctx)):
            for n in range(nmin, 5):
                if end - n + 1 >= 0:
                    naive[tuple(ctx[end - n + 1 : end + 1])].append(end)
        assert idx.ends == dict(naive)


# --------------------------------------------------------------------------- suffix index


class NaiveSuffix:
    """Counts of every substring (length <= depth) of the sequences, rebuilt from scratch."""

    def __init__(self, seqs, depth):
        self.depth = depth
        self.count = collections.Counter()
        self.last = {}
        self.kids = collections.defaultdict(set)
        clock = 0
        for seq in seqs:
            for j in range(len(seq)):  # token j ends substrings starting at s >= j - depth + 1
                clock += 1
                self.count[()] += 1
                for s in range(max(0, j - depth + 1), j + 1):
                    sub = tuple(seq[s : j + 1])
                    self.count[sub] += 1
                    self.last[sub] = clock
                    self.kids[sub[:-1]].add(sub)
        self.current = list(seqs[-1]) if seqs else []

    def ranked_children(self, node, limit=None):
        kids = sorted(self.kids.get(node, ()), key=lambda c: (self.count[c], self.last[c]), reverse=True)
        return [(c[-1], c, self.count[c]) for c in kids[:limit]]

    def match(self, max_match):
        for k in range(min(max_match, len(self.current), self.depth - 1), 0, -1):
            node = tuple(self.current[-k:])
            if self.kids.get(node):
                return k, node
        return 0, None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    earlier=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), max_size=2),
    stream=st.lists(st.integers(0, 4), min_size=1, max_size=45),
    depth=st.integers(2, 7),
    max_match=st.integers(1, 8),
    budget=st.integers(1, 20),
    branches=st.sampled_from([None, 1, 2]),
)
def test_suffix_index_incremental_equals_rebuild(earlier, stream, depth, max_match, budget, branches):
    index = SuffixIndex(depth)
    for seq in earlier:
        index.add_sequence(seq)
    d = SuffixDrafter(budget=budget, max_depth=6, index=index, max_match=max_match, branches=branches)
    d.prefill(stream[:1])
    for j in range(len(stream)):
        if j:  # one emitted token per round
            d.commit(None, [0], [stream[j]])
        naive = NaiveSuffix(earlier + [stream[: j + 1]], depth)
        k, node = naive.match(max_match)
        draft = d.draft(stream[j], 63)
        assert d.last_match == k
        if k == 0:
            assert draft.size == 1
            continue
        want = expand_best_first(stream[j], node, naive.ranked_children, naive.count.__getitem__, budget,
                                 min(6, depth - k), 0.0, branches)
        assert np.array(draft.tokens).tolist() == want.tokens.tolist()
        assert draft.layout.parents.tolist() == want.parents.tolist()
        # every counted substring agrees (trie paths <-> naive substrings)
        trie = {(): 0}
        stack = [((), 0)]
        while stack:
            sub, n = stack.pop()
            assert index.count[n] == naive.count[sub] and (not sub or index.last[n] == naive.last[sub])
            for t, c in index.children[n].items():
                trie[sub + (t,)] = c
                stack.append((sub + (t,), c))
        assert set(trie) == set(naive.count)


def check_top_set(naive, node, tree, budget, depth, min_prob=0.0):
    """The tree is the prefix-closed top `budget` set of paths below `node` by probability."""
    k = len(node)
    prob, stack = {}, [(node, 1.0)]
    while stack:
        sub, pr = stack.pop()
        for _, kid, c in naive.ranked_children(sub):
            p = pr * (c / naive.count[sub])
            if len(kid) - k <= depth and p >= min_prob:
                prob[kid[k:]] = p
                stack.append((kid, p))
    kept = set(paths(tree)[1:])
    assert len(kept) == min(budget, len(prob)) and kept <= set(prob)
    assert all(len(q) == 1 or q[:-1] in kept for q in kept), "not prefix-closed"
    if len(kept) < len(prob):
        assert min(prob[q] for q in kept) >= max(prob[q] for q in set(prob) - kept)
    got = [prob[q] for q in paths(tree)[1:]]
    assert got == sorted(got, reverse=True), "not in best-first order"


@settings(max_examples=60, deadline=None)
@given(
    stream=st.lists(st.integers(0, 2), min_size=30, max_size=90),
    max_match=st.integers(1, 3),
    budget=st.integers(1, 63),
    depth=st.integers(1, 8),
    min_prob=st.sampled_from([0.0, 0.05, 0.2]),
)
def test_suffix_expansion_is_the_top_set_by_path_probability(stream, max_match, budget, depth, min_prob):
    d = SuffixDrafter(budget=budget, max_depth=depth, max_match=max_match, min_prob=min_prob, index_depth=12)
    d.prefill(stream)
    draft = d.draft(stream[-1], 63)
    naive = NaiveSuffix([stream], 12)
    k, node = naive.match(max_match)
    assert d.last_match == k
    if k == 0:
        assert draft.size == 1
        return
    check_top_set(naive, node, _tree(draft), budget, depth, min_prob)


def test_suffix_expansion_is_best_first_on_empirical_probability():
    # "1 2" occurs 5 times (4 earlier + the suffix itself); "9 1 2" never before: the match is "1 2"
    # children of "1 2": 3 (x3), 4 (x1); of "1 2 3": 5 (x2), 6 (x1); of "1 2 3 5": 0 (x2)
    # path probabilities: 3 .6, 3 5 .4, 3 5 0 .4, 4 .2, 4 0 .2, 3 6 .2
    seq = [1, 2, 3, 5, 0, 1, 2, 3, 5, 0, 1, 2, 4, 0, 1, 2, 3, 6, 9, 1, 2]
    d = SuffixDrafter(budget=3, max_depth=4, index_depth=8)
    d.prefill(seq)
    draft = d.draft(2, 63)
    assert d.last_match == 2
    assert np.array(draft.tokens).tolist() == [2, 3, 5, 0]
    d = SuffixDrafter(budget=5, max_depth=2, index_depth=8)
    d.prefill(seq)
    draft = d.draft(2, 63)
    tree_paths = paths(_tree(draft))
    # ties at .2: 4 was pushed before 3 6, and 4 0 (.2 * 1/1) is pushed when 4 pops, still before 3 6
    assert tree_paths == [(), (3,), (3, 5), (4,), (4, 0), (3, 6)]
    # min_prob drops the unlikely branches
    d = SuffixDrafter(budget=5, max_depth=2, index_depth=8, min_prob=0.3)
    d.prefill(seq)
    assert paths(_tree(d.draft(2, 63))) == [(), (3,), (3, 5)]
    # no earlier occurrence of the root token: no draft
    d.prefill([1, 2, 3])
    assert d.draft(3, 63).size == 1 and d.last_match == 0


def _tree(draft):
    from mlx_treespec.tree import DraftTree

    return DraftTree(np.array(draft.tokens).astype(np.int64), draft.layout.parents)


def test_shared_suffix_index_carries_earlier_outputs():
    index = SuffixIndex(16)
    first = SuffixDrafter(budget=8, max_depth=8, index=index)
    first.prefill([40, 41, 42])
    draft = first.draft(42, 63)
    assert draft.size == 1
    first.commit(draft, [0], [43, 44, 45, 46, 47])
    second = SuffixDrafter(budget=8, max_depth=8, index=index)
    second.prefill([7, 42])
    draft = second.draft(42, 63)
    assert np.array(draft.tokens).tolist() == [42, 43, 44, 45, 46, 47]
    # a private index forgets: the same prompt has no match
    private = SuffixDrafter(budget=8, max_depth=8)
    private.prefill([7, 42])
    assert private.draft(42, 63).size == 1


def test_a_suffix_drafter_refuses_an_index_that_is_not_one():
    with pytest.raises(ValueError, match="SuffixIndex"):
        SuffixDrafter(budget=3, max_depth=4, index=[])


def test_drafters_refuse_a_root_they_did_not_see():
    for d in (LookupDrafter(4, 4), SuffixDrafter(4, 4)):
        d.prefill([1, 2, 3])
        with pytest.raises(ValueError, match="root"):
            d.draft(9, 4)


# --------------------------------------------------------------------------- through the round loop

N = 160


@pytest.fixture(scope="module")
def targets():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = tiny.build(tiny.CONFIGS[family])
        return cache[family]

    return get


def repetitive_prompt(seed=0, length=20, copies=3, subs=2):
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, tiny.VOCAB, length).tolist()
    out = []
    for _ in range(copies):
        p = list(phrase)
        for j in rng.choice(length, subs, replace=False):
            p[j] = int(rng.integers(0, tiny.VOCAB))
        out += p
    return out


DRAFTERS = {
    "lookup_chain": lambda: LookupDrafter(budget=6, max_depth=6, branches=1),
    "lookup_tree": lambda: LookupDrafter(budget=24, max_depth=8),
    "suffix_chain": lambda: SuffixDrafter(budget=6, max_depth=6, branches=1),
    "suffix_tree": lambda: SuffixDrafter(budget=24, max_depth=8),
}


def run(target, drafter, prompt, n=N, **kw):
    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=n, stats=stats, **kw)]
    return out, stats


# qwen3_5: model-free trees verify on recurrent (GatedDeltaNet) targets too
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_5"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_identical_to_mlx_lm(targets, family, name):
    target = targets(family)
    prompt = repetitive_prompt(1 if family == "gemma3" else 0)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N)]
    out, stats = run(target, DRAFTERS[name](), prompt)
    assert out == ref
    assert len(set(ref)) >= 5, "the tiny target does not vary its output"
    assert sum(stats.accepted) > 0, "no draft was ever accepted"
    assert any(a < d for a, d in zip(stats.accepted, stats.depth)), "no draft was ever rejected"
    if name.endswith("chain"):
        assert max(stats.nodes) <= 7
    else:
        assert max(stats.nodes) > 7, "the tree drafter never branched beyond a chain's width"


def test_greedy_identical_with_stop_tokens_and_max_tokens(targets):
    target = targets("qwen3")
    prompt = repetitive_prompt(2)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N)]
    stop = ref[37]
    want = ref[: ref.index(stop) + 1]
    for make in DRAFTERS.values():
        out, _ = run(target, make(), prompt, stop_tokens=[stop])
        assert out == want
        for n in (1, 9, 50):
            out, _ = run(target, make(), prompt, n=n)
            assert out == ref[:n]


class Recording:
    """Wraps a drafter; records per round whether it found a match."""

    def __init__(self, inner):
        self.inner = inner
        self.matched = []

    def prefill(self, prompt):
        self.inner.prefill(prompt)

    def draft(self, root, max_depth):
        draft = self.inner.draft(root, max_depth)
        self.matched.append(self.inner.last_match > 0)
        return draft

    def commit(self, draft, path, emitted):
        self.inner.commit(draft, path, emitted)

    def reset(self):
        self.inner.reset()

    def probe_parents(self):
        return self.inner.probe_parents()


@pytest.mark.parametrize("make", [lambda: LookupDrafter(16, 8, ngram_min=2), lambda: SuffixDrafter(16, 8)],
                         ids=["lookup", "suffix"])
def test_no_match_round_verifies_the_root_alone(targets, make):
    target = targets("qwen3")
    prompt = list(range(30))  # all distinct: the first round cannot match
    drafter = Recording(make())
    out, stats = run(target, drafter, prompt, n=120)
    assert out == [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=120)]
    assert len(drafter.matched) == stats.rounds
    assert not all(drafter.matched) and any(drafter.matched)
    for matched, nodes in zip(drafter.matched, stats.nodes):
        assert (nodes > 1) == matched


DEMO_N = 40


@pytest.fixture(scope="module")
def demo():
    """The shipped target, a copy-editing prompt (this repo's tests/tiny.py, then an edited copy
    of its start) and mlx-lm's greedy reference, computed once (the target is slow on CPU)."""
    from mlx_lm import load

    model, tokenizer = load(str(DEMO))
    src = pathlib.Path(tiny.__file__).read_text()
    prompt = tokenizer.encode(src[:450] + "\n# edited copy\n" + src[:160].replace("weights", "params"))
    ref = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=DEMO_N)]
    return model, prompt, ref


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason=f"no shipped demo target at {DEMO}")
@pytest.mark.parametrize("name", ["lookup_chain", "lookup_tree", "suffix_tree"])
def test_greedy_identical_on_demo_target(demo, name):
    model, prompt, ref = demo
    out, stats = run(model, DRAFTERS[name](), prompt, n=DEMO_N)
    assert out == ref
    assert sum(stats.accepted) > 0, "the demo target never followed the copied text"


def test_match_length_is_what_draft_matches():
    from mlx_treespec.drafters.lookup import LookupDrafter

    rng = np.random.default_rng(3)
    d = LookupDrafter(8, 4)
    d.prefill(rng.integers(0, 6, 30).tolist())
    for t in rng.integers(0, 6, 40).tolist():
        d.commit(None, None, [t])
        m = d.match_length()
        d.draft(t, 4)
        assert m == d.last_match
