"""Adaptive drafting: before every round, the draft with the most expected tokens per millisecond.

`AdaptiveDrafter` picks one of three arms each round: `primary` (a drafter that runs a model:
DFlash, a draft model, an MTP or EAGLE-3 head; where rounds can be queued ahead, `QueueAhead`:
the loop queues the primary's trees (its chains where it drafts none) until `queue_more` hands
back), `host` (prompt lookup or a
suffix index, where it matched the text) or `plain` (`PlainStretch(n)`: the loop decodes n
tokens plainly, pipelined as mlx-lm, then hands the drafters what they missed in `catch_up`).
An arm's rate is its tokens per use over its wall ms per use: the ms carry over between
generations, the tokens are re-learned per text (`value`); a DFlash round's node budget is the one with the most expected
tokens per ms (`choose_budget`, over calibrated node probabilities and the cost fit at the
generation's context). The rules, their constants and the tests that pin them are
docs/design.md's "Adaptive drafting". Exactness does not depend on any of it: every arm drafts
an exact draft, and a plain stretch is plain decoding.
"""
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .builders import best_first_tree
from .draft import Draft
from .tree import MAX_NODES, DraftTree, depths_of, preorder
from .verify import pad_keys_default, row_bucket
from .walk import greedy_walk

__all__ = ["AdaptiveDrafter", "PlainStretch", "QueueAhead", "Calibration", "Rate"]

ALPHA = 0.3  # weight of the newest use in an arm's averages
STRETCH, MAX_STRETCH = 16, 256  # tokens of a plain stretch: first, and after repeated losses
REPROBE = 16  # available rounds after which an arm not taken is tried once
MAX_WAIT = 64  # where rounds queue: the most rounds the primary's arm sits out (`handed_back`)
CARRIED_USES = 1  # weight of the tokens per use carried from earlier generations, in uses
REPRICE = 1024  # context rows between two asks of `context_costs`
MATCHES = 4  # host match lengths told apart (longer ones count as this)
# A use that took over SPIKE x what the start-up fit says it costs paid for a new shape once (a
# trace, new kernels: on the H200 such a round costs several times a usual one) and is not
# booked, unless SPIKES_IN_A_ROW uses in a row did: then that is what the arm costs
SPIKE, SPIKES_IN_A_ROW = 4.0, 2
# Rounds queued ahead (queued.py): the first QUEUED_WARM pay traces and checks and are not booked
# (queued again later in a generation: the first, the pipeline's start);
# once QUEUED_MIN rounds are booked and their rate over the last QUEUED_WINDOW booked rounds
# (tokens / ms: not an EWMA, whose few hard rounds ended a generation's queueing for good; not the
# whole generation, which late on would never move) is below QUEUED_LOSS x plain decoding's, the
# adaptive rounds take over. Not at 1.0: plain's rate is the start-up fit's, taken in quiet
# conditions. An EWMA handed back where the chain was faster than what followed (bench/RESULTS.md,
# "The retrained hybrid DFlash head"). The bar is the
# better of plain's rate and the host's over the same tokens (`_shadow`), once the host's shadow
# rounds cover at least half the window's tokens. A hand-back is not for good: the primary's
# arm queues again when chosen (`QueueAhead`), so the decision comes early (bench/RESULTS.md,
# "The default comes back to queued rounds" and "The default, three runs of each prompt")
QUEUED_WARM, QUEUED_MIN, QUEUED_WINDOW, QUEUED_LOSS = 3, 4, 32, 0.8
# Sampled, a head's queued rounds are never handed back (`holds_queue`): a round's emitted
# count swings with the draws (a text's first rounds 1-2 tokens, later ones 9), four booked
# rounds read a hard start as a losing arm, and the rounds that followed were mostly plain
# stretches, on the prompts where the fixed tree lost to plain decoding too. Holding ran
# 1.15x the old rule on the hybrid at temp 0.7; at 0.3 the old rule won on repetitive text,
# handing back to prompt lookup (bench/RESULTS.md, "Sampled, the default keeps its queued tree")


@dataclass(frozen=True)
class PlainStretch:
    """No draft for the next `tokens` tokens: the loop decodes them plainly (pipelined). The loop
    shows `watch` (if any) each token as it is read; True ends the stretch at the next token."""

    tokens: int
    watch: Optional[Callable[[int], bool]] = None


@dataclass(frozen=True)
class QueueAhead:
    """No draft from the round loop: the loop queues the primary's rounds ahead (queued.py) from
    the root, after `requeue`, until `queue_more` hands back."""


class Rate:
    """Emitted tokens and wall ms of an arm's uses, each averaged (EWMA); `value` their ratio."""

    __slots__ = ("tokens", "ms", "uses")

    def __init__(self, ms_per_token=None):
        self.tokens, self.ms, self.uses = (1.0, float(ms_per_token), 0) if ms_per_token else (None, None, 0)

    def add(self, tokens, ms):
        if self.ms is None:
            self.tokens, self.ms = float(tokens), float(ms)
        else:
            self.tokens += ALPHA * (tokens - self.tokens)
            self.ms += ALPHA * (ms - self.ms)
        self.uses += 1

    @property
    def value(self):
        """Tokens per ms (None before any use or prior)."""
        return None if self.ms is None else self.tokens / max(self.ms, 1e-6)


class Calibration:
    """P(the target accepts a draft node | the drafter's probability of its path), by bin:
    `PRIOR` pseudo-observations at the drafter's own probability, then every verified node."""

    EDGES = np.array([0.0, 0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97])
    PRIOR = 4.0

    def __init__(self):
        self.hits = np.zeros(len(self.EDGES))
        self.seen = np.zeros(len(self.EDGES))

    def _bins(self, p):
        return np.clip(np.searchsorted(self.EDGES, p, side="right") - 1, 0, len(self.EDGES) - 1)

    def __call__(self, p):
        p = np.asarray(p, np.float64)
        b = self._bins(p)
        return (self.hits[b] + self.PRIOR * p) / (self.seen[b] + self.PRIOR)

    def update(self, p, accepted):
        b = self._bins(np.asarray(p, np.float64))
        np.add.at(self.hits, b, np.asarray(accepted, np.float64))
        np.add.at(self.seen, b, 1.0)


class Learned:
    """What an adaptive drafter has learned: its arms' rates, the DFlash calibration, a DFlash
    round's overhead. Drafters built with the same `memory` key share one (`LEARNED`), so a
    library call that makes a drafter per generation starts from what the last one learned."""

    def __init__(self, plain_ms=None):
        # the host's rate by the length of its match (1..MATCHES): a long match drafts far more
        # (and ("sampled", i): the primary's rounds in shape i of AdaptiveDrafter.shapes, made
        # at their first use by `_key`: the shapes cost apart)
        self.rates = {"primary": Rate(), "plain": Rate(plain_ms),
                      **{("host", m): Rate() for m in range(MATCHES + 1)}}
        self.calibration = Calibration()
        self.overhead = None  # EWMA of a DFlash round's ms beyond its verify's
        self.plain_at = plain_ms  # the plain ms per token the plain rate stands at (repricing scales it)


LEARNED = {}  # memory key -> Learned, for this process


class ModelKey:
    """A `memory` key naming a draft configuration (a `DraftSpec`, or any hashable) and live
    models. Equal only while the very models it was made for are alive: a model freed and a new
    one that takes its id must not share a record."""

    __slots__ = ("config", "refs", "_hash")

    def __init__(self, config, *models):
        self.config = config
        self.refs = tuple(None if m is None else weakref.ref(m) for m in models)
        self._hash = hash((config,) + tuple(id(m) for m in models))

    def _models(self):
        return tuple(None if r is None else r() for r in self.refs)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if not isinstance(other, ModelKey) or other.config != self.config or len(other.refs) != len(self.refs):
            return False
        mine, theirs = self._models(), other._models()
        return all(r is None or (m is not None and m is t) for r, m, t in zip(self.refs, mine, theirs)) and \
            all((r is None) == (u is None) for r, u in zip(self.refs, other.refs))


def _kind(drafter):
    return getattr(drafter, "kind", type(drafter).__name__.replace("Drafter", "").lower())


class AdaptiveDrafter:
    """Picks each round's arm (module docstring). `primary`: a model drafter or None; `host`: a
    model-free drafter or None (at least one); `costs`: (plain ms per token, verify CostFit over
    nodes) from `costmodel.startup_costs` (or a function returning them, called at the first
    prefill), or None to learn plain's rate from a first stretch and draft DFlash's whole
    budget until a round's overhead is known; `verify_rows`: the verify's row count for n
    nodes (default: the device's, `row_bucket` on GPUs); `memory`: a key under which what it
    learns is shared with later drafters of the same key (`Learned`); `context_costs`: a
    function of the context's rows returning `costs` there (`costmodel.costs_at`), asked at
    each prefill and every `REPRICE` rows; `sampled_shapes`: ((temp, (topk, lanes, depth,
    budget)), ...) by ascending temp, the primary's shape when sampling at each temp or hotter
    (`spec.DraftSpec.sampled_shapes`). `reset` starts a fresh record (under the same key)."""

    def __init__(self, primary=None, host=None, costs=None, verify_rows=None, memory=None,
                 context_costs=None, sampled_shapes=None):
        if primary is None and host is None:
            raise ValueError("an adaptive drafter needs a drafter to choose: pass primary= or host=")
        if getattr(host, "capture", ()):
            raise ValueError("host= is a model-free drafter (lookup, suffix); a drafter that reads the "
                             "target goes in primary=")
        self.primary, self.host, self.costs = primary, host, costs
        self.context_costs, self.context, self.priced = context_costs, 0, None
        # set by the loop: the most rows an attention layer reads (None: all), the rows the
        # caches held before the prompt (a prompt cache's earlier turns)
        self.window, self.prefix = None, 0
        self.capture = tuple(getattr(primary, "capture", ())) if primary is not None else ()
        # DDTree drafters (ranked + as_draft) get their budget chosen per round
        self.blocks = primary is not None and callable(getattr(primary, "ranked", None)) and primary.topk != 1
        if verify_rows is None:
            verify_rows = row_bucket if pad_keys_default() else (lambda n: n)
        self.verify_rows = verify_rows
        self.names = {"primary": _kind(primary) if primary is not None else "",
                      "host": _kind(host) if host is not None else "", "plain": "plain"}
        self.memory = memory
        # ((temp from which, the primary's (topk, lanes, depth, budget)), ...), coolest first:
        # its own shape greedy and cool, then `sampled_shapes` (spec.DraftSpec.sampled_shapes;
        # None: one shape)
        if sampled_shapes is not None:
            temps = [t for t, _ in sampled_shapes]
            if primary is None:
                raise ValueError("sampled_shapes= shapes the primary drafter: pass primary=")
            if not callable(getattr(primary, "reshape", None)):
                raise ValueError(f"sampled_shapes= reshapes the primary drafter, and a {type(primary).__name__} "
                                 "takes no shape (a draft model's or a head's does): drop sampled_shapes=")
            if not all(a < b for a, b in zip([0.0] + temps, temps)):  # (NaN fails every comparison)
                raise ValueError("sampled_shapes= takes (temp, shape) pairs by strictly ascending temp, each "
                                 f"above 0: got temps {temps}")
        self.shapes = None if sampled_shapes is None else (
            ((0.0, (primary.topk, primary.lanes, primary.depth, primary.budget)),) + tuple(sampled_shapes))
        self.tier = 0  # the index in `shapes` of the shape this generation drafts
        self.queueable = False  # set by the loop per generation: rounds can be queued ahead (queued.py)
        if memory is not None and memory in LEARNED:
            self.learned = LEARNED[memory] = LEARNED.pop(memory)  # (the most recent now: kept longest)
            self._restart()
            for d in (primary, host):
                if d is not None:
                    d.reset()
        else:
            self.reset()

    @property
    def rates(self):
        return self.learned.rates

    @property
    def calibration(self):
        return self.learned.calibration

    @property
    def overhead(self):
        return self.learned.overhead

    @overhead.setter
    def overhead(self, ms):
        self.learned.overhead = ms

    @property
    def depth(self):
        return getattr(self.primary if self.primary is not None else self.host, "depth", 0)

    @property
    def draw(self):
        """The sampling.Draw the primary guesses (set by the loop per generation, at temp > 0)."""
        return getattr(self.primary, "draw", None)

    @draw.setter
    def draw(self, draw):
        # a head's default drafts the shape of the hottest threshold its temp reaches (spec.py)
        if hasattr(self.primary, "draw"):
            self.primary.draw = draw
        if self.shapes is not None:
            temp = getattr(draw, "temp", None)
            self.tier = 0 if temp is None else max((i for i, (t, _) in enumerate(self.shapes) if temp >= t), default=0)
            self.primary.reshape(*self.shapes[self.tier][1])

    # ------------------------------------------------------------------ the drafter calls

    def reset(self):
        plain = self.costs[0] if self.costs and not callable(self.costs) else None
        self.learned = Learned(plain)
        if self.memory is not None:
            LEARNED.pop(self.memory, None)
            while len(LEARNED) >= 64:  # the least recently used first (most often a model long gone)
                LEARNED.pop(next(iter(LEARNED)))
            LEARNED[self.memory] = self.learned
        self._restart()
        for d in (self.primary, self.host):
            if d is not None:
                d.reset()

    def _restart(self):
        self.idle = {"primary": 0, "host": 0}
        self.stretch = STRETCH
        self.probing = False  # the round under way is the probe after a stretch
        self.after_stretch = False
        self.match = 0  # the host's match length this round (its rate's key)
        self.fed = 0  # tokens of the stretch under way the host drafter has seen (`watch`)
        self.warm = set()  # arms used in this generation: an arm's first use pays one-off costs
        self.seen = {}  # rate key -> (tokens, uses) of this generation's speculative uses
        # tokens per use carried in (what `value` weighs this generation's own against)
        self.prior = {k: r.tokens for k, r in self.rates.items() if r.ms is not None}
        self.spikes = {}  # per rate: uses in a row not booked as spikes (SPIKE)
        self.last = None  # (arm, start time, nodes) of the round or stretch under way
        self.emitted = 0
        self.scores = None  # draft probability of each node of the last DFlash draft (draft order)
        self.requeued = False  # the queued rounds under way are not the generation's first
        # where rounds queue, rounds the primary's arm sits out after a hand-back (`handed_back`)
        self.wait = REPROBE
        self._queue_from(None)
        self.reach = self._reach_base()  # how deep the next host round drafts (`_reach_after`)

    def _queue_from(self, root):
        """A fresh record for queued rounds from `root` (None: before the prefill)."""
        self.queued, self.queued_seen = deque(maxlen=QUEUED_WINDOW), 0  # booked queued rounds: (tokens, ms)
        # the host's shadow rounds over the queued rounds' tokens (`_shadow`): (tokens, ms); the
        # root and the tokens emitted queued since, and how many of them the host drafter has seen
        self.shadow = deque()
        self.queued_tokens, self.shadowed = ([], 0) if root is None else ([int(root)], 1)
        self.shadow_total = [0, 0.0]  # the shadow rounds' tokens and ms, summed

    def _reach_base(self):
        """A host round's depth at first: half what the host may draft (the rest is for texts
        that repeat, `_reach_after`)."""
        most = getattr(self.host, "max_depth", None)
        return None if most is None else max(1, int(most) // 2)

    def _reach_after(self, deepest, accepted):
        """The next host round's depth: twice this one's (up to the host's max_depth) where the
        target accepted a whole root path of the draft, as deep as it went (`deepest`; a text
        repeating itself: a deeper draft costs the verify little and is accepted further), else
        the start."""
        if self.reach is None:
            return None
        if deepest and accepted >= deepest:
            return min(2 * self.reach, int(self.host.max_depth))
        return self._reach_base()

    def prefill(self, prompt, hidden=None):
        if callable(self.costs):  # measured on the first generation (after the gate passed the target)
            self.costs = self.costs()
            if self.rates["plain"].value is None:
                self.rates["plain"] = Rate(self.costs[0])
                self.learned.plain_at = self.costs[0]
        self._restart()
        self._queue_from(prompt[-1])
        self.context, self.priced = self.prefix + len(prompt), None
        self._reprice()
        if self.primary is not None:
            self.primary.prefill(prompt, *self._rows(hidden))
        if self.host is not None:
            self.host.prefill(prompt)

    def _reprice(self):
        """Costs at the context the next round reads (asked every REPRICE rows): the verify fit,
        and plain's rate scaled by plain's new cost over the one it stands at."""
        rows = self.context if self.window is None else min(self.context, self.window)
        if self.context_costs is None or self.costs is None or callable(self.costs) or self.priced == rows // REPRICE:
            return
        self.priced = rows // REPRICE
        self.costs = self.context_costs(rows)
        plain, at = self.rates["plain"], self.learned.plain_at
        if plain.ms is not None and at:
            plain.ms *= self.costs[0] / at
        self.learned.plain_at = self.costs[0]

    def draft(self, root, max_depth):
        now = time.perf_counter()
        self._close(now)
        self._reprice()  # (after the last round was booked at the costs it ran under)
        if max_depth <= 0:
            return Draft.root_only(root)
        reach = max_depth if self.reach is None else min(max_depth, self.reach)
        match, e = self._host_match(root, reach) if self.host is not None else (0, None)
        available = ["primary"] if self.primary is not None else []
        if match:
            available.append("host")
            self.match = min(match, MATCHES)
        arm = self.choose(available)
        if arm == "plain":
            self.last = ("plain", now, 1)
            self.fed = 0
            return PlainStretch(self.stretch, self.watch if self.host is not None else None)
        if arm == "primary" and self.queueable:  # its rounds are booked in `queue_more`
            return QueueAhead()
        if arm == "host":
            d = e if e is not None else self.host.draft(root, reach)
        else:
            d = self._primary_draft(root, max_depth)
        d.source = self.names[arm]
        self.last = (arm, now, d.size)
        return d

    def commit(self, draft, path, emitted, hidden=None):
        self.emitted = len(emitted)
        self.context += len(emitted)
        arm = self.last[0] if self.last is not None else None
        if arm == "primary" and self.blocks and self.scores is not None:
            n = min(draft.size, len(self.scores) + 1)  # the verify may have dropped the last nodes
            accepted = np.zeros(n - 1, bool)
            nodes = np.asarray(path, np.int64)[1:]
            accepted[nodes[nodes < n] - 1] = True
            self.calibration.update(self.scores[: n - 1], accepted)
        self.scores = None
        if arm == "host":
            deepest = int(depths_of(draft.layout.host_parents()).max()) if draft.size > 1 else 0
            self.reach = self._reach_after(deepest, len(path) - 1)
        if self.primary is not None:
            self.primary.commit(draft, path, emitted, *self._rows(hidden))
        if self.host is not None:
            self.host.commit(draft, path, emitted)

    def _rows(self, hidden):
        """The target rows for the primary's calls: passed only to a drafter that reads them."""
        return (hidden,) if self.capture else ()

    def watch(self, token):
        """A stretch's token as it is read: the host drafter sees it, and the stretch ends at the
        next token where the host matches with a match length whose rounds beat plain decoding
        (or were never measured): the next round drafts with it."""
        self.host.commit(None, None, [int(token)])
        self.fed += 1
        match, _ = self._host_match(int(token), getattr(self.host, "max_depth", self.depth) or 1)
        if not match:
            return False
        rate = self.value(("host", min(int(match), MATCHES)))
        plain = self.value("plain")
        return rate is None or plain is None or rate > plain

    def _host_match(self, root, max_depth):
        """(the host drafter's match length at `root`, 0 for none; its draft where building it
        was the way to know, else None). Prompt lookup tells its match without building the
        tree (`match_length`), so a round the host does not draft builds none."""
        if callable(getattr(self.host, "match_length", None)):
            return self.host.match_length(), None
        e = self.host.draft(root, max_depth)
        return (max(int(getattr(self.host, "last_match", 1)), 1) if e.size > 1 else 0), e

    @property
    def ahead(self):
        """The primary's queued draft (queued.py) where it has one: DDTree's trees where its
        primary drafts them, over attention and recurrent layers alike (they cost a queued
        round about a chain's and emit more: bench/RESULTS.md), else its chain
        (`queues_trees`). Where rounds can be queued, a generation starts with them, and
        `queue_more` hands it to the adaptive rounds when they lose to plain decoding."""
        if self.primary is None:
            return None
        return self.primary.ahead if self.queues_trees else getattr(self.primary, "chain_ahead", None)

    @property
    def queues_trees(self):
        # DDTree's trees queue; a head's one-lane tree adds a few percent to its chain's
        # emitted per verify for its verify's extra rows, and queued in the adaptive rounds it
        # lost to the head's chain (bench/RESULTS.md at a9f0a7f, "Head trees queued ahead"): a head queues
        # its chain here, greedy. Sampled, its draws miss more often and a step's runners-up
        # catch a fifth more tokens a verify (bench/RESULTS.md, "Sampled rounds"): its tree
        return bool(getattr(self.primary, "queues_trees", False)) and (not self.over_head or self.draw is not None)

    @property
    def holds_queue(self):
        """Queued rounds (a tree or a chain) go on whatever they emit: a head's, sampled (the
        note under the QUEUED_* constants)."""
        return self.draw is not None and self.over_head

    @property
    def over_head(self):
        """The primary is a head (drafters.head): its queued draft and rule differ when sampling."""
        from .drafters.head import HeadDrafter

        return isinstance(self.primary, HeadDrafter)

    def queued_read(self, emitted):
        """(queued.py: the host read queued rounds that emitted `emitted` tokens since queueing
        began; the primary's context bound follows.)"""
        read = getattr(self.primary, "queued_read", None)
        if read is not None:
            read(emitted)

    def queue_more(self, tokens, ms):
        """After each queued round (`tokens`: what it emitted, the last the next root; `ms`: its
        wall time): whether queueing goes on. Its rate over the last QUEUED_WINDOW booked rounds
        (warm-up rounds and spikes unbooked, as `_close` leaves them) must stay at least
        QUEUED_LOSS x the better of plain decoding's rate and the host drafter's over the same
        text (`_shadow`); sampled, a head's go on to the generation's end (`holds_queue`)."""
        if self.holds_queue:
            return True
        self.queued_tokens += [int(t) for t in tokens]
        self._shadow()
        self.queued_seen += 1
        if self.queued_seen <= (1 if self.requeued else QUEUED_WARM):
            return True
        booked = self.queued
        usual = sum(m for _, m in booked) / len(booked) if booked else None
        if usual is not None and ms > SPIKE * usual and self.spikes.get("queued", 0) < SPIKES_IN_A_ROW:
            self.spikes["queued"] = self.spikes.get("queued", 0) + 1  # a new shape, once
            return True
        self.spikes["queued"] = 0
        booked.append((len(tokens), ms))
        # plain decoding's start-up rate (at this context), not the stretches' EWMA: a stretch's
        # wall time holds the drafters' catch-up, and QUEUED_LOSS is the margin for that
        fit = self.costs is not None and not callable(self.costs)
        plain = 1.0 / max(float(self.costs[0]), 1e-9) if fit else self.rates["plain"].value
        window = sum(t for t, _ in booked)
        shadow, total = self.shadow, self.shadow_total
        while len(shadow) > 1 and total[0] - shadow[0][0] >= window:  # about the window's tokens
            t, m = shadow.popleft()
            total[0], total[1] = total[0] - t, total[1] - m
        if total[0] and 2 * total[0] >= window:
            host = total[0] / max(total[1], 1e-6)
            plain = host if plain is None else max(plain, host)
        rate = window / max(sum(m for _, m in booked), 1e-6)
        return plain is None or len(booked) < QUEUED_MIN or rate >= QUEUED_LOSS * plain  # (QUEUED_MIN <= the window)

    def _shadow(self):
        """The host drafter follows the queued rounds' text as the adaptive rounds would run it:
        from its root, the round the adaptive rounds would draft (its draft at this reach where
        it matches, else a plain token), walked against the tokens the target emitted (exact at
        any temperature: the target's token at a position is the text's wherever the path
        before it is), priced (a host round as `_expected_ms` prices it,
        a plain token at plain's start-up cost), and committed. A round is walked once the text
        holds its deepest path and the bonus token.
        What the host's draft is accepted to goes into this text's record of its rate, as a
        round of its own would (`seen`). Hosts draft here with `tree` (prompt lookup, suffix:
        numpy), so the queued rounds' device work is not waited on."""
        if (self.host is None or not callable(getattr(self.host, "tree", None)) or self.costs is None
                or callable(self.costs) or not self.shadowed):
            return  # (no host tree to walk, nothing to price it by, or no prefill: no root)
        text, quick = self.queued_tokens, getattr(self.host, "match_length", None)
        while True:
            reach = self.reach if self.reach is not None else self.depth
            known = text[self.shadowed:]
            if reach < 1 or len(known) < reach + 1:
                return
            tree = None if callable(quick) and not quick() else self.host.tree(text[self.shadowed - 1], reach)
            if tree is not None and tree.size > 1:
                # the target's choice after a node at depth k is the text's k-th token after the root
                path, _ = greedy_walk(tree, np.asarray(known, np.int64)[tree.depths])
                accepted = len(path) - 1
                self.match = min(max(int(self.host.last_match), 1), MATCHES)
                ms = self._expected_ms("host", tree.size)
                key = ("host", self.match)
                t, u = self.seen.get(key, (0.0, 0))
                self.seen[key] = (t + accepted + 1, u + 1)
                self.reach = self._reach_after(int(tree.depths.max()), accepted)
            else:
                accepted, ms = 0, float(self.costs[0])
            emitted = known[: accepted + 1]
            self.host.commit(None, None, emitted)
            self.shadowed += len(emitted)
            self.shadow.append((len(emitted), ms))
            self.shadow_total[0] += len(emitted)
            self.shadow_total[1] += ms

    def handed_back(self, start, tokens):
        """Queued rounds ended at `start` context rows, having emitted `tokens` (the last is
        the next root): the drafters catch up, and the adaptive rounds go on. The primary's
        arm (queued rounds, on this path) sits out `wait` rounds, then is tried again."""
        self.primary.handed_back(start, tokens)
        self.context = start + 1
        if self.host is not None:  # what its shadow rounds did not see
            self.host.commit(Draft.root_only(tokens[-1]), np.zeros(1, np.int64), tokens[max(self.shadowed - 1, 0):])
        # a try that handed back at its first decision: twice as long before the next (a text
        # where queued rounds lose would otherwise pay a window's warm-up every REPROBE rounds);
        # one that outlasted it won for a while, as speculation winning resets a stretch
        n = len(self.queued)
        if self.requeued and n <= QUEUED_MIN:
            self.wait = min(2 * self.wait, MAX_WAIT)
        else:
            self.wait = REPROBE
            if n > QUEUED_MIN:
                self.stretch = STRETCH

    def requeue(self, root):
        """The loop queues rounds again from `root` (a `QueueAhead` chosen): a fresh window (the
        text has moved on since the last), the host's shadow from `root` (it has seen every
        token), the primary's context written to the end."""
        self._queue_from(root)
        self.requeued = True
        self.primary.requeue()

    def catch_up(self, root, tokens, hidden=None):
        """After a plain stretch from `root`: the `tokens` it emitted (the last is the next root)
        and the target rows of the tokens it forwarded (root first, one per token); the host
        drafter saw the first `fed` of them in `watch`."""
        self.emitted = len(tokens)
        self.context += len(tokens)
        d, path = Draft.root_only(root), np.zeros(1, np.int64)
        if self.primary is not None:
            self.primary.commit(d, path, tokens, *self._rows(hidden))
            if callable(getattr(self.primary, "settle", None)):
                self.primary.settle()  # the stretch's catch-up is the stretch's cost
        if self.host is not None and len(tokens) > self.fed:
            self.host.commit(d, path, tokens[self.fed:])
        self.fed = 0

    def probe_parents(self):
        return (self.primary if self.primary is not None else self.host).probe_parents()

    # ------------------------------------------------------------------ the choices

    def choose(self, available):
        """The arm for this round among `available` speculative arms and plain."""
        was_probe, self.probing = self.probing, False
        chosen = self._choose(available)  # sets `probing` for the probe after a stretch
        for a in available:
            self.idle[a] = 0 if a == chosen else self.idle[a] + 1
        if chosen == "plain":
            if was_probe:  # speculation lost its probe: stay off longer
                self.stretch = min(2 * self.stretch, MAX_STRETCH)
            self.after_stretch = True
        return chosen

    def rate(self, arm):
        """The Rate an arm books to (the host's by this round's match length)."""
        return self.rates[self._key(arm)]

    def _key(self, arm):
        if arm == "host":
            return ("host", self.match)
        if arm != "primary" or not self.tier:
            return arm
        key = ("sampled", self.tier)
        self.rates.setdefault(key, Rate())
        return key

    def value(self, key):
        """A rate's expected tokens per ms in this generation (`key`: an arm, or ("host", match
        length)): its carried ms per use, and its tokens per use this generation with the
        carried average as `CARRIED_USES` uses (None before any booked use)."""
        rate = self.rates[key]
        if rate.ms is None or key == "plain":
            return rate.value
        tokens, uses = self.seen.get(key, (0.0, 0))
        prior = self.prior.get(key)
        if prior is None:  # first learned in this generation: its own uses (the EWMA before any)
            return (tokens / uses if uses else rate.tokens) / max(rate.ms, 1e-6)
        return (CARRIED_USES * prior + tokens) / (CARRIED_USES + uses) / max(rate.ms, 1e-6)

    def _choose(self, available):
        if self.queueable and "primary" in available:  # queued rounds: tried again after `wait`
            if self.idle["primary"] >= self.wait:
                self.after_stretch = False  # (queue_more judges the try)
                return "primary"
            available = [a for a in available if a != "primary"]
        rates = {a: self.value(self._key(a)) for a in available + ["plain"]}
        for a in available:  # never used: try it
            if rates[a] is None:
                return a
        if "primary" in available and self._key("primary") not in self.seen:  # once per text
            return "primary"
        if not available or rates["plain"] is None:
            return "plain"
        if self.after_stretch:  # back from a stretch: the best speculative arm, once
            self.after_stretch, self.probing = False, True
            return max(available, key=rates.get)
        for a in available:
            if self.idle[a] >= REPROBE:
                return a
        best = max(available + ["plain"], key=rates.get)
        if best != "plain":
            self.stretch = STRETCH
        return best

    def verify_ms(self, nodes):
        """The verify fit's ms of `nodes` nodes (an array), at the device's row count (a table
        per fit and row rule, built once: this runs every DFlash round). The table is kept with
        the fit itself, not its id: a repriced fit may take a freed one's id."""
        fit, rows = self.costs[1], self.verify_rows
        table = getattr(self, "_verify_table", None)
        if table is None or table[0] is not fit or table[1] is not rows:
            table = self._verify_table = (fit, rows, fit.at([rows(n) for n in range(MAX_NODES + 1)]))
        return table[2][np.atleast_1d(np.asarray(nodes, np.int64))]

    def choose_budget(self, probs):
        """Nodes of the best-first tree to draft, given its nodes' draft probabilities in
        best-first order: the B in 1..len(probs) with the most expected emitted tokens per ms."""
        n = len(probs)
        if self.costs is None or self.overhead is None:
            return n
        gain = 1.0 + np.cumsum(self.calibration(probs))
        ms = np.maximum(self.overhead + self.verify_ms(np.arange(2, n + 2)), 1e-6)
        return int(np.argmax(gain / ms)) + 1

    def _primary_draft(self, root, max_depth):
        p = self.primary
        if not self.blocks:
            return p.draft(root, max_depth)
        depth = min(p.depth, max_depth)
        ids, top = p.ranked(root, depth)
        tree = best_first_tree(0, top, min(p.budget, MAX_NODES - 1))
        B = self.choose_budget(np.exp(tree.scores[1:]))
        tree = DraftTree(tree.tokens[: B + 1], tree.parents[: B + 1], tree.scores[: B + 1])
        self.scores = np.exp(tree.scores[preorder(tree.parents)][1:])  # as as_draft numbers them
        return p.as_draft(root, ids, tree, depth, B)

    def _expected_ms(self, arm, nodes):
        """What a use usually costs: the larger of the start-up fit's figure (a stretch its
        tokens' plain ms, a round its verify's, a DFlash round plus its measured overhead) and
        the arm's own average use (a draft model's rounds cost its forwards too); inf before
        either exists."""
        rate = self.rate(arm)
        own = rate.ms / rate.tokens * max(self.emitted, 1) if arm == "plain" and rate.ms else rate.ms
        if self.costs is None or callable(self.costs):
            return own if own is not None else float("inf")
        if arm == "plain":
            fit = float(self.costs[0]) * max(self.emitted, 1)
        else:
            fit = float(self.verify_ms([nodes])[0]) + (
                self.overhead if arm == "primary" and self.overhead is not None else 0.0)
        return max(fit, own or 0.0)

    def _close(self, now):
        """Book the round or stretch that just ended against its arm."""
        if self.last is None:
            return
        arm, start, nodes = self.last
        self.last = None
        ms = 1e3 * (now - start)
        key = self._key(arm)
        if arm != "plain":  # what it emitted is this text's, whatever the round cost
            tokens, uses = self.seen.get(key, (0.0, 0))
            self.seen[key] = (tokens + self.emitted, uses + 1)
        if arm != "plain" and arm not in self.warm:  # traces, first buffers: not what it costs
            self.warm.add(arm)
            return
        if ms > SPIKE * self._expected_ms(arm, nodes) and self.spikes.get(key, 0) < SPIKES_IN_A_ROW:
            self.spikes[key] = self.spikes.get(key, 0) + 1  # a new shape's trace and kernels, once
            return
        self.spikes[key] = 0
        self.rate(arm).add(self.emitted, ms)
        if arm == "primary" and self.blocks and self.costs is not None:
            extra = max(ms - float(self.verify_ms([nodes])[0]), 0.0)
            self.overhead = extra if self.overhead is None else self.overhead + ALPHA * (extra - self.overhead)
