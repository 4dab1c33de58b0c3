"""FPLUT on the GPU: correctness against the numpy reference, throughput against torch, and the per-op
overhead of our CUDA-EP bridge against an onnxruntime native op, all in one run. The kernel runs as a session
node runs it (custom_ops.runtime.direct.call: the kernel object's compute and its ROUTES).

    PYTHONPATH=/tmp/ortgpu/site:. python benchmarks/fplut_gpu.py [--json OUT.json]

Needs: a CUDA GPU, torch (timing anchor), onnxruntime-gpu (for the session part; skipped if absent).
"""
from __future__ import annotations

import argparse

import numpy as np
from timing import bind_io, copy_gbps, time_cuda, time_wall, write_json

from onnx_lowbit import fplut, halfbits
from onnx_lowbit.custom_ops.runtime import direct

try:
    from onnx_lowbit import fplut_tables
except ImportError:  # pragma: no cover
    fplut_tables = None
SEED_SILU = [-20.359375, -17.109375, -8.3671875, -1.9755859375, -0.255615234375, -0.007244110107421875,
             0.0072174072265625, 0.228515625, 1.58203125, 10.46875, 65504.0]


def _attrs(table):
    return {"function": "silu", "cut_points": list(table.cut_points), "table": table.values.astype(np.float32)}


def run_host(x, table, bf16=False):
    """FPLUT on host array ``x`` (bf16: uint16 bits read as bfloat16) through direct.call, on Numba device arrays."""
    from numba import cuda
    dx, dy = cuda.to_device(np.ascontiguousarray(x)), cuda.device_array(x.shape, x.dtype)
    wrap = (lambda a: direct.typed(a, 16)) if bf16 else (lambda a: a)  # noqa: E731
    direct.call("FPLUT", _attrs(table), [wrap(dx)], [wrap(dy)], 0)()
    cuda.synchronize()
    return dy.copy_to_host()


def check_correctness(table):
    cuts, vals = table.cut_points, table.values
    rng = np.random.default_rng(0)
    bad = []
    allx = halfbits.all_fp16()  # every fp16 pattern, NaN/Inf included
    for n in [1, 3, 4, 5, 1023, 4097, 65536 + 3, 1 << 20, 3_000_001]:
        x16 = allx[rng.integers(0, 65536, n)] if n > 8 else np.array([np.nan, np.inf, -np.inf, 0.5, -3, 1e4, -0.0, 7][:n], np.float16)
        x32 = (rng.standard_normal(n) * 8).astype(np.float32)
        x32[: min(n, 4)] = np.array([np.nan, np.inf, -np.inf, 1e30], np.float32)[: min(n, 4)]
        xb = halfbits.f32_to_bf16_bits(x32)
        for name, x, bf in [("fp16", x16, False), ("fp32", x32, False), ("bf16", xb, True)]:
            y = run_host(x, table, bf16=bf)
            ref = fplut.apply(x, cuts, vals, bf16=bf)
            if not np.array_equal(y.view(np.uint8), ref.view(np.uint8)):
                bad.append((name, n))
    # exhaustive over fp16
    y = run_host(allx.copy(), table)
    if not np.array_equal(y.view(np.uint16), fplut.apply(allx, cuts, vals).view(np.uint16)):
        bad.append(("fp16-exhaustive", 65536))
    return bad


def throughput(table, n=64 << 20):
    import torch
    rows = []
    copy_bw, t_copy = copy_gbps()
    rows.append(("d2d copy 256 MiB", t_copy, copy_bw, None))
    for dt in (torch.float16, torch.float32, torch.bfloat16):
        x = (torch.randn(n, device="cuda") * 4).to(dt)
        out = torch.empty_like(x)
        bf = dt == torch.bfloat16
        wrap = (lambda a: direct.typed(a.view(torch.int16), 16)) if bf else (lambda a: a)  # noqa: E731
        stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
        run = direct.call("FPLUT", _attrs(table), [wrap(x)], [wrap(out)], stream)
        ours = time_cuda(run)
        torch_t = time_cuda(lambda: torch.nn.functional.silu(x, inplace=False))
        nbytes = 2 * x.numel() * x.element_size()
        # spot check vs reference on a slice
        ref = fplut.apply(x[:100000].view(torch.int16).cpu().numpy().view(np.uint16), table.cut_points, table.values,
                          bf16=True) if bf else fplut.apply(x[:100000].cpu().numpy(), table.cut_points, table.values)
        got = out[:100000].view(torch.int16).cpu().numpy().view(np.uint16) if bf else out[:100000].cpu().numpy()
        ok = np.array_equal(np.asarray(got).view(np.uint8), np.asarray(ref).view(np.uint8))
        rows.append((f"FPLUT silu 64M {str(dt)[6:]} (ours)", ours, nbytes / ours / 1e3, ok))
        rows.append((f"torch silu 64M {str(dt)[6:]}", torch_t, nbytes / torch_t / 1e3, None))
        rows.append((f"ratio ours/torch throughput {str(dt)[6:]}", torch_t / ours, None, None))
    return rows, copy_bw


def ort_overhead(table, reps=2000):
    """Wall time per run of a one-FPLUT model vs a one-Relu model, [1,4096] fp16, IOBinding on the GPU."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    import onnx_lowbit
    from onnx_lowbit import domain
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return None
    def model(node):
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4096])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4096])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)
    ours = model(helper.make_node("FPLUT", ["x"], ["y"], domain=domain.DOMAIN, name="act", function="silu",
                                  cut_points=list(table.cut_points), table=table.values.astype(np.float32).tolist()))
    native = model(helper.make_node("Relu", ["x"], ["y"]))
    results = {}
    x = np.random.randn(1, 4096).astype(np.float16)
    for name, m in [("onnxruntime Relu (native)", native), ("FPLUT via onnx-lowbit bridge", ours)]:
        so = ort.SessionOptions()
        so.optimized_model_filepath = f"/tmp/opt_{len(results)}.onnx"
        onnx_lowbit.register(so)
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CUDAExecutionProvider"])
        opt = onnx.load(so.optimized_model_filepath)
        memcpy = [n.op_type for n in opt.graph.node if n.op_type.startswith("Memcpy")]
        io, (yv,) = bind_io(sess, {"x": x}, x)
        med, p90 = time_wall(lambda: sess.run_with_iobinding(io), reps, warmup=200)
        y = yv.numpy()
        ok = None
        if name.startswith("FPLUT"):
            ok = bool(np.array_equal(y.view(np.uint16), fplut.apply(x, table.cut_points, table.values).view(np.uint16)))
        results[name] = (med, p90, memcpy, ok)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    try:
        table = fplut_tables.get_table("silu")
    except Exception as e:  # noqa: BLE001
        print("shipped tables unavailable, using the seed table:", e)
        table = fplut.Table.build("silu", SEED_SILU)
    print("GPU:", torch.cuda.get_device_name(0))
    bad = check_correctness(table)
    print("correctness vs numpy reference:", "all bit-exact" if not bad else f"MISMATCH {bad}")
    rows, copy_bw = throughput(table)
    print(f"{'case':45s} {'us':>9s} {'GB/s':>8s} {'%copy':>6s}  bit-exact")
    for name, us, bw, ok in rows:
        if bw is None:
            print(f"{name:45s} {us:9.3f}")
        else:
            print(f"{name:45s} {us:9.1f} {bw:8.0f} {100 * bw / copy_bw:6.1f}  {'' if ok is None else ok}")
    ov = ort_overhead(table)
    if ov is None:
        print("onnxruntime-gpu not available: session overhead not measured")
    else:
        for name, (med, p90, memcpy, ok) in ov.items():
            print(f"{name:45s} median {med:7.1f} us/run  p90 {p90:7.1f}  memcpy nodes: {memcpy or 'none'}  "
                  f"{'' if ok is None else 'bit-exact=' + str(ok)}")
        names = list(ov)
        print(f"per-op overhead of the bridge vs native: {ov[names[1]][0] - ov[names[0]][0]:.1f} us")
    write_json(a.json, {"rows": rows, "copy_bw": copy_bw, "bad": bad,
                        "ort": {k: list(v) for k, v in (ov or {}).items()}}, default=str)


if __name__ == "__main__":
    main()
