"""The benchmark harness: every figure in bench/RESULTS.md comes from one of its sections.

    python bench/run.py loop --target demo --arms plain,chain:7,tree:3:8,dflash:15,ddtree:31 \\
        --prompts unseen,heldout --n 20 --max-tokens 256 --seconds 400
    python bench/run.py acceptance --target demo --arms tree:3:8,ddtree:31 --prompts unseen --n 12
    python bench/run.py proj --acceptance FILE.json.gz --family dflash --config bench/configs/qwen3_8b.json \\
        --head-config bench/configs/qwen3_8b_dflash.json --q-bits 0,4
    python bench/run.py long --config bench/configs/qwen3_8b.json --contexts 1024,8192,32768 --q-bits 0,4
    python bench/run.py pieces --target demo --history 300 --repeats 30   # a DDTree round's pieces
    python bench/run.py round-host --target demo --arms eagle3-chain:10,eagle3-tree:4:10:40:1 --n 4   # queued rounds' host ms
    python bench/run.py draft-kernels --target demo --arms eagle3-chain:10,eagle3-chain:6   # kernels a head draft launches
    python bench/run.py comm --target demo-hybrid --arms plain,dflash:7,ddtree:12 --n 4   # sharded: collectives
    python bench/run.py bound --target demo --arms eagle3 --prompts unseen --n 8 --max-tokens 128 --depth 12
        # a head's best tree of N rank paths, with hindsight, against its chain of N (CPU, exact)
    python bench/run.py attn --rows 1,2,4,8,16,32,64 --widths 1024,4096   # fused vs composed attention
    python bench/run.py paths      # verify paths on this device (tiny models: latent attention, hybrid drafters)
    python bench/run.py unseen-prompts        # (re)writes bench/unseen_prompts.json.gz

Arms use mlx_treespec.spec's grammar (plain, chain:K, tree:K:S[:B[:L]], lookup:B:D,
suffix:B:D, dflash:K, ddtree:B, +lookupN[@T]) plus mlx-lm's own loops as baselines:
`mlx-plain` (generate_step) and `mlx-chain:K` (speculative_generate_step); an arm ending in /dI
drafts with the I-th folder its drafter's option names (--draft-model, --dflash, --mtp and --eagle3
take comma lists: two heads in one interleaved run), ARM/auto adaptive drafting over ARM's
shape (a draft model's or head's chain or tree: an earlier default's arm), /sync without queued rounds, auto:dflash/chains
queueing the primary's chains instead of its trees, auto:HEAD/handback (with --temp) handing
its queued rounds back where they lose, as greedy (the A/B arm of adaptive's holds_queue),
HEAD-chain:K/astree a head's chains queued as trees of no leaves, TREE/replay a spine-first tree's accepted paths re-run by the next round
as any tree's are, where the library commits them in place, ARM/separate every linear layer run
on its own, where the library joins those that read one input (mlx_treespec/join.py),
ARM/matmul a few rows' linear layers as matmuls, where the library runs them as products on CUDA
(join.few_rows), ARM/kernel the tree-attention kernel at every key width (attention.MIN_WIDTH 0:
a draft step's and a verify's masked attention), where the library runs it from MIN_WIDTH keys,
ARM/stepkernel so in forwards of up to join.FEW_ROWS query rows (a head's draft steps, where
the library's attention.STEP_ROWS is a chain step's one row), ARM/nostepkernel so in none (the
library's rule off),
TREE/ranked EAGLE-2's lanes re-ranked at every step, where the library ranks the first lane
step only, ARM/uncoupled (with --temp) a draft model's, head's or DFlash drafter's steps taking their logits'
argmax, where the library's guess the target's draw (sampling.Draw) (suffixes in that order:
ARM[/dI][/auto][/uncoupled][/sync], ARM[/chains][/handback], ARM[/astree], ARM[/replay], ARM[/ranked],
ARM[/separate, /matmul, /kernel, /stepkernel or /nostepkernel]). Speed figures are
ratios to `mlx-plain`, measured in the same run, arms interleaved per prompt (with --temp every
arm samples: mlx-plain by mlx-lm's sampler, the others' tokens checked against this library's
plain sampled decoding, `plain`). Each run writes
bench/results/<date>_<commit>_<section>.{md,json.gz} (commit, versions and device inside) unless
--out names another place.
"""
import argparse
import collections
import contextlib
import dataclasses
import functools
import gzip
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_treespec import RoundStats, tree_generate_step, verify  # noqa: E402
from mlx_treespec.cli import resolve_model_path  # noqa: E402
from mlx_treespec.harness import (encode_prompts, first_divergence, generate_once, interleave,  # noqa: E402
                                  load_prompts, ratio_interval, record, run_meta, spread)
from mlx_treespec.spec import HEADS, DraftSpec  # noqa: E402
from mlx_treespec.sampling import draw_of  # noqa: E402
from mlx_treespec.tree import MAX_NODES  # noqa: E402

# the drafter each demo target uses, by kind
DEMO_DRAFTERS = {"demo": {"model": "demo-drafter", "dflash": "demo-dflash", "eagle3": "demo-eagle3", "mtp": "demo"},
                 "demo-hybrid": {"model": "demo-hybrid-drafter", "dflash": "demo-hybrid-dflash", "mtp": "demo-hybrid"}}


def _commit(meta):
    """The commit a run names, marked where the files run were not that commit's."""
    return f"{meta['commit']}" + (", files differing from it" if meta.get("tree_differs_from_commit") else "")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Arms:
    """The arms of a run, each a function (prompt, max_tokens) -> (tokens, RoundStats, seconds)."""

    def __init__(self, target, target_name, texts, draft_name=None, dflash_name=None, head_names=None,
                 sampling=None):
        from mlx_lm.utils import load

        self.target, self.target_name = target, target_name
        self.sampling = sampling or {}  # temp > 0: every arm samples (mlx-plain with mlx-lm's sampler)
        self.texts = texts
        demo = DEMO_DRAFTERS.get(target_name, {})
        # each drafter option may name several folders, comma separated: an arm ending in /dI
        # drafts with the I-th (from 1) of its drafter's list (chain:4/d2, mtp-chain:10/d2)
        names = dict(model=draft_name, dflash=dflash_name, **(head_names or {}))
        self._names = {k: (names.get(k) or demo.get(k) or "").split(",") for k in ("model", "dflash", "mtp", "eagle3")}
        self._drafters = {}
        self._load = load

    def _folder(self, kind, which):
        """The which-th folder given for this drafter kind (the CLI option: --KIND or --draft-model)."""
        names = self._names[kind]
        if not names[0] or which > len(names):
            option = "--draft-model" if kind == "model" else f"--{kind}"
            raise SystemExit(f"a {kind} arm (/d{which}) needs {option} naming {which} folder(s)")
        return resolve_model_path(names[which - 1])

    def draft_model(self, which=1):
        if ("model", which) not in self._drafters:
            self._drafters["model", which] = self._load(self._folder("model", which))[0]
        return self._drafters["model", which]

    def dflash(self, which=1):
        if ("dflash", which) not in self._drafters:
            from mlx_treespec.drafters.dflash import bind_dflash

            self._drafters["dflash", which] = bind_dflash(self._folder("dflash", which), self.target)
        return self._drafters["dflash", which]

    def head(self, kind, which=1):
        if (kind, which) not in self._drafters:
            from mlx_treespec.drafters.eagle3 import load_eagle3
            from mlx_treespec.drafters.mtp import load_mtp

            load = load_mtp if kind == "mtp" else load_eagle3
            head = load(self._folder(kind, which), self.target)
            self._drafters[kind, which] = head
        return self._drafters[kind, which]

    def runner(self, arm):
        from mlx_lm.generate import generate_step, speculative_generate_step

        if arm == "mlx-plain":
            sampler = self._mlx_sampler()
            return lambda p, n: _timed(t for t, _ in generate_step(mx.array(p), self.target, max_tokens=n,
                                                                   sampler=sampler))
        if arm.startswith("mlx-chain:"):
            k = int(arm.split(":")[1])
            return lambda p, n: _timed(t for t, _, _ in speculative_generate_step(
                mx.array(p), self.target, self.draft_model(), num_draft_tokens=k, max_tokens=n,
                sampler=self._mlx_sampler()))
        make = self.maker(arm)
        return lambda p, n: run_once(self.target, make(), p, n, **self.sampling)

    def _mlx_sampler(self):
        """mlx-lm's own sampler at --temp (None: greedy), for its loops' arms."""
        if not self.sampling:
            return None
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(self.sampling["temp"])

    def maker(self, arm):
        """A function making the arm's drafter: a fresh one per prompt, as each library call
        makes one (an adaptive one starts from the target's start-up costs, measured at the
        warm-up and then read from disk)."""
        mode = next((m for m in ("separate", "matmul", "kernel", "stepkernel", "nostepkernel")
                     if arm.endswith("/" + m)), None)
        arm = arm if mode is None else arm[: -len(mode) - 1]
        arm_in = arm
        arm, ranked = (arm[: -len("/ranked")], True) if arm.endswith("/ranked") else (arm, False)
        arm, replay = (arm[: -len("/replay")], True) if arm.endswith("/replay") else (arm, False)
        arm, as_tree = (arm[: -len("/astree")], True) if arm.endswith("/astree") else (arm, False)
        arm, handback = (arm[: -len("/handback")], True) if arm.endswith("/handback") else (arm, False)
        arm, chains = (arm[: -len("/chains")], True) if arm.endswith("/chains") else (arm, False)
        arm, unqueued = (arm[: -len("/sync")], True) if arm.endswith("/sync") else (arm, False)
        arm, uncoupled = (arm[: -len("/uncoupled")], True) if arm.endswith("/uncoupled") else (arm, False)
        arm, auto = (arm[: -len("/auto")], True) if arm.endswith("/auto") else (arm, False)
        arm, which = arm.rsplit("/d", 1) if "/d" in arm and arm.rsplit("/d", 1)[1].isdigit() else (arm, 1)
        spec, which = DraftSpec.parse(arm), int(which)
        if auto:  # "ARM/auto": adaptive drafting over this shape (an earlier default's A/B arm)
            if spec.drafter not in ("model",) + HEADS:
                raise ValueError("ARM/auto takes a draft model's or head's chain or tree arm")
            spec = dataclasses.replace(spec, adaptive=True)
        source = {"model": lambda: self.draft_model(which), "dflash": lambda: self.dflash(which),
                  "mtp": lambda: self.head("mtp", which),
                  "eagle3": lambda: self.head("eagle3", which)}.get(spec.drafter)
        make = (lambda: spec.build(source(), target=self.target)) if source else \
            (lambda: spec.build(None, target=self.target))
        if uncoupled:  # "ARM/uncoupled": at temp > 0 its steps take their logits' argmax (the A/B arm
            # of sampling.Draw; each wrapper binds the maker it wraps: a shared name would
            # call itself once a second suffix rebinds it)
            make = lambda inner=make: argmax_drafting(inner())  # noqa: E731
        if mode is not None:  # "ARM/separate": every linear layer on its own, "ARM/matmul": a few
            # rows' as matmuls (join.py's A/B arms), "ARM/kernel": the tree-attention kernel at
            # every key width (attention.MIN_WIDTH's), "ARM/stepkernel": so in every draft step,
            # "ARM/nostepkernel": in none (attention.STEP_ROWS')
            inner = self.maker(arm_in)
            return lambda: Separate(inner(), self.target, mode)
        if ranked:  # "TREE/ranked": EAGLE-2's lanes re-ranked at every step (ranked_lane_steps' A/B arm)
            return lambda: every_step_ranked(make())
        if handback and (unqueued or replay or ranked):
            raise ValueError("ARM/handback judges queued rounds: it takes no /sync, /replay or /ranked")
        if as_tree and (unqueued or chains):
            raise ValueError("ARM/astree queues a head's chains as trees: it takes no /sync or /chains")
        if unqueued:  # "ARM/sync": the same drafter through the round loop (one host sync a round)
            return lambda: Unqueued(make())
        if as_tree:  # "HEAD-chain:K/astree": its chains queued as one-lane trees of no leaves
            make = lambda inner=make: ChainAsTree(inner())  # noqa: E731
        if replay:  # "TREE/replay": a spine-first tree's paths re-run as any tree's are
            return lambda: Replayed(make())
        if chains:  # "auto:KIND/chains": the adaptive drafter queueing its primary's chains
            make = lambda inner=make: ChainsQueued.of(inner())  # noqa: E731
        if handback:  # "auto:HEAD/handback": sampled queued rounds handed back where they lose
            make = lambda inner=make: HandBack.of(inner())  # noqa: E731
        return make


def argmax_drafting(drafter):
    """A model, head or DFlash drafter (or an adaptive one over it) that drafts its logits' argmax at
    temp > 0 too, where the library's guesses the target's draw (sampling.Draw): the A/B arm
    ARM/uncoupled. (An adaptive one over a head then also queues the head's chain of its greedy
    shape and hands its queued rounds back, as it does greedy: compare it with
    ARM/chains/handback.)"""
    if not hasattr(drafter, "draw"):
        raise ValueError("ARM/uncoupled takes a draft model's, head's or DFlash arm (a drafter that guesses draws)")
    drafter.__class__ = type("Uncoupled" + type(drafter).__name__, (type(drafter),),
                             {"draw": property(lambda self: None, lambda self, draw: None)})
    return own_record(drafter, "uncoupled") if hasattr(drafter, "queue_more") else drafter


class Wraps:
    """A bench wrapper over `self.drafter`: the loop's sampling.Draw goes to the drafter it wraps
    (a wrapper reads through `__getattr__`, but an assignment would land on the wrapper)."""

    draw = draw_of("drafter")


def every_step_ranked(drafter):
    """A lane-tree drafter (model or head, lanes >= 2) whose lanes are re-ranked at every step, as
    EAGLE-2 ranks them, where the library ranks the first lane step only (`ranked_lane_steps`)."""
    if not (hasattr(drafter, "ranked_lane_steps") and drafter.topk > 1 and drafter.lanes > 1):
        raise ValueError("ARM/ranked takes a tree arm of two or more lanes (tree:K:S:B:L, mtp-tree, eagle3-tree)")
    drafter.ranked_lane_steps = drafter.depth
    return drafter


class Separate(Wraps):
    """A drafter whose generations run every linear layer on its own, the target's and the
    drafter's (mlx_treespec/join.py joins those that read one input): the A/B arm
    (ARM/separate; `run_once` runs it inside `separate`). The joined layers get their own
    classes back for the generation, and the target and a DFlash drafter compiled forwards of
    their own, traced without the joined matmuls. `mode` "matmul" (ARM/matmul) keeps the
    joined layers and runs a few rows as matmuls instead (`join.few_rows` off), in compiled
    forwards of its own; `mode` "kernel" (ARM/kernel) runs every masked attention the
    tree-attention kernel takes at any key width (`attention.MIN_WIDTH` 0; a CUDA GPU's only:
    elsewhere the kernel is not usable and nothing changes), in compiled forwards of its own;
    `mode` "stepkernel" (ARM/stepkernel) so in a queued head draft's forwards of up to
    `join.FEW_ROWS` query rows (`attention.STEP_ROWS` at FEW_ROWS, where the library's is a
    chain step's one row: its steps, and its slots where depth + 1 <= FEW_ROWS), the target's
    at the library's width bound;
    "nostepkernel" (ARM/nostepkernel) in no draft step below that bound (STEP_ROWS 0: the
    library's rule off)."""

    def __init__(self, drafter, target, mode="separate"):
        self.drafter, self.target, self.mode = drafter, target, mode

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    @contextlib.contextmanager
    def separate(self):
        import mlx_treespec.join as joining
        from mlx_treespec import attention
        from mlx_treespec.join import RowsLinear, join

        # (an adaptive or merged drafter's model drafter: its primary or base)
        inner = getattr(self.drafter, "primary", None) or getattr(self.drafter, "base", None) or self.drafter
        bound = getattr(inner, "bound", None)  # (a DFlash drafter)
        models = [self.target, getattr(inner, "model", None), getattr(bound, "model", None)]
        models = [m for m in models if m is not None]
        parts = [(p, type(p)) for m in models for g in join(m) for p in g.parts] if self.mode == "separate" else []
        own = (self.mode, "_treespec")  # (each mode's traces kept apart)
        # the compiled verify, and a head's compiled drafts (kept on the head, shared by its
        # drafters), traced apart: the joined arm's would run the joined matmuls
        stores = [(m, k) for m, k in ((self.target, "_treespec_compiled_verify"),
                                      (getattr(inner, "model", None), "_treespec_drafts")) if m is not None]
        joined = [m.__dict__.pop(k, None) for m, k in stores]
        for m, k in stores:
            if own + (k,) in m.__dict__:
                m.__dict__[k] = m.__dict__[own + (k,)]
        if bound is not None:  # (its block forward, traced at its first call: in here)
            forward = inner._forward
            inner._forward = bound.model.__dict__.get(own + ("forward",)) or inner._compile()
        for p, cls in parts:  # (a float layer as one in no group: a few rows still as products)
            p.__class__ = RowsLinear if cls.__mro__[1] is nn.Linear else cls.__mro__[1]
        products, min_width, step_rows = joining._products_here, attention.MIN_WIDTH, attention.STEP_ROWS
        if self.mode == "matmul":
            joining._products_here = lambda x, weight: False
        if self.mode == "kernel":
            attention.MIN_WIDTH = 0
        if self.mode in ("stepkernel", "nostepkernel"):
            attention.STEP_ROWS = joining.FEW_ROWS if self.mode == "stepkernel" else 0
        try:
            yield
        finally:
            joining._products_here, attention.MIN_WIDTH, attention.STEP_ROWS = products, min_width, step_rows
            for p, cls in parts:
                p.__class__ = cls
            for (m, k), store in zip(stores, joined):
                m.__dict__[own + (k,)] = m.__dict__.pop(k, None)
                if store is not None:
                    m.__dict__[k] = store
            if bound is not None:
                bound.model.__dict__[own + ("forward",)] = inner._forward
                inner._forward = forward


def run_once(target, drafter, prompt, max_tokens, **sampling):
    """`generate_once`, inside the drafter's `separate` where it has one (ARM/separate)."""
    separate = getattr(drafter, "separate", None)
    with separate() if separate is not None else contextlib.nullcontext():
        return generate_once(target, drafter, prompt, max_tokens, **sampling)


class Unqueued(Wraps):
    """A drafter whose chains are not queued ahead (mlx_treespec/queued.py): the A/B arm."""

    ahead = None
    queues_trees = False

    def __init__(self, drafter):
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)


class ChainAsTree(Wraps):
    """A head's queued chains drafted as trees (Draft, a chain's parents): the A/B arm that
    prices a queued tree round's own work (its re-run row, the tree mask, the device walk, the
    path's gathers) apart from its leaves."""

    queues_trees = True

    def __init__(self, drafter):
        if getattr(drafter, "topk", None) != 1 or not hasattr(drafter, "chain_ahead"):
            raise ValueError("ARM/astree takes a head's chain arm (mtp-chain:K, eagle3-chain:K)")
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def ahead(self, root, rows, count, path=None):
        from mlx_treespec.draft import Draft, Layout
        from mlx_treespec.tree import chain_parents

        d = self.drafter.depth
        tokens = mx.concatenate([root.reshape(1).astype(mx.uint32), self.drafter.chain_ahead(root, rows, count, path)])
        return Draft(tokens, Layout.fixed(chain_parents(d + 1)), budget=d, depth=d, forwards=d)


class Replayed(Wraps):
    """A queued tree drafter whose spine-first trees are committed as any tree is (the next round
    re-runs the whole accepted path, `queued._replay_layout`), where the library commits them in
    place: the A/B arm that prices the re-run path apart from a second lane's draft."""

    queues_trees = True

    def __init__(self, drafter):
        if getattr(drafter, "ahead", None) is None or not getattr(drafter, "queues_trees", False):
            raise ValueError("ARM/replay takes an arm whose trees are queued (eagle3-tree, mtp-tree, HEAD-chain:K/astree)")
        self.drafter = drafter

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def ahead(self, root, rows, count, path=None):
        from mlx_treespec.draft import Layout

        d = self.drafter.ahead(root, rows, count) if path is None else self.drafter.ahead(root, rows, count, path)
        return dataclasses.replace(d, layout=Layout.on_device(*d.layout.device))  # (no host parents: any shape)


class ChainsQueued:
    """An adaptive drafter whose queued rounds are its primary's chains where they could be its
    trees (the default before `f4d7a27`: its chain of 8 at every temperature, no sampled shape):
    the A/B arm of the queued draft's shape."""

    @staticmethod
    def of(drafter):
        if not getattr(getattr(drafter, "primary", None), "queues_trees", False) or not hasattr(drafter, "queue_more"):
            raise ValueError("ARM/chains takes an adaptive arm over a tree-drafting primary (auto:dflash; "
                             "auto:eagle3 or auto:mtp, which queue their trees at --temp above 0 only)")
        drafter.__class__ = type("ChainsQueued" + type(drafter).__name__, (type(drafter),), {"queues_trees": False})
        drafter.shapes = None
        return own_record(drafter, "chains")


class HandBack:
    """An adaptive drafter whose sampled queued rounds are handed back where they lose, as
    greedy ones are (the rule before adaptive's `holds_queue`): the A/B arm."""

    @staticmethod
    def of(drafter):
        if not getattr(drafter, "over_head", False):
            raise ValueError("ARM/handback takes an adaptive arm over a head (auto:mtp, auto:eagle3)")
        drafter.__class__ = type("HandBack" + type(drafter).__name__, (type(drafter),),
                                 {"holds_queue": property(lambda self: False)})
        return own_record(drafter, "handback")


def own_record(drafter, tag):
    """An adaptive A/B arm's drafter learning apart from the arm it varies (its rates:
    adaptive.Learned under a memory key of its own)."""
    from mlx_treespec.adaptive import LEARNED

    drafter.memory = (tag, drafter.memory)
    if drafter.memory in LEARNED:
        drafter.learned = LEARNED[drafter.memory]
        drafter._restart()
    else:
        drafter.reset()
    return drafter


def _timed(gen):
    out, t_first = [], None
    for t in gen:
        out.append(int(t))
        if t_first is None:
            t_first = time.perf_counter()
    return out, RoundStats(), time.perf_counter() - t_first


def load_target(name):
    from mlx_lm.utils import load

    model, tok = load(resolve_model_path(name))
    return model, tok


def run_loop(args):
    """Every arm on every prompt of each set, interleaved; tok/s against mlx-lm's plain loop."""
    names = ["mlx-plain"] + [a for a in args.arms.split(",") if a and a != "mlx-plain"]
    sampling = _sampling(args)
    if sampling and "plain" not in names:  # (the tokens every arm must equal: plain sampled decoding's)
        names.insert(1, "plain")
    if args.versus is not None and args.versus not in names:
        sys.exit(f"--versus {args.versus} is not one of --arms: pass one of {','.join(names)}")
    target, tok = load_target(args.target)
    report = dict(meta=run_meta(section=args.section, target=args.target, arms=names,
                                max_tokens=args.max_tokens, temp=args.temp, seed=args.seed), sets={})
    md = [f"# {args.section}: {args.target} on {report['meta']['device']} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", ""]
    budget = args.seconds / max(len(args.prompts.split(",")), 1) if args.seconds else None
    warmed = set()
    for pset in args.prompts.split(","):
        texts = load_prompts(pset)[: args.n]
        prompts = encode_prompts(tok, texts)
        arms = Arms(target, args.target, texts, args.draft_model, args.dflash, dict(mtp=args.mtp, eagle3=args.eagle3),
                    sampling)
        runners = {a: arms.runner(a) for a in names}
        outputs = {a: [] for a in names}

        def warmup(a):
            # each verify shape meets the verify's timed checks (verify.CHECKS: a sync and an
            # eager forward each) before it runs compiled: past the warm-up, the shapes a
            # generation verifies once (a spine-first tree's first round) and those of every
            # buffer width a whole generation reaches included. On CPU no verify is compiled
            # (whole-buffer forwards are a GPU's path): one generation of the run pays the traces
            if mx.default_device() != mx.gpu and a in warmed:
                return
            warmed.add(a)
            for _ in range(verify.CHECKS if mx.default_device() == mx.gpu else 1):
                runners[a](prompts[0], args.max_tokens)

        def run(a, i, order):
            p = i % len(prompts)  # --reps: every prompt again, after all of them
            before = verify_counts(target)
            out, stats, dt = runners[a](prompts[p], args.max_tokens)
            outputs[a].append(out)
            rec = record(p, order, prompts[p], out, stats, dt)
            rec["rep"] = i // len(prompts)
            rec["emitted_total"], rec["rounds_total"] = sum(stats.emitted), stats.rounds
            rec["compiled_total"], rec["verifies_total"] = np.subtract(verify_counts(target), before).tolist()
            log(f"{pset} prompt {p} {a}: {rec['tok_s']:.1f} tok/s, {rec['emitted_per_verify']:.2f} emitted/verify")
            return rec

        log(f"{pset}: {len(prompts)} prompts x {args.max_tokens} tokens x {args.reps}, {len(names)} arms")
        runs = interleave(names, prompts * args.reps, run, warmup=warmup, max_seconds=budget, log=log,
                          progress=(lambda m: log(m)) if args.verbose else None)
        rows = summarize_arms(names, runs, outputs, reference="plain" if sampling else "mlx-plain")
        ran = len({r["prompt"] for r in runs["mlx-plain"]})
        eager = eager_shapes(target)
        log(f"{pset}: verify shapes run eagerly after their checks (rows, key width): {eager or 'none'}")
        report["sets"][pset] = dict(prompts=ran, runs=len(runs["mlx-plain"]), arms=rows, eager_shapes=eager)
        md += set_table(pset, ran, args.max_tokens, len(runs["mlx-plain"]), rows, args.versus, args.temp)
        write(args, report, md)  # after each set: a run cut short keeps what it measured


def _sampling(args):
    """The generations' sampling options (--temp, --seed; none at temp 0: greedy)."""
    return dict(temp=args.temp, seed=args.seed) if args.temp > 0 else {}


def verify_counts(target):
    """(verifies run compiled, verifies that asked for the compiled path) so far: the rounds
    queued past the last one read included, which the round counts leave out. Summed over the
    library's store and each A/B arm's own (`Separate` keeps an arm's traces under (mode,
    "_treespec", "_treespec_compiled_verify") between its generations): one arm runs at a time,
    so a generation's difference is its own verifies (an A/B arm's read as none before)."""
    key = "_treespec_compiled_verify"
    stores = [v for k, v in target.__dict__.items() if v and (k == key or isinstance(k, tuple) and k[-1] == key)]
    return sum(s.get("trusted_runs", 0) for s in stores), sum(s.get("calls", 0) for s in stores)


def eager_shapes(target):
    """The verify shapes the timed checks sent down the eager path: rows, key width, capture,
    kernel, recurrent layers and inputs (verify.compiled_forward's shape without its dtypes),
    and the checks the eager forward won."""
    store = target.__dict__.get("_treespec_compiled_verify") or {}
    return sorted([shape[0], shape[4], str(shape[8]), shape[9], sorted(shape[10]), shape[11],
                   store["eager_wins"].get(shape)] for shape, eager in store.get("eager", {}).items() if eager)


def pooled_tok_s(rs):
    """Tokens per second per prompt over all of its runs (--reps): tokens after the first over
    the decode seconds, summed."""
    tokens, seconds = {}, {}
    for r in rs:
        tokens[r["prompt"]] = tokens.get(r["prompt"], 0) + r["tokens"] - 1
        seconds[r["prompt"]] = seconds.get(r["prompt"], 0.0) + r["decode_s"]
    return {p: tokens[p] / seconds[p] for p in tokens if seconds[p] > 0}


def summarize_arms(names, runs, outputs, reference="mlx-plain"):
    """Per arm: x plain is per prompt (each prompt's runs pooled, as `pooled_tok_s`), over
    mlx-lm's plain decoding of the same prompt; its spread is over the prompts. Identity is
    against `reference`'s tokens (sampled: this library's plain sampled decoding, whose draws
    are keyed by position; mlx-lm's sampler draws others)."""
    base = pooled_tok_s(runs["mlx-plain"])
    ref = {r["prompt"]: o for r, o in zip(runs[reference], outputs[reference])}
    rows = []
    for a in names:
        rs = runs[a]
        pooled = pooled_tok_s(rs)
        ratio = [pooled[p] / base[p] for p in sorted(pooled) if base.get(p)]
        emitted = sum(r.get("emitted_total", 0) for r in rs)
        rounds = sum(r.get("rounds_total", 0) for r in rs)
        compiled = sum(r.get("compiled_total", 0) for r in rs)
        verifies = sum(r.get("verifies_total", 0) for r in rs)
        same = sum(o == ref[r["prompt"]] for r, o in zip(rs, outputs[a]))
        div = [first_divergence(o, ref[r["prompt"]]) for r, o in zip(rs, outputs[a])]
        rows.append(dict(arm=a, tok_s=spread(list(pooled.values())), x_plain=spread(ratio),
                         emitted_per_verify=spread([r["emitted_per_verify"] for r in rs if r["rounds"]]),
                         pooled_emitted_per_verify=(emitted / rounds) if rounds else None,
                         compiled_verifies=(compiled / verifies) if verifies else None,
                         round_ms=spread([r["round_ms"] for r in rs if r["rounds"]]),
                         nodes=spread([r["nodes_per_round"] for r in rs if r["rounds"]]),
                         draft_forwards=spread([r["draft_forwards_per_round"] for r in rs if r["rounds"]]),
                         identical=f"{same}/{len(rs)}", first_divergence=div, used=_pooled_use(rs),
                         runs=[{k: v for k, v in r.items() if k != "acceptance_by_depth"} for r in rs]))
    return rows


def _pooled_use(rs):
    """Rounds per drafter over a run's prompts (adaptive arms; 'plain' counts tokens decoded
    without a draft)."""
    out = {}
    for r in rs:
        for k, v in (r.get("rounds_by_drafter") or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def _f(s, fmt="{:.2f}", spread_=True):
    if s is None:
        return "-"
    if isinstance(s, dict):
        return fmt.format(s["median"]) + (f" ({fmt.format(s['min'])}-{fmt.format(s['max'])})" if spread_ else "")
    return fmt.format(s)


def x_versus(rows, versus):
    """Each arm's tok/s over `versus`'s on the same prompt (each prompt's runs pooled, as
    `pooled_tok_s`), spread over the prompts: arms against each other without the noise of a
    third arm's timings in between."""
    base = pooled_tok_s(next(r for r in rows if r["arm"] == versus)["runs"])
    out = {}
    for r in rows:
        ratios = [v / base[p] for p, v in sorted(pooled_tok_s(r["runs"]).items()) if base.get(p)]
        s = spread(ratios)
        out[r["arm"]] = None if s is None else dict(s, interval=ratio_interval(ratios))
    return out


def _ci(s):
    """A `ratio_interval` cell: geometric mean [lo-hi]."""
    i = (s or {}).get("interval")
    return "-" if i is None else f"{i['geomean']:.3f} [{i['lo']:.3f}-{i['hi']:.3f}]"


def table(rows, versus=None):
    against = x_versus(rows, versus) if versus else {}
    extra = f" x {versus} (median, min-max) | x {versus} (geomean [90% CI]) |" if versus else ""
    lines = ["| arm | x plain (median, min-max) |" + extra + " tok/s | emitted/verify (pooled) | nodes/round | "
             "draft forwards/round | round ms | verifies compiled | identical to plain | rounds by drafter |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if versus else "")]
    for r in rows:
        used = ", ".join(f"{k} {v}" for k, v in sorted((r.get("used") or {}).items())) or "-"
        cell = f" {_f(against[r['arm']])} | {_ci(against[r['arm']])} |" if versus else ""
        lines.append(f"| {r['arm']} | {_f(r['x_plain'])} |{cell} {_f(r['tok_s'], '{:.1f}')} | "
                     f"{_f(r['pooled_emitted_per_verify'])} | {_f(r['nodes'], spread_=False)} | "
                     f"{_f(r['draft_forwards'], spread_=False)} | {_f(r['round_ms'], spread_=False)} | "
                     f"{_f(r.get('compiled_verifies'))} | {r['identical']} | {used} |")
    return "\n".join(lines)


def set_table(pset, prompts, max_tokens, runs, rows, versus=None, temp=0.0):
    """A loop set's markdown: its heading, how to read it, its table."""
    return [f"## {pset} prompts ({prompts} x {max_tokens} tokens, {runs} runs an arm, temp {temp:g})", "",
            "x plain" + (f", x {versus}" if versus else "") + " and tok/s: per prompt, its runs pooled; "
            "per-round columns: medians over runs; identical: runs.", "", table(rows, versus), ""]


def run_table(args):
    """A loop's or acceptance run's JSON (--from) as its markdown again, with --versus's column
    where given (a loop's)."""
    if args.source is None:
        sys.exit("table needs --from FILE: a loop's or acceptance run's .json or .json.gz")
    report = read_json(args.source)
    md = [f"# {report['meta']['section']} (from {Path(args.source).name})", ""]
    for pset, s in report["sets"].items():
        if "runs" not in s:  # an acceptance run's set
            if args.versus is not None:
                sys.exit(f"--versus: {args.source} is an acceptance run's (emitted per verify): drop --versus")
            md += acceptance_set_table(pset, s["prompts"], report["meta"]["max_tokens"], s["arms"],
                                       report["meta"].get("temp", 0.0)) + [""]
            continue
        names = [r["arm"] for r in s["arms"]]
        if args.versus is not None and args.versus not in names:
            sys.exit(f"--versus {args.versus} is not an arm of {args.source}: pass one of {','.join(names)}")
        md += set_table(pset, s["prompts"], report["meta"]["max_tokens"], s["runs"], s["arms"], args.versus,
                        report["meta"].get("temp", 0.0))
    print("\n".join(md))


def acceptance_set_table(pset, prompts, max_tokens, rows, temp=0.0):
    """An acceptance set's markdown: its heading and table."""
    return [f"## {pset} prompts ({prompts} x {max_tokens} tokens, temp {temp:g}, pooled)", "",
            "| arm | emitted/verify | rounds | identical to plain |", "|---|---|---|---|"] + \
        [f"| {r['arm']} | {r['emitted_per_verify']:.3f} | {r['rounds']} | {r['identical']} |" for r in rows]


def run_acceptance(args):
    """Emitted tokens per verify, pooled over prompts (on CPU a verify is bitwise one-token
    decoding, so this is the target's own acceptance); every arm's tokens checked against plain."""
    target, tok = load_target(args.target)
    names = ["plain"] + [a for a in args.arms.split(",") if a and a != "plain"]
    report = dict(meta=run_meta(section=args.section, target=args.target, arms=names,
                                max_tokens=args.max_tokens, temp=args.temp, seed=args.seed), sets={})
    md = [f"# {args.section}: {args.target} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", ""]
    for pset in args.prompts.split(","):
        texts = load_prompts(pset)[: args.n]
        prompts = encode_prompts(tok, texts)
        arms = Arms(target, args.target, texts, args.draft_model, args.dflash, dict(mtp=args.mtp, eagle3=args.eagle3),
                    _sampling(args))
        rows = []
        ref = None
        for a in names:
            run = arms.runner(a)
            outs, emitted, rounds, by_depth = [], 0, 0, []
            for p in prompts:
                out, stats, _ = run(p, args.max_tokens)
                outs.append(out)
                emitted += sum(stats.emitted)
                rounds += stats.rounds
                by_depth.append(stats.acceptance_by_depth())
            ref = outs if a == "plain" else ref
            same = sum(o == r for o, r in zip(outs, ref))
            rows.append(dict(arm=a, emitted_per_verify=emitted / max(rounds, 1), rounds=rounds,
                             tokens=emitted, identical=f"{same}/{len(outs)}"))
            log(f"{pset} {a}: {emitted / max(rounds, 1):.3f} emitted/verify, {same}/{len(outs)} identical")
            report["sets"][pset] = dict(prompts=len(prompts), arms=rows, partial=a != names[-1])
            write(args, report, md + [f"(partial: {pset}, {len(rows)} of {len(names)} arms)"], echo=False)
        chainlike = {r["arm"]: r["emitted_per_verify"] for r in rows}
        report["sets"][pset] = dict(prompts=len(prompts), arms=rows)
        md += acceptance_set_table(pset, len(prompts), args.max_tokens, rows, args.temp)
        if args.ratio:
            a, b = args.ratio.split("/")
            md.append(f"\n{a} / {b} = {chainlike[a] / chainlike[b]:.3f}")
        md.append("")
    write(args, report, md)


# ---------------------------------------------------------------------------- bound: a head's ranks

MAX_RANK = 8  # a rank path's ranks are 0..MAX_RANK - 1: past that, a head's candidate is seldom the target's


def head_ranks(target, head, prompt, max_tokens, depth, cap=MAX_RANK):
    """Per position of the target's greedy continuation of `prompt` (a round may start at any):
    the rank of the target's next token at each of `depth` head steps drafted along the target's
    own tokens (each step over its parent's output hidden, as a chain that matched so far),
    capped at `cap`."""
    from mlx_lm.generate import generate_step
    from mlx_treespec.verify import capturing

    s = list(prompt) + [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=max_tokens)]
    with capturing(target, head.capture) as captured:
        target(mx.array(s)[None])
        rows = captured.hidden()
    mtp = getattr(head, "target_hidden", None)
    rows = mtp(rows) if mtp is not None else rows
    flag = (lambda first: {}) if mtp is not None else (lambda first: dict(first=first))
    cache = head.make_cache()
    logits = head(mx.array(s[1:])[None], cache=cache, hidden=rows[:-1][None], **flag(True))[0]
    hidden, K, V = head.out_hidden[0], cache[0].keys, cache[0].values  # slot t predicts s[t + 2]
    out = []
    for t in range(max(len(prompt) - 2, 0), len(s) - depth - 1):  # (depth `depth` reads s[t + 1 + depth])
        c = head.make_cache()[0]
        c.keys, c.values, c.offset = K[:, :, : t + 1], V[:, :, : t + 1], t + 1
        lg, h, ranks = logits[t], hidden[t : t + 1], []
        for d in range(1, depth + 1):
            true = s[t + 1 + d]
            ranks.append(min(int(mx.sum(lg > lg[true]).item()), cap))
            if d < depth:
                lg = head(mx.array([[true]]), cache=[c], hidden=h[None], **flag(False))[0, 0]
                h = head.out_hidden[0]
        out.append(tuple(ranks))
    return out

def rank_rounds(per_prompt, tree):
    """Rounds as the loop runs them over each prompt's rank sequences (`head_ranks`), drafting the
    tree (a set of rank paths: the chain is {(0,), (0, 0), ...}): each round accepts its longest
    path in the tree and the next starts after the tokens it emitted. -> (emitted per verify,
    the rank sequences the rounds started at)."""
    emitted, starts = 0, []
    for seqs in per_prompt:
        t = 0
        while t < len(seqs):
            r, a = seqs[t], 0
            while a < len(r) and r[: a + 1] in tree:
                a += 1
            starts.append(r)
            emitted += a + 1
            t += a + 1
    return emitted / max(len(starts), 1), starts

def best_rank_tree(starts, n, cap=MAX_RANK):
    """The n rank paths most often accepted at these round starts, a parent before its
    children, in the order taken (a child is never accepted more often than its parent; ties go
    to the shallower, then lower ranks)."""
    count = collections.Counter(r[:d] for r in starts for d in range(1, len(r) + 1) if r[d - 1] < cap)
    tree = []
    taken = set()
    for k in sorted(count, key=lambda k: (-count[k], len(k), k)):
        if len(tree) == n:
            break
        if all(k[:d] in taken for d in range(1, len(k))):
            tree.append(k)
            taken.add(k)
    return tree


def run_bound(args):
    """A head's best tree of N rank paths, chosen with hindsight, against its chain of N (CPU,
    exact: teacher-forced head steps and the target's greedy text; rounds simulated as the loop
    runs them). `--arms mtp` or `eagle3`; `--nodes-list` the Ns; `--depth` the deepest step."""
    target, tok = load_target(args.target)
    kind = args.arms
    if kind not in ("mtp", "eagle3"):
        raise SystemExit(f"bound: --arms names one head, mtp or eagle3, got {kind!r}")
    head = Arms(target, args.target, [], head_names=dict(mtp=args.mtp, eagle3=args.eagle3)).head(kind)
    cap = 8
    report = dict(meta=run_meta(section=args.section, target=args.target, arms=[kind],
                                max_tokens=args.max_tokens), sets={})
    md = [f"# {args.section}: the {kind} head on {args.target} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", ""]
    for pset in args.prompts.split(","):
        prompts = encode_prompts(tok, load_prompts(pset)[: args.n])
        per_prompt = []
        for i, p in enumerate(prompts):
            per_prompt.append(head_ranks(target, head, p, args.max_tokens, args.depth, cap))
            log(f"{pset} prompt {i}: {len(per_prompt[-1])} positions")
        rows = []
        for n in [int(x) for x in args.nodes_list.split(",")]:
            chain, starts = rank_rounds(per_prompt, {(0,) * d for d in range(1, min(n, args.depth) + 1)})
            best = chain
            for _ in range(3):  # refit to the starts the tree's own rounds reach
                tree = set(best_rank_tree(starts, n, cap))
                emitted, starts = rank_rounds(per_prompt, tree)
                best = max(best, emitted)
            rows.append(dict(nodes=n, chain=chain, chain_nodes=min(n, args.depth), tree=best))
        first = [r[0] for seqs in per_prompt for r in seqs]
        top1 = sum(x == 0 for x in first) / max(len(first), 1)
        report["sets"][pset] = dict(prompts=len(prompts), positions=len(first), step1_top1=top1, rows=rows)
        md += [f"## {pset} ({len(prompts)} x {args.max_tokens} tokens; {len(first)} positions; "
               f"step-1 top-1 {top1:.3f})", "",
               "| nodes N | chain of N: emitted per verify | best tree of N rank paths, hindsight | tree / chain |",
               "|---|---|---|---|"]
        md += [f"| {r['nodes']} | {r['chain']:.3f}{'' if r['chain_nodes'] == r['nodes'] else ' (of %d)' % r['chain_nodes']} "
               f"| {r['tree']:.3f} | {r['tree'] / r['chain']:.3f}x |" for r in rows]
        md.append("")
    write(args, report, md)


def run_proj(args):
    """Projected tok/s over an 8B-shape target: the acceptance (emitted per verify) measured on a
    demo pair (a loop or acceptance JSON), over round costs timed here with random weights (a
    projection): DFlash / DDTree (one draft forward), MTP or EAGLE-3 heads (one head step per
    tree depth, as the head drafter runs them)."""
    from mlx_treespec import costmodel

    # a comma list of files: each arm's figure from the first file that has it (arms measured in
    # different runs over the same prompts, priced in one call)
    files = [read_json(f) for f in args.acceptance.split(",")]
    pset = args.prompt_set or next(iter(files[0]["sets"]))
    tau = {}
    for acc in files:
        for r in acc["sets"].get(pset, {}).get("arms", []):
            tau.setdefault(r["arm"], r.get("pooled_emitted_per_verify") or r.get("emitted_per_verify"))
    if args.costs:
        return proj_from_costs(args, tau, pset)
    family = args.family
    prefix = {"dflash": ("dflash", "ddtree"), "mtp": ("mtp-",), "eagle3": ("eagle3-",)}[family]
    arms = {a: t for a, t in tau.items() if a.startswith(prefix) and t}
    borrowed = {}  # a head's arm over a draft vocabulary (+vocabN) the file lacks: its whole-vocabulary
    # arm's figure, an optimistic estimate (a demo's vocabulary is no real tokenizer's: RESULTS,
    # "Draft vocabularies")
    if args.arms is not None:  # only these of the acceptance file's arms
        wanted = args.arms.split(",")
        for a in wanted:
            spec, sync = _sync_arm(a)
            whole = dataclasses.replace(spec, vocab=0).arm + ("/sync" if sync else "")
            if a not in arms and spec.vocab and whole in arms:
                arms[a], borrowed[a] = arms[whole], whole
        missing = [a for a in wanted if a not in arms]
        if missing:
            raise SystemExit(f"--arms {','.join(missing)}: not {family} arms of {args.acceptance} "
                             f"(it has {', '.join(arms) or 'none'})")
        arms = {a: t for a, t in arms.items() if a in wanted}
    if not args.rounds and any(_sync_arm(a)[0].vocab for a in arms):
        raise SystemExit("an arm over a draft vocabulary (+vocabN) is priced by its timed rounds: add --rounds")
    cfg = costmodel.load_config(args.config)
    # an MTP head is the target's own layer, built from the target's config: no head config
    head_config = None if family == "mtp" else args.head_config
    head_cfg = json.loads(Path(head_config).read_text()) if head_config else None
    report = dict(meta=run_meta(section=args.section, acceptance=args.acceptance, prompt_set=pset,
                                config=args.config, head_config=head_config, family=family), variants=[])
    md = [f"# {args.section}: {family} projection over {Path(args.config).stem} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          f"Acceptance (emitted per verify) measured on the demo pair, {pset} prompts, from "
          f"{args.acceptance}; round costs timed here with random weights: **projections**.", ""]
    variants = [(q, dq) for q in _bits_list(args.q_bits)
                for dq in ([q] if args.draft_q_bits == "same" else _bits_list(args.draft_q_bits))]
    built_for = "nothing yet"
    # the verify row counts timed: 8..64, and each arm's (its nodes, rounded up to a timed count)
    timed_rows = sorted(set(PROJ_TS[:4]) | {_verify_rows(_sync_arm(a)[0]) for a in arms})
    for q, dq in variants:
        label = args.dtype + (f", {q}-bit" if q else "") + (
            "" if dq == q else f"; drafter {f'{dq}-bit' if dq else args.dtype}")
        if built_for != q:  # the target is built (and its plain and verify timed) once per q
            target = None
            mx.clear_cache()
            target, built_for = costmodel.build_from_config(cfg, args.dtype, q), q
            plain_first = costmodel.time_plain(target, history=args.history, tokens=64)
            verify = costmodel.time_verify(target, Ts=timed_rows, history=args.history)
        plain = plain_first
        draft_cost = _draft_cost(family, target, cfg, head_cfg, args, dq)
        rounds, compiled = args.rounds, {}
        if rounds:  # every arm's rounds and plain decoding timed in turn, --round-reps times
            plains = [plain]
            for rep in range(args.round_reps):
                if rep:
                    plains.append(costmodel.time_plain(target, history=args.history, tokens=64))
                for a in arms:
                    before = verify_counts(target)
                    draft_cost["round_ms"](*_sync_arm(a))
                    after = verify_counts(target)  # (this arm's verifies: run compiled, asked)
                    c = compiled.setdefault(a, [0, 0])
                    c[0], c[1] = c[0] + after[0] - before[0], c[1] + after[1] - before[1]
            plain = statistics.median(plains)
            draft_cost["timed"]["plain_ms"] = plains
        out = dict(variant=label, target_bits=q, drafter_bits=draft_cost["bits"], plain_ms=plain, verify_ms=verify,
                   draft=draft_cost["timed"], arms=[], eager_shapes=eager_shapes(target))
        md += [f"## {label}: plain {plain:.2f} ms/token; verify T={'/'.join(map(str, timed_rows))} "
               + "/".join(f"{verify[T]:.2f}" for T in timed_rows) + " ms; " + draft_cost["text"], "",
               f"| arm | emitted/verify (measured) | draft ms | round ms ({'timed' if rounds else 'projected'}) "
               "| x plain (projected) | verifies compiled |",
               "|---|---|---|---|---|---|"]
        for a, t in arms.items():
            spec, sync = _sync_arm(a)
            if sync and not rounds:
                continue  # (the same pieces as the queued arm)
            T = _verify_rows(spec)
            # (the step-based draft estimate times whole-vocabulary steps: none for a narrowed head)
            d = None if spec.vocab else draft_cost["per_arm"](spec)
            round_ms = statistics.median(draft_cost["timed"]["round_ms"][_round_key(spec, sync)]) if rounds else \
                d + verify[T] + args.overhead_ms
            x = t * plain / round_ms
            share = compiled[a][0] / compiled[a][1] if compiled.get(a, [0, 0])[1] else None
            out["arms"].append(dict(arm=a, tau=t, draft_ms=d, round_ms=round_ms, x_plain=x, verifies_compiled=share,
                                    tau_of=borrowed.get(a)))
            md.append(f"| {a}" + (f" (at {borrowed[a]}'s)" if a in borrowed else "")
                      + f" | {t:.2f} | {'-' if d is None else f'{d:.2f}'} | {round_ms:.2f} | {x:.2f} | "
                      + ("-" if share is None else f"{share:.2f}") + " |")
        md += [f"\nround = whole rounds of the arm's generation, timed (--rounds): the median of {args.round_reps} "
               "runs, the arms and plain decoding in turn (plain ms: " + ", ".join(f"{p:.2f}" for p in plains)
               + "; round ms per run in the JSON); verify shapes run eagerly after their checks (rows, key "
               f"width, ...): {out['eager_shapes'] or 'none'}" if rounds else
               f"\nround = draft + verify (T = the next timed row count) + {args.overhead_ms:.2f} ms host "
               "overhead per round", ""]
        report["variants"].append(out)
        mx.clear_cache()
    write(args, report, md)


PROJ_TS = (8, 16, 32, 64, 128, 256)  # proj: the verify row counts it can time


def _round_nodes(spec):
    """proj: the nodes an arm's round verifies, root included (DDTree's default budget: 31)."""
    return min(spec.budget or 31, MAX_NODES - 1) + 1


def _verify_rows(spec):
    """proj: the timed verify that prices an arm's round: its nodes rounded up to one of PROJ_TS."""
    return next(T for T in PROJ_TS if _round_nodes(spec) <= T)


def _bits_list(text):
    """'0,4' -> [None, 4]: a comma list of quantization bits, 0 (or empty) for none."""
    return [None if b in ("0", "") else int(b) for b in text.split(",")]


def proj_from_costs(args, tau, pset):
    """The projection from round costs measured elsewhere (a JSON of plain ms/token, verify ms by
    T and the DFlash draft forward ms per variant) instead of timing them here; with
    --overhead-ms the host work per round measured on the demo pair is added."""
    costs = json.loads(Path(args.costs).read_text())
    report = dict(meta=run_meta(section=args.section, acceptance=args.acceptance, prompt_set=pset,
                                costs=args.costs, overhead_ms=args.overhead_ms), variants=[])
    md = [f"# {args.section}: DFlash / DDTree projected from measured round costs (commit {_commit(report['meta'])})",
          "", f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          f"Acceptance (emitted per verify): {args.acceptance}, {pset} prompts. Costs: {args.costs} "
          f"({costs.get('_about', '')}). **Projections.**", ""]
    for label, c in costs["variants"].items():
        verify = {int(T): ms for T, ms in c["verify_ms"].items()}
        out = dict(variant=label, **c, arms=[])
        md += [f"## {label}: plain {c['plain_ms']:.2f} ms/token, draft forward {c['dflash_draft_ms']:.2f} ms, "
               f"host overhead {args.overhead_ms:.2f} ms/round", "",
               "| arm | emitted/verify (measured) | round ms | x plain (projected) |", "|---|---|---|---|"]
        for a, t in tau.items():
            if not (a.startswith("dflash") or a.startswith("ddtree")) or not t:
                continue
            nodes = _round_nodes(DraftSpec.parse(a))
            if max(verify) < nodes:
                raise SystemExit(f"{args.costs} times verifies of at most {max(verify)} rows; arm {a} "
                                 f"verifies {nodes}: add its row count to the costs or drop the arm")
            T = min(x for x in verify if nodes <= x)
            round_ms = verify[T] + c["dflash_draft_ms"] + args.overhead_ms
            x = t * c["plain_ms"] / round_ms
            out["arms"].append(dict(arm=a, tau=t, round_ms=round_ms, x_plain=x))
            md.append(f"| {a} | {t:.2f} | {round_ms:.2f} | {x:.2f} |")
        md.append("")
        report["variants"].append(out)
    write(args, report, md)


def _sync_arm(arm):
    """(DraftSpec, through the round loop) of an arm name, `ARM/sync` the round loop's."""
    return (DraftSpec.parse(arm[: -len("/sync")]), True) if arm.endswith("/sync") else (DraftSpec.parse(arm), False)


def _round_key(spec, sync):
    """The key of an arm's timed rounds: its spec's own arm string (`dflash` and `dflash:15` are one arm)."""
    return spec.arm + ("/sync" if sync else "")


def _at_least_one(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: give 1 or more")
    return n


def _draft_cost(family, target, cfg, head_cfg, args, q):
    """Time the family's drafter at this shape; returns the figures and draft ms per arm."""
    quantize = functools.partial(_cast, dtype=args.dtype, q=q)
    if family == "dflash":
        from mlx_treespec.drafters.dflash import DFlashModel, bind_dflash

        drafter = quantize(DFlashModel(dict(head_cfg, vocab_size=cfg["vocab_size"])))
        bound = bind_dflash(drafter, target)
        ms = time_dflash(bound, target, history=args.history)
        if not args.rounds:
            return dict(bits=q, timed=dict(forward_ms=ms), text=f"DFlash draft forward {ms:.2f} ms",
                        per_arm=lambda spec: ms)
        timed, round_ms = _round_timer(bound, target, args)
        pieces = time_tree_pieces(cfg["vocab_size"], bound.model.block_size - 1)
        return dict(bits=q, timed=dict(forward_ms=ms, round_ms=timed, tree_pieces_ms=pieces), per_arm=lambda spec: ms,
                    round_ms=round_ms,
                    text=f"DFlash draft forward {ms:.2f} ms; a queued tree round's own pieces, each synced: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in pieces.items())
                    + " ms; round ms: whole rounds timed (--rounds)")
    head = _random_head(family, target, cfg, head_cfg, args.head_config, quantize)
    step = {L: time_head(head, history=args.history, rows=L) for L in (1, 2, 4)}

    def per_arm(spec):  # the spine's one-token steps; EAGLE-2 lanes step L rows after the first
        S, L = spec.depth, spec.lanes
        return step[1] * S if L == 1 else step[1] + (S - 1) * step[min(L, 4)]

    text = "head step (1/2/4 rows) " + "/".join(f"{step[L]:.2f}" for L in (1, 2, 4)) + " ms"
    if not args.rounds:
        return dict(bits=q, timed=dict(step_ms=step), text=text, per_arm=per_arm)
    timed, round_ms = _round_timer(head, target, args)
    return dict(bits=q, timed=dict(step_ms=step, round_ms=timed), per_arm=per_arm, round_ms=round_ms,
                text=text + "; round ms: whole rounds timed (--rounds)")


def _cast(module, dtype, q):
    """The module in `dtype`, quantized to `q` bits (group 64) where q is given."""
    import mlx.nn as nn

    module.set_dtype(getattr(mx, dtype))
    if q:
        nn.quantize(module, bits=q, group_size=64)
    return module


def _random_head(family, target, cfg, head_cfg, head_config, quantize):
    """A head of random weights at the target's shape: its MTP layer ("mtp"), or an EAGLE-3 head
    from `head_cfg` (read from the file `head_config`) over the whole vocabulary; `quantize`
    sets its dtype and bits."""
    if family == "mtp":
        from mlx_treespec.drafters.mtp import MTPHead

        return quantize(MTPHead(target))
    from mlx_treespec.drafters.eagle3 import Eagle3Head, _config

    c, _, ids = _config(head_cfg, head_config)
    c.update(n_aux=len(ids), vocab_size=cfg["vocab_size"])
    head = quantize(Eagle3Head(c, ids)).bind(target)
    head.set_vocab_map(mx.zeros((c["draft_vocab_size"],), mx.int32))
    return head


def _round_timer(draft_model, target, args):
    """--rounds: ({arm key: [round ms per run]}, a function timing one more run of an arm's
    rounds). Whole rounds as a generation runs them (queued ahead where they queue: the host's
    work per round overlaps the device's), the draft included; each arm's drafter built once."""
    timed, drafters = {}, {}

    def round_ms(spec, sync):
        key = _round_key(spec, sync)
        if key not in drafters:
            drafter = spec.build(draft_model, target=target)
            drafters[key] = Unqueued(drafter) if sync else drafter
        timed.setdefault(key, []).append(time_rounds(target, drafters[key], args.history))

    return timed, round_ms


def time_dflash(bound, target, history=256, new_rows=8, repeats=7, warmup=6, seed=0):
    """Median ms of one DFlash draft forward (its block and `new_rows` new context rows) over a
    context of `history` rows, as a round runs it (the chain's argmax read back)."""
    from mlx_treespec.drafters.dflash import DFlashDrafter

    m = bound.model
    width = len(m.target_layer_ids) * m.config["hidden_size"]
    rng = np.random.default_rng(seed)
    feats = lambda n: mx.array(rng.standard_normal((n, width)).astype(np.float32)).astype(m.norm.weight.dtype)  # noqa: E731
    d = DFlashDrafter(bound, topk=1)
    d.prefill([0] * (history + 1), feats(history))
    times = []
    for r in range(warmup + repeats):
        d.commit(None, None, None, feats(new_rows))
        length = d.length
        t0 = time.perf_counter()
        mx.eval(d.draft(1, d.depth).tokens)
        t1 = time.perf_counter()
        d.length = length  # the next repeat drafts at the same context length
        if r >= warmup:
            times.append(1e3 * (t1 - t0))
    return statistics.median(times)


def time_rounds(target, drafter, history, tokens=48, seed=0):
    """Median ms of a generation's rounds after `history` random prompt tokens (rounds queued
    ahead where they queue: then a round's ms is the period between the host's reads). Random
    weights accept little, so rounds emit about one token each; a round's cost does not depend
    on what it accepts but for the commit's few rows."""
    vocab = int(target(mx.array([[0]]))[0, -1].shape[-1])
    prompt = np.random.default_rng(seed).integers(0, vocab, history + 1).tolist()
    for n in (8, tokens):  # the first run traces and checks
        stats = RoundStats()
        for _ in tree_generate_step(prompt, target, drafter, max_tokens=n, stats=stats):
            pass
    return statistics.median(stats.round_ms[2:])


def time_tree_pieces(vocab, depth, budget=31, repeats=15, seed=0):
    """Median ms of each piece a queued DDTree round adds to a chain's besides its rows,
    synced one at a time: the block's top-k over the vocabulary, the tree build, the walk."""
    from mlx_treespec import device_tree

    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((depth, vocab)).astype(np.float32))
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    root = mx.array([1], mx.uint32)
    K = min(budget, vocab)
    tree = device_tree.best_first(root, lp, budget, budget)
    choice = mx.array(rng.integers(0, 4, budget + 1).astype(np.uint32))

    def timed(f):
        for _ in range(3):
            mx.eval(f())
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval(f())
            ts.append(time.perf_counter() - t)
        return 1e3 * statistics.median(ts)

    def two_stage():  # (an experiment: the K best of the K chunks with the best maxima)
        S = -(-vocab // 512)
        x = mx.concatenate([lp, mx.full((depth, 512 * S - vocab), -mx.inf)], axis=1).reshape(depth, 512, S)
        chunks = mx.argpartition(-x.max(axis=-1), kth=K - 1, axis=-1)[:, :K]
        cand = mx.take_along_axis(x, chunks[..., None], axis=1).reshape(depth, K * S)
        pick = mx.argpartition(-cand, kth=K - 1, axis=-1)[:, :K]
        return mx.take_along_axis(chunks, pick // S, axis=1) * S + pick % S, mx.take_along_axis(cand, pick, axis=1)

    return {"top-k": timed(lambda: device_tree.top_k(lp, K)),
            "top-k in two stages": timed(two_stage),
            "build": timed(lambda: device_tree.best_first(root, lp, budget, budget)),
            "walk": timed(lambda: device_tree.walk(choice, *tree[:2], *tree[2:]))}


def time_head(head, history=256, rows=1, repeats=5, warmup=2, seed=0):
    """Median ms of one drafting-head step of `rows` tokens (1: a chain step; L: a lane step)
    over `history` cached slots (random tokens and hidden states)."""
    rng = np.random.default_rng(seed)
    eagle = type(head).__name__ == "Eagle3Head"
    H = head.hidden_size if eagle else head.args.hidden_size
    width = head.config["n_aux"] * head.config["target_hidden_size"] if eagle else H  # first-pass rows
    vocab = int(head._embed.weight.shape[0])
    dtype = head.norm.weight.dtype
    cache = head.make_cache()
    toks = lambda n: mx.array(rng.integers(0, vocab, n).astype(np.uint32))[None]  # noqa: E731
    hid = lambda n, w: mx.array(rng.standard_normal((1, n, w)).astype(np.float32)).astype(dtype)  # noqa: E731
    kw = {"first": True} if eagle else {}
    mx.eval(head(toks(history), cache=cache, hidden=hid(history, width), **kw))
    kw = {"first": False} if kw else {}
    times = []
    from mlx_treespec.join import join, running

    join(head)  # (as a drafting head runs: its projections joined)
    for r in range(warmup + repeats):
        t0 = time.perf_counter()
        with running():
            mx.eval(head(toks(rows), cache=cache, hidden=hid(rows, H), **kw))
        t1 = time.perf_counter()
        for c in cache:
            c.trim(rows)
        if r >= warmup:
            times.append(1e3 * (t1 - t0))
    return statistics.median(times)


def _filled_caches(model, context, room=512, seed=0):
    """The target's caches holding `context` random K/V rows (costs do not depend on the values;
    a 32k-token prefill of an 8B model would cost more than the measurement), their buffers as
    wide as a verify mid-generation finds them (a multiple of `verify.width_step()`: else every
    repeat's verify would pay the copy that widens them, which a generation pays once per 1024
    tokens, and `abort` would narrow them again). mlx-lm's causal forward reads only its rows."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache
    from mlx_treespec.verify import width_step

    caches = make_prompt_cache(model)
    mx.random.seed(seed)
    step = width_step()
    cap = -(-(context + room) // step) * step
    for c in caches:
        if type(c) is not KVCache:
            raise SystemExit(f"long: attention-only targets ({type(c).__name__} found)")
    layer = model.layers[0].self_attn
    n_kv = getattr(layer, "n_kv_heads", None) or getattr(layer, "num_key_value_heads")
    head_dim = layer.k_proj.weight.shape[0] // n_kv if not hasattr(layer, "head_dim") else layer.head_dim
    dtype = model.layers[0].input_layernorm.weight.dtype
    for c in caches:
        c.keys = (0.5 * mx.random.normal((1, n_kv, cap, head_dim))).astype(dtype)
        c.values = (0.5 * mx.random.normal((1, n_kv, cap, head_dim))).astype(dtype)
        c.offset = context
    mx.eval([c.state for c in caches])
    return caches, n_kv, head_dim, dtype


def run_long(args):
    """A tree verify of T nodes against mlx-lm's own causal forward of T tokens and plain
    decoding, at each context length, arms interleaved per repeat; then the attention alone in
    each mask form, one layer's shape, to show where a verify's time goes."""
    from mlx_treespec import costmodel
    from mlx_treespec.draft import Draft, Layout
    from mlx_treespec.probe import representative_tree_parents
    from mlx_treespec.tree import depths_of
    from mlx_treespec.verify import TreeRound

    contexts = [int(c) for c in args.contexts.split(",")]
    T = args.nodes
    parents = representative_tree_parents(2, min(T - 1, 12), T - 1)
    report = dict(meta=run_meta(section=args.section, config=args.config, contexts=contexts, nodes=T), variants=[])
    md = [f"# {args.section}: tree verify vs causal forward at long context (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          f"T = {T} nodes (a two-wide tree of depth {int(max(depths_of(parents)))}); median ms of {args.repeats} repeats, arms interleaved; K/V rows random (values do not change costs).", ""]
    targets = []
    if args.config == "demo":
        targets.append(("demo target", lambda: load_target("demo")[0]))
    else:
        cfg = costmodel.load_config(args.config)
        for q in _bits_list(args.q_bits):
            targets.append((f"{Path(args.config).stem} {args.dtype}" + (f" {q}-bit" if q else ""),
                            lambda q=q: costmodel.build_from_config(cfg, args.dtype, q)))
    for label, build in targets:
        model = build()
        rows = []
        for ctx in contexts:
            caches, n_kv, head_dim, dtype = _filled_caches(model, ctx)
            rng = np.random.default_rng(ctx)
            tokens = mx.array(rng.integers(0, 1000, T).astype(np.uint32))
            one = mx.array([[7]], mx.uint32)

            def plain():
                for c in caches:
                    c.offset = ctx
                t0 = time.perf_counter()
                y = None
                for _ in range(8):  # pipelined like generate_step: queue the next before reading
                    logits = model(one, cache=caches)
                    nxt = mx.argmax(logits[0, -1])
                    mx.async_eval(nxt)
                    if y is not None:
                        y.item()
                    y = nxt
                y.item()
                dt = (time.perf_counter() - t0) / 8
                for c in caches:
                    c.offset = ctx
                return dt

            def causal():
                t0 = time.perf_counter()
                mx.eval(model(tokens[None], cache=caches))
                dt = time.perf_counter() - t0
                for c in caches:
                    c.offset = ctx
                return dt

            masked = mx.where(mx.arange(ctx + T)[None] <= (ctx + mx.arange(T))[:, None],
                              mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))

            def causal_masked():  # the same forward with the causal pattern as an additive mask
                t0 = time.perf_counter()
                mx.eval(model(tokens[None], cache=[_WithMask(c, masked) for c in caches]))
                dt = time.perf_counter() - t0
                for c in caches:
                    c.offset = ctx
                return dt

            def tree(compiled=True):
                rnd = TreeRound(model, caches, compiled=compiled)
                t0 = time.perf_counter()
                logits, _ = rnd.verify(Draft(tokens, Layout.fixed(parents)))
                mx.eval(logits)
                dt = time.perf_counter() - t0
                rnd.abort()
                return dt

            arms = dict(plain=plain, causal=causal, causal_masked=causal_masked, tree=tree,
                        tree_eager=lambda: tree(False))
            times = {a: [] for a in arms}
            for r in range(args.repeats + 2):
                for a, f in arms.items():
                    dt = f()
                    if r >= 2:
                        times[a].append(1e3 * dt)
            med = {a: statistics.median(v) for a, v in times.items()}
            store = model.__dict__.get("_treespec_compiled_verify") or {}
            path = "compiled" if store.get("trusted_runs") else "eager"  # after the checks
            attn = _attention_forms(model, ctx, T, n_kv, head_dim, dtype, caches[0].keys.shape[2], args.repeats)
            rows.append(dict(context=ctx, **{f"{a}_ms": m for a, m in med.items()}, tree_path=path,
                             tree_over_causal=med["tree"] / med["causal"], attention_ms=attn))
            log(f"{label} ctx {ctx}: " + ", ".join(f"{a} {m:.2f}" for a, m in med.items()) +
                f" ms (tree ran {path}); attention " + ", ".join(f"{k} {v:.3f}" for k, v in attn.items()))
            model.__dict__.pop("_treespec_compiled_verify", None)  # the next context's width chooses anew
            caches = None  # free this context's K/V before the next one is filled
            mx.clear_cache()
        forms = list(rows[0]["attention_ms"])
        md += [f"## {label}", "", "| context | plain ms/token | causal forward T ms | causal, additive mask ms | "
               "tree verify T ms (path) | tree eager ms | tree / causal | "
               + " | ".join(f"attn {f} ms" for f in forms) + " |", "|---" * (7 + len(forms)) + "|"]
        md += [f"| {r['context']} | {r['plain_ms']:.2f} | {r['causal_ms']:.2f} | {r['causal_masked_ms']:.2f} | "
               f"{r['tree_ms']:.2f} ({r['tree_path']}) | {r['tree_eager_ms']:.2f} | {r['tree_over_causal']:.2f} | "
               + " | ".join(f"{r['attention_ms'][f]:.3f}" for f in forms) + " |" for r in rows]
        md.append("")
        report["variants"].append(dict(target=label, rows=rows))
        write(args, report, md, echo=False)
        model = None
        mx.clear_cache()
    write(args, report, md)


class _WithMask:
    """A KVCache that hands the model a given mask (mlx-lm's forward, another mask form)."""

    def __init__(self, inner, mask):
        self.inner, self.mask = inner, mask

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def offset(self):
        return self.inner.offset

    def make_mask(self, N, window_size=None, return_array=False):
        return self.mask

    def update_and_fetch(self, keys, values):
        return self.inner.update_and_fetch(keys, values)


def _attention_forms(model, ctx, T, n_kv, head_dim, dtype, width, repeats):
    """ms of one layer's attention (all layers' worth: x n_layers) in each mask form."""
    from mlx_treespec.attention import tree_attention
    from mlx_treespec.verify import kernel_fits

    layer = model.layers[0].self_attn
    n_q = getattr(layer, "n_heads", None) or getattr(layer, "num_attention_heads")
    n_layers = len(model.layers)
    scale = head_dim ** -0.5
    q = mx.random.normal((1, n_q, T, head_dim)).astype(dtype)
    k = mx.random.normal((1, n_kv, width, head_dim)).astype(dtype)
    v = mx.random.normal((1, n_kv, width, head_dim)).astype(dtype)
    used = ctx + T
    tree = np.tril(np.ones((T, T), bool))
    tree[T // 2 :, : T // 4] = False  # some rows miss some nodes: not a causal mask
    rows = np.concatenate([np.ones((T, ctx), bool), tree, np.zeros((T, width - used), bool)], axis=1)
    bool_full = mx.array(rows)
    add_full = mx.where(bool_full, mx.array(0, dtype), mx.array(-np.inf, dtype))
    bool_used, add_used = bool_full[:, :used], add_full[:, :used]
    ku, vu = k[:, :, :used], v[:, :, :used]
    forms = {
        "causal": lambda: mx.fast.scaled_dot_product_attention(q, ku, vu, scale=scale, mask="causal"),
        "bool": lambda: mx.fast.scaled_dot_product_attention(q, ku, vu, scale=scale, mask=bool_used),
        "additive": lambda: mx.fast.scaled_dot_product_attention(q, ku, vu, scale=scale, mask=add_used),
        "bool whole buffer": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bool_full),
        "additive whole buffer": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=add_full),
        "cascade (fused history + tree ops)": lambda: _split_attention(q, ku, vu, scale, ctx, mx.array(tree)),
    }
    if kernel_fits(k):  # CUDA: the tree-attention kernel over the whole buffer, as a verify runs it
        bounds = mx.array([ctx, used], mx.int32)
        forms["tree kernel (whole buffer)"] = lambda: tree_attention(q, k, v, add_full, bounds, scale)
    mx.eval(q, k, v, bool_full, add_full, ku, vu)
    out = {}
    for name, f in forms.items():
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            mx.eval([f() for _ in range(n_layers)])
            if r:
                times.append(1e3 * (time.perf_counter() - t0))
        out[name] = statistics.median(times)
    return out


def _split_attention(q, k, v, scale, ctx, tree):
    """The history by the fused kernel (no mask) and the tree window by ops, merged by their
    log-sum-exps (the history's from one score matmul): what a cascade costs in MLX ops."""
    kh, vh, kt, vt = k[:, :, :ctx], v[:, :, :ctx], k[:, :, ctx:], v[:, :, ctx:]
    n_q, n_kv = q.shape[1], k.shape[1]
    g = n_q // n_kv
    qg = q.reshape(1, n_kv, g * q.shape[2], q.shape[3])
    s_h = (qg * scale) @ kh.swapaxes(-1, -2)
    lse_h = mx.logsumexp(s_h.astype(mx.float32), axis=-1, keepdims=True)
    o_h = mx.fast.scaled_dot_product_attention(q, kh, vh, scale=scale).reshape(qg.shape)
    s_t = ((qg * scale) @ kt.swapaxes(-1, -2)).astype(mx.float32)
    s_t = mx.where(mx.tile(tree, (g, 1)), s_t, -np.inf)
    lse_t = mx.logsumexp(s_t, axis=-1, keepdims=True)
    o_t = (mx.softmax(s_t, axis=-1).astype(v.dtype) @ vt)
    lse = mx.logaddexp(lse_h, lse_t)
    o = mx.exp(lse_h - lse) * o_h + mx.exp(lse_t - lse) * o_t
    return o.astype(q.dtype).reshape(q.shape)


def run_round_host(args):
    """Where a queued round's host time goes, arm by arm (interleaved per prompt): queued rounds
    are host-bound on the H200 (the host waits ~0.1 ms a round on the device), so a round costs
    what the host spends building and launching it. Timed without a sync: the draft (the
    drafter's `ahead`), the mask and positions, the verify's graph, the walk, the recurrent
    commit, the launch (`mx.async_eval` of the round), the wait for its count, and the rest (the
    round's other ops and the loop's own work). One more generation per arm counts the
    primitives each round's graph holds (views included; `kernels` leaves out the view kinds).
    The verify's timed checks launch inside it: their launches count as verify and as launch
    (the rest then reads negative), in the first prompts a shape meets. `--cpu-queued`: on CPU,
    the GPU's queued rounds, for their kernel counts (CPU graphs hold more primitives than a
    GPU's: RMSNorm, RoPE and attention are several ops there; CPU times are not speed), every
    verify shape compiled as a GPU's are."""
    import mlx_treespec.queued as queued

    if args.cpu_queued:
        if mx.default_device() != mx.cpu:
            sys.exit("round-host: --cpu-queued is for CPU (a GPU queues its rounds already)")
        import mlx_treespec.adaptive as adaptive  # (it imports the rule by name)

        gpu_path, clock = verify.pad_keys_default, verify._clock
        verify.pad_keys_default = adaptive.pad_keys_default = lambda: True
        # the compiled-or-eager checks see a tie (every read one tick later): each shape stays
        # compiled, as the GPU's do, and the counts do not follow this CPU's timings
        verify._clock = itertools.count().__next__
        try:
            return run_round_host(argparse.Namespace(**dict(vars(args), cpu_queued=False)))
        finally:
            verify.pad_keys_default = adaptive.pad_keys_default = gpu_path
            verify._clock = clock
    names = [a for a in args.arms.split(",") if a and a not in ("plain", "mlx-plain")]
    target, tok = load_target(args.target)
    texts = load_prompts(args.prompts.split(",")[0])[: args.n]
    prompts = encode_prompts(tok, texts)
    arms = Arms(target, args.target, texts, args.draft_model, args.dflash, dict(mtp=args.mtp, eagle3=args.eagle3))
    makers = {a: arms.maker(a) for a in names}
    clock, counts = collections.Counter(), []
    pieces = {"draft": None, "layout": "_replay_layout", "spine layout": "_spine_layout", "verify": "compiled_forward",
              "walk": "walk", "commit": "replay_prefix"}
    originals = {k: getattr(queued, v) for k, v in pieces.items() if v}
    launch = mx.async_eval

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                out = fn(*a, **k)
            finally:
                clock[name] += time.perf_counter() - t
            if args.split_launch and not name.endswith("launch"):  # launched here: this piece's own kernels
                t = time.perf_counter()
                launch(*_arrays_in(out))
                clock[name + " launch"] += time.perf_counter() - t
            return out
        return call

    def counted(*arrays):  # the round's own graph: earlier rounds were launched (and detached)
        import io
        import re

        buf = io.StringIO()
        mx.export_to_dot(buf, *arrays)
        counts.append(collections.Counter(re.findall(r'label ="([^"]+)"', buf.getvalue())))
        return launch(*arrays)

    class Timed:  # the drafter, its `ahead` timed
        def __init__(self, drafter):
            self.drafter = drafter

        def __getattr__(self, name):
            return getattr(self.drafter, name)

        @property
        def ahead(self):
            inner = self.drafter.ahead
            return None if inner is None else timed("draft", inner)

    views = VIEWS
    results = {a: [] for a in names}

    def run(a, i, order):
        clock.clear()
        for k, v in pieces.items():
            if v:  # (both tree layouts count as "layout")
                setattr(queued, v, timed(k.replace("spine ", ""), originals[k]))
        mx.async_eval = timed("rest launch" if args.split_launch else "launch", launch)
        try:
            out, stats, dt = run_once(target, Timed(makers[a]()), prompts[i], args.max_tokens)
        finally:
            for k, v in pieces.items():
                if v:
                    setattr(queued, v, originals[k])
            mx.async_eval = launch
        queued_rounds = [j for j, d in enumerate(stats.drafter) if d == "queued"]
        if not queued_rounds:
            sys.exit(f"round-host: arm {a} ran no queued round (it times rounds queued ahead, on a GPU)")
        n = stats.rounds + 1  # the round queued past the last is built and launched too
        rec = {k: 1e3 * v / n for k, v in clock.items()}
        rec["launch"] = sum(v for k, v in rec.items() if k.endswith("launch"))  # (every piece's: the round's)
        rec["wait"] = statistics.fmean(stats.sync_ms[j] for j in queued_rounds)
        rec["round"] = statistics.fmean(stats.round_ms[j] for j in queued_rounds)
        rec["rest"] = rec["round"] - sum(rec.get(k, 0.0) for k in ("draft", "layout", "verify", "walk", "commit",
                                                                    "launch", "wait"))
        rec.update(prompt=i, order=order, rounds=stats.rounds, tokens=len(out),
                   emitted_per_verify=sum(stats.emitted) / stats.rounds)
        log(f"prompt {i} {a}: " + ", ".join(f"{k} {rec[k]:.3f}" for k in ("round", "draft", "verify", "launch", "rest")))
        results[a].append(rec)
        return rec

    log(f"{len(prompts)} prompts x {args.max_tokens} tokens, {len(names)} arms")
    interleave(names, prompts, run, log=log,  # (warmed up as `loop` does: on CPU, whose times are not speed, once)
               warmup=lambda a: [run_once(target, makers[a](), prompts[0], args.max_tokens)
                                 for _ in range(verify.CHECKS if mx.default_device() == mx.gpu else 1)])
    rows = []
    for a in names:
        counts.clear()
        mx.async_eval = counted
        try:
            run_once(target, makers[a](), prompts[0], args.max_tokens)
        finally:
            mx.async_eval = launch
        # (past the verify's timed checks: those rounds run the eager forward too)
        later = counts[verify.CHECKS + 1:] or counts
        prims = statistics.fmean(sum(c.values()) for c in later)
        kernels = statistics.fmean(sum(v for k, v in c.items() if k not in views) for c in later)
        mean = {k: statistics.fmean(r[k] for r in results[a]) for k in
                ("round", "draft", "layout", "verify", "walk", "commit", "launch", "wait", "rest", "emitted_per_verify")
                + SPLIT_LAUNCH if all(k in r for r in results[a])}
        every = collections.Counter()
        for c in later:
            every.update({k: v / len(later) for k, v in c.items()})
        rows.append(dict(arm=a, runs=results[a], primitives=prims, kernels=kernels, by_kind=dict(every),
                         top=[(k, v) for k, v in every.most_common() if k not in views][:12], **mean))
    launches = launch_costs()
    report = dict(meta=run_meta(section=args.section, target=args.target, arms=names, max_tokens=args.max_tokens),
                  prompts=len(prompts), arms=rows, launches=launches)
    cols = ["round", "draft", "layout", "verify", "walk", "commit", "launch", "wait", "rest"]
    if args.split_launch:
        cols[7:7] = [c for c in SPLIT_LAUNCH if any(c in r for r in rows)]
    md = [f"# {args.section}: {args.target} on {report['meta']['device']} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          f"Host ms a queued round (means over {len(prompts)} prompts x {args.max_tokens} tokens, arms interleaved); "
          "kernels: a round graph's primitives but views."
          + (" `launch`: every piece's launch; `X launch`: the kernels of piece X's outputs, launched as it returned "
             "(`draft launch`: the draft's; `rest launch`: what the round's own launch was left)." if args.split_launch
             else ""), "",
          "| arm | emitted per verify | " + " | ".join(cols) + " | kernels (primitives) |",
          "|---|---|" + "---|" * len(cols) + "---|"]
    md += [f"| {r['arm']} | {r['emitted_per_verify']:.2f} | " + " | ".join(f"{r.get(c, 0.0):.3f}" for c in cols)
           + f" | {r['kernels']:.0f} ({r['primitives']:.0f}) |" for r in rows]
    md += ["", "Kernels a round, the most frequent:", ""]
    md += [f"- {r['arm']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["top"]) for r in rows]
    md += ["", "One op of each kind, chained 200 times: host us an op to build, to launch, and device us an op "
           "after the launch (\"+ add\": a second kernel that feeds the op's output to the next op):", "",
           "| op | build us | launch us | device us |", "|---|---|---|---|"]
    md += [f"| {k} | {v['build_us']:.1f} | {v['launch_us']:.1f} | {v['device_us']:.1f} |" for k, v in launches.items()]
    write(args, report, md)


SPLIT_LAUNCH = ("draft launch", "layout launch", "verify launch", "walk launch", "commit launch", "rest launch")


def _arrays_in(out):
    """The mx arrays in a round piece's output (tuples, lists, a Draft's tokens and device layout)."""
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (tuple, list)):
        return [a for x in out for a in _arrays_in(x)]
    from mlx_treespec.draft import Draft

    return [out.tokens, *out.layout.device] if isinstance(out, Draft) else []


VIEWS = {"Slice", "Split", "Reshape", "Broadcast", "ExpandDims", "Squeeze", "Transpose", "Flatten", "Unflatten",
         "AsStrided", "StopGradient", "Depends"}  # primitives that launch no kernel


def head_arms(args, command):
    """(target, the first unseen prompt's 64 tokens, [(arm, a fresh drafter)]) for a command over
    head arms drafting ahead (draft-kernels); any other arm exits naming it."""
    target, tok = load_target(args.target)
    texts = load_prompts(args.prompts.split(",")[0])[:1]
    prompt = encode_prompts(tok, texts)[0][:64]
    arms = Arms(target, args.target, texts, args.draft_model, args.dflash, dict(mtp=args.mtp, eagle3=args.eagle3))
    out = []
    for a in args.arms.split(","):
        drafter = arms.maker(a)()
        if getattr(drafter, "ahead", None) is None or not hasattr(drafter, "_steps_ahead"):
            sys.exit(f"{command}: arm {a} is not a head drafting ahead (mtp-..., eagle3-...)")
        out.append((a, drafter))
    return target, prompt, out


def prefilled(target, drafter, prompt):
    """`drafter` prefilled with `prompt` (the target's captured rows): its queued kind."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(target)
    with verify.capturing(target, drafter.capture) as cap:
        target(mx.array(prompt[:-1])[None], cache=cache)
        hidden = cap.hidden()
    drafter.prefill(prompt, hidden)
    return {"chain_ahead": "chain", "tree_ahead": "tree", "lanes_ahead": "lanes"}[drafter.ahead.__name__]


def draft_kernels(target, drafter, prompt):
    """The kernels (primitives but views, by kind) in the graph of one queued draft of a head
    drafter from `prompt` prefilled: its slots' forward, steps and, for a lane tree, re-rank."""
    import io
    import re

    kind = prefilled(target, drafter, prompt)
    out = drafter._steps_ahead(mx.array([prompt[-1]], mx.uint32), None, None, None, kind)
    arrays = [out[0]] + (list(out[1].device) if kind == "lanes" else [out[1]] if kind == "tree" else [])
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return collections.Counter(k for k in re.findall(r'label ="([^"]+)"', buf.getvalue()) if k not in VIEWS)


def composed_attention(q, k, v, mask, scale):
    """MLX's fallback attention as ops (scaled queries by keys, plus the additive mask, a precise
    softmax, by values): what its fused call runs on CPU, bit for bit."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    q = mx.array(scale, q.dtype) * q
    mask = mx.broadcast_to(mask.astype(q.dtype), (B, Hq, L, k.shape[2]))
    if Hq != Hkv:
        q = q.reshape(B, Hkv, Hq // Hkv, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
        mask = mask.reshape(B, Hkv, Hq // Hkv, L, -1)
    out = mx.softmax(q @ k.swapaxes(-1, -2) + mask, axis=-1, precise=True) @ v
    return out.reshape(B, Hq, L, -1) if Hq != Hkv else out


def chained_us(fns, start, step, calls):
    """Microseconds a call of each of `fns` ({arm: fn}), `calls` calls chained from `start` (x =
    step(fn, x): each call fed the last one's output), host and device together: three rounds
    over the arms, interleaved, the best of the last two (the first pays the traces)."""
    best = {}
    for rep in range(3):
        for arm, fn in fns.items():
            x = start
            mx.eval(x)
            t = time.perf_counter()
            for _ in range(calls):
                x = step(fn, x)
            mx.eval(x)
            us = (time.perf_counter() - t) / calls * 1e6
            if rep:
                best[arm] = min(best.get(arm, us), us)
    return best


def run_head_step(args):
    """One head step at 8B shapes (random weights), drafting over the whole vocabulary against
    over the first `--draft-vocab` ids (HeadModule.narrowed): synced ms a step of each `--rows`,
    the two in turn `--round-reps` times. The head is the target's MTP layer where `--config` is
    a qwen3_5 / qwen3_next shape, else `--head-config`'s EAGLE-3 head over the whole vocabulary."""
    from mlx_treespec import costmodel

    rows_list, out = [int(r) for r in args.rows.split(",")], []
    md = [f"# {args.section}: a head step over the whole vocabulary and over {args.draft_vocab} ids "
          f"({_commit(run_meta())})", "", f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          "| shape | rows | whole vocabulary ms | draft vocabulary ms | whole / draft |", "|---|---|---|---|---|"]
    for config in args.config.split(","):
        cfg = costmodel.load_config(config)
        for q in _bits_list(args.q_bits):
            target = costmodel.build_from_config(cfg, args.dtype, q)
            mtp = cfg.get("model_type", "").startswith(("qwen3_5", "qwen3_next"))
            head = _random_head("mtp" if mtp else "eagle3", target, cfg,
                                None if mtp else json.loads(Path(args.head_config).read_text()), args.head_config,
                                functools.partial(_cast, dtype=args.dtype, q=q))
            narrow = head.narrowed(args.draft_vocab)
            timed = {}
            for _ in range(args.round_reps):
                for label, h in (("whole", head), ("draft", narrow)):
                    for r in rows_list:
                        timed.setdefault((label, r), []).append(time_head(h, history=args.history, rows=r, repeats=15, warmup=3))
            shape = f"{Path(config).stem}, {args.dtype}" + (f", {q}-bit" if q else "")
            for r in rows_list:
                w, d = statistics.median(timed["whole", r]), statistics.median(timed["draft", r])
                out.append(dict(shape=shape, rows=r, whole_ms=timed["whole", r], draft_ms=timed["draft", r]))
                md.append(f"| {shape} | {r} | {w:.2f} | {d:.2f} | {w / d:.2f} |")
                print(md[-1], flush=True)
            target = head = narrow = None
            mx.clear_cache()
    md += ["", f"Medians of {args.round_reps} timings (each the median of 15 synced steps over {args.history} "
           "cached slots); every timing in the JSON.", ""]
    write(args, dict(meta=run_meta(section=args.section, draft_vocab=args.draft_vocab), rows=out), md)


def run_topk(args):
    """A draft step's top-k over R rows of a V-wide vocabulary (float32 logits, random): the
    one-lane trees' runners-up as they were (`put_along_axis` of the lane's token, then
    `argpartition`, which MLX runs as a sort on a GPU) against `device_tree.top_k` (argmaxes),
    each compiled, 200 calls chained: microseconds a call, host and device together."""
    from mlx_treespec.device_tree import top_k
    rows_list = [int(r) for r in args.rows.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    K, calls, out = 3, 200, []

    def old(x, taken):
        x = mx.put_along_axis(x, taken[:, None], mx.array(-mx.inf, x.dtype), axis=-1)
        return mx.argpartition(-x, kth=K - 2, axis=-1)[:, : K - 1].astype(mx.int32)

    def new(x, taken):
        return top_k(x, K - 1, skip=taken)[0]

    for V in widths:
        for R in rows_list:
            x0 = mx.random.normal((R, V))
            taken = mx.argmax(x0, axis=-1).astype(mx.int32)
            fns = {"argpartition": mx.compile(old), "argmax": mx.compile(new)}
            assert np.array_equal(np.sort(np.array(fns["argpartition"](x0, taken)), -1),
                                  np.sort(np.array(fns["argmax"](x0, taken)), -1))
            # (each call's ids feed the next call's logits)
            row = dict(width=V, rows=R, **chained_us(fns, x0, lambda fn, x: x + fn(x, taken)[:, :1].astype(x.dtype) * 0,
                                                     calls))
            out.append(row)
            print(f"V={V} R={R}: argpartition {row['argpartition']:.1f} us, argmax {row['argmax']:.1f} us", flush=True)
    report = dict(meta=run_meta(section=args.section), rows=out)
    md = [f"# {args.section}: a step's {K - 1} runners-up, argpartition against argmaxes ({_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          "Microseconds a call (200 chained, compiled, float32 logits; best of two after a warm-up; an add "
          f"each call), device: {report['meta'].get('device', '?')}.", "",
          "| vocabulary | rows | argpartition us | argmaxes us | argmaxes / argpartition |", "|---|---|---|---|---|"]
    md += [f"| {r['width']} | {r['rows']} | {r['argpartition']:.1f} | {r['argmax']:.1f} | {r['argmax'] / r['argpartition']:.2f} |"
           for r in out]
    write(args, report, md)


def run_attn(args):
    """Masked attention of R query rows over a K/V buffer (float16, random): MLX's fused call
    (on CUDA: cuDNN from two rows on) against the same arithmetic as composed ops (MLX's own
    fallback, `composed_attention`), each compiled, 200 calls chained (each call's output is
    the next call's queries): microseconds a call, host and device together. Shapes: the demo
    EAGLE-3 head's attention (6 query heads, 2 K/V heads, dim 64) and an 8B target's (32, 8, 128)."""
    shapes = {"demo head (6/2 x 64)": (6, 2, 64), "8B (32/8 x 128)": (32, 8, 128)}
    rows_list = [int(r) for r in args.rows.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    out, calls = [], 200
    for name, (Hq, Hkv, D) in shapes.items():
        for W in widths:
            k = mx.random.normal((1, Hkv, W, D)).astype(mx.float16)
            v = mx.random.normal((1, Hkv, W, D)).astype(mx.float16)
            for R in rows_list:
                q0 = mx.random.normal((1, Hq, R, D)).astype(mx.float16)
                seen = mx.arange(W)[None] < (W // 2 + mx.arange(R)[:, None])
                mask = mx.where(seen, mx.array(0, mx.float16), mx.array(mx.finfo(mx.float16).min, mx.float16))
                fns = {"fused": mx.compile(lambda q, k, v, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=m)),
                       "composed": mx.compile(lambda q, k, v, m: composed_attention(q, k, v, m, D ** -0.5))}
                row = dict(shape=name, width=W, rows=R, **chained_us(fns, q0, lambda fn, q: fn(q, k, v, mask), calls))
                out.append(row)
                print(f"{name} W={W} R={R}: fused {row['fused']:.1f} us, composed {row['composed']:.1f} us", flush=True)
    report = dict(meta=run_meta(section=args.section), rows=out)
    md = [f"# {args.section}: masked attention, fused call against composed ops ({_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          "Microseconds a call (200 chained, compiled, float16; best of two after a warm-up), device: "
          f"{report['meta'].get('device', '?')}.", "",
          "| shape | key columns | query rows | fused us | composed us | fused / composed |", "|---|---|---|---|---|---|"]
    md += [f"| {r['shape']} | {r['width']} | {r['rows']} | {r['fused']:.1f} | {r['composed']:.1f} | {r['fused'] / r['composed']:.2f} |"
           for r in out]
    write(args, report, md)


def run_draft_kernels(args):
    """Kernels in one queued draft's graph per head arm (the first unseen prompt, 64 tokens, as
    its prefill): arms of two depths give a step's kernels, (A_S - A_s) / (S - s)."""
    target, prompt, drafters = head_arms(args, "draft-kernels")
    rows = []
    for a, drafter in drafters:
        separate = getattr(drafter, "separate", None)  # (ARM/separate: its layers apart)
        with separate() if separate is not None else contextlib.nullcontext():
            counts = draft_kernels(target, drafter, prompt)
        rows.append(dict(arm=a, kernels=sum(counts.values()), by_kind=dict(counts)))
        log(f"{a}: {rows[-1]['kernels']} kernels")
    report = dict(meta=run_meta(section=args.section, target=args.target, arms=args.arms.split(",")), arms=rows)
    md = [f"# {args.section}: {args.target} on {report['meta']['device']} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          "Kernels (primitives but views) in one queued draft's graph: the slots' forward, the steps, a lane "
          "tree's re-rank.", "", "| arm | kernels | the most frequent |", "|---|---|---|"]
    md += [f"| {r['arm']} | {r['kernels']} | " + ", ".join(f"{k} {v}" for k, v in
                                                       collections.Counter(r["by_kind"]).most_common(8)) + " |"
           for r in rows]
    write(args, report, md)


def run_stalls(args):
    """Rounds that stall: each arm (a fresh drafter a generation) over --n prompts of the first
    --prompts set, --reps passes in one process, arms interleaved per prompt; per generation
    its seconds, its rounds, and the rounds over STALL_MS (their count, time and node counts).
    Then the first and second call of MLX's masked attention and of a depthwise conv1d (a
    GatedDeltaNet layer's, `gdn.tree_conv1d`: one window a row) at shapes new to the process
    (on CUDA MLX runs both through cuDNN, which builds a graph for each shape it meets first)."""
    target, tok = load_target(args.target)
    texts = load_prompts(args.prompts.split(",")[0])[: args.n]
    prompts = encode_prompts(tok, texts)
    arms = Arms(target, args.target, texts, args.draft_model, args.dflash, dict(mtp=args.mtp, eagle3=args.eagle3))
    names = args.arms.split(",")
    makers = {a: arms.maker(a) for a in names}
    rows = []
    for rep in range(args.reps):
        for i, p in enumerate(prompts):
            for a in names:
                t = time.perf_counter()
                _, stats, _ = run_once(target, makers[a](), p, args.max_tokens)
                wall = time.perf_counter() - t
                slow = [(round(ms, 1), n) for ms, n in zip(stats.round_ms, stats.nodes) if ms > STALL_MS]
                rows.append(dict(arm=a, rep=rep, prompt=i, wall_s=wall, rounds=stats.rounds,
                                 round_ms_median=statistics.median(stats.round_ms) if stats.round_ms else 0.0,
                                 slow=slow, slow_ms=sum(ms for ms, _ in slow)))
                log(f"{a} rep {rep} prompt {i}: {wall:.2f} s, {stats.rounds} rounds, {len(slow)} over {STALL_MS} ms "
                    f"({sum(ms for ms, _ in slow):.0f} ms: {slow[:6]})")
    rng = np.random.default_rng(5)
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float16))  # noqa: E731
    firsts = []

    def first_two(kind, rows, width, op, *inputs):  # ms of the op's first and second call, synced
        mx.eval(*inputs)
        ts = []
        for _ in range(2):
            t = time.perf_counter()
            mx.eval(op(*inputs))
            ts.append(1e3 * (time.perf_counter() - t))
        firsts.append(dict(kind=kind, rows=rows, width=width, first_ms=ts[0], second_ms=ts[1]))

    for W in (640, 1152, 1664):
        for R in (2, 4, 8, 16):
            mask = mx.array(np.where(rng.random((R, W)) < 0.9, 0, -60000).astype(np.float16))
            first_two("attention", R, W, lambda q, k, v, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m),
                      normal(1, 4, R, 64), normal(1, 2, W, 64), normal(1, 2, W, 64), mask)
    for R in (2, 4, 8, 16, 32):  # a GatedDeltaNet layer's depthwise conv over R windows (the demo hybrid's)
        first_two("conv1d", R, 4, lambda win, w: mx.conv1d(win, w, 1, 0, 1, 384), normal(R, 4, 384), normal(384, 4, 1))
    report = dict(meta=run_meta(section=args.section, target=args.target, arms=names), runs=rows, firsts=firsts)
    md = [f"# {args.section}: {args.target} on {report['meta']['device']} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          f"Generations ({args.n} prompts x {args.max_tokens} tokens, {args.reps} passes, one process): rounds over "
          f"{STALL_MS} ms.", "", "| arm | pass | seconds (median, max) | rounds over | their ms (sum) | node counts of the slowest |",
          "|---|---|---|---|---|---|"]
    for a in names:
        for rep in range(args.reps):
            rs = [r for r in rows if r["arm"] == a and r["rep"] == rep]
            slow = sorted((x for r in rs for x in r["slow"]), reverse=True)
            md.append(f"| {a} | {rep} | {statistics.median(r['wall_s'] for r in rs):.2f}, {max(r['wall_s'] for r in rs):.2f} "
                      f"| {len(slow)} | {sum(r['slow_ms'] for r in rs):.0f} | {', '.join(str(n) for _, n in slow[:8])} |")
    md += ["", "MLX's masked attention (float16, 4 query heads over 2, head dim 64) and a depthwise conv1d (384 "
           "channels, 4 taps) at shapes new to the process: ms of the first and the second call, synced.", "",
           "| op | rows | key columns or taps | first | second |", "|---|---|---|---|---|"]
    md += [f"| {x['kind']} | {x['rows']} | {x['width']} | {x['first_ms']:.2f} | {x['second_ms']:.2f} |" for x in firsts]
    write(args, report, md)


STALL_MS = 50.0


def launch_costs(n=200):
    """Host and device microseconds an op of each kind a queued round launches, each op fed the
    last one's output (so none is merged or skipped): {kind: build_us, launch_us, device_us}."""
    from mlx_treespec import attention
    from mlx_treespec.attention import kernel_backend
    from mlx_treespec.device_tree import run_walk

    W = 64
    perm = mx.array(np.random.default_rng(0).permutation(W).astype(np.int32))
    fused = mx.compile(lambda a: a * 0.999 + 0.5)
    mat = mx.ones((W, W)) / W
    rows = mx.array(np.random.default_rng(1).standard_normal((4, 4096)).astype(np.float32))
    kinds = {
        "take (a gather)": lambda a: mx.take(a, perm),
        "concatenate (two slices)": lambda a: mx.concatenate([a[W // 2:], a[: W // 2]]),
        "compiled elementwise (fused)": fused,
        "elementwise, not compiled": lambda a: a * 0.999,
        "[1, W] @ [W, W] matmul": lambda a: (a[None] @ mat)[0],
        "argmax (+ add)": lambda a: a + mx.argmax(a).astype(a.dtype),
        "arange (+ add)": lambda a: a + mx.arange(W, dtype=a.dtype),
        # ranking candidates sorts each row; a chain step takes its argmax
        "argsort of [4, 4096] rows (+ add)": lambda a: a + mx.argsort(rows + a[0], axis=-1)[0, -1].astype(a.dtype),
        "argmax of [4, 4096] rows (+ add)": lambda a: a + mx.argmax(rows + a[0], axis=-1)[0].astype(a.dtype),
    }
    # a head step's (1 row), a lane step's (4 or 8 rows) and a verify's (17) masked attention over
    # 1024 columns (the demo target's heads, float16): MLX's fused attention (cuDNN on CUDA; one
    # masked row runs MLX's unfused arithmetic, two matmuls and a softmax), and the
    # tree-attention kernel where it is usable
    rng = np.random.default_rng(2)
    # a head step's linear layer at the demo width (nn.Linear's x @ weight.T; float16 on a GPU,
    # float32 on CPU, gather_mm's only type there): on CUDA one row runs a matrix-vector kernel,
    # several rows a GEMM library call; and 1, 4 and 8 rows as that many matrix-vector products
    # in one `mx.gather_mm` (join.few_rows)
    half = np.float16 if mx.default_device() == mx.gpu else np.float32
    weight = mx.array(rng.standard_normal((1024, 384)).astype(half) / 20)
    for R in (1, 4, 8, 17):
        x = mx.array(rng.standard_normal((R, 384)).astype(half))
        kinds[f"[{R}, 384] @ [384, 1024] matmul (+ add)"] = lambda a, x=x: a + (
            x @ weight.T)[0, :W].astype(a.dtype)
    for R in (1, 4, 8):  # (one row: whether a chain step's layers would launch cheaper so too)
        xr = mx.array(rng.standard_normal((R, 1, 384)).astype(half))
        each, one = mx.arange(R, dtype=mx.uint32), mx.zeros((R,), mx.uint32)
        kinds[f"{R} x [1, 384] @ [384, 1024] gather_mm (+ add)"] = lambda a, xr=xr, each=each, one=one: a + mx.gather_mm(
            xr, weight.T[None], lhs_indices=each, rhs_indices=one, sorted_indices=False)[0, 0, :W].astype(a.dtype)
    backend = kernel_backend()
    tree_kernel = backend == "cuda" and attention.usable(mx.float16, 64)
    bounds = mx.array([1024 - 32, 1024], mx.int32)  # (the kernel reads the mask in these columns)
    for R in (1, 4, 8, 17):
        q, k, v = (mx.array(rng.standard_normal(sh).astype(np.float16))
                   for sh in ((1, 6, R, 64), (1, 2, 1024, 64), (1, 2, 1024, 64)))
        m = mx.array(np.where(rng.random((R, 1024)) < 0.9, 0, -60000).astype(np.float16))
        kinds[f"masked attention, {R} rows (+ add)"] = lambda a, q=q, k=k, v=v, m=m: a + mx.fast.scaled_dot_product_attention(
            q, k, v, scale=0.125, mask=m)[0, 0, 0, :W].astype(a.dtype)
        if tree_kernel:
            kinds[f"tree-attention kernel, {R} rows (+ add)"] = lambda a, q=q, k=k, v=v, m=m: a + attention.tree_attention(
                q, k, v, m, bounds, 0.125)[0, 0, 0, :W].astype(a.dtype)
    if backend is not None:  # the device walk's kernel on a 41-node one-lane tree
        from mlx_treespec.drafters.model import lanes_parents

        parents = lanes_parents(10, 4)
        tok = mx.zeros((len(parents),), mx.uint32)
        par = mx.array(parents.astype(np.int32))
        kinds["the walk kernel (+ add)"] = lambda a: a + run_walk(backend, tok, tok, par)[0].astype(a.dtype)
    out = {}
    for name, f in kinds.items():
        for reps in (8, n):  # (a warm-up, then the timed chain)
            a = mx.zeros((W,), mx.float32)
            mx.eval(a)
            t0 = time.perf_counter()
            for _ in range(reps):
                a = f(a)
            t1 = time.perf_counter()
            mx.async_eval(a)
            t2 = time.perf_counter()
            mx.eval(a)
            t3 = time.perf_counter()
        out[name] = dict(build_us=1e6 * (t1 - t0) / n, launch_us=1e6 * (t2 - t1) / n, device_us=1e6 * (t3 - t2) / n)
    return out


def run_pieces(args):
    """A DDTree round's pieces on one prompt of the unseen set, each synced and timed alone
    (medians of --repeats): the drafter's ranked block, the verify of its 32 nodes eager and
    compiled, the whole round both ways; plain decoding, mlx-lm's and this library's loop."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_treespec import tree_generate_step
    from mlx_treespec.builders import best_first_tree
    from mlx_treespec.drafters.dflash import DFlashDrafter
    from mlx_treespec.verify import TreeRound, capturing, install

    model, tok = load_target(args.target)
    install(model)
    prompt = encode_prompts(tok, load_prompts("unseen")[:1])[0][: args.history]
    dd = DFlashDrafter(Arms(model, args.target, []).dflash(), budget=31)
    caches = make_prompt_cache(model)
    with capturing(model, dd.capture) as cap:
        model(mx.array(prompt[:-1])[None], cache=caches)
        hidden = cap.hidden()
    mx.eval([c.state for c in caches], hidden)
    root, depth = prompt[-1], dd.depth
    dd.prefill(prompt, hidden)

    def timed(f, n=args.repeats, warm=5):
        for _ in range(warm):
            f()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return 1e3 * statistics.median(ts)

    def ranked():
        at = dd.length  # the block forward writes context rows: each timing starts from the same
        ids, top = dd.ranked(root, depth)
        dd.length = at
        return ids, top

    def draft():
        ids, top = ranked()
        return dd.as_draft(root, ids, best_first_tree(0, top, dd.budget), depth, dd.budget)

    def verify(d, compiled):
        rnd = TreeRound(model, caches, dd.capture, compiled=compiled)
        logits, _ = rnd.verify(d, None)
        mx.eval(mx.argmax(logits, -1), rnd.hidden, d.arrays())
        rnd.abort()

    d = draft()
    rows = {"ranked block (forward, top-k read back)": timed(ranked)}
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        rows[f"verify of 32 nodes, {name}"] = timed(lambda: verify(d, compiled))
        rows[f"round (ranked block, host tree, verify), {name}"] = timed(lambda: verify(draft(), compiled))
    record = {k: ({str(s): n for s, n in v.items()} if k == "checked" else v)
              for k, v in model.__dict__.get("_treespec_compiled_verify", {}).items() if k != "fns"}
    p = mx.array(prompt)
    rows["plain, mlx-lm generate_step, ms/token (64 tokens)"] = timed(
        lambda: [None for _ in generate_step(p, model, max_tokens=64)], n=5, warm=1) / 64
    rows["plain, this library's loop, ms/token (64 tokens)"] = timed(
        lambda: [None for _ in tree_generate_step(prompt, model, None, max_tokens=64)], n=5, warm=1) / 64
    report = dict(meta=run_meta(section=args.section, target=args.target, history=len(prompt)), ms=rows,
                  compiled_verify=record)
    md = [f"# {args.section}: {args.target} on {report['meta']['device']} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "",
          f"One unseen prompt ({len(prompt)} tokens), each piece synced, median of {args.repeats}; "
          f"DDTree budget 31 over the DFlash block. Compiled verify: {record}.", "",
          "| piece | ms |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in rows.items()]
    write(args, report, md)


def run_comm(args):
    """Collectives of a target sharded over two processes of `mlx.launch` on this machine's ring:
    count and bytes of every all_sum / all_gather / send / recv per round (per token for plain
    decoding), per arm, and what broadcasting each round's tree from one process would cost
    instead of drafting on every process. Launches itself once per --shard mode."""
    import shutil
    import subprocess

    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    report = dict(meta=run_meta(section=args.section, target=args.target, arms=args.arms.split(","),
                                max_tokens=args.max_tokens), modes={})
    md = [f"# {args.section}: {args.target} over 2 processes (ring, localhost; commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", ""]
    for mode in args.shard.split(","):
        rank_args = ["comm-rank", "--shard", mode, "--target", args.target, "--arms", args.arms,  # (mlx.launch
                     "--prompts", args.prompts, "--prompts-per-set", str(args.n),  # reads -n itself)
                     "--max-tokens", str(args.max_tokens)]
        out = subprocess.run([launcher, "--backend", "ring", "-n", "2", "--python", sys.executable, __file__]
                             + rank_args, capture_output=True, text=True, timeout=1800)
        rows = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not rows:
            raise SystemExit(f"the {mode} launch printed no result:\n{out.stderr[-3000:]}")
        res = report["modes"][mode] = rows[0]
        md += [f"## {mode} parallel ({res['prompts']} prompts x {args.max_tokens} tokens)", "",
               "| arm | rounds (plain: tokens) | target forwards | emitted/verify | collectives / round | KB / round "
               "| by kind / forward: calls (KB) | draft ms / round | identical to plain |",
               "|---|---|---|---|---|---|---|---|---|"]
        for arm, r in res["arms"].items():
            kinds = ", ".join(f"{k} {c:.2f} ({b / 1e3:.2f})" for k, (c, b) in sorted(r["per_forward"].items()))
            md.append(f"| {arm} | {r['rounds']} | {r['forwards']} | {r['emitted_per_verify']:.2f} | "
                      f"{r['calls_per_round']:.1f} | {r['bytes_per_round'] / 1e3:.1f} | {kinds} | {r['draft_ms']:.2f} | "
                      f"{r['identical']} |")
        b = res["broadcast"]
        md += ["", f"A broadcast of one round's tree ({b['ints']} int32: tokens and parents) is one all_sum "
                   f"of {b['ints'] * 4} bytes: {b['ms']:.2f} ms median on this ring ({b['repeats']} repeats).", ""]
    write(args, report, md)


def run_comm_rank(args):
    """One process of `run_comm`'s launch; rank 0 prints `RESULT {json}`."""
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    target, tok = sharded_load(resolve_model_path(args.target), **{f"{args.shard}_group": group})
    counts = {}

    def counting(name, fn, nbytes):
        def wrapped(*a, **k):
            c = counts.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += nbytes(*a, **k)
            return fn(*a, **k)
        return wrapped

    dist = mx.distributed
    for name in ("all_sum", "all_gather", "send", "recv_like"):
        setattr(dist, name, counting(name, getattr(dist, name), lambda x, *a, **k: x.nbytes))
    dist.recv = counting("recv", dist.recv, lambda shape, dtype, *a, **k: int(np.prod(shape)) * dtype.size)
    cls = type(target)  # the target's forwards: collectives per forward
    cls.__call__ = counting("forward", cls.__call__, lambda *a, **k: 0)

    texts = load_prompts(args.prompts.split(",")[0])[: args.n]
    prompts = encode_prompts(tok, texts)
    arms = Arms(target, args.target, texts)
    names = ["plain"] + [a for a in args.arms.split(",") if a and a != "plain"]
    result = dict(prompts=len(prompts), arms={})
    ref = {}
    for arm in names:
        make = arms.maker(arm)
        list(tree_generate_step(prompts[0], target, make(), max_tokens=8))  # warm-up
        tot, rounds, emitted, draft_ms, same = {}, 0, 0, 0.0, 0
        for i, p in enumerate(prompts):
            seen, stats = {}, RoundStats()

            def prefilled(done, total):  # counted from here: the prefill left out
                if done == total:
                    seen.update({k: list(v) for k, v in counts.items()})

            counts.clear()
            out = [int(t) for t, _, _ in tree_generate_step(p, target, make(), max_tokens=args.max_tokens,
                                                           stats=stats, prompt_progress_callback=prefilled)]
            for k, (c, b) in counts.items():
                c0, b0 = seen.get(k, [0, 0])
                t = tot.setdefault(k, [0, 0])
                t[0], t[1] = t[0] + c - c0, t[1] + b - b0
            rounds, emitted, draft_ms = rounds + stats.rounds, emitted + sum(stats.emitted), draft_ms + sum(stats.draft_ms)
            ref.setdefault(i, out)
            same += out == ref[i]
        forwards = tot.pop("forward", [0, 0])[0]
        result["arms"][arm] = dict(
            rounds=rounds, forwards=forwards, emitted_per_verify=emitted / max(rounds, 1),
            calls_per_round=sum(c for c, _ in tot.values()) / max(rounds, 1),
            bytes_per_round=sum(b for _, b in tot.values()) / max(rounds, 1),
            per_round={k: (c / max(rounds, 1), b / max(rounds, 1)) for k, (c, b) in tot.items()},
            per_forward={k: (c / max(forwards, 1), b / max(forwards, 1)) for k, (c, b) in tot.items()},
            draft_ms=draft_ms / max(rounds, 1), identical=f"{same}/{len(prompts)}")
    # the alternative to a replicated drafter: one process drafts and sends the tree to the others
    ints, times = 2 * 32, []
    probe = mx.zeros((ints,), mx.int32)
    for r in range(35):
        t0 = time.perf_counter()
        mx.eval(dist.all_sum(probe))
        if r >= 5:
            times.append(1e3 * (time.perf_counter() - t0))
    result["broadcast"] = dict(ints=ints, ms=statistics.median(times), repeats=len(times))
    if group.rank() == 0:
        print("RESULT " + json.dumps(result, default=_json), flush=True)


def run_paths(args):
    """Verify paths on this device, tiny float32 models (tests/tiny.py): for deepseek_v3 (latent
    attention), qwen3 and qwen3_5, tree speculation (a sibling tree, depth 3, two per depth)
    against mlx-lm's generate_step and the exactness probe; for qwen3_5 also a hybrid draft
    model's chain and EAGLE-2 tree. A device check for paths the CPU tests pin bitwise."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny
    from mlx_lm.generate import generate_step

    from mlx_treespec import make_drafter
    from mlx_treespec.probe import probe_exactness, representative_tree_parents
    from mlx_treespec.tree import chain_parents

    report = dict(meta=run_meta(section=args.section), rows=[])
    md = [f"# {args.section} on {report['meta']['device']} (commit {_commit(report['meta'])})", "",
          f"`python bench/run.py {' '.join(sys.argv[1:])}`", "", "| target | drafter | probe | tokens equal |",
          "|---|---|---|---|"]
    for name, cfg in (("deepseek_v3", tiny.COVERAGE["deepseek_v3"]), ("qwen3", tiny.CONFIGS["qwen3"]),
                      ("qwen3_5", tiny.CONFIGS["qwen3_5"])):
        model = tiny.build(cfg)
        drafters = {"siblings 3x2": tiny.SiblingDrafter(tiny.perturbed(model), 3, 2)}
        if name == "qwen3_5":  # (copies made before the probe keeps compiled state on the model)
            drafters.update({k: make_drafter(tiny.perturbed(model), **v) for k, v in (
                ("hybrid draft model, chain 3", dict(draft_block_size=3)),
                ("hybrid draft model, tree K2 S3 B6", dict(tree_topk=2, tree_depth=3, tree_budget=6)))})
        prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, 8).tolist()
        ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=32)]
        rows = []
        for label, drafter in drafters.items():
            stats = RoundStats()
            out = [int(t) for t, _, _ in tree_generate_step(prompt, model, drafter, max_tokens=32, stats=stats)]
            rows.append(dict(target=name, drafter=label, identical=out == ref,
                             emitted_per_verify=stats.summary()["emitted_per_verify"]))
        probe = probe_exactness(model, [chain_parents(4), representative_tree_parents(2, 4, 10)], n_inputs=2,
                                history=12)
        for r in rows:
            r["probe"] = probe.message()
            md.append(f"| {r['target']} | {r['drafter']} ({r['emitted_per_verify']:.2f} emitted/verify) | "
                      f"{r['probe']} | {r['identical']} |")
        report["rows"] += rows
    write(args, report, md)


def make_unseen_prompts(args):
    """Prompts from text the demo models never saw: this project's own source files (written
    after the demo corpus was collected from a Python installation's stdlib and site-packages).
    Each prompt is ~200 characters from a seeded random line start, extended to the line's end."""
    rng = random.Random(0)
    files = sorted(p for d in ("mlx_treespec", "tests", "bench") for p in (ROOT / d).rglob("*.py")
                   if p.stat().st_size > 3000)
    prompts = []
    for p in files:
        text = p.read_text()
        lines = text.splitlines(keepends=True)
        starts = [sum(len(l) for l in lines[:i]) for i in range(len(lines)) if i and lines[i].strip()]
        s = rng.choice(starts[: max(len(starts) * 3 // 4, 1)])
        end = text.find("\n", s + 200)
        prompts.append(dict(source=str(p.relative_to(ROOT)), prompt=text[s : end + 1 if end > 0 else None]))
    rng.shuffle(prompts)
    doc = dict(about="Source text the demo models never saw in training: this project's own Python files "
                     "(bench/run.py unseen-prompts)", commit=run_meta()["commit"], prompts=prompts[: args.n])
    path = ROOT / "bench" / "unseen_prompts.json.gz"
    path.write_bytes(gzip.compress((json.dumps(doc, indent=1) + "\n").encode(), mtime=0))
    print(f"wrote {len(doc['prompts'])} prompts to {path}")


def make_train_prompts(args):
    """Prompts from the demo corpus's training split, as the demo pair's trainer splits it: this
    machine's Python stdlib, files whose sha1(relpath) % 50 != 0 (bench/train_demo_pair.py), the
    first by sha1 of the path with >= 3000 characters; each ~200 characters from a seeded random
    line start, extended to the line's end: the `train` prompt set, text like the training text
    and neither evaluation set."""
    import hashlib
    import sysconfig

    rng = random.Random(0)
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = []
    for f in stdlib.rglob("*.py"):
        rel = "stdlib/" + f.relative_to(stdlib).as_posix()
        if "site-packages" in rel or int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0:
            continue
        files.append((hashlib.sha1(rel.encode()).hexdigest(), rel, f))
    prompts = []
    for _, rel, f in sorted(files):
        try:
            text = f.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 3000:
            continue
        lines = text.splitlines(keepends=True)
        starts = [sum(len(l) for l in lines[:i]) for i in range(len(lines)) if i and lines[i].strip()]
        s = rng.choice(starts[: max(len(starts) * 3 // 4, 1)])
        end = text.find("\n", s + 200)
        prompts.append(dict(source=rel, prompt=text[s : end + 1 if end > 0 else None]))
        if len(prompts) == args.n:
            break
    doc = dict(about="The demo corpus's training split (this machine's Python stdlib, sha1(relpath) % 50 != 0): "
                     "the `train` prompt set (bench/run.py train-prompts)", commit=run_meta()["commit"],
               prompts=prompts)
    path = ROOT / "bench" / "train_prompts.json.gz"
    path.write_bytes(gzip.compress((json.dumps(doc, indent=1) + "\n").encode(), mtime=0))
    print(f"wrote {len(prompts)} prompts to {path}")


def write(args, report, md, echo=True):
    text = "\n".join(md) + "\n"
    if echo:
        print(text)
    if args.out:
        out = Path(args.out)
    else:
        meta = report["meta"]
        out = ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}_{meta['commit']}_{args.section}"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text)
    raw = (json.dumps(compact(report), separators=(",", ":"), default=_json) + "\n").encode()
    Path(f"{out}.json.gz").write_bytes(gzip.compress(raw, mtime=0))
    log(f"wrote {out}.md and {out}.json.gz")


def read_json(path):
    """A JSON file, or one this harness wrote (.json.gz)."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)


def compact(o, digits=5):
    """The report with floats at `digits` significant digits (timings are not more precise than
    that; the raw files stay small enough to travel with every device call)."""
    if isinstance(o, dict):
        return {k: compact(v, digits) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [compact(v, digits) for v in o]
    if isinstance(o, (float, np.floating)) and np.isfinite(o):
        return float(f"{float(o):.{digits}g}")
    return o


def _json(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(type(o).__name__)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["loop", "acceptance", "proj", "long", "pieces", "round-host", "draft-kernels", "comm", "comm-rank",
                                       "paths", "bound", "unseen-prompts", "train-prompts", "table", "attn", "topk",
                                       "head-step", "stalls"])
    p.add_argument("--section", default=None, help="the results file's section name (default: the command)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="attn: query rows; head-step: a step's "
                                                              "rows; topk: logits rows")
    p.add_argument("--draft-vocab", type=int, default=32768, help="head-step: the draft vocabulary's ids")
    p.add_argument("--widths", default="1024,4096", help="attn: key columns; topk: vocabulary widths")
    p.add_argument("--target", default="demo")
    p.add_argument("--draft-model", default=None, help="draft model(s), comma separated: an arm ending in /di "
                                                            "drafts with the i-th (chain:4/d2)")
    p.add_argument("--dflash", default=None, help="DFlash drafter folder(s), comma separated as --draft-model "
                                                       "(default: the demo target's)")
    p.add_argument("--mtp", default=None, help="folder(s) with the target's mtp.* weights, comma separated as "
                                                    "--draft-model (default: the target's)")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 folder(s), comma separated as --draft-model "
                                                       "(default: the demo target's)")
    p.add_argument("--arms", default=None, help="default plain,chain:7,tree:3:8; proj: which of the "
                   "acceptance file's arms (default: all of the family's)")
    p.add_argument("--prompts", default="unseen,heldout", help="prompt sets or files, comma separated")
    p.add_argument("--n", "--prompts-per-set", dest="n", type=int, default=20, help="prompts per set")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="loop, acceptance: sample at this temperature (every "
                   "arm's tokens checked against this library's plain sampled decoding)")
    p.add_argument("--seed", type=int, default=0, help="loop, acceptance: the sampling seed (--temp)")
    p.add_argument("--reps", type=int, default=1, help="loop: runs of each prompt per arm (pooled per prompt)")
    p.add_argument("--seconds", type=float, default=None, help="loop: start no prompt after this (all sets)")
    p.add_argument("--versus", default=None, help="loop, table: a column of each arm's tok/s over this arm's, "
                                                   "per prompt")
    p.add_argument("--from", dest="source", default=None, help="table: a loop's JSON")
    p.add_argument("--ratio", default=None, help="acceptance: print A/B of two arms' emitted per verify")
    p.add_argument("--acceptance", default=None, help="proj: a loop or acceptance JSON (a comma list: "
                   "each arm's figure from the first file that has it)")
    p.add_argument("--prompt-set", default=None, help="proj: which set of that JSON")
    p.add_argument("--config", default="bench/configs/qwen3_8b.json")
    p.add_argument("--family", default="dflash", choices=["dflash", "mtp", "eagle3"], help="proj: which drafter")
    p.add_argument("--head-config", default="bench/configs/qwen3_8b_dflash.json",
                   help="proj: the drafter's config (DFlash or EAGLE-3 JSON; MTP: built from the target's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--q-bits", default="0,4")
    p.add_argument("--draft-q-bits", default="same",
                   help="proj: the drafter's bits, a comma list (0: unquantized, in --dtype); 'same': the target's")
    p.add_argument("--costs", default=None, help="proj: round costs measured elsewhere (JSON) instead of timing here")
    p.add_argument("--history", type=int, default=512)
    p.add_argument("--split-launch", action="store_true",
                   help="round-host: launch each piece's kernels as it returns and time each launch")
    p.add_argument("--cpu-queued", action="store_true",
                   help="round-host on CPU: run the GPU's queued rounds (whole-buffer verify) to count each round's "
                        "kernels; CPU times are not speed")
    p.add_argument("--contexts", default="1024,8192,32768", help="long: committed tokens before the verify")
    p.add_argument("--nodes", type=int, default=32, help="long: tree nodes (and causal tokens) per forward")
    p.add_argument("--nodes-list", default="2,3,5,8,10,12,15,20,30,45", help="bound: tree sizes")
    p.add_argument("--depth", type=int, default=12, help="bound: the deepest head step")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--overhead-ms", type=float, default=0.5)
    p.add_argument("--rounds", action="store_true",
                   help="proj: time whole rounds of each arm (queued where they queue) instead of "
                        "summing the verify and the draft")
    p.add_argument("--round-reps", type=_at_least_one, default=3,
                   help="proj --rounds: time each arm's rounds (and plain decoding) this many times, in turn")
    p.add_argument("--shard", default="tensor,pipeline", help="comm: how the target is split over the processes")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json instead of bench/results/")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    args.section = args.section or args.command
    if args.arms is None and args.command != "proj":
        args.arms = "plain,chain:7,tree:3:8"
    {"loop": run_loop, "acceptance": run_acceptance, "proj": run_proj, "long": run_long,
     "pieces": run_pieces, "round-host": run_round_host, "stalls": run_stalls, "draft-kernels": run_draft_kernels, "attn": run_attn, "topk": run_topk, "head-step": run_head_step, "bound": run_bound, "comm": run_comm, "comm-rank": run_comm_rank, "paths": run_paths,
     "unseen-prompts": make_unseen_prompts, "train-prompts": make_train_prompts,
     "table": run_table}[args.command](args)


if __name__ == "__main__":
    main()
