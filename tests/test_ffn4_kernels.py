"""FusedFFNNF4 / FusedFFNAWQ kernels against onnx_lowbit.ffn: CPU faces through onnxruntime sessions, CUDA faces
(FusedFFNNF4: its kernel object through runtime/direct.call, ``nf4_cuda_call``; FusedFFNAWQ: ``run_arrays``) under
Numba's CUDA simulator (small shapes; NUMBA_ENABLE_CUDASIM=1) or on a real GPU
(ONNX_LOWBIT_REAL_GPU=1).

Error metric: max |S - ref| / max |ref| (float64 reference). Bars:
  * fp32 X: <= 1e-5 (fp32 accumulation; NF4 weights are exact in fp32; AWQ kernels multiply with the exact
    (q - z) * s, so they are compared with ffn.swiglu_ref on those exact weights);
  * fp16 X: <= 2^-10 (one fp16 rounding of S, plus fp32 sums);
  * AWQ against ffn.swiglu_awq_ref (whose weights are rounded to fp16): <= 1e-3, the issue's bar.
Non-finite X: the rows holding NaN/Inf must be non-finite exactly where the reference is, other rows as above.
"""
import itertools

import numpy as np
import pytest
from numba import config
from onnx import TensorProto, helper, numpy_helper

from onnx_lowbit import awq, domain, ffn, nf4
from onnx_lowbit.custom_ops.runtime.routing import route
from test_nf4_kernels import call_op

SIM = bool(config.ENABLE_CUDASIM)
ET = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


def _rel(y, ref):
    ref = np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / max(float(np.max(np.abs(ref))), 1e-12))


def _tol(dtype):
    return 1e-5 if np.dtype(dtype) == np.float32 else 2.0 ** -10


def _data(lead, k, n, dtype, biases, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(lead + (k,)) + 0.2).astype(dtype)
    b1 = rng.standard_normal(n).astype(dtype) if biases[0] else None
    b3 = rng.standard_normal(n).astype(dtype) if biases[1] else None
    return x, b1, b3


# ------------------------------------------------------------------------------------------------------ NF4
def nf4_weights(k, n, bs, qt, seed=0):
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((k, n)).astype(np.float32)
    w3 = rng.standard_normal((k, n)).astype(np.float32)
    return nf4.quantize(w1, qt, bs) + nf4.quantize(w3, qt, bs)


def _model(op, ins, inits, x_dims, k, n, dtype, attrs, name="ffn"):
    et = ET[np.dtype(dtype)]
    node = helper.make_node(op, ins, ["s"], domain=domain.DOMAIN, name=name, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", et, x_dims + [k])],
                          [helper.make_tensor_value_info("s", et, x_dims + [n])],
                          [numpy_helper.from_array(v, nm) for nm, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


def nf4_model(lead, k, n, bs, qt, dtype, ws, b1, b3, name="ffn"):
    q1, a1, q3, a3 = ws
    inits = {"q1": q1, "a1": a1, "q3": q3, "a3": a3}
    ins = ["x", "q1", "a1", "q3", "a3", "b1" if b1 is not None else "", "b3" if b3 is not None else ""]
    for nm, b in (("b1", b1), ("b3", b3)):
        if b is not None:
            inits[nm] = b
    while ins[-1] == "":
        ins.pop()
    return _model("FusedFFNNF4", ins, inits, [f"d{i}" for i in range(len(lead))], k, n, dtype,
                  {"quant_type": qt, "block_size": bs, "K": k, "N": n}, name)


def _session(model):
    import onnx_lowbit
    return onnx_lowbit.InferenceSession(model, providers=["CPUExecutionProvider"])


NF4_CASES = [  # lead dims, K, N, block size, quant type, dtype, (B1, B3)
    ((1,), 64, 16, 32, "nf4", np.float32, (True, True)),
    ((1, 3), 688, 24, 64, "fp4", np.float16, (False, False)),    # K not a multiple of the block (blocks straddle rows)
    ((2,), 128, 8, 128, "nf4", np.float16, (True, False)),
    ((2, 2, 2), 96, 40, 256, "fp4", np.float32, (False, True)),  # 3-D X, a block of several rows
    ((17,), 64, 8, 32, "nf4", np.float32, (True, True)),        # M > 16: the prefill path
    ((0,), 64, 8, 64, "nf4", np.float32, (True, True)),         # empty batch
    ((1, 2), 64, 24, 32, "int4", np.float32, (True, False)),    # int4 (MatMulNBits' symmetric grid)
]
NF4_IDS = [f"{'x'.join(map(str, c[0]))}-K{c[1]}-N{c[2]}-bs{c[3]}-{c[4]}-{np.dtype(c[5]).name}" for c in NF4_CASES]


@pytest.mark.parametrize("lead,k,n,bs,qt,dtype,biases", NF4_CASES, ids=NF4_IDS)
def test_nf4_cpu_session(lead, k, n, bs, qt, dtype, biases):
    ws = nf4_weights(k, n, bs, qt)
    x, b1, b3 = _data(lead, k, n, dtype, biases, 1)
    s = _session(nf4_model(lead, k, n, bs, qt, dtype, ws, b1, b3)).run(None, {"x": x})[0]
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    assert s.shape == ref.shape and s.dtype == x.dtype
    assert _rel(s, ref) <= _tol(dtype)


def _nf4_cuda():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda
    return fusedffnnf4_cuda


def nf4_cuda_call(x, ws, qt, bs, k, n, b1=None, b3=None, path=None):
    """FusedFFNNF4's CUDA kernel object on host arrays (test_nf4_kernels.call_op): (S, the routed kernel's name)."""
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda as fc
    q1, a1, q3, a3 = ws
    attrs = {"quant_type": qt, "block_size": bs, "K": k, "N": n}
    s, kern = call_op("FusedFFNNF4", attrs, [x, q1.reshape(-1), a1.reshape(-1).astype(np.float32), q3.reshape(-1),
                                             a3.reshape(-1).astype(np.float32), b1, b3], x.shape[:-1] + (n,),
                      x.dtype, path)
    m = int(np.prod(x.shape[:-1]))
    return s, (route(fc.ROUTES, kern.case(m)).kernel if m else None)


def _nf4_setting(fc, monkeypatch, setting):
    """Routing switches of the tests: 'fp32' (ONNX_LOWBIT_FP32_DECODE=1), 'wide' (WIDE_MIN_K = 0), 'block' (no
    warp-column kernel), 'ungrouped' (no thread groups)."""
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    for part in setting.split("+") if setting else ():
        if part == "fp32":
            monkeypatch.setenv("ONNX_LOWBIT_FP32_DECODE", "1")
        elif part == "wide":
            monkeypatch.setattr(fc, "WIDE_MIN_K", 0)
        elif part == "block":
            monkeypatch.setattr(fc, "WARPCOLS", {})
        else:
            assert part == "ungrouped"
            monkeypatch.setattr(fc, "grouped", lambda a16, k: False)


NF4_CUDA_CASES = [  # (the simulator runs every thread in Python: small M * N)
    ((1,), 64, 16, 32, "nf4", np.float32, (True, True)),
    ((1, 1), 688, 10, 64, "fp4", np.float16, (False, False)),     # blocks straddle rows; 2 warps, one partial
    ((2,), 128, 8, 128, "nf4", np.float16, (True, False)),
    ((2, 1, 2), 96, 12, 256, "fp4", np.float32, (False, True)),   # 3-D X, 2 row chunks of 2
    ((5,), 48, 21, 32, "nf4", np.float16, (True, True)),          # 3 row chunks (one partial), N % 8 != 0
    ((1,), 96, 45, 32, "nf4", np.float16, (True, False)),         # M=1 slices of several steps, a partial last step
    ((1,), 512, 19, 64, "fp4", np.float32, (False, True)),        # M=1, one full warp (every thread owns a word)
    ((1,), 40, 8, 32, "nf4", np.float32, (True, True)),           # K % 16 != 0: the generic kernel
    ((1,), 96, 45, 32, "int4", np.float16, (True, False)),        # int4 code, M = 1
    ((3,), 64, 16, 32, "int4", np.float32, (False, True)),
    ((17,), 64, 8, 32, "fp4", np.float16, (False, True)),         # M > 16: generic (prefill with cuBLAS)
    ((0,), 64, 8, 64, "nf4", np.float32, (True, True)),
]


@pytest.mark.parametrize("lead,k,n,bs,qt,dtype,biases", NF4_CUDA_CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-K{c[1]}-N{c[2]}-bs{c[3]}-{np.dtype(c[5]).name}"
                              for c in NF4_CUDA_CASES])
def test_nf4_cuda_kernel(lead, k, n, bs, qt, dtype, biases, monkeypatch):
    """The routed kernel, the generic one (forced), and with fp16 X the other decode kernels the routing switches
    reach at this shape (the fp32 decode; the wide one where K % 32 == 0, with and without thread groups), each
    distinct kernel once. The prefill route (fp16 X from M = 17 where cuBLAS exists: on a GPU; its own tests:
    test_ffn4_prefill_cuda) multiplies fp16-rounded weights: compared with the reference on those."""
    from onnx_lowbit.custom_ops.device import cublas
    fc = _nf4_cuda()
    blas = not SIM and cublas.load() is not None
    ws = nf4_weights(k, n, bs, qt, seed=2)
    x, b1, b3 = _data(lead, k, n, dtype, biases, 3)
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    settings = [("", None), ("", "generic")]
    if np.dtype(dtype) == np.float16:
        settings += [("fp32", None), ("wide", None), ("wide+ungrouped", None)]
    m = int(np.prod(lead))
    seen = set()
    for setting, path in settings:
        with monkeypatch.context() as mp:
            _nf4_setting(fc, mp, setting)
            a16 = np.dtype(dtype) == np.float16
            want = route(fc.ROUTES, fc.case(dtype, m, k, n, bs, False, "fp32" in setting, fc.grouped(a16, k),
                                            path=path, cublas_ok=blas, scratch=True)).kernel
            if want in seen:
                continue
            seen.add(want)
            s, name = nf4_cuda_call(x, ws, qt, bs, k, n, b1, b3, path)
        assert name in (want, None) and s.shape == ref.shape and s.dtype == x.dtype, (setting, want)
        w16 = [ffn.nf4_weight_t(ws[i], ws[i + 1], qt, bs, k, n).astype(np.float16) for i in (0, 2)]
        assert _rel(s, ref if want != "prefill" else ffn.swiglu_ref(x, *w16, b1, b3)) <= _tol(dtype), (setting, want)


def test_nf4_reduce_index_matches_kernel_layout():
    _nf4_cuda()
    from onnx_lowbit.custom_ops.nf4 import decode_cuda
    for nv in (4, 8, 16, 32):
        steps = nv.bit_length() - 1
        seen = {decode_cuda.red_index(lane, nv) for lane in range(32) if lane & ((1 << (5 - steps)) - 1) == 0}
        assert seen == set(range(nv))


# ------------------------------------------------------------------------------------------------------ AWQ
_AWQ = {}


def awq_weights(k, n, g, seed=0):
    key = (k, n, g, seed)
    if key not in _AWQ:
        rng = np.random.default_rng(seed + 7 * k + n)
        _AWQ[key] = tuple(awq.quantize_rtn((rng.standard_normal((k, n)) * rng.uniform(0.02, 0.2, n)).astype(np.float32),
                                           g) for _ in range(2))
    return _AWQ[key]


def awq_exact_t(w, g, k):
    """[N, K] float64 exact weights (q - z) * s, as the kernels use them."""
    q, z = awq.unpack(w[0], w[1])
    s = np.repeat(w[2].astype(np.float64), g, axis=0)[:k]
    return ((q[:k].astype(np.float64) - np.repeat(z, g, axis=0)[:k]) * s).T


def check_awq(s, x, w1, w3, g, k, n, b1, b3):
    assert s.dtype == x.dtype and s.shape == x.shape[:-1] + (n,)
    exact = ffn.swiglu_ref(x, awq_exact_t(w1, g, k), awq_exact_t(w3, g, k), b1, b3)
    assert _rel(s, exact) <= _tol(x.dtype)
    assert _rel(s, ffn.swiglu_awq_ref(x, *w1, *w3, g, k, n, b1, b3)) <= 1e-3


def awq_model(lead, k, n, g, dtype, w1, w3, b1, b3, name="ffn", attrs=None):
    inits = {f"{nm}{i}": t for i, w in ((1, w1), (3, w3)) for nm, t in zip(("qw", "qz", "sc"), w)}
    ins = ["x", "qw1", "qz1", "sc1", "qw3", "qz3", "sc3", "b1" if b1 is not None else "", "b3" if b3 is not None else ""]
    for nm, b in (("b1", b1), ("b3", b3)):
        if b is not None:
            inits[nm] = b
    while ins[-1] == "":
        ins.pop()
    return _model("FusedFFNAWQ", ins, inits, [f"d{i}" for i in range(len(lead))], k, n, dtype,
                  attrs if attrs is not None else {"group_size": g, "K": k, "N": n}, name)


AWQ_CASES = [  # lead dims, K, N, group size, dtype, (B1, B3)
    ((1,), 128, 16, 128, np.float32, (True, True)),
    ((1, 3), 688, 24, 128, np.float16, (False, False)),   # K padded to a multiple of the group
    ((2,), 100, 16, 7, np.float32, (True, False)),        # odd group size
    ((2, 2, 2), 256, 64, 64, np.float16, (False, True)),
    ((17,), 64, 8, 32, np.float16, (True, True)),         # M > 16
    ((0,), 64, 8, 32, np.float32, (True, True)),
]


@pytest.mark.parametrize("lead,k,n,g,dtype,biases", AWQ_CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-K{c[1]}-N{c[2]}-G{c[3]}-{np.dtype(c[4]).name}"
                              for c in AWQ_CASES])
def test_awq_cpu_session(lead, k, n, g, dtype, biases):
    w1, w3 = awq_weights(k, n, g)
    x, b1, b3 = _data(lead, k, n, dtype, biases, 4)
    s = _session(awq_model(lead, k, n, g, dtype, w1, w3, b1, b3)).run(None, {"x": x})[0]
    check_awq(s, x, w1, w3, g, k, n, b1, b3)


def _awq_cuda():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.awq import gemv_run_cuda    # FusedFFNAWQ's decode / generic kernels (nw = 2)
    return gemv_run_cuda


AWQ_CUDA_CASES = [  # M, K, N, G, dtype, (B1, B3), ct, warps (shrunk blocks under the simulator), rows
    (1, 128, 16, 128, np.float32, (True, True), 4, 2, None),
    (1, 688, 24, 128, np.float16, (False, True), 4, 2, None),     # padded K, 3 column tiles
    (3, 100, 16, 7, np.float32, (True, False), 2, 2, None),       # odd group: slices of 7 rows
    (6, 64, 16, 32, np.float16, (True, True), 2, 2, None),        # 2 row chunks of 4 (one partial)
    (2, 64, 16, 32, np.float16, (False, False), 2, 2, 32),        # a single K split: S written directly
    (17, 64, 8, 32, np.float32, (True, True), 2, 2, None),        # generic kernel
    (1, 352, 16, 32, np.float16, (True, True), 2, 2, 16),         # 11 K splits: a batch of 8 partials summed, then 3
    (3, 352, 16, 32, np.float32, (True, False), 2, 2, 16),        # the same with 3 rows of partials per split
]


@pytest.mark.parametrize("M,K,N,G,dtype,biases,ct,warps,rows", AWQ_CUDA_CASES,
                         ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-G{c[3]}-{np.dtype(c[4]).name}" for c in AWQ_CUDA_CASES])
def test_awq_cuda_kernel(M, K, N, G, dtype, biases, ct, warps, rows):  # noqa: N803
    fc = _awq_cuda()
    w1, w3 = awq_weights(K, N, G, seed=1)
    x, b1, b3 = _data((M,), K, N, dtype, biases, 5)
    geo = {"ct": ct, "warps": warps, "rows": rows} if SIM else {}
    s = fc.run(x, w1, w3, b1, b3, G, K, N, repeat=2, **geo)   # the scratch must be left zeroed
    check_awq(s, x, w1, w3, G, K, N, b1, b3)
    if M <= 16:
        geo.pop("rows", None)
        check_awq(fc.run(x, w1, w3, b1, b3, G, K, N, generic=True, **geo), x, w1, w3, G, K, N, b1, b3)


def test_awq_cuda_empty():
    fc = _awq_cuda()
    w1, w3 = awq_weights(64, 8, 32)
    s = fc.run(np.zeros((0, 3, 64), np.float16), w1, w3, None, None, 32, 64, 8)
    assert s.shape == (0, 3, 8) and s.dtype == np.float16


# ------------------------------------------------------------------------------------------ non-finite X
def _specials(x):
    x = x.copy()
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2, 0] = -np.inf
    return x


def _check_nonfinite(s, ref, dtype):
    bad = ~np.isfinite(ref)
    assert np.array_equal(~np.isfinite(s), bad)
    assert bad[:3].all() and not bad[3:].any()   # every output of a row holding NaN/Inf is non-finite
    assert _rel(s[3:], ref[3:]) <= _tol(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nonfinite_x_nf4(dtype, monkeypatch):
    k, n, bs, qt = 64, 16, 32, "nf4"
    ws = nf4_weights(k, n, bs, qt, seed=4)
    x, b1, b3 = _data((5,), k, n, dtype, (True, True), 6)
    x = _specials(x)
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    _check_nonfinite(_session(nf4_model((5,), k, n, bs, qt, dtype, ws, b1, b3)).run(None, {"x": x})[0], ref, dtype)
    fc = _nf4_cuda()
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    for path in (None, "generic"):
        _check_nonfinite(nf4_cuda_call(x, ws, qt, bs, k, n, b1, b3, path)[0], ref, dtype)
    if dtype == np.float16:     # the packed-fp16 decodes at M = 1 and 2 (rows 0 and 1 hold NaN / Inf, row 4 none)
        for setting, rows in itertools.product(("", "wide"), ([0], [1], [0, 1], [4], [3, 4])):
            with monkeypatch.context() as mp:
                _nf4_setting(fc, mp, setting)
                s, name = nf4_cuda_call(x[rows], ws, qt, bs, k, n, b1, b3)
            assert name.startswith("decode.") and ("wide" in name) == (setting == "wide"), name
            bad = ~np.isfinite(ref[rows])
            assert np.array_equal(~np.isfinite(s), bad), (name, rows)
            assert _rel(s[~bad.any(axis=1)], ref[rows][~bad.any(axis=1)]) <= _tol(dtype), (name, rows)


def test_nf4_h2_default_and_opt_out(monkeypatch):
    """fp16 X at M = 1 decodes in packed fp16 by default, fp32 X never does, and ONNX_LOWBIT_FP32_DECODE=1 (read when
    the kernel object is made) keeps the fp32 decode: the routes the kernel objects take and their outputs."""
    fc = _nf4_cuda()
    k, n, bs = 128, 8, 64
    ws = nf4_weights(k, n, bs, "nf4", seed=7)
    x, _, _ = _data((1,), k, n, np.float16, (False, False), 7)
    ref = ffn.swiglu_nf4_ref(x, *ws, "nf4", bs, k, n, None, None)
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    fast, name = nf4_cuda_call(x, ws, "nf4", bs, k, n)
    assert name == "decode.mt1.h2" and _rel(fast, ref) <= _tol(np.float16)
    assert nf4_cuda_call(x.astype(np.float32), ws, "nf4", bs, k, n)[1] == "decode.mt1.nib"
    monkeypatch.setenv("ONNX_LOWBIT_FP32_DECODE", "1")
    exact, name = nf4_cuda_call(x, ws, "nf4", bs, k, n)
    assert name == "decode.mt1.nib" and _rel(exact, ref) <= _tol(np.float16)
    assert not np.array_equal(exact, fast)


def test_nf4_h2_rounding_with_a_mean_in_x(monkeypatch):
    """The packed-fp16 decode rounds each of the 16 NF4 levels to fp16 once, so that error is systematic per level
    and does not average out when X has a mean. Here (K = 1024, X ~ N(0.2, 1), weights N(0, 1), SiLU(g) * u after
    sums with cancellation) plain fp16 levels gave 1.9e-3 of the largest output, twice the fp16 tolerance; the
    table holds the levels times half2.h2_scale (1.3662 for NF4: half the rounding), which brings it to 6.8e-4.
    The fp32 decode (ONNX_LOWBIT_FP32_DECODE=1) stays far inside. The block decode kernels (the warp-column kernel,
    routed at this K, does the wide one's arithmetic: test_nf4warp_cuda)."""
    fc = _nf4_cuda()
    k, n, bs = 1024, 3, 64
    ws = nf4_weights(k, n, bs, "nf4", seed=2)
    x, b1, _ = _data((1,), k, n, np.float16, (True, False), 3)
    ref = ffn.swiglu_nf4_ref(x, *ws, "nf4", bs, k, n, b1, None)
    for setting, want, tol in (("fp32", "decode.mt1.nib", _tol(np.float16) / 8),
                               ("block", "decode.mt1.h2", _tol(np.float16)),
                               ("block+wide+ungrouped", "decode.mt1.wide", _tol(np.float16))):
        with monkeypatch.context() as mp:
            _nf4_setting(fc, mp, setting)
            s, name = nf4_cuda_call(x, ws, "nf4", bs, k, n, b1)
        assert name == want and _rel(s, ref) <= tol, (name, _rel(s, ref))


@pytest.mark.parametrize("scale,wide", [(2.0 ** -20, False), (2.0 ** -9, True), (1.0, False), (3000.0, True),
                                        (30000.0, False)])
def test_nf4_h2_decode_x_range(scale, wide, monkeypatch):
    """The packed-fp16 decode scales each row of X by a power of two: activations near fp16's largest value do not
    overflow its fp16 partial sums, tiny ones (subnormal in fp16) keep their precision; M = 1 (chains of 2, or the
    wide decode's chains of 4) and M = 2 (the wide decode), rows of different magnitude (the absmax scaled so that
    the outputs stay inside fp16's range)."""
    fc = _nf4_cuda()
    k, n, bs, qt = 256, 12, 64, "nf4"
    q1, am1, q3, am3 = nf4_weights(k, n, bs, qt, seed=5)
    am1, am3 = (np.float32(1 / (16 * scale)) * a for a in (am1, am3))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, k)) * scale / 4
    x[0, 7] = scale                                   # one outlier sets the row's scale
    x[1] *= 2.0 ** -3
    x = x.astype(np.float16)
    ws = (q1, am1.astype(np.float32), q3, am3.astype(np.float32))
    _nf4_setting(fc, monkeypatch, "wide" if wide else "")
    for m in (1, 2) if wide else (1,):
        ref = ffn.swiglu_nf4_ref(x[:m], *ws, qt, bs, k, n, None, None)
        s, name = nf4_cuda_call(x[:m], ws, qt, bs, k, n)
        assert name.startswith(f"decode.mt{m}.{'wide' if wide else 'h2'}"), name
        assert np.isfinite(ref).all() and np.isfinite(s).all(), m
        for r in range(m):      # each row against its own magnitude; chains of 4 round about twice as much
            assert _rel(s[r], ref[r]) <= _tol(np.float16) * (2 if wide else 1), (m, r)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nonfinite_x_awq(dtype):
    k, n, g = 64, 16, 32
    w1, w3 = awq_weights(k, n, g, seed=2)
    x, b1, b3 = _data((5,), k, n, dtype, (True, False), 7)
    x = _specials(x)
    ex = lambda w: awq_exact_t(w, g, k)  # noqa: E731
    ref = ffn.swiglu_ref(x, ex(w1), ex(w3), b1, b3)
    _check_nonfinite(_session(awq_model((5,), k, n, g, dtype, w1, w3, b1, b3)).run(None, {"x": x})[0], ref, dtype)
    fc = _awq_cuda()
    geo = {"ct": 2, "warps": 2} if SIM else {}
    for kw in ({}, {"generic": True}):
        _check_nonfinite(fc.run(x, w1, w3, b1, b3, g, k, n, **geo, **kw), ref, dtype)
    if dtype == np.float16:     # what sessions route fp16 X at M = 5 to: the small-M tensor-core GEMV (8 rows)
        from onnx_lowbit.custom_ops.awq import matmulawq1_cuda
        _check_nonfinite(matmulawq1_cuda.run(x, w1, w3, b1, b3, g, k, n, wpl=1, unroll=2), ref, dtype)


# ------------------------------------------------------------------------------------------------ bad inputs
def _run_error(model, x):
    sess = _session(model)
    with pytest.raises(Exception) as ei:
        sess.run(None, {"x": x})
    return str(ei.value)


def test_nf4_bad_inputs_name_the_input():
    k, n, bs, qt = 64, 16, 32, "nf4"
    q1, a1, q3, a3 = nf4_weights(k, n, bs, qt)
    x = np.ones((1, k), np.float32)
    msg = _run_error(nf4_model((1,), k, n, bs, qt, np.float32, (q1, a1[:-1], q3, a3), None, None, name="gateup"), x)
    assert "absmax1" in msg and "FusedFFNNF4" in msg and "gateup" in msg and "[31]" in msg
    msg = _run_error(nf4_model((1,), k, n, bs, qt, np.float32, (q1, a1, q3, a3[:-2]), None, None), x)
    assert "input 4 'absmax3'" in msg
    msg = _run_error(nf4_model((1,), k, n, bs, qt, np.float32, (q1, a1, q3[:-1], a3), None, None), x)
    assert "input 3 'Q3'" in msg
    msg = _run_error(nf4_model((1,), k, n, bs, qt, np.float32, (q1, a1, q3, a3), None, np.ones(n + 1, np.float32)),
                     x)
    assert "input 6 'B3'" in msg and f"[{n}]" in msg
    with pytest.raises(Exception, match="block_size"):
        _session(nf4_model((1,), k, n, 48, qt, np.float32, (q1, a1, q3, a3), None, None))


def test_nf4_cuda_host_entry_checks_inputs():
    """The kernel object's input checks (as a session calls it; a bias of the wrong type never reaches it: the
    op variants bind by type)."""
    _nf4_cuda()
    from onnx_lowbit.custom_ops import KernelError
    q1, a1, q3, a3 = nf4_weights(64, 16, 32, "nf4")
    with pytest.raises(KernelError, match="input 2 'absmax1'"):
        nf4_cuda_call(np.ones((1, 64), np.float32), (q1, a1[:-1], q3, a3), "nf4", 32, 64, 16)
    with pytest.raises(KernelError, match="input 0 'X' must have last dimension K=64"):
        nf4_cuda_call(np.ones((1, 80), np.float32), (q1, a1, q3, a3), "nf4", 32, 64, 16)
    with pytest.raises(KernelError, match=r"input 5 'B1' must have shape \[16\]"):
        nf4_cuda_call(np.ones((1, 64), np.float32), (q1, a1, q3, a3), "nf4", 32, 64, 16, np.ones(15, np.float32))


def test_awq_bad_inputs_name_the_input():
    k, n, g = 688, 24, 128
    w1, w3 = awq_weights(k, n, g)
    x = np.ones((1, k), np.float16)
    bad3 = (w3[0], w3[1][:-1], w3[2])
    msg = _run_error(awq_model((1,), k, n, g, np.float16, w1, bad3, None, None, name="gateup"), x)
    assert "input 5 'qzeros3'" in msg and "[6, 3]" in msg and "[5, 3]" in msg and "gateup" in msg
    bad1 = (w1[0], w1[1], w1[2].astype(np.float32))
    with pytest.raises(Exception, match="sc1.*FusedFFNAWQ"):   # onnxruntime's type check (the schema)
        _session(awq_model((1,), k, n, g, np.float16, bad1, w3, None, None)).run(None, {"x": x})
    msg = _run_error(awq_model((1,), k, n, g, np.float16, w1, w3, np.ones(n - 8, np.float16), None), x)
    assert "input 7 'B1'" in msg
    with pytest.raises(Exception, match="'N'"):
        _session(awq_model((1,), k, n, g, np.float16, w1, w3, None, None, attrs={"group_size": g, "K": k, "N": 20}))


def test_awq_cuda_host_entry_checks_inputs():
    fc = _awq_cuda()
    from onnx_lowbit.custom_ops import KernelError
    w1, w3 = awq_weights(128, 16, 128)
    with pytest.raises(KernelError, match="input 4 'qweight3'"):
        fc.run(np.ones((1, 128), np.float32), w1, (w3[0][:64], w3[1], w3[2]), None, None, 128, 128, 16)


@pytest.mark.parametrize("m", [1, 2])
def test_nf4_default_is_warpcols_at_k2048(m, monkeypatch):
    """At M = 1, 2 with fp16 X and K = 2048 the kernel object routes to the warp-column kernel (pairs of warps at
    M = 2): the same bits as nf4warp_cuda's runner with the geometry the kernel object uses under the simulator
    (2 warps per column pair, 2 blocks), and within fp16 rounding of the block kernel in the same arithmetic."""
    fc = _nf4_cuda()
    from onnx_lowbit.custom_ops.nf4 import nf4warp_cuda
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    k, n, bs = 2048, 5, 64
    ws = nf4_weights(k, n, bs, "nf4", seed=11)
    x, b1, b3 = _data((m,), k, n, np.float16, (True, False), 12)
    s, name = nf4_cuda_call(x, ws, "nf4", bs, k, n, b1, b3)
    warps, split = fc.WARPCOLS[(m, 2)]
    assert name == f"nf4warp.mt{m}.c2" + (".s2" if split == 2 else "")
    wc = nf4warp_cuda.run_arrays(x, *ws, "nf4", bs, k, n, b1, b3, warps=2 * split if SIM else warps,
                                 blocks=2 if SIM else None, split=split)
    assert np.array_equal(s.view(np.uint16), wc.view(np.uint16))
    _nf4_setting(fc, monkeypatch, "block+wide")
    blk, name = nf4_cuda_call(x, ws, "nf4", bs, k, n, b1, b3)
    assert name.startswith(f"decode.mt{m}.wide") and _rel(s, blk) <= _tol(np.float16)


def test_nf4_cuda_session_warpcols(monkeypatch):
    """FusedFFNNF4 nodes in onnxruntime CUDA sessions at M = 1 and 2 with fp16 X and K = 2048 (GPU machine only)
    take the warp-column kernel (WARPCOLS): outputs against the block kernel in the same arithmetic and the
    reference, the same bits on a second run."""
    from helpers import lowbit_session, ort_cuda_or_skip
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda as fc
    from onnx_lowbit.custom_ops.runtime import bridge
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    k, n, bs = 2048, 300, 64
    ws = nf4_weights(k, n, bs, "nf4", seed=6)
    for lead in ((1, 1), (2,)):
        x, b1, b3 = _data(lead, k, n, np.float16, (True, True), 7)
        sess = lowbit_session(nf4_model(lead, k, n, bs, "nf4", np.float16, ws, b1, b3), ["CUDAExecutionProvider"])
        s1 = sess.run(None, {"x": x})[0]
        s2 = sess.run(None, {"x": x})[0]
        assert np.array_equal(s1.view(np.uint16), s2.view(np.uint16))
        ks = [kk for kk in list(bridge._kernels.values()) if isinstance(kk, fc.FusedFFNNF4CudaKernel)
              and kk.k == k and kk.n == n]
        assert ks and all(route(fc.ROUTES, kk.case(m)).kernel.startswith("nf4warp.") for kk in ks for m in (1, 2))
        with monkeypatch.context() as mp:
            _nf4_setting(fc, mp, "block+wide")
            blk, _ = nf4_cuda_call(x, ws, "nf4", bs, k, n, b1, b3)
        assert _rel(s1, blk) <= _tol(np.float16), lead
        assert _rel(s1, ffn.swiglu_nf4_ref(x, *ws, "nf4", bs, k, n, b1, b3)) <= 4 * _tol(np.float16), lead


@pytest.mark.parametrize("wide_min_k", [0, 1 << 20])
def test_nf4_cuda_session_m1_decode(wide_min_k, monkeypatch):
    """A FusedFFNNF4 node in an onnxruntime CUDA session at M = 1 with fp16 X (GPU machine only) runs the
    packed-fp16 decode, with chains of 4 and two words per thread and row (WIDE_MIN_K lowered so that a small
    weight takes it; blocks of thread groups on GROUPS_CARDS) and without: outputs against the reference, the same
    bits on a second run."""
    from helpers import lowbit_session, ort_cuda_or_skip
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda as fc
    monkeypatch.setattr(fc, "WIDE_MIN_K", wide_min_k)
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    k, n, bs = 512, 72, 64
    ws = nf4_weights(k, n, bs, "nf4", seed=4)
    x, b1, b3 = _data((1, 1), k, n, np.float16, (True, True), 5)
    from onnx_lowbit.custom_ops.runtime import bridge
    before = set(bridge._kernels)
    sess = lowbit_session(nf4_model((1, 1), k, n, bs, "nf4", np.float16, ws, b1, b3), ["CUDAExecutionProvider"])
    s1 = sess.run(None, {"x": x})[0]
    s2 = sess.run(None, {"x": x})[0]
    assert np.array_equal(s1.view(np.uint16), s2.view(np.uint16))
    assert _rel(s1, ffn.swiglu_nf4_ref(x, *ws, "nf4", bs, k, n, b1, b3)) <= _tol(np.float16)
    ks = [kk for kid, kk in list(bridge._kernels.items()) if kid not in before and
          isinstance(kk, fc.FusedFFNNF4CudaKernel)]
    want = "decode.mt1.h2" if wide_min_k else "decode.mt1.wide.g3" if fc.grouped_card() else "decode.mt1.wide"
    assert ks and all(route(fc.ROUTES, kk.case(1)).kernel == want for kk in ks)


@pytest.mark.parametrize("n", [61, 200, 8])
def test_nf4_wide_groups_same_bits(n, monkeypatch):
    """Blocks of 3 thread groups sharing one table (decode.mt1.wide.g3): each group on its own column slice, every
    group walking the longest slice's steps (n = 200: slices of different step counts; n = 8: empty slices). The
    same bits as one group per block (decode.mt1.wide), biases or not."""
    fc = _nf4_cuda()
    monkeypatch.delenv("ONNX_LOWBIT_FP32_DECODE", raising=False)
    monkeypatch.setattr(fc, "WIDE_MIN_K", 0)
    k, bs = 256, 64
    ws = nf4_weights(k, n, bs, "nf4", seed=37)
    x, b1, b3 = _data((1,), k, n, np.float16, (n != 8, True), 41)
    with monkeypatch.context() as mp:
        mp.setattr(fc, "grouped", lambda a16, k: True)
        got, name = nf4_cuda_call(x, ws, "nf4", bs, k, n, b1, b3)
    assert name == "decode.mt1.wide.g3"
    _nf4_setting(fc, monkeypatch, "ungrouped")
    base, name = nf4_cuda_call(x, ws, "nf4", bs, k, n, b1, b3)
    assert name == "decode.mt1.wide"
    assert np.array_equal(base.view(np.uint16), got.view(np.uint16))
    assert _rel(got, ffn.swiglu_nf4_ref(x, *ws, "nf4", bs, k, n, b1, b3)) <= 4 * _tol(np.float16)
