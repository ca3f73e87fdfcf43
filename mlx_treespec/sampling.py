"""The target's token choice at each node: greedy, or sampled with noise fixed by position.

Speculation is exact at temp > 0 when the token drawn at a node depends only on (seed, absolute
position, the node's logits): then whichever branch the walk follows, the emitted token equals
what plain sampled decoding with the same seed draws at that position. Sampling is Gumbel-max
with noise from a counter-based hash of (seed, position, token id), so all nodes of a tree are
drawn in one vectorized call and no random state is carried between calls.
"""
import functools

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

__all__ = ["make_node_sampler", "position_uniform", "apply_xtc_rows", "Draw", "draw_of"]


def _mix(x):
    # murmur3's 32-bit finalizer: every input bit flips about half the output bits.
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, mx.uint32)
    return x ^ (x >> 16)


def position_uniform(seed, positions, vocab):
    """Uniform (0, 1) noise [n, vocab], a pure function of (seed (an int, or mx uint32), position,
    token id)."""
    pos = positions.astype(mx.uint32)[:, None]
    tok = mx.arange(vocab, dtype=mx.uint32)[None, :]
    s = seed if isinstance(seed, mx.array) else mx.array(seed & 0xFFFFFFFF, mx.uint32)
    x = _mix(_mix(pos * mx.array(0x9E3779B1, mx.uint32) + s) ^ (tok * mx.array(0x27D4EB2F, mx.uint32)))
    return ((x >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))


def apply_xtc_rows(logprobs, coin, probability, threshold, special_tokens=()):
    """mlx-lm's XTC (exclude top choices) with its coin drawn per row: a row whose coin is at most
    `probability` drops every token above `threshold` but the least likely of them (special
    tokens always kept)."""
    probs = mx.softmax(logprobs, axis=-1)
    mask = probs > mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    if special_tokens:
        mask[..., list(special_tokens)] = False
    return mx.where(coin[:, None] > probability, logprobs, mx.where(mask, -mx.inf, logprobs))


def make_node_sampler(temp=0.0, top_p=0.0, min_p=0.0, top_k=0, min_tokens_to_keep=1, seed=0,
                      xtc_probability=0.0, xtc_threshold=0.1, xtc_special_tokens=()):
    """Returns choose(logits [n, V], positions mx int [n]) -> tokens mx uint32 [n].

    temp == 0 is mlx-lm's greedy sampler (argmax of the log-probabilities). Otherwise the
    filters are mlx-lm's own (top-p, min-p, XTC, top-k, in make_sampler's order) and the draw is
    Gumbel-max at temperature temp. XTC's coin is keyed by (seed, position) like the draw: it is
    the noise of the token id one past the vocabulary, so the draw's noise stays as it was.
    `choose.scores(logits, positions, choose.seed)`: the draw's scores (its argmax is the draw),
    what a drafter guesses the draw by (`Draw`).
    """
    if not 0 <= xtc_threshold <= 0.5:
        raise ValueError(f"xtc_threshold must be in 0..0.5, got {xtc_threshold}")
    if not 0 <= xtc_probability <= 1.0:
        raise ValueError(f"xtc_probability must be in 0..1, got {xtc_probability}")
    if temp == 0:
        def choose(logits, positions):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(logprobs, axis=-1).astype(mx.uint32)

        choose.greedy, choose.scores, choose.seed, choose.temp = True, None, None, 0.0  # (positions: may be None)
        return choose
    scores, draw = _draws(float(temp), float(top_p), float(min_p), int(top_k), int(min_tokens_to_keep),
                          float(xtc_probability), float(xtc_threshold), tuple(xtc_special_tokens))
    key = mx.array(seed & 0xFFFFFFFF, mx.uint32)

    def choose(logits, positions):
        return draw(logits, positions, key)

    choose.greedy, choose.scores, choose.seed, choose.temp = False, scores, key, float(temp)
    return choose


@functools.lru_cache(maxsize=16)
def _draws(temp, top_p, min_p, top_k, min_tokens_to_keep, xtc_probability, xtc_threshold, xtc_special_tokens):
    """(scores, draw) of one sampler setting, compiled, the seed an input (mx uint32): a draw is a
    dozen elementwise ops over the vocabulary, each a launch of its own uncompiled, and a
    setting's traces (one per row count, and a head's compiled drafts over them) are shared by
    every generation, whatever its seed (a trace per generation cost queued rounds their first
    rounds: bench/RESULTS.md, "Sampled rounds"). Plain and speculative decoding draw a row alike:
    both call these."""
    filters = []
    if 0 < top_p < 1.0:
        filters.append(lambda x, coin: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x, coin: apply_min_p(x, min_p, min_tokens_to_keep))
    if xtc_probability > 0.0:
        filters.append(lambda x, coin: apply_xtc_rows(x, coin, xtc_probability, xtc_threshold,
                                                      xtc_special_tokens))
    if top_k > 0:
        filters.append(lambda x, coin: apply_top_k(x, top_k))

    def scores(logits, positions, seed):
        # float32: a small temp overflows a half-precision model's log-probabilities to -inf
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        V = logprobs.shape[-1]
        u = position_uniform(seed, positions, V + (1 if xtc_probability > 0 else 0))
        coin, u = (u[:, V], u[:, :V]) if xtc_probability > 0 else (None, u)
        for f in filters:
            logprobs = f(logprobs, coin)
        return logprobs.astype(mx.float32) * (1 / temp) - mx.log(-mx.log(u))

    def draw(logits, positions, seed):
        return mx.argmax(scores(logits, positions, seed), axis=-1).astype(mx.uint32)

    return mx.compile(scores), mx.compile(draw)


class Draw:
    """What a drafter needs to guess sampled tokens (temp > 0): the sampler's `scores` (compiled,
    one function per sampler setting: a compiled draft keys its traces by it), its `seed` (mx
    uint32), its `temp` (the default's shape reads it: spec.SAMPLED_TREES) and the position of
    the round's root (set by the loop before each draft; a device int32 scalar in rounds queued
    ahead). The target draws the token after a node at the node's
    position, so a drafter picks the token after a node at depth d (root 0) by argmax (its
    runners-up: the next best) of `at(logits, d)`. Exactness does not rest on it: any draft is
    exact."""

    __slots__ = ("scores", "seed", "position", "temp")

    def __init__(self, choose):
        self.scores, self.seed, self.position = choose.scores, choose.seed, None
        self.temp = getattr(choose, "temp", None)  # (a sampler of one's own may not say)

    def at(self, logits, depth, root=None):
        """The draw's scores of `logits` [n, V], every row at `depth` from the root (an int, or
        an mx int32 array [n]). `root`: (the root's position, the seed) as arrays, where a
        compiled draft takes them as inputs (default: this round's)."""
        position, seed = (self.position, self.seed) if root is None else root
        depth = mx.array(depth, mx.int32) if isinstance(depth, int) else depth
        return self.scores(logits, mx.broadcast_to(position + depth, (logits.shape[0],)), seed)


def draw_of(inner):
    """A wrapper drafter's `draw` property: the drafter it holds in attribute `inner` (an
    adaptive drafter's primary, a merged drafter's base) gets the loop's Draw and reads it back,
    where it guesses draws (elsewhere None)."""

    def get(self):
        return getattr(getattr(self, inner), "draw", None)

    def put(self, draw):
        held = getattr(self, inner)
        if hasattr(held, "draw"):
            held.draw = draw

    return property(get, put, doc=f"The sampling.Draw of `{inner}` (set by the loop at temp > 0).")
