"""Launch one of our CUDA kernels at one configuration (twice where a second call matters: tile counters left by the
first, or ``ncu --launch-skip 1``), check the output, print one line: the program that compute-sanitizer and ncu
run (`bash benchmarks/gpu_check.sh edges` and `... stalls` call it; options are the host runners' keywords).

    python3 benchmarks/kernel_once.py fplut [N]                     FPLUT on N fp16 values (the routed kernel)
    python3 benchmarks/kernel_once.py nf4 ffn|mm K N                 FusedFFNNF4 / MatMulNF4 at M = 1 (routed)
    M=2 python3 benchmarks/kernel_once.py awq mm|mm1|ffn|ffn1 K N ["wpl=1"]   MatMulAWQ / FusedFFNAWQ (M rows):
                                                                     fp32 decode (mm, ffn) / small-M GEMV (mm1, ffn1)
    python3 benchmarks/kernel_once.py ffn_tc M K N   FusedFFN's [N, K] tensor-core kernel (the routed configuration)
    python3 benchmarks/kernel_once.py ffn_kn M K N XTYPE WTYPE       FusedFFN on [K, N] weights (decode / tensor cores)
    python3 benchmarks/kernel_once.py nf4tc M K N                    NF4 tensor-core kernel, one and two weights
    python3 benchmarks/kernel_once.py nf4wide_ffn M K N GROUPS       FusedFFNNF4's wide decode, GROUPS 1 or 3 (.g3)
    python3 benchmarks/kernel_once.py nf4wide_mm M K N                MatMulNF4's wide M = 1 / two-row decode

    ncu --section SpeedOfLight --section WarpStateStats -k regex:decode --launch-skip 1 --launch-count 1 \\
        python3 benchmarks/kernel_once.py nf4 ffn 4096 11008

Folded from fplut_ncu.py, nf4_ncu.py, awq_ncu.py, ffn_tc_ncu.py and the inline programs of the *_sanitize.sh
scripts (docs/lab-log.md, "Removed benchmark scripts").
"""
import os
import sys

import numpy as np


def _opts(argv, i):
    """Keyword options given as one string, e.g. "h2=2, wide=True" (a benchmark-only convenience)."""
    return eval("dict(" + argv[i] + ")") if len(argv) > i else {}  # noqa: S307


def fplut(argv):
    """FPLUT on N fp16 values as a session node runs it (runtime.direct.call: the kernel ROUTES picks)."""
    import torch

    from onnx_lowbit import fplut
    from onnx_lowbit.custom_ops.runtime import direct
    seed = [-20.359375, -17.109375, -8.3671875, -1.9755859375, -0.255615234375, -0.007244110107421875,
            0.0072174072265625, 0.228515625, 1.58203125, 10.46875, 65504.0]
    n = int(argv[0]) if argv else 64 << 20
    t = fplut.Table.build("silu", seed)
    x = (torch.randn(n, device="cuda") * 4).half()
    out = torch.empty_like(x)
    attrs = {"function": "silu", "cut_points": list(t.cut_points), "table": t.values.astype(np.float32)}
    direct.call("FPLUT", attrs, [x], [out], torch.cuda.current_stream().cuda_stream)()
    torch.cuda.synchronize()
    ref = fplut.apply(x[:4096].cpu().numpy(), t.cut_points, t.values)
    ok = np.array_equal(out[:4096].cpu().numpy().view(np.uint16), ref.view(np.uint16))
    print("fplut", n, "ok" if ok else "MISMATCH")


def _nf4_call(op, x, ws, k, n, bias=None):
    """``op`` through its kernel object, as a session node calls it (runtime/direct.call), twice; host arrays in,
    (output, the routed kernel's name) out."""
    from numba import cuda

    from onnx_lowbit.custom_ops.runtime import direct
    from onnx_lowbit.custom_ops.runtime.routing import route
    dev = [cuda.to_device(np.ascontiguousarray(v)) for v in (x, *ws) + ((bias,) if bias is not None else ())]
    out = cuda.device_array(x.shape[:-1] + (n,), x.dtype)
    run = direct.call(op, {"quant_type": "nf4", "block_size": 64, "K": k, "N": n}, dev, [out], 0)
    for _ in range(2):
        run()
    cuda.synchronize()
    mod = sys.modules[type(run.kernel).__module__]
    return out.copy_to_host(), route(mod.ROUTES, run.kernel.case(x.shape[0])).kernel


def nf4(argv):
    from numba import cuda

    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cpu
    from onnx_lowbit.custom_ops.nf4 import common as nf4_common, matmulnf4_cpu
    bs = 64
    cuda.current_context()      # the context first (the kernel objects ask the driver for the SM count)
    what, k, n = argv[0], int(argv[1]), int(argv[2])
    rng = np.random.default_rng(0)
    code = nf4_common.parse_attrs({"quant_type": "nf4", "block_size": bs, "K": k, "N": n})[4]
    x = (rng.standard_normal((1, k)) * 0.5).astype(np.float16)
    w = [(rng.integers(0, 256, k * n // 2, dtype=np.uint8),
          (rng.random(k * n // bs) * 0.1 + 0.01).astype(np.float32)) for _ in range(2)]
    if what == "ffn":
        y, name = _nf4_call("FusedFFNNF4", x, (w[0][0], w[0][1], w[1][0], w[1][1]), k, n)
        ref = fusedffnnf4_cpu.swiglu(x.astype(np.float32), w[0][0], w[0][1], w[1][0], w[1][1], code, k, n, bs)
    else:
        y, name = _nf4_call("MatMulNF4", x, w[0], k, n)
        ref = matmulnf4_cpu.matmul(x.astype(np.float32), w[0][0], w[0][1], code, k, n, bs)
    ref = np.asarray(ref, np.float64).reshape(y.shape)
    err = np.max(np.abs(y.astype(np.float64) - ref)) / np.max(np.abs(ref))
    print(what, k, n, name, "ok" if err < 2e-3 else "MISMATCH", f"rel {err:.1e}")


def awq(argv):
    from numba import cuda

    from onnx_lowbit import awq
    from onnx_lowbit.custom_ops.awq import gemv_run_cuda, matmulawq1_cuda
    g = 128
    cuda.current_context()      # the context first (the launchers ask the driver for the SM count)
    what, k, n = argv[0], int(argv[1]), int(argv[2])
    kw = _opts(argv, 3)
    rng = np.random.default_rng(0)
    m = int(os.environ.get("M", "1"))    # rows of x (mm1 / ffn1 take up to 16)
    x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)

    def weights():
        kp = -(-k // g) * g         # AutoAWQ pads K to a whole number of groups
        return (rng.integers(-2 ** 31, 2 ** 31, (kp, n // 8), dtype=np.int64).astype(np.int32),
                rng.integers(-2 ** 31, 2 ** 31, (kp // g, n // 8), dtype=np.int64).astype(np.int32),
                (rng.random((kp // g, n)) * 0.004 + 0.001).astype(np.float16))

    w1, w3 = weights(), weights()
    run = matmulawq1_cuda.run if what in ("mm1", "ffn1") else gemv_run_cuda.run
    w3_ = w3 if what in ("ffn1", "ffn") else None
    for _ in range(2):
        y = run(x, w1, w3_, None, None, g, k, n, **kw)
    ref = awq.matmul(x, *w1, g, k, n).astype(np.float64)
    if w3_ is not None:
        ref = ref / (1 + np.exp(-ref)) * awq.matmul(x, *w3, g, k, n).astype(np.float64)
    err = np.max(np.abs(y.astype(np.float64) - ref)) / np.max(np.abs(ref))
    print(what, f"M={m}", k, n, kw, "ok" if err < 2e-3 else "MISMATCH", f"rel {err:.1e}")


def _ffn_call(x, w1, w3, b1, b3, kn, path, calls=1):
    """S of a FusedFFN node on these host arrays, ``calls`` times, through its CUDA kernel object as a session node
    runs it (runtime.direct), forced onto ``path``."""
    from numba import cuda

    from onnx_lowbit.custom_ops.runtime import direct
    dev = [cuda.to_device(a) for a in (x, w1, w3, b1)] + ([cuda.to_device(b3)] if b3 is not None else [])
    y = cuda.device_array(x.shape[:-1] + (w1.shape[1] if kn else w1.shape[0],), x.dtype)
    run = direct.call("FusedFFN", {"weights_kn": int(kn)}, dev, [y], 0)
    run.kernel.force_path = path
    for _ in range(calls):
        run()
    cuda.synchronize()
    return y.copy_to_host()


def ffn_tc(argv):
    """FusedFFN's [N, K] tensor-core kernel at M rows (the configuration sessions launch there)."""
    from onnx_lowbit.custom_ops.ffn import fusedffn_tc_cuda as tc
    m, k, n = int(argv[0]), int(argv[1]), int(argv[2])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k)).astype(np.float16)
    w1 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
    w3 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
    b1, b3 = rng.standard_normal(n).astype(np.float16), rng.standard_normal(n).astype(np.float16)
    y = _ffn_call(x, w1, w3, b1, b3, False, "tc", calls=2)
    xd = x.astype(np.float64)
    gate = xd @ w1.astype(np.float64).T + b1
    ref = gate / (1 + np.exp(-gate)) * (xd @ w3.astype(np.float64).T + b3)
    err = float(np.abs(y - ref).max() / np.abs(ref).max())
    print(f"M={m} K={k} N={n} config {tc.config(m)}: max rel error {err:.2e}")
    return 0 if err < 1e-3 else 1


def ffn_kn(argv):
    from onnx_lowbit import ffn
    m, k, n, xd, wd = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    path = "decode" if m <= 2 else "tc"
    r = np.random.default_rng(0)
    x = r.standard_normal((m, k)).astype(xd)
    w1 = (r.standard_normal((k, n)) / np.sqrt(k)).astype(wd)
    w3 = (r.standard_normal((k, n)) / np.sqrt(k)).astype(wd)
    b = r.standard_normal(n).astype(xd)
    y = _ffn_call(x, w1, w3, b, None, True, path, calls=2)    # the second call finds the tile counters the first left
    ref = ffn.swiglu_ref(x, w1, w3, b, None, kn=True)
    print(m, k, n, xd, wd, path, "rel err", float(np.abs(y - ref).max() / np.abs(ref).max()))


def _nf4_weights(r, k, n, count):
    from onnx_lowbit import nf4
    return sum((nf4.quantize(r.standard_normal((k, n)).astype(np.float32), "nf4", 64) for _ in range(count)), ())


def nf4tc(argv):
    from onnx_lowbit import nf4
    from onnx_lowbit.custom_ops.nf4 import nf4tc_cuda as tc
    m, k, n = (int(v) for v in argv[:3])
    r = np.random.default_rng(0)
    w = _nf4_weights(r, k, n, 2)
    x = r.standard_normal((m, k)).astype(np.float16)
    s = tc.run(x, *w, nf4.code("nf4"), 64, k, n, r.standard_normal(n).astype(np.float16), None)
    y = tc.run(x, w[0], w[1], None, None, nf4.code("nf4"), 64, k, n)
    print("rc", tc.row_chunks(m), "finite", bool(np.isfinite(s).all() and np.isfinite(y).all()))


def nf4wide_ffn(argv):
    """The wide decode at any K (WIDE_MIN_K lowered, the warp-column routes off), one thread group per block or
    GROUPS_CARDS' 3 (on any card)."""
    from numba import cuda

    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda as f
    m, k, n, g = (int(v) for v in argv[:4])
    if g not in (1, 3):
        raise SystemExit("GROUPS: 1 or 3 (the thread groups sessions run)")
    cuda.current_context()
    f.WIDE_MIN_K, f.WARPCOLS = 0, {}
    f.grouped = lambda a16, k_: g == 3
    r = np.random.default_rng(0)
    w = _nf4_weights(r, k, n, 2)
    x = r.standard_normal((m, k)).astype(np.float16)
    s, name = _nf4_call("FusedFFNNF4", x, w, k, n)
    print(name, "finite", bool(np.isfinite(s).all()))


def nf4wide_mm(argv):
    """MatMulNF4's wide M = 1 kernel / two-row decode (M2_MAX_M raised to M)."""
    from numba import cuda

    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda as mc
    m, k, n = (int(v) for v in argv[:3])
    cuda.current_context()
    mc.M2_MAX_M = max(mc.M2_MAX_M, m)
    r = np.random.default_rng(0)
    q, am = _nf4_weights(r, k, n, 1)
    a = r.standard_normal((m, k)).astype(np.float16)
    y, name = _nf4_call("MatMulNF4", a, (q.reshape(-1), am.reshape(-1).astype(np.float32)), k, n,
                        r.standard_normal(n).astype(np.float16))
    print("matmul m", m, name, "finite", bool(np.isfinite(y).all()))


KERNELS = {"fplut": fplut, "nf4": nf4, "awq": awq, "ffn_tc": ffn_tc, "ffn_kn": ffn_kn, "nf4tc": nf4tc,
           "nf4wide_ffn": nf4wide_ffn, "nf4wide_mm": nf4wide_mm}


def main(argv):
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in KERNELS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return KERNELS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
