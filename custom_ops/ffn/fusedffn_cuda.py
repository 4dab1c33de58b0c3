"""FusedFFN, CUDA face: S[..., N] = SiLU(X W1^T + B1) * (X W3^T + B3), W1/W3 [N, K], or [K, N] with the attribute
weights_kn = 1 (reference: onnx_lowbit.ffn).

Types: X, B1, B3, S of T, W1, W3 of TW, T and TW each float or float16 (four variants). Products are accumulated
in fp32 and SiLU is computed in fp32 (z / (1 + exp(-z)), libdevice expf), one rounding to T.

Which kernel serves a call is ``ROUTES`` (read top to bottom, the first row that holds serves it); the kernel
object builds the call's ``Case`` (``case``) and launches the row's kernel, nothing else decides a path. The
kernels: ``decode`` (fusedffn_decode_cuda, [N, K], M <= 2), ``tc`` (fusedffn_tc_cuda, fp16 [N, K] at M = 3..32),
``kn_tc`` (fusedffn_kn_tc_cuda, fp16 [K, N] at M = 2..16), ``kn_decode`` (fusedffn_kn_cuda, [K, N], M <= 2),
the cuBLAS path ``gemm`` / ``gemm_tf32`` / ``gemm_f16out`` and the fallback ``tiled`` (fusedffn_prefill_cuda). The ffn
pass picks the layout (option ffn_weights, default "auto": for fp16 models [N, K] below 17 static rows, [K, N]
from there and for dynamic rows; [N, K] for fp32 / mixed); measured trade-off in docs/ffn.md.

Native plans (plans.py), every path: the GEMMs are recorded like kernel launches (cublas.Handle.gemm_rows; one
cuBLAS handle per stream with a fixed workspace), so after the first call per input signature the C shim replays
the whole call (converts, GEMMs, activation) without Python, also under CUDA-graph capture.

Scratch (the cuBLAS path: G, the converted x, the row scales; the [K, N] decode kernel's split-K partials): taken
per call from onnxruntime's allocator (``Context.scratch``: the CUDA arena, on the call's stream) and given back by
the shim once the call's launches are issued; a native replay takes one of the recorded size the same way. With
onnxruntime older than 1.18 (no scratch API) the prefill shapes run the tiled kernel and the [K, N] decode kernel
one split (K <= its KS_MAX). ``run`` without a scratch provider (GPU tests, benchmarks) uses a buffer the kernel
object keeps and grows.
"""
from __future__ import annotations

import os as _os

import numpy as np
from numba import cuda

from onnx_lowbit import ffn

from ..device import cublas, launch as cuda_launch
from ..device.splitk import ScratchPool
from ..device.target import SIM, tc_device
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route
from . import (fusedffn_decode_cuda as dec, fusedffn_kn_cuda as knm, fusedffn_kn_tc_cuda as kntc,
               fusedffn_prefill_cuda as pre, fusedffn_tc_cuda as tcm)
from .common import check_shapes

DECODE_MAX_M = dec.MT_BUCKETS[-1]   # [N, K]: rows of X on the decode kernel
TC_MIN_M, TC_MAX_M = 3, 32      # fp16 X and W, [N, K]: M on the tensor-core kernel (past 32 rows it re-reads the
                                # weights per 16-row chunk and cuBLAS is faster); read when routing
                                # (benchmarks/session_gpu.py sets TC_MAX_M = 0 to time cuBLAS there)
KN_TC_MIN_M, KN_TC_MAX_M = 2, 16    # [K, N], fp16 X and W: M on fusedffn_kn_tc_cuda (M = 9..16, H100 sessions:
                                    # 81.4-82.6 us with CUDA graphs, 87-93 without, against cuBLAS's 82.2-82.9 and
                                    # 89-100; the kernels alone: 73.4 against 69.1-70.6 us); read when routing
TF32 = _os.environ.get("ONNX_LOWBIT_TF32", "1") != "0"
                                # prefill GEMMs with fp32 inputs (fp32 X and W; fp16 X widened for fp32 W) on the
                                # tensor cores in TF32 (cuBLAS COMPUTE_32F_FAST_TF32), as onnxruntime's CUDA MatMul
                                # runs the unfused graph's by default (provider option use_tf32 = 1). H100 sessions,
                                # fp32 4096 x 11008: strict fp32 GEMMs made FusedFFN 0.24-0.79x the unfused graph at
                                # M = 3..256, TF32 0.98-1.14x (max rel. error 4.7e-4). ONNX_LOWBIT_TF32=0 (for
                                # sessions with use_tf32 = 0): strict fp32. Read at kernel creation (Case.opts 'tf32').
SIM_SMS = 2                     # SMs the simulator pretends to have (decode grids of several blocks)
PATHS = ("decode", "tc", "gemm", "tiled")   # what Case.opts 'path' may force (tests, benchmarks)


# ------------------------------------------------------------------------------------------ routing
def _path(c, name):
    """The call is routed (no 'path' forced) or forced onto ``name``."""
    return c.opt("path") in (None, name)


def _cublas(c):
    return _path(c, "gemm") and c.opt("cublas") and c.opt("scratch") and c.k > 0


def _f16(c):
    return c.dtype == c.wdtype == "float16"


ROUTES = (
    Route("tiled", "forced: path 'tiled' (tests, benchmarks)", lambda c: c.opt("path") == "tiled",
          "not measured: forced only"),
    Route("decode", "[N, K], M <= 2, K a multiple of the 16-byte chunk (8 fp16 / 4 fp32 W), 16-byte aligned W, "
          "M bucket x K x 4 bytes of x <= 100 KiB",
          lambda c: c.layout == "nk" and _path(c, "decode") and c.m <= DECODE_MAX_M and
          dec.fits(c.m, c.k, c.wdtype == "float16", c.aligned),
          "BENCHMARKS.md 'FusedFFN (fp16 weights), decode and prefill kernels' (M = 1, 2); docs/lab-log.md session 30"),
    Route("tc", "[N, K], fp16 X and W, tensor cores, K % 8 == 0, 16-byte aligned X and W, M = 3..32 "
          "(TC_MIN_M..TC_MAX_M; forced: any M)",
          lambda c: c.layout == "nk" and _path(c, "tc") and _f16(c) and c.tc and
          tcm.ok(True, True, c.m, c.k, c.aligned and c.opt("x_aligned")) and
          (c.opt("path") == "tc" or TC_MIN_M <= c.m <= TC_MAX_M),
          "docs/lab-log.md session 24 (M = 3..32 against cuBLAS and torch); BENCHMARKS.md 'Float FusedFFN' ([N, K] "
          "row)"),
    Route("kn_tc", "[K, N], fp16 X and W, tensor cores, K % 8 == 0, N % 8 == 0, 16-byte aligned X and W, M = 2..16 "
          "(KN_TC_MIN_M..KN_TC_MAX_M; forced: any M)",
          lambda c: c.layout == "kn" and _path(c, "tc") and _f16(c) and c.tc and
          kntc.ok(True, True, c.m, c.k, c.n, c.aligned and c.opt("x_aligned")) and
          (c.opt("path") == "tc" or KN_TC_MIN_M <= c.m <= KN_TC_MAX_M),
          "docs/lab-log.md session 30; BENCHMARKS.md 'Float FusedFFN' (M = 2..16)"),
    Route("kn_decode", "[K, N], M <= 2, K >= 1, N a multiple of the 16-byte chunk, 16-byte aligned W, <= 4096 column "
          "tiles; scratch for the split-K partials, or K <= 4096 (one split)",
          lambda c: c.layout == "kn" and _path(c, "decode") and
          knm.ok(c.m, c.k, c.n, c.wdtype == "float16", c.aligned) and (c.opt("scratch") or c.k <= knm.KS_MAX),
          "docs/lab-log.md sessions 29, 30; BENCHMARKS.md 'FusedFFN (fp16 weights), decode and prefill kernels' (M = 1)"),
    Route("gemm_f16out", "cuBLAS, scratch and K > 0; [K, N] with fp16 X and W: GEMMs with fp16 outputs (the unfused "
          "graph's MatMuls)",
          lambda c: _cublas(c) and c.layout == "kn" and _f16(c),
          "docs/ffn.md (H100 sessions, M = 24..256: 1.00-1.04x the unfused graph; fp32 G 0.96-1.00x), commit d38336e"),
    Route("gemm_tf32", "cuBLAS, scratch and K > 0; fp32 W (fp32 X, or fp16 X widened), ONNX_LOWBIT_TF32 on (the "
          "default): TF32 GEMMs",
          lambda c: _cublas(c) and c.wdtype == "float32" and c.opt("tf32"),
          "BENCHMARKS.md 'Float FusedFFN' (fp32 paragraph: TF32 against strict fp32); commit a3e4d4e"),
    Route("gemm", "cuBLAS, scratch and K > 0: GEMMs with fp32 accumulation and fp32 outputs (fp16 X and W on [N, K]; "
          "fp32 X with fp16 W split into fp16 hi + lo; strict fp32 with ONNX_LOWBIT_TF32=0)",
          _cublas,
          "BENCHMARKS.md 'Float FusedFFN' ([N, K] from M = 33, mixed); 'FusedFFN (fp16 weights), decode and prefill "
          "kernels'"),
    Route("tiled", "always (no cuBLAS, no scratch memory, K = 0, shapes the kernels above do not take)",
          always, "not measured: the fallback (correct, not tuned)"),
)

REFUSED = {     # forced path -> why the call cannot take it
    "decode": "the decode kernel does not take M={m}, K={k}, N={n} (M <= 2; [N, K]: K a multiple of the 16-byte "
              "chunk; [K, N]: N a multiple of it; unaligned weights never)",
    "tc": "the tensor-core kernel does not take this product (fp16 X and W, K % 8 == 0, [K, N]: N % 8 == 0, 16-byte "
          "aligned X and weights, compute capability >= 8.0; got K={k}, N={n})",
    "gemm": "the cuBLAS path needs cuBLAS, scratch memory and K > 0",
}


def path_of(kernel):
    """The path name (PATHS) a kernel name of ROUTES belongs to: 'kn_decode' -> 'decode', 'gemm_tf32' -> 'gemm'."""
    return kernel.removeprefix("kn_").split("_")[0]


def case(x16, w16, m, k, n, *, kn=False, aligned=True, x_aligned=True, tc=True, cublas_ok=True, scratch=True,
         tf32=None, path=None):
    """The Case of one call: ``aligned``: W1 and W3 16-byte aligned; ``x_aligned``: X too; ``tc``: the GPU has
    mma.sync; ``cublas_ok``: the cuBLAS library was found; ``scratch``: the call has a scratch provider; ``tf32``:
    fp32-input GEMMs may run in TF32 (None: TF32 now); ``path``: a forced path (PATHS) or None (routed)."""
    opts = [("cublas", bool(cublas_ok)), ("scratch", bool(scratch)), ("tf32", TF32 if tf32 is None else bool(tf32)),
            ("x_aligned", bool(x_aligned))]
    if path is not None:
        opts.append(("path", path))
    return Case("float16" if x16 else "float32", m, k, n, wdtype="float16" if w16 else "float32",
                layout="kn" if kn else "nk", aligned=bool(aligned), tc=bool(tc), opts=tuple(sorted(opts)))


# ------------------------------------------------------------------------------------------ the kernel
class FusedFFNCudaKernel(Kernel):
    # every path's steps (launches, cuBLAS GEMMs on per-stream handles) and scratch size depend only on shapes and
    # pointer alignment; scratch is per call, handles live for the process (see plans.py)
    native_plans = True
    force_path = None   # tests, benchmarks: a path of PATHS every compute call must take (Case.opts 'path')

    def __init__(self, **kw):
        super().__init__(**kw)
        self.x16 = self.in_types[0] == 10
        self.w16 = self.in_types[1] == 10
        try:
            self.kn = ffn.parse_kn(self.attrs or {})    # W1, W3 [K, N] (attribute weights_kn = 1), else [N, K]
        except ValueError as e:
            raise KernelError(str(e)) from None
        # the simulator has no device queries: a fixed SM count, mma.sync emulated
        self.sms = SIM_SMS if SIM else cuda_launch.sm_count(cuda_launch.current_device())
        self.tc = SIM or tc_device()
        self.blas = cublas.load() is not None       # else the tiled kernel serves every prefill shape
        self.tf32 = TF32
        # compile what ROUTES can route this type variant and layout to now (once per process), never per call
        f16 = self.x16 and self.w16
        self.tiled = pre.launcher("tiled", self.x16, self.w16, kn=self.kn)
        pre.launcher("act", self.x16, f16 and self.kn)
        pre.launcher("widen")
        pre.launcher("split")
        if self.kn:     # the K-major decode kernel (split-K; tile counters per stream), the K-major tc kernel
            self.decode = {mt: knm.launcher(mt, self.x16, self.w16) for mt in (1, knm.MAX_M)}
            self.pool = ScratchPool(0, knm.TILES_MAX)
            if f16 and self.tc:
                for _, c in kntc.CONFIGS:
                    kntc.launcher(*c)
        else:
            self.decode = {mt: dec.launcher(mt, self.x16, self.w16) for mt in dec.MT_BUCKETS}
            if f16 and self.tc:
                for _, c in tcm.CONFIGS:
                    tcm.launcher(*c)
        self._occ = {}
        self._direct = None                         # scratch of direct calls (run without a provider)
        self.launch = {"decode": self._decode, "kn_decode": self._kn_decode, "tc": self._tc, "kn_tc": self._kn_tc,
                       "gemm": self._gemm, "gemm_tf32": self._gemm, "gemm_f16out": self._gemm,
                       "tiled": self._tiled}

    def compute(self, ctx, inputs):
        x, w1, w3 = (inputs[i] if i < len(inputs) else None for i in range(3))
        b1 = inputs[3] if len(inputs) > 3 else None
        b3 = inputs[4] if len(inputs) > 4 else None
        for i, name, t in ((0, "X", x), (1, "W1", w1), (2, "W3", w3)):
            if t is None:
                raise KernelError(f"input {i} '{name}' is missing")
        m, k, n = check_shapes(x.shape, w1.shape, w3.shape, b1.shape if b1 is not None else None,
                               b3.shape if b3 is not None else None, self.kn)
        y = ctx.output(0, tuple(x.shape[:-1]) + (n,))
        if m == 0 or n == 0:
            return
        self.run(ctx.stream, m, k, n, x.ptr, w1.ptr, w3.ptr, b1.ptr if b1 is not None else 0,
                 b3.ptr if b3 is not None else 0, y, scratch=ctx.scratch if ctx.has_scratch else False,
                 path=self.force_path)

    def case(self, m, k, n, xp, w1p, w3p, scratch, path=None):
        """The Case of a call on these pointers (``scratch``: False when the call has no scratch provider)."""
        return case(self.x16, self.w16, m, k, n, kn=self.kn, aligned=((w1p | w3p) & 15) == 0,
                    x_aligned=(xp & 15) == 0, tc=self.tc, cublas_ok=self.blas, scratch=scratch is not False,
                    tf32=self.tf32, path=path)

    def serving_row(self, m, k, n, xp, w1p, w3p, scratch, path=None):
        """The ROUTES row serving this call (KernelError when a forced ``path`` cannot take it)."""
        if path is not None and path not in PATHS:
            raise KernelError(f"path {path!r} is not one of {', '.join(PATHS)}")
        row = route(ROUTES, self.case(m, k, n, xp, w1p, w3p, scratch, path))
        if path is not None and path_of(row.kernel) != path:
            raise KernelError(REFUSED[path].format(m=m, k=k, n=n))
        return row

    def run(self, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, scratch=None, path=None):
        """Launches on device pointers (b1p / b3p 0 when absent) what ROUTES names for the call. ``scratch``:
        nbytes -> device pointer of this call's scratch (onnxruntime's: ``Context.scratch``), False when there is
        none, None for the kernel object's own buffer (direct calls outside onnxruntime, one thread); ``path``: a
        forced path (PATHS; tests, benchmarks)."""
        row = self.serving_row(m, k, n, xp, w1p, w3p, scratch, path)
        self.launch[row.kernel](row.kernel, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, scratch)

    # one launcher per kernel name of ROUTES: (name, stream, m, k, n, pointers, scratch)
    def _decode(self, _name, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, scratch):
        mt = dec.bucket(m)
        lau = self.decode[mt]
        occ = self._occupancy(("nk", mt, mt * k * 4), lau, dec.BLOCK, mt * k * 4)
        dec.launch(lau, stream, m, k, n, self.w16, xp, w1p, w3p, b1p, b3p, yp, self.sms, occ)

    def _kn_decode(self, _name, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, scratch):
        mt = knm.bucket(m)
        lau = self.decode[mt]
        occ = self._occupancy(("kn", mt), lau, knm.BLOCK, 0)
        # without onnxruntime's scratch (onnxruntime < 1.18) one split: no partials
        geo = knm.geometry(k, n, self.w16, self.sms, min(occ, knm.BLOCKS_PER_SM), u=knm.TUNED[mt]["u"],
                           ks=None if scratch is not False else min(k, knm.KS_MAX))
        floats = knm.partial_floats(geo[1], m, n)
        part = ((scratch or self._own_scratch)(4 * floats) if floats else 0, floats)
        knm.launch(lau, stream, m, k, n, self.w16, xp, w1p, w3p, b1p, b3p, yp, part, self.pool.counters(stream), geo)

    def _tc(self, _name, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, scratch):
        tcm.launch(stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, *tcm.config(m))

    def _kn_tc(self, _name, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, scratch):
        kntc.launch(stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, *kntc.config(m))

    def _gemm(self, name, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, scratch):
        pre.launch_gemm(stream, m, k, n, self.x16, self.w16, self.kn, name == "gemm_f16out", name == "gemm_tf32",
                        xp, w1p, w3p, b1p, b3p, yp, scratch or self._own_scratch)

    def _tiled(self, _name, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, scratch):
        pre.launch_tiled(self.tiled, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp)

    def _occupancy(self, key, lau, block, shmem):
        occ = self._occ.get(key)
        if occ is None:
            occ = self._occ[key] = 1 if SIM else max(1, lau.blocks_per_sm(block, shmem))
        return occ

    def _own_scratch(self, nbytes):
        """The kernel object's scratch for direct calls outside onnxruntime (grown, never shrunk)."""
        if self._direct is None or self._direct.size < nbytes:
            self._direct = cuda.device_array(max(nbytes, 1), np.uint8)
        return self._direct.device_ctypes_pointer.value


KERNEL = FusedFFNCudaKernel
