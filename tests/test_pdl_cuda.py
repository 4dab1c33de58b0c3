"""Programmatic dependent launch (custom_ops/device/pdl.py): the decode kernels that may start before the kernel
before them ends (MatMulNF4's m1 / m2, FusedFFNNF4's decode and warp-column kernels, CacheAttention's decode)
read what that kernel wrote only after ``pdl.wait()``.

The decode chain of one LLaMA layer (q/k/v product -> CacheAttention -> o product -> FusedFFNNF4 -> down product),
every node a kernel object with constant weights (as a session's initializers), launched back to back on one
stream, a new X each round: each stage is checked against the reference applied to the output the stage before
actually left, so a kernel that read its input before the previous kernel had written it (the last round's
values) fails. On a GPU of compute capability 9.0+ the launches are PDL (asserted); elsewhere, and under the
simulator, the same code in order. Plan recording: a PDL launch is recorded as such (runtime/plans.PDL)."""
import os

import numpy as np
import pytest
from numba import config

from helpers import gpu_or_sim
from onnx_lowbit import cacheattention as ca
from onnx_lowbit import ffn, nf4

SIM = bool(config.ENABLE_CUDASIM)
F16 = np.float16


def _dev(a):
    if SIM:
        from test_nf4_kernels import _HostArray
        return _HostArray(a)
    from numba import cuda
    return cuda.to_device(np.ascontiguousarray(a))


def _host(d):
    return d.host.copy() if SIM else d.copy_to_host()


def _rel(got, want):
    got, want = got.astype(np.float64), want.astype(np.float64)
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / max(1e-6, np.abs(want).max()))


def _weights(rng, k, n, qt="nf4", bs=64):
    q, am = nf4.quantize((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), qt, bs)
    return q.reshape(-1), am.reshape(-1).astype(np.float32)


# (heads, kv heads, head size, hidden, intermediate, history keys, rounds); GPU: the d = 2048 genai config's shapes
CASES = [(1, 1, 64, 64, 128, 5, 1)] if SIM else [(16, 16, 128, 2048, 8192, 200, 20), (4, 2, 64, 256, 1024, 5, 5)]


@pytest.mark.parametrize("hq,hkv,d,hidden,inter,hist,rounds", CASES)
def test_decode_chain_reads_what_the_kernel_before_wrote(hq, hkv, d, hidden, inter, hist, rounds):
    gpu_or_sim()
    from onnx_lowbit.custom_ops.runtime import direct
    rng = np.random.default_rng(7)
    nqkv = (hq + 2 * hkv) * d
    w_qkv, w_o, w_down = _weights(rng, hidden, nqkv), _weights(rng, hq * d, hidden), _weights(rng, inter, hidden)
    w_1, w_3 = _weights(rng, hidden, inter), _weights(rng, hidden, inter)
    p = hist                                         # share_buffer 0: past of hist keys, present of hist + 1
    pk = rng.standard_normal((1, hkv, p, d)).astype(F16)
    pv = rng.standard_normal((1, hkv, p, d)).astype(F16)
    sl = np.full(1, hist, np.int32)                  # hist keys in the cache, the new one at position hist
    ang = np.arange(p + 8)[:, None] / (10000 ** (np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(ang).astype(F16), np.sin(ang).astype(F16)

    x = _dev(np.zeros((1, 1, hidden), F16))
    qkv, o = _dev(np.zeros((1, 1, nqkv), F16)), _dev(np.zeros((1, 1, hq * d), F16))
    ok, ov = _dev(np.zeros((1, hkv, p + 1, d), F16)), _dev(np.zeros((1, hkv, p + 1, d), F16))
    h, s, y = _dev(np.zeros((1, 1, hidden), F16)), _dev(np.zeros((1, 1, inter), F16)), _dev(np.zeros((1, 1, hidden),
                                                                                                 F16))
    stream = 0
    if not SIM:
        from numba import cuda
        st = cuda.stream()
        stream = int(st.handle)
    dw = {k: tuple(_dev(a) for a in v) for k, v in
          dict(qkv=w_qkv, o=w_o, down=w_down, w1=w_1, w3=w_3).items()}
    mm = lambda name, a, out, k, n: direct.call(  # noqa: E731
        "MatMulNF4", dict(quant_type="nf4", block_size=64, K=k, N=n), [a, *dw[name]], [out], stream, name,
        constants=(1, 2))
    steps = [
        mm("qkv", x, qkv, hidden, nqkv),
        direct.call("CacheAttention", dict(num_heads=hq, kv_num_heads=hkv, scale=0.0, share_buffer=0),
                    [qkv, _dev(pk), _dev(pv), _dev(sl), _dev(cos), _dev(sin)], [o, ok, ov], stream, "attn"),
        mm("o", o, h, hq * d, hidden),
        direct.call("FusedFFNNF4", dict(quant_type="nf4", block_size=64, K=hidden, N=inter),
                    [h, *dw["w1"], *dw["w3"]], [s], stream, "ffn", constants=(1, 2, 3, 4)),
        mm("down", s, y, inter, hidden),
    ]
    if not SIM:
        from onnx_lowbit.custom_ops.device.launch import current_device, pdl_enabled
        assert all(f.kernel.pdl for f in (steps[0], steps[2], steps[3], steps[4]))
        cc9 = cuda.get_current_device().compute_capability >= (9, 0)
        assert pdl_enabled(current_device()) == (cc9 and os.environ.get("ONNX_LOWBIT_PDL", "1") != "0")
    for r in range(rounds):
        xh = (rng.standard_normal((1, 1, hidden)) * (1 + r)).astype(F16)
        if SIM:
            x.host[...] = xh
        else:
            x.copy_to_device(xh, stream=st)
        for f in steps:
            f()
        if not SIM:
            st.synchronize()
        xq, got_qkv, got_o, got_h, got_s, got_y = (_host(a) for a in (x, qkv, o, h, s, y))
        assert _rel(got_qkv, nf4.matmul(xq, *w_qkv, "nf4", 64, hidden, nqkv)) < 2e-2, r
        want_o = ca.apply(got_qkv, pk, pv, sl, cos, sin, hq, hkv, 0.0, 0)[0]
        assert _rel(got_o, want_o) < 2e-2, r
        assert _rel(got_h, nf4.matmul(got_o, *w_o, "nf4", 64, hq * d, hidden)) < 2e-2, r
        assert _rel(got_s, ffn.swiglu_nf4_ref(got_h, *w_1, *w_3, "nf4", 64, hidden, inter)) < 2e-2, r
        assert _rel(got_y, nf4.matmul(got_s, *w_down, "nf4", 64, inter, hidden)) < 2e-2, r


def test_weights_not_constant_launch_in_order():
    """Without constant weights (a node fed by another node's output) the products launch in order: their kernels
    read the weights before pdl.wait."""
    gpu_or_sim()
    from onnx_lowbit.custom_ops.runtime import direct
    rng = np.random.default_rng(3)
    q, am = _weights(rng, 256, 64)
    a, y = _dev(rng.standard_normal((1, 256)).astype(F16)), _dev(np.zeros((1, 64), F16))
    attrs = dict(quant_type="nf4", block_size=64, K=256, N=64)
    assert not direct.call("MatMulNF4", attrs, [a, _dev(q), _dev(am)], [y], 0).kernel.pdl
    assert direct.call("MatMulNF4", attrs, [a, _dev(q), _dev(am)], [y], 0, constants=(1, 2)).kernel.pdl


def test_recorder_marks_pdl_steps():
    from onnx_lowbit.custom_ops.runtime import plans
    rec = plans.Recorder([], [])
    rec.launch(1, 2, 32, 0, [0], [])
    rec.mark_pdl()
    assert rec.steps[-1][0] == plans.PDL
    rec.gemm(5, [0] * plans.GEMM_ARGS, [])
    with pytest.raises(ValueError):
        rec.mark_pdl()
