#!/usr/bin/env python3
"""Syntax/type checks of mlx_treespec's GPU kernel sources on a machine without a GPU.

Metal: MLX on Linux cannot run a Metal kernel, but while tracing a function for
``mx.export_function`` it builds each ``mx.fast.metal_kernel``'s full Metal source and, with
``verbose=True``, prints it to stdout. :func:`traced_metal_sources` runs a function under that
tracing with stdout redirected at the file-descriptor level (the print comes from C++), collects
every printed kernel, and :func:`check_metal` compiles one with ``g++ -fsyntax-only`` against
``metal_stdlib_mock.h`` (a stand-in for ``<metal_stdlib>``, next to this file).

CUDA: a CPU build of MLX refuses to even construct an ``mx.fast.cuda_kernel``, so the CUDA
twin's source is rebuilt by :func:`cuda_twin_source` (a mirror of MLX 0.32.4's
``build_kernel``) and :func:`check_cuda` compiles it to PTX with ``nvcc`` (sm_90, the H200)
against a small mock of MLX's ``mlx/backend/cuda/device/utils.cuh``. MLX compiles with NVRTC at
run time; nvcc is the closest stand-in available offline.

What this catches: syntax and type errors, misspelled names and builtins, wrong template use,
a thread attribute used in the header but not in the source. What it cannot catch: anything
about results, Metal address spaces or resource limits. Run the kernels for real for that.

Usage (from the repository root):
    python tests/msl_check.py                      # every variant of the GDN tree kernel
    python tests/msl_check.py package.module:func  # Metal kernels traced by func()
Exit status: 0 all compile, 1 one does not, 2 nothing was traced.
"""
from __future__ import annotations

import atexit
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
METAL_MOCK = os.path.join(HERE, "metal_stdlib_mock.h")

# A stand-in for mlx/backend/cuda/device/utils.cuh: the names MLX's generated custom-kernel
# source relies on (fp16/bf16 types, cuda::std, Shape/Strides).
CUDA_UTILS_MOCK = r"""
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
#define MAX_NDIM 10
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""

_SOURCE_RE = re.compile(r"Generated source code for `([^`]*)`:\n```\n(.*?)```", re.S)


def traced_metal_sources(func: Callable[[], object]) -> List[Tuple[str, str]]:
    """Run ``func`` under mx.export_function tracing; return [(kernel name, Metal source)]."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryFile(mode="w+") as out:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            def traced():
                func()
                return mx.zeros((1,))

            mx.export_function(os.path.join(d, "trace.mlxfn"), traced)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        text = out.read()
    return _SOURCE_RE.findall(text)


def have_gxx() -> bool:
    return shutil.which("g++") is not None


def have_nvcc() -> bool:
    return shutil.which("nvcc") is not None


def check_metal(source) -> Tuple[bool, str]:
    """g++ -fsyntax-only of generated Metal source against the mock header.

    ``source`` is one kernel's source or a list of them, checked as one translation unit
    (MLX names every template variant differently, so they coexist).
    """
    if not isinstance(source, str):
        source = "\n".join(source)
    text = source.replace("#include <metal_stdlib>", "").replace("using namespace metal;", "")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cpp")
        with open(path, "w") as f:
            f.write(f'#include "{METAL_MOCK}"\n')
            f.write(text)
        r = subprocess.run(
            ["g++", "-std=c++17", "-fsyntax-only", "-Wno-attributes",
             "-Wno-ignored-attributes", path],
            capture_output=True, text=True,
        )
    return r.returncode == 0, r.stderr


def check_cuda(source, arch: str = "sm_90") -> Tuple[bool, str]:
    """nvcc device compile (to PTX) of generated CUDA source against the utils mock.

    ``source`` is one kernel's source or a list of them (one translation unit).
    """
    if not isinstance(source, str):
        source = "\n".join(source)
    with tempfile.TemporaryDirectory() as d:
        inc = os.path.join(d, "mlx", "backend", "cuda", "device")
        os.makedirs(inc)
        with open(os.path.join(inc, "utils.cuh"), "w") as f:
            f.write(CUDA_UTILS_MOCK)
        path = os.path.join(d, "kernel.cu")
        with open(path, "w") as f:
            f.write(source)
        r = subprocess.run(
            ["nvcc", "-std=c++17", f"-arch={arch}", "--ptx", "-I", d, path,
             "-o", os.path.join(d, "kernel.ptx")],
            capture_output=True, text=True,
        )
    return r.returncode == 0, r.stdout + r.stderr


def gdn_variants():
    """Every (dtype, Dk, gvec, store_final) variant the GDN tree kernel is built for."""
    import mlx.core as mx

    for dt in (mx.bfloat16, mx.float16, mx.float32):
        for Dk in (64, 128):
            for gvec in (False, True):
                for store_final in (False, True):
                    yield dt, Dk, gvec, store_final


def trace_gdn_metal_variants():
    """Call the Metal tree kernel once per variant with verbose=True, stream=mx.gpu."""
    import mlx.core as mx
    from mlx_treespec import gdn

    B, T, Hk, Hv, Dv = 1, 3, 2, 4, 128
    for dt, Dk, gvec, store_final in gdn_variants():
        z = lambda *s, d=dt: mx.zeros(s, dtype=d)  # noqa: E731
        g = z(B, T, Hv, Dk, d=mx.float32) if gvec else z(B, T, Hv, d=mx.float32)
        gdn.run_tree_kernel(
            "metal", z(B, T, Hk, Dk), z(B, T, Hk, Dk), z(B, T, Hv, Dv), g, z(B, T, Hv),
            z(B, Hv, Dv, Dk, d=mx.float32), [-1, 0, 0], store_final=store_final,
            verbose=True, stream=mx.gpu,
        )


def _cuda_types():
    import mlx.core as mx

    return {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
            mx.int32: "int32_t", mx.float64: "double", mx.int64: "int64_t", mx.uint32: "uint32_t",
            mx.bool_: "bool"}


# MLX 0.32.4 mlx/backend/cuda/custom_kernel.cpp: default_header.
_CUDA_DEFAULT_HEADER = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
    "#define inf cuda::std::numeric_limits<float>::infinity()\n\n"
)


def cuda_kernel_source(name, inputs, outputs, template, header, source) -> Tuple[str, str]:
    """The CUDA source MLX 0.32.4's ``cuda_kernel`` generates (mlx/backend/cuda/custom_kernel.cpp,
    ``build_kernel``): inputs and outputs are [(name, dtype)]; an input's ``<name>_shape`` is a
    parameter where the source names it. Returns ``(kernel name, source)``."""
    types = _cuda_types()

    def h(a):
        if isinstance(a, bool):
            return "_t" if a else "_f"
        if isinstance(a, int):
            return f"_{a}"
        return "_" + str(a).split(".")[-1]

    kname = "custom_kernel_" + name + "".join(h(a) for _, a in template)
    src = _CUDA_DEFAULT_HEADER + header
    src += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += f"__global__ void {kname}(\n"
    for n_, dt in inputs:
        src += f"    const {types[dt]}* {n_},\n"
        if f"{n_}_shape" in source:
            src += f"    const __grid_constant__ Shape {n_}_shape,\n"
    src += ",\n".join(f"    {types[dt]}* {n_}" for n_, dt in outputs) + ") {\n"
    for n_, a in template:
        if isinstance(a, bool):
            src += f"  constexpr bool {n_} = {'true' if a else 'false'};\n"
        elif isinstance(a, int):
            src += f"  constexpr int {n_} = {a};\n"
        else:
            src += f"  using {n_} = {types[a]};\n"
    src += "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n"
    return kname, src


def cuda_twin_source(q_dtype, Dk: int, Dv: int, Hk: int, Hv: int, gvec: bool,
                     store_final: bool, g_dtype=None, beta_dtype=None,
                     v_dtype=None) -> Tuple[str, str]:
    """Rebuild the CUDA source MLX 0.32.4's ``cuda_kernel`` generates for this kernel.

    Through ``cuda_kernel_source`` (a mirror of MLX's ``build_kernel``: default header, header,
    ``__global__`` signature, template constants, source), so it can be compiled on a host
    without a CUDA build of MLX. Returns ``(kernel_name, source)``.
    """
    import mlx.core as mx
    from mlx_treespec.gdn import KERNEL_INPUTS, KERNEL_NAME, KERNEL_OUTPUTS, kernel_header, kernel_source

    g_dtype = mx.float32 if g_dtype is None else g_dtype
    beta_dtype = q_dtype if beta_dtype is None else beta_dtype
    v_dtype = q_dtype if v_dtype is None else v_dtype
    in_dtypes = [q_dtype, q_dtype, v_dtype, g_dtype, beta_dtype, mx.float32, mx.int32]
    out_dtypes = [q_dtype, mx.float32, mx.float32]
    tmpl = [("InT", q_dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
            ("GVec", bool(gvec)), ("StoreFinal", bool(store_final))]

    return cuda_kernel_source(KERNEL_NAME, list(zip(KERNEL_INPUTS, in_dtypes)), list(zip(KERNEL_OUTPUTS, out_dtypes)),
                              tmpl, kernel_header("cuda"), kernel_source("cuda"))


def gdn_cuda_sources() -> List[Tuple[str, str]]:
    import mlx.core as mx

    return [
        cuda_twin_source(dt, Dk, 128, 2, 4, gvec, store_final, g_dtype=mx.float32)
        for dt, Dk, gvec, store_final in gdn_variants()
    ]


# ---------------------------------------------------------------------------------------------
# CPU emulation of the kernel body
# ---------------------------------------------------------------------------------------------
# The body text of metal_kernels/gdn_tree.inc compiled as plain C++ and run on the CPU: every
# 32-lane warp is 32 cooperative user-level contexts (ucontext) that meet at each
# TS_WARP_SUM, which then applies the xor butterfly of the CUDA twin to all lanes at once.
# It runs the body's real indexing, depth-first schedule, scratch reloads and final-state
# write, so a logic error shows up here before the GPU; it says nothing about GPU compilers.

# Both emulators start each lane or thread as a user-level context on its own stack.
EMU_COMMON = r"""
#include <ucontext.h>
#include <vector>
static void start_context(ucontext_t& ctx, std::vector<char>& stack, void (*entry)()) {
  getcontext(&ctx);
  ctx.uc_stack.ss_sp = stack.data();
  ctx.uc_stack.ss_size = stack.size();
  ctx.uc_link = nullptr;
  makecontext(&ctx, entry, 0);
}
"""

EMU_HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <ucontext.h>

typedef float InT;
static int g_Dv, g_Hk, g_Hv;
static const float *g_q, *g_k, *g_v, *g_g, *g_beta, *g_state_in;
static const int32_t* g_tree;
static float *g_y, *g_scratch, *g_state_out;

struct Lane { ucontext_t ctx; std::vector<char> stack; float val; bool done; };
static ucontext_t sched_ctx;
static Lane lanes[32];
static int cur_lane, cur_row, cur_head;

static float ts_warp_sum(float x) {
  lanes[cur_lane].val = x;
  swapcontext(&lanes[cur_lane].ctx, &sched_ctx);
  return lanes[cur_lane].val;
}
#define TS_WARP_SUM(x) ts_warp_sum(x)

template <int Dk, bool GVec, bool StoreFinal>
static void body(const float* q, const float* k, const float* v, const float* g,
                 const float* beta, const float* state_in, const int32_t* tree, InT* y,
                 float* scratch, float* state_out, int ts_lane, int ts_row, int ts_head) {
  const int Dv = g_Dv, Hk = g_Hk, Hv = g_Hv;
#include KERNEL_BODY
}

static void (*g_body)(const float*, const float*, const float*, const float*, const float*,
                      const float*, const int32_t*, InT*, float*, float*, int, int, int);

static void lane_entry() {
  g_body(g_q, g_k, g_v, g_g, g_beta, g_state_in, g_tree, g_y, g_scratch, g_state_out,
         cur_lane, cur_row, cur_head);
  lanes[cur_lane].done = true;
  swapcontext(&lanes[cur_lane].ctx, &sched_ctx);
}

template <int Dk, bool GVec, bool StoreFinal>
static void pick() { g_body = body<Dk, GVec, StoreFinal>; }

static std::vector<char> slurp(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) { perror(path); exit(3); }
  fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<char> b(n); if (n && fread(b.data(), 1, n, f) != (size_t)n) exit(3);
  fclose(f); return b;
}

int main(int argc, char** argv) {
  // args: dir B Dk Dv Hk Hv gvec store_final scratch_floats
  const char* dir = argv[1];
  int B = atoi(argv[2]), Dk = atoi(argv[3]);
  g_Dv = atoi(argv[4]); g_Hk = atoi(argv[5]); g_Hv = atoi(argv[6]);
  int gvec = atoi(argv[7]), sf = atoi(argv[8]);
  long n_scr = atol(argv[9]);
  char p[4096];
  auto load = [&](const char* name) { snprintf(p, sizeof p, "%s/%s", dir, name); return slurp(p); };
  auto q = load("q"), k = load("k"), v = load("v"), g = load("g"), beta = load("beta");
  auto st = load("state"), tree = load("tree");
  g_q = (const float*)q.data(); g_k = (const float*)k.data(); g_v = (const float*)v.data();
  g_g = (const float*)g.data(); g_beta = (const float*)beta.data();
  g_state_in = (const float*)st.data(); g_tree = (const int32_t*)tree.data();
  int T = g_tree[0];
  std::vector<float> y((size_t)B * T * g_Hv * g_Dv, NAN), scr(n_scr > 0 ? n_scr : 1, NAN);
  std::vector<float> out((size_t)B * g_Hv * g_Dv * Dk, NAN);
  g_y = y.data(); g_scratch = scr.data(); g_state_out = out.data();
#define PICK(D) \
  if (Dk == D) { if (gvec) { if (sf) pick<D, true, true>(); else pick<D, true, false>(); } \
                 else { if (sf) pick<D, false, true>(); else pick<D, false, false>(); } }
  PICK(32) PICK(64) PICK(128)
  if (!g_body) { fprintf(stderr, "unsupported Dk\n"); return 4; }
  for (int l = 0; l < 32; ++l) lanes[l].stack.resize(1 << 16);
  for (int head = 0; head < B * g_Hv; ++head) {
    for (int row = 0; row < g_Dv; ++row) {
      for (int l = 0; l < 32; ++l) {
        start_context(lanes[l].ctx, lanes[l].stack, lane_entry);
        lanes[l].done = false;
      }
      for (;;) {
        int n_done = 0;
        for (int l = 0; l < 32; ++l) {
          cur_lane = l; cur_row = row; cur_head = head;
          swapcontext(&sched_ctx, &lanes[l].ctx);
          n_done += lanes[l].done;
        }
        if (n_done == 32) break;
        if (n_done != 0) { fprintf(stderr, "lanes diverged at a warp sum\n"); return 5; }
        float x[32];
        for (int l = 0; l < 32; ++l) x[l] = lanes[l].val;
        for (int m = 1; m < 32; m <<= 1) {
          float nx[32];
          for (int l = 0; l < 32; ++l) nx[l] = x[l] + x[l ^ m];
          for (int l = 0; l < 32; ++l) x[l] = nx[l];
        }
        for (int l = 0; l < 32; ++l) lanes[l].val = x[l];
      }
    }
  }
  snprintf(p, sizeof p, "%s/y.out", dir); FILE* f = fopen(p, "wb");
  fwrite(y.data(), sizeof(float), y.size(), f); fclose(f);
  snprintf(p, sizeof p, "%s/state.out", dir); f = fopen(p, "wb");
  fwrite(out.data(), sizeof(float), out.size(), f); fclose(f);
  snprintf(p, sizeof p, "%s/scratch.out", dir); f = fopen(p, "wb");
  fwrite(scr.data(), sizeof(float), scr.size(), f); fclose(f);
  return 0;
}
"""

_emu_binary = {}


def build_emulator(body_path: str = None) -> str:
    """Compile the emulator around the kernel body; returns the binary's path (cached)."""
    if body_path is None:
        from mlx_treespec import gdn

        d = tempfile.mkdtemp(prefix="gdn_emu_")
        atexit.register(shutil.rmtree, d, True)
        body_path = os.path.join(d, "body.inc")
        with open(body_path, "w") as f:
            f.write(gdn.kernel_body())
    if body_path in _emu_binary:
        return _emu_binary[body_path]
    d = os.path.dirname(body_path)
    src = os.path.join(d, "emu.cpp")
    exe = os.path.join(d, "emu")
    with open(src, "w") as f:
        f.write(EMU_COMMON + EMU_HARNESS)
    r = subprocess.run(
        ["g++", "-std=c++17", "-O1", f'-DKERNEL_BODY="{body_path}"', src, "-o", exe],
        capture_output=True, text=True,
    )
    if r.returncode != 0:
        raise RuntimeError("emulator build failed:\n" + r.stderr)
    _emu_binary[body_path] = exe
    return exe


def emulate_tree_kernel(q, k, v, g, beta, state, parents, store_final=True):
    """Run the kernel body on the CPU (float32); returns numpy (y, final state or None). With
    `parents` a gdn.DevicePlan (its device-built table: every node kept), the second is every
    node's state [B, T, Hv, Dv, Dk], read from the scratch slots."""
    import numpy as np
    from mlx_treespec import gdn

    arrs = {n: np.ascontiguousarray(np.array(a, dtype=np.float32))
            for n, a in dict(q=q, k=k, v=v, g=g, beta=beta, state=state).items()}
    B, T, Hk, Dk = arrs["q"].shape
    Hv, Dv = arrs["v"].shape[-2:]
    on_device = isinstance(parents, gdn.DevicePlan)
    if on_device:
        table, n_slots = parents.kernel_table()
        table = np.array(table)
    else:
        table, n_slots = gdn.tree_kernel_table(parents)
    exe = build_emulator()
    with tempfile.TemporaryDirectory() as d:
        for n, a in arrs.items():
            a.tofile(os.path.join(d, n))
        table.astype(np.int32).tofile(os.path.join(d, "tree"))
        r = subprocess.run(
            [exe, d, str(B), str(Dk), str(Dv), str(Hk), str(Hv), str(int(arrs["g"].ndim == 4)),
             str(int(store_final)), str(B * Hv * n_slots * Dv * Dk)],
            capture_output=True, text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"emulator failed ({r.returncode}): {r.stderr}")
        y = np.fromfile(os.path.join(d, "y.out"), dtype=np.float32).reshape(B, T, Hv, Dv)
        final = np.fromfile(os.path.join(d, "state.out"), dtype=np.float32)
        scratch = np.fromfile(os.path.join(d, "scratch.out"), dtype=np.float32)
    if on_device:
        return y, scratch.reshape(B, Hv, T, Dv, Dk).swapaxes(1, 2)
    return y, (final.reshape(B, Hv, Dv, Dk) if store_final else None)


# ---------------------------------------------------------------------------------------------
# The tree-attention kernel (mlx_treespec/attention.py): its CUDA source, and its body on the CPU
# ---------------------------------------------------------------------------------------------


def attention_cuda_sources() -> List[Tuple[str, str]]:
    """Every variant of the tree-attention kernel and its merge, as MLX would build them."""
    import mlx.core as mx
    from mlx_treespec import attention as at

    out = []
    for dt in at.DTYPES:
        for D in at.HEAD_DIMS:
            for direct in (True, False):
                out.append(cuda_kernel_source(
                    "treespec_tree_attention",
                    [("q", dt), ("k", dt), ("v", dt), ("mask", dt), ("bounds", mx.int32), ("params", mx.float32)],
                    [("out", dt), ("opart", mx.float32), ("lpart", mx.float32)],
                    [("InT", dt), ("D", D), ("KT", at.KEY_TILE), ("Bf16", dt == mx.bfloat16), ("Direct", direct)],
                    at.HEADER, at.PRELUDE + at.kernel_text("tree_attention.inc")))
            out.append(cuda_kernel_source(
                "treespec_tree_attention_merge", [("opart", mx.float32), ("lpart", mx.float32)], [("out", dt)],
                [("InT", dt), ("D", D)], at.HEADER, at.MERGE_PRELUDE + at.kernel_text("tree_attention_merge.inc")))
    return out


# The body on the CPU: a block's 128 threads are cooperative user-level contexts (ucontext) that
# meet at each barrier, shuffle and mma; a warp's mma is done by the scheduler from its 32 lanes'
# fragments, laid out as the PTX ISA gives them for m16n8k16 (bf16/f16 in, f32 accumulators).
ATTN_EMU = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <ucontext.h>

struct uint4 { uint32_t x, y, z, w; };
static inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
alignas(16) static unsigned short ts_smem[2 * 2 * 64 * 136];
static void ts_cp16(unsigned short* dst, const unsigned short* src, bool in) {
  if (in) memcpy(dst, src, 16); else memset(dst, 0, 16);
}
#define TS_CP_COMMIT() ((void)0)
#define TS_CP_WAIT(n) ((void)0)
#define TS_INF INFINITY

static float bits_to_float(unsigned short h, bool bf) {
  if (bf) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
  _Float16 x; memcpy(&x, &h, 2); return (float)x;
}
static unsigned short float_to_bits(float f, bool bf) {
  if (bf) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
  }
  _Float16 x = (_Float16)f; unsigned short h; memcpy(&h, &x, 2); return h;
}
template <bool Bf16> static float ts_to_float(unsigned short h) { return bits_to_float(h, Bf16); }
template <bool Bf16> static uint32_t ts_pack2(float a, float b) {
  return (uint32_t)float_to_bits(a, Bf16) | ((uint32_t)float_to_bits(b, Bf16) << 16);
}
static uint32_t ts_ld32(const unsigned short* p) { uint32_t u; memcpy(&u, p, 4); return u; }
template <bool BF> struct Emu16 {
  unsigned short bits;
  explicit Emu16(float f) : bits(float_to_bits(f, BF)) {}
};

enum { RUN, SYNC, SHFL, MMA, LDM, DONE };
struct Thread {
  ucontext_t ctx; std::vector<char> stack; int op; float val; int lanemask;
  float* d; const uint32_t* a; uint32_t b0, b1; bool bf;
  const unsigned short* row; uint32_t* regs; bool trans;
};
static Thread th[128];
static ucontext_t sched;
static int cur;
static void wait_at(int op) { th[cur].op = op; swapcontext(&th[cur].ctx, &sched); }
#define TS_SYNC() wait_at(SYNC)
static float ts_shfl(float x, int m) { th[cur].val = x; th[cur].lanemask = m; wait_at(SHFL); return th[cur].val; }
#define TS_SHFL_XOR(x, m) ts_shfl((x), (m))
template <bool Bf16> static void ts_mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  Thread& t = th[cur]; t.d = d; t.a = a; t.b0 = b0; t.b1 = b1; t.bf = Bf16; wait_at(MMA);
}
static void ts_ldmatrix_x4(uint32_t* r, const unsigned short* row, bool trans) {
  Thread& t = th[cur]; t.row = row; t.regs = r; t.trans = trans; wait_at(LDM);
}
static void warp_ldmatrix(int w) {  // PTX ldmatrix.m8n8.x4(.trans).b16
  for (int l = 0; l < 32; ++l) {
    Thread& t = th[w * 32 + l];
    for (int m = 0; m < 4; ++m) {
      unsigned short e0, e1;
      if (!t.trans) {
        const unsigned short* row = th[w * 32 + m * 8 + l / 4].row;
        e0 = row[2 * (l % 4)]; e1 = row[2 * (l % 4) + 1];
      } else {
        e0 = th[w * 32 + m * 8 + 2 * (l % 4)].row[l / 4];
        e1 = th[w * 32 + m * 8 + 2 * (l % 4) + 1].row[l / 4];
      }
      t.regs[m] = (uint32_t)e0 | ((uint32_t)e1 << 16);
    }
  }
}
static float lo(uint32_t r, bool bf) { return bits_to_float((unsigned short)(r & 0xffffu), bf); }
static float hi(uint32_t r, bool bf) { return bits_to_float((unsigned short)(r >> 16), bf); }
static void warp_mma(int w) {
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const Thread& t = th[w * 32 + l]; const int g = l >> 2, c = l & 3; const bool bf = t.bf;
    A[g][2 * c] = lo(t.a[0], bf); A[g][2 * c + 1] = hi(t.a[0], bf);
    A[g + 8][2 * c] = lo(t.a[1], bf); A[g + 8][2 * c + 1] = hi(t.a[1], bf);
    A[g][2 * c + 8] = lo(t.a[2], bf); A[g][2 * c + 9] = hi(t.a[2], bf);
    A[g + 8][2 * c + 8] = lo(t.a[3], bf); A[g + 8][2 * c + 9] = hi(t.a[3], bf);
    B[2 * c][g] = lo(t.b0, bf); B[2 * c + 1][g] = hi(t.b0, bf);
    B[2 * c + 8][g] = lo(t.b1, bf); B[2 * c + 9][g] = hi(t.b1, bf);
    C[g][2 * c] = t.d[0]; C[g][2 * c + 1] = t.d[1]; C[g + 8][2 * c] = t.d[2]; C[g + 8][2 * c + 1] = t.d[3];
  }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      float acc = C[i][j];
      for (int x = 0; x < 16; ++x) acc += A[i][x] * B[x][j];
      C[i][j] = acc;
    }
  for (int l = 0; l < 32; ++l) {
    Thread& t = th[w * 32 + l]; const int g = l >> 2, c = l & 3;
    t.d[0] = C[g][2 * c]; t.d[1] = C[g][2 * c + 1]; t.d[2] = C[g + 8][2 * c]; t.d[3] = C[g + 8][2 * c + 1];
  }
}

template <int D, int KT, bool Bf16, bool Direct>
static void body(const unsigned short* q, const unsigned short* k, const unsigned short* v,
                 const unsigned short* mask, const int32_t* bounds, const float* params,
                 unsigned short* out, float* opart, float* lpart, const int* q_shape,
                 const int* k_shape, int ts_tid, int ts_split, int ts_splits, int ts_tile, int ts_bh) {
#include ATTN_BODY
}

template <int D, bool Bf16>
static void merge(const float* opart, const float* lpart, Emu16<Bf16>* out, const int* lpart_shape,
                  int ts_row, int ts_col) {
  using InT = Emu16<Bf16>;
#include MERGE_BODY
}

static const unsigned short *gq, *gk, *gv, *gm;
static const int32_t* gb;
static const float* gp;
static unsigned short* gout;
static float *gop, *glp;
static int g_qs[4], g_ks[4], g_split, g_splits, g_tile, g_bh;
static void (*g_body)(const unsigned short*, const unsigned short*, const unsigned short*,
                      const unsigned short*, const int32_t*, const float*, unsigned short*,
                      float*, float*, const int*, const int*, int, int, int, int, int);

static void entry() {
  g_body(gq, gk, gv, gm, gb, gp, gout, gop, glp, g_qs, g_ks, cur, g_split, g_splits, g_tile, g_bh);
  th[cur].op = DONE;
  swapcontext(&th[cur].ctx, &sched);
}

static int run_block() {
  for (int i = 0; i < 128; ++i) {
    start_context(th[i].ctx, th[i].stack, entry);
    th[i].op = RUN;
  }
  for (;;) {
    for (int i = 0; i < 128; ++i)
      if (th[i].op == RUN) { cur = i; swapcontext(&sched, &th[i].ctx); }
    bool moved = false;
    for (int w = 0; w < 4; ++w) {
      const int op = th[w * 32].op;
      for (int l = 1; l < 32; ++l)
        if (th[w * 32 + l].op != op) { fprintf(stderr, "warp %d diverged\n", w); return 5; }
      if (op == SHFL) {
        float x[32];
        for (int l = 0; l < 32; ++l) x[l] = th[w * 32 + l].val;
        for (int l = 0; l < 32; ++l) th[w * 32 + l].val = x[l ^ th[w * 32 + l].lanemask];
      } else if (op == MMA) {
        warp_mma(w);
      } else if (op == LDM) {
        warp_ldmatrix(w);
      } else {
        continue;
      }
      for (int l = 0; l < 32; ++l) th[w * 32 + l].op = RUN;
      moved = true;
    }
    if (moved) continue;
    int at_sync = 0, done = 0;
    for (int i = 0; i < 128; ++i) { at_sync += th[i].op == SYNC; done += th[i].op == DONE; }
    if (done == 128) return 0;
    if (at_sync != 128) { fprintf(stderr, "threads diverged at a barrier\n"); return 6; }
    for (int i = 0; i < 128; ++i) th[i].op = RUN;
  }
}

static std::vector<char> slurp(const char* dir, const char* name) {
  char p[4096]; snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE* f = fopen(p, "rb");
  if (!f) { perror(p); exit(3); }
  fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<char> b(n); if (n && fread(b.data(), 1, n, f) != (size_t)n) exit(3);
  fclose(f); return b;
}

template <int D, bool Bf16, bool Direct> static void pick(int kt) {
  g_body = kt == 32 ? body<D, 32, Bf16, Direct> : body<D, 64, Bf16, Direct>;
}

int main(int argc, char** argv) {
  // args: dir B Hq R Hkv W D bf16 splits key_tile
  const char* dir = argv[1];
  const int B = atoi(argv[2]), Hq = atoi(argv[3]), R = atoi(argv[4]), Hkv = atoi(argv[5]);
  const int W = atoi(argv[6]), D = atoi(argv[7]), bf = atoi(argv[8]), S = atoi(argv[9]);
  const int KT = atoi(argv[10]);
  auto q = slurp(dir, "q"), k = slurp(dir, "k"), v = slurp(dir, "v"), m = slurp(dir, "mask");
  auto b = slurp(dir, "bounds"), p = slurp(dir, "params");
  gq = (const unsigned short*)q.data(); gk = (const unsigned short*)k.data();
  gv = (const unsigned short*)v.data(); gm = (const unsigned short*)m.data();
  gb = (const int32_t*)b.data(); gp = (const float*)p.data();
  const int rows = B * Hq * R;
  std::vector<unsigned short> out((size_t)rows * D, 0x7fc0);
  std::vector<float> op((size_t)S * rows * D, NAN), lp((size_t)S * rows, NAN);
  gout = out.data(); gop = op.data(); glp = lp.data();
  g_qs[0] = B; g_qs[1] = Hq; g_qs[2] = R; g_qs[3] = D;
  g_ks[0] = B; g_ks[1] = Hkv; g_ks[2] = W; g_ks[3] = D;
  const bool direct = S == 1;
#define PICK(DD, BF) if (D == DD && bf == BF) { if (direct) pick<DD, BF, true>(KT); else pick<DD, BF, false>(KT); }
  PICK(64, 0) PICK(64, 1) PICK(128, 0) PICK(128, 1)
  if (!g_body) { fprintf(stderr, "unsupported D\n"); return 4; }
  for (int i = 0; i < 128; ++i) th[i].stack.resize(1 << 16);
  const int tiles = ((Hq / Hkv) * R + 63) / 64;
  g_splits = S;
  for (g_bh = 0; g_bh < B * Hkv; ++g_bh)
    for (g_tile = 0; g_tile < tiles; ++g_tile)
      for (g_split = 0; g_split < S; ++g_split) {
        const int rc = run_block();
        if (rc) return rc;
      }
  if (!direct) {
    const int ls[2] = {S, rows};
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < D; ++c) {
#define MERGE(DD, BF) if (D == DD && bf == BF) \
        merge<DD, BF>(op.data(), lp.data(), reinterpret_cast<Emu16<BF>*>(out.data()), ls, r, c);
        MERGE(64, 0) MERGE(64, 1) MERGE(128, 0) MERGE(128, 1)
      }
  }
  char path[4096]; snprintf(path, sizeof path, "%s/out.bin", dir);
  FILE* f = fopen(path, "wb"); fwrite(out.data(), 2, out.size(), f); fclose(f);
  return 0;
}
"""

_attn_emu = {}


def build_attention_emulator() -> str:
    """Compile the emulator around the tree-attention kernel's bodies; returns the binary (cached)."""
    if "exe" in _attn_emu:
        return _attn_emu["exe"]
    from mlx_treespec import attention as at

    d = tempfile.mkdtemp(prefix="attn_emu_")
    atexit.register(shutil.rmtree, d, True)
    for name in ("tree_attention.inc", "tree_attention_merge.inc"):
        with open(os.path.join(d, name), "w") as f:
            f.write(at.kernel_text(name))
    src, exe = os.path.join(d, "emu.cpp"), os.path.join(d, "emu")
    with open(src, "w") as f:
        f.write(EMU_COMMON + ATTN_EMU)
    r = subprocess.run(
        ["g++", "-std=c++17", "-O1", f'-DATTN_BODY="{d}/tree_attention.inc"',
         f'-DMERGE_BODY="{d}/tree_attention_merge.inc"', src, "-o", exe],
        capture_output=True, text=True,
    )
    if r.returncode != 0:
        raise RuntimeError("attention emulator build failed:\n" + r.stderr)
    _attn_emu["exe"] = exe
    return exe


def emulate_tree_attention(q, k, v, mask, bounds, scale, splits, key_tile=64):
    """Run the kernel (and, with several splits, its merge) on the CPU; q, k, v, mask are mx
    float16 / bfloat16 arrays as attention.tree_attention takes them. Returns the output as an mx
    array of q's dtype."""
    import numpy as np
    import mlx.core as mx

    bits = lambda a: np.array(mx.contiguous(a).view(mx.uint16))  # noqa: E731
    B, Hq, R, D = q.shape
    _, Hkv, W, _ = k.shape
    exe = build_attention_emulator()
    with tempfile.TemporaryDirectory() as d:
        for n, a in dict(q=q, k=k, v=v, mask=mask).items():
            bits(a).tofile(os.path.join(d, n))
        np.asarray(bounds, np.int32).tofile(os.path.join(d, "bounds"))
        np.array([scale], np.float32).tofile(os.path.join(d, "params"))
        r = subprocess.run([exe, d] + [str(x) for x in (B, Hq, R, Hkv, W, D, int(q.dtype == mx.bfloat16), splits, key_tile)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"attention emulator failed ({r.returncode}): {r.stderr}")
        out = np.fromfile(os.path.join(d, "out.bin"), dtype=np.uint16).reshape(B, Hq, R, D)
    return mx.array(out).view(q.dtype)


def main(argv: List[str]) -> int:
    sys.path.insert(0, os.getcwd())
    found, failed = 0, 0
    funcs = []
    if argv:
        for spec in argv:
            m, f = spec.split(":")
            funcs.append(getattr(importlib.import_module(m), f))
    else:
        funcs.append(trace_gdn_metal_variants)
    for func in funcs:
        for name, source in traced_metal_sources(func):
            found += 1
            ok, err = check_metal(source)
            print(f"{'ok  ' if ok else 'FAIL'} metal {name}")
            if not ok:
                failed += 1
                print(err)
    if not argv:
        if have_nvcc():
            for name, source in gdn_cuda_sources():
                found += 1
                ok, err = check_cuda(source)
                print(f"{'ok  ' if ok else 'FAIL'} cuda  {name}")
                if not ok:
                    failed += 1
                    print(err)
        else:
            print("nvcc not found: CUDA twin not compiled")
    if found == 0:
        print("no kernel was traced: does the function call its kernels with verbose=True "
              "and stream=mx.gpu?")
        return 2
    print(f"{found - failed} of {found} kernel sources compile")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ---------------------------------------------------------------------------------------------
# One-thread kernels (mlx_treespec/device_tree.py): their bodies on the CPU, their sources
# ---------------------------------------------------------------------------------------------

_C_TYPES = {"float32": "float", "uint32": "uint32_t", "int32": "int32_t", "bool": "bool"}
_single_binary = {}


def emulate_single_thread(body_name, template, inputs, outputs):
    """Run a one-thread kernel body of metal_kernels/ as plain C++ on the CPU: `template` the
    int constants {name: value}, `inputs` [(name, numpy array)], `outputs` [(name, numpy dtype,
    shape)]; returns the outputs as numpy arrays."""
    import numpy as np
    from mlx_treespec import device_tree

    key = (body_name, tuple(sorted(template.items())), tuple((n, a.dtype.name) for n, a in inputs),
           tuple((n, np.dtype(t).name) for n, t, _ in outputs))
    exe = _single_binary.get(key)
    if exe is None:
        d = tempfile.mkdtemp(prefix="tree_emu_")
        atexit.register(shutil.rmtree, d, True)
        with open(os.path.join(d, "body.inc"), "w") as f:
            f.write(device_tree.kernel_text(body_name))
        params = [f"const {_C_TYPES[a.dtype.name]}* {n}" for n, a in inputs] + \
            [f"{_C_TYPES[np.dtype(t).name]}* {n}" for n, t, _ in outputs]
        consts = "".join(f"  constexpr int {n} = {v};\n" for n, v in template.items())
        reads = "".join(f'  auto in_{n} = slurp(dir, "{n}");\n' for n, _ in inputs)
        allocs = "".join(f"  std::vector<char> buf_{n}({int(np.prod(s)) * np.dtype(t).itemsize}); "
                         f"auto* out_{n} = ({_C_TYPES[np.dtype(t).name]}*)buf_{n}.data();\n"
                         for n, t, s in outputs)
        args = ", ".join([f"(const {_C_TYPES[a.dtype.name]}*)in_{n}.data()" for n, a in inputs] +
                         [f"out_{n}" for n, _, _ in outputs])
        writes = "".join(f'  spill(dir, "{n}.out", buf_{n}.data(), buf_{n}.size());\n' for n, _, _ in outputs)
        src = (
            "#include <cstdint>\n#include <cstdio>\n#include <cstdlib>\n#include <cmath>\n#include <vector>\n"
            "#define TS_NEG_INF (-INFINITY)\n"
            f"static void body({', '.join(params)}) {{\n{consts}#include \"{d}/body.inc\"\n}}\n"
            "static std::vector<char> slurp(const char* dir, const char* name) {\n"
            "  char p[4096]; snprintf(p, sizeof p, \"%s/%s\", dir, name); FILE* f = fopen(p, \"rb\");\n"
            "  if (!f) exit(3); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);\n"
            "  std::vector<char> b(n + 1); if (n && fread(b.data(), 1, n, f) != (size_t)n) exit(3);\n"
            "  fclose(f); return b; }\n"
            "static void spill(const char* dir, const char* name, const void* p, size_t n) {\n"
            "  char q[4096]; snprintf(q, sizeof q, \"%s/%s\", dir, name); FILE* f = fopen(q, \"wb\");\n"
            "  fwrite(p, 1, n, f); fclose(f); }\n"
            f"int main(int argc, char** argv) {{\n  const char* dir = argv[1];\n{reads}{allocs}"
            f"  body({args});\n{writes}  return 0;\n}}\n")
        with open(os.path.join(d, "emu.cpp"), "w") as f:
            f.write(src)
        exe = os.path.join(d, "emu")
        r = subprocess.run(["g++", "-std=c++17", "-O1", os.path.join(d, "emu.cpp"), "-o", exe],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("emulator build failed:\n" + r.stderr)
        exe = _single_binary[key] = exe
    with tempfile.TemporaryDirectory() as d:
        for n, a in inputs:
            np.ascontiguousarray(a).tofile(os.path.join(d, n))
        r = subprocess.run([exe, d], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"emulator failed ({r.returncode}): {r.stderr}")
        return [np.fromfile(os.path.join(d, n + ".out"), dtype=t).reshape(s) for n, t, s in outputs]


def trace_device_tree_metal():
    """The Metal build and walk kernels, traced once each (verbose: the source is printed)."""
    import mlx.core as mx
    from mlx_treespec import device_tree

    device_tree.run_build("metal", mx.zeros((4, 3)), mx.zeros((4, 3), mx.uint32), mx.zeros((1,), mx.uint32), 6,
                          verbose=True, stream=mx.gpu)
    device_tree.run_walk("metal", mx.zeros((5,), mx.uint32), mx.zeros((5,), mx.uint32), mx.zeros((5,), mx.int32),
                         verbose=True, stream=mx.gpu)


def device_tree_cuda_sources() -> List[Tuple[str, str]]:
    import mlx.core as mx
    from mlx_treespec import device_tree

    h = device_tree._HEADER["cuda"]
    return [
        cuda_kernel_source("ddtree_build", [("lp", mx.float32), ("ids", mx.uint32), ("root", mx.uint32)],
                           [("tokens", mx.uint32), ("parents", mx.int32), ("depths", mx.int32), ("anc", mx.bool_)],
                           [("D", 15), ("K", 31), ("N", 31)], h, device_tree.kernel_text("ddtree_build.inc")),
        cuda_kernel_source("tree_walk", [("choice", mx.uint32), ("tokens", mx.uint32), ("parents", mx.int32)],
                           [("count", mx.int32), ("path", mx.int32), ("emitted", mx.uint32)],
                           [("T", 32)], h, device_tree.kernel_text("tree_walk.inc")),
    ]
