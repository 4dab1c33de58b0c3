"""CacheAttention: reference (onnx_lowbit.cacheattention) against onnxruntime's own GroupQueryAttention (CPU EP),
CPU face (custom_ops/attention/cacheattention_cpu.py) and CUDA face (custom_ops/attention/cacheattention_cuda.py;
under Numba's CUDA simulator in CI, on the GPU with ONNX_LOWBIT_REAL_GPU=1) against the reference, the pass
(passes/cacheattention.py) on genai's spelling, and sessions: the rewritten graph gives the GroupQueryAttention
graph's outputs (CPU EP; on a GPU with onnxruntime-gpu, the CUDA EP, with the shared past / present buffer genai
binds).

The sums run in fp32 in other orders than the reference's, so outputs agree within those sums (fp32) or one fp16
rounding (fp16); the present caches (copies and rotated keys rounded once) are bit-exact.
"""
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import direct_run, gpu_or_sim, lowbit_session, ort_cuda_or_skip
from onnx_lowbit import cacheattention as ca
from onnx_lowbit.custom_ops.attention import cacheattention_cpu, cacheattention_cuda
from onnx_lowbit.custom_ops.device import host
from onnx_lowbit.custom_ops.runtime import routing
from onnx_lowbit.custom_ops.runtime.kernels import KernelError
from onnx_lowbit.passes import run_passes

F16, F32 = np.float16, np.float32
ET = {F16: TensorProto.FLOAT16, F32: TensorProto.FLOAT}
TOL = {F32: 2e-6, F16: 2e-3}


def _tables(dt, d, m=128):
    inv = 1.0 / (10000 ** (np.arange(0, d, 2) / d))
    ang = np.arange(m)[:, None] * inv[None, :]
    return np.cos(ang).astype(dt), np.sin(ang).astype(dt)


def _call(dt, hq, hkv, d, b, s, p, share, hist, seed=0, lengths=None):
    """The six inputs of a call: ``hist`` keys before the new tokens (every row, or ``lengths`` per row: total
    lengths), past of length p (the shared buffer's length when ``share``)."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((b, s, (hq + 2 * hkv) * d)).astype(dt)
    pk = rng.standard_normal((b, hkv, p, d)).astype(dt)
    pv = rng.standard_normal((b, hkv, p, d)).astype(dt)
    tot = s + hist
    sl = (np.asarray(lengths, np.int32) - 1) if lengths is not None else np.full(b, tot - 1, np.int32)
    cos, sin = _tables(dt, d, max(128, p + s))
    return [qkv, pk, pv, sl, cos, sin]


def _close(got, want, dt, exact=False):
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.array_equal(np.isnan(g), np.isnan(w)) and np.array_equal(np.isposinf(g), np.isposinf(w))
    assert np.array_equal(np.isneginf(g), np.isneginf(w))
    fin = np.isfinite(w)
    if exact:
        assert np.array_equal(g[fin], w[fin])
        return
    if fin.any():
        assert float(np.abs(g[fin] - w[fin]).max()) <= TOL[dt] * max(1.0, float(np.abs(w[fin]).max()))


def _check(got, want, dt):
    """(O, present_key, present_value) against the reference's: O within the sums' order, the caches exactly."""
    for g, w, exact in zip(got, want, (False, True, True)):
        _close(g, w, dt, exact)


def _gqa_model(dt, hq, hkv, scale=0.0, **attrs):
    et = ET[dt]
    ins = [helper.make_tensor_value_info(n, t, None) for n, t in
           [("qkv", et), ("pk", et), ("pv", et), ("sl", TensorProto.INT32), ("tot", TensorProto.INT32), ("cos", et),
            ("sin", et)]]
    outs = [helper.make_tensor_value_info(n, et, None) for n in ("o", "k", "v")]
    a = dict(num_heads=hq, kv_num_heads=hkv, scale=scale, do_rotary=1, rotary_interleaved=0, local_window_size=-1,
             softcap=0.0)
    a.update(attrs)
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "sl", "tot", "cos", "sin"],
                            ["o", "k", "v"], domain="com.microsoft", name="gqa", **a)
    g = helper.make_graph([node], "g", ins, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


# (Hq, Hkv, D, B, [S per step]): a prompt, decode steps, then (batch 1) a continuation of two tokens
GENERATIONS = [(4, 2, 16, 2, [5, 1, 1]), (4, 4, 16, 1, [3, 1, 2]), (6, 2, 32, 1, [7, 1, 1, 3])]


@pytest.mark.parametrize("dt", [F32, F16])
@pytest.mark.parametrize("share", [0, 1])
@pytest.mark.parametrize("gen", GENERATIONS)
def test_reference_is_onnxruntimes_group_query_attention(dt, share, gen):
    """Prompt, decode and continuation steps fed back as genai does (the present caches become the next past):
    the reference's outputs equal onnxruntime's GroupQueryAttention (CPU EP) within the sums' order, its caches
    exactly in fp16 (fp32: within an ulp, onnxruntime's rotation rounds its products in another way); with
    share_buffer the caches keep the buffer's length (onnxruntime: present = max(total, past))."""
    hq, hkv, d, b, steps = gen
    sess = ort.InferenceSession(_gqa_model(dt, hq, hkv).SerializeToString(), providers=["CPUExecutionProvider"])
    cos, sin = _tables(dt, d)
    pk = np.zeros((b, hkv, 16 if share else 0, d), dt)
    pv = pk.copy()
    rng = np.random.default_rng(1)
    total = 0
    for s in steps:
        total += s
        qkv = rng.standard_normal((b, s, (hq + 2 * hkv) * d)).astype(dt)
        feeds = dict(qkv=qkv, pk=pk, pv=pv, sl=np.full(b, total - 1, np.int32), tot=np.array([total], np.int32),
                     cos=cos, sin=sin)
        o, k, v = sess.run(None, feeds)
        ro, rk, rv = ca.apply(qkv, pk, pv, feeds["sl"], cos, sin, hq, hkv, 0.0, share)
        assert rk.shape == k.shape
        _close(ro, o, dt)
        for got, want in ((rk, k), (rv, v)):
            _close(got[:, :, :total], want[:, :, :total], dt, exact=dt == F16)
        pk, pv = k, v


CASES = [  # (Hq, Hkv, D, B, S, P, share, hist): decode through the warp kernel (D / 8 fp16 or 4 fp32 dims a power of
    # two: shared buffer, several splits; two buffers, batch 2; a continuation of 3 tokens; 120 keys; D = 8: one
    # or two lanes per key), and through the first kernel (D = 6, D = 96)
    (4, 2, 32, 1, 1, 40, 1, 37), (4, 2, 32, 2, 1, 7, 0, 7), (2, 2, 32, 1, 3, 20, 1, 4), (1, 1, 64, 1, 1, 130, 1, 120),
    (2, 1, 8, 1, 5, 0, 0, 0), (3, 1, 6, 1, 1, 9, 0, 9), (1, 1, 8, 1, 1, 70, 1, 65), (2, 1, 96, 1, 1, 12, 1, 10)]
ROWS_CASES = [(2, 1, 8, 1, 5, 0, 0, 0), (2, 2, 8, 1, 3, 40, 1, 33)]    # through the rows kernel (SPLIT_ROWS lowered)
GPU_CASES = [  # genai-sized, on the GPU only: decode, then prompts (the tensor-core route), one after 700 tokens
    (16, 16, 128, 1, 1, 2048, 1, 1000), (32, 8, 128, 1, 1, 4096, 1, 3000), (9, 3, 64, 1, 1, 2048, 1, 700),
    (16, 16, 128, 1, 300, 2048, 1, 0), (9, 3, 64, 1, 128, 2048, 1, 0), (8, 2, 128, 1, 200, 2048, 1, 700),
    (8, 2, 128, 2, 100, 300, 0, 300)]


@pytest.mark.parametrize("dt", [F32, F16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_kernel(case, dt):
    hq, hkv, d, b, s, p, share, hist = case
    args = _call(dt, hq, hkv, d, b, s, p, share, hist)
    want = ca.apply(*args, hq, hkv, 0.0, share)
    got = cacheattention_cpu.run(*args, hq, hkv, 0.0, share)
    _check(got, want, dt)


def _cuda(args, hq, hkv, share, scale=0.0):
    qkv, pk = args[0], args[1]
    b, s, d, p, length = ca.dims(qkv.shape, pk.shape, args[5].shape, hq, hkv, share)
    dt = qkv.dtype
    return direct_run("CacheAttention", dict(num_heads=hq, kv_num_heads=hkv, scale=scale, share_buffer=share), args,
                      [((b, s, hq * d), dt), ((b, hkv, length, d), dt), ((b, hkv, length, d), dt)])


def _cuda_case(case, dt, seed):
    """One (Hq, Hkv, D, B, S, P, share, hist) case through the CUDA face, checked against the reference."""
    hq, hkv, d, b, s, p, share, hist = case
    args = _call(dt, hq, hkv, d, b, s, p, share, hist, seed=seed)
    _check(_cuda(args, hq, hkv, share), ca.apply(*args, hq, hkv, 0.0, share), dt)


@pytest.mark.parametrize("dt", [F32, F16])
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel(case, dt):
    gpu_or_sim()
    _cuda_case(case, dt, 2)


@pytest.mark.parametrize("dt", [F32, F16])
@pytest.mark.parametrize("case", ROWS_CASES)
def test_cuda_rows_kernel(case, dt, monkeypatch):
    """The rows route (one block per query row over all its keys, what a long prompt takes), on small shapes."""
    gpu_or_sim()
    monkeypatch.setattr(cacheattention_cuda, "SPLIT_ROWS", 1)
    _cuda_case(case, dt, 7)


TC_CASES = [(2, 1, 16, 1, 40, 0, 0, 0), (2, 2, 32, 2, 20, 48, 1, 5), (2, 1, 16, 1, 70, 0, 0, 0),
            (2, 1, 16, 2, 20, 10, 0, 10)]


@pytest.mark.parametrize("case", TC_CASES)
def test_cuda_tc_prompt_kernel(case, monkeypatch):
    """The tensor-core prompt route (fp16, tiles of 64 query rows x 32 keys) and its append, on small shapes: a first
    prompt over two key tiles, a batch of two continuing a shared buffer, two query tiles, a batch of two continuing
    past in two buffers (the append copies past's 10 positions into present)."""
    gpu_or_sim()
    monkeypatch.setattr(cacheattention_cuda, "SPLIT_ROWS", 1)
    _cuda_case(case, F16, 12)


@pytest.mark.parametrize("sms", [1, 3, 4])
def test_cuda_tc_prompt_kernel_block_order(sms, monkeypatch):
    """The tensor-core route's block order (the heaviest query tiles first, every other round of ``sms`` blocks
    turned back) gives every tile one block: three query tiles x two heads (6 blocks) in rounds of 1, 3 and 4."""
    gpu_or_sim()
    monkeypatch.setattr(cacheattention_cuda, "SPLIT_ROWS", 1)
    monkeypatch.setattr(host, "sm_count", lambda: sms)
    _cuda_case((2, 1, 16, 1, 130, 0, 0, 0), F16, 17)


def test_cuda_tc_prompt_kernel_padded_rows_and_a_scale(monkeypatch):
    """A right-padded first prompt (rows of 12 and 7 tokens) and an explicit scale through the tensor-core route."""
    gpu_or_sim()
    monkeypatch.setattr(cacheattention_cuda, "SPLIT_ROWS", 1)
    args = _call(F16, 2, 1, 16, 2, 12, 0, 0, 0, seed=13, lengths=[12, 7])
    want = ca.apply(*args, 2, 1, 0.3, 0)
    _check(_cuda(args, 2, 1, 0, 0.3), want, F16)


def test_cuda_tc_prompt_kernel_nan_query_and_stale_buffer(monkeypatch):
    """The tensor-core route: a NaN in one query row gives that row NaN; NaN keys and Inf values left in the shared
    buffer past the prompt (a previous sequence's, or never written) are not read (its last key tile stops at the
    rows' length), so the other rows match the reference and the buffer past the prompt keeps its bits."""
    gpu_or_sim()
    monkeypatch.setattr(cacheattention_cuda, "SPLIT_ROWS", 1)
    args = _call(F16, 2, 1, 16, 1, 40, 64, 1, 0, seed=14)
    args[1][:, :, 40:] = np.nan
    args[2][:, :, 40:] = np.inf
    args[0][0, 5, 0] = np.nan                           # query head 0 of token 5
    want = ca.apply(*args, 2, 1, 0.0, 1)
    assert np.isnan(want[0][0, 5, :16]).all() and np.isfinite(np.delete(want[0][0], 5, axis=0)).all()
    _check(_cuda(args, 2, 1, 1), want, F16)


@pytest.mark.parametrize("dt", [F32, F16])
def test_cpu_kernel_in_place_on_a_long_buffer(dt):
    """genai's shared buffer (past and present one array, far longer than the tokens so far): the CPU face writes
    only the new tokens' positions (the rest of the buffer, past's keys and the unused tail, keeps its bits) and
    matches the reference, batch rows of different lengths."""
    args = _call(dt, 4, 2, 16, 2, 1, 64, 1, 0, seed=11, lengths=[9, 5])
    want = ca.apply(*args, 4, 2, 0.0, 1)
    pk, pv = args[1].copy(), args[2].copy()
    o, k, v = cacheattention_cpu.run(*args[:1], pk, pv, *args[3:], 4, 2, 0.0, 1, None, pk, pv)
    assert k is pk and v is pv
    _check((o, k, v), want, dt)
    new = np.zeros(pk.shape, bool)
    new[0, :, 8], new[1, :, 4] = True, True
    np.testing.assert_array_equal(k[~new], args[1][~new])
    np.testing.assert_array_equal(v[~new], args[2][~new])


@pytest.mark.parametrize("dt", [F32, F16])
def test_cuda_warp_kernel_several_steps_per_block(dt, monkeypatch):
    """One block per row (NSPLIT lowered) over 301 keys: the block's warps take several steps of G loads each (fp32:
    64 keys per step of the block, 5 steps; fp16: 128, 3 steps)."""
    gpu_or_sim()
    monkeypatch.setattr(cacheattention_cuda, "NSPLIT", 1)
    args = _call(dt, 2, 1, 32, 1, 1, 310, 1, 300, seed=9)
    want = ca.apply(*args, 2, 1, 0.0, 1)
    _check(_cuda(args, 2, 1, 1), want, dt)


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_large(case):
    """genai-sized calls (decode over long caches: many splits; prompts: the tensor-core route, one continuing past
    in two buffers), on a real GPU."""
    if os.environ.get("ONNX_LOWBIT_REAL_GPU") != "1":
        pytest.skip("large shapes: real GPU only")
    _cuda_case(case, F16, 8)


def test_kernels_rows_of_different_lengths_and_a_scale():
    """Batch rows with other lengths (decode of a right-padded batch) and an explicit scale."""
    args = _call(F32, 2, 1, 32, 3, 1, 12, 1, 0, seed=3, lengths=[12, 5, 9])
    want = ca.apply(*args, 2, 1, 0.3, 1)
    _check(cacheattention_cpu.run(*args, 2, 1, 0.3, 1), want, F32)
    gpu_or_sim()
    _check(_cuda(args, 2, 1, 1, 0.3), want, F32)


@pytest.mark.parametrize("dt", [F32, F16])
def test_kernels_nan_and_inf(dt):
    """A NaN in a query gives a NaN row; an Inf in a new value makes that column non-finite where it counts."""
    args = _call(dt, 2, 1, 32, 1, 1, 10, 1, 6, seed=4)
    args[0][0, 0, 0] = np.nan                           # query head 0 of the new token
    args[0][0, 0, (2 + 1) * 32 + 3] = np.inf            # the new token's v, dim 3
    want = ca.apply(*args, 2, 1, 0.0, 1)
    assert np.isnan(want[0][0, 0, :32]).all()
    _check(cacheattention_cpu.run(*args, 2, 1, 0.0, 1), want, dt)
    gpu_or_sim()
    _check(_cuda(args, 2, 1, 1), want, dt)


def test_bad_inputs_name_the_problem():
    args = _call(F32, 2, 1, 8, 1, 1, 10, 1, 6)
    with pytest.raises(ca.CacheAttentionError, match="multiple of kv_num_heads"):
        ca.apply(*args, 3, 2)
    with pytest.raises(ca.CacheAttentionError, match="times the head size"):
        ca.apply(args[0][..., :-1], *args[1:], 2, 1)
    bad = list(args)
    bad[3] = np.array([40], np.int32)                   # longer than the cache
    with pytest.raises(ca.CacheAttentionError, match="seqlens_k"):
        ca.apply(*bad, 2, 1, 0.0, 1)
    with pytest.raises(ca.CacheAttentionError, match="seqlens_k"):
        cacheattention_cpu.run(*bad, 2, 1, 0.0, 1)


def test_cuda_kernel_values_out_of_range_give_nan_rows():
    """A length past the cache (a value the op does not take): no write out of bounds, the rows are NaN (the CPU
    face raises, above)."""
    gpu_or_sim()
    args = _call(F32, 2, 1, 32, 1, 1, 10, 1, 6)
    args[3] = np.array([40], np.int32)
    o, k, v = _cuda(args, 2, 1, 1)
    assert np.isnan(o).all()
    np.testing.assert_array_equal(k, args[1])           # the cache: only past copied


def test_routes():
    r = cacheattention_cuda.ROUTES
    name = lambda m, d=128, dt="float16", al=True: routing.route(  # noqa: E731
        r, routing.Case(dt, m, d, 2048, aligned=al)).kernel
    assert name(16) == "cacheattention.warps" and name(16, 64) == "cacheattention.warps"
    assert name(16, 256) == "cacheattention.warps" and name(16, 128, "float32") == "cacheattention.warps"
    # 16-byte chunks per key not a power of two up to 32, or an unaligned cache: the first kernel
    assert name(16, 96) == "cacheattention.split" and name(16, 80) == "cacheattention.split"
    assert name(16, 288) == "cacheattention.split" and name(16, 256, "float32") == "cacheattention.split"
    assert name(16, 8) == "cacheattention.split" and name(16, 8, "float32") == "cacheattention.warps"
    assert name(16, al=False) == "cacheattention.split"
    assert name(cacheattention_cuda.SPLIT_ROWS + 1) == "cacheattention.tc"
    assert name(cacheattention_cuda.SPLIT_ROWS + 1, 128, "float32") == "cacheattention.rows"
    assert name(cacheattention_cuda.SPLIT_ROWS + 1, 8) == "cacheattention.rows"
    assert name(cacheattention_cuda.SPLIT_ROWS + 1, al=False) == "cacheattention.rows"
    assert cacheattention_cuda.splits(16, 2048, "cacheattention.warps") == (cacheattention_cuda.NSPLIT, 0)
    assert cacheattention_cuda.splits(16, 2048, "cacheattention.split") == (64, 32)
    assert cacheattention_cuda.splits(16, 4096, "cacheattention.split") == (64, 64)
    assert cacheattention_cuda.splits(4096, 2048, "cacheattention.rows") == (1, 2048)


def test_pass_rewrites_genai_spelling_and_session_agrees():
    """The pass on a GroupQueryAttention node as genai writes it; the rewritten model gives the original's outputs
    in a CPU session with our library (CacheAttention's CPU face); other spellings are reported as skipped."""
    dt, hq, hkv, d = F16, 4, 2, 16
    model = _gqa_model(dt, hq, hkv)
    out, report = run_passes(model, passes=["cacheattention"], cacheattention_share_buffer=True)
    ops = [(n.domain, n.op_type) for n in out.graph.node]
    assert list(out.graph.node[0].input) == ["qkv", "pk", "pv", "sl", "cos", "sin"]      # tot no longer read
    assert ops == [("onnx_lowbit", "CacheAttention")] and len(report.rewritten("cacheattention")) == 1
    attrs = {a.name: helper.get_attribute_value(a) for a in out.graph.node[0].attribute}
    assert attrs["share_buffer"] == 1 and attrs["num_heads"] == hq
    args = _call(dt, hq, hkv, d, 1, 1, 16, 1, 9, seed=5)
    feeds = dict(zip(["qkv", "pk", "pv", "sl", "cos", "sin"], args), tot=np.array([10], np.int32))
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = lowbit_session(out, ["CPUExecutionProvider"]).run(None, feeds)
    _close(got[0], want[0], dt)
    for g, w in zip(got[1:], want[1:]):     # positions past the length: ours keep past's, onnxruntime's are unset
        _close(g[:, :, :10], w[:, :, :10], dt, exact=True)
    for attrs, why in (({"do_rotary": 0}, "do_rotary"), ({"local_window_size": 64}, "local_window_size"),
                       ({"rotary_interleaved": 1}, "rotary_interleaved")):
        _, rep = run_passes(_gqa_model(dt, hq, hkv, **attrs), passes=["cacheattention"])
        assert not rep.rewritten() and why in rep.skipped("cacheattention")[0].reason


@pytest.mark.parametrize("dt,d,why", [(F16, 64, None), (F16, 128, None), (F16, 24, "head size 24"),
                                       (F16, 160, "head size 160"), (F32, 64, "float32 caches")])
def test_pass_tc_only_keeps_the_heads_the_tensor_core_prompt_kernel_takes(dt, d, why):
    """The option cacheattention_tc_only (``onnx-lowbit genai``'s CUDA default) reads the head size and type from
    the cos_cache constant; other heads keep onnxruntime's GroupQueryAttention, reported with the reason."""
    model = _gqa_model(dt, 4, 2)
    cos = np.ones((32, d // 2), dt)
    model.graph.initializer.extend([numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(cos, "sin")])
    del model.graph.input[5:7]
    _, rep = run_passes(model, passes=["cacheattention"], cacheattention_tc_only=True)
    if why is None:
        assert len(rep.rewritten("cacheattention")) == 1
    else:
        assert not rep.rewritten() and why in rep.skipped("cacheattention")[0].reason
    _, rep = run_passes(model, passes=["cacheattention"])       # without the option: every head
    assert len(rep.rewritten("cacheattention")) == 1


def test_cpu_session_bad_lengths_name_the_problem():
    out, _ = run_passes(_gqa_model(F32, 2, 1), passes=["cacheattention"], cacheattention_share_buffer=True)
    sess = lowbit_session(out, ["CPUExecutionProvider"])
    args = _call(F32, 2, 1, 8, 1, 1, 10, 1, 6)
    args[3] = np.array([40], np.int32)
    with pytest.raises(Exception, match="seqlens_k"):
        sess.run(None, dict(zip(["qkv", "pk", "pv", "sl", "cos", "sin"], args), tot=np.array([7], np.int32)))
    assert issubclass(KernelError, Exception)


@pytest.mark.parametrize("steps", [[9, 1, 1, 1], [200, 1]])
def test_cuda_session_agrees_with_group_query_attention(steps):
    """On a GPU with onnxruntime-gpu: the rewritten node on the CUDA EP, fed as genai feeds it (one buffer bound as
    past and present through IOBinding), gives GroupQueryAttention's outputs on the CUDA EP, step after step."""
    ort_cuda = ort_cuda_or_skip()
    dt, hq, hkv, d, m = F16, 8, 2, 64, 256
    model = _gqa_model(dt, hq, hkv)
    out, _ = run_passes(model, passes=["cacheattention"], cacheattention_share_buffer=True)
    prov = ["CUDAExecutionProvider"]
    sessions = [ort_cuda.InferenceSession(model.SerializeToString(), providers=prov), lowbit_session(out, prov)]
    cos, sin = _tables(dt, d, m)
    caches = [[ort_cuda.OrtValue.ortvalue_from_numpy(np.zeros((1, hkv, m, d), dt), "cuda", 0) for _ in range(2)]
              for _ in sessions]
    rng = np.random.default_rng(6)
    total = 0
    for s in steps:
        total += s
        qkv = rng.standard_normal((1, s, (hq + 2 * hkv) * d)).astype(dt)
        outs = []
        for sess, (kc, vc) in zip(sessions, caches):
            io = sess.io_binding()
            for name, v in (("qkv", qkv), ("sl", np.array([total - 1], np.int32)),
                            ("tot", np.array([total], np.int32)), ("cos", cos), ("sin", sin)):
                io.bind_cpu_input(name, v)
            io.bind_ortvalue_input("pk", kc)
            io.bind_ortvalue_input("pv", vc)
            io.bind_output("o", "cuda")
            io.bind_ortvalue_output("k", kc)
            io.bind_ortvalue_output("v", vc)
            sess.run_with_iobinding(io)
            outs.append([io.get_outputs()[0].numpy(), kc.numpy(), vc.numpy()])
        (o0, k0, v0), (o1, k1, v1) = outs
        _close(o1, o0, dt)
        _close(k1[:, :, :total], k0[:, :, :total], dt, exact=True)
        _close(v1[:, :, :total], v0[:, :, :total], dt, exact=True)
