"""FusedFFN with fp16 X and W on the tensor cores, block-tiled: the block's warps share X through shared memory.

S[m, n] = SiLU(X W1^T + b1) * (X W3^T + b3), W1/W3 [N, K]. Same mma arithmetic and k permutation as
fusedffn_tc_cuda (16 weight rows as A, 8 X rows as B, each lane's 16-byte chunk feeds two mmas), with the block
layout of a GEMM: a block owns ``fw`` 16-feature tiles (warp w: tile w, W1 and W3) and 8 ``mt`` rows of X, and all
its warps walk K together in 32-column chunks. Each chunk (2 x 16 fw weight rows and 8 mt X rows, 64 bytes each)
is copied to shared memory with cp.async by the whole block, in a ring of ``stages`` slots (no registers held for
loads in flight); one barrier per chunk. The X rows are loaded once per block instead of once per warp, so more
rows per block cost no more registers than their accumulators.

Needs fp16 X and W, K % 8 == 0 and 16-byte aligned X, W1, W3. Measured: docs/ffn.md.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32

from .dequantawq_cuda import SIM, device, h2f, st16
from .fusedffn_cuda import silu
from .matmulawq_cuda import _mma

FW = 4
STAGES = 4
F0 = np.float32(0.0)

if SIM:
    def _cp16(sm, si, g, gi, ok):
        """Simulator: 16 bytes (4 words) of uint32 array g from chunk gi to sm[si:si + 4], zeros unless ``ok``."""
        si = int(si)
        if ok:
            j = 4 * int(gi)
            for i in range(4):
                sm[si + i] = g[j + i]
        else:
            for i in range(4):
                sm[si + i] = 0

    def _cp_commit():
        pass

    def _make_wait(n):
        def wait():
            pass
        return wait

    def _lds4(sm, si):
        si = int(si)
        return sm[si], sm[si + 1], sm[si + 2], sm[si + 3]
else:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.cuda.extending import intrinsic as _intrinsic

    _SHARED = "{ .reg .u64 a; .reg .u32 b; cvta.to.shared.u64 a, %s; cvt.u32.u64 b, a; %s }"

    @_intrinsic
    def _cp16(typingctx, sm, si, g, gi, ok):
        """cp.async.cg 16 bytes: chunk ``gi`` of uint32 array ``g`` -> sm[si:si + 4] (zero-filled unless ``ok``)."""
        def codegen(context, builder, sig, args):
            sary = context.make_array(sig.args[0])(context, builder, value=args[0])
            gary = context.make_array(sig.args[2])(context, builder, value=args[2])
            i64 = _ir.IntType(64)
            sidx = context.cast(builder, args[1], sig.args[1], _types.uint64)
            gidx = context.cast(builder, args[3], sig.args[3], _types.uint64)
            sptr = builder.gep(sary.data, [sidx])
            gptr = builder.gep(gary.data, [builder.shl(gidx, _ir.Constant(i64, 2))])
            okv = context.cast(builder, args[4], sig.args[4], _types.boolean)
            n = builder.select(okv, _ir.Constant(_ir.IntType(32), 16), _ir.Constant(_ir.IntType(32), 0))
            fnty = _ir.FunctionType(_ir.VoidType(), [sptr.type, gptr.type, _ir.IntType(32)])
            builder.call(_ir.InlineAsm(fnty, _SHARED % ("$0", "cp.async.cg.shared.global [b], [$1], 16, $2;"),
                                       "l,l,r,~{memory}", side_effect=True), [sptr, gptr, n])
            return context.get_dummy_value()
        return _types.void(sm, si, g, gi, ok), codegen

    @_intrinsic
    def _lds4(typingctx, sm, si):
        """sm[si:si + 4] (16-byte aligned) in one ld.shared.v4."""
        rt = _types.UniTuple(_types.uint32, 4)

        def codegen(context, builder, sig, args):
            sary = context.make_array(sig.args[0])(context, builder, value=args[0])
            sidx = context.cast(builder, args[1], sig.args[1], _types.uint64)
            sptr = builder.gep(sary.data, [sidx])
            i32 = _ir.IntType(32)
            fnty = _ir.FunctionType(_ir.LiteralStructType([i32] * 4), [sptr.type])
            res = builder.call(_ir.InlineAsm(fnty, _SHARED % ("$4", "ld.shared.v4.u32 {$0, $1, $2, $3}, [b];"),
                                             "=r,=r,=r,=r,l,~{memory}", side_effect=True), [sptr])
            return context.make_tuple(builder, rt, [builder.extract_value(res, k) for k in range(4)])
        return rt(sm, si), codegen

    @_intrinsic
    def _cp_commit(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(_ir.InlineAsm(_ir.FunctionType(_ir.VoidType(), []), "cp.async.commit_group;", "~{memory}",
                                       side_effect=True), [])
            return context.get_dummy_value()
        return _types.void(), codegen

    def _make_wait(n):
        @_intrinsic
        def wait(typingctx):
            def codegen(context, builder, sig, args):
                builder.call(_ir.InlineAsm(_ir.FunctionType(_ir.VoidType(), []), f"cp.async.wait_group {n};",
                                           "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return _types.void(), codegen
        return wait


def slot_words(mt, fw=FW):
    """Words of one ring slot: 2 x 16 fw weight rows and 8 mt X rows of 16 words (64 bytes)."""
    return (32 * fw + 8 * mt) * 16


def smem_bytes(mt, fw=FW, stages=STAGES):
    return stages * slot_words(mt, fw) * 4


def grid(m, n, mt, fw=FW):
    return -(-n // (16 * fw)) * -(-m // (8 * mt))


def _make(mt, fw=FW, stages=STAGES, max_registers=None, mfast=True):
    """Signature as fusedffn_tc_cuda._make: (x, w1, w3 uint32, b1, b3, out uint16, m_dim, k_dim, n_dim, cpw (unused),
    has_b1, has_b3); block 32 fw threads, smem_bytes(mt, fw, stages) of dynamic shared memory."""
    scr_size = fw * 32 * 6 if SIM else 1
    nacc = 8 * mt
    sw = slot_words(mt, fw)
    nthr = 32 * fw
    xcopies = 32 * mt                              # 16-byte copies of X per slot
    xrounds = -(-xcopies // nthr)
    wait = _make_wait(stages - 2)
    wait0 = _make_wait(0)
    opts = {} if SIM or max_registers is None else {"max_registers": max_registers}

    @device
    def issue(sm, base, c, tid, kc, k8, n0, m0, n32, m32, x, w1, w3):
        """The block copies chunk c (zeros past K, N, M) into the slot at word ``base``."""
        q = tid & uint32(3)
        kq = c * uint32(4) + q
        kin = c < kc and kq < k8
        for i in range(4):                         # weight rows: i = 0, 1 W1, 2, 3 W3 (8 fw rows each)
            r = uint32((i & 1) * 8 * fw) + (tid >> uint32(2))
            n = n0 + r
            w = w1 if i < 2 else w3
            _cp16(sm, base + (uint32((i >> 1) * 16 * fw) + r) * uint32(16) + q * uint32(4), w, n * k8 + kq,
                  kin and n < n32)
        for i in range(xrounds):
            idx = tid + uint32(i * nthr)
            if idx < uint32(xcopies):
                r = idx >> uint32(2)
                mrow = m0 + r
                _cp16(sm, base + uint32(32 * fw * 16) + r * uint32(16) + q * uint32(4), x, mrow * k8 + kq,
                      kin and mrow < m32)

    @cuda.jit(**opts)
    def kern(x, w1, w3, b1, b3, out, m_dim, k_dim, n_dim, cpw, has_b1, has_b3):
        scr = cuda.shared.array(scr_size, uint32)
        sm = cuda.shared.array(0, uint32)
        tid = uint32(cuda.threadIdx.x)
        lane = tid & uint32(31)
        warp = tid >> uint32(5)
        g = lane >> uint32(2)
        t = lane & uint32(3)
        n32 = uint32(n_dim)
        m32 = uint32(m_dim)
        tiles = (n32 + uint32(16 * fw - 1)) // uint32(16 * fw)
        b = uint32(cuda.blockIdx.x)
        if mfast:
            mcs = (m32 + uint32(8 * mt - 1)) // uint32(8 * mt)
            bt = b // mcs
            mc = b - bt * mcs
        else:
            mc = b // tiles
            bt = b - mc * tiles
        n0 = bt * uint32(16 * fw)
        m0 = mc * uint32(8 * mt)
        k8 = uint32(k_dim >> 3)
        kc = (uint32(k_dim) + uint32(31)) >> uint32(5)

        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = F0
        for s in range(stages - 1):
            issue(sm, uint32(s * sw), uint32(s), tid, kc, k8, n0, m0, n32, m32, x, w1, w3)
            _cp_commit()
        # the lane's fragment offsets within a slot: W1 rows 16 warp + g, + 8; W3 the same 16 fw rows on; X rows g
        wa = (warp * uint32(16) + g) * uint32(16) + t * uint32(4)
        xo = uint32(32 * fw * 16) + g * uint32(16) + t * uint32(4)
        c = uint32(0)
        rd = uint32(0)                              # slot of chunk c
        wr = uint32(stages - 1)                     # slot of chunk c + stages - 1
        while c < kc:                               # block-uniform
            wait()                                  # this thread's copies of chunk c have landed
            cuda.syncthreads()                      # everyone's have; slot wr is no longer read
            issue(sm, wr * uint32(sw), c + uint32(stages - 1), tid, kc, k8, n0, m0, n32, m32, x, w1, w3)
            _cp_commit()
            sb = rd * uint32(sw)
            a1 = _lds4(sm, sb + wa)
            a1b = _lds4(sm, sb + wa + uint32(8 * 16))
            a3 = _lds4(sm, sb + wa + uint32(16 * fw * 16))
            a3b = _lds4(sm, sb + wa + uint32(16 * fw * 16 + 8 * 16))
            for j in range(mt):
                xw = _lds4(sm, sb + xo + uint32(j * 8 * 16))
                for wsel in range(2):
                    aw = a1 if wsel == 0 else a3
                    bw = a1b if wsel == 0 else a3b
                    ai = (wsel * mt + j) * 4
                    for h in range(2):
                        r4 = _mma(aw[2 * h], bw[2 * h], aw[2 * h + 1], bw[2 * h + 1], xw[2 * h], xw[2 * h + 1],
                                  acc[ai], acc[ai + 1], acc[ai + 2], acc[ai + 3], scr, tid)
                        for e in range(4):
                            acc[ai + e] = r4[e]
            c += uint32(1)
            rd = rd + uint32(1) if rd < uint32(stages - 1) else uint32(0)
            wr = wr + uint32(1) if wr < uint32(stages - 1) else uint32(0)
        wait0()

        # D[n, m]: c0 = (n + g, m 2t), c1 = (n + g, 2t + 1), c2 = (n + g + 8, 2t), c3 = (n + g + 8, 2t + 1)
        for half in range(2):
            n = n0 + warp * uint32(16) + g + uint32(8 * half)
            if n < n32:
                bg = h2f(b1[n]) if has_b1 else F0
                bu = h2f(b3[n]) if has_b3 else F0
                for j in range(mt):
                    for e in range(2):
                        m = m0 + uint32(8 * j) + uint32(2) * t + uint32(e)
                        if m < m32:
                            i = j * 4 + 2 * half + e
                            st16(out, m * n32 + n, silu(acc[i] + bg) * (acc[mt * 4 + i] + bu))

    return kern


_launchers = {}


def launcher(mt, fw=FW, stages=STAGES, max_registers=None, mfast=True):
    from .cuda_launch import Launcher, SimLauncher
    from .fusedffn_tc_cuda import sig
    key = (mt, fw, stages, max_registers, mfast)
    if key not in _launchers:
        fn = _make(mt, fw, stages, max_registers, mfast)
        _launchers[key] = SimLauncher(fn, sig()) if SIM else Launcher(fn, sig(),
                                                                      dynamic_shared=smem_bytes(mt, fw, stages))
    return _launchers[key]


def launch(stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, mt, fw=FW, stages=STAGES, max_registers=None, mfast=True):
    wwords = n * k // 2
    bias = ((b1p or yp, (n,)), (b3p or yp, (n,)))
    launcher(mt, fw, stages, max_registers, mfast).launch(
        grid(m, n, mt, fw), 32 * fw, stream, (xp, (m * k // 2,)), (w1p, (wwords,)), (w3p, (wwords,)), *bias,
        (yp, (m * n,)), m, k, n, 0, int(b1p != 0), int(b3p != 0))


def run_arrays(x, w1, w3, b1=None, b3=None, mt=8, fw=FW, stages=STAGES, max_registers=None, mfast=True):
    """S for host arrays (tests, benchmarks): fp16 x [..., K], w1 / w3 [N, K], optional fp16 biases [N]."""
    from .bridge import KernelError
    from .fusedffn_cuda import check_arrays
    from .fusedffn_tc_cuda import ok
    m, k, n = check_arrays(x, w1, w3, b1, b3)
    if not ok(x.dtype == np.float16, w1.dtype == np.float16, m, k):
        raise KernelError(f"the tensor-core FusedFFN kernel takes fp16 X and W with K % 8 == 0 (got {x.dtype}, "
                          f"{w1.dtype}, K={k})")
    lead = tuple(x.shape[:-1])
    if n == 0:
        return np.zeros(lead + (n,), np.float16)

    def dev(a):
        return cuda.to_device(np.ascontiguousarray(a, np.float16).reshape(-1).view(np.uint16))

    dx, dw1, dw3 = dev(x), dev(w1), dev(w3)
    dy = cuda.device_array(m * n, np.uint16)
    db1 = dev(b1) if b1 is not None else dy
    db3 = dev(b3) if b3 is not None else dy
    if SIM:
        as32 = lambda a: a.view(np.uint32)  # noqa: E731
        _make(mt, fw, stages, None, mfast)[grid(m, n, mt, fw), 32 * fw, 0, smem_bytes(mt, fw, stages)](
            as32(dx), as32(dw1), as32(dw3), db1, db3, dy, m, k, n, 0, int(b1 is not None), int(b3 is not None))
    else:
        p = lambda a: a.device_ctypes_pointer.value  # noqa: E731
        launch(0, m, k, n, p(dx), p(dw1), p(dw3), p(db1) if b1 is not None else 0, p(db3) if b3 is not None else 0,
               p(dy), mt, fw, stages, max_registers, mfast)
        cuda.synchronize()
    return dy.copy_to_host().view(np.float16).reshape(lead + (n,))
