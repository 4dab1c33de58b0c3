"""FusedFFN, CUDA face (custom_ops/ffn/fusedffn_cuda.py and its kernels) against the float64 reference
onnx_lowbit.ffn.swiglu_ref, through the op's kernel object as a session node runs it (``run_op``).

Runs under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1; small shapes; the kernels' simulator block shapes, no
cuBLAS: prefill shapes take the tiled kernel) or on a real GPU with ONNX_LOWBIT_REAL_GPU=1 (the same cases, plus
test_ffn_cuda_gpu.py: the cuBLAS path, LLaMA-size shapes, one-node sessions). Which kernel serves a call is asked
from the routing table (``served``), never assumed.

Tolerance, per output: with g = x.w1 + b1, u = x.w3 + b3 (float64), Sg = sum |x||w1| + |b1|, Su likewise and
gamma = (K + 8) 2^-23 (fp32 sums in any order; also covers the hi/lo split of a fp32 X for fp16 weights, whose
residual is <= 2^-22 |x|):
    |S - ref| <= 1.1 |u| gamma Sg + |SiLU(g)| gamma Su + 2^-11 |ref| (fp16 output rounding; 2^-24 for fp32)
(|SiLU'| <= 1.1); with fp16 GEMM outputs (route gemm_f16out), + 2^-11 (1.1 |u| |x.w1| + |SiLU(g)| |x.w3|): the
products are rounded to fp16 before the activation (biases added after), as in the unfused graph; TF32 GEMMs (route
gemm_tf32) add 2^-9 to gamma. On top, every path with fp16 in it must meet the issue's bar: max |S - ref| / max |ref|
<= 1e-3.
"""
import os

import numpy as np
import pytest
from numba import config

from onnx_lowbit import ffn
from onnx_lowbit.custom_ops import KernelError
from onnx_lowbit.custom_ops.runtime import direct
from onnx_lowbit.custom_ops.runtime.bridge import Tensor
from onnx_lowbit.custom_ops.runtime.routing import route

SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"
F16, F32 = np.float16, np.float32


def _cuda():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda
    return fusedffn_cuda


def data(lead, k, n, xd, wd, b1=False, b3=False, seed=0):
    rng = np.random.default_rng(seed + 7 * k + n)
    x = (rng.standard_normal(lead + (k,)) + 0.2).astype(xd)
    scale = 1.0 / np.sqrt(max(k, 1))
    w1 = (rng.standard_normal((n, k)) * 2 * scale).astype(wd)
    w3 = (rng.standard_normal((n, k)) * scale).astype(wd)
    bias = lambda on: rng.standard_normal(n).astype(xd) if on else None  # noqa: E731
    return x, w1, w3, bias(b1), bias(b3)


def check(y, x, w1, w3, b1=None, b3=None, g16=False, tf32=False):
    """y against the float64 reference within a rounding-error bound; ``g16``: fp16 GEMM outputs; ``tf32``: the
    GEMMs ran in TF32 (X and W rounded to 10-bit mantissas). W1, W3 [N, K]."""
    n, k = w1.shape
    assert y.dtype == x.dtype and y.shape == x.shape[:-1] + (n,)
    if y.size == 0:
        return
    ref = ffn.swiglu_ref(x, w1, w3, b1, b3)
    x64 = np.abs(x.astype(np.float64).reshape(-1, k))
    g = x.astype(np.float64).reshape(-1, k) @ w1.astype(np.float64).T + (0 if b1 is None else b1.astype(np.float64))
    u = x.astype(np.float64).reshape(-1, k) @ w3.astype(np.float64).T + (0 if b3 is None else b3.astype(np.float64))
    sg = x64 @ np.abs(w1.astype(np.float64)).T + (0 if b1 is None else np.abs(b1.astype(np.float64)))
    su = x64 @ np.abs(w3.astype(np.float64)).T + (0 if b3 is None else np.abs(b3.astype(np.float64)))
    gamma = (k + 8) * 2.0 ** -23 + (2.0 ** -9 if tf32 else 0.0)
    r = ref.reshape(-1, n)
    if g16:     # fp16 GEMM outputs round x.w1, x.w3 to fp16 (as the unfused graph)
        sg = sg + 2.0 ** -11 / gamma * np.abs(g - (0 if b1 is None else b1.astype(np.float64)))
        su = su + 2.0 ** -11 / gamma * np.abs(u - (0 if b3 is None else b3.astype(np.float64)))
    tol = 1.1 * np.abs(u) * gamma * sg + np.abs(ffn.silu(g)) * gamma * su + \
        (2.0 ** -11 if x.dtype == F16 else 2.0 ** -24) * np.abs(r) + 1e-30
    err = np.abs(y.reshape(-1, n).astype(np.float64) - r)
    assert np.all(err <= tol), f"max excess {np.max(err - tol):.3e} (max err {err.max():.3e})"
    if x.dtype == F16 or w1.dtype == F16:
        assert err.max() / np.abs(r).max() <= 1e-3


def served(xd, wd, m, k, n, kn=False, path=None, scratch=True):
    """The kernel ROUTES names for a call with fresh (aligned) buffers on this machine: what the kernel object
    launches (the simulator has no cuBLAS and emulates mma.sync)."""
    from onnx_lowbit.custom_ops.device import cublas
    from onnx_lowbit.custom_ops.device.target import tc_device
    fc = _cuda()
    c = fc.case(np.dtype(xd) == F16, np.dtype(wd) == F16, m, k, n, kn=kn, tc=SIM or tc_device(),
                cublas_ok=not SIM and cublas.load() is not None, scratch=scratch, path=path)
    return route(fc.ROUTES, c).kernel


def bounds(xd, wd, m, k, n, kn=False, path=None):
    """check()'s g16 / tf32 flags for the kernel that serves this call."""
    name = served(xd, wd, m, k, n, kn, path)
    return dict(g16=name == "gemm_f16out", tf32=name == "gemm_tf32")


class _Host:
    """A host array seen as a device array: under the simulator the kernels' SimLaunchers read and write host memory
    at the pointers the kernel object is given."""

    def __init__(self, a):
        self.a = np.ascontiguousarray(a)
        self.__cuda_array_interface__ = {"shape": self.a.shape, "typestr": self.a.dtype.str,
                                         "data": (self.a.ctypes.data, False), "version": 3}


class _Context(direct.Context):
    """direct.Context with host scratch under the simulator (its own asks a Numba device array for a device pointer,
    which the simulator's arrays lack); ``has_scratch`` False: onnxruntime < 1.18."""

    def __init__(self, stream, outputs, has_scratch=True):
        super().__init__(stream, outputs)
        self.has_scratch, self._host = has_scratch, []

    def scratch(self, nbytes):
        if not SIM:
            return super().scratch(nbytes)
        self._host.append(np.zeros(max(nbytes, 1), np.uint8))
        return self._host[-1].ctypes.data


def run_op(x, w1, w3, b1=None, b3=None, *, kn=False, path=None, scratch=True):
    """S of a FusedFFN node (W1, W3 [K, N] with ``kn``) on these host arrays through its CUDA kernel object, as
    runtime.direct.call runs it (not direct.call itself: see _Context); ``path``: a forced path (fusedffn_cuda.PATHS);
    ``scratch`` False: a call without scratch memory."""
    from numba import cuda
    n = (w1.shape[1] if kn else w1.shape[0]) if w1.ndim == 2 else 0     # (a 1-D W1 is refused)
    ins = [x, w1, w3, b1, b3]
    while ins[-1] is None:
        ins.pop()
    y = np.zeros(x.shape[:-1] + (n,), x.dtype)
    dev = (lambda a: _Host(a)) if SIM else (lambda a: cuda.to_device(np.ascontiguousarray(a)))
    dins = [None if a is None else dev(a) for a in ins]
    dy = _Host(y) if SIM else cuda.to_device(y)
    kern = direct.kernel("FusedFFN", {"weights_kn": 1} if kn else {}, dins, [dy])
    kern.force_path = path
    kern.compute(_Context(0, [dy], scratch), [None if a is None else Tensor(*direct.describe(a)) for a in dins])
    if SIM:
        return dy.a
    cuda.synchronize()
    return dy.copy_to_host()


def tf32_gemm(path, wd):
    """Whether a call with this forced path may run TF32 GEMMs (sessions' shapes): fp32 weights with TF32 on, on a
    GPU with cuBLAS (the simulator has none)."""
    fc = _cuda()
    return not SIM and fc.TF32 and np.dtype(wd) == F32 and path in (None, "gemm")


# (lead dims, K, N, X type, W type, B1, B3, path): every type variant, bias combination and decode bucket. K = 520
# (fp16) / 260 (fp32) gives 65 chunks per row: two-chunk steps and a single-chunk remainder with the simulator's
# 32-thread block; N = 9 with 2 rows per group and a grid of 2 blocks: a partial last group and several
# grid-stride steps. Prefill shapes: the tensor-core kernel (fp16 X and W) or the tiled kernel here, cuBLAS on a GPU.
CASES = [
    ((1,), 64, 9, F16, F16, True, True, None),
    ((2,), 520, 9, F16, F16, True, False, None),              # decode bucket 2, several steps per group
    ((2,), 264, 5, F32, F16, False, True, None),
    ((1, 1), 520, 5, F16, F16, False, False, None),
    ((2,), 260, 9, F32, F32, True, False, None),
    ((1,), 40, 7, F32, F16, False, True, None),               # mixed: fp32 X, fp16 W
    ((1, 2), 32, 9, F16, F32, True, True, None),              # fp16 X, fp32 W
    ((1,), 24, 3, F32, F32, False, False, None),
    ((3,), 520, 9, F16, F16, True, False, None),              # M = 3: tensor cores
    ((9,), 264, 5, F32, F16, False, True, None),
    ((), 48, 6, F32, F16, True, True, None),                  # 1-D X
    ((17,), 24, 5, F16, F16, True, True, None),
    ((2, 3, 3), 24, 11, F32, F16, False, True, None),         # 3-D X, M = 18
    ((6,), 13, 9, F16, F16, True, True, None),                # K not a multiple of the chunk
    ((3,), 30, 10, F32, F32, False, True, None),              # K % 4 != 0 (fp32 chunk of 4)
    ((1,), 32, 17, F16, F32, True, False, "tiled"),           # forced tiled on a decode shape
    ((9,), 40, 20, F32, F32, True, True, "tiled"),
]


def case_ids(cases):
    """Test ids of (lead dims, K, N, X type, W type, B1, B3, path) cases."""
    return [f"{'x'.join(map(str, c[0])) or 'vec'}-K{c[1]}-N{c[2]}-{np.dtype(c[3]).name}-{np.dtype(c[4]).name}-"
            f"{int(c[5])}{int(c[6])}-{c[7] or 'auto'}" for c in cases]


@pytest.mark.parametrize("lead,K,N,xd,wd,hb1,hb3,path", CASES, ids=case_ids(CASES))
def test_cuda_vs_reference(lead, K, N, xd, wd, hb1, hb3, path):  # noqa: N803
    _cuda()
    x, w1, w3, b1, b3 = data(lead, K, N, xd, wd, hb1, hb3)
    m = int(np.prod(lead))
    check(run_op(x, w1, w3, b1, b3, path=path), x, w1, w3, b1, b3, **bounds(xd, wd, m, K, N, path=path))


def test_cuda_edge_shapes():
    _cuda()
    for lead, k, n, xd, wd in [((0,), 16, 8, F16, F16), ((0, 3), 16, 8, F32, F16), ((2,), 16, 0, F32, F32)]:
        x, w1, w3, _, _ = data(lead, k, n, xd, wd)
        y = run_op(x, w1, w3)
        assert y.shape == lead + (n,) and y.dtype == xd
    for path in (None, "tiled"):
        x, w1, w3, b1, b3 = data((3,), 24, 1, F16, F16, True, True)        # N = 1
        check(run_op(x, w1, w3, b1, b3, path=path), x, w1, w3, b1, b3)
        x, w1, w3, b1, b3 = data((2,), 0, 5, F32, F32, True, True)         # K = 0: S = SiLU(B1) * B3
        y = run_op(x, w1, w3, b1, b3, path=path)
        np.testing.assert_allclose(y, np.broadcast_to(ffn.silu(b1) * b3, (2, 5)), rtol=1e-6)
        x, w1, w3, _, _ = data((1,), 8, 3, F16, F32)                       # K = 8: one chunk (fp16) per row
        check(run_op(x, w1, w3, path=path), x, w1, w3)


def test_cuda_forced_path_the_call_cannot_take():
    _cuda()
    x, w1, w3, _, _ = data((3,), 16, 8, F16, F16)
    with pytest.raises(KernelError, match="decode kernel does not take M=3"):
        run_op(x, w1, w3, path="decode")                    # M > 2 (buckets past 2 are gone)
    with pytest.raises(KernelError, match="tensor-core kernel does not take"):
        run_op(x.astype(F32), w1, w3, path="tc")
    with pytest.raises(KernelError, match="path 'fast' is not one of"):
        run_op(x, w1, w3, path="fast")


@pytest.mark.parametrize("path,xd,wd", [(None, F16, F16), ("tiled", F16, F16), ("tc", F16, F16), (None, F32, F16),
                                         ("tiled", F32, F16)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_nonfinite(path, xd, wd):
    """NaN/Inf propagate as in the unfused graph; fp16 outputs past 65504 become inf (every path; the
    tensor-core kernel fusedffn_tc_cuda takes fp16 X and W only)."""
    _cuda()
    x, w1, w3, b1, b3 = data((4,), 16, 6, xd, wd, True, True, seed=3)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2, :] *= 300          # |g|, |u| ~ 1e3: S ~ 1e6 overflows fp16
    w1[4, 2] = np.nan       # column 4 NaN for every row
    y = run_op(x, w1, w3, b1, b3, path=path).astype(np.float64)
    ref = ffn.swiglu_ref(x, w1, w3, b1, b3)
    with np.errstate(over="ignore"):
        refc = ref.astype(xd).astype(np.float64)
    assert np.array_equal(np.isnan(y), np.isnan(refc))
    assert np.array_equal(np.isposinf(y), np.isposinf(refc)) and np.array_equal(np.isneginf(y), np.isneginf(refc))
    assert np.isnan(y[0]).all() and np.isnan(y[:, 4]).all()
    fin = np.isfinite(refc) & np.isfinite(y)
    assert fin[3].sum() == 5 and np.allclose(y[fin], refc[fin], rtol=2e-3, atol=1e-3)


def test_cuda_bad_inputs_name_the_input():
    """Shapes: a KernelError naming the input; types no FusedFFN variant has: no kernel object (onnxruntime refuses
    such a node before it reaches a kernel)."""
    _cuda()
    x, w1, w3, b1, _ = data((2,), 16, 8, F32, F32, True)
    with pytest.raises(KernelError, match=r"input 0 'X' must have last dimension K=16"):
        run_op(x[:, :15], w1, w3)
    with pytest.raises(KernelError, match=r"input 2 'W3' must have W1's shape \[N, K\] = \[8, 16\], got \[8, 15\]"):
        run_op(x, w1, w3[:, :15])
    with pytest.raises(KernelError, match=r"input 1 'W1' must be 2-D"):
        run_op(x, w1.reshape(-1), w3.reshape(-1))
    with pytest.raises(KernelError, match=r"input 3 'B1' must have shape \[N\] = \[8\], got \[7\]"):
        run_op(x, w1, w3, b1[:7])
    for bad in ((x, w1, w3, None, b1.astype(F16)), (x, w1, w3.astype(F16))):
        with pytest.raises(TypeError, match="FusedFFN has no variant"):
            run_op(*bad)


# W1, W3 [K, N] (attribute weights_kn = 1): the K-major tensor-core kernel (fusedffn_kn_tc_cuda) at M = 2..16 with
# fp16 X and W, the K-major split-K decode kernel (fusedffn_kn_cuda) at other M <= 2, the tiled kernel otherwise
# under the simulator (cuBLAS on a GPU). N = 24 / 40 fp16 with the simulator's 64-thread block (256-column tiles x
# 2 K warps); K = 37 / 300: partial steps and several splits.
KN_CASES = [
    ((1,), 300, 40, F16, F16, True, True, None),
    ((2,), 37, 24, F32, F16, False, True, None),
    ((1, 1), 64, 12, F16, F32, True, False, None),
    ((2,), 130, 16, F32, F32, True, True, None),
    ((), 48, 8, F16, F16, False, False, None),          # 1-D X
    ((1,), 40, 10, F16, F16, True, True, None),         # N % 8 != 0 (fp16)
    ((2,), 300, 40, F16, F16, True, True, "decode"),    # the two-row decode kernel with fp16 X and W
    ((3,), 40, 24, F16, F16, True, True, None),         # M = 3: tensor-core kernel, one 8-row tile
    ((2, 4), 72, 136, F16, F16, False, True, None),     # M = 8: tensor-core kernel, 3 feature tiles
    ((2, 5), 72, 136, F16, F16, False, True, None),     # M = 10: 16-row tiles
    ((3,), 40, 24, F32, F16, True, True, None),         # mixed at M = 3
    ((2,), 40, 24, F32, F16, True, False, "tiled"),
]


@pytest.mark.parametrize("lead,K,N,xd,wd,hb1,hb3,path", KN_CASES, ids=case_ids(KN_CASES))
def test_cuda_kn_vs_reference(lead, K, N, xd, wd, hb1, hb3, path):  # noqa: N803
    _cuda()
    x, w1, w3, b1, b3 = data(lead, K, N, xd, wd, hb1, hb3, seed=11)
    y = run_op(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, path=path, kn=True)
    check(y, x, w1, w3, b1, b3, **bounds(xd, wd, int(np.prod(lead)), K, N, kn=True, path=path))


@pytest.mark.parametrize("m,k", [(1, 300), (2, 45), (5, 40)])
def test_cuda_kn_without_scratch(m, k):
    """A call without scratch memory (onnxruntime < 1.18): the K-major decode kernel in one split (no partials),
    prefill shapes on the kernels that take no scratch."""
    _cuda()
    x, w1, w3, b1, b3 = data((m,), k, 40, F16, F16, True, True, seed=4)
    assert served(F16, F16, m, k, 40, kn=True, scratch=False) in ("kn_decode", "kn_tc", "tiled")
    y = run_op(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, kn=True, scratch=False)
    check(y, x, w1, w3, b1, b3)


@pytest.mark.parametrize("path", [None, "tiled"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_kn_nonfinite(path):
    """NaN/Inf on the K-major paths propagate as in the unfused graph (M = 2: the tensor-core kernel)."""
    _cuda()
    x, w1, w3, b1, b3 = data((2,), 40, 16, F16, F16, True, True, seed=3)
    x[0, 3] = np.nan
    x[1, :] *= 3000         # S overflows fp16
    w1[4, 2] = np.inf
    y = run_op(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, path=path,
               kn=True).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        refc = ffn.swiglu_ref(x, w1, w3, b1, b3).astype(F16).astype(np.float64)
    assert np.isnan(y[0]).all()
    assert np.array_equal(np.isnan(y), np.isnan(refc)) and np.array_equal(np.isinf(y), np.isinf(refc))
    fin = np.isfinite(refc)
    assert np.allclose(y[fin], refc[fin], rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("m,k,n", [(5, 24, 8), (9, 88, 72), (20, 40, 64), (11, 56, 136)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_kn_tc_configs(m, k, n):
    """The K-major tensor-core kernel's configurations (8- and 16-row tiles, M = 20 forced past the routed M: several
    row tiles; partial last step, feature tile and row tile), NaN in X and in a weight column propagating as in the
    unfused graph."""
    _cuda()
    x, w1, w3, b1, b3 = data((m,), k, n, F16, F16, True, True, seed=m)
    y = run_op(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, kn=True, path="tc")
    check(y, x, w1, w3, b1, b3)
    x[1, 2] = np.nan
    w3[n - 1, k - 1] = np.nan
    y = run_op(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, kn=True, path="tc")
    assert np.isnan(y[1]).all() and np.isnan(y[:, n - 1]).all()
    assert np.isfinite(np.delete(np.delete(y, 1, 0), n - 1, 1)).all()


def test_kn_tc_configs_fit_static_shared_memory():
    """Every configuration sessions may launch compiles within 48 KiB of static shared memory (the simulator does
    not check it; ptxas refuses more)."""
    from onnx_lowbit.custom_ops.ffn import fusedffn_kn_tc_cuda as kntc
    for _, (mt, kw, ring) in kntc.CONFIGS:
        smem_out = mt > 1 and kntc.red_bytes(mt, kw, True) <= kntc.SMEM_MAX
        assert kntc.red_bytes(mt, kw, smem_out) <= kntc.SMEM_MAX
    with pytest.raises(ValueError, match="bytes of shared memory"):
        kntc.make(8, 4, 1)


def test_cuda_kn_bad_inputs():
    _cuda()
    x, w1, w3, _, _ = data((1,), 16, 8, F16, F16)
    with pytest.raises(KernelError, match=r"input 0 'X' must have last dimension K=8 \(W1 is \[K, N\]"):
        run_op(x, w1, w3, kn=True)      # [N, K] weights given as [K, N]
    with pytest.raises(KernelError, match=r"input 2 'W3' must have W1's shape \[K, N\]"):
        run_op(x, w1.T, w3.T[:, :7], kn=True)


if REAL_GPU and SIM:  # pragma: no cover
    raise RuntimeError("ONNX_LOWBIT_REAL_GPU=1 but the CUDA simulator is on")
