"""merge on the CPU: three sibling MatMuls (q/k/v) against merge's one MatMul + Split, CPU sessions."""
import sys, numpy as np, onnx
from onnx import helper, TensorProto, numpy_helper
from onnx_lowbit import tune
from onnx_lowbit.passes import run_passes
def model(d, seq):
    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    for n in "qkv":
        inits.append(numpy_helper.from_array((rng.standard_normal((d, d)) * 0.05).astype(np.float32), f"w{n}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w{n}"], [n], name=f"mm_{n}"))
        outs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, seq, d]))
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, d])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
for d, seq in [(768, 1), (768, 16), (768, 128), (2048, 1), (2048, 16)]:
    m = model(d, seq)
    out, rep = run_passes(m, passes=["merge"])
    assert len(rep.rewritten()) == 1
    feeds = {"x": np.random.default_rng(1).standard_normal((1, seq, d)).astype(np.float32)}
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    t = tune.SessionTimer(feeds, runs=runs, warmup=10)
    a, b = t(m, out)
    print(f"d={d} seq={seq}: 3 MatMuls {a*1e3:.1f} us, merged {b*1e3:.1f} us: {tune.speed(a, b)}", flush=True)
