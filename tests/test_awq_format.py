"""AWQ int4 GEMM layout (onnx_lowbit.awq): numpy properties, the activation-aware scale search, and agreement with
AutoAWQ's own packing/unpacking.

The AutoAWQ comparisons skip (with a reason) when torch or the autoawq package is not installed. ``import awq``
itself needs transformers and accelerate, so the two plain-torch modules used here (awq/utils/packing_utils.py and
awq/modules/linear/gemm.py) are loaded from the installed package's files with small stand-ins for its heavy
imports; autoawq can be installed with --no-deps. Verified with autoawq 0.2.9 on torch 2.13.0 (CPU).
"""
import ast
import importlib
import importlib.util
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_lowbit import awq


def _codes(rng, K, N, G):
    Kp = awq.padded_rows(K, G)
    return (rng.integers(0, 16, (Kp, N), dtype=np.uint8), rng.integers(0, 16, (Kp // G, N), dtype=np.uint8),
            (rng.uniform(0.001, 0.1, (Kp // G, N))).astype(np.float16))


# ---------------------------------------------------------------------------------------------------------------
# numpy-only properties


def test_nibble_order():
    q = np.arange(8, dtype=np.uint8)[None, :]            # columns 0..7 hold the values 0..7
    packed = awq.pack_int4(q)
    assert packed.dtype == np.int32 and packed.shape == (1, 1)
    assert int(packed.view(np.uint32)[0, 0]) == 0x75316420  # nibble i (LSB first) = column PACK_ORDER[i]
    np.testing.assert_array_equal(awq.unpack_int4(packed), q)
    hi = np.full((1, 8), 15, np.uint8)                    # the top nibble set: a negative int32, same bits
    assert int(awq.pack_int4(hi)[0, 0]) == -1


@settings(max_examples=40, deadline=None)
@given(R=st.integers(1, 40), C8=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(R, C8, seed):
    v = np.random.default_rng(seed).integers(0, 16, (R, 8 * C8), dtype=np.uint8)
    p = awq.pack_int4(v)
    assert p.shape == (R, C8) and p.dtype == np.int32
    np.testing.assert_array_equal(awq.unpack_int4(p), v)


def test_pack_and_dequantize():
    rng = np.random.default_rng(0)
    K, N, G = 200, 24, 64                                  # K not a multiple of G: Kp = 256
    q, z, s = _codes(rng, K, N, G)
    qweight, qzeros, scales = awq.pack(q, z, s)
    assert qweight.shape == (256, 3) and qzeros.shape == (4, 3) and scales.dtype == np.float16
    q2, z2 = awq.unpack(qweight, qzeros)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(z2, z)
    w = awq.dequantize(qweight, qzeros, scales, G, K, N)
    assert w.dtype == np.float16 and w.shape == (K, N)
    expect = ((q.astype(np.float64) - np.repeat(z, G, 0)) * np.repeat(s.astype(np.float64), G, 0)).astype(np.float16)
    np.testing.assert_array_equal(w, expect[:K])


def test_validation_messages():
    rng = np.random.default_rng(1)
    qweight, qzeros, scales = awq.pack(*_codes(rng, 128, 16, 64))
    awq.validate(qweight, qzeros, scales, 64, 128, 16)
    with pytest.raises(ValueError, match="multiple of 8"):
        awq.dequantize(qweight, qzeros, scales, 64, 128, 12)
    with pytest.raises(ValueError, match=r"qweight must have shape \(192, 2\)"):
        awq.dequantize(qweight, qzeros, scales, 64, 129, 16)
    with pytest.raises(ValueError, match="qzeros must be int32"):
        awq.dequantize(qweight, qzeros.astype(np.int64), scales, 64, 128, 16)
    with pytest.raises(ValueError, match="scales must be float16"):
        awq.dequantize(qweight, qzeros, scales.astype(np.float32), 64, 128, 16)
    with pytest.raises(ValueError, match="group_size"):
        awq.dequantize(qweight, qzeros, scales, 0, 128, 16)
    with pytest.raises(ValueError, match="0..15"):
        awq.pack_int4(np.full((1, 8), 16))
    with pytest.raises(ValueError, match="multiple of 8"):
        awq.quantize_rtn(np.zeros((4, 12), np.float32), 4)
    with pytest.raises(ValueError, match="NaN"):
        awq.quantize_rtn(np.full((4, 8), np.nan, np.float32), 4)


def test_rtn_error_bound_and_padding():
    rng = np.random.default_rng(2)
    K, N, G = 300, 32, 128
    w = rng.standard_normal((K, N)).astype(np.float32)
    qweight, qzeros, scales = awq.quantize_rtn(w, G)
    assert qweight.shape == (384, 4) and scales.shape == (3, N)
    wd = awq.dequantize(qweight, qzeros, scales, G, K, N).astype(np.float32)
    step = np.repeat(scales.astype(np.float32), G, 0)[:K]
    assert np.all(np.abs(wd - w) <= 0.5 * step * 1.01 + 1e-3 * np.abs(w))
    # zero-padding: the same tensors as quantising the explicitly padded matrix; padded rows dequantise to 0
    padded = np.concatenate([w, np.zeros((384 - K, N), np.float32)])
    for a, b in zip(awq.quantize_rtn(padded, G), (qweight, qzeros, scales)):
        np.testing.assert_array_equal(a, b)
    assert not np.any(awq.dequantize(qweight, qzeros, scales, G, 384, N)[K:].astype(np.float32))
    # AutoAWQ's zero point: round(-min / scale) clamped to 0..15 (min > 0 -> 0)
    z = awq.rtn_codes(np.abs(w) + 1.0, G)[1]
    assert not z.any()


def test_matmul_reference():
    rng = np.random.default_rng(3)
    K, N, G = 96, 16, 32
    w = rng.standard_normal((K, N)).astype(np.float32)
    qweight, qzeros, scales = awq.quantize_rtn(w, G)
    wd = awq.dequantize(qweight, qzeros, scales, G, K, N).astype(np.float64)
    a = rng.standard_normal((2, 5, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    y = awq.matmul(a, qweight, qzeros, scales, G, K, N, bias)
    assert y.shape == (2, 5, N) and y.dtype == np.float32
    np.testing.assert_array_equal(y, (a.astype(np.float64) @ wd + bias).astype(np.float32))
    assert awq.matmul(a.astype(np.float16), qweight, qzeros, scales, G, K, N).dtype == np.float16
    with pytest.raises(ValueError, match="last dimension"):
        awq.matmul(a[..., :-1], qweight, qzeros, scales, G, K, N)


def _outlier_problem(seed=0, K=512, N=256):
    """Gaussian weights; activations with per-channel magnitudes of which a few channels are 30x outliers."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
    mag = np.abs(rng.standard_normal(K) * 0.5 + 1.0)
    mag[rng.choice(K, 8, replace=False)] *= 30.0

    def acts(m):
        return (rng.standard_normal((m, K)) * mag).astype(np.float32)
    return w, acts(256), acts(512)


def test_awq_beats_rtn_on_held_out_activations():
    G = 128
    w, x_cal, x_test = _outlier_problem()
    K, N = w.shape
    found = awq.search_scales(w, x_cal, G, grid=20)
    assert found.scales.shape == (K,) and 0.0 <= found.alpha < 1.0
    assert found.err_awq <= found.err_rtn
    res = awq.quantize_awq(w, x_cal, G)
    np.testing.assert_allclose(res.act_scale, 1.0 / found.scales, rtol=1e-6)
    ref = x_test.astype(np.float64) @ w
    rtn = awq.quantize_rtn(w, G)
    y_rtn = awq.matmul(x_test, *rtn, G, K, N).astype(np.float64)
    y_awq = awq.matmul((x_test * res.act_scale).astype(np.float32), res.qweight, res.qzeros, res.scales, G, K, N)
    err_rtn = float(np.mean((ref - y_rtn) ** 2))
    err_awq = float(np.mean((ref - y_awq.astype(np.float64)) ** 2))
    print(f"\nAWQ alpha={found.alpha:.2f}; calibration MSE rtn={found.err_rtn:.4g} awq={found.err_awq:.4g}; "
          f"held-out MSE rtn={err_rtn:.4g} awq={err_awq:.4g} ({err_rtn / err_awq:.2f}x lower)")
    assert err_awq < err_rtn
    assert err_awq < 0.7 * err_rtn
    duo = awq.search_scales(w, x_cal, G, duo_scaling=True)  # AutoAWQ's default variant also helps here
    assert duo.err_awq < duo.err_rtn


def test_search_without_outliers_can_keep_rtn():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((128, 16)).astype(np.float32)
    x = np.ones((8, 128), np.float32)  # identical channel magnitudes: every alpha gives s = 1
    found = awq.search_scales(w, x, 64, grid=5)
    assert found.alpha == 0.0 and found.err_awq == found.err_rtn
    np.testing.assert_array_equal(found.scales, np.ones(128, np.float32))


# ---------------------------------------------------------------------------------------------------------------
# AutoAWQ


_AWQ_STANDINS = {"awq.utils.utils": {"get_best_device": lambda: "cpu"}}  # its real module imports accelerate


def _pseudo_quantize_from_source(path):
    """AutoAWQ's AwqQuantizer.pseudo_quantize_tensor, compiled from the installed source file on its own (the
    module around it imports transformers)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AwqQuantizer":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "pseudo_quantize_tensor":
                    fn.decorator_list = []
                    namespace = {"torch": importlib.import_module("torch")}
                    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), namespace)  # noqa: S102
                    return namespace["pseudo_quantize_tensor"]
    return None


@pytest.fixture(scope="module")
def autoawq():
    pytest.importorskip("torch", reason="the AutoAWQ comparisons need torch")
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed (pip install autoawq==0.2.9 --no-deps)")
    root = next(iter(spec.submodule_search_locations))
    saved = {k: v for k, v in sys.modules.items() if k == "awq" or k.startswith("awq.")}
    try:
        for k in saved:
            del sys.modules[k]
        pkg = types.ModuleType("awq")
        pkg.__path__ = [root]
        sys.modules["awq"] = pkg
        for name, attrs in _AWQ_STANDINS.items():
            stand_in = types.ModuleType(name)
            stand_in.__dict__.update(attrs)
            sys.modules[name] = stand_in
        try:
            packing = importlib.import_module("awq.utils.packing_utils")
            gemm = importlib.import_module("awq.modules.linear.gemm")
        except ImportError as e:
            pytest.skip(f"AutoAWQ's packing modules do not load here: {e}")
        pseudo_quantize = _pseudo_quantize_from_source(f"{root}/quantize/quantizer.py")
    finally:
        for k in [k for k in sys.modules if k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    import torch
    return types.SimpleNamespace(torch=torch, packing=packing, gemm=gemm, pseudo_quantize=pseudo_quantize)


_SHAPES = [(256, 64, 128), (128, 32, 32), (300, 32, 128), (96, 96, 32), (64, 8, 64), (200, 24, 64)]


def test_dequantize_matches_autoawq(autoawq):
    torch, pu = autoawq.torch, autoawq.packing
    rng = np.random.default_rng(5)
    for K, N, G in _SHAPES:
        for qweight, qzeros, scales in (awq.pack(*_codes(rng, K, N, G)),
                                        awq.quantize_rtn(rng.standard_normal((K, N)).astype(np.float32), G)):
            t = [torch.from_numpy(x) for x in (qweight, qzeros, scales)]
            ref = pu.dequantize_gemm(*t, 4, G)
            assert ref.dtype == torch.float16 and tuple(ref.shape) == (awq.padded_rows(K, G), N)
            mine = awq.dequantize(qweight, qzeros, scales, G, K, N)
            np.testing.assert_array_equal(mine.view(np.uint16), ref.numpy()[:K].view(np.uint16))
            # unpack_awq + reverse_awq_order (+ the & 0xF overflow fix) is our unpack
            iw, iz = pu.reverse_awq_order(*pu.unpack_awq(t[0], t[1], 4), 4)
            q, z = awq.unpack(qweight, qzeros)
            np.testing.assert_array_equal(q, (iw & 15).numpy())
            np.testing.assert_array_equal(z, (iz & 15).numpy())


def test_pack_matches_autoawq_from_linear(autoawq):
    """WQLinear_GEMM.from_linear packs round((W + z * s) / s); with s = 1 and W = q - z it packs exactly q and z.
    (from_linear itself only works for N a multiple of 32: it sizes qweight as N // 32 * 4 columns.)"""
    torch, gemm = autoawq.torch, autoawq.gemm
    rng = np.random.default_rng(6)
    for K, N, G in [(256, 64, 128), (128, 32, 32), (96, 96, 32), (64, 32, 64)]:
        q, z, _ = _codes(rng, K, N, G)
        linear = torch.nn.Linear(K, N, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy((q.astype(np.float32) - np.repeat(z, G, 0)).T.copy()))
        ones = np.ones((K // G, N), np.float16)
        m = gemm.WQLinear_GEMM.from_linear(linear, 4, G, scales=torch.from_numpy(ones),
                                           zeros=torch.from_numpy(z.astype(np.float32)))
        qweight, qzeros, scales = awq.pack(q, z, ones)
        np.testing.assert_array_equal(qweight, m.qweight.numpy())
        np.testing.assert_array_equal(qzeros, m.qzeros.numpy())
        np.testing.assert_array_equal(scales, m.scales.numpy())


def test_rtn_matches_autoawq_pseudo_quantize(autoawq):
    """Our RTN on fp16 weights (AutoAWQ's usual dtype) against AutoAWQ's own pseudo_quantize_tensor: the same
    scales, zero points and dequantised weights, bit for bit; on fp32 weights within the fp16 rounding of the
    scale."""
    torch, fn = autoawq.torch, autoawq.pseudo_quantize
    if fn is None:
        pytest.skip("AwqQuantizer.pseudo_quantize_tensor not found in this AutoAWQ version")
    rng = np.random.default_rng(7)
    self = types.SimpleNamespace(group_size=None, zero_point=True, w_bit=4)
    for K, N, G in [(512, 64, 128), (256, 40, 64), (128, 16, 32)]:
        self.group_size = G
        w = (rng.standard_normal((K, N)) * rng.uniform(0.01, 1)).astype(np.float32)
        w[:G, 0] = np.abs(w[:G, 0]) + 0.5                 # a group with min > 0: zero point clamps to 0
        w[G:2 * G, 1] = 0.0                                # a constant group: span clamps to 1e-5
        w16 = w.astype(np.float16)
        wq, s_ref, z_ref = fn(self, torch.from_numpy(np.ascontiguousarray(w16.T)))
        q, z, s = awq.rtn_codes(w16, G)
        np.testing.assert_array_equal(s.view(np.uint16), s_ref.numpy().T.view(np.uint16))
        np.testing.assert_array_equal(z, z_ref.numpy().T.astype(np.uint8))
        mine = awq.dequantize(*awq.pack(q, z, s), G, K, N)
        np.testing.assert_array_equal(mine.view(np.uint16), wq.numpy().T.view(np.uint16))
        # fp32 weights: AutoAWQ keeps fp32 scales; ours are those rounded to fp16
        wq32, s32, z32 = fn(self, torch.from_numpy(np.ascontiguousarray(w.T)))
        q, z, s = awq.rtn_codes(w, G)
        np.testing.assert_allclose(s.astype(np.float32), s32.numpy().T, rtol=1e-3, atol=6e-8)  # fp16 subnormals
        assert np.mean(z == z32.numpy().T) > 0.95
        step = np.repeat(s.astype(np.float32), G, 0)
        assert np.all(np.abs(awq.fake_quantize(w, G) - wq32.numpy().T) <= 1.01 * step)
