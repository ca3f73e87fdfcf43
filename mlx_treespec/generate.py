"""The speculative round loop, mlx-lm-style library calls, and the command line.

Each round: draft -> verify -> walk -> commit. The drafter proposes a tree rooted at the last
emitted token; the target runs every node in one forward; the walk follows the target's own
choices down the tree; the caches keep the accepted path only. Greedy output is the target's own
greedy output, token for token.
"""
import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .cache import committed_offset, leading_run
from .drafters import root_only
from .sampling import make_node_sampler
from .support import require_tree_support
from .tree import MAX_NODES, DraftTree
from .verify import TreeRound, cached_array
from .walk import greedy_walk

DEFAULT_QUANTIZED_KV_START = 5000
# Queue the draft before building the verify? (bench/round_parts_bench.py times both)
QUEUE_DRAFT = True
# The draft shape when none is given (topk, lanes, depth): a spine of 8 with each step's two
# runners-up, the fastest tree on the H200 with the demo pair (bench/RESULTS.md, section 1)
DEFAULT_TREE = (3, 1, 8)
# --tree-branches without --tree-fork-below: 1 forks the branches at the first steps with no
# probability read back (each read cost ~1.6 ms a round on the H200: bench/RESULTS.md, 1b)
DEFAULT_FORK_BELOW = 1.0

__all__ = ["tree_generate_step", "stream_generate", "generate", "RoundStats", "main"]


@dataclass
class RoundStats:
    """Per-round figures of one generation; `summary()` condenses them."""

    accepted: List[int] = field(default_factory=list)  # draft tokens accepted per round
    emitted: List[int] = field(default_factory=list)  # tokens emitted per round (per verify)
    nodes: List[int] = field(default_factory=list)  # nodes verified per round (root included)
    depth: List[int] = field(default_factory=list)  # effective tree depth per round
    held: List[int] = field(default_factory=list)  # accepted tokens left for the next forward
    requested_budget: List[int] = field(default_factory=list)
    requested_depth: List[int] = field(default_factory=list)
    draft_ms: List[float] = field(default_factory=list)
    verify_ms: List[float] = field(default_factory=list)
    round_ms: List[float] = field(default_factory=list)
    sync_ms: List[float] = field(default_factory=list)  # waiting in the round's one host sync
    walk_ms: List[float] = field(default_factory=list)  # after the sync: walk and commits
    prompt_ms: float = 0.0

    @property
    def rounds(self):
        return len(self.emitted)

    def acceptance_by_depth(self):
        """Fraction of rounds reaching depth d, among rounds whose tree was at least d deep."""
        depth = np.array(self.depth)
        acc = np.array(self.accepted)
        out = []
        for d in range(1, int(depth.max(initial=0)) + 1):
            has = depth >= d
            out.append(float((acc[has] >= d).mean()))
        return out

    def summary(self):
        n = max(self.rounds, 1)
        return {
            "rounds": self.rounds,
            "emitted": int(sum(self.emitted)),
            "emitted_per_verify": sum(self.emitted) / n,
            "accepted_per_round": sum(self.accepted) / n,
            "nodes_per_round": sum(self.nodes) / n,
            "held_per_round": sum(self.held) / n,
            "acceptance_by_depth": self.acceptance_by_depth(),
            "requested_budget": max(self.requested_budget, default=0),
            "effective_budget": (sum(self.nodes) - self.rounds) / n,
            "requested_depth": max(self.requested_depth, default=0),
            "effective_depth": sum(self.depth) / n,
            "draft_ms_per_round": sum(self.draft_ms) / n,
            "verify_ms_per_round": sum(self.verify_ms) / n,
            "round_ms": sum(self.round_ms) / n,
            "sync_ms_per_round": sum(self.sync_ms) / n,
            "walk_ms_per_round": sum(self.walk_ms) / n,
            "prompt_ms": self.prompt_ms,
        }

    def format(self):
        s = self.summary()
        by_depth = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"])
        return (
            f"Rounds: {s['rounds']}, emitted/verify: {s['emitted_per_verify']:.3f}, "
            f"accepted/round: {s['accepted_per_round']:.3f}, re-run next round: {s['held_per_round']:.3f}\n"
            f"Nodes/round: {s['nodes_per_round']:.2f} (budget requested {s['requested_budget']}, "
            f"effective {s['effective_budget']:.2f}; depth requested {s['requested_depth']}, "
            f"effective {s['effective_depth']:.2f})\n"
            f"Acceptance by depth: {by_depth or '-'}\n"
            f"Draft {s['draft_ms_per_round']:.2f} ms/round, verify {s['verify_ms_per_round']:.2f} "
            f"ms/round, round {s['round_ms']:.2f} ms (of which waiting on the device "
            f"{s['sync_ms_per_round']:.2f}, walk and commit {s['walk_ms_per_round']:.2f})"
        )


def _maybe_quantize(caches, kv_bits, kv_group_size, quantized_kv_start):
    # mlx-lm's rule, applied at the same token boundaries as plain decoding
    if kv_bits is None:
        return
    for i, c in enumerate(caches):
        if hasattr(c, "to_quantized") and c.offset >= quantized_kv_start:
            caches[i] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)


def _prefill(model, caches, prompt, prefill_step_size, quantize, progress):
    """Process all prompt tokens but the last, in mlx-lm's chunks; the last is the first root."""
    total = len(prompt)
    done = 0
    progress(done, total)
    while total - done > 1:
        n = min(prefill_step_size, total - done - 1)
        model(mx.array(prompt[done : done + n])[None], cache=caches)
        quantize(caches)
        mx.eval([c.state for c in caches])
        done += n
        progress(done, total)
        mx.clear_cache()


def tree_generate_step(
    prompt,
    model,
    drafter=None,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    top_k: int = 0,
    min_tokens_to_keep: int = 1,
    seed: int = 0,
    prompt_cache: Optional[List[Any]] = None,
    max_kv_size: Optional[int] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stop_tokens=(),
    stats: Optional[RoundStats] = None,
    sync_timing: bool = False,
):
    """Yields (token, logprobs, from_draft) like mlx-lm's generate steps.

    `prompt_cache` (the target's caches) is used in place: afterwards it holds the prompt and
    every emitted token, as mlx-lm's generate leaves it (the last token costs one more forward,
    made only when a cache was passed in). The drafter keeps its own caches.
    With `stop_tokens`, emission ends at the first of them (included).
    """
    prompt = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    if not prompt:
        raise ValueError("the prompt is empty: pass at least one token")
    if kv_bits is not None and max_kv_size is not None:
        raise ValueError("kv_bits and max_kv_size cannot be combined (mlx-lm cannot quantize a rotating cache)")
    caches = prompt_cache if prompt_cache is not None else make_prompt_cache(model, max_kv_size=max_kv_size)
    choose = make_node_sampler(temp, top_p, min_p, top_k, min_tokens_to_keep, seed)
    stop_tokens = set(int(t) for t in stop_tokens)
    stats = stats if stats is not None else RoundStats()

    def quantize(cs):
        _maybe_quantize(cs, kv_bits, kv_group_size, quantized_kv_start)

    tic = time.perf_counter()
    _prefill(model, caches, prompt, prefill_step_size, quantize, prompt_progress_callback or (lambda *_: None))
    if drafter is not None:
        drafter.prefill(prompt)
    stats.prompt_ms = 1e3 * (time.perf_counter() - tic)

    root = prompt[-1]
    if drafter is None and max_tokens != 0:
        yield from _plain_decode(model, caches, root, max_tokens, choose, quantize, stop_tokens,
                                 stats, forward_last=prompt_cache is not None)
        return
    n = 0
    held_tokens = None  # accepted tokens whose K/V the target did not keep: they lead the next forward
    while max_tokens < 0 or n < max_tokens:
        room = float("inf") if max_tokens < 0 else max_tokens - n
        base = committed_offset(caches)
        max_depth = int(min(room - 1, MAX_NODES - 1))
        if kv_bits is not None and base < quantized_kv_start:
            # plain decoding quantizes once the offset reaches the start: no node may cross it
            max_depth = min(max_depth, quantized_kv_start - base - 1)
        t0 = time.perf_counter()
        # draft
        draft = drafter.draft(root, max_depth) if drafter is not None else root_only(root)
        if draft.size > MAX_NODES:
            raise ValueError(f"the drafter proposed {draft.size} nodes; at most {MAX_NODES} fit")
        if sync_timing:
            mx.eval(draft.tokens)
        elif QUEUE_DRAFT:  # the device drafts while the host builds the verify
            mx.async_eval(draft.arrays())
        t1 = time.perf_counter()
        # verify
        rnd = TreeRound(model, caches)
        logits, depths = _verify(rnd, draft, held_tokens)
        chosen = choose(logits, None if temp == 0 else base + depths)
        ts = time.perf_counter()
        mx.eval(draft.arrays(), chosen)
        tw = time.perf_counter()
        # walk
        tree = DraftTree(np.array(draft.tokens).astype(np.int64), draft.host_parents())
        path, emitted = greedy_walk(tree, np.array(chosen).astype(np.int64), max_emit=None if room == float("inf") else int(room))
        emitted = [int(t) for t in emitted]
        accepted = len(path) - 1
        for i, t in enumerate(emitted):
            if t in stop_tokens:
                emitted = emitted[: i + 1]
                break
        path = path[: len(emitted)]
        # commit: where the path leaves the nodes' order, moving K/V would cost a gather per
        # layer; append caches keep the leading run and re-run the rest with the next round
        p = 0 if held_tokens is None else held_tokens.shape[0]
        keep = np.concatenate([np.arange(p), p + path])
        run = leading_run(keep) if rnd.all_append and kv_bits is None else len(keep)
        rnd.commit(keep[:run])
        nodes = (keep[run:] - p).tolist()  # tree nodes: the held lead is always kept
        # the held tokens stay on the device (slices, no host copy): the next verify reads them
        held_tokens = mx.concatenate([draft.tokens[i : i + 1] for i in nodes]) if nodes else None
        quantize(caches)
        if drafter is not None:
            drafter.commit(draft, path, emitted)
        t2 = time.perf_counter()
        stats.accepted.append(accepted)
        stats.emitted.append(len(emitted))
        stats.nodes.append(draft.size)
        stats.depth.append(int(tree.max_depth))
        stats.held.append(len(nodes))
        stats.requested_budget.append(draft.requested_budget)
        stats.requested_depth.append(draft.requested_depth)
        stats.draft_ms.append(1e3 * (t1 - t0))
        stats.verify_ms.append(1e3 * (t2 - t1))
        stats.round_ms.append(1e3 * (t2 - t0))
        stats.sync_ms.append(1e3 * (tw - ts))
        stats.walk_ms.append(1e3 * (t2 - tw))
        logprobs = logits[cached_array(path.astype(np.int32))]
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        for i, t in enumerate(emitted):
            n += 1
            yield t, logprobs[i], i < accepted
        root = emitted[-1]
        if root in stop_tokens:
            break
    if prompt_cache is not None:
        last = mx.array([root], mx.uint32)
        if held_tokens is not None:
            last = mx.concatenate([held_tokens, last])
        model(last[None], cache=caches)
        quantize(caches)
        mx.eval([c.state for c in caches])


def _verify(rnd, draft, held_tokens):
    """One target forward: `held_tokens` (mx array: accepted earlier, not in the caches yet;
    or None) as a chain, the draft tree hung from the last of them. Returns the tree's logits
    and its nodes' round depths (mx int32). No host array is made here: on a GPU one would
    wait for the queued draft."""
    p, n = (0 if held_tokens is None else held_tokens.shape[0]), draft.size
    tokens = mx.concatenate([held_tokens, draft.tokens]) if p else draft.tokens
    if draft.visible is not None and rnd.all_append:  # the topology stays on the device
        depths, rows = draft.depths, draft.visible
        if p:
            depths = mx.concatenate([mx.arange(p, dtype=mx.int32), depths.astype(mx.int32) + p])
            lead = np.concatenate([np.tril(np.ones((p, p), bool)), np.zeros((p, n), bool)], axis=1)
            rows = mx.concatenate([cached_array(lead), mx.concatenate(
                [mx.ones((n, p), mx.bool_), rows], axis=1)], axis=0)
        logits = rnd.forward_rows(tokens, depths, rows)
    else:
        parents = draft.host_parents()
        if p:
            parents = np.concatenate([np.arange(p) - 1, np.where(parents < 0, p - 1, parents + p)])
        logits = rnd.forward(tokens, parents)
        depths = cached_array(rnd.depths.astype(np.int32))
    return (logits[p:], depths[p:]) if p else (logits, depths)


def _plain_decode(model, caches, root, max_tokens, choose, quantize, stop_tokens, stats, forward_last):
    """Decoding without a drafter, pipelined as mlx-lm's generate_step: the forward of token n
    is queued before the host reads it, so the device never waits on Python."""

    def step(token, position):
        logits = model(token.reshape(1, 1), cache=caches)[0]
        quantize(caches)
        return choose(logits, None if choose.greedy else mx.array([position], mx.int32)), logits

    position = committed_offset(caches)
    y, logits = step(mx.array([root], mx.uint32), position)
    mx.async_eval(y)
    n, forwarded = 0, False
    tic = time.perf_counter()
    while True:
        n += 1
        last = 0 <= max_tokens <= n
        if not last:  # queue the next forward before reading this token
            next_y, next_logits = step(y, position + 1)
            mx.async_eval(next_y)
        ts = time.perf_counter()
        token = y.item()
        toc = time.perf_counter()
        stats.accepted.append(0)
        stats.emitted.append(1)
        stats.nodes.append(1)
        stats.depth.append(0)
        stats.held.append(0)
        stats.requested_budget.append(0)
        stats.requested_depth.append(0)
        stats.draft_ms.append(0.0)
        stats.verify_ms.append(1e3 * (toc - tic))
        stats.round_ms.append(1e3 * (toc - tic))
        stats.sync_ms.append(1e3 * (toc - ts))
        stats.walk_ms.append(0.0)
        tic = toc
        yield token, logits[0] - mx.logsumexp(logits[0], keepdims=True), False
        if last or token in stop_tokens:
            forwarded = not last
            break
        y, logits, position = next_y, next_logits, position + 1
    if forward_last:  # the cache ends holding every emitted token
        if not forwarded:
            model(y.reshape(1, 1), cache=caches)
            quantize(caches)
        mx.eval([c.state for c in caches])


def make_drafter(draft_model=None, *, drafter=None, draft_block_size=None, tree_topk=None,
                 tree_depth=None, tree_budget=None, tree_lanes=None, tree_branches=None,
                 tree_fork_below=None, draft_lookup=None, draft_lookup_trust=0):
    """The drafter for a set of mlx-lm-style options: a chain of `draft_block_size`, or an
    EAGLE-2 tree of `tree_topk` children per node (default 1: a chain), `tree_lanes` nodes
    expanded per step (default `tree_topk`), `tree_depth` steps and `tree_budget` nodes; or, with
    `tree_branches`, the spine and its `tree_topk` - 1 runners-up plus branches drafted as batch
    rows of the draft model, forked where the spine's top probability is below
    `tree_fork_below`. With no shape option at all: `DEFAULT_TREE`. `draft_lookup` N > 0 hangs
    a prompt-lookup chain of up to N tokens from the same root (drafters/merged.py); with
    `draft_lookup_trust` n, rounds whose lookup matched n tokens or more skip the draft model."""
    if draft_lookup is not None and not 0 <= draft_lookup <= MAX_NODES - 2:
        raise ValueError(f"--draft-lookup counts lookup nodes: 0..{MAX_NODES - 2}, got {draft_lookup}")
    if draft_lookup_trust and not draft_lookup:
        raise ValueError("--draft-lookup-trust needs --draft-lookup N (the lookup it trusts)")
    if draft_lookup_trust is not None and not 0 <= draft_lookup_trust <= 4:
        raise ValueError(f"--draft-lookup-trust is a match length in 0..4 (the lookup's longest n-gram), "
                         f"got {draft_lookup_trust}")
    if drafter is not None:
        if draft_lookup:
            raise ValueError("--draft-lookup adds lookup nodes to a draft model's tree: use it with "
                             "--draft-model, not --drafter")
        return drafter
    if draft_model is None:
        if draft_lookup:
            raise ValueError("--draft-lookup adds lookup nodes to a draft model's tree: give --draft-model")
        return None
    base = _model_drafter(draft_model, draft_block_size, tree_topk, tree_depth, tree_budget, tree_lanes,
                          tree_branches, tree_fork_below)
    if not draft_lookup:
        return base
    from .drafters.lookup import LookupDrafter
    from .drafters.merged import MergedDrafter

    return MergedDrafter(base, LookupDrafter(budget=draft_lookup, max_depth=draft_lookup, branches=1),
                         trust=draft_lookup_trust or 0)


def _model_drafter(draft_model, draft_block_size, tree_topk, tree_depth, tree_budget, tree_lanes,
                   tree_branches, tree_fork_below):
    from .drafters.model import ModelDrafter

    if tree_branches is not None or tree_fork_below is not None:
        return _branch_drafter(draft_model, draft_block_size, tree_topk, tree_depth, tree_budget,
                               tree_lanes, tree_branches, tree_fork_below)
    if all(o is None for o in (draft_block_size, tree_topk, tree_depth, tree_budget, tree_lanes)):
        tree_topk, tree_lanes, tree_depth = DEFAULT_TREE
    tree_topk = 1 if tree_topk is None else tree_topk
    if tree_topk < 1 or tree_topk > 16:
        raise ValueError(f"--tree-topk must be in 1..16, got {tree_topk}")
    lanes = tree_topk if tree_lanes is None else tree_lanes
    if not 1 <= lanes <= tree_topk:
        raise ValueError(f"--tree-lanes must be in 1..--tree-topk ({tree_topk}), got {lanes}")
    if draft_block_size is not None and (tree_depth is not None or tree_topk > 1):
        raise ValueError("give either --draft-block-size (a chain) or --tree-topk/--tree-depth (a tree), not both")
    depth = draft_block_size if draft_block_size is not None else (tree_depth if tree_depth is not None else 4)
    if depth < 0 or depth > MAX_NODES - 1:
        raise ValueError(f"the draft depth must be in 0..{MAX_NODES - 1}, got {depth}")
    budget = depth if tree_topk == 1 else (tree_budget if tree_budget is not None else min(MAX_NODES - 1, 4 * depth))
    if tree_topk > 1 and not 1 <= budget <= MAX_NODES - 1:
        raise ValueError(f"--tree-budget counts draft nodes without the root: 1..{MAX_NODES - 1}, got {budget}")
    return ModelDrafter(draft_model, topk=tree_topk, depth=depth, budget=budget, lanes=lanes)


def _branch_drafter(draft_model, block, topk, depth, budget, lanes, branches, fork_below):
    from .drafters.branch import BranchDrafter

    if block is not None or budget is not None or lanes is not None:
        raise ValueError("--tree-branches drafts the spine, its runners-up and its branches as "
                         "batch rows: give --tree-topk and --tree-depth with it, not "
                         "--draft-block-size, --tree-budget or --tree-lanes")
    topk = 1 if topk is None else topk
    if not 1 <= topk <= 16:
        raise ValueError(f"--tree-topk must be in 1..16, got {topk}")
    depth = 8 if depth is None else depth
    if not 0 <= depth <= MAX_NODES - 1:
        raise ValueError(f"the draft depth must be in 0..{MAX_NODES - 1}, got {depth}")
    return BranchDrafter(draft_model, topk=topk, depth=depth, rows=2 if branches is None else branches,
                         fork_below=DEFAULT_FORK_BELOW if fork_below is None else fork_below)


def _check_vocab(model, draft_model):
    def vocab(m):
        args = getattr(m, "args", None)
        v = getattr(args, "vocab_size", None)
        if v is None and args is not None and getattr(args, "text_config", None):
            v = args.text_config.get("vocab_size")
        return v

    vt, vd = vocab(model), vocab(draft_model)
    if vt is not None and vd is not None and vt != vd:
        raise ValueError(
            f"the draft model's vocabulary ({vd} tokens) differs from the target's ({vt}): "
            "use a drafter trained with the target's tokenizer"
        )


def stream_generate(model, tokenizer, prompt, draft_model=None, *, max_tokens=256, drafter=None,
                    draft_block_size=None, tree_topk=None, tree_depth=None, tree_budget=None,
                    tree_lanes=None, tree_branches=None, tree_fork_below=None, draft_lookup=None,
                    draft_lookup_trust=None, stats=None, sampler=None, **kwargs):
    """mlx-lm's `stream_generate`, speculating with a draft tree. Yields `GenerationResponse`s.

    Sampling options are `temp`, `top_p`, `min_p`, `top_k`, `seed` (not a `sampler` function:
    the draw at each node must be a function of its position for trees to stay exact).
    """
    from mlx_lm.generate import GenerationResponse
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if sampler is not None:
        raise ValueError("pass temp=, top_p=, min_p=, top_k=, seed= instead of a sampler function")
    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit)")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if draft_model is not None:
        _check_vocab(model, draft_model)
    drafter = make_drafter(draft_model, drafter=drafter, draft_block_size=draft_block_size,
                           tree_topk=tree_topk, tree_depth=tree_depth, tree_budget=tree_budget,
                           tree_lanes=tree_lanes, tree_branches=tree_branches,
                           tree_fork_below=tree_fork_below, draft_lookup=draft_lookup,
                           draft_lookup_trust=draft_lookup_trust)
    if drafter is not None:
        require_tree_support(model)
    stats = stats if stats is not None else RoundStats()
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    eos = set(tokenizer.eos_token_ids)
    steps = tree_generate_step(prompt, model, drafter, max_tokens=max_tokens, stop_tokens=eos,
                               stats=stats, **kwargs)
    tic = time.perf_counter()
    prompt_tps = 0.0

    def response(n, token, logprobs, from_draft, finish_reason):
        return GenerationResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=len(prompt), prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish_reason,
        )

    # The steps end by themselves (max_tokens, stop tokens), so they can leave a prompt cache as
    # mlx-lm does; each response goes out once the next token shows it was not the last.
    held = None
    for n, (token, logprobs, from_draft) in enumerate(steps):
        if n == 0:
            prompt_tps = len(prompt) / max(time.perf_counter() - tic, 1e-9)
            tic = time.perf_counter()
        if held is not None:
            yield response(*held, None)
        if token not in eos:
            detokenizer.add_token(token)
        held = (n, token, logprobs, from_draft)
    detokenizer.finalize()
    if held is not None:
        yield response(*held, "stop" if held[1] in eos else "length")


def generate(model, tokenizer, prompt, draft_model=None, verbose=False, **kwargs):
    """Generate a complete response; with `verbose`, print it as mlx-lm's generate does."""
    import itertools

    responses = stream_generate(model, tokenizer, prompt, draft_model, **kwargs)
    first = next(responses)  # bad input raises here, before anything is printed
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in itertools.chain([first], responses):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print("=" * 10)
        if len(text) == 0:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


DEMO_MODELS = {"demo": "target", "demo-target": "target", "demo-hybrid": "hybrid",
               "demo-drafter": "drafter"}


def resolve_model_path(name):
    """A shipped demo name, or a local mlx-lm folder, or a Hugging Face repo id."""
    import os

    if name in DEMO_MODELS:
        from .demo import __file__ as demo_init

        path = os.path.join(os.path.dirname(demo_init), DEMO_MODELS[name])
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"the shipped demo model {name!r} is missing at {path}: reinstall mlx-treespec")
        return path
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(f"{name} has no config.json: pass an mlx-lm model folder")
        return expanded
    looks_like_repo = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise FileNotFoundError(f"model folder {name} does not exist: pass an mlx-lm model folder, "
                                "a Hugging Face repo id, or 'demo' / 'demo-hybrid'")
    return name


def setup_arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_treespec.generate",
        description="Generate text with draft-tree speculative decoding (mlx-lm's flags plus tree flags).",
    )
    p.add_argument("--model", default="demo",
                   help="target: an mlx-lm folder or repo id, 'demo' (default) or 'demo-hybrid'")
    p.add_argument("--draft-model", default=None,
                   help="draft model (default: the shipped demo drafter when --model is a demo)")
    p.add_argument("--drafter", choices=["model", "lookup", "suffix", "none"], default=None,
                   help="what drafts: a draft model (default when one is given), prompt lookup, "
                        "a suffix index, or none (plain decoding)")
    p.add_argument("--prompt", "-p", default="def parse(", help="message to process ('-' reads stdin)")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="maximum number of tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling min-p")
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the draw at each position depends on it)")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--max-kv-size", type=int, default=None, help="maximum key-value cache size")
    p.add_argument("--kv-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
                   help="bits for KV cache quantization (default: none)")
    p.add_argument("--kv-group-size", type=int, default=64, help="group size for KV cache quantization")
    p.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                   help="when --kv-bits is set, quantize the cache from this many tokens on")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill step")
    p.add_argument("--verbose", nargs="?", const=True, default=None,
                   type=lambda v: str(v).lower() in ("1", "t", "true", "yes"),
                   help="print round statistics too (--verbose F prints only the response)")
    t = p.add_argument_group("tree", "with a draft model and none of these: --tree-topk 3 "
                                     "--tree-lanes 1 --tree-depth 8")
    t.add_argument("--draft-block-size", type=int, default=None, help="draft a chain of this many tokens")
    t.add_argument("--tree-topk", type=int, default=None,
                   help="EAGLE-2: children per expanded node, and lanes per step (1, the default "
                        "when other tree flags are given: a chain)")
    t.add_argument("--tree-lanes", type=int, default=None,
                   help="nodes expanded per step, 1..--tree-topk (default: --tree-topk); 1 drafts a "
                        "chain of one-token steps with its top-K siblings as leaves")
    t.add_argument("--tree-depth", type=int, default=None, help="draft steps (tree depth)")
    t.add_argument("--tree-budget", type=int, default=None,
                   help="draft nodes verified per round, root excluded (at most 63)")
    t.add_argument("--tree-branches", type=int, default=None,
                   help="draft the spine (and its --tree-topk - 1 runners-up per step) with this "
                        "many batch rows of the draft model: row r >= 1 forks a branch from the "
                        "spine's runner-up at the r-th uncertain step (1..8)")
    t.add_argument("--tree-fork-below", type=float, default=None,
                   help=f"with --tree-branches: a spine step is uncertain when its top draft "
                        f"probability is below this; 1 (the default) forks at the first steps "
                        f"without reading probabilities back")
    t.add_argument("--draft-lookup", type=int, default=None,
                   help="also hang a prompt-lookup chain of up to this many tokens from the root "
                        "(continuations of the text's last n-gram seen earlier; nodes the draft "
                        "model does not spend a step on), 0..62")
    t.add_argument("--draft-lookup-trust", type=int, default=None,
                   help="with --draft-lookup: a round whose lookup matched this many tokens or "
                        "more (1..4) drafts with the lookup alone, skipping the draft model")
    t.add_argument("--allow-inexact", action="store_true",
                   help="speculate even where the exactness probe finds verify differs from decoding")
    return p


def _build_drafter(args, model, draft_model):
    kind = args.drafter or ("model" if draft_model is not None else "none")
    if (args.draft_lookup or args.draft_lookup_trust) and kind != "model":
        raise ValueError("--draft-lookup adds lookup nodes to a draft model's tree; --drafter "
                         f"{kind} drafts without one: drop --draft-lookup or use --drafter model")
    if kind == "none":
        return None
    if kind == "model":
        if draft_model is None:
            raise ValueError("--drafter model needs --draft-model")
        _check_vocab(model, draft_model)
        return make_drafter(draft_model, draft_block_size=args.draft_block_size,
                            tree_topk=args.tree_topk, tree_depth=args.tree_depth,
                            tree_budget=args.tree_budget, tree_lanes=args.tree_lanes,
                            tree_branches=args.tree_branches, tree_fork_below=args.tree_fork_below,
                            draft_lookup=args.draft_lookup, draft_lookup_trust=args.draft_lookup_trust)
    if args.tree_branches is not None or args.tree_fork_below is not None:
        raise ValueError("--tree-branches and --tree-fork-below need a draft model (--drafter model)")
    budget = args.tree_budget if args.tree_budget is not None else 16
    depth = args.tree_depth if args.tree_depth is not None else (args.draft_block_size or 8)
    if not 1 <= budget <= MAX_NODES - 1 or not 1 <= depth <= MAX_NODES - 1:
        raise ValueError(f"--tree-budget and --tree-depth must be in 1..{MAX_NODES - 1}")
    if kind == "lookup":
        from .drafters.lookup import LookupDrafter

        return LookupDrafter(budget, depth)
    from .drafters.suffix import SuffixDrafter

    return SuffixDrafter(budget, depth)


def _run(args):
    from mlx_lm.utils import load

    if args.max_tokens == 0:
        raise ValueError("--max-tokens must be non-zero (use -1 for no limit)")
    model_path = resolve_model_path(args.model)
    draft_name = args.draft_model
    if draft_name is None and args.model in DEMO_MODELS and args.drafter in (None, "model"):
        draft_name = "demo-drafter"
    draft_path = resolve_model_path(draft_name) if draft_name else None
    model, tokenizer = load(model_path)
    draft_model = load(draft_path)[0] if draft_path and args.drafter in (None, "model") else None
    drafter = _build_drafter(args, model, draft_model)
    if drafter is not None:
        require_tree_support(model)
        _probe(args, model, drafter)

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if not args.ignore_chat_template and tokenizer.chat_template is not None:
        messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(prompt)
    if args.max_kv_size is not None and len(tokens) > args.max_kv_size:
        raise ValueError(f"the prompt has {len(tokens)} tokens but --max-kv-size is {args.max_kv_size}: "
                         "raise --max-kv-size or shorten the prompt")

    def progress(done, total):
        if total > args.prefill_step_size and args.verbose is not False:
            print(f"\rPrefill: {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr, flush=True)

    stats = RoundStats()
    text = generate(model, tokenizer, tokens, verbose=args.verbose is not False, drafter=drafter,
                    max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, min_p=args.min_p,
                    top_k=args.top_k, seed=args.seed, max_kv_size=args.max_kv_size,
                    kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                    quantized_kv_start=args.quantized_kv_start,
                    prefill_step_size=args.prefill_step_size, prompt_progress_callback=progress,
                    stats=stats)
    if args.verbose is False:
        print(text)
    elif args.verbose:
        print(stats.format())


def _probe(args, model, drafter):
    """Refuse speculation where a tree verify is not bitwise one-token decoding (GPU kernels).

    On MLX's CPU backend a verify is bitwise one-token decoding by construction (pinned by the
    test suite for every supported family), so the probe's forwards are spent on GPUs only.
    """
    if mx.default_device() == mx.cpu:
        return
    from .probe import chain_parents, check_speculation, representative_tree_parents

    depth = getattr(drafter, "depth", None) or getattr(drafter, "max_depth", 4)
    topk = getattr(drafter, "topk", 1)
    budget = getattr(drafter, "budget", depth)
    topologies = [chain_parents(depth)]
    if hasattr(drafter, "probe_parents"):  # a drafter whose largest layout is known
        topologies.append(drafter.probe_parents())
    elif topk > 1 or budget != depth:
        topologies.append(representative_tree_parents(max(topk, 2), depth, budget))
    check_speculation(model, topologies, allow_inexact=args.allow_inexact)


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        _run(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
