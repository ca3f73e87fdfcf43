"""The rotating-cache bookkeeping mirrors mlx-lm's RotatingKVCache exactly."""
import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_treespec.cache import commit_appended, rotating_plan, rotating_slot_positions


def tagged(positions):
    """K/V rows whose value is their token position, so a buffer shows which slot holds what."""
    p = mx.array(np.asarray(positions, np.float32))
    return p.reshape(1, 1, -1, 1)


def buffer_positions(cache):
    return np.array(cache.keys[0, 0, :, 0]).astype(np.int64)


@pytest.mark.parametrize("max_size,keep", [(8, 0), (8, 4), (12, 4), (5, 1)])
@pytest.mark.parametrize("prefill", [1, 3, 8, 13, 30])
@pytest.mark.parametrize("decoded", [0, 1, 5, 17])
def test_rotating_plan_matches_mlx_lm(max_size, keep, prefill, decoded):
    cache = RotatingKVCache(max_size=max_size, keep=keep)
    cache.step = 4  # small growth steps exercise the growth branch
    cache.update_and_fetch(tagged(range(prefill)), tagged(range(prefill)))
    for t in range(prefill, prefill + decoded):
        cache.update_and_fetch(tagged([t]), tagged([t]))
    size = cache.keys.shape[2]
    pos = rotating_slot_positions(cache.offset, cache._idx, size, keep)
    written = pos >= 0
    assert (buffer_positions(cache)[written] == pos[written]).all()
    # emulate 9 more one-token steps and compare slot by slot with the real cache
    src, pos0, write_slot, visible_len = rotating_plan(cache.offset, cache._idx, size, keep,
                                                       max_size, 9, grow=cache.step)
    start = cache.offset
    for d in range(9):
        cache.update_and_fetch(tagged([start + d]), tagged([start + d]))
        real = buffer_positions(cache)
        assert real[write_slot[d]] == start + d
        seen = cache.keys_and_values()[0].shape[2]
        assert seen == visible_len[d]


def test_commit_appended_gathers_the_path_to_consecutive_rows():
    cache = KVCache()
    cache.update_and_fetch(tagged(range(10)), tagged(range(10)))  # history 0..9
    base = cache.offset
    cache.update_and_fetch(tagged([100, 101, 102, 103, 104]), tagged([100, 101, 102, 103, 104]))
    commit_appended(cache, base, [0, 2, 4])
    assert cache.offset == base + 3
    assert buffer_positions(cache)[: cache.offset].tolist() == list(range(10)) + [100, 102, 104]


def test_commit_appended_prefix_is_a_trim():
    cache = KVCache()
    cache.update_and_fetch(tagged(range(4)), tagged(range(4)))
    cache.update_and_fetch(tagged([7, 8, 9]), tagged([7, 8, 9]))
    commit_appended(cache, 4, [0, 1])
    assert cache.offset == 6
    assert buffer_positions(cache)[:6].tolist() == [0, 1, 2, 3, 7, 8]


def test_leading_run_counts_nodes_already_in_place():
    from mlx_treespec.cache import leading_run

    assert leading_run([]) == 0
    assert leading_run([0, 1, 2]) == 3
    assert leading_run([0, 1, 5, 6]) == 2  # an accepted sibling (node 5) and its child
    assert leading_run([0, 3]) == 1
