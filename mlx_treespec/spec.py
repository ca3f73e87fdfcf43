"""One draft configuration: what drafts, and the shape of its tree.

`DraftSpec` is the one place where draft options are read, checked and defaulted. It comes from
keyword arguments (`from_options`: the library's and the CLI's options, the same names) or from
one arm string (`parse`: the sweep's and the benchmark's grammar), and builds the drafter
(`build`). `spec.arm` writes the arm string back (`DraftSpec.parse(s.arm) == s`).

Arm grammar:
    plain                  no drafter
    chain:K                the draft model's chain of K tokens
    tree:K:S[:B[:L]]       EAGLE-2 over the draft model: K children per expanded node, S steps,
                           B draft nodes (default: every candidate, at most 255), L lanes
                           expanded per step (default K; 1 = a chain with siblings as leaves)
    lookup:B:D / suffix:B:D  model-free drafters: B draft nodes, depth D
    dflash:K               a DFlash block drafter's chain of K tokens (K < its block size)
    ddtree:B               DDTree over a DFlash block drafter: B draft nodes (best-first)
    auto:KIND              adaptive drafting (adaptive.py) over KIND (model, dflash, mtp, eagle3,
                           lookup, suffix) and prompt lookup: each round's drafter and tree
                           picked, or no draft; what every drafter gets when no shape is given
    ... +lookupN[@T]       (after chain or tree) a prompt-lookup chain of N nodes under the same
                           root; with T, rounds whose lookup matched T tokens draft with it alone
    ... +vocabN            (after a head's arm, auto:mtp or auto:eagle3 included) the head drafts
                           over N token ids only: the first N of its folder's ranking, else ids
                           0..N-1 (drafters/mtp.py, HeadModule.narrowed)
"""
from dataclasses import dataclass, replace

from .tree import MAX_NODES, chain_parents, check_int, eagle2_candidates

__all__ = ["DraftSpec", "check_int", "DEFAULT_TREE", "SAMPLED_TREES", "DRAFTERS"]

# The draft model's shape when no shape option is given: a spine of 8 with each step's two
# runners-up as leaves (K=3, one lane, S=8): the fastest tree of the draft model alone on the
# H200 with the demo pair (bench/RESULTS.md).
DEFAULT_TREE = dict(topk=3, lanes=1, depth=8)
# Sampled, the default over a head (adaptive: `adaptive_over`) drafts shallower, wider trees
# the hotter the draw: (temp from which, shape), coolest first. At temp 0.7 the target's draw
# is missed about every third token, so a spine's steps past the fourth seldom pay for their
# head step, and more candidates a step catch more of the misses (bench/RESULTS.md, "A sampled
# default shape": K5 S4 beat 3 x 8 at temp 0.7 on unseen text in both demo pairs; on held-out
# text level in one call, ahead in the next); cooler, draws are missed less and the deeper
# tree wins. Hotter still, the fourth step seldom pays either (bench/RESULTS.md, "A third
# sampled shape": K6 S3 beat K5 S4 at temp 1.0 in both pairs and both sets). Each threshold is
# where the hotter shape comes level in both pairs: 0.55 between 0.5 (behind) and 0.6 (ahead),
# 0.8 the coolest temperature measured where both are level or ahead (exact CPU acceptance by
# temperature priced by the GPU's round costs).
SAMPLED_TREES = ((0.55, dict(topk=5, lanes=1, depth=4)), (0.8, dict(topk=6, lanes=1, depth=3)))
# The depth of any tree or chain whose depth is not given, and the budget of a model-free
# drafter's tree whose budget is not given.
DEFAULT_DEPTH = 8
DEFAULT_FREE_BUDGET = 16
MAX_TOPK = 16
MAX_TRUST = 4  # the lookup's longest n-gram
# a head's draft vocabulary (--draft-vocab): at least MAX_TOPK ids, so that a step's candidates
# are all in it (checked here, before loading); at most one id fewer than the target's
# vocabulary (HeadModule.narrowed checks both bounds, with this one)
MIN_DRAFT_VOCAB = MAX_TOPK
DRAFTERS = ("model", "lookup", "suffix", "dflash", "mtp", "eagle3", "none")
HEADS = ("mtp", "eagle3")  # one-layer heads over the target's hidden states: a draft model's shapes


def _opt(value, name, low, high):
    return None if value is None else check_int(value, name, low, high)


@dataclass(frozen=True)
class DraftSpec:
    """What drafts (`drafter`) and its tree: `topk` children per expanded node, `lanes` nodes
    expanded per step, `depth` steps, `budget` draft nodes (root excluded), plus `lookup` nodes
    of a prompt-lookup chain under the same root and its `trust` match length; `vocab`: a head
    drafts over that many token ids only (the first of its folder's ranking, else 0..vocab-1;
    0: all of them). A chain is `topk = 1`, `budget = depth`. Build instances with
    `from_options` or `parse`: they check and default every field.

    A DFlash drafter (`drafter='dflash'`) proposes every block position in one forward; its tree
    is DDTree's best-first tree over the per-position marginals with `topk` candidates per
    position (1: the argmax chain), at most `depth` deep, `budget` nodes; 0 for depth or budget
    means the drafter's own (its block size), resolved when it is built.

    `adaptive` (what `from_options` gives when no shape option is given): the drafter's default
    shape is one arm of an `AdaptiveDrafter` (adaptive.py), beside prompt lookup and no draft; a
    DFlash drafter's tree then takes each round's budget, up to its default, from its scores."""

    drafter: str = "none"
    topk: int = 1
    lanes: int = 1
    depth: int = 0
    budget: int = 0
    lookup: int = 0
    trust: int = 0
    vocab: int = 0
    adaptive: bool = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_options(cls, drafter=None, draft_block_size=None, tree_topk=None, tree_depth=None,
                     tree_budget=None, tree_lanes=None, draft_lookup=None, draft_lookup_trust=None,
                     draft_vocab=None, *, has_draft_model=True):
        """The library's and the CLI's draft options (None: not given). `drafter` defaults to
        'model' when a draft model is at hand, else 'none'."""
        if drafter is None:
            if draft_lookup and not has_draft_model:
                raise ValueError("--draft-lookup adds lookup nodes to a draft model's tree: give --draft-model")
            drafter = "model" if has_draft_model else "none"
        if drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
        block = _opt(draft_block_size, "--draft-block-size (a chain's depth)", 1, MAX_NODES - 1)
        topk = _opt(tree_topk, "--tree-topk", 1, MAX_TOPK)
        depth = _opt(tree_depth, "--tree-depth", 1, MAX_NODES - 1)
        budget = _opt(tree_budget, "--tree-budget", 1, MAX_NODES - 1)
        lanes = _opt(tree_lanes, "--tree-lanes", 1, MAX_TOPK)
        lookup = _opt(draft_lookup, "--draft-lookup", 0, MAX_NODES - 2) or 0
        trust = _opt(draft_lookup_trust, "--draft-lookup-trust", 1, MAX_TRUST) or 0
        vocab = 0 if draft_vocab is None else check_int(draft_vocab, "--draft-vocab (token ids a head drafts)",
                                                        MIN_DRAFT_VOCAB)
        if vocab and drafter not in HEADS:
            raise ValueError(f"--draft-vocab narrows a head's lm_head, and --drafter {drafter} is not a head: "
                             "drop --draft-vocab, or use --drafter mtp or eagle3")
        if trust and not lookup:
            raise ValueError("--draft-lookup-trust needs --draft-lookup N (the lookup it trusts)")
        if lookup and drafter not in ("model",) + HEADS:
            raise ValueError("--draft-lookup adds lookup nodes to a draft model's tree; --drafter "
                             f"{drafter} drafts without one: drop --draft-lookup or use --drafter model")
        if drafter == "none":
            if any(o is not None for o in (block, topk, depth, budget, lanes)):
                raise ValueError("the shape flags shape a drafter's tree, and nothing drafts here: give "
                                 "--draft-model or --drafter (lookup, suffix, dflash, ...), or drop them")
            return cls("none")
        if all(o is None for o in (block, topk, depth, budget, lanes)) and not lookup:
            return replace(cls.adaptive_over(drafter), vocab=vocab)
        if block is not None and (depth is not None or (topk or 1) > 1 or lanes is not None):
            raise ValueError("give either --draft-block-size (a chain) or --tree-topk/--tree-depth "
                             "(a tree), not both")
        if drafter in ("lookup", "suffix"):
            if topk is not None or lanes is not None:
                raise ValueError(f"--drafter {drafter} builds its own tree: give --tree-budget and "
                                 "--tree-depth, not --tree-topk or --tree-lanes")
            depth = block if block is not None else depth
            return cls(drafter, depth=depth or DEFAULT_DEPTH, budget=budget or DEFAULT_FREE_BUDGET)
        if drafter == "dflash":
            if topk is not None or lanes is not None or depth is not None:
                raise ValueError("--drafter dflash drafts a block: give --draft-block-size k (its "
                                 "chain) or --tree-budget N (a DDTree of N nodes), not --tree-topk, "
                                 "--tree-lanes or --tree-depth")
            if block is not None and budget is not None:
                raise ValueError("give either --draft-block-size (a DFlash chain) or --tree-budget "
                                 "(a DDTree), not both")
            if block is not None:
                return cls("dflash", topk=1, depth=block, budget=block)
            if budget == 1:  # (a DDTree of one node is the block's first argmax: a chain of 1)
                return cls("dflash", topk=1, depth=1, budget=1)
            return cls("dflash", topk=budget or 0, depth=0, budget=budget or 0)
        # the draft model, or a head
        if all(o is None for o in (block, topk, depth, budget, lanes)):
            topk, lanes, depth = DEFAULT_TREE["topk"], DEFAULT_TREE["lanes"], DEFAULT_TREE["depth"]
        topk = topk or 1
        depth = block if block is not None else (depth or DEFAULT_DEPTH)
        if topk == 1:
            if budget is not None and budget != depth:
                raise ValueError(f"--tree-budget {budget} counts a tree's nodes; a chain of {depth} "
                                 f"drafts {depth}: drop --tree-budget, or give --tree-topk K > 1 for a tree")
            if lanes not in (None, 1):
                raise ValueError(f"--tree-lanes must be in 1..--tree-topk (1), got {lanes}")
            return cls(drafter, topk=1, lanes=1, depth=depth, budget=depth, lookup=lookup, trust=trust,
                       vocab=vocab)
        lanes = topk if lanes is None else lanes
        if not 1 <= lanes <= topk:
            raise ValueError(f"--tree-lanes must be in 1..--tree-topk ({topk}), got {lanes}")
        candidates = eagle2_candidates(topk, lanes, depth)
        if budget is None:
            # one lane: every candidate (the fixed layout); more lanes: EAGLE-2's 4 per step
            # (with 4 lanes of 4 children that is the lanes' own nodes: `keeps_lanes_only`)
            budget = candidates if lanes == 1 else 4 * depth
        elif budget > candidates:
            raise ValueError(f"--tree-budget {budget}: a tree of --tree-topk {topk}, --tree-lanes {lanes} and "
                             f"--tree-depth {depth} has {candidates} nodes to choose from: give at most "
                             f"{candidates}, or a wider or deeper tree")
        budget = min(budget, candidates, MAX_NODES - 1)
        return cls(drafter, topk=topk, lanes=lanes, depth=depth, budget=budget, lookup=lookup, trust=trust,
                   vocab=vocab)

    @classmethod
    def adaptive_over(cls, drafter):
        """Adaptive drafting over `drafter`'s default shape (and prompt lookup)."""
        if drafter in ("lookup", "suffix"):
            fixed = cls.from_options(drafter, tree_budget=DEFAULT_FREE_BUDGET, tree_depth=DEFAULT_DEPTH)
        elif drafter == "dflash":  # the budget is picked per round, up to DDTree's default
            fixed = cls("dflash", topk=0, depth=0, budget=0)  # (0: the drafter's, resolved when built)
        else:
            fixed = cls.from_options(drafter, tree_topk=DEFAULT_TREE["topk"], tree_lanes=DEFAULT_TREE["lanes"],
                                     tree_depth=DEFAULT_TREE["depth"])
        return replace(fixed, adaptive=True)

    @classmethod
    def parse(cls, arm):
        """An arm string (module docstring) as a spec; ValueError naming the grammar if not."""
        if not isinstance(arm, str):
            raise ValueError(f"an arm is a string like 'chain:6' or 'tree:3:8:24:1', got {arm!r}")
        text = arm.strip().lower()
        base, *extras = text.split("+")
        lookup = trust = vocab = None
        for extra in extras:
            if extra.startswith("lookup") and lookup is None:
                n, _, t = extra[len("lookup"):].partition("@")
                lookup, trust = _arm_int(n, arm), (_arm_int(t, arm) if t else None)
                if lookup < 1:
                    raise ValueError(f"arm {arm!r}: +lookupN needs N in 1..{MAX_NODES - 2}")
            elif extra.startswith("vocab") and vocab is None:
                vocab = _arm_int(extra[len("vocab"):], arm)
            else:
                raise ValueError(f"cannot read arm {arm!r}: after '+' comes lookupN, lookupN@T or vocabN")
        has_lookup = lookup is not None
        parts = base.split(":")
        if parts[0] == "auto":
            if has_lookup:
                raise ValueError(f"arm {arm!r}: +lookup goes after a chain:K or tree:K:S[:B[:L]] arm, not auto:KIND")
            if len(parts) != 2 or parts[1] not in DRAFTERS or parts[1] == "none":
                raise ValueError(f"cannot read arm {arm!r}: auto:KIND takes one of "
                                 f"{', '.join(d for d in DRAFTERS if d != 'none')} (a head's: +vocabN)")
            return cls.from_options(parts[1], draft_vocab=vocab, has_draft_model=True)
        kind, args = parts[0], [_arm_int(p, arm) for p in parts[1:]]
        if kind.startswith("chain") and kind != "chain" and not args:  # 'chain6'
            kind, args = "chain", [_arm_int(kind[5:], arm)]
        drafter = "model"
        for head in HEADS:  # 'mtp-chain:4', 'eagle3-tree:3:4:12:1'
            if kind.startswith(head + "-"):
                drafter, kind = head, kind[len(head) + 1:]
                if kind not in ("chain", "tree"):
                    raise ValueError(f"cannot read arm {arm!r}: a head's arm is {head}-chain:K or "
                                     f"{head}-tree:K:S[:B[:L]] (its default: auto:{head})")
        if has_lookup and kind not in ("chain", "tree"):
            raise ValueError(f"arm {arm!r}: +lookup goes after a chain:K or tree:K:S[:B[:L]] arm")
        if vocab is not None and kind not in ("chain", "tree"):
            raise ValueError(f"arm {arm!r}: +vocabN goes after a head's arm (mtp-chain:K, eagle3-tree:..., auto:mtp)")
        if kind == "plain" and not args:
            return cls.from_options("none")
        if kind == "chain" and len(args) == 1:
            return cls.from_options(drafter, draft_block_size=args[0], draft_lookup=lookup,
                                    draft_lookup_trust=trust, draft_vocab=vocab)
        if kind == "tree" and 2 <= len(args) <= 4:
            K, S, B, L = (args + [None, None])[:4]
            return cls.from_options(drafter, tree_topk=K, tree_depth=S, tree_budget=B, tree_lanes=L,
                                    draft_lookup=lookup, draft_lookup_trust=trust, draft_vocab=vocab)
        if kind in ("lookup", "suffix") and len(args) == 2:
            return cls.from_options(kind, tree_budget=args[0], tree_depth=args[1])
        if kind in ("dflash", "ddtree") and not args:  # DDTree of the drafter's default budget
            return cls("dflash", topk=0, depth=0, budget=0)
        if kind == "dflash" and len(args) == 1:
            return cls.from_options("dflash", draft_block_size=args[0])
        if kind == "ddtree" and len(args) == 1:
            return cls.from_options("dflash", tree_budget=args[0])
        raise ValueError(f"cannot read arm {arm!r}: use plain, chain:K, tree:K:S[:B[:L]], lookup:B:D, "
                         "suffix:B:D, dflash[:K], ddtree[:B], mtp-chain:K, mtp-tree:K:S[:B[:L]], "
                         "eagle3-chain:K or eagle3-tree:K:S[:B[:L]] (a chain or tree may end in +lookupN[@T], "
                         "a head's in +vocabN)")

    # ------------------------------------------------------------------ what it is

    @property
    def is_chain(self):
        return self.topk == 1

    @property
    def needs_draft_model(self):
        return self.drafter in ("model", "dflash") + HEADS

    def check_draft_model(self, draft_model):
        """A draft model where the kind needs one."""
        if self.needs_draft_model and draft_model is None:
            raise ValueError(f"--drafter {self.drafter} needs --draft-model")

    @property
    def arm(self):
        """The arm string of this spec (`parse` reads it back)."""
        if self.drafter == "none":
            return "plain"
        vocab = f"+vocab{self.vocab}" if self.vocab else ""
        if self.adaptive:
            return f"auto:{self.drafter}" + vocab
        if self.drafter in ("lookup", "suffix"):
            return f"{self.drafter}:{self.budget}:{self.depth}"
        if self.drafter == "dflash":
            return f"dflash:{self.depth}" if self.topk == 1 else (f"ddtree:{self.budget}" if self.budget else "ddtree")
        # a model drafter or a head
        base = f"chain:{self.depth}" if self.is_chain else f"tree:{self.topk}:{self.depth}:{self.budget}:{self.lanes}"
        if self.drafter in HEADS:
            base = f"{self.drafter}-{base}"
        if self.lookup:
            base += f"+lookup{self.lookup}" + (f"@{self.trust}" if self.trust else "")
        return base + vocab

    @property
    def label(self):
        """A short human name: 'chain k=6', 'tree K=3 L=1 S=8 B=24 + lookup 8 trust 3' (L only
        where lanes differ from K)."""
        if self.drafter == "none":
            return "plain"
        vocab = f" over {self.vocab} ids" if self.vocab else ""
        if self.adaptive:
            return f"adaptive {self.drafter}" + vocab + (" + lookup" if self.drafter not in ("lookup", "suffix") else "")
        if self.drafter in ("lookup", "suffix"):
            return f"{self.drafter} B={self.budget} D={self.depth}"
        if self.drafter == "dflash":
            return f"dflash chain k={self.depth}" if self.topk == 1 else f"ddtree B={self.budget or 'default'}"
        lanes = "" if self.lanes == self.topk else f" L={self.lanes}"
        base = f"chain k={self.depth}" if self.is_chain else f"tree K={self.topk}{lanes} S={self.depth} B={self.budget}"
        if self.drafter in HEADS:
            base = f"{self.drafter} {base}"
        base += vocab
        if self.lookup:
            base += f" + lookup {self.lookup}" + (f" trust {self.trust}" if self.trust else "")
        return base

    @property
    def requested_nodes(self):
        """Nodes a round of this shape verifies at most (root included)."""
        return min(MAX_NODES, 1 + self.budget + self.lookup) if self.drafter != "none" else 1

    # ------------------------------------------------------------------ building

    def build(self, draft_model=None, target=None):
        """The drafter (None for 'none'). `draft_model`: an mlx-lm model ('model'), a DFlash
        drafter bound to its target ('dflash'; drafters.dflash.bind_dflash), a head bound to its
        target ('mtp', 'eagle3'; drafters.mtp.load_mtp, drafters.eagle3.load_eagle3). An
        adaptive spec prices its arms with `target`'s start-up costs (costmodel.startup_costs;
        without a target, from its first rounds), at the generation's context (costmodel.costs_at)."""
        if self.drafter == "none":
            return None
        self.check_draft_model(draft_model)
        if self.adaptive:
            from .adaptive import AdaptiveDrafter, ModelKey
            from .costmodel import costs_at, startup_costs
            from .drafters.lookup import LookupDrafter
            from .launch import in_launch

            if in_launch():
                # a sharded target (mlx.launch): every process must draft the same tree, and
                # choices by wall time would differ between them; the fixed shape drafts alike
                return replace(self, adaptive=False).build(draft_model)
            costs = (lambda: startup_costs(target)) if target is not None else None
            at = (lambda rows: costs_at(target, rows)) if target is not None else None
            # what one call learned, the next call over the same target, drafter and shape starts
            # from (the whole spec: two adaptive specs over different shapes learn apart)
            memory = ModelKey(self, target, draft_model) if target is not None else None
            # the host drafts half its depth, all of it where the text repeats (adaptive.py)
            if self.drafter in ("lookup", "suffix"):
                host = replace(self, adaptive=False, depth=min(2 * self.depth, MAX_NODES - 1)).build(draft_model)
                return AdaptiveDrafter(host=host, costs=costs, memory=memory, context_costs=at)
            return AdaptiveDrafter(primary=replace(self, adaptive=False).build(draft_model),
                                   host=LookupDrafter(DEFAULT_FREE_BUDGET, 2 * DEFAULT_DEPTH),
                                   costs=costs, memory=memory, context_costs=at, sampled_shapes=self.sampled_shapes)
        if self.drafter == "lookup":
            from .drafters.lookup import LookupDrafter

            return LookupDrafter(self.budget, self.depth)
        if self.drafter == "suffix":
            from .drafters.suffix import SuffixDrafter

            return SuffixDrafter(self.budget, self.depth)
        if self.drafter == "dflash":
            from .drafters.dflash import DFlashDrafter

            return DFlashDrafter(draft_model, topk=self.topk, depth=self.depth, budget=self.budget)
        if self.drafter in HEADS:
            from .drafters.head import HeadDrafter

            base = HeadDrafter(draft_model, topk=self.topk, depth=self.depth, budget=self.budget,
                               lanes=self.lanes, vocab=self.vocab)
        else:
            from .drafters.model import ModelDrafter

            base = ModelDrafter(draft_model, topk=self.topk, depth=self.depth, budget=self.budget,
                                lanes=self.lanes)
        if not self.lookup:
            return base
        from .drafters.lookup import LookupDrafter
        from .drafters.merged import MergedDrafter

        return MergedDrafter(base, LookupDrafter(budget=self.lookup, max_depth=self.lookup, branches=1),
                             trust=self.trust)

    @property
    def sampled_shapes(self):
        """((temp, (topk, lanes, depth, budget)), ...): the shapes a head's default drafts when
        sampling at each temp of SAMPLED_TREES or hotter, coolest first (None: this spec's own
        at every temperature: not adaptive, not a head, or a shape other than the default's)."""
        if not (self.adaptive and self.drafter in HEADS):
            return None
        default = DraftSpec.adaptive_over(self.drafter)
        if (self.topk, self.lanes, self.depth, self.budget) != (default.topk, default.lanes, default.depth, default.budget):
            return None
        shapes = []
        for temp, shape in SAMPLED_TREES:
            hot = DraftSpec.from_options(self.drafter, tree_topk=shape["topk"], tree_lanes=shape["lanes"],
                                         tree_depth=shape["depth"])
            shapes.append((temp, (hot.topk, hot.lanes, hot.depth, hot.budget)))
        return tuple(shapes)

    def probe_parents(self):
        """The largest layout a round of this spec sends (what the GPU exactness probe verifies),
        without building the drafter (adaptive: its model arm's)."""
        from .probe import with_root_chain

        if self.drafter == "none":
            return chain_parents(1)
        if self.drafter in ("lookup", "suffix"):
            from .drafters import host_probe_parents

            return host_probe_parents(None, self.budget, self.depth)
        if self.drafter == "dflash":
            from .drafters.dflash import probe_parents

            return probe_parents(self.topk, self.depth, self.budget)
        from .drafters.model import model_probe_parents

        return with_root_chain(model_probe_parents(self.topk, self.lanes, self.depth, self.budget), self.lookup)


def _arm_int(text, arm):
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"cannot read arm {arm!r}: {text!r} is not an integer") from None
