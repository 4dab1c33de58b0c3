"""MatMulNF4 / DequantNF4 kernels against onnx_lowbit.nf4: CPU through onnxruntime sessions, CUDA under the
simulator in CI (real GPU with ONNX_LOWBIT_REAL_GPU=1). fp32 accumulation vs the float64 reference: relative
error (max |err| / max |ref|) below 1e-5 for fp32 outputs, and within fp16 rounding (2^-10) for fp16 outputs. The
CUDA kernels run through runtime/direct.call (``call_op``), the kernel objects sessions make; their routing tables:
test_nf4_routes.py."""
import sys

import numpy as np
import onnxruntime as ort
import pytest
from numba import config
from onnx import TensorProto, helper, numpy_helper

import onnx_lowbit
from onnx_lowbit import domain, nf4
from onnx_lowbit.custom_ops.device.launch import SimLauncher

CASES = [  # M (leading dims), K, N, block size, quant type, dtype, bias
    ((1,), 64, 16, 32, "nf4", np.float32, True),
    ((1, 3), 688, 24, 64, "fp4", np.float16, False),   # K not a multiple of the block; blocks straddle rows
    ((2,), 128, 8, 64, "nf4", np.float16, True),
    ((17,), 64, 8, 32, "nf4", np.float32, False),      # M > 16: the prefill path
    ((0,), 64, 8, 64, "nf4", np.float32, True),        # empty batch
    ((1, 2), 96, 40, 32, "int4", np.float16, True),    # int4 (MatMulNBits' symmetric grid)
    ((1,), 64, 24, 64, "int4", np.float32, False),
]


def _quantized(k, n, bs, qt, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, am = nf4.quantize(w, qt, bs)
    return q, am


def _tol(dtype):
    return 1e-5 if dtype == np.float32 else 2.0 ** -10


def _rel(y, ref):
    ref = np.asarray(ref, np.float64)
    return np.abs(np.asarray(y, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-12) if ref.size else 0.0


def matmul_model(lead, k, n, bs, qt, dtype, bias, q, am, b=None):
    et = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    inits = [numpy_helper.from_array(q, "q"), numpy_helper.from_array(am, "am")]
    ins = ["a", "q", "am"]
    if bias:
        inits.append(numpy_helper.from_array(b, "b"))
        ins.append("b")
    node = helper.make_node("MatMulNF4", ins, ["y"], domain=domain.DOMAIN, name="mm", quant_type=qt, block_size=bs,
                            K=k, N=n)
    dims = [f"d{i}" for i in range(len(lead))]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", et, dims + [k])],
                          [helper.make_tensor_value_info("y", et, dims + [n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


@pytest.mark.parametrize("lead,k,n,bs,qt,dtype,bias", CASES)
def test_matmul_cpu_session(lead, k, n, bs, qt, dtype, bias):
    q, am = _quantized(k, n, bs, qt)
    rng = np.random.default_rng(1)
    a = rng.standard_normal(lead + (k,)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    sess = onnx_lowbit.InferenceSession(matmul_model(lead, k, n, bs, qt, dtype, bias, q, am, b),
                                        providers=["CPUExecutionProvider"])
    y = sess.run(None, {"a": a})[0]
    ref = nf4.matmul(a, q, am, qt, bs, k, n, b if bias else None)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert _rel(y, ref) <= _tol(dtype)


@pytest.mark.parametrize("transposed", [0, 1])
@pytest.mark.parametrize("adt", [np.float32, np.float16])
def test_dequant_cpu_session(transposed, adt):
    k, n, bs, qt = 688, 24, 64, "nf4"
    q, am = _quantized(k, n, bs, qt)
    am = am.astype(adt)
    et = TensorProto.FLOAT if adt == np.float32 else TensorProto.FLOAT16
    node = helper.make_node("DequantNF4", ["q", "am"], ["w"], domain=domain.DOMAIN, quant_type=qt, block_size=bs,
                            K=k, N=n, transposed=transposed)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("q", TensorProto.UINT8, [q.size]),
                                        helper.make_tensor_value_info("am", et, [am.size])],
                          [helper.make_tensor_value_info("w", et, [n, k] if transposed else [k, n])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)
    w = onnx_lowbit.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"q": q, "am": am})[0]
    ref = nf4.dequantize(q, am.astype(np.float32), qt, bs, k, n, np.float32).astype(adt)
    assert np.array_equal(w, ref.T if transposed else ref)


def test_bad_absmax_count_names_the_input():
    k, n, bs, qt = 64, 16, 32, "nf4"
    q, am = _quantized(k, n, bs, qt)
    sess = onnx_lowbit.InferenceSession(matmul_model((1,), k, n, bs, qt, np.float32, False, q, am[:-1]),
                                        providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="absmax"):
        sess.run(None, {"a": np.ones((1, k), np.float32)})


def test_bad_block_size_attribute():
    k, n, qt = 64, 16, "nf4"
    q, am = _quantized(k, n, 32, qt)
    m = matmul_model((1,), k, n, 48, qt, np.float32, False, q, am)
    with pytest.raises(Exception, match="block_size"):
        onnx_lowbit.InferenceSession(m, providers=["CPUExecutionProvider"])


def test_wrong_k_in_activation():
    k, n, bs, qt = 64, 16, 32, "nf4"
    q, am = _quantized(k, n, bs, qt)
    sess = onnx_lowbit.InferenceSession(matmul_model((1,), k, n, bs, qt, np.float32, False, q, am),
                                        providers=["CPUExecutionProvider"])
    with pytest.raises(Exception):
        sess.run(None, {"a": np.ones((1, k + 1), np.float32)})


# ---------------------------------------------------------------------------------------------------------------
SIM = bool(config.ENABLE_CUDASIM)


def _cuda_ok():
    if SIM:
        return True
    from numba import cuda
    return cuda.is_available()


needs_cuda = pytest.mark.skipif(not _cuda_ok(), reason="no GPU and the CUDA simulator is off")


class _HostArray:
    """A host array standing in for a device array under the simulator (host memory is the simulator's device
    memory): __cuda_array_interface__ over a 64-byte aligned copy, or ``offset`` bytes past such an address."""

    def __init__(self, a, offset=0):
        a = np.ascontiguousarray(a)
        self._buf = np.zeros(a.nbytes + 128, np.uint8)
        start = (-self._buf.ctypes.data) % 64 + offset
        self.host = self._buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
        self.host[...] = a
        self.__cuda_array_interface__ = {"data": (self.host.ctypes.data, False), "typestr": a.dtype.str,
                                         "shape": a.shape, "version": 3}


def call_op(op, attrs, inputs, out_shape, out_dtype, path=None, offsets=None):
    """``op`` run once through runtime/direct.call, the kernel object as a session node calls it (its ROUTES pick
    the kernel; ``path`` sets the kernel object's forced path, for the tables' forced rows): host arrays in (None:
    an optional input left out; ``offsets``: byte offsets of the inputs from 64-byte alignment, simulator only),
    host array out. Returns (output, the kernel object)."""
    from onnx_lowbit.custom_ops.runtime import direct
    offsets = offsets or [0] * len(inputs)
    if SIM:
        dev = [None if a is None else _HostArray(a, o) for a, o in zip(inputs, offsets)]
        out = _HostArray(np.zeros(out_shape, out_dtype))
    else:
        from numba import cuda
        dev = [None if a is None else cuda.to_device(np.ascontiguousarray(a)) for a in inputs]
        out = cuda.device_array(out_shape, out_dtype)
    while dev and dev[-1] is None:
        dev.pop()
    run = direct.call(op, attrs, dev, [out], 0)
    run.kernel.path = path
    run()
    if SIM:
        return out.host.copy(), run.kernel
    cuda.synchronize()
    return out.copy_to_host(), run.kernel


def matmul_cuda(a, q, am, qt, bs, k, n, bias=None, path=None):
    """MatMulNF4's CUDA kernel object on host arrays (call_op)."""
    attrs = {"quant_type": qt, "block_size": bs, "K": k, "N": n}
    y, kern = call_op("MatMulNF4", attrs, [a, q.reshape(-1), am.reshape(-1).astype(np.float32), bias],
                      a.shape[:-1] + (n,), a.dtype, path)
    return y, kern


def _routed(kern, m):
    """The kernel the kernel object's ROUTES pick for M = m with aligned buffers."""
    from onnx_lowbit.custom_ops.runtime.routing import route
    return route(sys.modules[type(kern).__module__].ROUTES, kern.case(m)).kernel


@needs_cuda
@pytest.mark.parametrize("lead,k,n,bs,qt,dtype,bias", CASES)
def test_matmul_cuda_kernel(lead, k, n, bs, qt, dtype, bias):
    """The routed kernel, and every kernel the table can be forced to (generic; fast where it fits)."""
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda as mc
    q, am = _quantized(k, n, bs, qt)
    rng = np.random.default_rng(2)
    a = rng.standard_normal(lead + (k,)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    ref = nf4.matmul(a, q, am, qt, bs, k, n, b if bias else None)
    m = int(np.prod(lead))
    fits = m <= mc.MAX_M_FAST and k % 16 == 0 and m * k * 4 <= mc.MAX_X_SHARED
    for path in [None, "generic"] + (["fast"] if fits else []):
        y, _ = matmul_cuda(a, q, am, qt, bs, k, n, b if bias else None, path)
        assert y.shape == ref.shape and _rel(y, ref) <= _tol(dtype), path


@needs_cuda
@pytest.mark.parametrize("k,n,bs,qt,dtype,bias", [(96, 45, 32, "nf4", np.float16, True),    # partial warp, tails
                                                  (512, 37, 64, "fp4", np.float32, False),   # full warp
                                                  (96, 45, 32, "int4", np.float16, False)])
@pytest.mark.parametrize("table", ["table16", "pair", "h2", "h2wide"])
def test_matmul_cuda_m1_kernel(k, n, bs, qt, dtype, bias, table, monkeypatch):
    """Each M = 1 kernel (the thresholds lowered so that a small weight takes it) on column slices of several steps
    with a partial last one; the packed-fp16 ones for fp16 A only (fp32 A takes the pair table there)."""
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda as mc
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    monkeypatch.setattr(mc, "U4", False)        # int4 weights through the tables too (the int4 decode: below)
    if table != "table16":
        monkeypatch.setattr(mc, "M1_PAIR_MIN_K", 16)
    if table in ("h2", "h2wide"):
        monkeypatch.setattr(mc, "M1_H2_MIN_K", 16)
    if table == "h2wide":
        monkeypatch.setattr(mc, "M1_WIDE_MIN_K", 32)
    q, am = _quantized(k, n, bs, qt, seed=4)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((1, k)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    y, kern = matmul_cuda(a, q, am, qt, bs, k, n, b if bias else None)
    want = table if dtype == np.float16 or table == "table16" else "pair"
    assert _routed(kern, 1) == "m1." + want
    assert _rel(y, nf4.matmul(a, q, am, qt, bs, k, n, b if bias else None)) <= _tol(dtype), table


@needs_cuda
@pytest.mark.parametrize("k,n,bias,want", [(96, 45, True, "m1.u4wide"), (80, 45, False, "m1.u4"),
                                           (1024, 9, True, "m1.u4wide")])
def test_matmul_cuda_m1_int4_kernel(k, n, bias, want, monkeypatch):
    """quant_type int4 with fp16 A at M = 1 takes the table-free decode by default (wide where K % 32 == 0): against
    the reference on column slices with a partial last step; a NaN in A makes every output NaN, an Inf non-finite;
    ONNX_LOWBIT_FP32_DECODE=1 leaves it for the fp32 decode."""
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    bs = 32
    q, am = _quantized(k, n, bs, "int4", seed=30 + k)
    rng = np.random.default_rng(31)
    a = (rng.standard_normal((1, k)) * 3).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    y, kern = matmul_cuda(a, q, am, "int4", bs, k, n, b)
    assert _routed(kern, 1) == want
    assert _rel(y, nf4.matmul(a, q, am, "int4", bs, k, n, b)) <= _tol(np.float16)
    a[0, 5] = np.nan
    y, _ = matmul_cuda(a, q, am, "int4", bs, k, n, b)
    assert np.isnan(y).all()
    a[0, 5] = np.inf
    y, _ = matmul_cuda(a, q, am, "int4", bs, k, n, b)
    assert not np.isfinite(y[0, q.reshape(n, -1)[:, 2] >> 4 != 8]).any()
    monkeypatch.setenv("ONNX_LOWBIT_FP32_DECODE", "1")
    _, kern = matmul_cuda(a[:, :], q, am, "int4", bs, k, n, b)
    assert not _routed(kern, 1).startswith("m1.u4")


@pytest.mark.skipif(not _cuda_ok(), reason="no GPU and the CUDA simulator is off")
@pytest.mark.parametrize("transposed", [False, True])
def test_dequant_cuda_kernel(transposed):
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cuda
    for k, n, bs, qt in [(688, 8, 64, "fp4"), (64, 16, 32, "nf4"), (33, 3, 32, "nf4"), (64, 8, 32, "int4")]:
        q, am = _quantized(k, n, bs, qt)
        w = dequantnf4_cuda.run_arrays(q, am, nf4.code(qt).astype(np.float32), k, n, bs, transposed)
        ref = nf4.dequantize(q, am, qt, bs, k, n, np.float32)
        assert np.array_equal(w, ref.T if transposed else ref)


@pytest.mark.skipif(SIM or "CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu and a GPU")
@pytest.mark.parametrize("lead,k,n,bs,qt,dtype,bias", CASES)
def test_matmul_cuda_session(lead, k, n, bs, qt, dtype, bias):
    q, am = _quantized(k, n, bs, qt)
    rng = np.random.default_rng(3)
    a = rng.standard_normal(lead + (k,)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    sess = onnx_lowbit.InferenceSession(matmul_model(lead, k, n, bs, qt, dtype, bias, q, am, b),
                                        providers=["CUDAExecutionProvider"])
    y = sess.run(None, {"a": a})[0]
    assert _rel(y, nf4.matmul(a, q, am, qt, bs, k, n, b if bias else None)) <= _tol(dtype)


def _dequant_variants():
    """Every option of the transposed=1 kernel at least once (dequantnf4_cuda.Variant), with a small block and grids
    of 1 block per SM (grid-stride over several tiles) or one block per tile (bps=0). ``sms`` = 1 below."""
    from onnx_lowbit.custom_ops.nf4.dequantnf4_cuda import LEGACY, Variant as V
    return [LEGACY, V(4, 2, 32, 1, "v4"), V(4, 1, 32, 0, "scalar"), V(8, 2, 32, 1, "v4cs"), V(8, 4, 64, 0, "scalar"),
            V(16, 1, 32, 1, "v4"), V(16, 2, 32, 0, "v4cs", h2=True), V(32, 1, 32, 1, "v4", "nc"),
            V(32, 2, 32, 0, "v4cs", "nc_na", h2=True), V(32, 1, 64, 1, "scalar", "ld")]


@pytest.mark.skipif(not _cuda_ok(), reason="no GPU and the CUDA simulator is off")
@pytest.mark.parametrize("adt", [np.float32, np.float16])
@pytest.mark.parametrize("vi", range(10))
def test_dequant_cuda_variants(vi, adt):
    """Each kernel variant bit-exact with the CPU face (fp32 and fp16 output): element counts that are odd (the
    last byte's low nibble unused), not multiples of a step (a tail of 1..epv-1 elements), a partial last block,
    K not a multiple of the block (blocks straddle rows of W^T), fewer elements than one step."""
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cpu, dequantnf4_cuda
    v = _dequant_variants()[vi]
    for k, n, bs, qt in [(33, 3, 32, "nf4"), (100, 7, 32, "fp4"), (96, 5, 64, "nf4"), (1, 5, 32, "nf4")]:
        q, am = _quantized(k, n, bs, qt, seed=vi)
        am = am.astype(adt)
        code = nf4.code(qt).astype(np.float32)
        w = dequantnf4_cuda.run_arrays(q, am, code, k, n, bs, True, variant=v, sms=1)
        ref = dequantnf4_cpu.dequantize(q, am, code, k, n, bs, True)
        assert w.dtype == ref.dtype and w.shape == (n, k)
        assert np.array_equal(w.view(np.uint8), ref.view(np.uint8)), (v, k, n)


def test_dequant_variant_launch_arguments():
    """rows_args / geometry: the views a variant's kernel gets stay inside the input and output buffers, and the
    alignment a variant asks of them matches its loads and stores."""
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cuda as dq
    for v in _dequant_variants():
        for total in (1, 99, 700, 4096 * 11008):
            for f16 in (False, True):
                args = dq.rows_args(v, f16, 0, (total + 1) // 2, 0, 1, 0, 0, total, 64)
                if v.epv == 2:
                    continue
                qbytes = args[0][1][0] * (4 if v.epv == 32 else np.dtype(dq._QTYPE[v.epv]).itemsize)
                assert qbytes <= (total + 1) // 2 and args[1][1][0] == (total + 1) // 2
                assert args[4][1][0] * 4 <= total * (2 if f16 else 4) and args[5][1][0] == total
                grid, block = dq.geometry(v, total, 132)
                assert grid >= 1 and block == v.block and (v.bps == 0 or grid <= v.bps * 132)
        assert v.q_align() == max(1, v.epv // 2) and v.out_align() in (1, 4, 16)
    assert dq.DEFAULT["float32"].epv in (2, 4, 8, 16, 32) and dq.DEFAULT["float16"].epv in (2, 4, 8, 16, 32)


class _SimLauncher(SimLauncher):
    """cuda_launch.SimLauncher (strict about empty arrays) that also notes which dequant variant each launch used and
    answers 2 resident blocks per SM."""

    def __init__(self, fn, sig, variant):
        super().__init__(fn, sig, empty=0)
        self.variant, self.used = variant, []

    def blocks_per_sm(self, block, shmem=None):
        return 2

    def launch(self, grid, block, stream, *args, shmem=None):
        self.used.append(self.variant)
        super().launch(grid, block, stream, *args, shmem=shmem)


def _aligned(nbytes, offset):
    """A host buffer and the address ``offset`` bytes past a 256-byte boundary in it."""
    b = np.zeros(nbytes + 512, np.uint8)
    return b, (b.ctypes.data + 255) // 256 * 256 + offset


@pytest.mark.skipif(not SIM, reason="stand-in launches over host memory: simulator only")
@pytest.mark.parametrize("adt", [np.float32, np.float16])
def test_dequant_kernel_object_default_and_fallback(monkeypatch, adt):
    """DequantNF4CudaKernel.compute as a session calls it, with a vector variant as DEFAULT: the variant for an
    aligned packed input, LEGACY for one that is not (bit-exact both ways), and a clear error for an output not
    aligned to the variant's 16-byte stores."""
    import ctypes
    from types import SimpleNamespace

    from onnx_lowbit.custom_ops.device import launch as cuda_launch
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cpu
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cuda as dq
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    from onnx_lowbit.custom_ops.device.launch import Array
    vec = dq.Variant(8, 2, 32, 1, "v4") if adt == np.float32 else dq.Variant(16, 1, 32, 0, "v4cs", h2=True)
    launchers = []

    def fake_launcher(transposed, dtype, variant=None):
        v = variant or dq.LEGACY
        f16 = np.dtype(dtype) == np.float16
        if v.epv == 2:
            fn, sig = dq.dequant_rows, [Array(np.uint64), Array(np.uint8), Array(dtype), Array(np.float32),
                                        Array(dtype), "int64", "int64", "int64"]
        else:
            ow, oe = (np.uint32, np.uint16) if f16 else (np.float32, np.float32)
            fn, sig = dq._make_vec(*v.kernel_key(f16)), [Array(dq._QTYPE[v.epv]), Array(np.uint8), Array(dtype),
                                                        Array(np.float32), Array(ow), Array(oe), "int64", "int64"]
        launchers.append(_SimLauncher(fn, sig, v))
        return launchers[-1]

    monkeypatch.setattr(cuda_launch, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_launch, "sm_count", lambda device: 1)
    monkeypatch.setattr(dq, "_launcher", fake_launcher)
    monkeypatch.setattr(dq, "DEFAULT", {np.dtype(adt).name: vec})
    monkeypatch.setattr(dq.cuda, "to_device", lambda a: SimpleNamespace(keep=a, device_ctypes_pointer=SimpleNamespace(
        value=a.ctypes.data)))
    k, n, bs, qt = 100, 7, 32, "nf4"
    q, am = _quantized(k, n, bs, qt, seed=3)
    am = am.astype(adt)
    tid = 1 if adt == np.float32 else 10
    kern = dq.DequantNF4CudaKernel(spec=domain.OPS["DequantNF4"], node_name="t", in_types=(2, tid), out_types=(tid,),
                                   attrs={"quant_type": qt, "block_size": bs, "K": k, "N": n, "transposed": 1})
    assert kern.variant == vec
    ref = dequantnf4_cpu.dequantize(q, am, nf4.code(qt).astype(np.float32), k, n, bs, True)
    for q_off, out_off, want in [(0, 0, vec), (1, 0, dq.LEGACY), (0, 4, None)]:
        qb, qp = _aligned(q.nbytes, q_off)
        np.frombuffer((ctypes.c_char * q.nbytes).from_address(qp), np.uint8)[:] = q
        ob, op = _aligned(ref.nbytes, out_off)
        ctx = SimpleNamespace(stream=0, output=lambda index, shape, op=op: op)
        inputs = [Tensor(qp, 2, q.shape), Tensor(am.ctypes.data, tid, am.shape)]
        if want is None:
            with pytest.raises(KernelError, match="aligned to 16 bytes"):
                kern.compute(ctx, inputs)
            continue
        kern.compute(ctx, inputs)
        assert launchers[-1].used[-1] == want
        got = np.frombuffer((ctypes.c_char * ref.nbytes).from_address(op), ref.dtype)
        assert np.array_equal(got.view(np.uint8), ref.reshape(-1).view(np.uint8)), want


@needs_cuda
def test_matmul_cuda_fp32_decode_switch(monkeypatch):
    """ONNX_LOWBIT_FP32_DECODE=1, read when the kernel object is made, keeps fp32 arithmetic at M = 1 (the pair
    table where the packed-fp16 decode would run): another kernel, outputs within fp16 of the reference and not the
    packed decode's bits."""
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda as mc
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    for name in ("M1_H2_MIN_K", "M1_WIDE_MIN_K", "M1_PAIR_MIN_K"):
        monkeypatch.setattr(mc, name, 64)
    k, n, bs = 128, 24, 64
    q, am = _quantized(k, n, bs, "nf4", seed=6)
    a = np.random.default_rng(6).standard_normal((1, k)).astype(np.float16)
    b = np.random.default_rng(7).standard_normal(n).astype(np.float16)
    ref = nf4.matmul(a, q, am, "nf4", bs, k, n, b)
    y, kern = matmul_cuda(a, q, am, "nf4", bs, k, n, b)
    assert _routed(kern, 1) == "m1.h2wide" and _rel(y, ref) <= _tol(np.float16)
    monkeypatch.setenv("ONNX_LOWBIT_FP32_DECODE", "1")
    exact, kern = matmul_cuda(a, q, am, "nf4", bs, k, n, b)
    assert kern.fp32_decode and _routed(kern, 1) == "m1.pair"
    assert _rel(exact, ref) <= _tol(np.float16) and not np.array_equal(exact, y)


@pytest.mark.parametrize("m1_h2_min_k,wide_min_k,m", [(64, 1 << 20, 1), (64, 64, 1), (1 << 20, 1 << 20, 1),
                                                     (64, 64, 2), (64, 64, 4)])
def test_matmul_cuda_session_m1_h2(m1_h2_min_k, wide_min_k, m, monkeypatch):
    """A MatMulNF4 node in an onnxruntime CUDA session with fp16 A (GPU machine only): at M = 1 with the packed-fp16
    decode (M1_H2_MIN_K lowered), with its 16-byte wide form (M1_WIDE_MIN_K lowered) and without; at M = 2 and 4 on
    the two-row decode kernel (M = 4 as two row chunks): outputs against the reference, the same bits twice."""
    from helpers import lowbit_session, ort_cuda_or_skip
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda as mc
    monkeypatch.setattr(mc, "M1_H2_MIN_K", m1_h2_min_k)
    monkeypatch.setattr(mc, "M1_WIDE_MIN_K", wide_min_k)
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    k, n, bs = 256, 40, 64
    q, am = _quantized(k, n, bs, "nf4", seed=8)
    a = np.random.default_rng(8).standard_normal((1, m, k)).astype(np.float16)
    sess = lowbit_session(matmul_model((1, m), k, n, bs, "nf4", np.float16, False, q, am), ["CUDAExecutionProvider"])
    y1 = sess.run(None, {"a": a})[0]
    y2 = sess.run(None, {"a": a})[0]
    assert np.array_equal(y1.view(np.uint16), y2.view(np.uint16))
    assert _rel(y1, nf4.matmul(a, q, am, "nf4", bs, k, n, None)) <= _tol(np.float16)


@needs_cuda
@pytest.mark.parametrize("m,n", [(2, 40), (2, 7), (4, 24)])
def test_matmul_cuda_m2_decode(m, n, monkeypatch):
    """The two-row decode kernel (wide, chains of 4; M = 4 as two row chunks), the wide thresholds lowered: every row
    the same bits as the M = 1 wide kernel on that row alone, against the reference, a NaN row stays NaN and the
    others finite."""
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda as mc
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    monkeypatch.setattr(mc, "M1_WIDE_MIN_K", 64)
    monkeypatch.setattr(mc, "M1_H2_MIN_K", 64)
    k, bs = 256, 64
    q, am = _quantized(k, n, bs, "nf4", seed=20 + m)
    rng = np.random.default_rng(m)
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16)
    y, kern = matmul_cuda(a, q, am, "nf4", bs, k, n, b)
    assert _routed(kern, m) == "m2" and _routed(kern, 1) == "m1.h2wide"
    assert _rel(y, nf4.matmul(a, q, am, "nf4", bs, k, n, b)) <= _tol(np.float16)
    for i in range(m):
        row, _ = matmul_cuda(a[i:i + 1], q, am, "nf4", bs, k, n, b)
        assert np.array_equal(y[i].view(np.uint16), row[0].view(np.uint16)), i
    a[1, 3] = np.nan
    y, _ = matmul_cuda(a, q, am, "nf4", bs, k, n, b)
    assert np.isnan(y[1]).all() and np.isfinite(np.delete(y, 1, axis=0)).all()


@needs_cuda
@pytest.mark.parametrize("m", [1, 3])
def test_matmul_cuda_nan_inf_rows(m):
    """NaN / Inf in a row of A make that row's outputs non-finite on every kernel that takes the call (the routed
    one, generic, fast); a NaN absmax makes its column NaN."""
    k, n, bs = 64, 8, 32
    q, am = _quantized(k, n, bs, "nf4", seed=1)
    a = np.random.default_rng(2).standard_normal((m, k)).astype(np.float16)
    if m == 3:
        a[1, 3], a[2, 5] = np.nan, np.inf
    ref = nf4.matmul(a[:1], q, am, "nf4", bs, k, n).astype(np.float64)
    for path in (None, "generic", "fast"):
        y, _ = matmul_cuda(a, q, am, "nf4", bs, k, n, path=path)
        assert np.allclose(y[0].astype(np.float64), ref[0], rtol=2e-3, atol=2e-3), path
        if m == 3:
            assert np.isnan(y[1]).all() and not np.isfinite(y[2]).any(), path
    am2 = am.copy()
    am2.reshape(-1)[0] = np.nan  # block 0: the first 32 elements of W^T, i.e. column 0
    y, _ = matmul_cuda(np.ones((1, k), np.float32), q, am2, "nf4", bs, k, n, path="generic")
    assert np.isnan(y[0, 0]) and np.isfinite(y[0, 1:]).all()
