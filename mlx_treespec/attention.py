"""Tree attention on CUDA GPUs: the history unmasked, the mask on the round's own columns only.

A tree verify's node sees every committed key and its own ancestors among the round's rows. MLX's
fused attention takes that as an additive mask over every key column, and on the H200 cuDNN's
masked path costs well over its causal one at long context (bench/RESULTS.md, long context).
This kernel (metal_kernels/tree_attention.inc, tensor-core `mma.sync`) reads the mask only in
the columns [hist, end) a round wrote, never past `end`, and splits the key columns over blocks
(each block leaves its rows' sums and log-sum-exps; a second kernel weighs them together), so a
few query rows still fill the GPU at any context length. It runs from MIN_WIDTH key columns,
and at any width for a queued head chain's one-row steps (`fits`, STEP_ROWS).

The contract with the caller (verify.py): `mask` is the round's additive mask [R, W], 0 in
columns [0, hist) and the most negative value of its dtype from `end` on; `bounds` holds
(hist, end) on the device. Only the columns in between are read from it.

CUDA only. On Metal the masked fused attention runs as before (nothing here was run on Apple
silicon); on CPU the verify keeps its boolean mask, whose arithmetic is plain decoding's.
"""
import functools
import warnings
from pathlib import Path

import numpy as np
import mlx.core as mx

from .tree import ancestors_of

__all__ = ["tree_attention", "usable", "splits_for"]

ROWS = 64  # query rows per block (4 warps of 16: the mma fragments' rows)
HEAD_DIMS = (64, 128)
DTYPES = (mx.float16, mx.bfloat16)
# Tile and split sizes, and the width from which the kernel runs, from sweeps on the H100 and
# H200 (bench/RESULTS.md at a9f0a7f, "Tree attention at long context"): tiles of 32 or 64 columns and
# splits of 512 or more columns, at most 32 of them, were within a few percent of the best at
# 1k, 8k and 32k keys; with 2k-column buffers (a 1k context) cuDNN's masked attention was the
# faster, from 9k columns on the kernel
MAX_SPLITS = 32
SPLIT_KEYS = 512
KEY_TILE = 32
MIN_WIDTH = 8192
# Query rows up to which a drafter's step (a queued head draft: `fits`' `steps`) runs the kernel
# at any key width: a chain step's one row. MLX's CUDA backend runs a masked attention of one
# query row as separate ops (scores, scale, mask add, softmax, values), the kernel in one launch
# or two, and a queued round, host-bound, launches one such step per draft token; a lane tree's
# four-row steps, which MLX ran as one fused attention, were not faster through the kernel
# (bench/RESULTS.md, "One-row steps through the tree-attention kernel")
STEP_ROWS = 1


def splits_for(width):
    """Blocks the key columns of a buffer `width` wide are split over (the one rule)."""
    return max(1, min(MAX_SPLITS, width // SPLIT_KEYS))


def kernel_backend():
    """'metal' or 'cuda' when the default device is a GPU of that backend, else None: where the
    kernels (tree attention, the GatedDeltaNet scan, the device tree's build and walk) may run."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def kernel_text(name):
    """The text of metal_kernels/NAME, installed beside the package or in a source checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "metal_kernels" / name, here.parent / "metal_kernels" / name):
        if cand.is_file():
            return cand.read_text()
    raise FileNotFoundError(f"metal_kernels/{name} not found next to mlx_treespec")


PRELUDE = """\
  extern __shared__ __align__(16) unsigned short ts_smem[];
  const int ts_tid = static_cast<int>(threadIdx.x);
  const int ts_split = static_cast<int>(blockIdx.x), ts_splits = static_cast<int>(gridDim.x);
  const int ts_tile = static_cast<int>(blockIdx.y), ts_bh = static_cast<int>(blockIdx.z);
"""
MERGE_PRELUDE = """\
  const int ts_col = static_cast<int>(threadIdx.x);
  const int ts_row = static_cast<int>(blockIdx.y);
"""
HEADER = r"""
#ifndef MLX_TREESPEC_ATTENTION_HEADER
#define MLX_TREESPEC_ATTENTION_HEADER
#define TS_INF __int_as_float(0x7f800000)
// 16 bytes global -> shared, asynchronously (zeros where !in: no byte is read)
__device__ __forceinline__ void ts_cp16(unsigned short* dst, const unsigned short* src, bool in) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src), "r"(in ? 16 : 0));
}
// four 8x8 16-bit matrices from shared memory, one row address per lane (PTX ldmatrix)
__device__ __forceinline__ void ts_ldmatrix_x4(uint32_t* r, const unsigned short* row, bool trans) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
#define TS_CP_COMMIT() asm volatile("cp.async.commit_group;\n" ::)
#define TS_CP_WAIT(n) asm volatile("cp.async.wait_group %0;\n" ::"n"(n))
#define TS_SYNC() __syncthreads()
#define TS_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
__device__ __forceinline__ uint32_t ts_ld32(const unsigned short* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
template <bool Bf16>
__device__ __forceinline__ float ts_to_float(unsigned short h) {
  if constexpr (Bf16) return __bfloat162float(__ushort_as_bfloat16(h));
  else return __half2float(__ushort_as_half(h));
}
template <bool Bf16>
__device__ __forceinline__ uint32_t ts_pack2(float a, float b) {  // a in the low half
  if constexpr (Bf16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}
// d += a (16x16, row) * b (16x8, col), fp32 accumulators; PTX ISA fragment layouts
template <bool Bf16>
__device__ __forceinline__ void ts_mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (Bf16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
"""
INPUTS = ["q", "k", "v", "mask", "bounds", "params"]
OUTPUTS = ["out", "opart", "lpart"]
MERGE_INPUTS = ["opart", "lpart"]


def shared_bytes(D, key_tile):
    """Shared memory of a block: two stages of K and V tiles, rows padded to D + 8."""
    return 2 * 2 * key_tile * (D + 8) * 2


@functools.lru_cache(maxsize=None)
def _kernel(D, key_tile):
    return mx.fast.cuda_kernel(name="treespec_tree_attention", input_names=INPUTS, output_names=OUTPUTS,
                               source=PRELUDE + kernel_text("tree_attention.inc"), header=HEADER,
                               shared_memory=shared_bytes(D, key_tile))


@functools.lru_cache(maxsize=None)
def _merge():
    return mx.fast.cuda_kernel(name="treespec_tree_attention_merge", input_names=MERGE_INPUTS,
                               output_names=["out"], source=MERGE_PRELUDE + kernel_text("tree_attention_merge.inc"),
                               header=HEADER)


_params = {}


def _scale_array(scale):
    a = _params.get(scale)
    if a is None:
        a = _params[scale] = mx.array([scale], mx.float32)
    return a


def fits(q, k, v, mask, steps=False):
    """Whether the kernel takes these shapes, and pays there (else the caller runs MLX's fused
    attention): key buffers of at least MIN_WIDTH columns, or (`steps`: a drafter's forward) up
    to STEP_ROWS query rows at any width, of a variant `usable` has checked (only looked up
    here: this runs while a verify is traced, where nothing may be evaluated)."""
    if not isinstance(k, mx.array) or k.ndim != 4 or q.ndim != 4:
        return False
    B, Hq, R, D = q.shape
    if k.shape[2] < MIN_WIDTH and not (steps and R <= STEP_ROWS):
        return False
    return (_checked.get((q.dtype, D)) is True and q.dtype in DTYPES and k.dtype == q.dtype
            and v.dtype == q.dtype and mask.dtype == q.dtype and D in HEAD_DIMS and k.shape[3] == D
            and v.shape == k.shape and k.shape[0] == B and Hq % k.shape[1] == 0
            and mask.shape == (R, k.shape[2]) and B * Hq * R <= 65535)  # the merge's grid: one block row per output row


def tree_attention(q, k, v, mask, bounds, scale):
    """softmax(q k^T * scale + mask) v for q [B, Hq, R, D] over whole buffers k, v [B, Hkv, W, D],
    reading `mask` [R, W] only in columns [bounds[0], bounds[1]) (module docstring)."""
    B, Hq, R, D = q.shape
    Hkv, W = k.shape[1], k.shape[2]
    splits = splits_for(W)
    tiles = -(-(Hq // Hkv) * R // ROWS)
    direct = splits == 1
    rows = B * Hq * R
    out, opart, lpart = _kernel(D, KEY_TILE)(
        inputs=[q, k, v, mask, bounds, _scale_array(float(scale))],
        template=[("InT", q.dtype), ("D", D), ("KT", KEY_TILE), ("Bf16", q.dtype == mx.bfloat16),
                  ("Direct", direct)],
        grid=(splits * 128, tiles, B * Hkv), threadgroup=(128, 1, 1),
        output_shapes=[q.shape if direct else (1,), (1,) if direct else (splits, rows, D),
                       (1,) if direct else (splits, rows)],
        output_dtypes=[q.dtype, mx.float32, mx.float32])
    if direct:
        return out
    return _merge()(inputs=[opart, lpart], template=[("InT", q.dtype), ("D", D)],
                 grid=(D, rows, 1), threadgroup=(D, 1, 1), output_shapes=[q.shape],
                 output_dtypes=[q.dtype])[0]


_checked = {}


def usable(dtype, head_dim):
    """Whether the kernel runs on this device for (dtype, head_dim): on a CUDA GPU, built and
    checked once per variant against MLX's fused attention (a problem small enough to take a
    moment, with several splits and a masked tail); never on CPU or Metal. A variant that fails
    to build or to agree warns once and is not used again."""
    key = (dtype, head_dim)
    ok = _checked.get(key)
    if ok is None:
        ok = _checked[key] = _backend_is_cuda() and dtype in DTYPES and head_dim in HEAD_DIMS and _agrees(dtype, head_dim)
    return ok


def _backend_is_cuda():
    return kernel_backend() == "cuda"


def _agrees(dtype, D, B=1, Hkv=2, G=3, R=13, hist=506, W=1024):
    """The kernel against MLX's attention in float32 over the same 16-bit inputs: two splits,
    the round's columns across their boundary (both splits hold columns some rows see and
    columns they do not; the merge weighs two live splits)."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
               for s in ((B, Hkv * G, R, D), (B, Hkv, W, D), (B, Hkv, W, D)))
    parents = np.concatenate([[-1], rng.integers(-1, np.arange(1, R))])
    seen = ancestors_of(parents)  # a random tree's ancestor rows
    visible = np.zeros((R, W), bool)
    visible[:, :hist] = True
    visible[:, hist:hist + R] = seen
    mask = mx.where(mx.array(visible), mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
    bounds = mx.array([hist, hist + R], mx.int32)
    scale = D ** -0.5
    try:
        got = tree_attention(q, k, v, mask, bounds, scale).astype(mx.float32)
        f32 = [a.astype(mx.float32)[:, :, :hist + R] for a in (k, v)]
        want = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), *f32, scale=scale,
                                                    mask=mx.array(visible[:, :hist + R]))
        err = mx.abs(got - want).max().item()
    except Exception as e:  # NVRTC, a driver without mma.sync, ...
        warnings.warn(f"mlx_treespec: the tree-attention kernel ({dtype}, head dim {D}) did not "
                      f"build ({type(e).__name__}: {e}); tree verifies use MLX's masked attention")
        return False
    # the output's own 16-bit rounding and the probabilities' (they reach the tensor cores in 16
    # bits): ~1.1e-3 in bf16 and ~1e-4 in f16 on this problem in tests/msl_check.py's emulator,
    # where a wrong tree mask differs by ~0.08
    if not err < (5e-3 if dtype == mx.bfloat16 else 1e-3):
        warnings.warn(f"mlx_treespec: the tree-attention kernel ({dtype}, head dim {D}) differs "
                      f"from MLX's attention by {err:.3g}; tree verifies use MLX's masked attention")
        return False
    return True
