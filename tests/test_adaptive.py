"""Adaptive drafting: exact whatever it picks (rounds that switch drafter, rounds with no draft),
and its choices are what the arithmetic says for a mocked cost curve (CPU, tiny models)."""
import contextlib
import json

import types

import numpy as np
import pytest

import tiny
from test_dflash import OracleDFlash, dflash_config, plain, save_random
from test_dflash import speculative as run
from mlx_treespec import make_drafter, tree_generate_step
from mlx_treespec import adaptive
from mlx_treespec.adaptive import AdaptiveDrafter, Calibration, PlainStretch
from mlx_treespec.draft import Draft
from mlx_treespec.costmodel import CostFit, cost_cache_dir, startup_costs
from mlx_treespec.drafters.dflash import bind_dflash
from mlx_treespec.drafters.lookup import LookupDrafter
from mlx_treespec.drafters.model import ModelDrafter
from mlx_treespec.spec import DraftSpec

N = 64


def flat(ms):
    return CostFit(points={1: ms, 64: ms}, t1=ms, a=ms, b=0.0, kind="linear", linear_max_rel_err=0.0,
                   max_rel_err=0.0)


def linear(a, b):
    return CostFit(points={1: a + b, 64: a + 64 * b}, t1=a + b, a=a, b=b, kind="linear",
                   linear_max_rel_err=0.0, max_rel_err=0.0)


class Scripted(AdaptiveDrafter):
    """Arms taken from a script (cycled), where available: every kind of switch, deterministic."""

    def __init__(self, script, **kw):
        self.script = list(script)
        super().__init__(**kw)
        self.turn = 0

    def _choose(self, available):
        for _ in range(len(self.script)):
            arm = self.script[self.turn % len(self.script)]
            self.turn += 1
            if arm == "plain" or arm in available:
                return arm
        return "plain"


def book(d, arm, emitted, ms):
    """A use of `arm` that emitted `emitted` tokens in `ms` ms, booked as the loop books it."""
    d.warm.add(arm)
    d.last, d.emitted = (arm, 0.0, 2), emitted
    d._close(ms / 1e3)


def repetitive(n=12, seed=0):
    """A prompt that repeats itself, over every token id, so prompt lookup matches."""
    base = np.random.default_rng(seed).integers(0, tiny.VOCAB, n).tolist()
    return list(range(tiny.VOCAB)) + base + base + base[:4]


@pytest.fixture(scope="module")
def dflash_folder(tmp_path_factory):
    def get(family):
        return save_random(tmp_path_factory.mktemp(f"adaptive_{family}"), dflash_config(tiny.CONFIGS[family]))

    return get


SCRIPT = ["primary", "plain", "host", "primary", "primary", "plain", "plain", "host"]


@pytest.mark.parametrize("family,opts", [("qwen3", {}), ("qwen3_5", {}), ("qwen3", dict(max_kv_size=20)),
                                         ("qwen3_5", dict(max_kv_size=20)),
                                         ("qwen3-kv32", dict(kv_bits=8, kv_group_size=32, quantized_kv_start=24))])
def test_switching_dflash_lookup_and_plain_is_exact(tmp_path, monkeypatch, family, opts):
    monkeypatch.setattr(adaptive, "STRETCH", 5)
    cfg = dict(tiny.CONFIGS["qwen3"], head_dim=32) if family == "qwen3-kv32" else tiny.CONFIGS[family]
    target = tiny.build(cfg)
    bound = bind_dflash(save_random(tmp_path / "dflash", dflash_config(cfg)), target)
    prompt = repetitive()
    ref = plain(target, prompt, **opts)
    drafter = Scripted(SCRIPT, primary=OracleDFlash(bound, target, budget=12), host=LookupDrafter(8, 6),
                       costs=(1.0, flat(1.0)))
    out, stats = run(target, drafter, prompt, **opts)
    assert out == ref
    used = stats.rounds_by_drafter()
    assert used.get("oracledflash", 0) > 0 and used.get("lookup", 0) > 0 and used.get("plain", 0) > 0
    if family == "qwen3":  # (the hybrid's caches do not rotate)
        assert drafter.window == opts.get("max_kv_size")  # the loop tells it a rotating cache's rows
    earned = stats.emitted_ms_by_drafter()  # what each arm emitted, and its wall ms
    assert earned.keys() == used.keys()
    assert sum(t for t, _ in earned.values()) == sum(e for e, d in zip(stats.emitted, stats.drafter) if d)
    assert earned["plain"][0] == used["plain"] and all(ms > 0 for _, ms in earned.values())
    assert sum(stats.accepted) > 0


def test_a_stretch_settles_the_dflash_context_it_added(tmp_path, monkeypatch):
    # after a plain stretch longer than a block, the DFlash context is written at the stretch's
    # end (at most a block's worth left pending for the next forward), and every chain drafted
    # afterwards is the one the unsettled path drafts: the same writes, made earlier
    monkeypatch.setattr(adaptive, "STRETCH", 40)
    target = tiny.build(tiny.CONFIGS["qwen3"])
    bound = bind_dflash(save_random(tmp_path / "dflash", dflash_config(tiny.CONFIGS["qwen3"])), target)
    prompt = np.random.default_rng(5).integers(0, tiny.VOCAB, 12).tolist()
    drafts, pending = {}, []

    class Spy(OracleDFlash):
        def as_draft(self, *args):
            d = super().as_draft(*args)
            drafts[self.settles].append(np.array(d.tokens).tolist())
            return d

        def settle(self, sync=True):
            if not sync:  # the block forward's own write
                return super().settle(sync=False)
            wrote = super().settle() if self.settles else False  # a stretch's catch-up
            pending.append(0 if self.pending is None else self.pending.shape[0])
            return wrote

    for settles in (True, False):
        drafts[settles] = []
        primary = Spy(bound, target, budget=12)
        primary.settles = settles
        d = Scripted(["primary", "plain", "primary", "plain", "primary"], primary=primary, costs=(1.0, flat(1.0)))
        out, _ = run(target, d, prompt, n=100)
        assert out == plain(target, prompt, n=100)
    assert drafts[True] == drafts[False] and len(drafts[True]) >= 2
    settled, unsettled = pending[: len(pending) // 2], pending[len(pending) // 2:]
    assert max(settled) <= primary.block < max(unsettled), pending


def test_switching_model_drafter_and_sampling_is_exact(monkeypatch):
    """A draft model (it forwards what it missed), and sampled decoding (a stretch draws with
    the position's noise, as the verify does)."""
    monkeypatch.setattr(adaptive, "STRETCH", 3)
    target = tiny.build(tiny.CONFIGS["llama"])
    draft = tiny.perturbed(target)
    prompt = repetitive(seed=2)
    for opts in ({}, dict(temp=0.8, seed=5)):
        drafter = Scripted(SCRIPT, primary=ModelDrafter(draft, topk=2, depth=3, budget=6),
                           host=LookupDrafter(8, 6), costs=(1.0, flat(1.0)))
        out, stats = run(target, drafter, prompt, **opts)
        ref, _ = run(target, None, prompt, **opts)
        assert out == ref
        assert {"model", "lookup", "plain"} <= set(stats.rounds_by_drafter())
    assert out != plain(target, prompt)  # sampled: not the greedy text


def test_a_stream_abandoned_inside_a_stretch_leaves_the_prompt_cache_whole(monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setattr(adaptive, "STRETCH", 8)
    target = tiny.build(tiny.CONFIGS["qwen3"])
    prompt = repetitive(seed=3)
    drafter = Scripted(["plain"], host=LookupDrafter(8, 6), costs=(1.0, flat(1.0)))
    cache = make_prompt_cache(target)
    steps = tree_generate_step(prompt, target, drafter, max_tokens=N, prompt_cache=cache)
    got = [next(steps)[0] for _ in range(5)]  # inside the first stretch
    steps.close()
    assert got == plain(target, prompt, n=5)
    assert cache[0].offset == len(prompt) + 5  # the prompt and every delivered token


def test_budget_is_what_the_arithmetic_says():
    probs = np.array([0.9, 0.8, 0.6, 0.3, 0.2, 0.1, 0.05, 0.01])
    d = AdaptiveDrafter(host=LookupDrafter(), costs=(1.0, flat(2.0)), verify_rows=lambda n: n)
    d.overhead = 1.0
    # flat verify: every node adds expected tokens at no cost -> the whole tree
    assert d.choose_budget(probs) == len(probs)
    # verify 0.5 + 0.5 ms per row: (1 + sum of the first B) / (1 + 0.5 + 0.5 (B + 1)), by hand
    d.costs = (1.0, linear(0.5, 0.5))
    gains = 1 + np.cumsum(probs)
    ratios = gains / (1.0 + 0.5 + 0.5 * (np.arange(len(probs)) + 2))
    assert d.choose_budget(probs) == int(np.argmax(ratios)) + 1 == 3
    # rows as a GPU runs them (powers of two): 7 nodes cost what 8 rows cost, so B = 7
    d.verify_rows = lambda n: 1 << max(n - 1, 0).bit_length()
    d.costs = (1.0, CostFit(points={1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 9.0}, t1=1.0, a=0.0, b=0.0,
                            kind="interp", linear_max_rel_err=1.0, max_rel_err=0.0))
    assert d.choose_budget(probs) == 7


def test_budget_follows_the_context():
    """Costs are asked at the generation's context (every REPRICE rows): against a long context
    a verify of many rows costs more, and the budget is the arithmetic's at that context."""
    probs = np.array([0.9, 0.8, 0.6, 0.3, 0.2, 0.1, 0.05, 0.01])
    asked = []

    def at(rows):
        asked.append(rows)
        return (1.0, flat(2.0)) if rows < 2048 else (1.5, linear(0.5, 0.5))

    d = AdaptiveDrafter(host=LookupDrafter(), costs=(1.0, flat(2.0)), verify_rows=lambda n: n, context_costs=at)
    d.overhead = 1.0
    d.prefill(list(range(100)))
    assert asked == [100] and d.choose_budget(probs) == len(probs)
    for _ in range(3):
        d.commit(Draft.root_only(0), np.zeros(1, np.int64), [1] * 400)  # 500, 900, 1300 rows
        d._reprice()  # (what the next round's draft does first, after booking this one)
    assert asked == [100, 1300]  # asked once per REPRICE rows
    d.catch_up(1, [2] * 2000)  # 3300 rows: a long context
    d._reprice()
    assert d.costs[0] == 1.5 and asked[-1] == 3300
    assert d.rates["plain"].value == pytest.approx(1 / 1.5)  # plain's rate follows its cost
    ratios = (1 + np.cumsum(probs)) / (1.0 + 0.5 + 0.5 * (np.arange(len(probs)) + 2))
    assert d.choose_budget(probs) == int(np.argmax(ratios)) + 1 == 3
    d.window = 1500  # a rotating cache: a verify attends to its window only
    d.prefill(list(range(3000)))
    assert asked[-1] == 1500 and d.choose_budget(probs) == len(probs)


def test_costs_at_a_long_context_are_measured_once_and_kept(monkeypatch):
    from mlx_treespec import costmodel

    monkeypatch.setattr(costmodel, "LONG_HISTORY", 640)
    monkeypatch.setattr(costmodel, "LONG_FROM", 400)
    target = tiny.build(dict(tiny.CONFIGS["qwen3"], rope_theta=23456.0))  # a shape measured nowhere else
    plain0, fit0 = startup_costs(target)
    assert costmodel.costs_at(target, 399) == (plain0, fit0)
    plain1, fit1 = costmodel.costs_at(target, 640)  # measured now, kept
    kept = json.loads((cost_cache_dir() / f"{costmodel._cost_key(target)}.json").read_text())
    # (timings: the long fit may time below the short one; the interpolation never goes below it)
    assert kept["long"]["history"] == 640 and max(kept["long"]["plain_ms"], plain0) == pytest.approx(plain1)
    assert all(fit1.points[T] >= fit0(T) for T in costmodel.VERIFY_TS)
    monkeypatch.setattr(costmodel, "time_verify", lambda *a, **k: pytest.fail("measured twice"))
    monkeypatch.setattr(costmodel, "_AT", {})
    monkeypatch.setattr(costmodel, "_FITS", {})  # read back from the kept file
    half, _ = costmodel.costs_at(target, (256 + 640) // 2)  # halfway in context: halfway in cost
    assert half == pytest.approx((plain0 + plain1) / 2)


def test_calibration_learns_the_acceptance_of_a_probability_bin():
    c = Calibration()
    assert np.allclose(c([0.5, 0.05]), [0.5, 0.05])  # the prior: the drafter's own probability
    c.update(np.full(100, 0.55), np.zeros(100))  # nodes of p 0.55 are never accepted
    assert c([0.55])[0] < 0.03 and np.isclose(c([0.05])[0], 0.05)


def test_controller_turns_off_when_plain_is_faster_and_probes_with_backoff(monkeypatch):
    d = AdaptiveDrafter(host=LookupDrafter(), primary=LookupDrafter(), costs=(1.0, flat(1.0)))
    assert d.choose(["primary"]) == "primary"  # never used: tried first
    book(d, "primary", 2, 4.0)  # 0.5 tokens/ms against plain's 1.0
    assert d.choose(["primary"]) == "plain" and d.stretch == adaptive.STRETCH
    assert d.choose(["primary"]) == "primary"  # the probe after the stretch
    assert d.choose(["primary"]) == "plain" and d.stretch == 2 * adaptive.STRETCH  # it lost: longer
    d.choose(["primary"])
    for _ in range(10):
        d.choose(["primary"])
    assert d.stretch == adaptive.MAX_STRETCH
    book(d, "primary", 40, 4.0)  # text got easy
    d.after_stretch = False
    assert d.choose(["primary"]) == "primary" and d.stretch == adaptive.STRETCH


def test_controller_prefers_the_faster_arm_and_reprobes_the_other():
    d = AdaptiveDrafter(primary=LookupDrafter(), host=LookupDrafter(), costs=(10.0, flat(1.0)))
    book(d, "primary", 3, 3.0)
    d.match = 3
    book(d, "host", 6, 2.0)
    picks = [d.choose(["primary", "host"]) for _ in range(adaptive.REPROBE + 1)]
    assert picks[:-1] == ["host"] * adaptive.REPROBE and picks[-1] == "primary"
    assert d.choose(["primary"]) == "primary"  # the host did not match: the model drafts
    # the host's rate is kept per match length: a 1-token match that drafts little loses
    d.match = 1
    book(d, "host", 1, 2.0)
    assert d.choose(["primary", "host"]) == "primary"
    d.match = 3
    assert d.choose(["primary", "host"]) == "host"


def test_a_sampled_shapes_rounds_are_tried_once_per_text_under_its_own_rate():
    # the primary in a sampled shape (AdaptiveDrafter.shapes, tier i) books to ("sampled", i),
    # made at its first use (any number of tiers): a new text tries it once, and then its rate
    # decides (not an endless first try)
    d = AdaptiveDrafter(primary=LookupDrafter(), costs=(1.0, flat(1.0)))
    d.tier = 3
    d.prefill([1, 2, 3])
    for _ in range(3):
        book(d, "primary", 2, 4.0)  # 0.5 tokens/ms against plain's 1.0
    assert d.rates["primary"].value is None and d.rates[("sampled", 3)].value is not None
    assert d.choose(["primary"]) == "plain"
    d.prefill([4, 5, 6])  # the next text
    assert d.choose(["primary"]) == "primary"  # once per text
    book(d, "primary", 1, 4.0)
    assert d.choose(["primary"]) == "plain"


def test_first_use_of_an_arm_in_a_generation_is_not_booked():
    d = AdaptiveDrafter(primary=LookupDrafter(), costs=(1.0, flat(1.0)))
    d.prefill([1, 2, 3])
    d.last, d.emitted = ("primary", 0.0, 2), 1  # a round that took ~forever (a trace)
    d._close(1.0)
    assert d.rates["primary"].value is None  # its ms not booked: tried again
    assert d.seen["primary"] == (1, 1)  # what it emitted is booked (this text's)
    d.last = ("primary", 1.0, 2)
    d._close(1.002)
    assert d.rates["primary"].value == pytest.approx(0.5)


def test_each_generation_relearns_what_an_arm_emits():
    """The tokens an arm emits describe the text: a new generation tries the model arm once and
    weighs what it emitted there against the carried average as one use; the ms carry over."""
    d = AdaptiveDrafter(primary=LookupDrafter(), costs=(1.0, flat(1.0)))
    d.prefill([1, 2, 3])
    for _ in range(3):
        book(d, "primary", 2, 4.0)  # 0.5 tokens/ms against plain's 1.0
    assert d.choose(["primary"]) == "plain"
    d.prefill([4, 5, 6])  # the next text
    assert d.choose(["primary"]) == "primary"  # once per text
    d.last, d.emitted = ("primary", 0.0, 2), 12
    d._close(0.030)  # its first use: 30 ms (a trace) not booked, its 12 tokens are
    assert d.rates["primary"].ms == pytest.approx(4.0)
    assert d.value("primary") == pytest.approx((2 + 12) / 2 / 4.0)
    assert d.choose(["primary"]) == "primary"
    d.prefill([7, 8, 9])
    book(d, "primary", 1, 4.0)  # a hard text
    assert d.choose(["primary"]) == "plain"


def test_costs_are_priced_at_the_rows_a_verify_reads():
    """A rotating window bounds the rows (unless a layer keeps the whole context), and a
    prompt cache's earlier turns count."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

    from mlx_treespec.loop import attended_rows

    assert attended_rows([RotatingKVCache(8), RotatingKVCache(16)]) == 16
    assert attended_rows([ArraysCache(2), RotatingKVCache(8)]) == 8
    assert attended_rows([RotatingKVCache(8), KVCache()]) is None  # a global layer reads it all
    assert attended_rows([ArraysCache(2), KVCache()]) is None
    target = tiny.build(tiny.CONFIGS["qwen3"])
    cache = make_prompt_cache(target)
    target(mx.array([list(range(10))]), cache=cache)  # an earlier turn: 10 rows
    asked = []
    d = AdaptiveDrafter(host=LookupDrafter(), costs=(1.0, flat(1.0)),
                        context_costs=lambda rows: asked.append(rows) or (1.0, flat(1.0)))
    list(zip(tree_generate_step(list(range(20, 26)), target, d, max_tokens=2, prompt_cache=cache), range(2)))
    assert asked[0] == 16 and d.prefix == 10 and d.window is None


def test_the_host_relearns_per_match_length():
    """The host's tokens are this text's per match length: a long match's uses do not lift a
    short one's estimate, and the carried average is what the generation started with."""
    d = AdaptiveDrafter(host=LookupDrafter(), costs=(1.0, flat(1.0)))
    d.prefill([1, 2, 3])
    for m, tokens in ((1, 1), (3, 8), (3, 8)):
        d.match = m
        book(d, "host", tokens, 2.0)
    assert d.seen[("host", 1)] == (1, 1) and d.seen[("host", 3)] == (16, 2)
    assert d.value(("host", 1)) == pytest.approx(0.5) and d.value(("host", 3)) == pytest.approx(4.0)
    d.prefill([4, 5, 6])  # the next text: the carried averages are priors of one use
    prior = d.rates[("host", 3)].tokens
    d.match = 3
    book(d, "host", 2, 2.0)
    book(d, "host", 2, 2.0)
    assert d.value(("host", 3)) == pytest.approx((prior + 4) / 3 / d.rates[("host", 3)].ms)


def test_host_rounds_draft_deeper_where_the_text_repeats():
    """A host round drafts half the host's depth; a round whose whole draft was accepted makes
    the next one twice as deep (up to the host's max_depth), any other sends it back."""
    from mlx_treespec.tree import depths_of, root_path

    def deepest(draft):
        return int(depths_of(draft.layout.host_parents()).max())

    text = list(range(40))
    d = Scripted(["host"], host=LookupDrafter(16, 16), costs=(1.0, flat(1.0)))
    d.prefill(text + text[:3])  # the text repeats: lookup continues it for 37 tokens
    assert d.reach == 8
    root, seen = text[2], []
    for whole in (True, True, True, False, True):
        draft = d.draft(root, 64)
        seen.append(deepest(draft))
        parents = draft.layout.host_parents()
        tip = int(np.argmax(depths_of(parents))) if whole else int(np.flatnonzero(depths_of(parents) == 1)[0])
        path = root_path(parents, tip)
        tokens = np.array(draft.tokens).tolist()
        emitted = [tokens[i] for i in path[1:]] + [text[(text.index(root) + len(path)) % 40]]
        d.commit(draft, path, emitted)
        root = emitted[-1]
    assert seen == [8, 16, 16, 16, 8]  # doubled, capped at max_depth, back after a partial round


def test_emitted_and_ms_by_drafter_add_up():
    from mlx_treespec import RoundStats

    st = RoundStats()
    for emitted, ms, drafter in ((3, 2.0, "dflash"), (1, 0.5, "plain"), (5, 3.0, "dflash"), (2, 1.0, "")):
        st.record(accepted=emitted - 1, emitted=emitted, nodes=4, depth=2, held=0, budget=3, requested_depth=2,
                  draft_ms=0.0, verify_ms=ms, round_ms=ms, sync_ms=0.0, walk_ms=0.0, drafter=drafter)
    assert st.emitted_ms_by_drafter() == {"dflash": [8, 5.0], "plain": [1, 0.5]}  # unnamed rounds: none
    assert st.summary()["emitted_ms_by_drafter"] == st.emitted_ms_by_drafter()


def test_a_spike_is_not_booked_unless_it_repeats():
    # a round over SPIKE x its fitted cost paid for a new shape once (a trace, new kernels)
    d = AdaptiveDrafter(primary=LookupDrafter(), costs=(1.0, flat(1.0)))
    d.prefill([1, 2, 3])
    d.warm.add("primary")

    def use(arm, ms, emitted):
        d.last, d.emitted = (arm, 0.0, 2), emitted
        d._close(ms / 1e3)

    use("primary", 2.0, 4)
    assert d.rates["primary"].value == pytest.approx(2.0)
    use("primary", 50.0, 4)  # 50 ms against a 1 ms verify: not booked
    assert d.rates["primary"].value == pytest.approx(2.0)
    use("primary", 50.0, 4)
    assert d.rates["primary"].value == pytest.approx(2.0)
    use("primary", 50.0, 4)  # SPIKES_IN_A_ROW in a row: that is what the arm costs now
    assert adaptive.SPIKES_IN_A_ROW == 2 and d.rates["primary"].value < 1.0
    plain = d.rates["plain"].value
    use("plain", 100.0, 10)  # a stretch of 10 tokens at 1 ms each took 100 ms: not booked
    assert d.rates["plain"].value == plain
    use("plain", 12.0, 10)
    assert d.rates["plain"].value < plain


def test_end_to_end_budgets_follow_the_cost_curve(dflash_folder):
    """A DFlash drafter under a flat verify curve drafts whole trees; under a steep one, one node."""
    target = tiny.build(tiny.CONFIGS["qwen3"])
    bound = bind_dflash(dflash_folder("qwen3"), target)
    prompt = np.random.default_rng(4).integers(0, tiny.VOCAB, 12).tolist()
    ref = plain(target, prompt, n=32)
    nodes = {}
    for name, fit in (("flat", flat(1.0)), ("steep", linear(0.0, 1e6))):
        d = AdaptiveDrafter(primary=OracleDFlash(bound, target, budget=20), costs=(1e9, fit),
                            verify_rows=lambda n: n)
        out, stats = run(target, d, prompt, n=32)
        assert out == ref
        nodes[name] = [k for k, s in zip(stats.nodes, stats.drafter) if s == "oracledflash"][2:]  # booked rounds
    assert nodes["flat"] and max(nodes["flat"]) == 21 and min(nodes["flat"][:-3]) == 21  # the whole budget
    assert nodes["steep"] and set(nodes["steep"]) == {2}


def test_startup_costs_are_measured_once_and_kept(monkeypatch):
    target = tiny.build(dict(tiny.CONFIGS["qwen3"], rope_theta=12345.0))  # a shape measured nowhere else
    plain_ms, fit = startup_costs(target)
    assert plain_ms > 0 and fit(8) > 0 and sorted(fit.points) == [1, 2, 4, 8, 16, 32, 64]
    files = list(cost_cache_dir().glob("*.json"))
    assert any(json.loads(f.read_text())["plain_ms"] == plain_ms for f in files)
    from mlx_treespec import costmodel

    monkeypatch.setattr(costmodel, "time_verify", lambda *a, **k: pytest.fail("measured twice"))
    assert startup_costs(target)[0] == plain_ms  # this process's
    monkeypatch.setattr(costmodel, "_FITS", {})
    assert startup_costs(target)[0] == plain_ms  # the kept file's


def test_adaptive_is_the_default_without_a_shape_and_a_shape_fixes_it():
    target = tiny.build(tiny.CONFIGS["qwen3"])
    draft = tiny.perturbed(target)
    d = make_drafter(draft, target=target)
    assert isinstance(d, AdaptiveDrafter) and isinstance(d.primary, ModelDrafter) and callable(d.costs)
    assert isinstance(make_drafter(draft, target=target, tree_depth=4), ModelDrafter)
    assert isinstance(make_drafter(drafter="lookup"), AdaptiveDrafter)
    assert DraftSpec.parse("auto:dflash") == DraftSpec.from_options("dflash")
    assert DraftSpec.parse("auto:model").arm == "auto:model"
    with pytest.raises(ValueError, match="auto:KIND"):
        DraftSpec.parse("auto:bogus")
    out, stats = run(target, d, repetitive(seed=6), n=48)
    assert d.costs[0] > 0  # measured at the first prefill
    assert out == plain(target, repetitive(seed=6), n=48)
    assert sum(stats.rounds_by_drafter().values()) == stats.rounds


def test_stretch_is_a_marker_not_a_draft():
    assert PlainStretch(4).tokens == 4
    with pytest.raises(ValueError, match="primary= or host="):
        AdaptiveDrafter()


def test_drafters_for_the_same_pair_start_from_what_the_last_one_learned():
    target = tiny.build(tiny.CONFIGS["qwen3"])
    draft = tiny.perturbed(target)
    a = make_drafter(draft, target=target)
    a.rates["primary"].add(5, 2.0)
    b = make_drafter(draft, target=target)
    assert b.rates["primary"].value == pytest.approx(2.5) and b.learned is a.learned
    other = make_drafter(tiny.perturbed(target, seed=2), target=target)
    assert other.rates["primary"].value is None  # another drafter: its own record
    # an adaptive spec over another shape of the same drafter learns apart (the key is the spec)
    from dataclasses import replace

    from mlx_treespec.spec import DraftSpec

    chain = replace(DraftSpec.parse("chain:12"), adaptive=True).build(draft, target=target)
    assert chain.rates["primary"].value is None and chain.learned is not a.learned
    b.reset()
    assert make_drafter(draft, target=target).rates["primary"].value is None


def test_a_stretch_ends_where_the_host_drafter_matches(monkeypatch):
    """The host drafter watches a stretch's tokens; a match ends it at the next token, and the
    tokens stay the target's own."""
    monkeypatch.setattr(adaptive, "STRETCH", 64)
    target = tiny.build(tiny.CONFIGS["qwen3"])
    prompt = repetitive(seed=7)
    d = AdaptiveDrafter(host=LookupDrafter(8, 6), costs=(1.0, flat(1.0)))
    d.rates[("host", 0)].add(1, 1.0)  # every match length measured, none better than plain
    for m in range(1, adaptive.MATCHES + 1):
        d.rates[("host", m)].add(1, 10.0)
    out, stats = run(target, d, prompt, n=40)
    assert out == plain(target, prompt, n=40)
    assert stats.rounds_by_drafter() == {"plain": 40}  # one stretch: nothing beat plain
    d = AdaptiveDrafter(host=LookupDrafter(8, 6), costs=(1e-3, flat(1.0)))  # plain "fast"
    out, stats = run(target, d, prompt, n=40)
    assert out == plain(target, prompt, n=40)
    assert stats.rounds_by_drafter().get("lookup", 0) > 1  # unmeasured matches end stretches


@pytest.mark.parametrize("plain_ms,hands_back", [(1e-6, True), (1e6, False)])
def test_the_default_queues_dflash_chains_and_hands_back_when_they_lose(tmp_path, monkeypatch, plain_ms,
                                                                         hands_back):
    # on the GPU path an adaptive drafter over DFlash starts with chains queued ahead; once
    # their rate (QUEUED_MIN rounds after QUEUED_WARM) is below plain decoding's (and the host's:
    # its rounds cost what plain does here), the adaptive rounds take the generation over where
    # the last queued round ended: tokens stay plain's
    import mlx_treespec.verify as verify
    from test_dflash import QueuedOracle

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    target = tiny.build(tiny.CONFIGS["qwen3"])
    bound = bind_dflash(save_random(tmp_path / "dflash", dflash_config(tiny.CONFIGS["qwen3"])), target)
    prompt = repetitive()
    drafter = AdaptiveDrafter(primary=QueuedOracle(bound, target, budget=12), host=LookupDrafter(8, 6),
                              costs=(plain_ms, flat(plain_ms)))
    out, stats = run(target, drafter, prompt, n=120)
    assert out == plain(target, prompt, n=120)
    used = stats.rounds_by_drafter()
    if hands_back:
        assert used["queued"] >= adaptive.QUEUED_WARM + adaptive.QUEUED_MIN and len(used) > 1, used
    else:
        assert used == {"queued": stats.rounds}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_queued_rounds_draft_trees_over_attention_and_recurrent_layers(monkeypatch, tmp_path, family):
    # where rounds queue, an adaptive drafter whose primary drafts DDTree trees queues them, over
    # an attention target and a hybrid's recurrent layers alike (a tree round costs about a
    # chain's; the recurrent scan takes the tree's device parents); tokens stay plain's
    import mlx_treespec.verify as verify
    from test_dflash import QueuedTreeOracle

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    target = tiny.build(tiny.CONFIGS[family])
    bound = bind_dflash(save_random(tmp_path / family, dflash_config(tiny.CONFIGS[family])), target)
    primary = QueuedTreeOracle(bound, target, seed=4, budget=12)
    drafter = AdaptiveDrafter(primary=primary, host=LookupDrafter(8, 6), costs=(1.0, flat(1.0)))
    prompt = repetitive()
    out, stats = run(target, drafter, prompt, n=48)
    assert out == plain(target, prompt, n=48)
    queued = {n for n, k in zip(stats.nodes, stats.drafter) if k == "queued"}
    assert queued == {13}, (queued, stats.drafter)


class Requeues(Scripted):
    """Scripted arms; queued rounds hand back after `per_entry` rounds each time they run. Checks
    at every requeue that the DFlash context holds every row of this turn before the root
    (`context - 1`, less a prompt cache's earlier turns) with nothing pending, where its chain
    starts."""

    def __init__(self, script, per_entry, **kw):
        super().__init__(script, **kw)
        self.per_entry, self.left, self.requeues = per_entry, per_entry, []

    def queue_more(self, tokens, ms):
        super().queue_more(tokens, ms)
        self.left -= 1
        return self.left > 0

    def requeue(self, root):
        super().requeue(root)
        self.left = self.per_entry
        p = self.primary
        clean = p.pending is None and p._queued is None
        self.requeues.append((p.length, self.context - 1 - self.prefix, clean))


@pytest.fixture
def requeuing(tmp_path, monkeypatch):
    """The GPU path on CPU (rounds queue), and for a tiny target of a family, a maker of
    scripted drafters whose queued rounds hand back after 3 rounds and are requeued (this
    text's lookup rounds hold tokens before a requeue)."""
    import mlx_treespec.verify as verify
    from test_dflash import QueuedOracle

    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    monkeypatch.setattr(adaptive, "STRETCH", 5)

    def pair(family="qwen3"):
        target = tiny.build(tiny.CONFIGS[family])
        bound = bind_dflash(save_random(tmp_path / family, dflash_config(tiny.CONFIGS[family])), target)

        def make():
            return Requeues(["host", "primary", "plain", "host", "host", "primary"], 3,
                            primary=QueuedOracle(bound, target, budget=12), host=LookupDrafter(8, 6),
                            costs=(1.0, flat(1.0)))

        return target, make

    return pair


@pytest.mark.parametrize("n", [12, 1000, "second turn", "hybrid"])
def test_queued_rounds_come_back_after_the_round_loop(requeuing, n):
    # where rounds queue (the GPU path, here on CPU), a hand-back is not for good: the primary's
    # arm chosen in the round loop queues its chains again from the root (held tokens forwarded
    # first, the DFlash context written to the end); tokens stay plain decoding's through every
    # kind of switch (a 1000-token prompt: buffers grown in between; a second turn over a
    # prompt cache: the DFlash context counts this turn's rows only; a hybrid: the recurrent
    # states handed over both ways)
    target, make = requeuing("qwen3_5" if n == "hybrid" else "qwen3")
    prompt = repetitive()
    if n == 1000:
        prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, n).tolist() + prompt
    d = make()
    if n == "second turn":
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from test_reliability import mlx_cache_after

        earlier = list(range(20))
        first = plain(target, earlier, n=8)
        cache, ref_cache = (mlx_cache_after(target, earlier, first, {}) for _ in range(2))
        out, stats = run(target, d, prompt, n=96, prompt_cache=cache)
        want = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=96, prompt_cache=ref_cache)]
        assert d.prefix > 0 and out == want
        return _requeued(d, stats, check_held=False)
    out, stats = run(target, d, prompt, n=96)
    assert out == plain(target, prompt, n=96)
    _requeued(d, stats, check_held=n == 12)  # (a hybrid's rounds hold no tokens: they commit whole paths)


def _requeued(d, stats, check_held):
    entries = [i for i, k in enumerate(stats.drafter)
               if k == "queued" and (i == 0 or stats.drafter[i - 1] != "queued")]
    assert len(entries) >= 3 and len(d.requeues) == len(entries) - 1, stats.drafter
    assert all(length == rows and clean for length, rows, clean in d.requeues), d.requeues
    if check_held:  # (this text's lookup rounds hold tokens before a requeue)
        assert any(stats.held[i - 1] for i in entries[1:]), "no requeue forwarded held tokens"
    assert {"lookup", "plain"} <= set(stats.drafter)


@pytest.mark.parametrize("end", ["cut", "stop token", "max_tokens", "requeue raises", "hybrid cut"])
def test_a_prompt_cache_holds_every_token_through_a_requeue(requeuing, end):
    # a generation that ends inside queued rounds the round loop handed back to (the consumer
    # stops, a stop token, max_tokens), or at the requeue itself (an error), leaves a prompt
    # cache holding the prompt and every delivered token (mlx-lm's rule), as one that ends
    # anywhere else (a hybrid's recurrent states too)
    from mlx_lm.models.cache import make_prompt_cache
    from test_reliability import check_cache_holds

    target, make = requeuing("qwen3_5" if end.startswith("hybrid") else "qwen3")
    end = end.split()[-1] if end.startswith("hybrid") else end
    prompt = repetitive()

    ref = plain(target, prompt, n=96)
    _, stats = run(target, make(), prompt, n=96)
    # the token positions the second queued period emitted (after a requeue)
    spans, pos, entry = [], 0, 0
    for i, (kind, e) in enumerate(zip(stats.drafter, stats.emitted)):
        entry += kind == "queued" and (i == 0 or stats.drafter[i - 1] != "queued")
        if kind == "queued" and entry == 2:
            spans += range(pos, pos + e)
        pos += e
    firsts = [p for p in spans if ref.index(ref[p]) == p]
    assert firsts, "the requeued rounds emitted no token seen for the first time"
    k = firsts[len(firsts) // 2] + 1  # tokens delivered, the last from the requeued rounds
    kw = dict(max_tokens=k if end == "max_tokens" else 96)
    if end == "stop token":
        kw["stop_tokens"] = [ref[k - 1]]
    cache = make_prompt_cache(target)
    d = make()
    if end == "requeue raises":
        def fails(root):
            raise RuntimeError("requeue")
        d.requeue = fails
    steps = tree_generate_step(prompt, target, d, prompt_cache=cache, **kw)
    got = []
    with pytest.raises(RuntimeError) if end == "requeue raises" else contextlib.nullcontext():
        for t, _, _ in steps:
            got.append(t)
            if end == "cut" and len(got) == k:
                break
    steps.close()
    assert got == ref[: len(got) if end == "requeue raises" else k] and got
    check_cache_holds(target, cache, prompt, got, {})


def test_after_a_hand_back_queued_rounds_sit_out_a_wait_then_are_tried_again():
    # where rounds queue, the primary's arm is queued rounds: after a hand-back it sits out
    # REPROBE rounds (plain here: no host), then the round loop is handed a QueueAhead, and the
    # queued rounds that follow decide after one unbooked and QUEUED_MIN booked rounds. A try
    # that hands back at its first decision doubles the wait (up to MAX_WAIT); one that outlasts
    # it resets the wait and the stretch. Plain stretches never double on the way
    calls = []
    stub = types.SimpleNamespace(handed_back=lambda start, tokens: None, requeue=lambda: calls.append("requeue"),
                                 reset=lambda: None, prefill=lambda prompt: None, chain_ahead=None)
    d = AdaptiveDrafter(primary=stub, costs=(1.0, flat(1.0)))
    d.queueable = True
    d.prefill([7, 8, 9])
    rounds = 0
    while d.queue_more([1], 10.0):
        rounds += 1
    assert rounds == adaptive.QUEUED_WARM + adaptive.QUEUED_MIN - 1
    d.handed_back(100, [1] * (rounds + 1))
    waits = [adaptive.REPROBE * 2 ** k for k in range(4)]
    assert waits[-1] > adaptive.MAX_WAIT
    for wait in waits:
        wait = min(wait, adaptive.MAX_WAIT)
        assert d.wait == wait
        assert [d.choose(["primary"]) for _ in range(wait)] == ["plain"] * wait
        assert isinstance(d.draft(1, 8), adaptive.QueueAhead)
        d.requeue(1)
        assert calls[-1] == "requeue" and d.queued_tokens == [1] and not d.queued
        answers = [d.queue_more([1], 10.0) for _ in range(1 + adaptive.QUEUED_MIN)]
        assert answers == [True] * adaptive.QUEUED_MIN + [False]
        d.handed_back(100, [1] * len(answers))
        assert d.stretch == adaptive.STRETCH and not d.probing
    d.stretch = 4 * adaptive.STRETCH
    d.requeue(1)  # a try that outlasts its first decision: back to REPROBE and STRETCH
    d.queued.extend([(9, 1.0)] * (adaptive.QUEUED_MIN + 1))
    d.handed_back(100, [1])
    assert d.wait == adaptive.REPROBE and d.stretch == adaptive.STRETCH
    d.after_stretch, d.idle["primary"] = True, d.wait  # right after a stretch, the wait over:
    assert d.choose(["primary", "host"]) == "primary"  # tried, and not as the stretch's probe
    assert not d.probing and not d.after_stretch


def test_queued_rounds_hand_back_to_a_host_that_would_draft_faster():
    # while rounds queue, the host drafter follows their text in shadow rounds: each its draft
    # at the adaptive rounds' reach, walked against what the target emitted, priced by the fit.
    # A text that repeats itself: the first shadow round drafts 8 (half the host's depth) and is
    # accepted whole (9 tokens), the next ones 16 (17); a token off the repeat cuts a round there
    # and sends the reach back to 8. Queued rounds that beat plain but fall below QUEUED_LOSS x
    # the host's shadow rate hand back; the host is then handed only the tokens it has not seen
    base = np.random.default_rng(3).permutation(tiny.VOCAB)[:20].tolist()
    text = base * 8
    emitted = text[:40] + [base[5]] + text[41:120]  # off the repeat at 40 (base[0] is due)
    d = AdaptiveDrafter(host=LookupDrafter(16, 16), costs=(1.0, flat(2.0)))
    d.prefill(base + base)
    d.queue_more(emitted[:62], 1.0)  # (a warm-up round: the shadow is not trimmed to a window)
    # 9 + 17 + 15 (base[5] its bonus), then base[5]'s one-gram match drafts base[6:] where
    # base[1] follows (a round of one token), then 8 deep again off base[1]'s one-gram match;
    # each round's tokens go to this text's record under its match length
    assert list(d.shadow) == [(9, 2.0), (17, 2.0), (15, 2.0), (1, 2.0), (9, 2.0)], list(d.shadow)
    assert d.seen == {("host", 4): (41, 3), ("host", 1): (10, 2)}, d.seen
    d = AdaptiveDrafter(host=LookupDrafter(16, 16), costs=(1.0, flat(2.0)))
    d.prefill(base + base)
    rounds = 0
    while d.queue_more(emitted[4 * rounds: 4 * rounds + 4], 1.0):  # 4 tokens / ms
        rounds += 1
    # 4 tokens / ms beats plain (1) but not 0.8 x the host's shadow rate (about 6 tokens / ms
    # at the decision): handed back at the first booked decision
    assert rounds == adaptive.QUEUED_WARM + adaptive.QUEUED_MIN - 1
    assert 4.0 < adaptive.QUEUED_LOSS * d.shadow_total[0] / d.shadow_total[1]
    fed = emitted[: 4 * rounds + 4]
    assert len(d.host.index) < len(base + base + fed)  # its shadow is behind the text
    d.primary = types.SimpleNamespace(handed_back=lambda start, tokens: None)
    d.handed_back(500, fed)
    assert d.host.index.tokens == base + base + fed
    # the same text priced so that the host's rounds cost 16 ms: the shadow still covers the
    # window (the comparison is made) and its rate is below the queued rounds': they go on
    d = AdaptiveDrafter(host=LookupDrafter(16, 16), costs=(1.0, flat(16.0)))
    d.prefill(base + base)
    assert all(d.queue_more(emitted[i:i + 4], 1.0) for i in range(0, 120, 4))
    window = sum(t for t, _ in d.queued)
    assert 2 * d.shadow_total[0] >= window and d.shadow_total[0] / d.shadow_total[1] < 4.0


def test_a_few_hard_queued_rounds_do_not_end_queueing():
    # the hand-back reads the last QUEUED_WINDOW booked rounds (tokens / ms over all of them): 20
    # good rounds then three that emit one token each keep queueing (an EWMA would have dropped
    # below the margin), while rounds that keep losing hand back within a window
    d = AdaptiveDrafter(host=LookupDrafter(8, 6), costs=(1.0, flat(1.0)))
    good = [d.queue_more([1] * 20, 10.0) for _ in range(adaptive.QUEUED_WARM + 20)]
    assert all(good) and all(d.queue_more([1], 10.0) for _ in range(3))
    assert False in [d.queue_more([1], 10.0) for _ in range(adaptive.QUEUED_WINDOW)]  # the window, not the generation


def test_queued_rounds_hand_back_below_the_margin_only():
    # plain's rate (1 token/ms here) is the start-up fit's: queued rounds go on at 0.9 of it and
    # hand back at 0.7, after QUEUED_WARM unbooked and QUEUED_MIN booked rounds
    for tokens, keeps in ((9, True), (7, False)):
        d = AdaptiveDrafter(host=LookupDrafter(8, 6), costs=(1.0, flat(1.0)))
        answers = [d.queue_more([1] * tokens, 10.0) for _ in range(adaptive.QUEUED_WARM + adaptive.QUEUED_MIN + 4)]
        first_no = answers.index(False) if False in answers else None
        assert first_no == (None if keeps else adaptive.QUEUED_WARM + adaptive.QUEUED_MIN - 1), answers
    # stretches that booked a slower plain (catch-up included) do not lower the bar
    d = AdaptiveDrafter(host=LookupDrafter(8, 6), costs=(1.0, flat(1.0)))
    for _ in range(8):
        book(d, "plain", 16, 64.0)  # 0.25 tokens per ms
    answers = [d.queue_more([1] * 7, 10.0) for _ in range(adaptive.QUEUED_WARM + adaptive.QUEUED_MIN + 4)]
    assert answers.index(False) == adaptive.QUEUED_WARM + adaptive.QUEUED_MIN - 1, answers


def test_a_freed_models_record_is_not_a_new_models():
    # memory keys name live models: a new model that takes a freed one's id (CPython reuses
    # them) starts a record of its own
    import gc

    from mlx_treespec.adaptive import ModelKey

    target, draft = tiny.build(tiny.CONFIGS["qwen3"]), None
    key = ModelKey("auto", target, draft)
    assert key == ModelKey("auto", target, draft) and key != ModelKey("other", target, draft)
    records = {key: "learned"}
    other = tiny.build(tiny.CONFIGS["qwen3"])
    collide = ModelKey("auto", other, draft)
    collide._hash = key._hash  # as if `other` had taken the id of `target`
    assert records.get(collide) is None
    del target
    gc.collect()
    assert key != ModelKey("auto", other, draft) and key != key.__class__("auto", other, None)


def test_what_was_learned_is_kept_for_the_most_recently_used_models():
    # the process keeps 64 models' records: past that the least recently used goes, not all of
    # them (a live model's record was dropped with the others)
    from mlx_treespec.adaptive import LEARNED

    saved = dict(LEARNED)
    LEARNED.clear()
    try:
        first = AdaptiveDrafter(host=LookupDrafter(), costs=(1.0, flat(2.0)), memory="kept").learned
        for i in range(100):
            AdaptiveDrafter(host=LookupDrafter(), costs=(1.0, flat(2.0)), memory=f"other {i}")
            if i % 10 == 0:  # in use: the model's record is found again, and made the most recent
                assert AdaptiveDrafter(host=LookupDrafter(), memory="kept").learned is first
        assert len(LEARNED) == 64 and LEARNED["kept"] is first and "other 99" in LEARNED and "other 0" not in LEARNED
    finally:
        LEARNED.clear()
        LEARNED.update(saved)


def test_an_error_in_a_hand_back_still_lands_the_last_token(requeuing):
    # queued rounds hand back to the round loop: where the drafter's hand-back raises (an
    # interrupt), the prompt cache still holds the prompt and every token delivered (the last
    # one, never forwarded by a queued round, was missing)
    target, make = requeuing()
    d = make()

    def interrupted(start, tokens):
        raise KeyboardInterrupt("interrupted during the hand-back")

    d.handed_back = interrupted
    from mlx_lm.models.cache import make_prompt_cache

    prompt, cache, got = repetitive(), make_prompt_cache(target), []
    with pytest.raises(KeyboardInterrupt):
        for t, _, _ in tree_generate_step(prompt, target, d, max_tokens=64, prompt_cache=cache):
            got.append(t)
    assert got and {c.offset for c in cache} == {len(prompt) + len(got)}
    assert got == plain(target, prompt, n=len(got))
