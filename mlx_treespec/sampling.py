"""The target's token choice at each node: greedy, or sampled with noise fixed by position.

Speculation is exact at temp > 0 when the token drawn at a node depends only on (seed, absolute
position, the node's logits): then whichever branch the walk follows, the emitted token equals
what plain sampled decoding with the same seed draws at that position. Sampling is Gumbel-max
with noise from a counter-based hash of (seed, position, token id), so all nodes of a tree are
drawn in one vectorized call and no random state is carried between calls.
"""
import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

__all__ = ["make_node_sampler", "position_uniform"]


def _mix(x):
    # murmur3's 32-bit finalizer: every input bit flips about half the output bits.
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, mx.uint32)
    return x ^ (x >> 16)


def position_uniform(seed, positions, vocab):
    """Uniform (0, 1) noise [n, vocab], a pure function of (seed, position, token id)."""
    pos = positions.astype(mx.uint32)[:, None]
    tok = mx.arange(vocab, dtype=mx.uint32)[None, :]
    s = mx.array(seed & 0xFFFFFFFF, mx.uint32)
    x = _mix(_mix(pos * mx.array(0x9E3779B1, mx.uint32) + s) ^ (tok * mx.array(0x27D4EB2F, mx.uint32)))
    return ((x >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))


def make_node_sampler(temp=0.0, top_p=0.0, min_p=0.0, top_k=0, min_tokens_to_keep=1, seed=0):
    """Returns choose(logits [n, V], positions mx int [n]) -> tokens mx uint32 [n].

    temp == 0 is mlx-lm's greedy sampler (argmax of the log-probabilities). Otherwise the
    filters are mlx-lm's own (top-p, min-p, top-k, in make_sampler's order) and the draw is
    Gumbel-max at temperature temp.
    """
    filters = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p, min_tokens_to_keep))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))

    def choose(logits, positions):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if temp == 0:
            return mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        for f in filters:
            logprobs = f(logprobs)
        u = position_uniform(seed, positions, logprobs.shape[-1])
        gumbel = -mx.log(-mx.log(u))
        return mx.argmax(logprobs * (1 / temp) + gumbel, axis=-1).astype(mx.uint32)

    choose.greedy = temp == 0  # positions are not read: callers may pass None
    return choose
