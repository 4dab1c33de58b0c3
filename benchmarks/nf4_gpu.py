"""NF4 4-bit weights on the GPU: MatMulNF4 decode kernel and DequantNF4 against the reference and against the
anchors measured in the same run: torch fp16 GEMV (x @ W, W fp16 [4096, 11008], two of them = gate + up),
onnxruntime's own MatMulBnb4 (CUDA EP, two nodes), and a 256 MiB device copy for bandwidth.

    PYTHONPATH=/tmp/ortgpu/site:. python3 benchmarks/nf4_gpu.py
"""
from __future__ import annotations

import statistics
import time

import numpy as np
from timing import time_cuda
import torch

from onnx_lowbit.custom_ops import dequantnf4_cuda as dq
from onnx_lowbit.custom_ops import matmulnf4_cpu as cpu
from onnx_lowbit.custom_ops import matmulnf4_cuda as mm
from onnx_lowbit.custom_ops import nf4_common

K, N, BS = 4096, 11008, 64


def weights(rng, k=K, n=N, bs=BS):
    q = rng.integers(0, 256, (k * n + 1) // 2, dtype=np.uint8)
    absmax = (rng.random((k * n + bs - 1) // bs) * 0.1 + 0.01).astype(np.float32)
    return q, absmax


def main():
    rng = np.random.default_rng(0)
    code = nf4_common.parse_attrs({"quant_type": "nf4", "block_size": BS, "K": K, "N": N})[4]
    print("GPU:", torch.cuda.get_device_name(0))
    # ---- correctness on several shapes (fast and generic kernels) vs the CPU kernel (tested against onnx_lowbit.nf4)
    for (m, k, n, bs, dt) in [(1, 4096, 1024, 64, np.float16), (4, 4096, 512, 64, np.float32), (16, 1024, 256, 128, np.float16),
                              (1, 688, 256, 64, np.float16), (17, 256, 64, 32, np.float32), (1, 4096, 11008, 64, np.float16)]:
        q, am = weights(rng, k, n, bs)
        a = rng.standard_normal((m, k)).astype(dt)
        bias = rng.standard_normal(n).astype(dt)
        ref = cpu.matmul(a.astype(np.float32), q, am, code, k, n, bs, bias.astype(np.float32))
        for mode in ["generic"] + (["fast"] if mm.fast_path(m, k) else []) + (["m1"] if mm.m1_path(m, k) else []):
            y = mm.run_arrays(a, q, am, code, k, n, bs, bias, mode=mode)
            err = np.abs(y.astype(np.float64) - ref).max() / (np.abs(ref).max() + 1e-9)
            print(f"MatMulNF4 M={m} K={k} N={n} bs={bs} {np.dtype(dt).name} [{mode}]: rel err {err:.2e} "
                  f"{'OK' if err < 2e-3 else 'FAIL'}")
        for tr in (True, False):
            w = dq.run_arrays(q, am, code, k, n, bs, transposed=tr)
            wr = cpu_dq(q, am, code, k, n, bs, tr)
            print(f"DequantNF4 transposed={int(tr)} K={k} N={n}: {'bit-exact' if np.array_equal(w, wr) else 'MISMATCH'}")
    # ---- timing: gate + up
    copy_src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    t_copy = time_cuda(lambda: copy_dst.copy_(copy_src))
    bw = 2 * copy_src.numel() / t_copy / 1e3
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    W1 = torch.randn(K, N, device="cuda", dtype=torch.float16) * 0.02
    W3 = torch.randn(K, N, device="cuda", dtype=torch.float16) * 0.02
    t_torch = time_cuda(lambda: (x @ W1, x @ W3))
    qs = [weights(rng) for _ in range(2)]
    dev = [(torch.from_numpy(q).cuda(), torch.from_numpy(a).cuda()) for q, a in qs]
    dcode = torch.from_numpy(code).cuda()
    y1 = torch.empty(1, N, device="cuda", dtype=torch.float16)
    y2 = torch.empty_like(y1)
    L = mm._launcher("fast", np.float16)
    L1 = mm._launcher("m1", np.float16, mm.m1_pair(K))
    stream = torch.cuda.current_stream().cuda_stream
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def ours():
        for (q, am), y in zip(dev, (y1, y2)):
            L.launch(mm.fast_grid(N, sms), 32 * mm.WARPS_PER_BLOCK, stream, (x.data_ptr(), (K,)),
                     (q.data_ptr(), (K * N // 16,)), (am.data_ptr(), (am.numel(),)), (dcode.data_ptr(), (16,)),
                     (y.data_ptr(), (N,)), 0, (y.data_ptr(), (N,)), 1, K, N, BS.bit_length() - 5, shmem=K * 4)
    t_fast = time_cuda(ours)
    print(f"  variant: smem-x kernel (any M <= 16), 4 blocks/SM: {t_fast:.1f} us")

    def ours_m1(grid_blocks):
        for (q, am), y in zip(dev, (y1, y2)):
            L1.launch(grid_blocks, mm.m1_block(K), stream, (x.data_ptr(), (K,)), (q.data_ptr(), (K * N // 16,)),
                      (am.data_ptr(), (am.numel(),)), (dcode.data_ptr(), (16,)), (y.data_ptr(), (N,)), 0,
                      (y.data_ptr(), (N,)), K, N, BS.bit_length() - 5)
    for gb in (sms * 4, sms * 8):
        print(f"  variant: register-x M=1 kernel, grid {gb}: {time_cuda(lambda: ours_m1(gb)):.1f} us")
    from onnx_lowbit.custom_ops.cuda_launch import Array, Launcher
    for cols in (8, 16):
        kv = Launcher(mm._make_m1(cols, prefetch=False, pair=True), [Array(np.float16), Array(np.uint64), Array(np.float32), Array(np.float32),
                                          Array(np.float16), "int32", Array(np.float16), "int64", "int64", "int64"],
                      dynamic_shared=mm.TAB_BYTES)

        def run_v(kv=kv, cols=cols):
            for (q, am), y in zip(dev, (y1, y2)):
                kv.launch(max(1, min((N + cols - 1) // cols, sms * 3)), mm.m1_block(K), stream, (x.data_ptr(), (K,)),
                          (q.data_ptr(), (K * N // 16,)), (am.data_ptr(), (am.numel(),)), (dcode.data_ptr(), (16,)),
                          (y.data_ptr(), (N,)), 0, (y.data_ptr(), (N,)), K, N, BS.bit_length() - 5)
        print(f"  variant: register-x M=1 kernel, COLS={cols}: {time_cuda(run_v):.1f} us")
    t_ours = time_cuda(lambda: ours_m1(mm.m1_grid(N, sms)))
    ref1 = cpu.matmul(x.float().cpu().numpy(), qs[0][0], qs[0][1], code, K, N, BS)
    e1 = np.abs(y1.float().cpu().numpy() - ref1).max() / np.abs(ref1).max()
    print(f"  (M=1 kernel output vs reference on the timed data: rel err {e1:.1e})")
    nbytes = 2 * (K * N // 2 + (K * N // BS) * 4)
    print(f"\n{'case (x[1,4096] . W[4096,11008] x2)':48s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s}")
    print(f"{'device copy 256 MiB':48s} {t_copy:8.1f} {bw:7.0f} {100:6.1f}")
    print(f"{'torch fp16 GEMV x2':48s} {t_torch:8.1f} {2 * K * N * 2 / t_torch / 1e3:7.0f} "
          f"{100 * 2 * K * N * 2 / t_torch / 1e3 / bw:6.1f}")
    print(f"{'MatMulNF4 M=1 kernel x2 (ours, block 64)':48s} {t_ours:8.1f} {nbytes / t_ours / 1e3:7.0f} "
          f"{100 * nbytes / t_ours / 1e3 / bw:6.1f}")
    print(f"speedup vs torch fp16: {t_torch / t_ours:.2f}x")
    # dequant streaming
    q, am = dev[0]
    out = torch.empty(N * K, device="cuda", dtype=torch.float16)
    Ld = dq._launcher(True, np.float32)
    out32 = torch.empty(N * K, device="cuda", dtype=torch.float32)
    t_dq = time_cuda(lambda: Ld.launch(dq._grid_rows(K * N), dq.BLOCK, stream, (q.data_ptr(), (K * N // 16,)),
                                       (q.data_ptr(), (q.numel(),)), (am.data_ptr(), (am.numel(),)),
                                       (dcode.data_ptr(), (16,)), (out32.data_ptr(), (K * N,)), K * N,
                                       BS.bit_length() - 5, BS))
    db = K * N // 2 + am.numel() * 4 + K * N * 4
    print(f"{'DequantNF4 4096x11008 -> fp32 W^T (ours)':48s} {t_dq:8.1f} {db / t_dq / 1e3:7.0f} {100 * db / t_dq / 1e3 / bw:6.1f}")
    del out
    ort_anchor(qs, code)


def cpu_dq(q, am, code, k, n, bs, tr):
    from onnx_lowbit.custom_ops import dequantnf4_cpu
    return dequantnf4_cpu.dequantize(q, am, code, k, n, bs, tr)


def ort_anchor(qs, code):
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("onnxruntime-gpu not available: MatMulBnb4 anchor not measured")
        return
    inits, nodes = [], []
    for i, (q, am) in enumerate(qs):
        # onnxruntime's MatMulBnb4 wants absmax in A's type (fp16 here); our op keeps fp32
        inits += [numpy_helper.from_array(q, f"q{i}"), numpy_helper.from_array(am.astype(np.float16), f"a{i}")]
        nodes.append(helper.make_node("MatMulBnb4", ["x", f"q{i}", f"a{i}"], [f"y{i}"], domain="com.microsoft",
                                      K=K, N=N, block_size=BS, quant_type=1))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, K])],
                          [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT16, [1, N]) for i in range(2)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                          ir_version=10)
    try:
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        print("MatMulBnb4 anchor failed:", str(e)[:200])
        return
    xn = np.random.default_rng(1).standard_normal((1, K)).astype(np.float16)
    xv = ort.OrtValue.ortvalue_from_numpy(xn, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xv)
    for i in range(2):
        io.bind_output(f"y{i}", "cuda")
    for _ in range(50):
        sess.run_with_iobinding(io)
    ts = []
    for _ in range(500):
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        ts.append((time.perf_counter() - t) * 1e6)
    ys = io.copy_outputs_to_cpu()
    ref = cpu.matmul(xn.astype(np.float32), qs[0][0], qs[0][1], code, K, N, BS)
    err = np.abs(ys[0].astype(np.float64) - ref).max() / np.abs(ref).max()
    print(f"{'onnxruntime MatMulBnb4 x2 (CUDA EP, wall/run)':48s} {statistics.median(ts):8.1f}   "
          f"(its output vs our reference: rel err {err:.1e} -> same layout: {err < 2e-2})")


if __name__ == "__main__":
    main()
