"""FusedFFN, CUDA face, continued: launch geometry and the cuBLAS path's own kernels (simulator and GPU), then what
needs a real GPU (ONNX_LOWBIT_REAL_GPU=1): the cuBLAS path, LLaMA-size shapes, alignment fallbacks, one-node
onnxruntime CUDA sessions. Helpers and the tolerance: test_ffn_cuda.py."""
import numpy as np
import pytest
from test_ffn_cuda import SIM, _cuda, bounds, check, data, run_op, served, tf32_gemm

from onnx_lowbit import ffn
from onnx_lowbit.custom_ops import KernelError
from onnx_lowbit.custom_ops.ffn import fusedffn_decode_cuda as dec, fusedffn_prefill_cuda as pre

F16, F32 = np.float16, np.float32


def test_plans():
    assert [dec.bucket(m) for m in (1, 2, 3)] == [1, 2, None]
    # LLaMA gate/up decode: x of one row is 16 KiB of fp32 in shared memory
    assert dec.fits(1, 4096, True) and dec.fits(2, 4096, True) and not dec.fits(3, 64, True)
    assert not dec.fits(1, 4100, True) and dec.fits(1, 4100, False) and not dec.fits(1, 4096, True, False)
    assert dec.fits(2, 12800, True) and not dec.fits(2, 12808, True)     # 100 KiB of x
    # 11008 rows, 2 per group, 132 SMs x 4 blocks: 5504 groups in ceil(5504 / 528) = 11 steps -> 501 blocks
    assert dec.grid(11008, 1, 132, 4) == 501 and dec.grid(1, 1, 132, 4) == 1
    for n, mt, sms, occ in [(11008, 1, 132, 4), (4096, 2, 132, 3), (9, 1, 2, 1), (100000, 2, 132, 2)]:
        grid = dec.grid(n, mt, sms, occ)
        groups = -(-n // dec.COLS)
        steps = -(-groups // grid)
        assert grid <= sms * occ and (grid - 1) * steps < groups <= grid * steps    # balanced, none idle
    # prefill: one chunk while the scratch fits SCRATCH_MAX, else M split evenly into as few chunks as fit
    rows, conv, *_, (_, _, nbytes) = pre.prefill_plan(1000, 4096, 11008, x16=False, w16=True)
    assert (rows, conv) == (500, "split") and nbytes <= pre.SCRATCH_MAX     # 192 KiB per row: 2 chunks
    assert pre.prefill_plan(1024, 4096, 11008, x16=True, w16=True)[:2] == (1024, None)     # 90 MB: one chunk
    assert pre.prefill_plan(1000, 64, 64, x16=True, w16=False)[:2] == (1000, "widen")
    assert pre.prefill_plan(20, 64, 64, x16=True, w16=True)[:2] == (20, None)
    for m, k, n, x16, w16, g16 in [(5000, 4096, 11008, True, True, False), (777, 512, 3000, False, True, False),
                                   (3, 100, 5, False, False, False), (4096, 4096, 14336, True, True, True)]:
        rows, conv, *_, (xoff, soff, nbytes) = pre.prefill_plan(m, k, n, x16, w16, g16, scratch_max=1 << 22)
        chunks = -(-m // rows)
        assert rows * chunks >= m > rows * (chunks - 1) and (nbytes <= (1 << 22) + 512 or rows == 1)
        assert xoff >= (2 if conv == "split" else 1) * rows * 2 * n * (2 if g16 else 4) and soff >= xoff


@pytest.mark.parametrize("xd,wd,g16", [(F32, F16, False), (F16, F32, False), (F16, F16, False), (F16, F16, True),
                                       (F32, F32, False)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_prefill_convert_and_activation_kernels(xd, wd, g16):
    """The cuBLAS path's own kernels (x widening / row-scaled hi-lo split, SiLU * mul over the GEMM scratch) with
    the two GEMMs emulated in numpy on exactly what cuBLAS would get (simulator and GPU). The split must keep
    fp32 accuracy for rows far outside fp16's range and let inf/NaN through."""
    _cuda()
    from numba import cuda
    x, w1, w3, b1, b3 = data((6,), 40, 12, xd, wd, True, True, seed=11)
    if xd == F32:
        x[1] *= 1e6                   # |x| >> 65504
        x[2] *= 1e-30                 # tiny row
        x[3, 7] = np.inf
        x[4, :] = 0.0
    m, k, n = 6, 40, 12
    rows, conv, _, _, _ = pre.prefill_plan(m, k, n, xd == F16, wd == F16)
    splits = 2 if conv == "split" else 1
    blk = 32 if SIM else pre.ACT_BLOCK
    inv = np.ones(rows, np.float32)
    if conv == "split":
        dxo = cuda.device_array(2 * m * k, np.uint16)
        dinv = cuda.to_device(inv)
        pre.make_split(blk)[m, blk](cuda.to_device(x.reshape(-1).view(np.uint32)), dxo, dinv, m, k)
        xg, inv = dxo.copy_to_host().view(F16).reshape(2 * m, k), dinv.copy_to_host()
        big = np.abs(x[[0, 1, 2, 5]]).max(axis=1) / inv[[0, 1, 2, 5]]     # each row's largest value, scaled
        assert np.all((big >= 2.0 ** 14) & (big < 2.0 ** 15)) and inv[4] == 1.0
    elif conv == "widen":
        dxo = cuda.device_array(m * k, np.float32)
        pre.make_widen()[-(-m * k // blk), blk](cuda.to_device(x.reshape(-1).view(np.uint16)), dxo, m * k)
        xg = dxo.copy_to_host().reshape(m, k)
        assert np.array_equal(xg, x.astype(np.float32))
    else:
        xg = x
    with np.errstate(invalid="ignore", over="ignore"):
        g = np.concatenate([xg.astype(np.float64) @ w1.astype(np.float64).T,
                            xg.astype(np.float64) @ w3.astype(np.float64).T], axis=1).astype(np.float32)
    xb = np.uint16 if xd == F16 else np.float32
    dy = cuda.device_array(m * n, xb)
    if g16:                             # fp16 GEMM outputs (route gemm_f16out)
        g = g.astype(F16).view(np.uint16)
    pre.make_act(xd == F16, g16)[pre.act_grid(m, n, blk), blk](
        cuda.to_device(g.reshape(-1)), cuda.to_device(inv), cuda.to_device(b1.view(xb)), cuda.to_device(b3.view(xb)),
        dy, m, n, splits, 1, 1)
    y = dy.copy_to_host().view(xd).reshape(m, n)
    if xd == F32:
        fin = np.isfinite(x).all(axis=1)
        check(y[fin], x[fin], w1, w3, b1, b3, g16)
        ref = ffn.swiglu_ref(x[3:4], w1, w3, b1, b3)
        assert np.array_equal(np.isnan(y[3]), np.isnan(ref[0])) and np.array_equal(np.isinf(y[3]), np.isinf(ref[0]))
    else:
        check(y, x, w1, w3, b1, b3, g16)


# ------------------------------------------------------------------------------------------ real GPU only
GPU_CASES = [
    ((1,), 4096, 512, F16, F16, True, True),
    ((3,), 4096, 300, F32, F16, False, True),
    ((4,), 2048, 130, F32, F32, True, False),
    ((1, 2), 1024, 77, F16, F32, False, False),
    ((16,), 1024, 256, F16, F16, True, True),
    ((8,), 512, 100, F32, F16, True, True),
]


def _cublas_paths():
    from onnx_lowbit.custom_ops.device import cublas
    return ("gemm",) if cublas.load() is not None else ()


@pytest.mark.skipif(SIM, reason="real GPU only (kernels at full size)")
@pytest.mark.parametrize("lead,K,N,xd,wd,hb1,hb3", GPU_CASES)
def test_gpu_large(lead, K, N, xd, wd, hb1, hb3):  # noqa: N803
    _cuda()
    x, w1, w3, b1, b3 = data(lead, K, N, xd, wd, hb1, hb3, seed=5)
    m = int(np.prod(lead))
    for path in (None, "tiled") + _cublas_paths():
        check(run_op(x, w1, w3, b1, b3, path=path), x, w1, w3, b1, b3, **bounds(xd, wd, m, K, N, path=path))


def _kernel(x16, w16, kn=False):
    fc = _cuda()
    return fc.FusedFFNCudaKernel(spec=None, attrs={"weights_kn": 1} if kn else {}, node_name="t",
                                 in_types=(10 if x16 else 1, 10 if w16 else 1), out_types=(10 if x16 else 1,))


@pytest.mark.skipif(SIM, reason="real GPU only")
def test_gpu_unaligned_weights_leave_the_decode_kernel():
    """Weights not 16-byte aligned (a view at +2 bytes): the decode kernel is not used, results stay right."""
    from numba import cuda
    x, w1, w3, b1, _ = data((2,), 256, 40, F16, F16, True)
    k, n = 256, 40
    buf1 = cuda.to_device(np.concatenate([np.zeros(1, F16), w1.reshape(-1)]).view(np.uint16))
    buf3 = cuda.to_device(np.concatenate([np.zeros(1, F16), w3.reshape(-1)]).view(np.uint16))
    dx, db1 = cuda.to_device(x.view(np.uint16)), cuda.to_device(b1.view(np.uint16))
    dy = cuda.device_array(2 * n, np.uint16)
    kern = _kernel(True, True)
    p = lambda a: a.device_ctypes_pointer.value  # noqa: E731
    with pytest.raises(KernelError, match="unaligned"):
        kern.run(0, 2, k, n, p(dx), p(buf1) + 2, p(buf3) + 2, p(db1), 0, p(dy), path="decode")
    kern.run(0, 2, k, n, p(dx), p(buf1) + 2, p(buf3) + 2, p(db1), 0, p(dy))
    cuda.synchronize()
    check(dy.copy_to_host().view(F16).reshape(2, n), x, w1, w3, b1)


@pytest.mark.skipif(SIM, reason="cuBLAS prefill path: real GPU only")
@pytest.mark.parametrize("m", [17, 64, 700])
@pytest.mark.parametrize("xd,wd", [(F16, F16), (F32, F32), (F32, F16), (F16, F32)])
def test_gpu_prefill(m, xd, wd, monkeypatch):
    """The cuBLAS path for every type pair; fp32-input GEMMs (fp32 W) in TF32 by default and strict fp32 with
    TF32 off (ONNX_LOWBIT_TF32=0, read at kernel creation), each within its own error bound."""
    fc = _cuda()
    if not _cublas_paths():
        pytest.skip("no cuBLAS library found")
    x, w1, w3, b1, b3 = data((m,), 520, 200, xd, wd, True, m != 64, seed=m)
    tf32 = served(xd, wd, m, 520, 200, path="gemm") == "gemm_tf32"
    assert tf32 == tf32_gemm("gemm", wd)
    check(run_op(x, w1, w3, b1, b3, path="gemm"), x, w1, w3, b1, b3, tf32=tf32)
    check(run_op(x, w1, w3, b1, b3), x, w1, w3, b1, b3, **bounds(xd, wd, m, 520, 200))
    monkeypatch.setattr(fc, "TF32", False)
    assert served(xd, wd, m, 520, 200, path="gemm") == "gemm"
    check(run_op(x, w1, w3, b1, b3, path="gemm"), x, w1, w3, b1, b3)
    if tf32 and xd == F32:  # the default really is TF32: strict fp32 is far more accurate (fp32 outputs)
        ref = ffn.swiglu_ref(x, w1, w3, b1, b3)
        e_strict = np.abs(run_op(x, w1, w3, b1, b3, path="gemm") - ref).max()
        monkeypatch.setattr(fc, "TF32", True)
        assert np.abs(run_op(x, w1, w3, b1, b3, path="gemm") - ref).max() > 4 * e_strict


@pytest.mark.skipif(SIM, reason="cuBLAS prefill path: real GPU only")
def test_gpu_prefill_takes_its_scratch_from_the_provider():
    """The cuBLAS path asks its scratch provider (onnxruntime's, through Context.scratch, in a session) once per
    call for exactly prefill_plan's bytes and keeps no buffer of its own; without a provider (onnxruntime < 1.18)
    prefill shapes run the tiled kernel."""
    from numba import cuda
    if not _cublas_paths():
        pytest.skip("no cuBLAS library found")
    m, k, n = 40, 520, 200
    assert served(F16, F16, m, k, n) == "gemm" and served(F16, F16, m, k, n, scratch=False) == "tiled"
    x, w1, w3, b1, b3 = data((m,), k, n, F16, F16, True, True, seed=9)
    dx, d1, d3, db1, db3 = (cuda.to_device(a.reshape(-1).view(np.uint16)) for a in (x, w1, w3, b1, b3))
    p = lambda a: a.device_ctypes_pointer.value  # noqa: E731
    kern = _kernel(True, True)
    asked, bufs = [], []

    def scratch(nbytes):
        asked.append(nbytes)
        bufs.append(cuda.device_array(nbytes, np.uint8))
        return p(bufs[-1])

    for provider in (scratch, False):
        dy = cuda.device_array(m * n, np.uint16)
        kern.run(0, m, k, n, p(dx), p(d1), p(d3), p(db1), p(db3), p(dy), scratch=provider)
        cuda.synchronize()
        check(dy.copy_to_host().view(F16).reshape(m, n), x, w1, w3, b1, b3)
    assert asked == [pre.prefill_plan(m, k, n, True, True)[4][2]] and kern._direct is None
    with pytest.raises(KernelError, match="scratch memory"):
        kern.run(0, m, k, n, p(dx), p(d1), p(d3), p(db1), p(db3), p(dy), path="gemm", scratch=False)


@pytest.mark.skipif(SIM, reason="real GPU only")
@pytest.mark.parametrize("lead,K,N,xd,wd", [((1,), 4096, 11008, F16, F16), ((2,), 4096, 512, F16, F16),
                                            ((1,), 3000, 776, F32, F16), ((2,), 1024, 300, F32, F32),
                                            ((1, 2), 9000, 264, F16, F32), ((1,), 520, 8, F16, F16)])
def test_gpu_kn(lead, K, N, xd, wd):  # noqa: N803
    """K-major weights on the GPU, every path (decode: several splits, the tile counters left at zero; cuBLAS with
    fp16 GEMM outputs for fp16 X and W, fp32 ones otherwise)."""
    _cuda()
    x, w1, w3, b1, b3 = data(lead, K, N, xd, wd, True, N != 512, seed=6)
    w1k, w3k = np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T)
    m = int(np.prod(lead))
    for path in (None, "decode", "tiled") + _cublas_paths():
        for _ in range(2):      # the second call finds the tile counters the first left
            y = run_op(x, w1k, w3k, b1, b3, path=path, kn=True)
        check(y, x, w1, w3, b1, b3, **bounds(xd, wd, m, K, N, kn=True, path=path))
    for m in (3, 40):
        x, _, _, _, _ = data((m,), K, N, xd, wd, seed=m)
        check(run_op(x, w1k, w3k, b1, b3, kn=True), x, w1, w3, b1, b3, **bounds(xd, wd, m, K, N, kn=True))


@pytest.mark.skipif(SIM, reason="real GPU only")
@pytest.mark.parametrize("m", [2, 5, 8, 9, 12, 16, 17, 33])
def test_gpu_kn_tc(m):
    """The K-major tensor-core kernel on the GPU at both configurations it has (8- and 16-row tiles; forced past
    the routed M: several row tiles), with NaN in X and in a weight column."""
    _cuda()
    k, n = 1032, 520                       # K: a partial last 16-row step; N: a partial 64-feature tile
    x, w1, w3, b1, b3 = data((m,), k, n, F16, F16, True, True, seed=40 + m)
    w1k, w3k = np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T)
    check(run_op(x, w1k, w3k, b1, b3, path="tc", kn=True), x, w1, w3, b1, b3)
    x[m - 1, 3] = np.nan
    w3[n - 2, 7] = np.nan
    with np.errstate(invalid="ignore"):
        y = run_op(x, w1k, np.ascontiguousarray(w3.T), b1, b3, path="tc", kn=True)
    assert np.isnan(y[m - 1]).all() and np.isnan(y[:, n - 2]).all()
    assert np.isfinite(np.delete(np.delete(y, m - 1, 0), n - 2, 1)).all()


def _ort_cuda():
    try:
        import onnxruntime as ort
    except ImportError:
        pytest.skip("onnxruntime not installed")
    if SIM or "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here (or the simulator is on)")
    return ort


def ffn_model(xd, wd, k, n, b1=False, b3=False, kn=False):
    from onnx import TensorProto, helper

    from onnx_lowbit import domain
    et = {np.dtype(F32): TensorProto.FLOAT, np.dtype(F16): TensorProto.FLOAT16}
    ins = [helper.make_tensor_value_info("X", et[np.dtype(xd)], ["B", "T", k]),
           helper.make_tensor_value_info("W1", et[np.dtype(wd)], [k, n] if kn else [n, k]),
           helper.make_tensor_value_info("W3", et[np.dtype(wd)], [k, n] if kn else [n, k])]
    names = ["X", "W1", "W3"]
    for on, nm in ((b1, "B1"), (b3, "B3")):
        if on:
            ins.append(helper.make_tensor_value_info(nm, et[np.dtype(xd)], [n]))
            names.append(nm)
        elif nm == "B1" and b3:
            names.append("")
    node = helper.make_node("FusedFFN", names, ["S"], domain=domain.DOMAIN, name="ffn0",
                            **({"weights_kn": 1} if kn else {}))
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("S", et[np.dtype(xd)], ["B", "T", n])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


@pytest.mark.parametrize("xd,wd", [(F16, F16), (F32, F32), (F32, F16), (F16, F32)])
def test_ort_cuda_session(xd, wd):
    """One FusedFFN node in an onnxruntime CUDA session: decode (M = 1, 3) and prefill (M = 40) shapes."""
    ort = _ort_cuda()
    import onnx_lowbit
    so = ort.SessionOptions()
    onnx_lowbit.register(so)
    k, n = 256, 96
    sess = ort.InferenceSession(ffn_model(xd, wd, k, n, False, True).SerializeToString(), so,
                                providers=["CUDAExecutionProvider"])
    for lead in [(1, 1), (1, 3), (2, 20), (0, 2)]:
        x, w1, w3, _, b3 = data(lead, k, n, xd, wd, False, True, seed=sum(lead))
        y = sess.run(None, {"X": x, "W1": w1, "W3": w3, "B3": b3})[0]
        check(y, x, w1, w3, None, b3, **bounds(xd, wd, int(np.prod(lead)), k, n))


@pytest.mark.parametrize("xd,wd", [(F16, F16), (F32, F16)])
def test_ort_cuda_session_kn(xd, wd):
    """FusedFFN with weights_kn = 1 in an onnxruntime CUDA session: decode (M = 1, 2: split-K with onnxruntime's
    scratch for the partials), cuBLAS (M = 3, 40), an empty batch."""
    ort = _ort_cuda()
    import onnx_lowbit
    so = ort.SessionOptions()
    onnx_lowbit.register(so)
    k, n = 2048, 96
    sess = ort.InferenceSession(ffn_model(xd, wd, k, n, True, True, kn=True).SerializeToString(), so,
                                providers=["CUDAExecutionProvider"])
    for lead in [(1, 1), (1, 2), (1, 3), (1, 12), (2, 20), (0, 2), (1, 1)]:
        x, w1, w3, b1, b3 = data(lead, k, n, xd, wd, True, True, seed=sum(lead))
        y = sess.run(None, {"X": x, "W1": np.ascontiguousarray(w1.T), "W3": np.ascontiguousarray(w3.T), "B1": b1,
                            "B3": b3})[0]
        check(y, x, w1, w3, b1, b3, **bounds(xd, wd, int(np.prod(lead)), k, n, kn=True))
