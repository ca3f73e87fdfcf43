"""Experiment (deleted after one run, bench/RESULTS.md "Fixed lanes"): bench/run.py with every
array-masked attention call as composed ops (MLX's own fallback, `run.composed_attention`)
instead of MLX's fused call (cuDNN on CUDA from two query rows on)."""
import runpy
import sys

import mlx.core as mx

sys.path.insert(0, "bench")
from run import composed_attention  # noqa: E402

_fused = mx.fast.scaled_dot_product_attention


def sdpa(q, k, v, *, scale, mask=None, sinks=None, **kw):
    if isinstance(mask, mx.array) and sinks is None and not kw:
        return composed_attention(q, k, v, mask, scale)
    return _fused(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)


mx.fast.scaled_dot_product_attention = sdpa
sys.argv = ["bench/run.py"] + sys.argv[1:]
runpy.run_path("bench/run.py", run_name="__main__")
