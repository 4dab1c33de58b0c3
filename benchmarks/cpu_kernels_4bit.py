"""The 4-bit and idle sections of benchmarks/cpu_kernels.py (run that script; this module holds its helpers).

4bit: MatMulNF4 (block 64; accuracy_level 0, and 4: int8 activations) and MatMulAWQ (group 128) of one random weight
per K x N, each as the kernel alone (the CPU face's ``product``, what compute calls; level 4: A quantised, then the
product: on VNNI CPUs the column-lane product of the weight packed once, as a node with a constant weight runs
it) and as a node of an onnx_lowbit session (IOBinding, fp32 A), against
onnxruntime's MatMulNBits (the AWQ weights in its layout, accuracy_level 0 and 4) and the fp32 MatMul of the
dequantised AWQ weight, all in one onnxruntime version and process.
idle: CPU seconds the process burns while sleeping 0.5 s right after each product (our paths, then numpy's BLAS
product of the same shape for comparison), and a plain onnxruntime fp32 MatMul run timed right after each.
"""
from __future__ import annotations

import resource
import sys
import time

import numpy as np

from cpu_kernels import bound_run, compare, session, words
from timing import print_table


def _models(K, N, w32, qw, qz, sc, q, am, m):  # noqa: N803
    """name -> ModelProto of one node taking A [m, K] fp32."""
    from onnx import TensorProto, helper, numpy_helper

    from onnx_lowbit import domain
    from onnx_lowbit.passes.weights4_quant import nbits_layout

    def model(node, inits, ours=False):
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, N])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
        ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(g, opset_imports=ops + ([domain.opset_import()] if ours else []), ir_version=10)

    b, s, zp = nbits_layout(qw, qz, sc, K, 128, np.float32, N)
    out = {}
    for lvl in (0, 4):
        out[f"nbits{lvl}"] = model(helper.make_node("MatMulNBits", ["a", "b", "s", "z"], ["y"], domain="com.microsoft",
                                                    bits=4, block_size=128, K=K, N=N, accuracy_level=lvl),
                                   {"b": b, "s": s, "z": zp})
    out["fp32"] = model(helper.make_node("MatMul", ["a", "w"], ["y"]), {"w": w32})
    for name, lvl in (("nf4", 0), ("nf4 lvl4", 4)):
        out[name] = model(helper.make_node("MatMulNF4", ["a", "q", "am"], ["y"], domain=domain.DOMAIN,
                                           quant_type="nf4", block_size=64, K=K, N=N, accuracy_level=lvl),
                          {"q": q, "am": am}, ours=True)
    out["awq"] = model(helper.make_node("MatMulAWQ", ["a", "qweight", "qzeros", "scales"], ["y"],
                                        domain=domain.DOMAIN, group_size=128, K=K, N=N),
                       {"qweight": qw, "qzeros": qz, "scales": sc}, ours=True)
    return out


def _weights(K, N):  # noqa: N803
    from onnx_lowbit import awq, nf4
    w = (np.random.default_rng(K + N).standard_normal((K, N)) * 0.05).astype(np.float32)
    qw, qz, sc = awq.quantize_rtn(w, 128)
    q, am = nf4.quantize(w, "nf4", 64)
    return w, qw, qz, sc, q, am


def fourbit_section(threads, shapes, ms, rounds):
    import numba

    from onnx_lowbit import awq, nf4
    from onnx_lowbit.custom_ops.awq import matmulawq_cpu
    from onnx_lowbit.custom_ops.awq.dequantawq_cpu import parse_attrs
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cpu, matmulnf4_int8_cpu as int8, nf4col_cpu
    print(f"NF4 permute kernels (AVX-512): {matmulnf4_cpu.FAST}, int8 (accuracy_level 4) VNNI kernels: {int8.VNNI}")
    tbl = int8.table("nf4")
    rows = []
    for t in threads:
        numba.set_num_threads(t)
        clock = time.thread_time if t == 1 else time.perf_counter
        for K, N in shapes:  # noqa: N806
            w, qw, qz, sc, q, am = _weights(K, N)
            w32 = awq.dequantize(qw, qz, sc, 128, K, N).astype(np.float32)
            code = np.ascontiguousarray(nf4.code("nf4"), dtype=np.float32)
            sh = parse_attrs({"group_size": 128, "K": K, "N": N})
            pk = nf4col_cpu.pack(q, am, K, N, 64, 64) if int8.VNNI else None
            for m in ms:
                a = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
                runs = {}
                for name, mod in _models(K, N, w32, qw, qz, sc, q, am, m).items():
                    runs[name], _ = bound_run(session(mod, t, ours=name in ("nf4", "nf4 lvl4", "awq")), {"a": a},
                                              (m, N), np.float32)
                runs["nf4 kernel"] = lambda: matmulnf4_cpu.product(a, q, am, code, K, N, 64)  # noqa: B023
                if int8.VNNI:   # the constant weight's path (packed once, as a session node packs it)
                    runs["nf4 lvl4 kernel"] = lambda: int8.product_packed(a, pk, tbl)  # noqa: B023
                else:
                    runs["nf4 lvl4 kernel"] = (lambda: int8.product(int8.quantize(a, 64), q, am, tbl,  # noqa: B023
                                                                    K, N, 64, 64))
                runs["awq kernel"] = lambda: matmulawq_cpu.product(a, qw, qz, sc, sh)  # noqa: B023
                got = compare(runs, rounds, clock)
                for ours in ("nf4", "nf4 lvl4", "awq"):
                    k_us, s_us = got[f"{ours} kernel"], got[ours]
                    rows.append([t, f"{K}x{N}", m, ours, f"{k_us:.0f}", f"{s_us:.0f}", f"{got['nbits0']:.0f}",
                                 words(s_us, got["nbits0"]), f"{got['nbits4']:.0f}", words(s_us, got["nbits4"]),
                                 f"{got['fp32']:.0f}", words(s_us, got["fp32"])])
                    print(" ".join(str(v) for v in rows[-1]), file=sys.stderr, flush=True)
    print_table(["threads", "K x N", "M", "op", "kernel us", "session us", "NBits lvl0 us", "session vs lvl0",
                 "NBits lvl4 us", "session vs lvl4", "fp32 MatMul us", "session vs fp32"], rows,
                numeric=[2, 4, 5, 6, 8, 10])
    return rows


def _idle_cpu(seconds=0.5):
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def idle_section(threads, K=2048, N=2048, m=24):  # noqa: N803
    """CPU burnt while idle after a product, and the next onnxruntime run's time (the symptom of a spinning pool)."""
    import numba

    from onnx_lowbit import nf4
    from onnx_lowbit.custom_ops.awq import matmulawq_cpu
    from onnx_lowbit.custom_ops.awq.dequantawq_cpu import parse_attrs
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cpu
    w, qw, qz, sc, q, am = _weights(K, N)
    code = np.ascontiguousarray(nf4.code("nf4"), dtype=np.float32)
    sh = parse_attrs({"group_size": 128, "K": K, "N": N})
    a = np.random.default_rng(0).standard_normal((m, K)).astype(np.float32)
    rows = []
    for t in threads:
        numba.set_num_threads(t)
        ort_run, _ = bound_run(session(_models(K, N, w, qw, qz, sc, q, am, m)["fp32"], t), {"a": a}, (m, N),
                               np.float32)
        cases = {"nothing": lambda: None,
                 "MatMulNF4 product": lambda: matmulnf4_cpu.product(a, q, am, code, K, N, 64),
                 "MatMulAWQ product": lambda: matmulawq_cpu.product(a, qw, qz, sc, sh),
                 "numpy BLAS a @ w": lambda: a @ w}
        for name, fn in cases.items():
            fn()
            fn()
            cpu = _idle_cpu()
            fn()
            t0 = time.perf_counter()
            ort_run()
            after = (time.perf_counter() - t0) * 1e6
            rows.append([t, m, name, f"{cpu:.3f}", f"{after:.0f}"])
    print_table(["threads", "M", "last call", "CPU s burnt in 0.5 s idle", "next ort MatMul run us"], rows,
                numeric=[1, 3, 4])
    return rows
