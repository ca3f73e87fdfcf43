"""A draft model's tree with a prompt-lookup chain under the same root (`--draft-lookup`):
exact greedy and sampled output, rounds accepted into the lookup nodes, both drafters kept in
step with the text, the errors (CPU)."""
import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.generate import generate_step

import tiny
from mlx_treespec.drafters.merged import MergedDrafter
from mlx_treespec import RoundStats, make_drafter, tree_generate_step
from mlx_treespec.cli import main
from mlx_treespec.tree import MAX_NODES, DraftTree

N = 128
BASES = {
    "chain6": dict(draft_block_size=6),
    "k3l1s6": dict(tree_topk=3, tree_lanes=1, tree_depth=6, tree_budget=18),  # fixed layout
    "k3l1s6b10": dict(tree_topk=3, tree_lanes=1, tree_depth=6, tree_budget=10),  # ranked on the device
    "k3l2s4b12": dict(tree_topk=3, tree_lanes=2, tree_depth=4, tree_budget=12),  # EAGLE-2, device parents
}


@pytest.fixture(scope="module")
def pairs():
    cache = {}

    def get(family):
        if family not in cache:
            target = tiny.build(tiny.CONFIGS[family])
            cache[family] = (target, tiny.perturbed(target))
        return cache[family]

    return get


def repetitive_prompt(seed=0):
    # a phrase said three times, so the lookup finds continuations from the start
    phrase = np.random.default_rng(seed).integers(0, tiny.VOCAB, 7).tolist()
    return phrase * 3 + phrase[:2]


class Recorder(MergedDrafter):
    """Counts rounds whose accepted path ends in a lookup node, and checks that both drafters
    hold the text after each commit."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.into_lookup = 0
        self.text = []

    def prefill(self, prompt):
        super().prefill(prompt)
        self.text = list(prompt)

    def commit(self, draft, path, emitted):
        self.into_lookup += bool(len(path) and path[-1] >= draft.state.first_extra)
        super().commit(draft, path, emitted)
        self.text += list(emitted)
        assert self.extra.index.tokens == self.text
        base = self.base
        cached = base.cache[0].offset
        assert cached + len(base.pending) == len(self.text)
        assert base.pending == self.text[cached:]


def merged(draft, base, n=8, trust=None):
    m = make_drafter(draft, **BASES[base], draft_lookup=n, draft_lookup_trust=trust)
    return Recorder(m.base, m.extra, trust=m.trust)


@pytest.mark.parametrize("family,base", [(f, b) for f in ["qwen3", "llama", "gemma3", "phi3"] for b in BASES])
def test_greedy_identical_to_mlx_lm(pairs, family, base):
    target, draft = pairs(family)
    prompt = repetitive_prompt()
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N)]
    stats = RoundStats()
    drafter = merged(draft, base)
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=N, stats=stats)]
    assert out == ref
    assert len(set(ref)) >= 5 and sum(stats.accepted) > 0
    assert max(stats.nodes) <= MAX_NODES


@pytest.mark.parametrize("base", list(BASES))
def test_rounds_accepted_into_lookup_nodes_stay_exact(pairs, base):
    # a drafter unrelated to the target: the lookup's nodes carry many rounds, and commits after
    # them leave the draft model with several pending tokens
    target, _ = pairs("qwen3")
    weak = tiny.build(tiny.CONFIGS["qwen3"], seed=5)
    prompt = repetitive_prompt(2)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N)]
    drafter = merged(weak, base)
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=N)]
    assert out == ref
    assert drafter.into_lookup >= 3, "too few rounds ended in a lookup node: the merge is untested"


@pytest.mark.parametrize("base", ["chain6", "k3l1s6", "k3l2s4b12"])
@pytest.mark.parametrize("trust", [1, 3])
def test_lookup_alone_where_it_matched_long_enough(pairs, base, trust):
    # rounds whose lookup matched `trust` tokens or more skip the draft model: its pending
    # tokens pile up and go in with its next draft; the output stays the target's own
    target, draft = pairs("qwen3")
    prompt = repetitive_prompt(3)
    ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=N)]
    drafter = merged(draft, base, trust=trust)
    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=N, stats=stats)]
    assert out == ref
    assert 0 < drafter.rounds_alone < stats.rounds
    assert drafter.into_lookup > 0


@pytest.mark.parametrize("base,trust", [("chain6", None), ("k3l2s4b12", None), ("chain6", 2)])
def test_sampled_equals_plain_sampled(pairs, base, trust):
    target, draft = pairs("qwen3")
    prompt = repetitive_prompt(1)
    for seed in (0, 1):
        kw = dict(temp=0.8, top_p=0.95, seed=seed)
        ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=120, **kw)]
        out = [t for t, _, _ in tree_generate_step(prompt, target, merged(draft, base, trust=trust),
                                                   max_tokens=120, **kw)]
        assert out == ref


def test_lookup_fills_only_what_is_left_of_max_nodes(pairs):
    _, draft = pairs("qwen3")
    d = make_drafter(draft, tree_topk=8, tree_lanes=8, tree_depth=12, tree_budget=MAX_NODES - 16, draft_lookup=40)
    d.prefill(repetitive_prompt() * 3)
    out = d.draft(d.extra.index.tokens[-1], MAX_NODES - 1)
    assert out.size == MAX_NODES
    tree = DraftTree(np.array(out.tokens).astype(np.int64), out.layout.host_parents())
    assert tree.size == MAX_NODES
    parents = d.probe_parents()
    assert len(parents) == MAX_NODES
    DraftTree(np.zeros(len(parents), np.int64), parents)


def test_bad_options_are_refused(pairs):
    _, draft = pairs("qwen3")
    from mlx_treespec.drafters.lookup import LookupDrafter

    for kw, words in [(dict(draft_model=None, draft_lookup=4), "give --draft-model"),
                      (dict(draft_model=draft, drafter=LookupDrafter(), draft_lookup=4), "not --drafter"),
                      (dict(draft_model=draft, draft_lookup=MAX_NODES - 1), f"0..{MAX_NODES - 2}"),
                      (dict(draft_model=draft, draft_lookup=-1), f"0..{MAX_NODES - 2}"),
                      (dict(draft_model=draft, draft_lookup_trust=2), "needs --draft-lookup"),
                      (dict(draft_model=draft, draft_lookup=8, draft_lookup_trust=5), "1..4"),
                      (dict(draft_model=draft, draft_lookup=8, draft_lookup_trust=0), "1..4")]:
        with pytest.raises(ValueError, match=words):
            make_drafter(**kw)
    assert not isinstance(make_drafter(draft, draft_lookup=0), MergedDrafter)


def test_cli_draft_lookup(capsys):
    main(["--draft-block-size", "4", "--draft-lookup", "6", "--draft-lookup-trust", "3", "--max-tokens", "24",
          "--verbose", "T"])
    out = capsys.readouterr().out
    assert out.count("==========") == 2 and "emitted/verify" in out
    with pytest.raises(SystemExit) as e:
        main(["--drafter", "lookup", "--draft-lookup", "4", "--max-tokens", "4"])
    assert e.value.code == 2
    assert "--draft-lookup" in capsys.readouterr().err
