"""Tests of the "merge" pass (passes/merge.py): sibling weight products of one input -> one product + Split.

Compared: the merged model against the same model rewritten without the merge, both run by onnxruntime on CPU (our
ops through onnx_lowbit.InferenceSession). The merged product computes the same sums per output column; fp32
differences come only from a different blocking of the float accumulation (<= 1e-5 relative), and for our 4-bit
ops the merged weights hold exactly the parts' bytes (checked directly).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

import onnx_lowbit
from onnx_lowbit import domain
from onnx_lowbit.passes import run_passes

CPU = ["CPUExecutionProvider"]


def qkv_model(k=128, ns=(128, 64, 64), opset=17, bias=False, extra=True, seed=0):
    """x [2, 3, K] -> LayerNorm-free stand-in: three MatMuls with constant weights (q, k, v; v optionally a Gemm-style
    MatMul + Add bias), outputs q, k, v and q + k[..., :Nk]-independent extra consumer of x (Relu)."""
    rng = np.random.default_rng(seed)
    inits, nodes, outs = [], [], []
    for name, n in zip("qkv", ns):
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        inits.append(nh.from_array(w, f"W{name}"))
        y = f"{name}_mm" if (bias and name == "v") else name
        nodes.append(oh.make_node("MatMul", ["x", f"W{name}"], [y], name=f"{name}_proj"))
        if bias and name == "v":
            inits.append(nh.from_array(rng.standard_normal(n).astype(np.float32), "bv"))
            nodes.append(oh.make_node("Add", [y, "bv"], [name], name="v_bias"))
        outs.append(oh.make_tensor_value_info(name, TP.FLOAT, None))
    nodes.append(oh.make_node("Mul", ["q", "q"], ["qq"], name="use_q"))     # a later consumer of a merged output
    outs.append(oh.make_tensor_value_info("qq", TP.FLOAT, None))
    if extra:
        nodes.append(oh.make_node("Relu", ["x"], ["r"], name="other_use_of_x"))
        outs.append(oh.make_tensor_value_info("r", TP.FLOAT, None))
    g = oh.make_graph(nodes, "qkv", [oh.make_tensor_value_info("x", TP.FLOAT, [2, 3, k])], outs, inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)])

    return m


def run(model, x):
    return onnx_lowbit.InferenceSession(model, providers=CPU).run(None, {"x": x})


def ops(model):
    """The nodes' (domain, op type), sorted (the passes' toposort may reorder independent nodes)."""
    return sorted((n.domain, n.op_type) for n in model.graph.node)


def _x(k=128, seed=1):
    return np.random.default_rng(seed).standard_normal((2, 3, k)).astype(np.float32)


def test_on_by_default_and_off_with_the_option(tmp_path):
    """The merge runs unless merge_siblings=False (CLI --no-merge-siblings); --merge-siblings is the default."""
    m = qkv_model()
    out, rep = run_passes(m, ["merge"])
    assert ops(out).count(("", "MatMul")) == 1 and len(rep.rewritten("merge")) == 1
    out, rep = run_passes(m, ["merge"], merge_siblings=False)
    assert ops(out) == ops(m) and not rep.entries
    from onnx_lowbit import cli
    src = tmp_path / "qkv.onnx"
    onnx.save(m, src)
    for flags, matmuls in (([], 1), (["--merge-siblings"], 1), (["--no-merge-siblings"], 3)):
        dst = tmp_path / f"out{len(flags)}{matmuls}.onnx"
        assert cli.main(["rewrite", str(src), str(dst), *flags]) == 0
        assert ops(onnx.load(dst)).count(("", "MatMul")) == matmuls, flags


@pytest.mark.parametrize("opset", [17, 11])
def test_float_siblings_merge_into_one_matmul_and_split(opset):
    m = qkv_model(opset=opset)
    out, rep = run_passes(m, ["merge"], merge_siblings=True)
    kinds = ops(out)
    assert kinds.count(("", "MatMul")) == 1 and kinds.count(("", "Split")) == 1, kinds
    (entry,) = rep.rewritten("merge")
    assert entry.details["n"] == [128, 64, 64] and len(entry.nodes) == 3
    split = next(n for n in out.graph.node if n.op_type == "Split")
    assert (len(split.input) == 2) == (opset >= 13)   # split sizes: an input from opset 13, else an attribute
    assert [o.name for o in out.graph.output] == [o.name for o in m.graph.output]
    x = _x()
    for a, b in zip(run(out, x), run(m, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["nf4", "awq"])
def test_4bit_siblings_merge_with_the_parts_bytes(fmt):
    """weights4 then merge: one MatMulNF4 / MatMulAWQ whose packed tensors are the parts' concatenated, N summed,
    the bias of the part that had one kept (zeros for the others); outputs as without the merge."""
    m = qkv_model(bias=True)
    ref, _ = run_passes(m, ["weights4"], weights=fmt)
    out, rep = run_passes(m, ["weights4", "merge"], weights=fmt, merge_siblings=True)
    op = "MatMulNF4" if fmt == "nf4" else "MatMulAWQ"
    mine = [n for n in out.graph.node if n.domain == domain.DOMAIN]
    assert [n.op_type for n in mine] == [op] and len(rep.rewritten("merge")) == 1
    assert {a.name: a.i for a in mine[0].attribute if a.name in ("K", "N")} == {"K": 128, "N": 256}
    split = next(n for n in out.graph.node if n.op_type == "Split")
    by_out = {n.output[0]: n for n in ref.graph.node if n.op_type == op}
    parts = [by_out[o] for o in split.output]          # the parts in the merged weight's order
    assert len(parts) == 3
    inits = {t.name: nh.to_array(t) for t in out.graph.initializer}
    rinits = {t.name: nh.to_array(t) for t in ref.graph.initializer}
    npacked = 2 if fmt == "nf4" else 3
    for i in range(npacked):    # Q, absmax (NF4, flat) / qweight, qzeros, scales (AWQ, along axis 1)
        merged = inits[mine[0].input[1 + i]]
        want = [rinits[p.input[1 + i]] for p in parts]
        want = np.concatenate([w.reshape(-1) for w in want]) if fmt == "nf4" else np.concatenate(want, axis=1)
        assert np.array_equal(merged.reshape(want.shape), want), i
    bias = inits[mine[0].input[1 + npacked]]
    ns = [int(next(a.i for a in p.attribute if a.name == "N")) for p in parts]
    offs = np.cumsum([0] + ns)
    for p, lo, hi in zip(parts, offs[:-1], offs[1:]):
        has = len(p.input) > 1 + npacked
        assert np.array_equal(bias[lo:hi], rinits[p.input[1 + npacked]] if has else np.zeros(hi - lo, bias.dtype))
    assert bias.shape == (256,) and bias.any()
    x = _x()
    for a, b in zip(run(out, x), run(ref, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt,op", [("nf4", "MatMulBnb4"), ("awq", "MatMulNBits")])
def test_onnxruntime_target_siblings_merge(fmt, op):
    """--target ort: onnxruntime's own MatMulBnb4 / MatMulNBits siblings merge the same way (their layouts are N-major
    too); the merged model runs on stock onnxruntime and gives the unmerged model's outputs."""
    import onnxruntime as ort
    m = qkv_model(bias=True)
    ref, _ = run_passes(m, ["weights4"], weights=fmt, weights_target="ort")
    out, rep = run_passes(m, ["weights4", "merge"], weights=fmt, weights_target="ort", merge_siblings=True)
    mine = [n for n in out.graph.node if n.op_type == op]
    assert len(mine) == 1 and len(rep.rewritten("merge")) == 1
    assert {a.name: a.i for a in mine[0].attribute if a.name in ("K", "N")} == {"K": 128, "N": 256}
    x = _x()
    got = ort.InferenceSession(out.SerializeToString(), providers=CPU).run(None, {"x": x})
    want = ort.InferenceSession(ref.SerializeToString(), providers=CPU).run(None, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_nf4_parts_that_straddle_blocks_are_skipped_with_a_reason():
    """K = 96, block 64: a part of N = 2 holds 192 weights = 3 blocks, but a part of N = 1 ends inside a block, which
    only the last part of a merged weight may do; with two such parts one is not last: the group is skipped and
    reported, and the model is as without the merge."""
    m = qkv_model(k=96, ns=(1, 1, 64), extra=False)
    ref, _ = run_passes(m, ["weights4"], weights="nf4", weights_min_elements=0)
    out, rep = run_passes(m, ["weights4", "merge"], weights="nf4", weights_min_elements=0, merge_siblings=True)
    assert not rep.rewritten("merge")
    (skip,) = rep.skipped("merge")
    assert "absmax blocks" in skip.reason and len(skip.nodes) == 3
    assert ops(out) == ops(ref)


def test_old_opset_is_skipped_with_a_reason():
    m = qkv_model(opset=10)
    out, rep = run_passes(m, ["merge"], merge_siblings=True)
    assert ops(out) == ops(m) and "opset 10" in rep.skipped("merge")[0].reason


def test_products_of_different_inputs_or_kinds_stay_apart():
    """Two MatMuls of different inputs, and one MatMul whose weight is not constant: nothing to merge."""
    rng = np.random.default_rng(0)
    w = nh.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")
    g = oh.make_graph([oh.make_node("MatMul", ["x", "W"], ["a"]), oh.make_node("MatMul", ["z", "W"], ["b"]),
                       oh.make_node("MatMul", ["x", "z2"], ["c"])], "g",
                      [oh.make_tensor_value_info(n, TP.FLOAT, s) for n, s in (("x", [2, 8]), ("z", [2, 8]),
                                                                             ("z2", [8, 4]))],
                      [oh.make_tensor_value_info(n, TP.FLOAT, None) for n in "abc"], [w])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    out, rep = run_passes(m, ["merge"], merge_siblings=True)
    assert ops(out) == ops(m) and not rep.entries


def test_cli_flag_last_one_wins(tmp_path):
    from onnx_lowbit.cli import main
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(qkv_model(), src)
    for flags, splits in ((["--merge-siblings", "--no-merge-siblings"], 0),
                          (["--no-merge-siblings", "--merge-siblings"], 1)):
        assert main(["rewrite", str(src), str(dst), *flags]) == 0
        assert [n.op_type for n in onnx.load(dst).graph.node].count("Split") == splits, flags
