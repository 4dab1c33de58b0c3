"""DequantNF4, CUDA face.

transposed=1 (W^T [N, K], the storage order), the kernel measured in BENCHMARKS.md (``LEGACY``, 90.7 us for a
4096 x 11008 weight -> fp32, 77% of copy): one byte (two outputs) per thread step, so a warp reads 32
consecutive bytes and writes 64 consecutive outputs with scalar stores, grid-stride over 16 blocks per SM (on
132 SMs).
transposed=0 (W [K, N]): one thread per output element, reading its nibble (correct; the transposition makes
the reads strided, so prefer transposed=1 with Gemm transB=1 where speed matters).

Variants of the transposed=1 kernel (``Variant``; benchmarks/dequant_gpu.py times them all against a device copy
in one run, each checked bit-exact against the CPU face): ``epv`` outputs per thread step (4, 8, 16 or 32: a
2-, 4-, 8- or 16-byte packed load, the last one a 128-bit ``ld.global[.nc].v4.u32``), ``unroll`` steps whose
loads are all issued before the first decode, the stores (scalar 32-bit, or 128-bit ``st.global.v4`` /
``st.global.v2`` for 8-byte steps, optionally with the ``.cs`` streaming hint), fp16 halves rounded in pairs by
one ``cvt.rn.f16x2.f32`` (``h2``), the block size and the grid (``bps`` blocks per SM, grid-stride; 0: one
block per tile of block x unroll steps, no grid-stride). Step s of a tile is thread t's step t + s x block, so
every load and store instruction of a warp covers one contiguous range. One absmax per step (block sizes >= 32
>= epv, steps aligned to epv). The last total % epv elements (and the odd last nibble) are written one each by
the first threads of the grid. Every variant computes the same fp32 product code[q] * absmax and rounds it
once (RNE) for fp16 output: all are bit-exact with the CPU face. Sessions use ``DEFAULT`` (one line below, per
output type); a variant needs the packed input aligned to its load and the output to its store (16 bytes), else
the call runs ``LEGACY``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import config, cuda, float32, uint16, uint32, uint64

from ..device import host, launch as cuda_launch
from ..device.fp16 import f2h, pack_h2
from ..device.launch import Array
from ..device.memory import make_ld4, make_st
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route
from . import common as nf4_common
from ..device.host import alignment

BLOCK = 256
U0, U1, U3, U4, U15 = (np.uint64(v) for v in (0, 1, 3, 4, 15))


@cuda.jit
def dequant_rows(q64, q8, absmax, code, out, total, bs_shift, bs):
    """out[i] = code[nib(i)] * absmax[i // bs] for i < total (flat W^T); bs: BlockSize.size (q64 and bs_shift,
    BlockSize.log2_words, are not read: the signature of the word kernels it was measured against). One byte (two
    outputs) per thread step,
    so a warp reads 32 consecutive bytes and writes 64 consecutive outputs (coalesced); grid-stride."""
    sm_code = cuda.shared.array(16, dtype=float32)
    if cuda.threadIdx.x < 16:
        sm_code[cuda.threadIdx.x] = code[cuda.threadIdx.x]
    cuda.syncthreads()
    t = uint64(cuda.grid(1))
    stride = uint64(cuda.gridsize(1))
    npairs = uint64(total) >> U1
    b = t
    while b < npairs:
        byte = uint64(q8[b])
        i = b << U1
        s = float32(absmax[i // uint64(bs)])   # both elements of a byte share a block (block sizes are even)
        out[i] = sm_code[byte >> U4] * s
        out[i + U1] = sm_code[byte & U15] * s
        b += stride
    if t == U0 and (uint64(total) & U1) == U1:
        i = uint64(total) - U1
        out[i] = sm_code[uint64(q8[i >> U1]) >> U4] * float32(absmax[i // uint64(bs)])


@cuda.jit
def dequant_kn(q8, absmax, code, out, k_dim, n_dim, bs):
    """out[k * N + n] = W[k, n]."""
    t = uint64(cuda.grid(1))
    total = uint64(k_dim) * uint64(n_dim)
    if t >= total:
        return
    k = t // uint64(n_dim)
    n = t - k * uint64(n_dim)
    i = n * uint64(k_dim) + k
    byte = uint64(q8[i >> U1])
    nib = (byte >> U4) if (i & U1) == U0 else (byte & U15)
    out[t] = code[nib] * float32(absmax[i // uint64(bs)])


def _grid_rows(total):
    return max(1, min(132 * 16, (total // 2 + BLOCK - 1) // BLOCK))


@dataclass(frozen=True)
class Variant:
    """A transposed=1 kernel configuration (module docstring). epv 2 is the LEGACY byte kernel (its grid is
    ``_grid_rows``; unroll, store, load, h2 do not apply). ``store``: 'scalar' | 'v4' | 'v4cs'; ``load`` (epv 32
    only): 'ld' | 'nc' | 'nc_na' (ld.global.nc.L1::no_allocate)."""
    epv: int = 2
    unroll: int = 1
    block: int = BLOCK
    bps: int = 16
    store: str = "scalar"
    load: str = "ld"
    h2: bool = False

    def kernel_key(self, f16):
        """What the compiled kernel depends on (block and bps are launch settings)."""
        return (self.epv, self.unroll, self.store, self.load, self.h2 and f16, f16)

    def q_align(self):
        """Bytes the packed input must be aligned to."""
        return max(1, self.epv // 2)

    def out_align(self):
        """Bytes the output must be aligned to."""
        return 1 if self.epv == 2 else 4 if self.store == "scalar" else 16


LEGACY = Variant()
DEFAULT = {"float32": Variant(epv=4, unroll=8, block=512, bps=0, store='v4', load='ld', h2=False),
           "float16": Variant(epv=8, unroll=4, block=1024, bps=0, store='v4cs', load='ld', h2=False)}
# ^ chosen on the H100 (benchmarks/dequant_gpu.py, 2026-11-24, 4096 x 11008): fp32 out 74.1 us = 92.6% of the
#   copy bandwidth measured in the same run (LEGACY 87.7 us, 78.2%); fp16 out 41.9 us, 90.9% (LEGACY 56.1%)

_QTYPE = {4: np.uint16, 8: np.uint32, 16: np.uint64, 32: np.uint32}   # packed step as loaded (epv 32: ld4 words)
_LD = {"ld": "ld.global.v4.u32", "nc": "ld.global.nc.v4.u32", "nc_na": "ld.global.nc.L1::no_allocate.v4.u32"}


def _make_vec(epv, unroll, store, load, h2, f16):
    """The vector kernel: dequant(qv, q8, absmax, code, out_w, out_e, total, bs_log2). ``qv``: the packed input as
    steps (_QTYPE[epv]; epv 32: uint32 words, 4 per step), ``q8`` the same bytes; ``out_w`` the output as 32-bit
    words (float32, or uint32 pairs of fp16 bits), ``out_e`` as elements (float32, or uint16 fp16 bits)."""
    if epv not in _QTYPE or store not in ("scalar", "v4", "v4cs") or load not in _LD:
        raise ValueError(f"bad variant: epv={epv} store={store!r} load={load!r}")
    nw = max(1, epv // 8)                 # 32-bit words of packed input per step (epv 4: one 16-bit word)
    nwo = epv // 2 if f16 else epv        # 32-bit output words per step
    nwu = nw * unroll                     # (local array sizes must be plain constants)
    cs = store == "v4cs"
    vec = store != "scalar"
    st4 = make_st(4, cs)
    st2 = make_st(2, cs)
    ld4 = make_ld4(_LD[load])
    owt = uint32 if f16 else float32
    M32 = np.uint64(0xFFFFFFFF)  # noqa: N806
    U32 = np.uint64(32)  # noqa: N806
    U16 = np.uint64(16)  # noqa: N806
    EPV = np.uint64(epv)  # noqa: N806

    @cuda.jit
    def dequant(qv, q8, absmax, code, out_w, out_e, total, bs_log2):
        sm_code = cuda.shared.array(16, dtype=float32)
        if cuda.threadIdx.x < 16:
            sm_code[cuda.threadIdx.x] = code[cuda.threadIdx.x]
        cuda.syncthreads()
        tid = uint64(cuda.threadIdx.x)
        blk = uint64(cuda.blockDim.x)
        tile = blk * uint64(unroll)
        tot = uint64(total)
        shift = uint64(bs_log2)
        nvec = tot // EPV
        base = uint64(cuda.blockIdx.x) * tile + tid
        stride = uint64(cuda.gridDim.x) * tile
        wv = cuda.local.array(nwu, uint32)
        sv = cuda.local.array(unroll, float32)
        vals = cuda.local.array(epv, float32)
        ow = cuda.local.array(nwo, owt)
        while base < nvec:
            for u in range(unroll):           # all loads of the tile first
                v = base + uint64(u) * blk
                if v < nvec:
                    if epv == 32:
                        t4 = ld4(qv, v)
                        wv[4 * u] = t4[0]
                        wv[4 * u + 1] = t4[1]
                        wv[4 * u + 2] = t4[2]
                        wv[4 * u + 3] = t4[3]
                    elif epv == 16:
                        x = uint64(qv[v])
                        wv[2 * u] = uint32(x & M32)
                        wv[2 * u + 1] = uint32(x >> U32)
                    else:
                        wv[u] = uint32(qv[v])
                    sv[u] = float32(absmax[(v * EPV) >> shift])
            for u in range(unroll):
                v = base + uint64(u) * blk
                if v < nvec:
                    s = sv[u]
                    for e in range(epv):      # element e: byte e // 2 (little-endian in its word), high nibble first
                        sh = 8 * ((e >> 1) & 3) + 4 * (1 - (e & 1))
                        vals[e] = sm_code[(wv[u * nw + (e >> 3)] >> uint32(sh)) & uint32(15)] * s
                    wi = v * uint64(nwo)      # first output word of the step
                    for m in range(nwo):
                        if f16:
                            if h2:
                                ow[m] = pack_h2(vals[2 * m], vals[2 * m + 1])
                            else:
                                ow[m] = uint32(f2h(vals[2 * m]) | (f2h(vals[2 * m + 1]) << U16))
                        else:
                            ow[m] = vals[m]
                    if vec:
                        if nwo == 2:
                            st2(out_w, wi, ow[0], ow[1])
                        else:
                            for m in range(nwo // 4):
                                st4(out_w, wi + uint64(4 * m), ow[4 * m], ow[4 * m + 1], ow[4 * m + 2], ow[4 * m + 3])
                    else:
                        for m in range(nwo):
                            out_w[wi + uint64(m)] = ow[m]
            base += stride
        t = uint64(cuda.blockIdx.x) * blk + tid  # the last total % epv elements, one per thread
        if t < tot - nvec * EPV:
            i = nvec * EPV + t
            byte = uint64(q8[i >> U1])
            nib = (byte >> U4) if (i & U1) == U0 else (byte & U15)
            r = sm_code[nib] * float32(absmax[i >> shift])
            if f16:
                out_e[i] = uint16(f2h(r))
            else:
                out_e[i] = r

    return dequant


_launchers = {}


def _launcher(transposed, dtype, variant=None, absmax=None):
    """The compiled kernel: transposed=0 (dequant_kn), or the transposed=1 kernel of ``variant`` (default LEGACY,
    which benchmarks/nf4_gpu.py times with ``_grid_rows`` and BLOCK) for output ``dtype``; ``absmax``: the absmax
    type when it is not the output's (FusedFFNNF4's prefill route: fp32 absmax, fp16 W^T). Under the simulator a
    SimLauncher (device/host)."""
    v = variant or LEGACY
    f16 = np.dtype(dtype) == np.float16
    adt = np.dtype(absmax if absmax is not None else dtype)
    key = (transposed, np.dtype(dtype).str) + ((v.kernel_key(f16),) if transposed and v.epv > 2 else ())
    key += (adt.str,) if adt != np.dtype(dtype) else ()
    if key not in _launchers:
        if transposed and v.epv > 2:
            ow, oe = (np.uint32, np.uint16) if f16 else (np.float32, np.float32)
            sig = [Array(_QTYPE[v.epv]), Array(np.uint8), Array(adt), Array(np.float32), Array(ow), Array(oe),
                   "int64", "int64"]
            _launchers[key] = host.launcher(_make_vec(*v.kernel_key(f16)), sig)
        elif transposed:
            sig = [Array(np.uint64), Array(np.uint8), Array(adt), Array(np.float32), Array(dtype), "int64", "int64",
                   "int64"]
            _launchers[key] = host.launcher(dequant_rows, sig)
        else:
            sig = [Array(np.uint8), Array(adt), Array(np.float32), Array(dtype), "int64", "int64", "int64"]
            _launchers[key] = host.launcher(dequant_kn, sig)
    return _launchers[key]


def geometry(variant, total, sms):
    """(grid, block) of the transposed=1 kernel of ``variant`` for ``total`` elements on ``sms`` SMs."""
    if variant.epv == 2:
        return _grid_rows(total), BLOCK
    tiles = -(-(total // variant.epv) // (variant.block * variant.unroll))
    grid = tiles if variant.bps == 0 else min(tiles, variant.bps * sms)
    return max(1, grid), variant.block


def rows_args(variant, f16, q_ptr, q_size, am_ptr, am_size, code_ptr, out_ptr, total, bs):
    """Launch arguments of the transposed=1 kernel of ``variant`` for fp16 (``f16``) or fp32 output (device
    pointers, sizes in elements; ``bs`` a BlockSize, or its size: benchmarks/dequant_gpu.py)."""
    if not isinstance(bs, nf4_common.BlockSize):
        bs = nf4_common.BlockSize(bs)
    if variant.epv == 2:
        return [(q_ptr, (max(total // 16, 1),)), (q_ptr, (q_size,)), (am_ptr, (am_size,)), (code_ptr, (16,)),
                (out_ptr, (total,)), total, bs.log2_words, bs.size]
    nvec = total // variant.epv
    qn = nvec * 4 if variant.epv == 32 else nvec
    nwords = total // 2 if f16 else total
    return [(q_ptr, (qn,)), (q_ptr, (q_size,)), (am_ptr, (am_size,)), (code_ptr, (16,)), (out_ptr, (nwords,)),
            (out_ptr, (total,)), total, bs.log2]


def launch_transposed(lau, variant, stream, f16, q, absmax, code_ptr, out, total, bs, sms):
    """One launch of the transposed=1 kernel ``lau`` of ``variant`` (``_launcher(True, ...)``): W^T [N, K] of
    ``total`` elements from Q and absmax (bridge Tensors) into ``out`` (a device pointer aligned to the variant's
    ``out_align``), fp16 (``f16``) or fp32. DequantNF4's compute and FusedFFNNF4's prefill route
    (ffn/fusedffn4_prefill_cuda) launch through it."""
    grid, block = geometry(variant, total, sms)
    lau.launch(grid, block, stream, *rows_args(variant, f16, q.ptr, q.size, absmax.ptr, absmax.size, code_ptr, out,
                                               total, bs))


def run_arrays(q, absmax, code, k, n, bs, transposed=False, variant=None, sms=None):
    """Runs a kernel on host arrays: through the Numba dispatcher under the CUDA simulator (a variant's block may be
    shrunk there, ``sms`` sets its grid), through the direct launch path on a real GPU. Output in absmax's dtype,
    W [K, N] or W^T [N, K]. Kept beside runtime/direct.py (which runs the routed DEFAULT / LEGACY kernels) for the
    tests and benchmarks/dequant_gpu.py that run any ``Variant`` of the transposed=1 kernel and choose ``sms``."""
    v = variant or LEGACY
    bs = nf4_common.BlockSize(bs)
    total = k * n
    f16 = absmax.dtype == np.float16
    dq = cuda.to_device(q.reshape(-1))
    dam, dcode = cuda.to_device(absmax.reshape(-1)), cuda.to_device(code)
    if transposed and v.epv > 2:   # fp16 as bits, padded to whole 32-bit words
        out = cuda.device_array(total + (total & 1), np.uint16) if f16 else cuda.device_array(total, np.float32)
    else:
        out = cuda.device_array(total, absmax.dtype)
    if config.ENABLE_CUDASIM:
        if transposed and v.epv > 2:
            nvec = total // v.epv
            qv = cuda.to_device(np.ascontiguousarray(q.reshape(-1)[: nvec * v.epv // 2]).view(_QTYPE[v.epv]))
            ow = out.view(np.uint32) if f16 else out
            grid, block = geometry(v, total, sms or 2)
            _make_vec(*v.kernel_key(f16))[grid, block](qv, dq, dam, dcode, ow, out, total, bs.log2)
        elif transposed:
            nw = total // 16
            dq64 = cuda.to_device(np.ascontiguousarray(q.reshape(-1)[: nw * 8]).view(np.uint64)) if nw else \
                cuda.to_device(np.zeros(1, np.uint64))
            dequant_rows[_grid_rows(total), BLOCK](dq64, dq, dam, dcode, out, total, bs.log2_words, bs.size)
        else:
            dequant_kn[(total + BLOCK - 1) // BLOCK, BLOCK](dq, dam, dcode, out, k, n, bs.size)
    else:
        ptr = lambda d: d.device_ctypes_pointer.value  # noqa: E731
        lau = _launcher(transposed, absmax.dtype, v)
        if transposed:
            grid, block = geometry(v, total, sms or cuda_launch.sm_count(cuda_launch.current_device()))
            args = rows_args(v, f16, ptr(dq), dq.size, ptr(dam), dam.size, ptr(dcode), ptr(out), total, bs)
        else:
            grid, block = (total + BLOCK - 1) // BLOCK, BLOCK
            args = [(ptr(dq), (dq.size,)), (ptr(dam), (dam.size,)), (ptr(dcode), (16,)), (ptr(out), (total,)), k, n,
                    bs.size]
        lau.launch(grid, block, 0, *args)
        cuda.synchronize()
    w = out.copy_to_host()[:total]
    if w.dtype == np.uint16:
        w = w.view(np.float16)
    return w.reshape((n, k) if transposed else (k, n))


ROUTES = (
    Route("kn", "transposed = 0 (W [K, N]): one thread per output element", lambda c: c.layout == "kn",
          "the only kernel for W [K, N] (strided reads; prefer transposed = 1)"),
    Route("vec", "transposed = 1 with the packed input aligned to DEFAULT[output type]'s loads (opts q_align)",
          lambda c: c.opt("q_align", 16) >= DEFAULT[c.dtype].q_align(),
          "BENCHMARKS.md Dequant (DEFAULT; benchmarks/dequant_gpu.py, 2026-11-24)"),
    Route("rows", "transposed = 1 otherwise (LEGACY: a byte per thread step)", always, "correctness fallback"),
)


def case(dtype, k, n, bs, transposed, q_align=16):
    """The Case of a call (output ``dtype``; the packed input's alignment, capped at 16). DequantNF4 has no M."""
    return Case(np.dtype(dtype).name, 1, k, n, layout="nk" if transposed else "kn", aligned=q_align == 16, bs=bs,
                opts=(("q_align", q_align),))


class DequantNF4CudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes and the input's alignment; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, code = nf4_common.parse_attrs(self.attrs)
        self.transposed = nf4_common.parse_transposed(self.attrs)
        self.dtype = np.dtype(np.float32 if self.in_types[1] == 1 else np.float16)
        self.code = cuda.to_device(code)
        self.code_ptr = self.code.device_ctypes_pointer.value
        self.sms = cuda_launch.sm_count(cuda_launch.current_device())
        self.variants = {"vec": DEFAULT[self.dtype.name], "rows": LEGACY}
        self.launcher(route(ROUTES, case(self.dtype, self.k, self.n, self.bs.size, self.transposed)).kernel)

    @property
    def variant(self):
        """The transposed=1 kernel aligned inputs run (DEFAULT[output type])."""
        return self.variants["vec"]

    def launcher(self, name):
        return _launcher(name != "kn", self.dtype, self.variants.get(name))

    def compute(self, ctx, inputs):
        q, absmax = inputs[0], inputs[1]
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs, 0, 1)
        total = self.k * self.n
        out = ctx.output(0, (self.n, self.k) if self.transposed else (self.k, self.n))
        name = route(ROUTES, case(self.dtype, self.k, self.n, self.bs.size, self.transposed,
                                  alignment(q.ptr))).kernel
        lau = self.launcher(name)
        if name == "kn":
            args = [(q.ptr, (q.size,)), (absmax.ptr, (absmax.size,)), (self.code_ptr, (16,)), (out, (total,)),
                    self.k, self.n, self.bs.size]
            lau.launch((total + BLOCK - 1) // BLOCK, BLOCK, ctx.stream, *args)
            return
        v = self.variants[name]
        if out % v.out_align():
            raise KernelError(f"the output must be a device buffer aligned to {v.out_align()} bytes")
        launch_transposed(lau, v, ctx.stream, self.dtype == np.float16, q, absmax, self.code_ptr, out, total, self.bs,
                          self.sms)


KERNEL = DequantNF4CudaKernel
