"""MatMulNF4 / FusedFFNNF4 with accuracy_level 4 (int8 activations): the reference's definition
(onnx_lowbit.nf4_int8) and the CPU kernels (custom_ops/nf4/matmulnf4_int8_cpu.py: the VNNI tiles where the CPU has
them, the scalar path everywhere) against it. The activations are quantised bit-identically and the integer sums
are exact, so kernels differ from the float64 reference only by fp32 rounding of the scaled sums: a few fp32 ulps of
the sum of |terms| (``_bound``)."""
import numpy as np
import pytest

from onnx_lowbit import ffn, nf4, nf4_int8
from onnx_lowbit.custom_ops.nf4 import matmulnf4_int8_cpu as int8
from onnx_lowbit.custom_ops.nf4 import nf4col_cpu as col
from onnx_lowbit.custom_ops.nf4 import nf4vnni_cpu as vnni
from onnx_lowbit.custom_ops.nf4.nf4decode_cpu import absmax32

EPS32 = 2.0 ** -24


def weights(k, n, bs, qt, seed=0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    return nf4.quantize(w, qt, bs)


def loop_reference(a, q, am, qt, bs, k, n):
    """The definition written out with Python loops (float64 sums), for small shapes: (y, sum of |terms|)."""
    g = nf4_int8.int8_group(k, bs)
    L = nf4_int8.level_divisor(qt)
    lev = [int(np.rint(float(c) * L)) for c in nf4.code(qt)]         # (the values: test_code_levels)
    idx = nf4.unpack_indices(q, k * n)
    y, mag = np.zeros((a.shape[0], n)), np.zeros((a.shape[0], n))
    for m in range(a.shape[0]):
        for j in range(k // g):
            blk = a[m, j * g:(j + 1) * g].astype(np.float32)
            amax = np.float32(np.max(np.abs(blk)))
            s_a = np.float32(amax / np.float32(127))
            inv = np.float32(127) / amax if amax > 0 else np.float32(0)
            aq = [int(np.rint(np.float32(x * inv))) for x in blk]
            for c in range(n):
                first = c * k + j * g
                isum = sum(aq[i] * lev[idx[first + i]] for i in range(g))
                term = float(am[first // bs]) / L * float(s_a) * isum
                y[m, c] += term
                mag[m, c] += abs(term)
    return y, mag


def _bound(a, q, am, qt, bs, k, n):
    """Sum of |terms| of each output (the scale the kernels' fp32 rounding is measured against)."""
    g = nf4_int8.int8_group(k, bs)
    aq, s_a = nf4_int8.quantize_activations(a, g)
    w8 = nf4_int8.code_levels(qt)[nf4.unpack_indices(q, k * n)].reshape(n, k).astype(np.int64)
    aq3 = aq.reshape(a.shape[0], k // g, g).astype(np.int64)
    isum = np.abs(np.einsum("mjk,njk->mnj", aq3, w8.reshape(n, k // g, g)))
    first = np.arange(n)[:, None] * k + np.arange(k // g)[None, :] * g
    with np.errstate(invalid="ignore"):
        return np.einsum("mnj,nj,mj->mn", isum.astype(np.float64), am[first // bs] / nf4_int8.level_divisor(qt),
                         np.abs(s_a))


# ---------------------------------------------------------------------------------------------- the reference
def test_code_levels():
    assert nf4_int8.code_levels("nf4").tolist() == [-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71,
                                                     92, 127]
    # FP4: 0.5 * 127 = 63.5 rounds half to even (64); 0.0625 / 12 * 127 = 0.66 -> 1; index 8 (-0) is +0
    assert nf4_int8.code_levels("fp4").tolist() == [0, 1, 85, 127, 42, 64, 21, 32, 0, -1, -85, -127, -42, -64, -21,
                                                     -32]
    # int4: code (q - 8) / 8 with L = 128: the levels 16 (q - 8), exact; nf4 / fp4 keep L = 127
    assert nf4_int8.code_levels("int4").tolist() == [16 * (q - 8) for q in range(16)]
    assert [nf4_int8.level_divisor(qt) for qt in ("nf4", "fp4", "int4")] == [127, 127, 128]


def test_groups_and_levels():
    assert nf4_int8.int8_group(2048, 64) == 64 and nf4_int8.int8_group(4096, 4096) == 4096
    assert nf4_int8.int8_group(352, 64) == 32 and nf4_int8.int8_group(64, 4096) == 32   # pieces of 32
    assert nf4_int8.int8_group(100, 64) is None and nf4_int8.int8_group(65, 32) is None  # level 4 = level 0 there
    for bad in (5, -1, "4", 4.0, True):
        with pytest.raises(ValueError, match="accuracy_level must be one of 0, 1, 2, 3, 4"):
            nf4_int8.check_level(bad)


def test_quantize_activations_rounding_and_specials():
    a = np.zeros((4, 64), np.float32)
    a[0, :4] = [127.0, 2.5, 3.5, -2.5]           # amax 127: inv = 1, halves to even
    a[1, :3] = [1.0, np.nan, 2.0]                # a NaN: the group's scale is NaN, its values 0
    a[2, :2] = [np.inf, 1.0]
    a[3, :2] = [1e-30, -3e-30]                   # tiny but not zero
    aq, s_a = nf4_int8.quantize_activations(a, 32)
    assert aq[0, :4].tolist() == [127, 2, 4, -2] and s_a[0, 0] == np.float32(1.0)
    assert s_a[0, 1] == 0 and not aq[0, 32:].any()           # an all-zero group: scale 0, values 0
    assert np.isnan(s_a[1, 0]) and not aq[1, :32].any() and s_a[1, 1] == 0
    assert np.isnan(s_a[2, 0]) and not aq[2, :32].any()
    assert aq[3, :2].tolist() == [42, -127] and s_a[3, 0] == np.float32(np.float32(3e-30) / np.float32(127))


@pytest.mark.parametrize("qt", ["nf4", "fp4", "int4"])
@pytest.mark.parametrize("k,n,bs", [(64, 5, 32), (96, 3, 64), (128, 4, 128)])
def test_reference_is_the_definition(qt, k, n, bs):
    q, am = weights(k, n, bs, qt, seed=k)
    a = np.random.default_rng(k + 1).standard_normal((3, k)).astype(np.float32)
    y = nf4_int8.matmul(a, q, am, qt, bs, k, n)
    want, mag = loop_reference(a, q, am, qt, bs, k, n)
    assert np.all(np.abs(y - want) <= 4 * EPS32 * mag + 1e-30)      # the float64 sums, rounded once to fp32
    np.testing.assert_array_equal(nf4.matmul(a, q, am, qt, bs, k, n, accuracy_level=4), y)


def test_levels_0_to_3_and_unsupported_k_are_the_float_product():
    q, am = weights(100, 6, 64, "nf4")
    a = np.random.default_rng(0).standard_normal((2, 100)).astype(np.float32)
    ref = nf4.matmul(a, q, am, "nf4", 64, 100, 6)
    np.testing.assert_array_equal(nf4_int8.matmul(a, q, am, "nf4", 64, 100, 6), ref)   # K % 32 != 0: level 0
    q, am = weights(128, 6, 64, "nf4")
    a = np.random.default_rng(0).standard_normal((2, 128)).astype(np.float32)
    ref = nf4.matmul(a, q, am, "nf4", 64, 128, 6)
    for lvl in (0, 1, 2, 3):
        np.testing.assert_array_equal(nf4_int8.matmul(a, q, am, "nf4", 64, 128, 6, accuracy_level=lvl), ref)
    y4 = nf4_int8.matmul(a, q, am, "nf4", 64, 128, 6)
    rel = np.linalg.norm(y4 - ref) / np.linalg.norm(ref)
    assert 0 < rel < 0.02, rel


def test_reference_nan_rows_bias_and_fp16():
    k, n = 128, 7
    q, am = weights(k, n, 64, "fp4", seed=3)
    rng = np.random.default_rng(4)
    a = rng.standard_normal((2, 3, k)).astype(np.float16)
    a[0, 1, 70] = np.inf
    b = rng.standard_normal(n).astype(np.float16)
    y = nf4_int8.matmul(a, q, am, "fp4", 64, k, n, b)
    assert y.dtype == np.float16 and y.shape == (2, 3, n)
    assert np.isnan(y[0, 1]).all() and np.isfinite(np.delete(y.reshape(6, n), 1, axis=0)).all()
    y32 = nf4_int8.matmul(a.astype(np.float32), q, am, "fp4", 64, k, n, b.astype(np.float32))
    np.testing.assert_array_equal(y, y32.astype(np.float16))       # fp16 A widens exactly; one rounding at the end


# ---------------------------------------------------------------------------------------------- the CPU kernels
SHAPES = [  # K, N, block size, M
    (256, 40, 64, 3),
    (2048, 37, 64, 1),       # N odd: the 4-column tiles and the single-column tail
    (384, 9, 128, 17),       # a span is one block; M past the 4-row tiles
    (192, 5, 64, 5),         # K % 128 == 64: the last span holds one block
    (352, 11, 64, 2),        # K % bs != 0: one absmax per 32-element piece, K % 128 == 96
    (96, 7, 32, 4),          # K < 128: only the partial span
    (1024, 6, 512, 1),       # one block over several spans
    (64, 5, 4096, 2),        # a block far larger than K (pieces)
    (512, 4, 64, 0),         # no rows
    (160, 33, 64, 5),        # column lanes: N past two tiles of 16, K % 128 == 32
    (512, 16, 256, 2),       # one whole tile, groups of 256
    (32, 3, 32, 1),          # K = 32: one group of one 8-element step per lane ... four steps
]


def kernel_outputs(a, q, am, qt, bs, k, n):
    """{path: y} for the VNNI path (where the CPU has it, through ``product``) and the scalar path."""
    g, kbs = int8.group(k, bs)
    tbl = int8.table(qt)
    out = {}
    if int8.VNNI:
        out["vnni"] = int8.product(int8.quantize(a, g), q, am, tbl, k, n, bs, g)
        out["packed"] = int8.product_packed(a, col.pack(q, am, k, n, bs, g), tbl)   # a constant weight's path
    aq = np.empty((a.shape[0], k), np.int8)
    sal = np.empty((a.shape[0], k // g), np.float32)
    int8.quantize_scalar(a, g, aq, sal)
    np.testing.assert_array_equal(aq, nf4_int8.quantize_activations(a, g)[0])
    am2 = am if kbs == bs else absmax32(am, 0, n * k // 32, bs)
    ys = np.empty((a.shape[0], n), np.float32)
    int8.cols_scalar(aq, sal, q, am2, tbl, k, kbs, g, 0, n, ys)
    vnni.rescale(tbl, ys, n)             # the level divisor's factor, as cols_product applies it
    out["scalar"] = ys
    return out


@pytest.mark.parametrize("qt", ["nf4", "fp4", "int4"])
@pytest.mark.parametrize("k,n,bs,m", SHAPES)
def test_kernels_against_reference(qt, k, n, bs, m):
    q, am = weights(k, n, bs, qt, seed=k + n)
    a = (np.random.default_rng(m + k).standard_normal((m, k)) * 3 + 0.5).astype(np.float32)
    ref = nf4_int8.matmul(a, q, am, qt, bs, k, n).astype(np.float64)
    bound = _bound(a, q, am, qt, bs, k, n)
    for path, y in kernel_outputs(a, q, am, qt, bs, k, n).items():
        assert y.shape == (m, n) and y.dtype == np.float32
        err = np.abs(y - ref)
        assert np.all(err <= 48 * EPS32 * bound + 1e-30), (path, float((err / np.maximum(bound, 1e-30)).max()))


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_big_group_packed_and_scalar(qt):
    """One group of 4096 (K = bs = 4096): the packed path's int32 group sum exceeds 2^24 and is rounded once to fp32,
    within the bound. (Not the span-layout VNNI path: it sums fp32 partials of 8-element lanes, whose rounding
    grows with the sum of |lane partials|, which cancellation in a group of 4096 leaves far above the group's
    |sum|: about 55 and 240 fp32 ulps of the bound here, not a bound of its own error.)"""
    k, n, bs, m = 4096, 18, 4096, 3
    q, am = weights(k, n, bs, qt, seed=k + n)
    a = (np.random.default_rng(m + k).standard_normal((m, k)) * 3 + 0.5).astype(np.float32)
    ref = nf4_int8.matmul(a, q, am, qt, bs, k, n).astype(np.float64)
    bound = _bound(a, q, am, qt, bs, k, n)
    outs = kernel_outputs(a, q, am, qt, bs, k, n)
    outs.pop("vnni", None)
    assert ("packed" in outs) == int8.VNNI
    for path, y in outs.items():
        err = np.abs(y - ref)
        assert np.all(err <= 48 * EPS32 * bound + 1e-30), (path, float((err / np.maximum(bound, 1e-30)).max()))


def test_vnni_activation_layout_matches_the_reference():
    if not int8.VNNI:
        pytest.skip("no AVX-512 VNNI")
    k, g = 352, 32
    a = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    a[1, 40] = np.nan
    qa = int8.quantize(a, g)
    aq, s_a = nf4_int8.quantize_activations(a, g)
    kp = qa.aq.shape[1]
    nat = np.zeros((3, kp), np.int8)
    nat[:, :k] = aq
    spans = nat.reshape(3, kp // 128, 64, 2).transpose(0, 1, 3, 2).reshape(3, kp)   # per span: evens, then odds
    np.testing.assert_array_equal(qa.aq, spans)
    np.testing.assert_array_equal(qa.corr, -128 * nat.reshape(3, -1, 8).astype(np.int32).sum(-1))
    lanes = np.repeat(s_a, g // 8, axis=1)
    assert np.array_equal(np.isnan(qa.sal[:, :k // 8]), np.isnan(lanes)) and not qa.sal[:, k // 8:].any()
    fin = ~np.isnan(lanes)
    np.testing.assert_allclose(qa.sal[:, :k // 8][fin], lanes[fin] / 127, rtol=4 * EPS32)
    aq_n, cg, sg = col.quantize_arrays(a, g)         # the column-lane kernels' layout: natural order, per group
    np.testing.assert_array_equal(aq_n, nat)
    np.testing.assert_array_equal(cg, -128 * nat.reshape(3, -1, g).astype(np.int32).sum(-1))
    np.testing.assert_array_equal(sg[:, :k // g], qa.sal[:, :k // 8:g // 8])
    assert not sg[:, k // g:].any()


@pytest.mark.parametrize("qt", ["nf4", "fp4", "int4"])
def test_kernels_nan_inf_rows(qt):
    k, n, bs = 384, 13, 64
    q, am = weights(k, n, bs, qt, seed=9)
    a = np.random.default_rng(10).standard_normal((5, k)).astype(np.float32)
    a[1, 7], a[3, 300], a[4, 0] = np.nan, np.inf, -np.inf
    ref = nf4_int8.matmul(a, q, am, qt, bs, k, n)
    for path, y in kernel_outputs(a, q, am, qt, bs, k, n).items():
        assert np.array_equal(np.isnan(y), np.isnan(ref)) and np.isnan(y[[1, 3, 4]]).all(), path
        assert np.isfinite(y[[0, 2]]).all(), path


def test_threads_split_gives_the_same_bytes(monkeypatch):
    k, n, bs = 352, 203, 64       # columns split on whole blocks (here: pairs of columns)
    q, am = weights(k, n, bs, "nf4", seed=1)
    a = np.random.default_rng(2).standard_normal((6, k)).astype(np.float32)
    one = int8.matmul(a, q, am, int8.table("nf4"), k, n, bs)
    monkeypatch.setattr(int8, "PARALLEL_MIN_MACS", 0)
    monkeypatch.setattr(int8.threads, "threads", lambda: 3)
    np.testing.assert_array_equal(int8.matmul(a, q, am, int8.table("nf4"), k, n, bs), one)


def test_column_lane_pack_layout():
    """nf4col_cpu.pack: per tile of 16 columns and 8-element step, lane c's 4 bytes hold elements 8 s + j (low
    nibble) and 8 s + 4 + j (high nibble) of column 16 t + c, 4 tiles' vectors side by side per step; absmax per
    tile, group and column; padding 0."""
    k, n, bs = 96, 21, 32
    q, am = weights(k, n, bs, "fp4", seed=11)
    pk = col.pack(q, am, k, n, bs, 32)
    idx = nf4.unpack_indices(q, k * n).reshape(n, k)
    full = np.zeros((64, k), np.int64)                         # tiles padded to a multiple of 4
    full[:n] = idx
    lanes = full.reshape(1, 4, 16, k // 8, 2, 4)               # tile group, tile, column, step, low / high, byte
    want = (lanes[..., 0, :] | (lanes[..., 1, :] << 4)).transpose(0, 3, 1, 2, 4).reshape(-1)
    np.testing.assert_array_equal(pk.qk, want.astype(np.uint8))
    sk = np.zeros((32, k // 32), np.float32)
    sk[:n] = am.reshape(n, k // 32)
    np.testing.assert_array_equal(pk.sk, sk.reshape(2, 16, k // 32).transpose(0, 2, 1).reshape(-1))
    assert pk.qk.ctypes.data % 64 == 0 and pk.tiles == 2 and pk.nbytes == 4 * (k // 8) * 64 + 2 * 3 * 16 * 4


@pytest.mark.parametrize("k,n,bs", [(352, 203, 64), (256, 48, 256)])
def test_packed_rows_and_thread_splits_give_the_same_bytes(monkeypatch, k, n, bs):
    """A packed weight: every row the same bytes whatever the row count (the 4-, 2- and 1-row tiles) and the
    threads' tile ranges, NaN / Inf rows included; fp16 A and a bias through matmul_packed."""
    if not int8.VNNI:
        pytest.skip("no AVX-512 VNNI")
    g, _ = int8.group(k, bs)
    q, am = weights(k, n, bs, "nf4", seed=k)
    pk = col.pack(q, am, k, n, bs, g)
    tbl = int8.table("nf4")
    a = np.random.default_rng(3).standard_normal((7, k)).astype(np.float32)
    a[2, 5], a[5, 100] = np.nan, -np.inf
    whole = int8.product_packed(a, pk, tbl)
    for r in range(7):
        np.testing.assert_array_equal(int8.product_packed(a[r:r + 1], pk, tbl), whole[r:r + 1])
    np.testing.assert_array_equal(int8.product_packed(a[1:4], pk, tbl), whole[1:4])
    assert np.isnan(whole[[2, 5]]).all() and np.isfinite(np.delete(whole, [2, 5], axis=0)).all()
    monkeypatch.setattr(int8, "PARALLEL_MIN_MACS", 0)
    monkeypatch.setattr(int8.threads, "threads", lambda: 3)
    np.testing.assert_array_equal(int8.product_packed(a, pk, tbl), whole)
    b = np.random.default_rng(4).standard_normal(n).astype(np.float16)
    a16 = a.astype(np.float16)
    y = int8.matmul_packed(a16.reshape(1, 7, k), pk, tbl, b)
    assert y.dtype == np.float16 and y.shape == (1, 7, n)
    ref = nf4_int8.matmul(a16, q, am, "nf4", bs, k, n, b)
    fin = [0, 1, 3, 4, 6]
    assert np.isnan(y[0, [2, 5]]).all()
    assert np.abs(y[0, fin].astype(np.float64) - ref[fin]).max() <= 2.0 ** -10 * np.abs(ref[fin]).max()


def test_fused_ffn_host_entry():
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cpu
    k, n, bs = 256, 19, 64
    q1, am1 = weights(k, n, bs, "nf4", seed=5)
    q3, am3 = weights(k, n, bs, "nf4", seed=6)
    x = np.random.default_rng(7).standard_normal((3, k)).astype(np.float32)
    l4 = int8.Level4.make(4, "nf4", k, bs)
    s = fusedffnnf4_cpu.swiglu(x, q1, am1, q3, am3, nf4.code("nf4"), k, n, bs, l4=l4)
    ref = ffn.swiglu_nf4_ref(x, q1, am1, q3, am3, "nf4", bs, k, n, accuracy_level=4)
    assert np.abs(s - ref).max() <= 1e-5 * np.abs(ref).max()
    float_ref = ffn.swiglu_nf4_ref(x, q1, am1, q3, am3, "nf4", bs, k, n)
    assert 0 < np.linalg.norm(s - float_ref) / np.linalg.norm(float_ref) < 0.03
    if int8.VNNI:       # W1 and W3 packed (a node's constant weights): within the same bound, rows alike at any M
        packs = (col.pack(q1, am1, k, n, bs, l4.g), col.pack(q3, am3, k, n, bs, l4.g))
        sp = fusedffnnf4_cpu.swiglu(x, q1, am1, q3, am3, nf4.code("nf4"), k, n, bs, l4=l4, packs=packs)
        assert np.abs(sp - ref).max() <= 1e-5 * np.abs(ref).max()
        np.testing.assert_array_equal(
            fusedffnnf4_cpu.swiglu(x[1:2], None, None, None, None, nf4.code("nf4"), k, n, bs, l4=l4, packs=packs),
            sp[1:2])
    assert int8.Level4.make(0, "nf4", k, bs) is None and int8.Level4.make(4, "nf4", 100, bs) is None
