"""The gru pass: ONNX GRU -> QuantGRU (hand-built GRUs in every supported form, the look-alikes it must skip, bad
calibration data, the CLI). Rewritten models run in onnxruntime with our kernels: their outputs equal the integer
reference (onnx_lowbit.gru_int) with the node's stored parameters, and are within int16's error of the float GRU
(relative L2 <= 1e-2; measured ~1e-3, docs/gru.md)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_lowbit
from onnx_lowbit import cli, domain, gru_float, gru_int
from onnx_lowbit.passes import run_passes
from onnx_lowbit.passes import gru
from onnx_lowbit.passes.gru import GRUPass

CPU = ["CPUExecutionProvider"]
T, N, C, H = 7, 3, 5, 8


def weights(d, seed=0):
    rng = np.random.default_rng(seed)
    k = 1.0 / np.sqrt(H)
    return (rng.uniform(-k, k, (d, 3 * H, C)).astype(np.float32), rng.uniform(-k, k, (d, 3 * H, H)).astype(np.float32),
            rng.uniform(-k, k, (d, 6 * H)).astype(np.float32))


def gru_model(direction="forward", layout=0, lbr=1, h0=False, lens=False, outputs=("Y", "Y_h"), clip=None,
              activations=None, fold=False, bias=True, seed=0):
    d = 2 if direction == "bidirectional" else 1
    W, R, B = weights(d, seed)
    nodes, inits = [], [numpy_helper.from_array(R, "R")]
    if fold:  # W through Slice / Concat / Unsqueeze / Transpose of initializers, as exporters write it
        wt = np.ascontiguousarray(W[0].T)                                     # [C, 3H]
        inits += [numpy_helper.from_array(wt[:, :2 * H].copy(), "Wt_a"), numpy_helper.from_array(wt[:, 2 * H:].copy(),
                  "Wt_b"), numpy_helper.from_array(np.array([0], np.int64), "ax0"),
                  numpy_helper.from_array(np.array([0], np.int64), "s0"),
                  numpy_helper.from_array(np.array([3 * H], np.int64), "s1")]
        nodes += [helper.make_node("Concat", ["Wt_a", "Wt_b"], ["Wt"], axis=1),
                  helper.make_node("Transpose", ["Wt"], ["W2"], perm=[1, 0]),
                  helper.make_node("Slice", ["W2", "s0", "s1", "ax0"], ["W2s"]),
                  helper.make_node("Unsqueeze", ["W2s", "ax0"], ["W"])]
        assert d == 1
    else:
        inits.append(numpy_helper.from_array(W, "W"))
    if bias:
        inits.append(numpy_helper.from_array(B, "B"))
    ins = ["X", "W", "R", "B" if bias else "", "L" if lens else "", "H0" if h0 else ""]
    while ins[-1] == "":
        ins.pop()
    attrs = dict(hidden_size=H, direction=direction, linear_before_reset=lbr)
    if layout:
        attrs["layout"] = 1
    if clip is not None:
        attrs["clip"] = clip
    if activations is not None:
        attrs["activations"] = activations
    outs = list(outputs)
    nodes.append(helper.make_node("GRU", ins, outs, name="gru", **attrs))
    xs = [T, N, C] if layout == 0 else [N, T, C]
    g_in = [helper.make_tensor_value_info("X", TensorProto.FLOAT, xs)]
    if lens:
        g_in.append(helper.make_tensor_value_info("L", TensorProto.INT32, [N]))
    if h0:
        g_in.append(helper.make_tensor_value_info("H0", TensorProto.FLOAT, [d, N, H] if layout == 0 else [N, d, H]))
    shapes = {"Y": [T, d, N, H] if layout == 0 else [N, T, d, H], "Y_h": [d, N, H] if layout == 0 else [N, d, H]}
    g_out = [helper.make_tensor_value_info(o, TensorProto.FLOAT, shapes[o]) for o in outs if o]
    g = helper.make_graph(nodes, "g", g_in, g_out, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)], ir_version=8), (W, R, B)


def feeds_for(m, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for vi in m.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.name == "L":
            out["L"] = np.array([T, 3, 0][:N], np.int32) if seed % 2 else np.array([T, T - 1, 1][:N], np.int32)
        else:
            out[vi.name] = (rng.standard_normal(shape) * (1.0 if vi.name == "X" else 0.5)).astype(np.float32)
    return out


def quant_node(out):
    (node,) = [n for n in out.graph.node if n.op_type == "QuantGRU"]
    return node


def int_reference(out, feeds):
    """gru_int.quant_gru with the parameters the rewritten model stores."""
    node = quant_node(out)
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    val = lambda n: None if n == "" else (feeds[n] if n in feeds else inits[n])  # noqa: E731
    ins = [val(n) for n in node.input] + [None] * (8 - len(node.input))
    return gru_int.quant_gru(*ins, hidden_size=a["hidden_size"], bits=a["bits"], exponents=a["exponents"],
                             zero_points=a["zero_points"], direction=a["direction"].decode(), layout=a["layout"])


def check_rewrite(m, wrb, *, direction, layout=0, clip=None, tol=1e-2, bits=16):
    cal, test = feeds_for(m, 1), feeds_for(m, 2)
    out, rep = run_passes(m, passes=["gru"], calibration=cal, gru_bits=bits, gru_small=True)
    assert [e.action for e in rep.entries] == ["rewritten"], rep.to_table()
    onnx.checker.check_model(out, full_check=True)
    assert [i.name for i in out.graph.input] == [i.name for i in m.graph.input]
    assert [o.name for o in out.graph.output] == [o.name for o in m.graph.output]
    assert not any(n.op_type == "GRU" for n in out.graph.node)
    got = onnx_lowbit.InferenceSession(out, providers=CPU).run(None, test)
    ref_int = int_reference(out, test)
    W, R, B = wrb
    ref = gru_float.gru(test["X"], W, R, B, test.get("L"), test.get("H0"), direction=direction, layout=layout,
                        linear_before_reset=1, clip=clip)
    names = [o.name for o in m.graph.output]
    for name, g in zip(names, got):
        i = {"Y": 0, "Y_h": 1}[name]
        np.testing.assert_array_equal(g, ref_int[i])
        rel = np.linalg.norm(g - ref[i]) / np.linalg.norm(ref[i])
        assert rel <= tol, (name, rel)
    if layout == 0:  # onnxruntime runs the original (its CPU GRU has no layout 1)
        orig = ort.InferenceSession(m.SerializeToString(), providers=CPU).run(None, test)
        for g, o in zip(got, orig):
            assert np.linalg.norm(g - o) / np.linalg.norm(o) <= tol
    return out, rep


@pytest.mark.parametrize("direction,layout,h0,lens,clip", [
    ("forward", 0, False, False, None),
    ("reverse", 0, True, True, None),
    ("bidirectional", 0, True, False, 2.0),
    ("bidirectional", 1, False, True, None),
    ("forward", 1, True, True, 0.5),
])
def test_rewrites(direction, layout, h0, lens, clip):
    m, wrb = gru_model(direction, layout, h0=h0, lens=lens, clip=clip)
    check_rewrite(m, wrb, direction=direction, layout=layout, clip=clip)


@pytest.mark.parametrize("outputs", [("Y",), ("", "Y_h")])
def test_one_output_used(outputs):
    m, wrb = gru_model("forward", outputs=outputs)
    out, _ = check_rewrite(m, wrb, direction="forward")
    assert len(quant_node(out).output) == 2


def test_no_bias():
    m, wrb = gru_model("reverse", bias=False)
    check_rewrite(m, (wrb[0], wrb[1], None), direction="reverse")


def test_folded_weights():
    m, wrb = gru_model("forward", fold=True)
    out, rep = check_rewrite(m, wrb, direction="forward")
    assert "folded constant subgraph of W" in rep.entries[0].reason
    assert not any(n.op_type in ("Slice", "Concat", "Transpose", "Unsqueeze") for n in out.graph.node)


@pytest.mark.parametrize("kw,needle", [
    (dict(lbr=0), "linear_before_reset=0 is not supported by the integer path"),
    (dict(activations=["Sigmoid", "Relu"]), "activations ['Sigmoid', 'Relu']"),
])
def test_skipped_with_reason(kw, needle):
    m, _ = gru_model("forward", **kw)
    out, rep = run_passes(m, passes=["gru"], calibration=feeds_for(m, 1), gru_small=True)
    assert [e.action for e in rep.entries] == ["skipped"] and needle in rep.entries[0].reason
    assert [n.op_type for n in out.graph.node] == ["GRU"]


def test_explicit_default_activations_rewritten():
    m, wrb = gru_model("bidirectional", activations=["Sigmoid", "Tanh", "Sigmoid", "Tanh"])
    check_rewrite(m, wrb, direction="bidirectional")


def test_runtime_weight_skipped():
    m, _ = gru_model("forward")
    m.graph.initializer.remove(next(i for i in m.graph.initializer if i.name == "R"))
    m.graph.input.append(helper.make_tensor_value_info("R", TensorProto.FLOAT, [1, 3 * H, H]))
    rep = run_passes(m, passes=["gru"], calibration=feeds_for(m, 1), gru_small=True)[1]
    assert rep.entries[0].action == "skipped"
    assert "R (R) is not a constant" in rep.entries[0].reason and "graph input 'R'" in rep.entries[0].reason


def test_no_calibration_says_what_to_pass():
    m, _ = gru_model("forward")
    out, rep = run_passes(m, passes=["gru"], gru_small=True)
    assert rep.entries[0].action == "skipped" and "--calibration DATA.npz" in rep.entries[0].reason
    assert [n.op_type for n in out.graph.node] == ["GRU"]
    assert run_passes(m, gru_small=True)[1].not_run("gru")                     # the default pass list reports it too
    assert not rep.skipped("gru") and rep.summary()["gru"] == {"rewritten": 0, "skipped": 0, "not_run": 1}
    assert GRUPass().needs({}) == "--calibration DATA.npz" and GRUPass().needs({"calibration": {}}) is None


@pytest.mark.parametrize("cal,needle", [
    ({"x": np.zeros((T, N, C), np.float32)}, "no graph input named 'x'"),
    ({"X": np.zeros((T, N, C + 1), np.float32)}, "array 'X' has shape [7, 3, 6]"),
])
def test_bad_calibration(cal, needle):
    m, _ = gru_model("forward")
    with pytest.raises(ValueError) as ei:
        run_passes(m, passes=["gru"], calibration=cal, gru_small=True)
    assert needle in str(ei.value)


def test_cli(tmp_path, capsys):
    m, _ = gru_model("bidirectional", h0=True)
    src, dst = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(m, src)
    assert cli.main(["rewrite", str(src), str(tmp_path / "f.onnx"), "--gru-small"]) == 0   # no calibration: a note
    assert "1 GRU left in float" in capsys.readouterr().err
    np.savez(tmp_path / "cal.npz", **feeds_for(m, 1))
    assert cli.main(["rewrite", str(src), str(dst), "--passes", "gru", "--calibration", str(tmp_path / "cal.npz"),
                     "--gru-bits", "8", "--gru-small"]) == 0
    node = quant_node(onnx.load(dst))
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "bits")) == 8
    dst8 = tmp_path / "q8.onnx"                     # int8 weights, int16 arithmetic: int8 initializers + Cast
    assert cli.main(["rewrite", str(src), str(dst8), "--passes", "gru", "--calibration", str(tmp_path / "cal.npz"),
                     "--gru-weight-bits", "8", "--gru-small"]) == 0
    m8 = onnx.load(dst8)
    node = quant_node(m8)
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "bits")) == 16
    casts = {n.output[0]: n.input[0] for n in m8.graph.node if n.op_type == "Cast"}
    inits = {i.name: i for i in m8.graph.initializer}
    assert [inits[casts[x]].data_type for x in node.input[1:3]] == [onnx.TensorProto.INT8] * 2
    assert cli.main(["rewrite", str(src), str(tmp_path / "q9.onnx"), "--passes", "gru", "--calibration",
                     str(tmp_path / "cal.npz"), "--gru-bits", "8", "--gru-weight-bits", "16"]) == 2
    assert "--gru-weight-bits 16 is wider than --gru-bits 8" in capsys.readouterr().err
    assert not (tmp_path / "q9.onnx").exists()
    np.savez(tmp_path / "bad.npz", X=np.zeros((T, N, C), np.float32))       # H0 missing
    dst2 = tmp_path / "q2.onnx"
    assert cli.main(["rewrite", str(src), str(dst2), "--calibration", str(tmp_path / "bad.npz"),
                     "--gru-small"]) == 2
    assert not dst2.exists()
    domain.register_schemas()


@pytest.mark.parametrize("bits", [8, 16])
def test_range_search(bits):
    """Both widths search ranges on the calibration data by default (never worse there than the start)."""
    m, _ = gru_model("forward")
    cal = feeds_for(m, 1)
    rep = run_passes(m, passes=["gru"], calibration=cal, gru_bits=bits, gru_small=True)[1]
    reason = rep.entries[0].reason
    assert "range search" in reason
    before, after = (float(v) for v in reason.split("range search ")[1].split(" in ")[0].split(" -> "))
    assert after <= before
    rep = run_passes(m, passes=["gru"], calibration=cal, gru_bits=bits, gru_search=False, gru_small=True)[1]
    assert "range search" not in rep.entries[0].reason


def test_small_gru_skipped_with_size_reason():
    """A GRU whose QuantGRU (tables included) would not be smaller than its float weights stays float by default."""
    m, _ = gru_model("forward")                                          # H=8, C=5: 480 float weights
    rep = run_passes(m, passes=["gru"], calibration=feeds_for(m, 1), gru_bits=8)[1]
    (e,) = rep.entries
    assert e.action == "skipped" and "too small to gain" in e.reason and "bytes" in e.reason, rep.to_table()
    assert gru.stored_bytes(1, 8, 5, 8) >= gru.stored_bytes(1, 8, 5)
    assert gru.stored_bytes(1, 128, 257, 8) < gru.stored_bytes(1, 128, 257, 16) < gru.stored_bytes(1, 128, 257)


def test_several_runs_cli_and_api(tmp_path):
    """NAME#K arrays (CLI) and a list of dicts (API) are one calibration run each: the report counts them, and both
    give the same parameters; a bad run number is a clear error."""
    m, _ = gru_model("forward", h0=True)
    a, b = feeds_for(m, 1), feeds_for(m, 2)
    out, rep = run_passes(m, passes=["gru"], calibration=[a, b], gru_small=True)
    assert "calibrated on 2 runs" in rep.entries[0].reason, rep.to_table()
    src, dst = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(m, src)
    np.savez(tmp_path / "cal.npz", **{f"{k}#0": v for k, v in a.items()}, **{f"{k}#1": v for k, v in b.items()})
    assert cli.main(["rewrite", str(src), str(dst), "--passes", "gru", "--calibration", str(tmp_path / "cal.npz"),
                     "--gru-small"]) == 0
    got, want = quant_node(onnx.load(dst)), quant_node(out)
    assert [helper.get_attribute_value(x) for x in got.attribute] == [helper.get_attribute_value(x)
                                                                       for x in want.attribute]
    with pytest.raises(ValueError, match="followed by the run number"):
        run_passes(m, passes=["gru"], calibration={f"{k}#x": v for k, v in a.items()}, gru_small=True)
    domain.register_schemas()
