"""MTP and EAGLE-3 heads as drafters: exact output for chains, one-lane and EAGLE-2 trees, on the
heads' published layouts, hybrid targets included (CPU, tiny random heads)."""
import os
import sys
import types

import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import tiny
from test_heads import make_eagle3, make_mtp
from mlx_treespec import RoundStats, make_drafter, tree_generate_step
from mlx_treespec.draft import Draft
from mlx_treespec.drafters.head import HeadDrafter
from mlx_treespec.drafters.model import keeps_lanes_only

N = 48


class OracleHead(tiny.FollowsText, HeadDrafter):
    """A head drafter whose spine tokens are replaced by the target's own greedy continuation at
    random steps (its logits, siblings and hidden states are the head's): rounds accept drafts,
    so commits of accepted paths and the pending slots' target rows are exercised."""

    def _spine(self, logits, rnd, depth):
        rows, toks = super()._spine(logits, rnd, depth)
        cache = make_prompt_cache(self.target)
        out = self.target(mx.array(self.text)[None], cache=cache)[0, -1]
        for s in range(depth):
            t = int(mx.argmax(out))
            if self.rng.random() < 0.8:
                toks[s] = mx.array([t], mx.uint32)
            out = self.target(mx.array([[int(toks[s].item())]]), cache=cache)[0, -1]
        return rows, toks


def plain(model, prompt, n=N, **kw):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kw)]


SHAPES = {"chain4": dict(topk=1, depth=4), "k3l1s4": dict(topk=3, lanes=1, depth=4, budget=12),
          "k3s3b9": dict(topk=3, lanes=3, depth=3, budget=9), "k3l2s4b21": dict(topk=3, lanes=2, depth=4, budget=21)}


@pytest.mark.parametrize("kind", ["mtp-qwen3_5_tied", "mtp-qwen3_next_moe", "eagle3-safeailab", "eagle3-speculators"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_identical_to_mlx_lm(tmp_path, kind, shape):
    family, name = kind.split("-", 1)
    head, target = (make_mtp(tmp_path, name)[:2] if family == "mtp" else make_eagle3(tmp_path, name)[:2])
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()
    ref = plain(target, prompt)
    oracle = shape in ("chain4", "k3l1s4")  # lanes: their own tokens (random heads accept little there)
    drafter = OracleHead(head, target, **SHAPES[shape]) if oracle else HeadDrafter(head, **SHAPES[shape])
    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=N, stats=stats)]
    assert out == ref
    if oracle:
        assert sum(stats.accepted) > 0 and any(a < d for a, d in zip(stats.accepted, stats.depth))


@pytest.mark.parametrize("opts", [dict(max_kv_size=16), dict(kv_bits=8, kv_group_size=32, quantized_kv_start=20)])
def test_greedy_identical_rotating_and_quantized(tmp_path, opts):
    from test_heads import EAGLE_TARGET

    head, target = make_eagle3(tmp_path, "safeailab")[:2]
    if "kv_bits" in opts:  # KV quantization takes groups of 32: a target of head_dim 32, same width
        target = tiny.build(dict(EAGLE_TARGET, head_dim=32))
        head.bind(target)
    prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, 20).tolist()
    ref = plain(target, prompt, **opts)
    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step(prompt, target, OracleHead(head, target, topk=2, lanes=1, depth=3),
                                               max_tokens=N, stats=stats, **opts)]
    assert out == ref and sum(stats.accepted) > 0


def test_make_drafter_loads_heads_and_merges_lookup(tmp_path):
    head, target = make_mtp(tmp_path, "qwen3_5_tied")[:2]
    folder = str(tmp_path / "qwen3_5_tied")
    prompt = np.random.default_rng(2).integers(0, tiny.VOCAB, 8).tolist() * 2
    ref = plain(target, prompt)
    for opts in (dict(draft_block_size=3), dict(tree_topk=3, tree_lanes=1, tree_depth=3),
                 dict(draft_block_size=3, draft_lookup=4)):
        d = make_drafter(folder, drafter="mtp", target=target, **opts)
        assert [t for t, _, _ in tree_generate_step(prompt, target, d, max_tokens=N)] == ref
    with pytest.raises(ValueError, match="target="):
        make_drafter(folder, drafter="mtp")
    # the adaptive default over a head: its one-lane tree in the round loop, its chain queued
    d = make_drafter(folder, drafter="mtp", target=target)
    assert d.primary.queues_trees and not d.queues_trees and d.ahead == d.primary.chain_ahead
    assert [t for t, _, _ in tree_generate_step(prompt, target, d, max_tokens=N)] == ref


def test_a_head_under_a_lookup_chain_keeps_a_target_row_for_every_emitted_token(monkeypatch):
    # --draft-lookup over a head: where the round accepts lookup nodes, the head still gets the
    # target's row of each emitted token (it got the rows of its own nodes only, and drafted
    # later rounds from rows padded with zeros)
    import mlx_lm

    from mlx_treespec.demo import demo_path
    from mlx_treespec.drafters.merged import MergedDrafter

    target, tok = mlx_lm.load(demo_path("target"))
    prompt = tok.encode("def parse(value):\n    return value\n\n\ndef parse(value):\n")
    seen = []
    real = MergedDrafter.commit

    def commit(self, draft, path, emitted, *hidden):
        real(self, draft, path, emitted, *hidden)
        head = self.base
        lookup_taken = bool((np.asarray(path) >= draft.state.first_extra).any())
        seen.append((lookup_taken, len(head.pending) == head.pending_hidden.shape[0]))

    monkeypatch.setattr(MergedDrafter, "commit", commit)
    d = make_drafter(demo_path("eagle3"), drafter="eagle3", target=target, draft_block_size=4, draft_lookup=8)
    assert [t for t, _, _ in tree_generate_step(prompt, target, d, max_tokens=64)] == plain(target, prompt, n=64)
    assert any(taken for taken, _ in seen) and all(rows for _, rows in seen), seen


def test_the_adaptive_head_queues_its_tree_when_sampling(tmp_path, monkeypatch):
    # where rounds queue (here on CPU), the adaptive default over a head queues its chain when
    # greedy (9 nodes) and its one-lane tree when sampling (its draws miss more often: the
    # runners-up pay): its own K3 S8 (25) below the first of spec.SAMPLED_TREES, then each
    # shape from its temp up (K5 S4: 21, K6 S3: 19), generation by generation in one drafter;
    # every generation plain (sampled) decoding's tokens. A shape given is kept at every
    # temperature
    import mlx_treespec.verify as verify
    from test_adaptive import flat

    from mlx_treespec.adaptive import AdaptiveDrafter
    from mlx_treespec.spec import SAMPLED_TREES, DraftSpec

    head, target = make_mtp(tmp_path, "qwen3_5_tied")[:2]
    folder = str(tmp_path / "qwen3_5_tied")
    prompt = np.random.default_rng(2).integers(0, tiny.VOCAB, 8).tolist() * 2
    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    (warm, _), (hot, _) = SAMPLED_TREES
    assert 0.3 < warm <= 0.7 < hot <= 1.0
    d = make_drafter(folder, drafter="mtp", target=target)
    d.costs, d.context_costs = (1e6, flat(1.0)), None  # plain decoding slow: queued rounds go on
    for sampling, nodes, tier in ((dict(), 1 + 8, 0), (dict(temp=0.7, seed=1), 1 + 5 * 4, 1),
                                  (dict(temp=0.3, seed=1), 1 + 3 * 8, 0), (dict(temp=1.0, seed=2), 1 + 6 * 3, 2),
                                  (dict(temp=warm, seed=2), 1 + 5 * 4, 1), (dict(temp=hot, seed=3), 1 + 6 * 3, 2),
                                  (dict(), 1 + 8, 0)):
        ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=N, **sampling)]
        stats = RoundStats()
        assert [t for t, _, _ in tree_generate_step(prompt, target, d, max_tokens=N, stats=stats, **sampling)] == ref
        queued = [n for n, k in zip(stats.nodes, stats.drafter) if k == "queued"]
        assert queued and set(queued) == {nodes}, (sampling, stats.nodes, stats.drafter)
        assert d.queues_trees == bool(sampling) and (d.draw is None) != bool(sampling)
        # (the primary's rounds in each shape book to a rate of their own: they cost apart)
        assert d.tier == tier and d.rate("primary") is d.rates[("sampled", tier) if tier else "primary"]
    assert DraftSpec.from_options("mtp").sampled_shapes == ((warm, (5, 1, 4, 20)), (hot, (6, 1, 3, 18)))
    for shape in (dict(tree_topk=3, tree_depth=6), dict(draft_block_size=4)):
        assert DraftSpec.from_options("mtp", **shape).sampled_shapes is None
    assert DraftSpec.from_options("dflash").sampled_shapes is None
    d.draw = types.SimpleNamespace(temp=1.0)
    assert d.tier == 2 and d.primary.depth == 3
    d.draw = types.SimpleNamespace(temp=-0.5)  # below every threshold: the greedy shape
    assert d.tier == 0 and d.primary.depth == 8
    d.draw = None
    for bad in (((0.8, (6, 1, 3, 18)), (0.55, (5, 1, 4, 20))), ((0.0, (5, 1, 4, 20)),),
                ((0.55, (5, 1, 4, 20)), (0.55, (6, 1, 3, 18))), ((float("nan"), (5, 1, 4, 20)),)):
        with pytest.raises(ValueError, match="strictly ascending temp, each above 0: got temps"):
            AdaptiveDrafter(primary=d.primary, sampled_shapes=bad)
    with pytest.raises(ValueError, match="pass primary="):
        AdaptiveDrafter(host=d.host, sampled_shapes=((0.55, (5, 1, 4, 20)),))
    with pytest.raises(ValueError, match="takes no shape"):  # (an AttributeError deep inside, before)
        AdaptiveDrafter(primary=d.host, sampled_shapes=((0.55, (5, 1, 4, 20)),))


def test_sampled_the_adaptive_head_never_hands_its_queued_rounds_back(tmp_path, monkeypatch):
    # queued rounds that lose to plain decoding (its start-up cost set near zero here) hand
    # back at their first decision when greedy; sampled, a head's go on to the generation's end
    # (AdaptiveDrafter.holds_queue: a sampled round's count swings with the draws). Tokens are
    # plain (sampled) decoding's either way
    import mlx_treespec.adaptive as adaptive
    import mlx_treespec.verify as verify
    from test_adaptive import flat

    head, target = make_mtp(tmp_path, "qwen3_5_tied")[:2]
    folder = str(tmp_path / "qwen3_5_tied")
    prompt = np.random.default_rng(4).integers(0, tiny.VOCAB, 12).tolist()
    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    monkeypatch.setattr(adaptive, "SPIKE", float("inf"))  # (a slow CPU round booked: the decision on time)
    first_decision = adaptive.QUEUED_WARM + adaptive.QUEUED_MIN
    for sampling in (dict(), dict(temp=0.7, seed=1)):
        ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=N, **sampling)]
        d, stats = make_drafter(folder, drafter="mtp", target=target), RoundStats()
        d.costs, d.context_costs = (1e-6, flat(1.0)), None  # plain a million tokens a ms: every queued round loses
        assert [t for t, _, _ in tree_generate_step(prompt, target, d, max_tokens=N, stats=stats, **sampling)] == ref
        queued = stats.drafter.count("queued")
        if sampling:
            assert d.holds_queue and queued == len(stats.drafter) > first_decision, stats.drafter
        else:
            assert not d.holds_queue and queued == first_decision < len(stats.drafter), stats.drafter


def test_one_token_prompt(tmp_path):
    # nothing to continue from in the first round: root only, then the head drafts
    head, target = make_mtp(tmp_path, "qwen3_5_tied")[:2]
    ref = plain(target, [7])
    stats = RoundStats()
    out = [t for t, _, _ in tree_generate_step([7], target, OracleHead(head, target, topk=1, depth=3),
                                               max_tokens=N, stats=stats)]
    assert out == ref and stats.depth[0] == 0 and sum(stats.accepted) > 0


def _truth_kept(pos, step):
    """Whether the oracle below drafts the target's own token at this draft step: a function of
    the text's length, so a round drafted twice (queued past a hand-back, then by the round
    loop) drafts the same."""
    return (7 * pos + 13 * step) % 10 < 8


def _leaf_truth(pos, step):
    """Where the oracle below keeps the head's spine token, whether it makes the target's own
    token the step's first runner-up (a one-lane tree's path then ends at that leaf)."""
    return (pos + step) % 3 != 0


class PositionOracle(tiny.FollowsText, HeadDrafter):
    """A head drafter whose chains are the head's own with most steps replaced by the target's
    greedy continuation (rounds accept and reject), and, in one-lane trees, whose other steps
    mostly rank the target's token first among the runners-up (paths end at leaves), in the
    round loop (`_spine`) and in rounds queued ahead (`_steps_ahead`) alike. Records the head's
    own chain per text position (`raw`) and the queued rounds whose path ends at a leaf
    (`leaf_ends`); queued rounds hand back after `hand_back_after` of them (None: never)."""

    hand_back_after = None

    def __init__(self, source, target, **kw):
        super().__init__(source, target, **kw)
        self.raw, self.queued_rounds, self.leaf_ends = [], 0, 0

    def _oracle(self, raw, logits):
        """(the chain verified, the steps' logits [S, V] with leaf truths ranked first after
        the spine token (None for a chain), whether the round's path ends at a leaf)."""
        pos = len(self.text)
        self.raw.append((pos, raw))
        cache = make_prompt_cache(self.target)
        out = self.target(mx.array(self.text)[None], cache=cache)[0, -1]
        chain, bumped, agreed, leaf = [], None if logits is None else np.array(logits.astype(mx.float32)), True, False
        for s, r in enumerate(raw):
            truth = int(mx.argmax(out))
            chain.append(truth if _truth_kept(pos, s) else r)
            if bumped is not None and chain[-1] != truth and _leaf_truth(pos, s):
                bumped[s, truth] = bumped[s].max() + 1
                leaf = leaf or agreed  # (every step before it agreed: the path ends here)
            agreed = agreed and chain[-1] == truth
            out = self.target(mx.array([[chain[-1]]]), cache=cache)[0, -1]
        return chain, None if bumped is None else mx.array(bumped).astype(logits.dtype), leaf

    def _spine(self, logits, rnd, depth):
        rows, toks = super()._spine(logits, rnd, depth)
        chain, bumped, _ = self._oracle([int(t.item()) for t in toks], mx.concatenate(rows) if self.topk > 1 else None)
        return (rows if bumped is None else list(bumped[:, None])), [mx.array([t], mx.uint32) for t in chain]

    def _steps_ahead(self, root, rows, count, path, kind):
        out = super()._steps_ahead(root, rows, count, path, kind)  # (a tree's: one lane's [S, 1])
        raw, logits = out[:2]
        if rows is not None:  # the last round's accepted drafts, then its target token (the root)
            accepted = self.last[: count.item() - 1] if path is None else np.array(path[1 : count.item()]).tolist()
            self.text += accepted + [int(root.item())]
        self.last, logits, leaf = self._oracle(np.array(raw).reshape(-1).tolist(), logits)
        self.leaf_ends += leaf
        chain = mx.array(self.last, mx.uint32)
        self._queued["prev"] = mx.concatenate([root.astype(mx.uint32), chain])  # (what is verified)
        return (chain, logits) if kind == "chain" else (chain[:, None], logits, out[2])

    def queue_more(self, tokens, ms):
        self.queued_rounds += 1
        return self.hand_back_after is None or self.queued_rounds < self.hand_back_after


def _round_loop_then_queued(oracle, head, target, prompt, opts, hand_back, monkeypatch, **sampling):
    """The oracle drafter's generation through the round loop, then queued (the GPU path, here on
    CPU) handing back after `hand_back` queued rounds (None: never): both plain decoding's
    tokens (with `sampling`: plain sampled decoding's), the queued one's first rounds queued and
    none after a hand-back. Returns (the round loop's drafter, the queued one, its RoundStats)."""
    import mlx_treespec.verify as verify

    ref = plain(target, prompt) if not sampling else \
        [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=N, **sampling)]
    host = oracle(head, target, **opts)
    assert [t for t, _, _ in tree_generate_step(prompt, target, host, max_tokens=N, **sampling)] == ref
    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    queued = oracle(head, target, **opts)
    queued.hand_back_after = hand_back
    stats = RoundStats()
    assert [t for t, _, _ in tree_generate_step(prompt, target, queued, max_tokens=N, stats=stats,
                                                **sampling)] == ref
    assert (queued.draw is not None) == bool(sampling.get("temp"))
    kinds = ["queued"] * (hand_back or len(stats.drafter))
    assert stats.drafter[: len(kinds)] == kinds and "queued" not in stats.drafter[len(kinds):]
    return host, queued, stats


QUEUED = [(kind, "chain", h) for kind in ("mtp-qwen3_5_tied", "mtp-qwen3_next_moe", "eagle3-safeailab",
                                         "eagle3-speculators") for h in (None, 3)] + \
    [(kind, "tree", h) for kind in ("mtp-qwen3_5_tied", "eagle3-safeailab") for h in (None, 3)]


@pytest.mark.parametrize("kind, shape, hand_back", QUEUED)
def test_queued_head_rounds_draft_what_the_round_loop_drafts(tmp_path, monkeypatch, kind, shape, hand_back):
    # where rounds queue (the GPU path, here on CPU), a head's chain is drafted on the device:
    # the slots of the last round's accepted path at a device offset, then one step per depth;
    # a one-lane tree adds each step's runners-up as leaves. Its chains are the round loop's,
    # round by round (the head's own tokens, before the oracle), through paths that end at a
    # leaf and a hand-back to the round loop too; tokens are plain decoding's
    family, name = kind.split("-", 1)
    head, target = (make_mtp(tmp_path, name)[:2] if family == "mtp" else make_eagle3(tmp_path, name)[:2])
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()
    opts = dict(topk=1, depth=4) if shape == "chain" else dict(topk=3, lanes=1, depth=4, budget=12)
    host, queued, stats = _round_loop_then_queued(PositionOracle, head, target, prompt, opts, hand_back, monkeypatch)
    assert queued.queues_trees == (shape == "tree")
    assert all(f == 4 for f, k in zip(stats.draft_forwards, stats.drafter) if k == "queued")
    assert sum(stats.accepted) > 0 and any(a < 4 for a in stats.accepted)
    assert (queued.leaf_ends > 0) == (shape == "tree")
    by_position = dict(host.raw)  # (a round near the end drafts less in the round loop: its prefix)
    assert len(queued.raw) >= len(host.raw)
    compared = [pos for pos, _ in queued.raw if pos in by_position]
    assert len(compared) >= len(host.raw) - 1, (compared, sorted(by_position))
    for pos, raw in queued.raw:
        if pos in by_position:
            assert raw[: len(by_position[pos])] == by_position[pos], pos


def test_queued_chain_steps_through_the_kernel_route_draft_what_the_round_loop_drafts(tmp_path, monkeypatch,
                                                                                      contract_kernel):
    # attention.STEP_ROWS: below the kernel's width bound a chain step's one query row takes
    # the tree-attention kernel (on CUDA; here the contract's stand-in, whose output is NaN
    # where the step's handed bounds disagree with its mask), every other forward MLX's
    # attention; the queued chains are the round loop's, the tokens plain decoding's
    from mlx_treespec import attention

    monkeypatch.setattr(attention, "MIN_WIDTH", 1 << 30)
    head, target = make_eagle3(tmp_path, "safeailab")[:2]
    prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, 12).tolist()
    host, queued, stats = _round_loop_then_queued(PositionOracle, head, target, prompt, dict(topk=1, depth=4), None,
                                                  monkeypatch)
    assert contract_kernel and set(contract_kernel) == {1}  # the steps' rows only
    assert sum(stats.accepted) > 0
    by_position = dict(host.raw)
    compared = [pos for pos, raw in queued.raw if pos in by_position and raw[: len(by_position[pos])] == by_position[pos]]
    assert len(compared) >= len(host.raw) - 1 and len(compared) == sum(pos in by_position for pos, _ in queued.raw)


@pytest.mark.parametrize("kind, opts, hand_back", [
    ("mtp-qwen3_5_tied", dict(topk=1, depth=4), 3), ("eagle3-safeailab", dict(topk=3, lanes=1, depth=4, budget=12), None),
    ("eagle3-safeailab", dict(topk=3, lanes=3, depth=4, budget=10), 3), ("mtp-qwen3_5_tied", dict(topk=3, lanes=2, depth=4, budget=21), None)])
def test_sampled_queued_head_rounds_draw_what_the_round_loop_draws(tmp_path, monkeypatch, kind, opts, hand_back):
    # at temp > 0 queued rounds run too (the target's draw at a node is keyed by its position,
    # on the device as on the host), and a head picks its tokens by the draw's scores of its
    # logits at the positions the target draws at (sampling.Draw): the queued drafts are the
    # round loop's, text position by text position (chains, one-lane trees, EAGLE-2 lanes,
    # fixed lanes), through a hand-back; tokens are plain sampled decoding's
    family, name = kind.split("-", 1)
    head, target = (make_mtp(tmp_path, name)[:2] if family == "mtp" else make_eagle3(tmp_path, name)[:2])
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()
    sampling = dict(temp=0.6, top_p=0.95, seed=5)
    if opts["topk"] == 1 or opts["lanes"] == 1:
        host, queued, stats = _round_loop_then_queued(PositionOracle, head, target, prompt, opts, hand_back,
                                                      monkeypatch, **sampling)
        by_position = dict(host.raw)
        compared = [(pos, raw) for pos, raw in queued.raw if pos in by_position]
        assert len(compared) >= len(host.raw) - 1 and queued.queued_rounds >= min(hand_back or 4, 4)
        for pos, raw in compared:
            assert raw[: len(by_position[pos])] == by_position[pos], pos
        # a sampler setting's compiled draft serves every generation whatever its seed (a trace
        # per generation cost queued rounds their first rounds)
        drafts = dict(queued._drafts)
        other = dict(sampling, seed=6)
        ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=N, **other)]
        assert [t for t, _, _ in tree_generate_step(prompt, target, queued, max_tokens=N, **other)] == ref
        assert dict(queued._drafts) == drafts
    else:
        host, queued, stats = _round_loop_then_queued(LaneOracle, head, target, prompt, opts, hand_back,
                                                      monkeypatch, **sampling)
        assert_same_root_paths(host, queued, stats, hand_back, depth=4)


@pytest.mark.parametrize("kind", ["mtp-qwen3_5_tied", "eagle3-safeailab"])
def test_queued_chain_after_slots_pile_up_is_the_round_loops(tmp_path, kind):
    # rounds the head did not draft (an adaptive drafter's lookup rounds) pile its pending slots
    # up; queued rounds then start (`requeue`): the slots past a round's worth go in as prefill
    # does, the compiled chain sees a round's slot count only (one trace), and the chain is the
    # one the round loop drafts from the same slots
    family, name = kind.split("-", 1)
    head, _ = (make_mtp(tmp_path, name)[:2] if family == "mtp" else make_eagle3(tmp_path, name)[:2])
    rng = np.random.default_rng(3)
    width = head.fc.weight.shape[1] if family == "eagle3" else head.args.hidden_size  # (EAGLE-3: n target layers)
    rows = lambda n: mx.array(rng.normal(size=(n, width)).astype(np.float32))
    prompt = rng.integers(0, tiny.VOCAB, 12).tolist()
    hidden, piles = rows(len(prompt) - 1), [(rng.integers(0, tiny.VOCAB, 3).tolist(), rows(3)) for _ in range(3)]
    loop, queued = HeadDrafter(head, topk=1, depth=4), HeadDrafter(head, topk=1, depth=4)
    for d in (loop, queued):
        d.prefill(prompt, hidden)
        for emitted, h in piles:
            d.commit(Draft.root_only(emitted[0]), [0], emitted, h)
    assert len(queued.pending) == 10 > queued.depth + 1
    root = loop.pending[-1]
    want = np.array(loop.draft(root, 4).tokens[1:]).tolist()
    slot_counts = []
    ahead_fn = queued._ahead_fn
    queued._ahead_fn = lambda kind: (lambda tokens, *a: slot_counts.append(tokens.shape[0]) or ahead_fn(kind)(tokens, *a))
    got = np.array(queued.chain_ahead(mx.array([root], mx.uint32), None, None)).tolist()
    assert slot_counts == [queued.depth + 1]
    assert got == want


def _root_paths(tokens, parents):
    """A tree's root paths as token tuples (the root's excluded): what it proposes, whatever
    its numbering."""
    out = set()
    for i in range(1, len(parents)):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        out.add(tuple(reversed(path)))
    return frozenset(out)


class LaneOracle(tiny.FollowsText, HeadDrafter):
    """A head drafter of EAGLE-2 trees (lanes) whose trees are the head's own with one root path
    made the target's greedy text at most steps, through the last child at some steps (a path
    off the spine), in the round loop (`draft`) and in rounds queued ahead (`lanes_ahead`).
    Records the head's own tree per text position (`raw`) and how many paths left the spine."""

    hand_back_after = None

    def __init__(self, source, target, **kw):
        super().__init__(source, target, **kw)
        self.raw, self.queued_rounds, self.off_spine = [], 0, 0

    def _oracle(self, draft, queued=False):
        tokens, parents = np.array(draft.tokens).tolist(), draft.layout.host_parents()
        pos = len(self.text)
        self.raw.append((pos, draft.depth, _root_paths(tokens, parents), queued))  # (the depth asked for)
        cache = make_prompt_cache(self.target)
        out = self.target(mx.array(self.text)[None], cache=cache)[0, -1]
        node, step = 0, 0
        while True:
            kids = [i for i in range(len(parents)) if parents[i] == node]
            if not kids or not _truth_kept(pos, step):
                break
            node = kids[-1] if _leaf_truth(pos, step) else kids[0]
            self.off_spine += len(kids) > 1 and node == kids[-1]
            tokens[node] = int(mx.argmax(out))
            out = self.target(mx.array([[tokens[node]]]), cache=cache)[0, -1]
            step += 1
        return Draft(mx.array(tokens, mx.uint32), draft.layout, draft.state, fetch=draft.fetch,
                     budget=draft.budget, depth=draft.depth, forwards=draft.forwards)

    def draft(self, root, max_depth):
        d = super().draft(root, max_depth)
        return d if d.state is None else self._oracle(d)

    def lanes_ahead(self, root, rows, count, path=None):
        if rows is not None:  # the last round's accepted drafts, then its target token (the root)
            self.text += np.array(path[1 : count.item()]).tolist() + [int(root.item())]
        return self._oracle(super().lanes_ahead(root, rows, count, path), queued=True)

    def tree_ahead(self, root, rows, count, path=None):
        if rows is not None:
            self.text += np.array(path[1 : count.item()]).tolist() + [int(root.item())]
        return self._oracle(super().tree_ahead(root, rows, count, path), queued=True)

    def queue_more(self, tokens, ms):
        self.queued_rounds += 1
        return self.hand_back_after is None or self.queued_rounds < self.hand_back_after


def assert_same_root_paths(host, queued, stats, hand_back, depth):
    """The oracle's queued trees propose the round loop's root paths at each text position both
    drafted at full `depth` (queued trees among them, at least `hand_back` or 4), rounds accept
    drafts, and some accepted path left the spine."""
    assert sum(stats.accepted) > 0 and queued.off_spine > 0
    by_position = {pos: paths for pos, d, paths, _ in host.raw if d == depth}
    compared = [(pos, from_queue) for pos, _, _, from_queue in queued.raw if pos in by_position]
    assert len(compared) >= len(by_position) - 1, (compared, sorted(by_position))
    assert sum(from_queue for _, from_queue in compared) >= min(hand_back or 4, 4), compared
    for pos, _, paths, _ in queued.raw:
        if pos in by_position:
            assert paths == by_position[pos], pos


@pytest.mark.parametrize("kind, hand_back, ranked", [("mtp-qwen3_5_tied", None, 1), ("eagle3-safeailab", 3, 1),
                                                     ("eagle3-safeailab", None, 4)])
def test_queued_lane_trees_draft_what_the_round_loop_drafts(tmp_path, monkeypatch, kind, hand_back, ranked):
    # where rounds queue, a head's EAGLE-2 tree (3 lanes) is drafted on the device, a compiled
    # call a step: the slots, then each step's lanes over their parents' output hidden states,
    # ranked at the first lane step (the library's) or at every one (EAGLE-2's own, bench's
    # ARM/ranked), each lane after that by its own argmax, then the re-rank of every candidate.
    # Its trees propose the round loop's root paths, text position by text position (queued
    # trees among them), through accepted paths off the spine and a hand-back to the round loop;
    # tokens are plain decoding's
    family, name = kind.split("-", 1)
    head, target = (make_mtp(tmp_path, name)[:2] if family == "mtp" else make_eagle3(tmp_path, name)[:2])
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()
    opts = dict(topk=3, lanes=3, depth=4, budget=10)
    oracle = type("RankedLaneOracle", (LaneOracle,), dict(ranked_lane_steps=ranked))
    host, queued, stats = _round_loop_then_queued(oracle, head, target, prompt, opts, hand_back, monkeypatch)
    assert host.ahead == host.lanes_ahead
    assert all(n == 11 for n, k in zip(stats.nodes, stats.drafter) if k == "queued")
    assert_same_root_paths(host, queued, stats, hand_back, depth=4)


@pytest.mark.parametrize("kind, hand_back, layout", [("mtp-qwen3_5_tied", 3, "fixed"), ("eagle3-safeailab", None, "fixed"),
                                                     ("mtp-qwen3_5_tied", None, "lanes kept"),
                                                     ("eagle3-safeailab", 3, "lanes kept")])
def test_queued_unranked_lanes_draft_what_the_round_loop_drafts(tmp_path, monkeypatch, kind, hand_back, layout):
    # lane trees of which nothing is ranked after the first lane step. "fixed": a budget that
    # keeps every candidate, the root's best 2 children each going on by its own argmax, every
    # step's runners-up leaves; queued, its lanes are one compiled call (a chain's steps over 2
    # rows). "lanes kept": a budget of the lanes' own nodes (3 + 3 x 3) keeps them and nothing
    # else (`keeps_lanes_only`; every greedy identity test of shape k3s3b9 drafts such trees
    # too). Queued trees propose the round loop's root paths, text position by text position,
    # through accepted paths off the spine and a hand-back; tokens are plain decoding's
    family, name = kind.split("-", 1)
    head, target = (make_mtp(tmp_path, name)[:2] if family == "mtp" else make_eagle3(tmp_path, name)[:2])
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()
    opts, ahead, nodes = ((dict(topk=3, lanes=2, depth=4, budget=21), "tree_ahead", 22) if layout == "fixed"
                          else (dict(topk=3, lanes=3, depth=4, budget=12), "lanes_ahead", 13))
    host, queued, stats = _round_loop_then_queued(LaneOracle, head, target, prompt, opts, hand_back, monkeypatch)
    assert host.ahead == getattr(host, ahead)
    assert all(n == nodes for n, k in zip(stats.nodes, stats.drafter) if k == "queued")
    assert_same_root_paths(host, queued, stats, hand_back, depth=4)
    if layout == "lanes kept":  # its whole draft is one compiled call, as a chain's (not one a step)
        assert type(queued._drafts[queued._ahead_key("lanes")]) is type(mx.compile(abs))


def test_keeps_lanes_only_is_a_budget_of_the_lanes_nodes_with_one_ranked_step():
    assert keeps_lanes_only(3, 3, 4, 12, 1) and keeps_lanes_only(4, 2, 3, 8, 1)
    assert not keeps_lanes_only(3, 3, 4, 11, 1) and not keeps_lanes_only(3, 3, 4, 12, 2)
    assert not keeps_lanes_only(3, 1, 4, 6, 1) and not keeps_lanes_only(3, 3, 2, 6, 1)


@pytest.mark.parametrize("queued", [False, True])
def test_lane_trees_of_any_depth_are_plain_decoding(tmp_path, monkeypatch, queued):
    # a lane tree of 1..5 steps ranked at 1 or 2 of them (none left to go by argmax, one, or
    # several), through the round loop and queued: plain decoding's tokens, and queued rounds
    # where asked
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: queued)
    head, target = make_eagle3(tmp_path, "safeailab")[:2]
    prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, 12).tolist()
    ref = plain(target, prompt)
    for depth in (1, 2, 3, 5):
        for ranked in (1, 2):
            drafter = HeadDrafter(head, topk=3, lanes=2, depth=depth, budget=min(6, 3 + 6 * (depth - 1)))
            drafter.ranked_lane_steps = ranked
            stats = RoundStats()
            out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=N, stats=stats)]
            assert out == ref, (depth, ranked)
            assert (stats.drafter[0] == "queued") == queued, (depth, ranked)


def test_queued_head_trees_after_a_one_token_prompt_over_a_prompt_cache(tmp_path, monkeypatch):
    # a one-token prompt over a prompt cache that holds an earlier turn: rounds queue (the cache
    # holds keys) but the head has no target row to continue from, so its first queued draft is
    # a guess; the guess keeps the real root (a lane tree's once verified token 0 in its place)
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    head, target = make_mtp(tmp_path, "qwen3_5_tied")[:2]
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()
    cache = make_prompt_cache(target)
    plain(target, prompt, n=8, prompt_cache=cache)
    ref = plain(target, [7], n=24, prompt_cache=cache)
    for shape in (dict(topk=1, depth=4), dict(topk=3, lanes=1, depth=4, budget=12),
                  dict(topk=3, lanes=3, depth=4, budget=10), dict(topk=3, lanes=1, depth=4, budget=7)):
        cache, drafter = make_prompt_cache(target), HeadDrafter(head, **shape)
        list(tree_generate_step(prompt, target, drafter, max_tokens=8, prompt_cache=cache))
        stats = RoundStats()
        out = [t for t, _, _ in tree_generate_step([7], target, drafter, max_tokens=24, prompt_cache=cache,
                                                   stats=stats)]
        assert out == ref, shape
        assert stats.drafter[0] == "queued", shape


def test_queued_lane_steps_launch_what_a_chain_step_launches(tmp_path, monkeypatch):
    # a queued round on a GPU is host-bound: each kernel a draft step launches costs host time.
    # After the one ranked lane step each lane goes on by its own argmax: a chain step's work
    # over L rows (masks, positions and bounds made once a round, the candidates scored once
    # after the last step), and no arange or buffer write. Per step: the kernels of a draft of
    # 6 steps less one of 3, over 3 steps (both rank the first lane step only)
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    head, target = make_eagle3(tmp_path, "safeailab")[:2]
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()

    def per_step(**opts):  # (bench/run.py's draft-kernels section counts the same way)
        deep, shallow = (draft_kernels(target, HeadDrafter(head, **dict(opts, depth=d)), prompt) for d in (6, 3))
        return {k: (deep[k] - shallow[k]) / 3 for k in deep | shallow}

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from run import draft_kernels

    chain, lanes = per_step(topk=1), per_step(topk=3, lanes=3, budget=12)
    assert chain["Matmul"] > 0 and abs(lanes["Matmul"] - chain["Matmul"]) < 1  # (keep_best's grow with S)
    for kind in ("Arange", "DynamicSliceUpdate"):
        assert lanes.get(kind, 0) == chain.get(kind, 0), (kind, lanes, chain)
    assert lanes.get("Concatenate", 0) - chain.get("Concatenate", 0) < 1, (lanes, chain)
    # (a ranked step launched 20 more: top-k, scores, the next lanes' argsort and gathers)
    assert sum(lanes.values()) - sum(chain.values()) <= 6, (lanes, chain)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_few_rows_run_as_products_and_lane_trees_stay_exact(tmp_path, monkeypatch, kind):
    # on CUDA a float linear layer of 1..FEW_ROWS rows runs one matrix-vector product a row
    # (join.few_rows: one gather_mm, not a matmul's launch); forced here on CPU (float32,
    # gather_mm's one type there): every linear layer and the lm_head of a chain's steps (1 row),
    # a lane tree's (3 rows) and their slots runs as products, the attention keeps its matmuls,
    # and the tokens are plain decoding's
    import mlx_treespec.join as joining
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    head, target = (make_eagle3(tmp_path, "safeailab") if kind == "eagle3" else make_mtp(tmp_path, "qwen3_5_tied"))[:2]
    prompt = np.random.default_rng(2).integers(0, tiny.VOCAB, 12).tolist()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from run import draft_kernels

    shapes = dict(chain=dict(topk=1, depth=4), lanes=dict(topk=3, lanes=3, depth=4, budget=12))
    counts = {}
    for on in (False, True):
        monkeypatch.setattr(joining, "_products_here", (lambda x, w: x.dtype == w.dtype == mx.float32) if on
                            else (lambda x, w: False))
        head.__dict__.pop("_treespec_drafts", None)  # (drafts traced with the rule as it was)
        for name, opts in shapes.items():
            counts[name, on] = draft_kernels(target, HeadDrafter(head, **opts), prompt)
    for name in shapes:  # (CPU's attention: two matmuls a forward, the slots' and 3 steps')
        off, on = counts[name, False], counts[name, True]
        assert off.get("GatherMM", 0) == 0 and on["Matmul"] == 2 * 4, (name, off, on)
        assert on["GatherMM"] == off["Matmul"] - on["Matmul"] >= 4 * 5, (name, off, on)
    ref = plain(target, prompt)
    for name, opts in shapes.items():
        stats = RoundStats()
        out = [t for t, _, _ in tree_generate_step(prompt, target, HeadDrafter(head, **opts), max_tokens=N, stats=stats)]
        assert out == ref, name
        assert stats.drafter[0] == "queued", name
    head.__dict__.pop("_treespec_drafts", None)  # (traced with the rule on)


def test_few_rows_are_each_rows_product_and_only_where_asked():
    import mlx_treespec.join as joining

    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((24, 32)).astype(np.float32))
    here = lambda x, w: x.dtype == mx.float32  # noqa: E731
    for rows in (2, 5, joining.FEW_ROWS):
        x = mx.array(rng.standard_normal((1, rows, 32)).astype(np.float32))
        assert joining._products_here(x, w) is False  # (CPU: MLX's matmul stays)
        assert joining.few_rows(x, w) is None
        joining._products_here, kept = here, joining._products_here
        try:
            y = joining.few_rows(x, w)
            one = joining.few_rows(x[0, :1], w)  # (a chain step's one row too)
            assert joining.few_rows(x[:, :1], w).shape == (1, 1, 24)
        finally:
            joining._products_here = kept
        assert y.shape == (1, rows, 24) and one.shape == (1, 24)
        np.testing.assert_allclose(np.array(one), np.array(x[0, :1] @ w.T), rtol=1e-5, atol=1e-5)
        for i in range(rows):  # each row's product is the one-row matmul's
            np.testing.assert_allclose(np.array(y[0, i]), np.array(x[0, i : i + 1] @ w.T)[0], rtol=1e-5, atol=1e-5)
    x = mx.array(rng.standard_normal((1, joining.FEW_ROWS + 1, 32)).astype(np.float32))
    joining._products_here, kept = here, joining._products_here
    try:
        assert joining.few_rows(x, w) is None
        big = mx.zeros((joining.FEW_ROWS_BYTES // 4 // 32 + 1, 32))  # (a weight read once a row from memory)
        assert joining.few_rows(x[:, :4], big) is None and joining.few_rows(x[:, :4], big[:-1]) is not None
    finally:
        joining._products_here = kept


# ------------------------------------------------------------------ draft vocabularies (--draft-vocab)

def _full_vocab_eagle3(tmp_path, target, own_lm_head=False):
    """An EAGLE-3 head over the whole target vocab, drafting through the target's lm_head, or
    through an lm_head of its own over the whole vocab."""
    from test_heads import H, eagle3_tensors, safeailab_config, save_folder
    from mlx_treespec.drafters.eagle3 import load_eagle3

    rng = np.random.default_rng(3)
    tensors = {k: v for k, v in eagle3_tensors(rng)[0].items() if k != "lm_head.weight"}
    tensors.update(d2t=mx.zeros((tiny.VOCAB,), mx.int64), t2d=mx.ones((tiny.VOCAB,), mx.bool_))
    if own_lm_head:
        tensors["lm_head.weight"] = mx.array(rng.standard_normal((tiny.VOCAB, H)).astype(np.float32) * 0.2)
    head = load_eagle3(str(save_folder(tmp_path / "whole", safeailab_config(draft_vocab_size=tiny.VOCAB), tensors)),
                       target)
    assert ("lm_head" in head) == own_lm_head and head._gather is None
    return head


def test_a_projection_narrowed_to_some_rows_computes_those_outputs():
    import mlx.nn as nn
    from mlx_treespec.drafters import vocab_rows

    rng = np.random.default_rng(4)
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    lin, emb = nn.Linear(64, 96, bias=True), nn.Embedding(96, 64)
    ids = np.sort(rng.choice(96, 40, replace=False))
    for full in (lin, nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4), emb.as_linear,
                 nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=4).as_linear):
        whole = np.array(full(x))
        np.testing.assert_allclose(np.array(vocab_rows(full, 40)(x)), whole[:, :40], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.array(vocab_rows(full, ids)(x)), whole[:, ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="drop --draft-vocab"):
        vocab_rows(lambda v: v, 40)


@pytest.mark.parametrize("kind", ["mtp-qwen3_5_tied", "mtp-qwen3_next_moe", "eagle3-whole", "eagle3-own-lm-head"])
def test_narrowed_heads_draft_only_their_ids_and_stay_exact(tmp_path, kind):
    from test_heads import EAGLE_TARGET

    if kind.startswith("mtp"):
        head, target = make_mtp(tmp_path, kind.split("-", 1)[1])[:2]
    else:
        target = tiny.build(EAGLE_TARGET)
        head = _full_vocab_eagle3(tmp_path, target, own_lm_head=kind == "eagle3-own-lm-head")
    ranked = np.random.default_rng(5).permutation(tiny.VOCAB).astype(np.int32)
    prompt = np.random.default_rng(6).integers(0, tiny.VOCAB, 12).tolist()
    ref = plain(target, prompt)
    for ranks, shape in ((None, SHAPES["chain4"]), (ranked, SHAPES["k3l1s4"]), (ranked, SHAPES["k3l2s4b21"])):
        head.token_ranks = ranks
        drafter = HeadDrafter(head, vocab=40, **shape)
        allowed = set(range(40) if ranks is None else ranks[:40].tolist())
        drafted = []
        original = drafter.draft

        def draft(*a, **k):
            d = original(*a, **k)
            drafted.extend(np.array(d.tokens)[1:].tolist())  # (the root is the target's token)
            return d
        drafter.draft = draft
        stats = RoundStats()
        out = [t for t, _, _ in tree_generate_step(prompt, target, drafter, max_tokens=N, stats=stats)]
        assert out == ref
        assert drafted and set(drafted) <= allowed
        assert drafter.model is not head and getattr(head, "_vocab", None) is None  # the folder's head is unchanged
    head.token_ranks = None
    with pytest.raises(ValueError, match=r"--draft-vocab \(token ids a head drafts\) must be in 16..95"):
        HeadDrafter(head, vocab=tiny.VOCAB)


def test_narrowed_logits_are_the_heads_on_its_ids_and_minus_inf_elsewhere(tmp_path):
    head, target = make_mtp(tmp_path, "qwen3_5_tied")[:2]
    rng = np.random.default_rng(7)
    tokens = mx.array(rng.integers(0, tiny.VOCAB, (1, 5)).astype(np.uint32))
    hidden = mx.array(rng.standard_normal((1, 5, head.args.hidden_size)).astype(np.float32))
    whole = np.array(head(tokens, cache=head.make_cache(), hidden=hidden))
    head.token_ranks = rng.permutation(tiny.VOCAB).astype(np.int32)
    for view, ids in ((head.narrowed(30), head.token_ranks[:30]), (None, np.arange(30))):
        if view is None:
            head.token_ranks = None
            view = head.narrowed(30)
        out = np.array(view(tokens, cache=view.make_cache(), hidden=hidden))
        inside = np.zeros(tiny.VOCAB, bool)
        inside[ids] = True
        np.testing.assert_allclose(out[..., inside], whole[..., inside], rtol=1e-5, atol=1e-5)
        assert np.all(np.isneginf(out[..., ~inside]))


def test_draft_vocab_errors_name_the_fix(tmp_path):
    from mlx_treespec.spec import DraftSpec

    head, target = make_eagle3(tmp_path, "safeailab")[:2]  # its own 40-token vocabulary (d2t)
    with pytest.raises(ValueError, match="its own 40-token vocabulary .* drop --draft-vocab"):
        head.narrowed(32)
    with pytest.raises(ValueError, match="not a head: drop --draft-vocab"):
        make_drafter(None, drafter="lookup", draft_vocab=64)
    with pytest.raises(ValueError, match="must be >= 16"):
        DraftSpec.from_options("mtp", draft_vocab=8)
    for arm in ("mtp-chain:10+vocab512", "eagle3-tree:3:8:24:1+vocab64", "auto:mtp+vocab300", "mtp-chain:4+lookup3+vocab256"):
        spec = DraftSpec.parse(arm)
        assert spec.arm == arm and DraftSpec.parse(spec.arm) == spec and spec.vocab
    with pytest.raises(ValueError, match=r"\+vocabN goes after a head's arm"):
        DraftSpec.parse("dflash:4+vocab64")


def test_a_counted_ranking_is_written_read_and_checked(tmp_path, capsys):
    from mlx_treespec.vocab import RANKS_FILE, count_ranks, main, read_ranks

    assert count_ranks([3, 3, 1, 3, 1, 0], 5).tolist() == [3, 1, 0, 2, 4]  # by count, then by id
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.py").write_text("def parse(value):\n    return value\n" * 20)
    out = tmp_path / "ranks"
    out.mkdir()
    assert main(["--model", "demo-hybrid", "--text", str(text), "--out", str(out / RANKS_FILE)]) == 0
    ranks = read_ranks(out, 4096)
    assert sorted(ranks.tolist()) == list(range(4096)) and ranks[0] != 0
    assert read_ranks(tmp_path, 4096) is None  # no file: the id order
    assert main(["--model", "demo-eagle3", "--text", str(text), "--out", str(out / "x.json")]) == 2
    assert "has no tokenizer: pass the target's folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not rank each of the target's 96 token ids once"):
        read_ranks(out, 96)
    # a config with text_config but the vocabulary size at the top (some multimodal configs)
    import json
    import shutil

    from mlx_treespec.demo import demo_path

    folder = tmp_path / "multimodal"
    shutil.copytree(demo_path("target"), folder, symlinks=False)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, text_config={"hidden_size": cfg["hidden_size"]})))
    assert main(["--model", str(folder), "--text", str(text), "--out", str(out / "y.json")]) == 0
    del cfg["vocab_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main(["--model", str(folder), "--text", str(text), "--out", str(out / "z.json")]) == 2
    assert "names no vocab_size" in capsys.readouterr().err  # (a KeyError traceback before)


@pytest.mark.parametrize("queued_rounds", [False, True])
def test_a_head_drafter_and_its_head_are_freed_when_the_generation_ends(tmp_path, monkeypatch, queued_rounds):
    # a library call makes a drafter per generation: no reference cycle holds it or a head
    # loaded for it (their K/V buffers and weights go when the last reference does, not when
    # the garbage collector next runs), greedy and sampled, for the default, a one-lane tree
    # and EAGLE-2 lanes; a head read from a folder per call is kept on the target and goes
    # with it; drafters over one head share its compiled queued drafts (a trace per
    # generation cost every call its first rounds)
    import gc
    import weakref

    import mlx_treespec.verify as verify
    from mlx_treespec.drafters.eagle3 import load_eagle3

    if queued_rounds:
        monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    head, target = make_eagle3(tmp_path, "safeailab")[:2]
    folder = str(tmp_path / "safeailab")
    prompt = np.random.default_rng(0).integers(0, tiny.VOCAB, 12).tolist()
    shapes = (dict(), dict(tree_topk=3, tree_depth=4, tree_lanes=1), dict(tree_topk=3, tree_depth=4, tree_lanes=2,
                                                                         tree_budget=8))
    gc.collect()
    gc.disable()
    try:
        for opts in shapes:
            for temp in (0.0, 0.7):
                drafter = make_drafter(load_eagle3(folder, target), drafter="eagle3", target=target, **opts)
                list(tree_generate_step(prompt, target, drafter, max_tokens=12, temp=temp, seed=1))
                held = getattr(drafter, "primary", drafter)
                # (the head's layers too: join.py's groups of q/k/v and gate/up hold theirs weakly)
                refs = [weakref.ref(drafter), weakref.ref(held)] + [weakref.ref(m) for _, m in held.model.named_modules()]
                assert any("Joined" in type(r()).__name__ for r in refs)
                del drafter, held
                assert [type(r()).__name__ for r in refs if r() is not None] == [], (opts, temp)
        drafts = []
        for _ in range(2):
            drafter = HeadDrafter(head, topk=3, lanes=1, depth=4)
            list(tree_generate_step(prompt, target, drafter, max_tokens=12, temp=0.7, seed=1))
            drafts.append(dict(drafter._drafts))
        assert drafts[0] == drafts[1] and bool(drafts[0]) == queued_rounds
        # a draft vocabulary's copy of the head is the head's (the compiled drafts see it
        # weakly): a later drafter's longer text, a new buffer width, traces them again with it
        mtp, hybrid = make_mtp(tmp_path, "qwen3_5_tied")[:2]
        long = np.random.default_rng(1).integers(0, tiny.VOCAB, 300).tolist()
        for text in (prompt, long):
            drafter = HeadDrafter(mtp, topk=3, lanes=1, depth=4, vocab=40)
            assert list(tree_generate_step(text, hybrid, drafter, max_tokens=12)) and drafter.model is mtp.narrowed(40)
            del drafter
        # (one vocabulary's copy and rows are kept: a sweep over sizes would keep an n x H copy each)
        assert mtp.narrowed(50) is not mtp.narrowed(40) and len(mtp.__dict__["_narrowed_views"]) == 1
        # a head read from a folder is kept on the target: the two go together, with the
        # last reference to the target (its compiled verify, kept on it, holds it weakly)
        drafter = make_drafter(folder, drafter="eagle3", target=target)
        list(tree_generate_step(prompt, target, drafter, max_tokens=12, temp=0.7, seed=1))
        refs = [weakref.ref(m) for _, m in drafter.primary.model.named_modules()] + [weakref.ref(target)]
        assert bool(target.__dict__.get("_treespec_compiled_verify", {}).get("fns")) == queued_rounds
        del drafter, drafts, head, target
        assert [type(r()).__name__ for r in refs if r() is not None] == []
    finally:
        gc.enable()


def test_a_head_folder_given_per_call_is_read_once_a_target(tmp_path):
    # a library call makes a drafter per generation; given a head's folder, the folder is read
    # once per target (kept on it): the head, its compiled drafts and the adaptive drafter's
    # record (its memory key names the head) carry over to the next call. A folder whose files
    # changed is read again; another target reads its own
    from test_heads import EAGLE_TARGET

    head, target = make_eagle3(tmp_path, "safeailab")[:2]
    folder = str(tmp_path / "safeailab")
    first, again = (make_drafter(folder, drafter="eagle3", target=target) for _ in range(2))
    assert again.primary.model is first.primary.model and again.learned is first.learned
    assert make_drafter(folder, drafter="eagle3", target=target, tree_topk=3, tree_depth=4).model is first.primary.model
    weights = os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".safetensors")))
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    reread = make_drafter(folder, drafter="eagle3", target=target)
    assert reread.primary.model is not first.primary.model and reread.learned is not first.learned
    assert make_drafter(folder, drafter="eagle3", target=tiny.build(EAGLE_TARGET)).primary.model is not reread.primary.model
    tied = tiny.build(dict(EAGLE_TARGET, tie_word_embeddings=True))  # (its lm_head: the embedding's, a new method each call)
    assert make_drafter(folder, drafter="eagle3", target=tied).primary.model is \
        make_drafter(folder, drafter="eagle3", target=tied).primary.model
    # a target whose embedding changed (quantized, adapted) binds the head again
    target.model.embed_tokens = type(target.model.embed_tokens)(*target.model.embed_tokens.weight.shape)
    rebound = make_drafter(folder, drafter="eagle3", target=target).primary.model
    assert rebound is not reread.primary.model and rebound._embed is target.model.embed_tokens
    # binding again drops what was made over the last binding, a benchmark arm's own traces too
    # (bench/run.py's Separate keeps them under (mode, "_treespec", "_treespec_drafts"))
    made = ["_treespec_drafts", ("matmul", "_treespec", "_treespec_drafts"), ("kernel", "_treespec", "_treespec_drafts")]
    for k in made:
        rebound.__dict__[k] = {}
    rebound.rebound()
    assert not any(k in rebound.__dict__ for k in made)

