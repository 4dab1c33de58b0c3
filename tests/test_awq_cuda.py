"""AWQ CUDA kernels (MatMulAWQ, DequantAWQ, and FusedFFNAWQ's routing) against the numpy reference, under Numba's
CUDA simulator (NUMBA_ENABLE_CUDASIM=1, small shapes) or on a real GPU (ONNX_LOWBIT_REAL_GPU=1).

The fp32 decode / generic kernels through awq/gemv_run_cuda.run (shrunk blocks and forced K slices reach the multi-split
edge cases at the simulator's cost); DequantAWQ through its kernel object, as a session calls it; the routing
tables against the dispatch of the code they replaced. Tolerances: tests/test_awq_kernels.py. The kernel objects'
split-K scratch and alignment routing: tests/test_awq_sessions_cuda.py."""
import itertools

import numpy as np
import pytest
from numba import config
from test_awq_kernels import activations, check_matmul, weights

from onnx_lowbit import awq, domain

SIM = bool(config.ENABLE_CUDASIM)


def _cuda():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.awq import dequantawq_cuda, gemv_cuda, gemv_run_cuda
    return gemv_cuda, dequantawq_cuda, gemv_run_cuda.run


# (M, K, N, G, A dtype, bias, ct, warps, rows): every M, K, N, dtype and bias value at least twice; ct/warps shrink
# the block under the simulator (the kernels are parametric in them), None = the GPU geometry (32 x 8).
CUDA_CASES = [
    (1, 128, 8, 128, np.float32, True, None, None, None),
    (1, 688, 136, 128, np.float16, False, 8, 4, None),
    (3, 688, 64, 128, np.float16, True, 8, 4, None),
    (3, 256, 136, 128, np.float32, False, 8, 2, None),
    (16, 256, 8, 128, np.float32, False, 4, 2, None),
    (16, 128, 64, 128, np.float16, True, 8, 2, None),
    (11, 128, 16, 32, np.float16, True, 4, 2, None),       # 2 row chunks of 8, the second one partial
    (17, 688, 8, 128, np.float16, True, 4, 2, None),
    (17, 128, 136, 128, np.float32, True, 8, 2, None),
    (2, 30, 16, 7, np.float32, True, 4, 2, None),          # odd group size: K slices of one row
    (1, 128, 64, 128, np.float32, True, 8, 2, 32),         # a single K split: the direct (no atomics) path
    (1, 352, 16, 32, np.float16, True, 4, 2, 16),          # 11 K splits: a batch of 8 partials summed, then 3
    (3, 352, 24, 32, np.float32, False, 4, 2, 16),         # the same with 3 rows of partials per split
]


@pytest.mark.parametrize("M,K,N,G,dtype,hb,ct,warps,rows", CUDA_CASES,
                         ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-G{c[3]}-{np.dtype(c[4]).name}{'-bias' if c[5] else ''}"
                              for c in CUDA_CASES])
def test_cuda_matmul_vs_reference(M, K, N, G, dtype, hb, ct, warps, rows):  # noqa: N803
    gc, _, run = _cuda()
    qw, qz, sc = weights(K, N, G, seed=2)
    a = activations((M, K), dtype, seed=M)
    bias = activations((N,), dtype, seed=9) if hb else None
    geo = {} if (ct is None or not SIM) else {"ct": ct, "warps": warps}
    repeat = 2 if M in (1, 17) or not SIM else 1   # the scratch must be left zeroed for the next launch
    y = run(a, (qw, qz, sc), None, bias, None, G, K, N, rows=rows if SIM else None, repeat=repeat, **geo)
    check_matmul(y, a, qw, qz, sc, G, K, N, bias)


@pytest.mark.parametrize("M", [1, 16])
def test_cuda_matmul_is_deterministic(M):  # noqa: N803
    """Split-K partials are summed in a fixed order: repeated runs give the same bits."""
    gc, _, run = _cuda()
    K, N, G = (256, 64, 128) if SIM else (4096, 1024, 128)  # noqa: N806   (simulator: 8 K splits, 2 column tiles)
    qw, qz, sc = weights(K, N, G, seed=3)
    a = activations((M, K), np.float32, seed=M)
    geo = {"ct": 4, "warps": 2, "rows": 16} if SIM else {}
    ys = [run(a, (qw, qz, sc), None, None, None, G, K, N, repeat=2 if SIM else 3, **geo) for _ in range(2)]
    assert np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))


def test_cuda_matmul_generic_and_empty():
    gc, _, run = _cuda()
    K, N, G = 128, 16, 32  # noqa: N806
    qw, qz, sc = weights(K, N, G, seed=4)
    a = activations((2, K), np.float16, seed=11)
    geo = {"ct": 4, "warps": 2} if SIM else {}
    check_matmul(run(a, (qw, qz, sc), None, None, None, G, K, N, generic=True, **geo), a, qw, qz, sc, G, K, N)
    y = run(np.zeros((0, 3, K), np.float32), (qw, qz, sc), None, None, None, G, K, N)
    assert y.shape == (0, 3, N) and y.dtype == np.float32


def test_decode_plan():
    gc, _, run = _cuda()
    # LLaMA-7B gate/up on 132 SMs at 5 resident blocks per SM: 43 column tiles x 8 K splits of 8 x 64 rows,
    # one wave (688 blocks of R = 32 would need a second, nearly empty one)
    assert gc.plan(4096, 11008, 128, 132, blocks_per_sm=5) == (43, 64, 8)
    assert gc.decode_plan(16, 4096, 11008, 128, 132, 2) == (43 * 8 * 2, 64, 8)   # two row chunks
    for k, n, g in [(4096, 4096, 128), (700, 64, 7), (11008, 4096, 32), (128, 8, 128)]:
        tiles, r, splits = gc.plan(k, n, g, 132)
        assert g % r == 0 and r <= gc.RMAX and splits * gc.WARPS * r >= k   # slices never straddle a group
    assert gc.bucket(1) == 1 and gc.bucket(3) == 4 and gc.bucket(16) == 8
    assert gc.bucket(3, 2) == 4 and gc.bucket(16, 2) == 4                  # two weights: chunks of 4 rows


# ------------------------------------------------------------------------------ DequantAWQ (its kernel object)
class _Ctx:
    """The context a CUDA kernel's compute uses; the output is a numpy buffer (the simulator's device memory is
    host memory) at ``offset`` bytes past a 256-byte boundary."""

    def __init__(self, nbytes, offset=0):
        self.stream, self.recorder, self.has_scratch = 0, None, True
        self.buf = np.zeros(nbytes + 512, np.uint8)
        self.ptr = (self.buf.ctypes.data + 255) // 256 * 256 + offset

    def output(self, index, shape):
        return self.ptr


def tensors(*arrays):
    """Bridge Tensors over host arrays (the simulator's device memory)."""
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    et = {np.dtype(np.float32): 1, np.dtype(np.float16): 10, np.dtype(np.int32): 6}
    return [None if a is None else Tensor(a.ctypes.data, et[a.dtype], a.shape) for a in arrays]


def dequant_kernel(K, N, G):  # noqa: N803
    from onnx_lowbit.custom_ops.runtime import direct
    return direct.kernel_class("DequantAWQ", "CUDAExecutionProvider")(
        spec=domain.OPS["DequantAWQ"], attrs={"group_size": G, "K": K, "N": N}, node_name="t", in_types=(6, 6, 10),
        out_types=(10,))


@pytest.mark.skipif(not SIM, reason="kernel objects over host memory: simulator only (GPU: session tests)")
@pytest.mark.parametrize("K,N,G", [(300, 136, 128), (100, 16, 7), (256, 64, 32)])
def test_cuda_dequant_bit_exact(K, N, G):  # noqa: N803
    """The kernel object, bit-exact with the reference: K not a multiple of the group (300 / 128, 100 / 7: row runs
    crossing groups), a partial column tile (17 column groups), several row runs per warp; an output not aligned to
    16 bytes is refused."""
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    kern = dequant_kernel(K, N, G)
    qw, qz, sc = weights(K, N, G, seed=8)
    ref = awq.dequantize(qw, qz, sc, G, K, N)
    ctx = _Ctx(ref.nbytes)
    kern.compute(ctx, tensors(qw, qz, sc))
    got = np.frombuffer(ctx.buf, np.uint16, ref.size, ctx.ptr - ctx.buf.ctypes.data)
    assert np.array_equal(got, ref.reshape(-1).view(np.uint16))
    with pytest.raises(KernelError, match="output to 16 bytes"):
        kern.compute(_Ctx(ref.nbytes, 8), tensors(qw, qz, sc))


def test_dequant_geometry():
    _, dc, _ = _cuda()
    for K, N in [(4096, 11008), (300, 136), (100, 16)]:  # noqa: N806
        grid, rows = dc.plan(K, N, 132)
        tiles = -(-(N // 8) // dc.CT)
        assert grid % tiles == 0 and (grid // tiles) * dc.WARPS * rows >= K
    # LLaMA-7B gate/up on 132 SMs: 43 column tiles x 37 row blocks (~12 per SM) of 8 warps x 14 rows
    assert dc.plan(4096, 11008, 132) == (43 * 37, 14)


@pytest.mark.skipif(not SIM, reason="kernel objects over host memory: simulator only")
def test_cuda_bad_inputs_name_the_input():
    from onnx_lowbit.custom_ops import KernelError
    qw, qz, sc = weights(688, 136)
    with pytest.raises(KernelError, match=r"input 1 'qzeros' must have shape \[6, 17\]"):
        dequant_kernel(688, 136, 128).compute(_Ctx(688 * 136 * 2), tensors(qw, qz[:5], sc))
    gc, _, run = _cuda()
    a = np.zeros((1, 688), np.float32)
    with pytest.raises(KernelError, match=r"input 2 'qzeros' must have shape \[6, 17\]"):
        run(a, (qw, qz[:5], sc), None, None, None, 128, 688, 136)
    with pytest.raises(KernelError, match="'bias' must have A's type"):
        run(a, (qw, qz, sc), None, np.zeros(136, np.float16), None, 128, 688, 136)
    with pytest.raises(KernelError, match="'A' must be float or float16"):
        run(a.astype(np.float64), (qw, qz, sc), None, None, None, 128, 688, 136)


# ----------------------------------------------------------------------------------------------- routing tables
def _old_pick(op, a16, m, k, g, tc, x, sc, qw, qz, wpl1):
    """The kernel the dispatch before ROUTES launched (commit 222707c: matmulawq_cuda / fusedffnawq_cuda compute,
    matmulawq1_cuda.config / session_launch, matmulawq_cuda.tc_ok / bucket), for a call that passed the input
    checks; pointers as ints (sc: both weights' scales or'ed, qw / qz: both weights' words or'ed)."""
    gemv_ok = tc and a16 and g % 16 == 0 and k % 4 == 0         # config(...) not None (N % 8 == 0 always)
    if gemv_ok and m <= 16:                                      # sp = m1 if m == 1 else m8 if m <= SESSION_MAX_M
        wpl = wpl1 if m == 1 and op == "MatMulAWQ" else 1
        if not ((x | sc) & 7 or (qw | qz) & (4 * wpl - 1)):
            return "gemv1" if m == 1 else "gemv8"
    if tc and a16 and k % 4 == 0 and g % 32 == 0 and 2 <= m <= 16 and not ((x | sc) & 7 or (qw | qz) & 3):
        return "tc"                                              # the tensor-core kernel (_make_tc)
    return "decode" if m <= 16 else "generic"


def _awq_kernel(op, a16, k, n, g):
    from onnx_lowbit.custom_ops.runtime.kernels import kernel_class
    t = 10 if a16 else 1
    return kernel_class(op, "CUDAExecutionProvider")(spec=domain.OPS[op], attrs={"group_size": g, "K": k, "N": n},
                                                     node_name="t", in_types=(t,), out_types=(t,))


class _P:
    def __init__(self, ptr):
        self.ptr = ptr


@pytest.mark.skipif(not SIM, reason="kernel objects built under the simulator (no compilation)")
@pytest.mark.parametrize("op", ["MatMulAWQ", "FusedFFNAWQ"])
def test_routes_pick_what_the_old_dispatch_picked(op, monkeypatch):
    """Over dtype, M, K, group size, tensor cores and pointer alignments, ROUTES names the kernel the dispatch it
    replaced launched; that dispatch never reached its tensor-core kernel (the small-M GEMV took every call it
    could take, with the same alignment), which is why that kernel is gone. With cuBLAS (``blas``) and scratch, fp16
    X from M = 17 takes the prefill routes added since (FusedFFNAWQ: ffn/fusedffn4_prefill_cuda; MatMulAWQ:
    awq/prefill_cuda) instead of the generic kernel; without scratch the generic kernel again."""
    from onnx_lowbit.custom_ops.awq import session_cuda
    from onnx_lowbit.custom_ops.runtime.routing import route
    base = 1 << 20
    offs = [(0, 0, 0), (2, 0, 0), (0, 4, 0), (0, 2, 0), (0, 0, 4)]     # X, scales, qweight / qzeros past 8 bytes
    seen = set()
    for tc in (True, False):
        monkeypatch.setattr(session_cuda, "has_tc", lambda tc=tc: tc)
        for a16 in (True, False):
            for k, g in ((256, 32), (256, 16), (256, 128), (258, 2), (100, 7), (96, 48)):
                kern = _awq_kernel(op, a16, k, 64, g)
                wpl1 = kern.gemv[1].wpl if 1 in kern.gemv else 1
                mod = __import__(type(kern).__module__, fromlist=["ROUTES"])
                for m, (ox, osc, ow), blas in itertools.product((1, 2, 5, 8, 9, 16, 17, 40), offs, (False, True)):
                    kern.blas = blas
                    ws = [(_P(base + ow), _P(base + ow), _P(base + osc))] * kern.NW
                    got = route(mod.ROUTES, kern.case(m, _P(base + ox), ws)).kernel
                    want = _old_pick(op, a16, m, k, g, tc, base + ox, base + osc, base + ow, base + ow, wpl1)
                    if blas and a16 and m >= 17:
                        want = "prefill"
                        assert route(mod.ROUTES, kern.case(m, _P(base + ox), ws, scratch=False)).kernel == "generic"
                    assert got == want, (op, tc, a16, k, g, m, ox, osc, ow, blas)
                    seen.add(got)
    assert seen == {"gemv1", "gemv8", "decode", "generic", "prefill"}


@pytest.mark.skipif(not SIM, reason="kernel objects built under the simulator (no compilation)")
def test_every_routed_kernel_has_a_launcher():
    from onnx_lowbit.custom_ops.awq import dequantawq_cuda, matmulawq_cuda
    from onnx_lowbit.custom_ops.ffn import fusedffnawq_cuda
    from onnx_lowbit.custom_ops.runtime.routing import always, kernels
    for mod, op in ((matmulawq_cuda, "MatMulAWQ"), (fusedffnawq_cuda, "FusedFFNAWQ")):
        kern = _awq_kernel(op, True, 256, 64, 32)
        assert set(kernels(mod.ROUTES)) == set(kern.launch)
        assert set(kern.gemv) == {1, 8}                  # fp16, tensor cores: both GEMV plans compiled
        assert mod.ROUTES[-1].test is always           # the last row holds for every case
    assert set(kernels(dequantawq_cuda.ROUTES)) == set(dequant_kernel(128, 8, 128).launchers)
