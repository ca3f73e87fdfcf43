"""The speculative round loop, and plain decoding.

Each round: draft -> verify -> walk -> commit. The drafter proposes a tree rooted at the last
emitted token; the target runs every node in one forward; the walk follows the target's own
choices down the tree; the caches keep the accepted path only. Greedy output is the target's own
greedy output, token for token.

A round is a transaction. Until its tokens are delivered nothing is committed (`TreeRound.abort`
puts the caches back if drafting, verifying or walking raises); once delivered, it commits the
tokens the consumer took: all of them, or, when the stream is abandoned inside the round, just
those. A prompt cache passed in then holds the prompt and every token delivered, mlx-lm's rule,
also after an exception.
"""
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .cache import cache_kind, committed_offset, restore, snapshot
from .draft import check_drafter
from .join import join
from .launch import agree, drafter_digest, in_launch, model_digest, shared_seed
from .sampling import Draw, make_node_sampler
from .support import require_tree_support
from .tree import MAX_NODES, DraftTree, check_int
from .adaptive import PlainStretch, QueueAhead
from .queued import can_queue, queued_rounds
from .verify import TreeRound, cached_array, capturing, check_capture, rows_are_steps
from .walk import cut_at_stop, greedy_walk

DEFAULT_QUANTIZED_KV_START = 5000

__all__ = ["tree_generate_step", "RoundStats", "check_prompt", "DEFAULT_QUANTIZED_KV_START"]


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
    draft_forwards: List[int] = field(default_factory=list)  # draft-model forwards per round
    drafter: List[str] = field(default_factory=list)  # what drafted each round ('plain': nothing)
    prompt_ms: float = 0.0

    def record(self, *, accepted, emitted, nodes, depth, held, budget, requested_depth, draft_ms,
               verify_ms, round_ms, sync_ms, walk_ms, draft_forwards=0, drafter=""):
        for name, value in locals().items():
            if name != "self":
                getattr(self, {"budget": "requested_budget"}.get(name, name)).append(value)

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
            "draft_forwards_per_round": sum(self.draft_forwards) / n,
            "rounds_by_drafter": self.rounds_by_drafter(),
            "emitted_ms_by_drafter": self.emitted_ms_by_drafter(),
            "prompt_ms": self.prompt_ms,
        }

    def emitted_ms_by_drafter(self):
        """{what drafted: [tokens emitted, wall ms]} over the rounds that say: each arm's rate as
        a generation saw it (adaptive drafting)."""
        out = {}
        for d, e, ms in zip(self.drafter, self.emitted, self.round_ms):
            if d:
                acc = out.setdefault(d, [0, 0.0])
                acc[0] += int(e)
                acc[1] += float(ms)
        return out

    def rounds_by_drafter(self):
        """{what drafted: rounds} over the rounds that say (adaptive drafting; 'plain': one
        token decoded without a draft)."""
        out = {}
        for d in self.drafter:
            if d:
                out[d] = out.get(d, 0) + 1
        return out

    def format(self):
        s = self.summary()
        by_depth = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"])
        used = ", ".join(f"{k} {v}" for k, v in sorted(s["rounds_by_drafter"].items()))
        return (
            f"Rounds: {s['rounds']}, emitted/verify: {s['emitted_per_verify']:.3f}, "
            f"accepted/round: {s['accepted_per_round']:.3f}, re-run next round: {s['held_per_round']:.3f}\n"
            f"Nodes/round: {s['nodes_per_round']:.2f} (budget requested {s['requested_budget']}, "
            f"effective {s['effective_budget']:.2f}; depth requested {s['requested_depth']}, "
            f"effective {s['effective_depth']:.2f})\n"
            f"Acceptance by depth: {by_depth or '-'}; draft forwards/round: {s['draft_forwards_per_round']:.2f}\n"
            f"Draft {s['draft_ms_per_round']:.2f} ms/round, verify {s['verify_ms_per_round']:.2f} "
            f"ms/round, round {s['round_ms']:.2f} ms (of which waiting on the device "
            f"{s['sync_ms_per_round']:.2f}, walk and commit {s['walk_ms_per_round']:.2f})"
            + (f"\nRounds by drafter: {used} (plain: tokens decoded without a draft)" if used else "")
        )


def vocab_size(model):
    """The target's vocabulary (rows of its output), from its config."""
    args = getattr(model, "args", None)
    v = getattr(args, "vocab_size", None)
    if v is None and args is not None and isinstance(getattr(args, "text_config", None), dict):
        v = args.text_config.get("vocab_size")
    return v


def check_prompt(prompt, vocab=None):
    """The prompt as a list of Python ints, or a one-line error naming the fix."""
    if isinstance(prompt, (mx.array, np.ndarray)):
        if prompt.ndim != 1:
            raise ValueError(f"the prompt must be a 1-D array of token ids, got shape {prompt.shape}: "
                             "pass one sequence (prompt[0] for a batch of one)")
        if isinstance(prompt, mx.array) and not mx.issubdtype(prompt.dtype, mx.integer):
            raise ValueError(f"prompt token ids must be integers, got {prompt.dtype}: pass token ids, not floats")
        prompt = prompt.tolist()
    elif isinstance(prompt, (str, bytes)):
        raise ValueError("the prompt is text: encode it with the tokenizer (or use stream_generate)")
    out = []
    for t in prompt:
        if isinstance(t, (list, tuple, np.ndarray)):
            raise ValueError("the prompt must be a flat sequence of token ids, got a nested sequence: "
                             "pass one sequence (prompt[0] for a batch of one)")
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"prompt token ids must be integers, got {t!r}: pass token ids, not floats")
        out.append(int(t))
    if not out:
        raise ValueError("the prompt is empty: pass at least one token")
    bad = [t for t in out if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1 if vocab else '?'}): "
                         "encode the prompt with this model's tokenizer")
    return out


def _quantizer(kv_bits, kv_group_size, quantized_kv_start):
    """mlx-lm's rule, applied at the same token boundaries as plain decoding."""

    def quantize(caches):
        if kv_bits is None:
            return
        for i, c in enumerate(caches):
            if hasattr(c, "to_quantized") and c.offset >= quantized_kv_start:
                caches[i] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)

    return quantize


def _forward(model, caches, tokens, quantize, capture=(), saved=None):
    """A plain forward that lands whole or not at all: a failure puts the caches back (to
    `saved`, where the caller took the snapshot: it may undo the forward later)."""
    saved = snapshot(caches) if saved is None else saved
    try:
        with capturing(model, capture) as cap:
            logits = model(tokens[None], cache=caches)
            hidden = cap.hidden()
        quantize(caches)
    except BaseException:
        restore(caches, saved)
        raise
    return logits, hidden


def _prefill(model, caches, prompt, step, quantize, progress, capture):
    """Process all prompt tokens but the last, in mlx-lm's chunks (the last is the first root);
    returns the captured layer outputs of those tokens (or None)."""
    total, done, hidden = len(prompt), 0, []
    progress(done, total)
    while total - done > 1:
        n = min(step, total - done - 1)
        _, h = _forward(model, caches, mx.array(prompt[done : done + n]), quantize, capture)
        mx.eval([c.state for c in caches] + ([h] if h is not None else []))
        hidden.append(h)
        done += n
        progress(done, total)
        mx.clear_cache()
    progress(total, total)
    if not capture:
        return None
    return mx.concatenate(hidden) if hidden else mx.zeros((0, 0))


def _depth_cap(caches, room, kv_bits, quantized_kv_start):
    """How deep this round's tree may be: the tokens left, `MAX_NODES`, the quantization
    boundary (a node must see the cache precision plain decoding would: mlx-lm quantizes once a
    step ends at `quantized_kv_start` or beyond), and the rotating window (a round's nodes must
    fit the window that plain decoding would keep)."""
    base = committed_offset(caches)
    cap = int(min(room - 1, MAX_NODES - 1))
    if kv_bits is not None and any(isinstance(c, KVCache) for c in caches):  # not yet quantized
        cap = min(cap, max(quantized_kv_start, 1) - base - 1)
    for c in caches:
        if cache_kind(c) == "rotating":
            cap = min(cap, c.max_size - c.keep - 1)
    return max(cap, 0), base


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
    seed: Optional[int] = None,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens=(),
    prompt_cache: Optional[List[Any]] = None,
    max_kv_size: Optional[int] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stop_tokens=(),
    stats: Optional[RoundStats] = None,
):
    """Yields (token, logprobs, from_draft) like mlx-lm's generate steps.

    `prompt_cache` (the target's caches) is used in place: afterwards it holds the prompt and
    every token delivered, as mlx-lm's generate leaves it, also when the consumer stops early or
    a round raises (the last token costs one more forward, made only when a cache was passed
    in). The drafter keeps its own caches. With `stop_tokens`, emission ends at the first of
    them (included). Bad options and prompts raise ValueError before anything runs.
    """
    max_tokens = check_int(max_tokens, "max_tokens", -1)
    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit)")
    if seed is None:  # a fresh draw each generation, as mlx-lm's sampling (one for a whole launch)
        seed = int.from_bytes(os.urandom(4), "little")
        if in_launch():
            seed = shared_seed(seed)
    for name, value, low in (("top_k", top_k, 0), ("seed", seed, None), ("kv_group_size", kv_group_size, 1),
                             ("quantized_kv_start", quantized_kv_start, 0),
                             ("prefill_step_size", prefill_step_size, 1), ("min_tokens_to_keep", min_tokens_to_keep, 1)):
        check_int(value, name, low)
    if max_kv_size is not None:
        check_int(max_kv_size, "max_kv_size", 1)
    if kv_bits is not None and check_int(kv_bits, "kv_bits", 1) not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"kv_bits must be 2, 3, 4, 5, 6 or 8 (what MLX quantizes to), got {kv_bits}")
    if prompt_cache is not None:
        check_cache_matches(model, prompt_cache)
        if max_kv_size is not None and not any(cache_kind(c) == "rotating" and c.max_size == max_kv_size
                                               for c in prompt_cache):
            raise ValueError(f"max_kv_size {max_kv_size} sizes a new cache; this prompt_cache keeps its own "
                             "size: drop one of them")
    vocab = vocab_size(model)
    stop_tokens = check_stop_tokens(stop_tokens, vocab)
    if not 0 <= seed < 1 << 32:
        raise ValueError(f"seed must be in 0..{(1 << 32) - 1}, got {seed}")
    for name, value, high in (("temp", temp, np.inf), ("top_p", top_p, 1), ("min_p", min_p, 1),
                              ("xtc_probability", xtc_probability, 1), ("xtc_threshold", xtc_threshold, 0.5)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not np.isfinite(value) or value < 0 or value > high:
            raise ValueError(f"{name} must be a number in 0..{'inf' if high == np.inf else high}, got {value!r}")
    with np.errstate(over="ignore", divide="ignore"):
        scale = np.float32(1) / np.float32(temp)  # (the draw scales log-probabilities by it in float32)
    if temp > 0 and not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"temp {temp!r} has no float32 reciprocal (every draw would be token 0): use "
                         "temp=0 for greedy decoding, or one in 1e-30..1e30")
    xtc_special_tokens = sorted(check_token_ids(() if xtc_special_tokens is None else xtc_special_tokens,
                                                "xtc_special_tokens", vocab))
    if vocab is not None and (top_k >= vocab or min_tokens_to_keep > vocab):  # (None: a config without it)
        raise ValueError(f"top_k must be below and min_tokens_to_keep at most the vocabulary ({vocab}), "
                         f"got {top_k} and {min_tokens_to_keep}")
    if kv_bits is not None and kv_group_size not in (32, 64, 128):
        raise ValueError(f"kv_group_size must be 32, 64 or 128 (what MLX quantizes by), got {kv_group_size}")
    prompt = check_prompt(prompt, vocab)
    if kv_bits is not None and max_kv_size is not None:
        raise ValueError("kv_bits and max_kv_size cannot be combined (mlx-lm cannot quantize a rotating cache)")
    if in_launch():  # every process must decode this request alike, before any collective (launch.py)
        request = json.dumps([prompt, max_tokens, temp, top_p, min_p, top_k, min_tokens_to_keep, seed,
                              xtc_probability, xtc_threshold, list(xtc_special_tokens), max_kv_size, kv_bits,
                              kv_group_size, quantized_kv_start, prefill_step_size, sorted(stop_tokens),
                              None if prompt_cache is None else [(type(c).__name__, getattr(c, "offset", None))
                                                                 for c in prompt_cache]],
                             default=str)
        agree(model=model_digest(model), drafter=drafter_digest(drafter, model),
              request=hashlib.sha256(request.encode()).hexdigest())
    capture = ()
    if drafter is not None:
        check_drafter(drafter)
        require_tree_support(model)
        capture = tuple(getattr(drafter, "capture", ()))
        check_capture(model, capture)
        join(model)  # (once; again where the target's weights changed since: join.py)
    caches = prompt_cache if prompt_cache is not None else make_prompt_cache(model, max_kv_size=max_kv_size)
    if kv_bits is not None and any(cache_kind(c) == "rotating" for c in caches):  # (mlx-lm fails at its first quantize)
        raise ValueError("kv_bits cannot quantize this model's sliding-window (rotating) cache layers: drop kv_bits")
    if kv_bits is not None and not isinstance(caches, list):  # (quantizing replaces the list's entries)
        raise ValueError(f"kv_bits quantizes the prompt_cache in place: pass it as a list, not a {type(caches).__name__}")
    if drafter is not None:
        for c in caches:
            if cache_kind(c) == "rotating" and c.max_size <= c.keep:
                raise ValueError(f"a rotating cache of {c.max_size} tokens holds only the {c.keep} it keeps "
                                 f"from the start, no window for a draft: raise --max-kv-size above {c.keep}")
        if hasattr(drafter, "window"):  # what a verify reads: adaptive drafting prices its rounds by it
            drafter.window, drafter.prefix = attended_rows(caches), committed_offset(caches)
    choose = make_node_sampler(temp, top_p, min_p, top_k, min_tokens_to_keep, seed, xtc_probability,
                               xtc_threshold, tuple(xtc_special_tokens))
    stats = stats if stats is not None else RoundStats()
    quantize = _quantizer(kv_bits, kv_group_size, quantized_kv_start)

    tic = time.perf_counter()
    hidden = _prefill(model, caches, prompt, prefill_step_size, quantize,
                      prompt_progress_callback or (lambda *_: None), capture)
    stats.prompt_ms = 1e3 * (time.perf_counter() - tic)
    if drafter is None:
        yield from _plain_decode(model, caches, prompt[-1], max_tokens, choose, quantize, stop_tokens,
                                 stats, settle=prompt_cache is not None)
        return
    if hasattr(drafter, "draw"):  # (a model, head or DFlash drafter: it guesses draws at temp > 0)
        drafter.draw = None if choose.greedy else Draw(choose)
    queue = can_queue(drafter, caches, kv_bits)  # rounds with no host sync between them
    if hasattr(drafter, "queueable"):  # (an adaptive drafter: its model arm is queued rounds)
        drafter.queueable = queue

    def land(token, failed):
        if prompt_cache is not None and _may_settle(failed):
            _forward(model, caches, mx.array([token], mx.uint32), quantize)
            mx.eval([c.state for c in caches])

    # queued rounds and the round loop hand the generation to each other: (root, tokens emitted)
    resume = None
    if queue:
        resume = yield from queued_rounds(model, caches, drafter, prompt, hidden, capture, max_tokens, choose,
                                          stop_tokens, stats, land)
        if resume is None:
            return
    while True:
        resume = yield from _rounds(model, caches, drafter, prompt, hidden, capture, max_tokens, choose,
                                    quantize, stop_tokens, stats, kv_bits, quantized_kv_start,
                                    settle=prompt_cache is not None, resume=resume)
        if resume is None:
            return
        resume = yield from queued_rounds(model, caches, drafter, prompt, hidden, capture, max_tokens, choose,
                                          stop_tokens, stats, land, resume=resume)
        if resume is None:
            return


def check_stop_tokens(stop_tokens, vocab=None):
    """The set of stop token ids (each below `vocab` where it is known)."""
    return check_token_ids(stop_tokens, "stop_tokens", vocab)


def check_token_ids(ids, name, vocab=None):
    """The set of token ids `ids` (a collection of ints, each below `vocab` where it is known:
    an id past it would index outside a logits row)."""
    if isinstance(ids, (int, np.integer, str)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a collection of token ids, got {ids!r}: pass e.g. {name}=[eos_id]")
    ids = {check_int(t, f"{name} entry", 0) for t in ids}
    if vocab is not None and any(t >= vocab for t in ids):
        raise ValueError(f"{name} entry {max(ids)} is not a token id (the vocabulary has {vocab})")
    return ids


def check_cache_matches(model, prompt_cache):
    """A prompt cache must be this model's: one cache per layer, attention where the model
    attends and recurrent where it recurs (another model's cache decodes wrong tokens or fails
    deep inside mlx-lm)."""
    fresh = make_prompt_cache(model)
    if not isinstance(prompt_cache, (list, tuple)) or len(prompt_cache) != len(fresh) or any(
            (cache_kind(a) in ("append", "rotating")) != (cache_kind(b) in ("append", "rotating"))
            for a, b in zip(prompt_cache, fresh)):
        n = len(prompt_cache) if isinstance(prompt_cache, (list, tuple)) else type(prompt_cache).__name__
        raise ValueError(f"prompt_cache ({n} caches) is not this model's ({len(fresh)} layers): make it with "
                         "mlx_lm.models.cache.make_prompt_cache(model)")


def attended_rows(caches):
    """The most context rows an attention layer reads: None (all of them) where any layer keeps
    the whole context, else the largest rotating window (recurrent layers read no rows)."""
    kinds = [cache_kind(c) for c in caches]
    if "append" in kinds or "rotating" not in kinds:
        return None
    return max(c.max_size for c, k in zip(caches, kinds) if k == "rotating")


def _rounds(model, caches, drafter, prompt, hidden, capture, max_tokens, choose, quantize, stop_tokens,
            stats, kv_bits, quantized_kv_start, settle, resume=None):
    # Between rounds the caches hold every delivered token but `pending`: the held tokens
    # (accepted, left to lead the next forward) and the root (the last delivered token).
    # `resume`: (root, tokens emitted) where queued rounds handed the generation over. Returns
    # None at the generation's end, or (root, tokens emitted) where the drafter asks for queued
    # rounds (`QueueAhead`): the caches then hold every token but the root
    held, (root, n) = None, (resume or (prompt[-1], 0))
    rerun = kv_bits is None and rows_are_steps(model)  # held tokens lead a plain forward (a stretch's)

    def land(failed):  # put the pending tokens in the caches: a prompt cache's rule (see the docstring)
        tokens = mx.array([root], mx.uint32) if root is not None else None
        if held is not None:
            tokens = held if tokens is None else mx.concatenate([held, tokens])
        if not (settle and _may_settle(failed)):
            return
        if tokens is not None:
            steps = rows_are_steps(model)
            for part in ([tokens] if steps else [tokens[i: i + 1] for i in range(tokens.shape[0])]):
                _forward(model, caches, part, quantize)  # (one at a time where rows are not steps)
        quantize(caches)  # (a round cut short commits without it: mlx-lm's cache is quantized here)
        mx.eval([c.state for c in caches])

    failed = False  # an error (not the consumer's stop) unwinds the generation
    queued = False  # handed to queued rounds: the generation goes on there
    draw = getattr(drafter, "draw", None)
    try:
        if resume is None:  # (else the drafter was prefilled and caught up: queued.py)
            drafter.prefill(prompt, hidden) if capture else drafter.prefill(prompt)
        while max_tokens < 0 or n < max_tokens:
            room = float("inf") if max_tokens < 0 else max_tokens - n
            t0 = time.perf_counter()
            depth_cap, base = _depth_cap(caches, room, kv_bits, quantized_kv_start)
            if draw is not None:  # the root's position: the held tokens lead it
                draw.position = base + (0 if held is None else held.shape[0])
            draft = drafter.draft(root, depth_cap)                                            # draft
            if isinstance(draft, PlainStretch):  # no speculation for a while (adaptive.py)
                count = draft.tokens if room == float("inf") else int(min(draft.tokens, room))
                lead, caught = root, []
                for token, lp, root in _stretch(model, caches, held, root, count, choose, quantize,
                                                capture, stats, caught, draft.watch):
                    held = None  # in the caches since the stretch's first forward
                    n += 1
                    yield token, lp, False
                    if token in stop_tokens:
                        break
                else:
                    drafter.catch_up(lead, *caught)
                    continue
                break
            if isinstance(draft, QueueAhead):  # queued rounds from here (queued.py)
                if held is not None:  # they lead with the root: the held tokens go in first
                    _forward(model, caches, held, quantize)
                    held = None
                queued = True
                return root, n
            if draft.size > MAX_NODES:
                raise ValueError(f"the drafter proposed {draft.size} nodes; at most {MAX_NODES} fit")
            mx.async_eval(draft.arrays())  # the device drafts while the host builds the verify
            t1 = time.perf_counter()
            rnd = TreeRound(model, caches, capture, compiled=True)
            try:
                draft = rnd.fit(draft, held)
                logits, depths = rnd.verify(draft, held)                                      # verify
                chosen = choose(logits, None if choose.greedy else base + depths)
                ts = time.perf_counter()
                mx.eval(draft.arrays(), chosen)
                tw = time.perf_counter()
                tree, path, emitted, drafted = _walk(draft, chosen, room, stop_tokens)            # walk
                accepted = len(path) - 1
                logprobs = logits[cached_array(path.astype(np.int32))]
                logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
            except BaseException:
                rnd.abort()
                raise
            delivered = 0
            try:
                try:
                    for i, t in enumerate(emitted):
                        delivered = i + 1
                        yield t, logprobs[i], i < drafted
                    held, root = rnd.commit(path, draft.tokens, rerun=rerun), emitted[-1]           # commit
                except BaseException:  # the consumer stopped after `delivered` tokens, or the commit raised
                    held, root = _land_delivered(rnd, path, draft.tokens, emitted, delivered, accepted, held, root)
                    raise
                quantize(caches)
                if capture:
                    drafter.commit(draft, path, emitted, rnd.hidden[cached_array(path.astype(np.int32))])
                else:
                    drafter.commit(draft, path, emitted)
                n += len(emitted)
            finally:  # the tokens delivered count, in a round the consumer cut short too (stream_generate
                # stops at its last token: the generation's last round ends that way)
                t2 = time.perf_counter()
                if delivered:
                    stats.record(accepted=min(drafted, delivered), emitted=delivered, nodes=draft.size,
                                 depth=int(tree.max_depth), held=0 if held is None else int(held.shape[0]),
                                 budget=draft.budget, requested_depth=draft.depth, draft_ms=1e3 * (t1 - t0),
                                 verify_ms=1e3 * (t2 - t1), round_ms=1e3 * (t2 - t0), sync_ms=1e3 * (tw - ts),
                                 walk_ms=1e3 * (t2 - tw), draft_forwards=draft.forwards,
                                 drafter=draft.source)
            if root in stop_tokens:
                break
    except GeneratorExit:
        raise
    except BaseException:
        failed = True
        raise
    finally:
        if not queued:
            land(failed)
    return None


def _stretch(model, caches, held, root, count, choose, quantize, capture, stats, caught, watch=None,
             label="plain"):
    """`count` tokens of plain decoding, pipelined as mlx-lm's generate_step: the forward of a
    token is queued before the host reads it, so the device never waits on Python. The first
    forward runs the held tokens and the root, each later one the token before.
    Yields (token, logprobs, root): `root` is what is pending after that token (None: the
    caches hold it; the stretch's last token is not forwarded, it is the next root). At the
    end `caught` holds the tokens and the captured rows of the tokens forwarded (root first:
    what a drafter reading the target missed), the held tokens' rows left out (the drafter had
    them from the round that accepted them). `watch(token)` True ends the stretch at the next
    token (its forward is queued already; the one after is not). Each token is a round of
    `stats`, drafted by `label`. An error (not the consumer's stop) puts the caches back to
    where the tokens delivered end: the next token's forward, queued before this token was
    read, is undone, and before the first token the lead's too (the caller still holds it
    pending)."""
    lead = mx.array([root], mx.uint32)
    p = 0 if held is None else held.shape[0]
    lead = lead if held is None else mx.concatenate([held, lead])
    position = committed_offset(caches) + p  # the root's

    def step(tokens, position, saved):
        logits, hidden = _forward(model, caches, tokens, quantize, capture, saved)
        logits = logits[0, -1:]
        return choose(logits, None if choose.greedy else mx.array([position], mx.int32)), logits, hidden

    undo = snapshot(caches)  # the caches as the delivered tokens leave them (the lead pending)
    y, logits, hidden = step(lead, position, undo)
    rows = [hidden[p:]] if hidden is not None else []
    mx.async_eval(y)
    tokens = []
    tic = time.perf_counter()
    i = -1
    while i + 1 < count:
        i += 1
        last = i == count - 1
        if i:  # the caches hold the lead and every token delivered: an error puts them back here
            undo = snapshot(caches)
        try:
            if not last:  # queue the next forward before reading this token
                nxt = step(y, position + i + 1, undo)
                mx.async_eval(nxt[0])
            ts = time.perf_counter()
            token = y.item()
            toc = time.perf_counter()
            stats.record(accepted=0, emitted=1, nodes=1, depth=0, held=0, budget=0, requested_depth=0,
                         draft_ms=0.0, verify_ms=1e3 * (toc - tic), round_ms=1e3 * (toc - tic),
                         sync_ms=1e3 * (toc - ts), walk_ms=0.0, drafter=label)
            tic = toc
            if not last and watch is not None and watch(token):
                count = i + 2
        except BaseException:  # this token is not delivered: its queued successor's forward goes
            restore(caches, undo)
            raise
        tokens.append(token)
        yield token, logits[0] - mx.logsumexp(logits[0], keepdims=True), (token if last else None)
        if not last:
            y, logits, hidden = nxt
            if hidden is not None:
                rows.append(hidden)
    caught += [tokens, mx.concatenate(rows) if rows else None]


def _walk(draft, chosen, room, stop_tokens):
    """The walk over the fetched draft: (tree, accepted path, emitted tokens, how many of them
    are accepted drafts), the emission cut at the tokens left and after the first stop token
    (the path with it: commits keep what was emitted; a cut token may be a draft the target
    accepted, and mlx-lm flags it drafted)."""
    tree = DraftTree(np.array(draft.tokens).astype(np.int64), draft.layout.host_parents())
    path, emitted = greedy_walk(tree, np.array(chosen).astype(np.int64),
                                max_emit=None if room == float("inf") else int(room))
    emitted = cut_at_stop([int(t) for t in emitted], stop_tokens)
    return tree, path[: len(emitted)], emitted, min(len(emitted), len(path) - 1)


def _may_settle(failed):
    """Whether a generation that ends now may forward its pending tokens into a prompt cache:
    not under a launch when an error (`failed`: not the consumer's stop) unwinds it. The error
    may be a process of the launch that is gone, and a forward would wait on it for ever. The
    caches then hold every delivered token but the pending ones (design.md, Sharded targets)."""
    return not (failed and in_launch())


def _land_delivered(rnd, path, tokens, emitted, delivered, accepted, held, root):
    """A round cut short after `delivered` of its tokens: keep what the target verified of them
    (the root and up to `delivered` accepted nodes); returns (held, root), the delivered tokens
    still to forward. If even that commit fails, the round's caches are as before it and every
    delivered token is pending. A round whose own commit failed was put back already, and rows
    it wrote in place may be gone: it is not committed again."""
    keep = min(delivered, accepted)
    if not rnd.aborted:
        try:
            rnd.commit(path[: keep + 1], tokens, rerun=False)
            return None, (emitted[accepted] if delivered > accepted else None)
        except BaseException:
            pass
    rnd.abort()  # every layer as the round found it, whatever failed
    lead = mx.array([root] + emitted[: delivered - 1], mx.uint32)
    return (lead if held is None else mx.concatenate([held, lead])), emitted[delivered - 1]


def _plain_decode(model, caches, root, max_tokens, choose, quantize, stop_tokens, stats, settle):
    """Decoding without a drafter: one stretch (`_stretch`, pipelined as mlx-lm's
    generate_step) to the end, the caches holding every token when it is delivered (mlx-lm's
    rule)."""
    count = max_tokens if max_tokens > 0 else float("inf")
    pending, failed = root, False  # a token delivered (or the prompt's last) not in the caches
    try:
        for token, lp, pending in _stretch(model, caches, None, root, count, choose, quantize, (), stats, [],
                                           label=""):
            yield token, lp, False
            if token in stop_tokens:
                break
    except GeneratorExit:
        raise
    except BaseException:
        failed = True
        raise
    finally:
        if settle and _may_settle(failed):  # the caches end holding every delivered token
            if pending is not None:
                _forward(model, caches, mx.array([pending], mx.uint32), quantize)
            mx.eval([c.state for c in caches])
