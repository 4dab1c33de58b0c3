"""MatMulAWQ / DequantAWQ kernels against the numpy reference (onnx_lowbit.awq).

CPU kernels run through the full onnxruntime bridge (one-node models in the onnx_lowbit domain); CUDA kernels
run under Numba's CUDA simulator through ``run_arrays`` (NUMBA_ENABLE_CUDASIM=1, small shapes and shrunk
blocks: the simulator runs every thread in Python), or on a real GPU with ONNX_LOWBIT_REAL_GPU=1.

Tolerances. DequantAWQ is bit-exact (one fp32 product, one RNE rounding to fp16, as the reference).
MatMulAWQ kernels multiply with the exact value (q - z) * s (fp32), while the reference ``awq.matmul`` uses W
rounded to fp16 and sums in float64. So, per output, with S = sum_k |x_k| |W16[k, n]| and
E = 32 * sum_k |x_k| |s[k // G, n]| (the magnitudes the fp32 sums go through: P = sum x (1 + q/16), S_x = sum x):
  * against the exact-product float64 reference: |y - ref| <= 2^-18 E  (fp32 sums of <= max(G, 32) terms of
    magnitude <= E plus the zero-point correction s (16 P - (16 + z) S_x), the 8 in-block and the split-K
    partials (or BLAS sgemm): about n u E with n ~ 64 terms and u = 2^-24; the observed errors are >= 30x below)
    + 2^-11 |ref| + 2^-24 for float16 outputs (one rounding);
  * against awq.matmul: the above + 2^-11 S (the fp16 rounding of each weight, at most half an fp16 ulp).
"""
import os

import numpy as np
import onnx
import pytest
from numba import config
from onnx import TensorProto, helper

import onnx_lowbit
from onnx_lowbit import awq, domain
from onnx_lowbit.custom_ops.device.launch import SimLauncher

SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"
CPU = ["CPUExecutionProvider"]
ET = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


# ---------------------------------------------------------------------------------------------------- helpers
_WEIGHTS = {}


def weights(K, N, G=128, seed=0):  # noqa: N803
    key = (K, N, G, seed)
    if key not in _WEIGHTS:
        rng = np.random.default_rng(seed + 1000 * K + N)
        w = (rng.standard_normal((K, N)) * rng.uniform(0.01, 0.2, N)).astype(np.float32)
        _WEIGHTS[key] = awq.quantize_rtn(w, G)
    return _WEIGHTS[key]


def activations(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) + 0.3).astype(dtype)  # a non-zero mean exercises the zero correction


def exact_ref(a, qw, qz, sc, G, K, N, bias=None):  # noqa: N803
    """float64 Y with the exact weights (q - z) * s (no fp16 rounding of W), and the bound E of the docstring."""
    q, z = awq.unpack(qw, qz)
    s = np.repeat(sc.astype(np.float64), G, axis=0)[:K]
    w = (q[:K].astype(np.float64) - np.repeat(z, G, axis=0)[:K]) * s
    x = a.reshape(-1, K).astype(np.float64)
    y = x @ w + (0.0 if bias is None else bias.astype(np.float64))
    return y.reshape(a.shape[:-1] + (N,)), (32 * np.abs(x) @ np.abs(s)).reshape(a.shape[:-1] + (N,))


def check_matmul(y, a, qw, qz, sc, G, K, N, bias=None):  # noqa: N803
    assert y.dtype == a.dtype and y.shape == a.shape[:-1] + (N,)
    if y.size == 0:
        return
    ref, e = exact_ref(a, qw, qz, sc, G, K, N, bias)
    y64 = y.astype(np.float64)
    out_round = 2.0 ** -11 * np.abs(ref) + 2.0 ** -24 if a.dtype == np.float16 else 0.0
    tol = 2.0 ** -18 * e + out_round
    assert np.all(np.abs(y64 - ref) <= tol), f"vs exact weights: max excess {np.max(np.abs(y64 - ref) - tol)}"
    w16 = np.abs(awq.dequantize(qw, qz, sc, G, K, N).astype(np.float64))
    s_w = (np.abs(a.reshape(-1, K).astype(np.float64)) @ w16).reshape(ref.shape)
    ref16 = awq.matmul(a, qw, qz, sc, G, K, N, bias).astype(np.float64)
    tol16 = tol + 2.0 ** -11 * s_w + (2.0 ** -11 * np.abs(ref16) if a.dtype == np.float16 else 0.0)
    assert np.all(np.abs(y64 - ref16) <= tol16), "vs awq.matmul"


def awq_model(op, K, N, G, *, a_dtype=np.float32, lead=("M",), bias=False, name="awq0", attrs=None,  # noqa: N803
              initializers=None):
    """One-node model. Inputs: A (MatMulAWQ), qweight, qzeros, scales, bias as graph inputs unless given in
    ``initializers`` (name -> array)."""
    Kp = -(-K // G) * G  # noqa: N806
    init = initializers or {}
    specs = [("qweight", TensorProto.INT32, [Kp, N // 8]), ("qzeros", TensorProto.INT32, [Kp // G, N // 8]),
             ("scales", TensorProto.FLOAT16, [Kp // G, N])]
    if op == "MatMulAWQ":
        specs = [("A", ET[np.dtype(a_dtype)], list(lead) + [K])] + specs
        if bias:
            specs.append(("bias", ET[np.dtype(a_dtype)], [N]))
        out = helper.make_tensor_value_info("Y", ET[np.dtype(a_dtype)], list(lead) + [N])
    else:
        out = helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [K, N])
    attrs = attrs if attrs is not None else {"group_size": G, "K": K, "N": N}
    node = helper.make_node(op, [s[0] for s in specs], ["Y"], domain=domain.DOMAIN, name=name, **attrs)
    inputs = [helper.make_tensor_value_info(n, t, [None] * len(shape) if n in ("qzeros", "bias") else shape)
              for n, t, shape in specs if n not in init]
    g = helper.make_graph([node], "g", inputs, [out],
                          initializer=[onnx.numpy_helper.from_array(v, n) for n, v in init.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


def session(model):
    return onnx_lowbit.InferenceSession(model, providers=CPU)


# --------------------------------------------------------------------------------------- CPU through onnxruntime
def test_ops_are_declared_in_the_domain():
    """The bridge declares domain.OPS; the AWQ ops must be there (no monkeypatching needed any more)."""
    assert "MatMulAWQ" in domain.OPS and "DequantAWQ" in domain.OPS


@pytest.mark.parametrize("K,N", [(128, 8), (688, 136), (256, 64), (688, 8), (128, 136)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cpu_matmul_vs_reference(K, N, dtype):  # noqa: N803
    G = 128  # noqa: N806
    qw, qz, sc = weights(K, N, G)
    for hb in (False, True):
        sess = session(awq_model("MatMulAWQ", K, N, G, a_dtype=dtype, bias=hb, lead=("B", "T")))
        bias = activations((N,), dtype, seed=5) if hb else None
        for lead in [(1, 1), (1, 3), (2, 8), (1, 17), (0, 4)]:   # M = 1, 3, 16, 17, 0
            a = activations(lead + (K,), dtype, seed=sum(lead))
            feeds = {"A": a, "qweight": qw, "qzeros": qz, "scales": sc}
            if hb:
                feeds["bias"] = bias
            y = sess.run(None, feeds)[0]
            check_matmul(y, a, qw, qz, sc, G, K, N, bias)


@pytest.mark.parametrize("K,N,G", [(256, 64, 32), (100, 16, 7), (688, 136, 688)])
def test_cpu_matmul_group_sizes_and_initializers(K, N, G):  # noqa: N803
    """Other group sizes (odd, per-channel), weights stored as initializers, 1-D and 3-D A."""
    qw, qz, sc = weights(K, N, G, seed=3)
    init = {"qweight": qw, "qzeros": qz, "scales": sc}
    for lead in [(), (2, 2, 5)]:
        sess = session(awq_model("MatMulAWQ", K, N, G, lead=[f"d{i}" for i in range(len(lead))],
                                 initializers=init))
        a = activations(lead + (K,), np.float32, seed=7)
        check_matmul(sess.run(None, {"A": a})[0], a, qw, qz, sc, G, K, N)


@pytest.mark.parametrize("K,N,G", [(128, 8, 128), (688, 136, 128), (256, 64, 32), (100, 16, 7)])
def test_cpu_dequant_bit_exact(K, N, G):  # noqa: N803
    qw, qz, sc = weights(K, N, G, seed=1)
    sess = session(awq_model("DequantAWQ", K, N, G))
    w = sess.run(None, {"qweight": qw, "qzeros": qz, "scales": sc})[0]
    assert w.dtype == np.float16 and w.shape == (K, N)
    assert np.array_equal(w.view(np.uint16), awq.dequantize(qw, qz, sc, G, K, N).view(np.uint16))


def test_schema_checker_and_shape_inference():
    domain.register_schemas()
    for op in ("MatMulAWQ", "DequantAWQ"):
        m = awq_model(op, 688, 136, 128, a_dtype=np.float16, bias=True)
        onnx.checker.check_model(m, full_check=True)


def _run_error(model, feeds):
    sess = session(model)
    with pytest.raises(Exception) as ei:
        sess.run(None, feeds)
    return str(ei.value)


def test_cpu_bad_inputs_name_the_input():
    K, N, G = 688, 136, 128  # noqa: N806
    qw, qz, sc = weights(K, N, G)
    a = activations((1, K), np.float32)
    m = awq_model("MatMulAWQ", K, N, G, name="proj")
    msg = _run_error(m, {"A": a, "qweight": qw, "qzeros": qz[:-1], "scales": sc})
    assert "qzeros" in msg and "[6, 17]" in msg and "[5, 17]" in msg and "proj" in msg and "MatMulAWQ" in msg
    msg = _run_error(awq_model("DequantAWQ", K, N, G, name="dq"), {"qweight": qw, "qzeros": qz[:, :-1], "scales": sc})
    assert "qzeros" in msg and "[6, 17]" in msg and "dq" in msg
    mb = awq_model("MatMulAWQ", K, N, G, bias=True)
    msg = _run_error(mb, {"A": a, "qweight": qw, "qzeros": qz, "scales": sc, "bias": np.zeros(N - 8, np.float32)})
    assert "bias" in msg and f"[{N}]" in msg


def test_cpu_bad_attributes_fail_at_creation():
    for attrs, word in [({"group_size": 128, "K": 688, "N": 132}, "'N'"), ({"group_size": 0, "K": 688, "N": 136},
                                                                          "'group_size'"),
                        ({"group_size": 128, "K": 0, "N": 136}, "'K'")]:
        with pytest.raises(Exception) as ei:
            session(awq_model("MatMulAWQ", 688, 136, 128, attrs=attrs, name="bad"))
        assert word in str(ei.value) and "bad" in str(ei.value)


def test_host_entry_points_check_inputs():
    from onnx_lowbit.custom_ops import KernelError
    from onnx_lowbit.custom_ops.awq import dequantawq_cpu, matmulawq_cpu
    qw, qz, sc = weights(128, 8)
    with pytest.raises(KernelError, match="'A' must have last dimension K=128"):
        matmulawq_cpu.matmul(np.zeros((1, 127), np.float32), qw, qz, sc, 128, 128, 8)
    with pytest.raises(KernelError, match="'scales' must be float16"):
        dequantawq_cpu.dequantize(qw, qz, sc.astype(np.float32), 128, 128, 8)
    with pytest.raises(KernelError, match="'qweight' must have shape \\[128, 1\\]"):
        dequantawq_cpu.dequantize(qw[:64], qz, sc, 128, 128, 8)


# ------------------------------------------------------------------------------------------ CUDA (simulator/GPU)
def _cuda():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.awq import dequantawq_cuda, matmulawq_cuda
    return matmulawq_cuda, dequantawq_cuda


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
GPT2_CASES = [(1, 256, 64, 32, np.float16, True), (2, 30, 16, 7, np.float32, False)]   # 8-byte loads (option)


@pytest.mark.parametrize("M,K,N,G,dtype,hb,ct,warps,rows", CUDA_CASES,
                         ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-G{c[3]}-{np.dtype(c[4]).name}{'-bias' if c[5] else ''}"
                              for c in CUDA_CASES])
def test_cuda_matmul_vs_reference(M, K, N, G, dtype, hb, ct, warps, rows):  # noqa: N803
    mc, _ = _cuda()
    qw, qz, sc = weights(K, N, G, seed=2)
    a = activations((M, K), dtype, seed=M)
    bias = activations((N,), dtype, seed=9) if hb else None
    geo = {} if (ct is None or not SIM) else {"ct": ct, "warps": warps}
    repeat = 2 if M in (1, 17) or not SIM else 1   # the scratch must be left zeroed for the next launch
    y = mc.run_arrays(a, qw, qz, sc, G, K, N, bias, rows=rows if SIM else None, repeat=repeat, **geo)
    check_matmul(y, a, qw, qz, sc, G, K, N, bias)


@pytest.mark.parametrize("M", [1, 16])
def test_cuda_matmul_is_deterministic(M):  # noqa: N803
    """Split-K partials are summed in a fixed order: repeated runs give the same bits."""
    mc, _ = _cuda()
    K, N, G = (256, 64, 128) if SIM else (4096, 1024, 128)  # noqa: N806   (simulator: 8 K splits, 2 column tiles)
    qw, qz, sc = weights(K, N, G, seed=3)
    a = activations((M, K), np.float32, seed=M)
    geo = {"ct": 4, "warps": 2, "rows": 16} if SIM else {}
    ys = [mc.run_arrays(a, qw, qz, sc, G, K, N, repeat=2 if SIM else 3, **geo) for _ in range(2)]
    assert np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))


@pytest.mark.parametrize("M,K,N,G,dtype,hb", GPT2_CASES)
def test_cuda_matmul_two_groups_per_thread(M, K, N, G, dtype, hb):  # noqa: N803
    mc, _ = _cuda()
    qw, qz, sc = weights(K, N, G, seed=6)
    a = activations((M, K), dtype, seed=M + 20)
    bias = activations((N,), dtype, seed=21) if hb else None
    geo = {"ct": 4, "warps": 2} if SIM else {}
    check_matmul(mc.run_arrays(a, qw, qz, sc, G, K, N, bias, gpt=2, **geo), a, qw, qz, sc, G, K, N, bias)


# tensor-core kernel (fp16 A): (M, K, N, G, bias, max K splits): M = 1 (sessions use it from TC_MIN_M on), two row
# chunks with several K splits, several groups per warp (the partials added up in shared memory), a partial
# column tile and K padded to the group
TC_CASES = [(1, 320, 72, 128, True, 8), (9, 256, 16, 64, False, 8), (16, 256, 8, 64, True, 1),
            (1, 704, 16, 32, False, 16)]   # 11 K splits under the simulator (2 warps): 8 partials summed, then 3


@pytest.mark.parametrize("M,K,N,G,hb,max_splits", TC_CASES)
def test_cuda_tc_matmul(M, K, N, G, hb, max_splits):  # noqa: N803
    mc, _ = _cuda()
    qw, qz, sc = weights(K, N, G, seed=7)
    a = activations((M, K), np.float16, seed=M + 30)
    bias = activations((N,), np.float16, seed=31) if hb else None
    assert mc.tc_ok(True, M, K, G)
    y = mc.tc_run(a, (qw, qz, sc), None, bias, None, G, K, N, repeat=2, max_splits=max_splits).reshape(M, N)
    check_matmul(y, a, qw, qz, sc, G, K, N, bias)


def test_cuda_matmul_generic_and_empty():
    mc, _ = _cuda()
    K, N, G = 128, 16, 32  # noqa: N806
    qw, qz, sc = weights(K, N, G, seed=4)
    a = activations((2, K), np.float16, seed=11)
    geo = {"ct": 4, "warps": 2} if SIM else {}
    check_matmul(mc.run_arrays(a, qw, qz, sc, G, K, N, force_generic=True, **geo), a, qw, qz, sc, G, K, N)
    y = mc.run_arrays(np.zeros((0, 3, K), np.float32), qw, qz, sc, G, K, N)
    assert y.shape == (0, 3, N) and y.dtype == np.float32


@pytest.mark.parametrize("K,N,G,ct,warps", [(128, 8, 128, None, None), (688, 136, 128, 8, 4), (256, 64, 32, 8, 2),
                                             (100, 16, 7, 4, 2)])
def test_cuda_dequant_bit_exact(K, N, G, ct, warps):  # noqa: N803
    _, dc = _cuda()
    qw, qz, sc = weights(K, N, G, seed=1)
    geo = {} if (ct is None or not SIM) else {"ct": ct, "warps": warps}
    w = dc.run_arrays(qw, qz, sc, G, K, N, **geo)
    assert np.array_equal(w.view(np.uint16), awq.dequantize(qw, qz, sc, G, K, N).view(np.uint16))


def _dequant_variants():
    """Every option of dequantawq_cuda.Variant at least once (ct/warps shrunk under the simulator, below)."""
    from onnx_lowbit.custom_ops.awq.dequantawq_cuda import LEGACY, Variant as A
    return [LEGACY, A(store="v4"), A(store="v4cs", bps=2), A(store="v4", zpre=True, h2=True, bps=0),
            A(unroll=4, store="v4cs", zpre=True), A(unroll=3, h2=True, bps=1), A(unroll=16, zpre=True, bps=16)]


@pytest.mark.parametrize("vi", range(7))
def test_cuda_dequant_variants_bit_exact(vi):
    """Each kernel variant bit-exact with the reference: K not a multiple of the group (300 / 128, 100 / 7: row runs
    crossing groups), a partial column tile (17 column groups), several row runs per warp."""
    _, dc = _cuda()
    v = _dequant_variants()[vi]
    for K, N, G in [(300, 136, 128), (100, 16, 7), (256, 64, 32)]:  # noqa: N806
        qw, qz, sc = weights(K, N, G, seed=8)
        geo = {"ct": 8, "warps": 2} if SIM else {}
        w = dc.run_arrays(qw, qz, sc, G, K, N, variant=v, sms=1, **geo)
        assert np.array_equal(w.view(np.uint16), awq.dequantize(qw, qz, sc, G, K, N).view(np.uint16)), (v, K, N, G)


def test_dequant_variant_geometry():
    from onnx_lowbit.custom_ops.awq import dequantawq_cuda as dc
    for v in _dequant_variants():
        for K, N in [(4096, 11008), (300, 136), (100, 16)]:  # noqa: N806
            grid, block, rows = dc.geometry(v, K, N, 132)
            tiles = -(-(N // 8) // v.ct)
            assert block == v.ct * v.warps and grid % tiles == 0 and (grid // tiles) * v.warps * rows >= K
        assert dc.out_align(v) == (8 if v.store == "u64x2" else 16)
    assert dc.geometry(dc.LEGACY, 4096, 11008, 132)[::2] == dc.plan(4096, 11008, 132)   # LEGACY = the first kernel


@pytest.mark.skipif(not SIM, reason="stand-in launches over host memory: simulator only")
def test_dequant_kernel_object_with_a_variant_default(monkeypatch):
    """DequantAWQCudaKernel.compute as a session calls it, with a 128-bit-store variant as DEFAULT: bit-exact
    through the variant's own geometry (bps 0: the stand-in's resident blocks), and a clear error for an output
    not aligned to 16 bytes."""
    import ctypes
    from types import SimpleNamespace

    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    from onnx_lowbit.custom_ops.device import launch as cuda_launch
    from onnx_lowbit.custom_ops.awq import dequantawq_cuda as dc
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    launches = []

    class Lau:
        def __init__(self, v):
            self.fn = dc._make_v(*v.kernel_key())

        def blocks_per_sm(self, block, shmem=None):
            return 3

        def launch(self, grid, block, stream, *args, shmem=None):
            launches.append((grid, block, args[-1]))
            dts = [np.uint32, np.uint32, np.uint16, np.uint64]
            conv = [FakeCUDAArray(np.frombuffer((ctypes.c_char * (a[1][0] * np.dtype(dt).itemsize)).from_address(a[0]),
                                                dt)) for a, dt in zip(args[:4], dts)] + list(args[4:])
            self.fn[grid, block](*conv)

    v = dc.Variant(ct=8, warps=2, unroll=4, bps=0, store="v4cs", zpre=True, h2=True)
    monkeypatch.setattr(cuda_launch, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_launch, "sm_count", lambda device: 1)
    monkeypatch.setattr(dc, "launcher", lambda variant=None: Lau(variant))
    monkeypatch.setattr(dc, "DEFAULT", v)
    K, N, G = 300, 136, 128  # noqa: N806
    qw, qz, sc = weights(K, N, G, seed=9)
    kern = dc.DequantAWQCudaKernel(spec=domain.OPS["DequantAWQ"], attrs={"group_size": G, "K": K, "N": N},
                                   node_name="t", in_types=(6, 6, 10), out_types=(10,))
    assert (kern.grid, kern.block, kern.rows) == dc.geometry(v, K, N, 1, kern.launcher)
    ref = awq.dequantize(qw, qz, sc, G, K, N)
    inputs = [Tensor(a.ctypes.data, t, a.shape) for a, t in ((qw, 6), (qz, 6), (sc, 10))]
    for off in (0, 8):
        buf = np.zeros(ref.nbytes + 512, np.uint8)
        op = (buf.ctypes.data + 255) // 256 * 256 + off
        ctx = SimpleNamespace(stream=0, output=lambda index, shape, op=op: op)
        if off:
            with pytest.raises(KernelError, match="output to 16 bytes"):
                kern.compute(ctx, inputs)
            continue
        kern.compute(ctx, inputs)
        assert launches[-1] == (kern.grid, v.block, kern.rows)
        got = np.frombuffer((ctypes.c_char * ref.nbytes).from_address(op), np.uint16)
        assert np.array_equal(got, ref.reshape(-1).view(np.uint16))


def test_cuda_bad_inputs_name_the_input():
    mc, dc = _cuda()
    from onnx_lowbit.custom_ops import KernelError
    qw, qz, sc = weights(688, 136)
    a = np.zeros((1, 688), np.float32)
    with pytest.raises(KernelError, match=r"input 2 'qzeros' must have shape \[6, 17\]"):
        mc.run_arrays(a, qw, qz[:5], sc, 128, 688, 136)
    with pytest.raises(KernelError, match=r"input 1 'qzeros' must have shape \[6, 17\]"):
        dc.run_arrays(qw, qz[:5], sc, 128, 688, 136)
    with pytest.raises(KernelError, match="'bias' must have A's type"):
        mc.run_arrays(a, qw, qz, sc, 128, 688, 136, np.zeros(136, np.float16))
    with pytest.raises(KernelError, match="'A' must be float or float16"):
        mc.run_arrays(a.astype(np.float64), qw, qz, sc, 128, 688, 136)


def test_decode_plan():
    mc, _ = _cuda()
    # LLaMA-7B gate/up on 132 SMs at 5 resident blocks per SM: 43 column tiles x 8 K splits of 8 x 64 rows,
    # one wave (688 blocks of R = 32 would need a second, nearly empty one)
    assert mc.plan(4096, 11008, 128, 132, blocks_per_sm=5) == (43, 64, 8)
    assert mc.decode_plan(16, 4096, 11008, 128, 132, 2) == (43 * 8 * 2, 64, 8)   # two row chunks
    for k, n, g in [(4096, 4096, 128), (700, 64, 7), (11008, 4096, 32), (128, 8, 128)]:
        tiles, r, splits = mc.plan(k, n, g, 132)
        assert g % r == 0 and r <= mc.RMAX and splits * mc.WARPS * r >= k   # slices never straddle a group
    assert mc.bucket(1) == 1 and mc.bucket(3) == 4 and mc.bucket(16) == 8 and mc.bucket(17) is None



# --------------------------------------------- split-K partials from onnxruntime's allocator (MatMulAWQ, FusedFFNAWQ)
# The kernel objects' compute, as a session calls it, under the simulator: kernel creation with stand-ins for the
# driver queries and for cuda_launch.Launcher (_SimLauncher: the real kernels at their GPU geometry, on arrays over
# the simulator's host memory of exactly the declared sizes), and a stand-in Context whose scratch is filled with
# NaN (no zeroing needed). On a GPU the session test below checks the same through onnxruntime.
class _SimLauncher(SimLauncher):
    """cuda_launch.SimLauncher, strict (a null or empty argument is an empty array), 4 resident blocks per SM."""

    def __init__(self, fn, sig):
        super().__init__(fn, sig, empty=0)

    def blocks_per_sm(self, block, shmem=None):
        return 4


class _ScratchCtx:
    """bridge.Context's stand-in: outputs and (with ``has_scratch``) scratch are numpy buffers (host memory is the
    simulator's device memory), scratch filled with NaN; both reported to the recorder as Context does."""

    def __init__(self, has_scratch, stream=7):
        self.has_scratch, self.stream, self.recorder = has_scratch, stream, None
        self.keep, self.asked = [], []

    def _buf(self, nbytes, fill):
        b = np.full(max(nbytes, 1), fill, np.uint8)
        self.keep.append(b)
        return b.ctypes.data

    def output(self, index, shape):
        ptr = self._buf(int(np.prod(shape)) * 4, 0)
        if self.recorder is not None:
            self.recorder.output(index, tuple(shape), ptr)
        return ptr

    def scratch(self, nbytes):
        assert self.has_scratch
        self.asked.append(nbytes)
        ptr = self._buf(nbytes, 0xFF)                       # NaN in every float
        if self.recorder is not None:
            self.recorder.scratch(ptr, nbytes)
        return ptr


@pytest.fixture
def sim_kernels(monkeypatch):
    """Kernel classes buildable under the simulator (SM count 1, 4 blocks per SM, tensor cores present)."""
    if not SIM:
        pytest.skip("stand-in launches over host memory: simulator only (on a GPU: test_gpu_session_...)")
    from onnx_lowbit.custom_ops.awq import matmulawq_cuda
    from onnx_lowbit.custom_ops.device import launch as cuda_launch
    from onnx_lowbit.custom_ops.ffn import fusedffnawq_cuda
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1c
    mc, fc = matmulawq_cuda, fusedffnawq_cuda
    monkeypatch.setattr(m1c, "launcher", lambda warps=m1c.WARPS, unroll=m1c.UNROLL, max_registers=None, wpl=m1c.WPL,
                        probe=0, nw=1, mr=1: _SimLauncher(m1c._make(warps, unroll, None, wpl, probe, nw, mr),
                                                          m1c.sig(wpl)))
    monkeypatch.setattr(cuda_launch, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_launch, "sm_count", lambda device: 1)
    monkeypatch.setattr(mc, "tc_device", lambda: True)
    monkeypatch.setattr(m1c, "tc_device", lambda: True)
    monkeypatch.setattr(mc, "tc_launcher", lambda nw, *a, **k: _SimLauncher(mc._make_tc(nw, True), mc.tc_sig()))
    monkeypatch.setattr(mc, "launcher", lambda a16, mt, gpt=1: _SimLauncher(
        mc.make_gemv(mt, a16, gpt=gpt) if mt else mc.make_generic(a16), mc._sig(a16, mt is not None, gpt)))
    monkeypatch.setattr(fc, "launcher", lambda a16, mt: _SimLauncher(
        fc._make_gemv(mt, a16) if mt else fc._make_generic(a16), fc._sig(a16, mt is not None)))
    return mc, fc


def _tensor(a):
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    et = {np.dtype(np.float32): 1, np.dtype(np.float16): 10, np.dtype(np.int32): 6}[a.dtype]
    return Tensor(a.ctypes.data, et, a.shape)


def _call(kernel, ctx, arrays, out_shape, dtype):
    """One recorded compute call: (output, plan, its launch's patches {slot: (kind, offset)}, the launch's
    partials and counters as (pointer, nitems, slot))."""
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.runtime.abi import LbPlan
    plan = LbPlan()
    plans.compute_and_record(kernel, ctx, [_tensor(a) if a is not None else None for a in arrays], plan)
    assert plan.valid and plan.n_steps == 1
    st = plan.steps[0]
    patches = {st.patch_slot[j]: (st.patch_kind[j], st.patch_off[j]) for j in range(st.n_patch)}
    part, cnt = _SimLauncher.last_slots[-2:]     # the last two array arguments: the partials, the counters
    y = np.frombuffer(ctx.keep[0], np.dtype(dtype))[:int(np.prod(out_shape))].reshape(out_shape).copy()
    return y, plan, patches, (st.params[part], st.params[part - 2], part), (st.params[cnt], st.params[cnt - 2], cnt)


SCRATCH_CASES = [  # op, M, dtype, has_scratch: the fp32 decode kernel (M=1), the small-M tensor-core GEMV
    # (matmulawq1_cuda, fp16: M = 1, and M = 2 .. 16 in chunks of 8 rows), the M >= 2 tensor-core kernel (fp16; "tc":
    # with matmulawq1_cuda.SESSION_MAX_M = 8, M = 9 .. 16 as before)
    ("MatMulAWQ", 1, np.float32, True), ("MatMulAWQ", 3, np.float16, True), ("MatMulAWQ", 1, np.float16, False),
    ("MatMulAWQ", 1, np.float16, True), ("MatMulAWQ", 11, np.float16, True), ("MatMulAWQ", "tc", np.float16, True),
    ("FusedFFNAWQ", 1, np.float32, True), ("FusedFFNAWQ", 5, np.float16, True), ("FusedFFNAWQ", 2, np.float16, False),
    ("FusedFFNAWQ", 1, np.float16, True), ("FusedFFNAWQ", 1, np.float16, False), ("FusedFFNAWQ", 9, np.float16, True),
    ("FusedFFNAWQ", 16, np.float16, False), ("FusedFFNAWQ", "tc", np.float16, True),
]


@pytest.mark.parametrize("op,M,dtype,has_scratch", SCRATCH_CASES)
def test_session_call_takes_its_partials_from_ort_scratch(sim_kernels, monkeypatch, op, M, dtype,  # noqa: N803
                                                          has_scratch):
    """compute takes the split-K partials through ctx.scratch, exactly the launch's splits x nw x M x N floats, once
    per call, recorded as the plan's SCRATCH (patched per replay); the tile counters are the kernel's per-stream
    buffer (unpatched in the plan) and zero after every call; results meet the reference on NaN-filled scratch,
    twice in a row. Without onnxruntime's scratch (< 1.18) the partials are the pool's own per-stream buffer."""
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1c
    from onnx_lowbit.custom_ops.device import splitk
    from onnx_lowbit.custom_ops.runtime import plans
    mc, fc = sim_kernels
    K, N, G = 256, 64, 32  # noqa: N806
    if M == "tc":           # sessions' kernel for M = 9 .. 16 before (still the fallback where the GEMV cannot go)
        monkeypatch.setattr(m1c, "SESSION_MAX_M", 8)
        M = 10 if op == "MatMulAWQ" else 12  # noqa: N806
    nw = 1 if op == "MatMulAWQ" else 2
    cls = mc.MatMulAWQCudaKernel if nw == 1 else fc.FusedFFNAWQCudaKernel
    tid = 10 if dtype == np.float16 else 1
    kern = cls(spec=domain.OPS[op], attrs={"group_size": G, "K": K, "N": N}, node_name="t", in_types=(tid,),
               out_types=(tid,))
    a = activations((M, K), dtype, seed=M + 40)
    if nw == 1:
        qw, qz, sc = weights(K, N, G, seed=8)
        bias = activations((N,), dtype, seed=41)
        arrays = [a, qw, qz, sc, bias]
    else:
        from test_ffn4_kernels import awq_weights, check_awq
        w1, w3 = awq_weights(K, N, G, seed=5)
        arrays = [a, *w1, *w3, activations((N,), dtype, seed=42), None]
    small = dtype == np.float16 and M <= m1c.SESSION_MAX_M
    sp = (kern.m1 if M == 1 else kern.m8) if small else None
    tc = M >= mc.TC_MIN_M and dtype == np.float16 and not small
    if small:
        assert sp is not None and sp.mr == (1 if M == 1 else 8)   # the shape suits the small-M tensor-core GEMV
        splits = sp.splits
    elif tc:
        _, _, splits = kern.tc_plans[M]
    else:
        _, _, splits = kern.plans[(mc.bucket(M), mc.chunks(M, mc.bucket(M)))] if nw == 1 else kern.plans[M]
    assert splits > 1                       # the shapes need the partials
    floats = mc.partial_floats(splits, nw, M, N)
    for _ in range(2):                      # the counters the first call left must serve the second
        ctx = _ScratchCtx(has_scratch)
        y, plan, patches, part, cnt = _call(kern, ctx, arrays, (M, N), dtype)
        if nw == 1:
            check_matmul(y, a, qw, qz, sc, G, K, N, bias)
        else:
            check_awq(y, a, w1, w3, G, K, N, arrays[7], None)
        block = sp.block if small else 32 * mc.TC_WARPS if tc else mc.BLOCK
        assert plan.steps[0].block == block     # the kernel the case is for
        assert part[1] == floats and cnt[1] == kern.scratch.tiles
        assert cnt[0] == kern.scratch.counters(ctx.stream)[0] and cnt[2] not in patches   # kernel-owned, kept
        assert np.all(kern.scratch._cnt[ctx.stream].copy_to_host() == 0)      # left zeroed for the next launch
        scratch_slots = [s for s, (kind, _) in patches.items() if kind == plans.SCRATCH]
        if has_scratch:
            assert ctx.asked == [4 * floats] and plan.scratch == 4 * floats   # one buffer per call, exact size
            assert scratch_slots == [part[2]] and patches[part[2]] == (plans.SCRATCH, 0)
            assert kern.scratch.owned_partials() == 0
        else:
            assert ctx.asked == [] and plan.scratch == 0 and scratch_slots == []   # kept: the pool's, per stream
            assert part[0] == splitk._dptr(kern.scratch._acc[ctx.stream])
            assert kern.scratch.owned_partials() == 1
    # another stream gets counters of its own
    assert kern.scratch.counters(8)[0] != kern.scratch.counters(7)[0]


@pytest.mark.parametrize("op", ["MatMulAWQ", "FusedFFNAWQ"])
def test_m1_gemv_needs_8_byte_aligned_x(sim_kernels, op):
    """M = 1, fp16: the tensor-core GEMV reads X 8 bytes at a time; an X that is only 2-byte aligned (a view one
    element into a buffer) takes the fp32 decode kernel instead, with the same result bounds."""
    mc, fc = sim_kernels
    K, N, G = 256, 64, 32  # noqa: N806
    nw = 1 if op == "MatMulAWQ" else 2
    cls = mc.MatMulAWQCudaKernel if nw == 1 else fc.FusedFFNAWQCudaKernel
    kern = cls(spec=domain.OPS[op], attrs={"group_size": G, "K": K, "N": N}, node_name="t", in_types=(10,),
               out_types=(10,))
    assert kern.m1 is not None
    buf = activations((1, K + 4), np.float16, seed=44)
    for a, block in ((buf[:, :K], kern.m1[2]), (buf[:, 1:K + 1], mc.BLOCK)):   # 8-byte aligned / 2 bytes past
        if nw == 1:
            qw, qz, sc = weights(K, N, G, seed=8)
            arrays = [a, qw, qz, sc]
        else:
            from test_ffn4_kernels import awq_weights, check_awq
            w1, w3 = awq_weights(K, N, G, seed=5)
            arrays = [a, *w1, *w3]
        y, plan, _, _, _ = _call(kern, _ScratchCtx(True), arrays, (1, N), np.float16)
        assert plan.steps[0].block == block
        if nw == 1:
            check_matmul(y, a, qw, qz, sc, G, K, N)
        else:
            check_awq(y, a, w1, w3, G, K, N, None, None)


@pytest.mark.parametrize("M,K,G,dtype", [(1, 8, 8, np.float32), (2, 64, 64, np.float16)])
def test_single_split_takes_no_scratch(sim_kernels, M, K, G, dtype):  # noqa: N803
    """A launch with one K split (fp32 decode kernel, small-M tensor-core GEMV) writes the output directly: no
    partials, no scratch asked for."""
    mc, _ = sim_kernels
    N = 16  # noqa: N806
    tid = 10 if dtype == np.float16 else 1
    kern = mc.MatMulAWQCudaKernel(spec=domain.OPS["MatMulAWQ"], attrs={"group_size": G, "K": K, "N": N},
                                  node_name="t", in_types=(tid,), out_types=(tid,))
    assert (kern.m8.splits if M >= 2 else kern.plans[(1, 1)][2]) == 1
    qw, qz, sc = weights(K, N, G, seed=9)
    a = activations((M, K), dtype, seed=43)
    ctx = _ScratchCtx(True)
    y, plan, _, part, _ = _call(kern, ctx, [a, qw, qz, sc], (M, N), dtype)
    check_matmul(y, a, qw, qz, sc, G, K, N)
    assert ctx.asked == [] and plan.scratch == 0 and part[:2] == (0, 0)


def test_gpu_session_takes_partials_from_onnxruntime():
    """GPU: one-node MatMulAWQ and FusedFFNAWQ sessions (fp32 decode kernel at M=1, MatMulAWQ's M=1 tensor-core
    GEMV with fp16 A, tensor-core at M=4) take
    their partials from onnxruntime's allocator on every call (the recording one and the native replays: the
    shim's counters) and keep none of their own; results meet the reference and repeat bit for bit."""
    if SIM or not REAL_GPU:
        pytest.skip("onnxruntime CUDA sessions: real GPU only (ONNX_LOWBIT_REAL_GPU=1)")
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here")
    from test_ffn4_kernels import awq_model as ffn_model
    from test_ffn4_kernels import awq_weights, check_awq

    from onnx_lowbit.custom_ops.awq import matmulawq_cuda
    from onnx_lowbit.custom_ops.ffn import fusedffnawq_cuda
    from onnx_lowbit.custom_ops.runtime import bridge
    K, N, G = 2048, 256, 64  # noqa: N806
    qw, qz, sc = weights(K, N, G, seed=10)
    w1, w3 = awq_weights(K, N, G, seed=11)
    for op in ("MatMulAWQ", "FusedFFNAWQ"):
        for M, dtype in ((1, np.float32), (1, np.float16), (4, np.float16)):  # noqa: N806
            a = activations((1, M, K), dtype, seed=M + 50)
            if op == "MatMulAWQ":
                model = awq_model(op, K, N, G, a_dtype=dtype, lead=("B", "T"),
                                  initializers={"qweight": qw, "qzeros": qz, "scales": sc})
                feeds = {"A": a}
            else:
                model = ffn_model((1, M), K, N, G, dtype, w1, w3, None, None)
                feeds = {"x": a}
            ids = set(bridge._kernels)
            sess = onnx_lowbit.InferenceSession(model, providers=["CUDAExecutionProvider"])
            kern = [k for i, k in bridge._kernels.items() if i not in ids][0]
            assert isinstance(kern, (matmulawq_cuda.MatMulAWQCudaKernel, fusedffnawq_cuda.FusedFFNAWQCudaKernel))
            nw = 1 if op == "MatMulAWQ" else 2
            tc = M >= matmulawq_cuda.TC_MIN_M and dtype == np.float16 and kern.tc is not None
            if M == 1 and dtype == np.float16:
                assert kern.m1 is not None
                splits = kern.m1[4]
            elif tc:
                splits = kern.tc_plans[M][2]
            elif nw == 1:
                splits = kern.plans[(matmulawq_cuda.bucket(M), 1)][2]
            else:
                splits = kern.plans[M][2]
            assert splits > 1, (op, M, dtype)
            counts = bridge.scratch_counts()
            ys = [sess.run(None, feeds)[0] for _ in range(4)]
            now = bridge.scratch_counts()
            nbytes = 4 * matmulawq_cuda.partial_floats(splits, nw, M, N)
            assert {k: now[k] - counts[k] for k in now} == {"taken": 4, "given_back": 4, "bytes": 4 * nbytes}
            assert kern.scratch.owned_partials() == 0
            if op == "MatMulAWQ":
                check_matmul(ys[0], a, qw, qz, sc, G, K, N)
            else:
                check_awq(ys[0], a, w1, w3, G, K, N, None, None)
            for y in ys[1:]:
                assert np.array_equal(y, ys[0])


if REAL_GPU and SIM:  # pragma: no cover
    raise RuntimeError("ONNX_LOWBIT_REAL_GPU=1 but the CUDA simulator is on")
