"""FusedFFN's routing table (custom_ops/ffn/fusedffn_cuda.ROUTES): it picks, for a grid of representative calls,
the kernel the code before the table picked (the expected names were derived by reading FusedFFNCudaKernel.run and
_run_kn at commit 222707c, not by asking the table), and every kernel it names has a launcher."""
import numpy as np
import pytest
from numba import config

from onnx_lowbit.custom_ops.runtime import routing

SIM = bool(config.ENABLE_CUDASIM)
H, F = True, False      # fp16 / fp32
BIG = dict(k=4096, n=11008)

# (x16, w16, m, call options, the kernel the old code launched); options: k, n, kn, aligned (W), x_aligned, tc,
# cublas_ok, scratch, tf32, path. Old names: run()'s 'decode' / 'tc' / 'gemm' / 'tiled', _run_kn()'s 'tc' / 'decode'
# (here kn_tc, kn_decode); the GEMM's compute type (TF32 for fp32-input GEMMs when TF32 is on) and its output type
# (fp16 only for fp16 X and W with [K, N] weights: KN_FP16_SCRATCH on, FP16_SCRATCH off) name the gemm rows.
OLD = [
    (H, H, 1, BIG, "decode"), (H, H, 2, BIG, "decode"), (H, H, 3, BIG, "tc"), (H, H, 32, BIG, "tc"),
    (H, H, 33, BIG, "gemm"), (H, H, 512, BIG, "gemm"),
    (H, H, 3, dict(BIG, tc=False), "gemm"), (H, H, 3, dict(BIG, x_aligned=False), "gemm"),
    (H, H, 1, dict(BIG, aligned=False), "gemm"), (H, H, 1, dict(BIG, x_aligned=False), "decode"),
    (H, H, 3, dict(BIG, cublas_ok=False), "tc"), (H, H, 3, dict(BIG, cublas_ok=False, tc=False), "tiled"),
    (H, H, 40, dict(BIG, scratch=False), "tiled"),
    (H, H, 1, dict(k=4100, n=64), "gemm"), (H, H, 2, dict(k=12800, n=64), "decode"),
    (H, H, 2, dict(k=12808, n=64), "gemm"), (H, H, 1, dict(k=0, n=64), "decode"), (H, H, 5, dict(k=0, n=64), "tiled"),
    (F, F, 1, BIG, "decode"), (F, F, 3, BIG, "gemm_tf32"), (F, F, 3, dict(BIG, tf32=False), "gemm"),
    (F, F, 1, dict(k=30, n=10), "gemm_tf32"), (F, F, 3, dict(k=30, n=10), "gemm_tf32"),
    (F, F, 3, dict(k=30, n=10, cublas_ok=False), "tiled"),
    (F, H, 1, BIG, "decode"), (F, H, 3, BIG, "gemm"), (F, H, 3, dict(BIG, tf32=False), "gemm"),
    (H, F, 3, BIG, "gemm_tf32"), (H, F, 5, dict(k=13, n=9), "gemm_tf32"), (H, F, 2, BIG, "decode"),
    # [K, N] weights
    (H, H, 1, dict(BIG, kn=True), "kn_decode"), (H, H, 2, dict(BIG, kn=True), "kn_tc"),
    (H, H, 16, dict(BIG, kn=True), "kn_tc"), (H, H, 17, dict(BIG, kn=True), "gemm_f16out"),
    (H, H, 2, dict(BIG, kn=True, tc=False), "kn_decode"), (H, H, 3, dict(BIG, kn=True, tc=False), "gemm_f16out"),
    (H, H, 2, dict(BIG, kn=True, x_aligned=False), "kn_decode"),
    (H, H, 1, dict(k=4096, n=11004, kn=True), "gemm_f16out"),
    (H, H, 1, dict(BIG, kn=True, scratch=False), "kn_decode"),
    (H, H, 1, dict(k=8192, n=11008, kn=True, scratch=False), "tiled"),
    (H, H, 1, dict(k=0, n=64, kn=True), "tiled"), (H, H, 12, dict(k=40, n=10, kn=True), "gemm_f16out"),
    (F, F, 1, dict(BIG, kn=True), "kn_decode"), (F, F, 2, dict(BIG, kn=True), "kn_decode"),
    (F, F, 3, dict(BIG, kn=True), "gemm_tf32"), (F, H, 3, dict(BIG, kn=True), "gemm"),
    (F, H, 2, dict(BIG, kn=True), "kn_decode"), (H, F, 5, dict(BIG, kn=True), "gemm_tf32"),
    (H, F, 5, dict(BIG, kn=True, cublas_ok=False), "tiled"),
    # forced paths (tests, benchmarks)
    (H, H, 1, dict(BIG, path="tiled"), "tiled"), (H, H, 1, dict(BIG, path="tc"), "tc"),
    (H, H, 40, dict(BIG, path="tc"), "tc"), (H, H, 5, dict(BIG, path="gemm"), "gemm"),
    (F, F, 5, dict(BIG, path="gemm"), "gemm_tf32"), (H, H, 2, dict(BIG, kn=True, path="decode"), "kn_decode"),
    (H, H, 40, dict(BIG, kn=True, path="tc"), "kn_tc"), (H, H, 2, dict(BIG, kn=True, path="gemm"), "gemm_f16out"),
    (F, F, 1, dict(BIG, kn=True, path="tiled"), "tiled"),
]


def _fc():
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda
    return fusedffn_cuda


@pytest.mark.parametrize("x16,w16,m,opts,want", OLD)
def test_table_picks_what_the_old_code_picked(x16, w16, m, opts, want):
    fc = _fc()
    o = dict(opts)
    c = fc.case(x16, w16, m, o.pop("k"), o.pop("n"), **o)
    assert routing.route(fc.ROUTES, c).kernel == want


def test_forced_paths_name_their_kernels():
    fc = _fc()
    assert {fc.path_of(k) for k in routing.kernels(fc.ROUTES)} == set(fc.PATHS)
    # a forced path whose kernel cannot take the call routes elsewhere; the kernel object refuses it (REFUSED)
    c = fc.case(True, True, 3, 64, 64, path="decode")      # the decode kernel has buckets 1 and 2 only
    assert routing.route(fc.ROUTES, c).kernel == "tiled" and set(fc.REFUSED) == set(fc.PATHS) - {"tiled"}


def test_every_kernel_of_the_table_has_a_launcher():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    fc = _fc()
    names = set(routing.kernels(fc.ROUTES))
    for kn in (0, 1):
        for x16 in (False, True):
            for w16 in (False, True):
                kern = fc.FusedFFNCudaKernel(spec=None, attrs={"weights_kn": kn}, node_name="t",
                                             in_types=(10 if x16 else 1, 10 if w16 else 1),
                                             out_types=(10 if x16 else 1,))
                assert set(kern.launch) == names and all(callable(f) for f in kern.launch.values())


def test_the_table_is_printed():
    fc = _fc()
    text = routing.table(fc.ROUTES)
    assert text.count("\n") == len(fc.ROUTES) + 1 and all(r.measured for r in fc.ROUTES)
    assert np.all([r.when for r in fc.ROUTES])
