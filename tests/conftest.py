import atexit
import itertools
import os
import shutil
import tempfile

import pytest

# start-up cost fits (costmodel.startup_costs) go to a per-run folder, not the user's cache
# (removed when the run ends: each run made one and left it). The run's one folder: xdist's
# workers inherit the controller's, so a target's fit (tens of seconds on this CPU) is measured
# once a run, not once a worker
if os.environ.get("PYTEST_XDIST_WORKER") is None:
    os.environ["MLX_TREESPEC_CACHE"] = tempfile.mkdtemp(prefix="mlx_treespec_costs_")
    atexit.register(shutil.rmtree, os.environ["MLX_TREESPEC_CACHE"], ignore_errors=True)


def check_clock(compiled, eager, eager_host=0):
    """A clock for verify's compiled-or-eager choice: a timed check's compiled forward takes
    `compiled` ticks (none of them host work) and its eager forward `eager`, `eager_host` of them
    host work (the check reads the clock five times); lists of equal length give the checks in
    turn, cycled."""
    pairs = list(zip(*[v if isinstance(v, list) else [v] for v in (compiled, eager)]))
    steps = itertools.cycle([t for c, e in pairs for t in (0, 0, c, eager_host, e - eager_host)])
    now = [0]

    def clock():
        now[0] += next(steps)
        return now[0]

    return clock


@pytest.fixture(autouse=True)
def compiled_wins(monkeypatch):
    # a GPU-path test's compiled verify is timed against its eager twin; on this CPU either may
    # win, and the compiled path must stay covered: under test the compiled one is the faster
    # (test_dflash.py pins the other side)
    import mlx_treespec.verify as verify

    monkeypatch.setattr(verify, "_clock", check_clock(compiled=1, eager=2))


@pytest.fixture
def contract_kernel(monkeypatch):
    """The tree-attention kernel's route on CPU (attention.py; the kernel itself runs on CUDA
    only): every shape qualifies, and `tree_attention` is MLX's attention over what the kernel
    may read: every column before bounds[0], the mask in [bounds[0], bounds[1]), no column from
    bounds[1] on. Where that differs from the round's mask (wrong bounds) its output is NaN, so
    the tokens change. Returns its calls."""
    import numpy as np
    import mlx.core as mx

    from mlx_treespec import attention

    calls = []

    def by_contract(q, k, v, mask, bounds, scale):
        cols = mx.arange(k.shape[2])
        low = mx.array(mx.finfo(mask.dtype).min, mask.dtype)
        seen = mx.where(cols < bounds[0], mx.array(0, mask.dtype), mx.where(cols < bounds[1], mask, low))
        calls.append(q.shape[2])
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=seen)
        return out + mx.where(mx.any(seen != mask), mx.array(np.nan, out.dtype), mx.array(0, out.dtype))

    monkeypatch.setattr(attention, "tree_attention", by_contract)

    class Checked(dict):  # every variant has passed `usable`'s check
        def get(self, key, default=None):
            return True

    monkeypatch.setattr(attention, "usable", lambda dtype, head_dim: True)
    monkeypatch.setattr(attention, "_checked", Checked())
    monkeypatch.setattr(attention, "MIN_WIDTH", 0)
    monkeypatch.setattr(attention, "DTYPES", (mx.float32,))
    monkeypatch.setattr(attention, "HEAD_DIMS", range(8, 257, 8))
    return calls
