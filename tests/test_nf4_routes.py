"""The NF4 ops' routing tables (MatMulNF4, FusedFFNNF4, DequantNF4 ROUTES) against the decisions the code made
before the tables (commit 222707c: MatMulNF4CudaKernel.compute / plan, FusedFFNNF4CudaKernel.compute with
table_choice / warpcols_plan / pick_groups, DequantNF4CudaKernel.compute), transcribed below as ``_old_*`` from
that code with its constants written out, over a grid of calls; every kernel a table names has a launcher. No GPU:
the tables are pure functions of a Case (the simulator only makes the CUDA modules importable here)."""
import itertools

import numpy as np
import pytest
from numba import config

SIM = bool(config.ENABLE_CUDASIM)
pytestmark = pytest.mark.skipif(not SIM, reason="imports the CUDA modules: run with NUMBA_ENABLE_CUDASIM=1")

DTYPES = ("float16", "float32")
MS = (1, 2, 3, 4, 5, 8, 9, 16, 17)
KS = (64, 96, 1024, 2048, 3072, 4096, 4112, 8192, 16384, 16400)
NS = (64, 4097, 11008)
BSS = (32, 64, 4096)


def _old_matmul(dt, m, k, n, bs, tc, fp32, a_al, q_al, am_al):
    """MatMulNF4CudaKernel.compute at 222707c (M2_DECODE, M2_MAX_M 4, M1_* 4096, M1_H2 2, M1_H2_WIDE 4, TC_MIN_M 2,
    nf4tc HALVES from M 8, RC2 from M 9, MAX_X_SHARED 160 KiB)."""
    f16 = dt == "float16"
    wide = f16 and k >= 4096 and k % 32 == 0 and not fp32                            # m1_wide
    h2 = 4 if wide else 2 if f16 and k >= 4096 and not fp32 else 0                 # m1_h2
    if wide and k // 16 <= 1024 and 2 <= m <= 4 and a_al >= 16 and q_al >= 16 and am_al >= 4:   # self.m2
        return "m2"
    if f16 and 2 <= m <= 16 and k % 64 == 0 and bs >= 64 and k * n < 2 ** 32 and tc \
            and a_al >= 8 and q_al >= 8 and am_al >= 4:                             # self.tc.pick(m)
        halves = n % 2 == 0 and (n // 2 * k) % bs == 0 and m >= 8
        return f"nf4tc.{'halves.' if halves else ''}rc{2 if m >= 9 else 1}"
    if m == 1 and k % 16 == 0 and k // 16 <= 1024:                                 # plan(): m1_path
        mode = "m1"
    elif m <= 16 and k % 16 == 0 and m * k * 4 <= 160 * 1024:                      # fast_path
        mode = "fast"
    else:
        return "generic"
    if q_al < (16 if mode == "m1" and wide else 8) or mode == "m1" and a_al < 16:
        return "generic"
    if mode == "fast":
        return "fast"
    pair = k >= 4096 and not h2
    return {4: "m1.h2wide", 2: "m1.h2"}.get(h2, "m1.pair" if pair else "m1.table16")


def _old_ffn(dt, m, k, n, bs, tc, fp32, grouped, x_al, q_al):
    """FusedFFNNF4CudaKernel.compute at 222707c (TC_MIN_M 3, MMA_M (3, 4), MMA_MIN_KN 2^25, WARPCOLS, table_choice
    with PAIR / EARLY / NIB / H2 / WIDE / H2_WIDE, WIDE_MIN_K 4096, GROUPS {1: 3} where pick_groups allows)."""
    a16 = dt == "float16"
    tc_ok = a16 and k % 64 == 0 and bs >= 64 and k * n < 2 ** 32 and tc
    mma_ms = {mm for mm in (3, 4) if k % 128 == 0 and bs >= 64 and k * n < 2 ** 32 and mm * k <= 16384}
    if tc_ok and mma_ms and k * n >= 1 << 25 and m in mma_ms and x_al >= 16 and q_al >= 16:
        return "nf4mma"
    if tc_ok and 3 <= m <= 16 and x_al >= 8 and q_al >= 8:
        return "nf4tc.rc2" if m >= 9 else "nf4tc.rc1"
    warpcols = {(1, 1): (8, 1), (2, 1): (8, 1), (1, 2): (8, 1), (2, 2): (8, 2), (1, 3): (6, 1)}
    plan = warpcols.get((m, k // 1024))
    if plan and not fp32 and a16 and k % (1024 * plan[1]) == 0 and 1 <= k // 1024 // plan[1] <= 5 and bs >= 32 \
            and x_al >= 16 and q_al >= 16:
        return f"nf4warp.mt{m}.c{k // 1024}" + (".s2" if plan[1] == 2 else "")
    if 0 < m <= 16 and k % 16 == 0 and k // 16 <= 1024:
        mt = 1 if m == 1 else 2
        big = k >= 4096 and k % 32 == 0
        h2 = 0 if not a16 or fp32 else 4 if big else {1: 2, 2: 0}[mt]
        wide = bool(h2) and k >= 4096 and k % 32 == 0
        pair = mt == 2 and not h2
        nib = mt == 1 and not h2
        if q_al >= (16 if wide else 8) and x_al >= 16:
            if wide:
                return f"decode.mt{mt}.wide" + (".g3" if mt == 1 and grouped else "")
            return "decode.mt1.nib" if nib else "decode.mt2.pair" if pair else "decode.mt1.h2"
    return "generic"


def _mods():
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda as fc
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cuda as dq, matmulnf4_cuda as mc
    from onnx_lowbit.custom_ops.runtime import routing
    return mc, fc, dq, routing


def test_matmulnf4_routes_as_before():
    """As before the tables, and with cuBLAS and onnxruntime's scratch (``blas``) fp16 A from M = 17 takes the
    prefill route (nf4/prefill_cuda) that replaced the generic kernel there, whatever K and alignment."""
    mc, _, _, routing = _mods()
    aligns = ((16, 16, 4), (8, 8, 4), (16, 8, 4), (8, 16, 4), (4, 16, 4), (16, 16, 2))
    n = 0
    for dt, m, k, nn, bs, tc, fp32, al, blas in itertools.product(DTYPES, MS, KS, NS, BSS, (True, False),
                                                                  (False, True), aligns, (False, True)):
        got = routing.route(mc.ROUTES, mc.case(dt, m, k, nn, bs, tc, fp32, al, blas=blas, scratch=blas)).kernel
        want = "prefill" if blas and dt == "float16" and m >= 17 else _old_matmul(dt, m, k, nn, bs, tc, fp32, *al)
        assert got == want, (dt, m, k, nn, bs, tc, fp32, al, blas)
        n += 1
    assert n > 10000
    for blas, scratch in ((True, False), (False, True)):    # one of the two missing: the generic kernel
        assert routing.route(mc.ROUTES, mc.case("float16", 17, 4096, 11008, 64, blas=blas,
                                                scratch=scratch)).kernel == "generic"


def test_fusedffnnf4_routes_as_before():
    """As before the tables, and with cuBLAS and onnxruntime's scratch (``blas``) fp16 X from M = 17 takes the
    prefill route (ffn/fusedffn4_prefill_cuda) that replaced the generic kernel there, whatever K and alignment."""
    _, fc, _, routing = _mods()
    aligns = ((16, 16), (8, 8), (16, 8), (8, 16), (4, 16))
    for dt, m, k, nn, bs, tc, fp32, grouped, al, blas in itertools.product(
            DTYPES, MS, KS, NS, BSS, (True, False), (False, True), (False, True), aligns, (False, True)):
        got = routing.route(fc.ROUTES, fc.case(dt, m, k, nn, bs, tc, fp32, grouped, al, cublas_ok=blas,
                                               scratch=blas)).kernel
        want = "prefill" if blas and dt == "float16" and m >= 17 else _old_ffn(dt, m, k, nn, bs, tc, fp32, grouped,
                                                                                 *al)
        assert got == want, (dt, m, k, nn, bs, tc, fp32, grouped, al, blas)
    for blas, scratch in ((True, False), (False, True)):    # one of the two missing: the generic kernel
        assert routing.route(fc.ROUTES, fc.case("float16", 17, 4096, 11008, 64, cublas_ok=blas,
                                                scratch=scratch)).kernel == "generic"


def test_forced_paths():
    mc, fc, _, routing = _mods()
    for path in ("generic", "fast"):
        assert routing.route(mc.ROUTES, mc.case("float16", 1, 4096, 11008, 64, path=path)).kernel == path
    assert routing.route(fc.ROUTES, fc.case("float16", 1, 4096, 11008, 64, path="generic")).kernel == "generic"


def test_named_calls():
    """A few calls by hand (LLaMA-7B shapes, H100-like): what BENCHMARKS.md's NF4 section times."""
    mc, fc, _, routing = _mods()
    mm = {(1, 4096, 11008): "m1.h2wide", (2, 4096, 11008): "m2", (4, 4096, 11008): "m2",
          (5, 4096, 11008): "nf4tc.rc1", (8, 4096, 11008): "nf4tc.halves.rc1", (12, 4096, 11008): "nf4tc.halves.rc2",
          (1, 2048, 2048): "m1.table16", (17, 4096, 11008): "prefill"}
    for (m, k, n), want in mm.items():
        assert routing.route(mc.ROUTES, mc.case("float16", m, k, n, 64)).kernel == want, (m, k, n)
    ffn = {(1, 4096, 11008, True): "decode.mt1.wide.g3", (1, 4096, 11008, False): "decode.mt1.wide",
           (2, 4096, 11008, False): "decode.mt2.wide", (3, 4096, 11008, False): "nf4mma",
           (9, 4096, 11008, False): "nf4tc.rc2", (1, 2048, 8192, False): "nf4warp.mt1.c2",
           (2, 2048, 8192, False): "nf4warp.mt2.c2.s2"}
    for (m, k, n, g), want in ffn.items():
        assert routing.route(fc.ROUTES, fc.case("float16", m, k, n, 64, grouped=g)).kernel == want, (m, k, n, g)


def test_int4_calls():
    """quant_type int4 (genai's MatMulNBits grid) with fp16 A: MatMulNF4 at M = 1 on the table-free decode (m1.u4wide
    where K % 32 == 0, else m1.u4); fp32 A, M > 1, the switch off or ONNX_LOWBIT_FP32_DECODE route as for NF4."""
    mc, _, _, routing = _mods()
    mm = lambda *a, **kw: routing.route(mc.ROUTES, mc.case(*a, **kw)).kernel  # noqa: E731
    for k, n in ((2048, 6144), (2048, 2048), (8192, 2048), (2048, 4096)):
        assert mm("float16", 1, k, n, 32, int4=True) == "m1.u4wide"
        assert mm("float16", 1, k, n, 32, fp32_decode=True, int4=True) == mm("float16", 1, k, n, 32, fp32_decode=True)
        assert mm("float32", 1, k, n, 32, int4=True) == mm("float32", 1, k, n, 32)
        assert mm("float16", 2, k, n, 32, int4=True) == mm("float16", 2, k, n, 32)
    assert mm("float16", 1, 2064, 512, 32, int4=True) == "m1.u4"
    assert mm("float16", 1, 2048, 2048, 32, align=(16, 8, 4), int4=True) == "m1.u4"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mc, "U4", False)
        assert mm("float16", 1, 2048, 2048, 32, int4=True) == "m1.table16"


def test_dequantnf4_routes_as_before():
    """DequantNF4CudaKernel.compute at 222707c: transposed=0 dequant_kn; transposed=1 DEFAULT's vector kernel when
    the packed input is aligned to its loads (q.ptr % DEFAULT.q_align() == 0: 2 bytes for fp32 out, 4 for fp16),
    else LEGACY's dequant_rows."""
    _, _, dq, routing = _mods()
    for dt, transposed, al in itertools.product(DTYPES, (False, True), (1, 2, 4, 8, 16)):
        want = "kn" if not transposed else "vec" if al >= {"float32": 2, "float16": 4}[dt] else "rows"
        assert routing.route(dq.ROUTES, dq.case(dt, 64, 32, 32, transposed, al)).kernel == want


def test_every_routed_kernel_has_a_launcher():
    """Every kernel name a table can route to has its launch configuration and builds a launcher (under the
    simulator: a SimLauncher over the generated kernel)."""
    mc, fc, dq, routing = _mods()
    from onnx_lowbit.custom_ops.nf4 import nf4mma_cuda, nf4tc_cuda, nf4warp_cuda
    for name in routing.kernels(mc.ROUTES):
        assert name in mc.KERNELS
        for dt in (np.float16, np.float32):
            assert mc.launcher(name, dt).dispatcher is not None
    for name in routing.kernels(fc.ROUTES):
        if name in fc.DECODE or name == "generic":
            assert fc.launcher(True, name).dispatcher is not None
        elif name.startswith("nf4warp."):
            m, ch = fc.WARP_KERNELS[name]
            assert nf4warp_cuda.launcher(ch, fc.WARPCOLS[(m, ch)][1], m).dispatcher is not None
        elif name == "nf4mma":
            assert nf4mma_cuda.launcher().dispatcher is not None
        elif name == "prefill":     # DequantNF4's transposed kernels (fp32 absmax, fp16 out), FusedFFN's SiLU * mul
            from onnx_lowbit.custom_ops.ffn import fusedffn_prefill_cuda as pre
            for var in (dq.DEFAULT["float16"], dq.LEGACY):
                assert dq._launcher(True, np.float16, var, absmax=np.float32).dispatcher is not None
            assert pre.launcher("act", True, False) is not None
        else:
            rc = {"nf4tc.rc1": 1, "nf4tc.rc2": 2}[name]
            assert nf4tc_cuda.launcher(2, nf4tc_cuda.warps_for(rc), rc).dispatcher is not None
    assert set(routing.kernels(dq.ROUTES)) == {"kn", "vec", "rows"}
