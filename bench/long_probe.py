"""One-off probe (issue 22), kept in git history only: where a tree verify's time goes at long
context on the H200, in the model (8B shape, bf16, random weights, caches aligned to 1024 rows).
mlx-lm's attention call is swapped per variant: as is, q made contiguous, no mask, no attention
at all (q passed through: no attention and no K/V write runs). Ran at e748bbe, before
`verify.compiled_forward` chose between compiled and eager per shape (compiled=True ran compiled
after its checks then).   python3 bench/long_probe.py 32768"""
import statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1])); sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np, mlx.core as mx
import mlx_lm.models.qwen3 as q3
from run import _filled_caches
from mlx_treespec import costmodel, verify
from mlx_treespec.draft import Draft, Layout
from mlx_treespec.probe import representative_tree_parents
from mlx_treespec.verify import TreeRound

orig = q3.scaled_dot_product_attention
def contig(q, k, v, cache=None, scale=None, mask=None):
    return orig(mx.contiguous(q), k, v, cache=cache, scale=scale, mask=mask)
def noattn(q, k, v, cache=None, scale=None, mask=None):
    return q * 1
def nomask(q, k, v, cache=None, scale=None, mask=None):
    return orig(q, k, v, cache=cache, scale=scale, mask=None)
VARIANTS = dict(orig=orig, contig_q=contig, nomask=nomask, noattn=noattn)

T = 32
parents = representative_tree_parents(2, 12, T - 1)
model = costmodel.build_from_config(costmodel.load_config("bench/configs/qwen3_8b.json"), "bfloat16", None)
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
caches, n_kv, hd, dtype = _filled_caches(model, ctx)
for c in caches:
    c.keys, c.values = verify.grown(c.keys, ctx + 64), verify.grown(c.values, ctx + 64)
mx.eval([c.state for c in caches])
tokens = mx.array(np.arange(T).astype(np.uint32) + 3)
def causal():
    out = model(tokens[None], cache=caches); mx.eval(out)
    for c in caches: c.offset = ctx
def tree(compiled):
    def f():
        rnd = TreeRound(model, caches, compiled=compiled)
        logits, _ = rnd.verify(Draft(tokens, Layout.fixed(parents))); mx.eval(logits); rnd.abort()
    return f
for name, fn in VARIANTS.items():
    q3.scaled_dot_product_attention = fn
    model.__dict__.pop("_treespec_compiled_verify", None)
    arms = dict(causal=causal, tree_eager=tree(False), tree_compiled=tree(True))
    times = {a: [] for a in arms}
    for r in range(7):
        for a, f in arms.items():
            mx.synchronize(); t0 = time.perf_counter(); f(); dt = time.perf_counter() - t0
            if r >= 3: times[a].append(1e3 * dt)
    print(f"ctx {ctx} sdpa={name}: " + ", ".join(f"{a} {statistics.median(v):.2f}" for a, v in times.items()), flush=True)
