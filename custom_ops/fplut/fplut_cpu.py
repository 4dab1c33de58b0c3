"""FPLUT, CPU face: Numba kernels evaluating the expanded fp16->fp16 map (onnx_lowbit.fplut.expand_table).

Every input is reduced to the fp16 bit pattern of its value (fp16 as is; fp32 and bf16 rounded to nearest even),
which indexes a 65,536-entry table of *output* bit patterns built once per kernel (``kernel_table``): the map itself
for fp16 inputs, the map widened to fp32 (256 KB) for fp32 inputs, the map rounded to bf16 for bf16 inputs, each
with the reference's own numpy conversions, so a lookup is the reference's result (bit-exact by construction; the
map sends every NaN index to the same NaN, so how pass 1 spells a NaN does not matter).

The work goes in chunks of CHUNK elements, two passes per chunk (fp16 inputs skip the first):
  1. the fp16 index of each element into a small buffer: on CPUs with AVX-512 (``FAST``: the ``AVX512`` kernels)
     one vcvtps2ph per 16 elements (``_fp16_bits``, a Numba intrinsic: LLVM's fptrunc to half), else (the
     ``PORTABLE`` kernels) device/half_cpu's branch-free ``f16_index`` (the float-arithmetic RNE rounding of
     Maratyszcza's FP16 library, vectorised by LLVM; the fp32 kernel is 1.3x slower with it);
  2. the lookups (``_lookups``): scalar loads, the results packed two (fp32) or four (fp16, bf16) to a 64-bit store
     (0.95 against 1.15 cycles per element with one store per result). Vector gathers (vpgatherdd, an intrinsic
     like quantgru_cpu's ``_lut_gather``) were measured and not kept: on Zen 4 they fetch about one element per
     cycle, no faster than scalar loads, and a one-pass kernel gathering from the fp32 table was 10-20% slower than
     these two passes.
Calls writing STREAM_MIN_BYTES or more of fp32 (outputs larger than the caches, e.g. 1e7 elements) pass ``stream``
(``streams``): the AVX512 kernels then prefetch their input and write the results through a buffer copied out with
non-temporal 64-byte stores (``_stream``; 1.8x faster at 1e7 elements, where plain stores read every output line
from memory first and push the table out of the caches).
From PARALLEL_MIN elements the tensor is split into one contiguous part per Numba thread (``split``;
``numba.get_num_threads()``: NUMBA_NUM_THREADS / numba.set_num_threads).
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llb, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from onnx_lowbit import fplut, halfbits

from ..device import native, threads
from ..device.half_cpu import f16_index
from ..runtime.kernels import Kernel, KernelError

PARALLEL_MIN = 1 << 20       # from here the tensor is split over threads (a hand-off costs ~50 us)
CHUNK = 128                  # elements per chunk (a multiple of 32): buffers in L1; 128 and 256 run alike, 512
                             # is 1.4x slower when streaming (the non-temporal stores come in bursts)
PREFETCH = 2048              # elements: how far ahead the streaming pass 1 prefetches its input
STREAM_MIN_BYTES = 1 << 24   # fp32 outputs from this size are written with non-temporal stores (half this CPU's L3)


def _has_avx512():
    try:
        return bool(llb.get_host_cpu_features().get("avx512f", False))
    except Exception:  # noqa: BLE001 - unknown host: the portable path
        return False


FAST = _has_avx512()


def kernel_table(map16, key):
    """The lookup table of the kernels for inputs ``key`` (np.dtype float16 / float32, or "bf16") from the
    fp16->fp16 map (uint16[65536]): output bit patterns (uint16, uint32, uint16) indexed by fp16 bit patterns."""
    if key == np.dtype(np.float16):
        return np.ascontiguousarray(map16, dtype=np.uint16)
    y = np.asarray(map16, dtype=np.uint16).view(np.float16).astype(np.float32)
    if key == np.dtype(np.float32):
        return y.view(np.uint32).copy()
    if key == "bf16":
        return halfbits.f32_to_bf16_bits(y)
    raise KeyError(key)


# ---------------------------------------------------------------------------------------------- intrinsics (FAST)
def _i64(context, builder, ty, v):
    return context.cast(builder, v, ty, types.int64)


@intrinsic
def _fp16_bits(typingctx, x, x0, n, idx, ahead):
    """idx[k] = the fp16 bit pattern (round to nearest even) of x[x0 + k] for k < n: x holds fp32 (uint32) or bf16
    (uint16) bit patterns, idx (uint16) must hold n rounded up to 16 (its lanes past n get zeros). Sixteen per
    vcvtps2ph; the last, partial vector reads x through a masked load. ``ahead`` (a literal bool): prefetch x
    PREFETCH elements ahead (for inputs streaming from memory). No bounds checks."""
    if not (isinstance(x, types.Array) and isinstance(idx, types.Array) and isinstance(ahead, types.BooleanLiteral)):
        return None
    bf16 = x.dtype.bitwidth == 16
    pf = ahead.literal_value
    sig = types.void(x, x0, n, idx, ahead)

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        ia = context.make_array(signature.args[3])(context, builder, args[3])
        x0v, nv = (_i64(context, builder, t, v) for t, v in zip(signature.args[1:3], args[1:3]))
        i1, i8, i16, i32, i64 = (ir.IntType(b) for b in (1, 8, 16, 32, 64))
        lane = i16 if bf16 else i32
        vin, v16, v32, v64, vf, vh, vb = (ir.VectorType(t, 16) for t in (lane, i16, i32, i64, ir.FloatType(),
                                                                          ir.HalfType(), i1))
        mload = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vin, [vin.as_pointer(), i32, vb, vin]),
                                               f"llvm.masked.load.v16i{lane.width}.p0")
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")
        xp = builder.gep(xa.data, [x0v])

        def body(k, mask):
            if pf:  # read, high temporal locality, data cache
                at = builder.bitcast(builder.gep(xp, [builder.add(k, ir.Constant(i64, PREFETCH))]), i8.as_pointer())
                builder.call(prefetch, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            p = builder.bitcast(builder.gep(xp, [k]), vin.as_pointer())
            if mask is None:
                w = builder.load(p, align=lane.width // 8)
            else:
                w = builder.call(mload, [p, ir.Constant(i32, lane.width // 8), mask, ir.Constant(vin, None)])
            if bf16:
                w = builder.shl(builder.zext(w, v32), ir.Constant(v32, [16] * 16))
            h = builder.bitcast(builder.fptrunc(builder.bitcast(w, vf), vh), v16)
            builder.store(h, builder.bitcast(builder.gep(ia.data, [k]), v16.as_pointer()), align=2)

        full = builder.udiv(nv, ir.Constant(i64, 16))
        with cgutils.for_range(builder, full) as lp:
            body(builder.mul(lp.index, ir.Constant(i64, 16)), None)
        k = builder.mul(full, ir.Constant(i64, 16))
        rest = builder.sub(nv, k)
        with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(i64, 0))):
            rv = builder.insert_element(ir.Constant(v64, None), rest, ir.Constant(i32, 0))
            rv = builder.shuffle_vector(rv, ir.Constant(v64, None), ir.Constant(v32, [0] * 16))
            body(k, builder.icmp_signed("<", ir.Constant(v64, list(range(16))), rv))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _stream(typingctx, src, dst, d0, n):
    """dst[d0 + k] = src[k] for k < n rounded down to 64 bytes, with non-temporal 64-byte stores: dst[d0] must be
    64-byte aligned; the caller copies the rest and ends with ``_sfence``. No bounds checks."""
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array)):
        return None
    width = dst.dtype.bitwidth
    sig = types.void(src, dst, d0, n)

    def codegen(context, builder, signature, args):
        sa = context.make_array(signature.args[0])(context, builder, args[0])
        da = context.make_array(signature.args[1])(context, builder, args[1])
        d0v, nv = (_i64(context, builder, t, v) for t, v in zip(signature.args[2:4], args[2:4]))
        i32, i64 = ir.IntType(32), ir.IntType(64)
        lanes = 512 // width
        vec = ir.VectorType(ir.IntType(width), lanes)
        dp = builder.gep(da.data, [d0v])
        nt = builder.module.add_metadata([ir.Constant(i32, 1)])
        with cgutils.for_range(builder, builder.udiv(nv, ir.Constant(i64, lanes))) as lp:
            k = builder.mul(lp.index, ir.Constant(i64, lanes))
            v = builder.load(builder.bitcast(builder.gep(sa.data, [k]), vec.as_pointer()), align=width // 8)
            st = builder.store(v, builder.bitcast(builder.gep(dp, [k]), vec.as_pointer()), align=64)
            st.set_metadata("nontemporal", nt)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _sfence(typingctx):
    """Orders the non-temporal stores before everything after (x86 sfence)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse.sfence")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


# ------------------------------------------------------------------------------------------------------ passes
# The chunk loop calls inlined helpers one level deep: Numba counts the references to the arrays passed down (atomic
# increments) at every level, and two levels more made a chunk of 512 elements 1.4x slower.
@njit(inline="always")
def _portable_indices(x, x0, n, idx):
    b = np.uint64(x0)
    sh = np.uint32(16) if x.itemsize == 2 else np.uint32(0)    # bf16 bits -> fp32 bits
    for k in range(n):
        w = np.uint32(np.uint32(x[b + np.uint64(k)]) << sh)
        idx[k] = f16_index(w, w.view(np.float32))


@njit(inline="always")
def _indices(x, x0, n, idx, stream, fast):
    """Pass 1: idx[k] = fp16 index of x[x0 + k], k < n (x: fp32 or bf16 bits; idx holds n rounded up to 16)."""
    if fast and stream:
        _fp16_bits(x, x0, n, idx, True)
    elif fast:
        _fp16_bits(x, x0, n, idx, False)
    elif n == CHUNK:    # a constant trip count: LLVM vectorises it (a trip count of min(...) it did not: 2.3x)
        _portable_indices(x, x0, CHUNK, idx)
    else:
        _portable_indices(x, x0, n, idx)


@njit(inline="always")
def _lookups(src, s0, table, d64, q0, n):
    """Pass 2: the results table[src[s0 + k]], k < n, packed into the 64-bit words d64[q0 ...]: two to a word for
    a uint32 table, four for a uint16 one (n a multiple of 2 or 4). Unsigned indices: with signed ones Numba
    wraps negative indices around, four instructions per access (25% slower)."""
    s, d = np.uint64(s0), np.uint64(q0)
    if table.itemsize == 4:
        for q in range(n >> 1):
            u = np.uint64(q)
            k = s + u + u
            d64[d + u] = np.uint64(table[src[k]]) | (np.uint64(table[src[k + np.uint64(1)]]) << np.uint64(32))
    else:
        for q in range(n >> 2):
            u = np.uint64(q)
            k = s + (u << np.uint64(2))
            d64[d + u] = (np.uint64(table[src[k]]) | (np.uint64(table[src[k + np.uint64(1)]]) << np.uint64(16))
                          | (np.uint64(table[src[k + np.uint64(2)]]) << np.uint64(32))
                          | (np.uint64(table[src[k + np.uint64(3)]]) << np.uint64(48)))


@njit(inline="always")
def _head(out, i0, i1):
    """The first index from i0 (at most i1) whose element of out is 64-byte aligned."""
    skip = ((-(out.ctypes.data + i0 * out.itemsize)) % 64) // out.itemsize
    return min(i1, i0 + skip)


@njit(inline="always")
def _range(x, table, out, i0, i1, stream, index, fast):
    """x[i0:i1] -> out[i0:i1]; ``index``: x holds fp32 / bf16 bits (pass 1 into idx, pass 2 from there), else
    fp16 bits (x indexes the table); ``fast``: the AVX-512 path (a constant: the other is compiled out). The
    elements before the first 64-byte aligned one of out go one by one, then chunks: pass 2 writes out through its
    64-bit view o64, or (``fast`` and ``stream``) res, copied with non-temporal stores."""
    if table.size != 65536 or table.itemsize != out.itemsize:
        raise ValueError("FPLUT: the table must be kernel_table(map, key) of this input type")
    idx = np.empty(CHUNK, np.uint16)
    res = np.empty(CHUNK, out.dtype)
    r64 = res.view(np.uint64)
    sh = 1 if out.itemsize == 4 else 2      # log2 of the results per 64-bit word
    line = 64 // out.itemsize               # results per 64-byte line
    i = _head(out, i0, i1)
    if index:
        _indices(x, i0, i - i0, idx, False, fast)
    for k in range(i - i0):
        out[i0 + k] = table[idx[k]] if index else table[x[i0 + k]]
    o64 = out[i:i1 - ((i1 - i) & ((1 << sh) - 1))].view(np.uint64)
    q = 0                                    # o64's word of element c0
    for c0 in range(i, i1, CHUNK):
        n = min(CHUNK, i1 - c0)
        whole = (n >> sh) << sh
        if index:
            _indices(x, c0, n, idx, stream, fast)
            if fast and stream:
                _lookups(idx, 0, table, r64, 0, whole)
            else:
                _lookups(idx, 0, table, o64, q, whole)
        elif fast and stream:
            _lookups(x, c0, table, r64, 0, whole)
        else:
            _lookups(x, c0, table, o64, q, whole)
        if fast and stream:
            _stream(res, out, c0, whole)
            for k in range(whole - whole % line, whole):
                out[c0 + k] = res[k]
        for k in range(whole, n):
            out[c0 + k] = table[idx[k]] if index else table[x[c0 + k]]
        q += whole >> sh
    if fast and stream:
        _sfence()


def _lut16(x, table, out, stream=False):
    """x, out uint16 bits of float16; table = kernel_table(map, float16) (the map). The AVX-512 path."""
    _range(x, table, out, 0, x.size, stream, False, True)


def _lut32(x, table, out, stream=False):
    """x, out uint32 bits of float32; table = kernel_table(map, float32). The AVX-512 path."""
    _range(x, table, out, 0, x.size, stream, True, True)


def _lutbf16(x, table, out, stream=False):
    """x, out uint16 bits of bfloat16; table = kernel_table(map, "bf16"). The AVX-512 path."""
    _range(x, table, out, 0, x.size, stream, True, True)


def _lut16_portable(x, table, out, stream=False):
    """_lut16 for CPUs without AVX-512 (``stream`` has no effect)."""
    _range(x, table, out, 0, x.size, stream, False, False)


def _lut32_portable(x, table, out, stream=False):
    """_lut32 for CPUs without AVX-512."""
    _range(x, table, out, 0, x.size, stream, True, False)


def _lutbf16_portable(x, table, out, stream=False):
    """_lutbf16 for CPUs without AVX-512."""
    _range(x, table, out, 0, x.size, stream, True, False)


def _compile(fn):
    return njit(cache=True, nogil=True, boundscheck=False)(fn)


def split(kernel):
    """``kernel`` (x, table, out, stream) over contiguous ranges claimed by the Numba thread count's threads
    (device/threads.py: serial calls on a small pool of Python threads; Numba's prange ran this body 2.5-3x slower
    per element)."""
    def run(x, table, out, stream=False):
        threads.run_ranges(kernel, lambda lo, hi: (x[lo:hi], table, out[lo:hi], stream),
                           threads.split(x.size, CHUNK))
    return run


_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
# the serial kernels by input key: the AVX-512 ones, and the portable ones (the fallback, tested on any CPU)
AVX512 = {_F16: _compile(_lut16), _F32: _compile(_lut32), "bf16": _compile(_lutbf16)}
PORTABLE = {_F16: _compile(_lut16_portable), _F32: _compile(_lut32_portable), "bf16": _compile(_lutbf16_portable)}
_SERIAL = AVX512 if FAST else PORTABLE
# key (np.dtype of the input, or "bf16") -> (serial kernel, parallel kernel, storage); both take (x bits,
# kernel_table(map, key), out bits, stream=False)
KERNELS = {k: (s, split(s), np.uint32 if k == _F32 else np.uint16) for k, s in _SERIAL.items()}


def streams(key, nbytes: int) -> bool:
    """Whether a call for inputs ``key`` writing ``nbytes`` passes ``stream``: fp32 outputs from STREAM_MIN_BYTES
    (1.8x faster at 1e7 elements). The 16-bit kernels gained nothing from it at 2e7 elements (their lookups, not
    memory, set their pace), so they keep plain stores."""
    return key == _F32 and nbytes >= STREAM_MIN_BYTES


class FPLUTKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        cuts, values = self.attrs["cut_points"], self.attrs["table"]
        try:
            map16 = fplut.expand_table(cuts, values)
        except fplut.TableError as e:
            raise KernelError(f"bad attribute: {e}") from None
        self.bf16 = self.in_types[0] == 16
        self.key = "bf16" if self.bf16 else np.dtype(np.float16 if self.in_types[0] == 10 else np.float32)
        self.table = kernel_table(map16, self.key)

    native_plans = True  # the native entries (below): recorded once per shape, replayed by the shim

    def compute(self, ctx, inputs):
        x = self.check_input(inputs, 0)
        serial, parallel, bits = KERNELS[self.key]
        stream = streams(self.key, x.size * np.dtype(bits).itemsize)
        if ctx.native:
            entry = native.compile_entry(NATIVE[self.in_types[0]])
            if ctx.run_native(entry, x.size, GRAIN, [x.ptr, ctx.output(0, x.shape), self.table.ctypes.data,
                                                     int(stream)], (0, 1)):
                return
        xa = x.numpy().reshape(-1)
        out = ctx.output_numpy(0, x.shape, xa.dtype).reshape(-1)
        if xa.size:
            (parallel if xa.size >= PARALLEL_MIN else serial)(xa.view(bits), self.table, out.view(bits), stream)


KERNEL = FPLUTKernel


# ---- native entry points (runtime/plans.py, "CPU kernels"): params = [X, Y, table, stream], items = elements
GRAIN = 1 << 15  # elements per task of onnxruntime's thread pool


def _native16(p, begin, end):
    x, y = native.vector(p[0], end, np.uint16), native.vector(p[1], end, np.uint16)
    _SERIAL16(x[begin:end], native.vector(p[2], 65536, np.uint16), y[begin:end], p[3] != 0)
    return 0


def _native32(p, begin, end):
    x, y = native.vector(p[0], end, np.uint32), native.vector(p[1], end, np.uint32)
    _SERIAL32(x[begin:end], native.vector(p[2], 65536, np.uint32), y[begin:end], p[3] != 0)
    return 0


def _nativebf16(p, begin, end):
    x, y = native.vector(p[0], end, np.uint16), native.vector(p[1], end, np.uint16)
    _SERIALBF16(x[begin:end], native.vector(p[2], 65536, np.uint16), y[begin:end], p[3] != 0)
    return 0


_SERIAL16, _SERIAL32, _SERIALBF16 = (_SERIAL[k] for k in (_F16, _F32, "bf16"))
NATIVE = {10: _native16, 1: _native32, 16: _nativebf16}  # by ONNX element type
