"""Tests of the "rotarykv" pass (passes/rotarykv.py): the q/k/v Split, three Reshapes and Transposes, the two Rotary
nodes and the KV-cache Concats of an attention layer -> one RotaryKV node (onnx_lowbit.rotarykv).

The op is exact with respect to the nodes it replaces (rotary as the Rotary op rounds it, the rest copies), so the
rewritten model must give the unrewritten one's outputs bit for bit, both run in onnxruntime's CPU EP with our ops
(onnx_lowbit.InferenceSession).
Hand-built graphs (the pattern as merge + rotary leave it, our Rotary op already in them; only "rotarykv" runs):
the spellings the pass accepts (cache or none, Split sizes as input / attribute / equal parts, axis -1 / 2, Concat
axis 2 / -2, Reshape targets with -1, 0 or TorchScript's Concat of Shape pieces), against the original graph and
rotarykv.apply; every skip reason that can be built small, with the node left alone and the reason reported.
Real exports: samples/llama_decode.py's decode step with a KV cache (tests/helpers.tiny_decode_export), rewritten
with the default passes: one RotaryKV per layer with the right head counts, the layer's Split, Reshapes, Transposes,
Rotary nodes and cache Concats gone; every output (logits, present.*) bit for bit that of the default passes without
rotarykv, and close to the original's in onnxruntime.
With 4-bit weights too (weights4 keeps the graph's node order, so merge packs q, k, v in that order); and in a
subgraph whose Reshape targets copy B and S (0 entries), where the Split outputs' shapes are unknown.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from helpers import checked_rewrite, input_specs, run_cpu, tiny_decode_export

import onnx_lowbit
from onnx_lowbit import domain, rotarykv
from onnx_lowbit.passes import resolve, run_passes
from onnx_lowbit.passes.rotarykv import PATTERN

CPU = ["CPUExecutionProvider"]
F32, F16 = np.float32, np.float16
ET = {F32: TP.FLOAT, F16: TP.FLOAT16, np.float64: TP.DOUBLE}


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(f"u{a.itemsize}"),
                                                                        b.view(f"u{b.itemsize}"))


def ops(model):
    return sorted((n.domain, n.op_type) for n in model.graph.node)


run_ours = run_cpu


def rewrite(model, passes=("rotarykv",), **options):
    return checked_rewrite(model, passes, check=False, **options)


# ----------------------------------------------------------------------------------------------------------------
# hand-built graphs
# ----------------------------------------------------------------------------------------------------------------
def kv_model(dtype=F32, b=1, s=1, p=3, d=8, hq=4, hkv=2, *, opset=17, sizes="const", axis=-1, cache=True,
             concat_axis=2, cos_shape=None, targets=None, dynamic=False, outputs=()):
    """The pattern as merge and rotary leave it: qkv [b, s, (hq + 2 hkv) d] -> Split (node "split", outputs q, k,
    v) -> Reshape ("reshape_<p>", target initializer "shape_<p>", [b, s, H, d] unless ``targets`` {p: entries}) ->
    Transpose ("transpose_<p>", -> qt, kt, vt) -> Rotary ("rotary_q" -> Q, "rotary_k" -> kr, cos and sin) ->
    Concat(past_k, kr) / Concat(past_v, vt) ("concat_k" / "concat_v" -> present_k / present_v; ``cache`` False:
    none, "k": only the k one). ``sizes``: "const" (an initializer from opset 13, else the attribute), "input" (a
    graph input), "equal" (none; num_outputs from opset 18). ``dynamic``: qkv [B, S, W] and TorchScript's targets
    Concat(Unsqueeze(Gather(Shape(qkv), 0)), Unsqueeze(Gather(Shape(qkv), 1)), [H, d]) (targets give H, d).
    ``outputs``: intermediates made graph outputs too (their shapes not declared)."""
    et = ET[dtype]
    widths = [hq * d, hkv * d, hkv * d]
    heads = {"q": hq, "k": hkv, "v": hkv}
    inits, nodes, extra_inputs = [], [], []
    split_in, split_attrs = ["qkv"], {"axis": axis}
    if sizes == "const":
        if opset >= 13:
            inits.append(nh.from_array(np.array(widths, np.int64), "split_sizes"))
            split_in.append("split_sizes")
        else:
            split_attrs["split"] = widths
    elif sizes == "input":
        split_in.append("split_sizes")
        extra_inputs.append(oh.make_tensor_value_info("split_sizes", TP.INT64, [3]))
    elif sizes == "equal" and opset >= 18:
        split_attrs["num_outputs"] = 3
    nodes.append(oh.make_node("Split", split_in, ["q", "k", "v"], name="split", **split_attrs))
    if dynamic:
        nodes.append(oh.make_node("Shape", ["qkv"], ["qkv_shape"]))
    for part in "qkv":
        tgt = (targets or {}).get(part, [b, s, heads[part], d])
        if dynamic:
            inits += [nh.from_array(np.array(i, np.int64), f"{part}_i{i}") for i in (0, 1)]
            inits.append(nh.from_array(np.array(tgt[2:], np.int64), f"{part}_hd"))
            inits.append(nh.from_array(np.array([0], np.int64), f"{part}_ax"))
            for i in (0, 1):
                nodes += [oh.make_node("Gather", ["qkv_shape", f"{part}_i{i}"], [f"{part}_g{i}"], axis=0),
                          oh.make_node("Unsqueeze", [f"{part}_g{i}", f"{part}_ax"], [f"{part}_u{i}"])]
            nodes.append(oh.make_node("Concat", [f"{part}_u0", f"{part}_u1", f"{part}_hd"], [f"shape_{part}"],
                                      axis=0))
        else:
            inits.append(nh.from_array(np.array(tgt, np.int64), f"shape_{part}"))
        nodes += [oh.make_node("Reshape", [part, f"shape_{part}"], [f"{part}4"], name=f"reshape_{part}"),
                  oh.make_node("Transpose", [f"{part}4"], [f"{part}t"], name=f"transpose_{part}", perm=[0, 2, 1, 3])]
    nodes += [oh.make_node("Rotary", ["qt", "cos", "sin"], ["Q"], name="rotary_q", domain=domain.DOMAIN),
              oh.make_node("Rotary", ["kt", "cos", "sin"], ["kr"], name="rotary_k", domain=domain.DOMAIN)]
    outs = ["Q"]
    pasts = []
    if cache:
        nodes.append(oh.make_node("Concat", ["past_k", "kr"], ["present_k"], name="concat_k", axis=concat_axis))
        outs.append("present_k")
        pasts.append("past_k")
    else:
        outs.append("kr")
    if cache is True:
        nodes.append(oh.make_node("Concat", ["past_v", "vt"], ["present_v"], name="concat_v", axis=concat_axis))
        outs.append("present_v")
        pasts.append("past_v")
    else:
        outs.append("vt")
    bs = ["B", "S"] if dynamic else [b, s]
    cos_shape = list(cos_shape) if cos_shape is not None else [1, 1, bs[1], d]
    inputs = [oh.make_tensor_value_info("qkv", et, bs + [sum(widths)]),
              oh.make_tensor_value_info("cos", et, cos_shape), oh.make_tensor_value_info("sin", et, cos_shape)]
    inputs += [oh.make_tensor_value_info(n, et, [bs[0], hkv, "P" if dynamic else p, d]) for n in pasts]
    g = oh.make_graph(nodes, "rotarykv", inputs + extra_inputs,
                      [oh.make_tensor_value_info(o, et, [f"{o}_{i}" for i in range(4)]) for o in outs] +
                      [oh.make_tensor_value_info(o, et, None) for o in outputs], inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", opset), domain.opset_import()], ir_version=8)


def feeds_for(model, seed=0, dims=None):
    """Random inputs: qkv and past normal, cos and sin uniform in [-1, 1]; symbolic dims from ``dims``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, dt in input_specs(model, dims):
        v = rng.uniform(-1, 1, shape) if name in ("cos", "sin") else rng.standard_normal(shape) * 3
        out[name] = v.astype(dt)
    return out


def node(model, name):
    return next(n for n in model.graph.node if n.name == name)


def set_attr(n, name, value):
    for a in list(n.attribute):
        if a.name == name:
            n.attribute.remove(a)
    n.attribute.append(oh.make_attribute(name, value))


def set_init(model, name, value):
    next(t for t in model.graph.initializer if t.name == name).CopyFrom(nh.from_array(np.asarray(value), name))


def set_input_shape(model, name, shape, et=None):
    vi = next(i for i in model.graph.input if i.name == name)
    vi.CopyFrom(oh.make_tensor_value_info(name, et or vi.type.tensor_type.elem_type, shape))


def assert_rewritten(m, hq, hkv, cache=True):
    """One RotaryKV(qkv, cos, sin[, past_k, past_v]) -> the pattern's outputs, everything else gone; the report's
    entry names the 11 (9 without a cache) nodes in graph order."""
    out, rep = rewrite(m)
    (e,) = rep.rewritten("rotarykv")
    assert not rep.skipped("rotarykv")
    mine = [n for n in out.graph.node if n.domain == domain.DOMAIN]
    assert [n.op_type for n in mine] == ["RotaryKV"]
    (n,) = mine
    assert not [x for x in out.graph.node if x.op_type in ("Split", "Reshape", "Transpose", "Concat")]
    assert {a.name: a.i for a in n.attribute} == {"num_heads": hq, "kv_num_heads": hkv}
    assert list(n.input) == (["qkv", "cos", "sin", "past_k", "past_v"] if cache else ["qkv", "cos", "sin"])
    assert list(n.output) == (["Q", "present_k", "present_v"] if cache else ["Q", "kr", "vt"])
    assert e.pattern == PATTERN and e.details["cache"] == cache and e.details["new_node"] == n.name
    assert (e.details["num_heads"], e.details["kv_num_heads"]) == (hq, hkv)
    assert e.details["outputs"] == list(n.output) and ("no KV cache" in e.reason) == (not cache)
    graph_order = [x.name for x in m.graph.node if x.name]
    assert list(e.nodes) == graph_order and len(e.nodes) == (11 if cache else 9)
    domain.register_schemas()
    onnx.checker.check_model(out, full_check=True)
    return out, rep


def check_values(m, out, hq, hkv, dims=None, seeds=(0, 1)):
    """The rewritten model (our RotaryKV kernel) == the original (our Rotary kernel, onnxruntime's Split, Reshape,
    Transpose, Concat) == rotarykv.apply, bit for bit."""
    for seed in seeds:
        feeds = feeds_for(m, seed, dims)
        want, got = run_ours(m, feeds), run_ours(out, feeds)
        assert sorted(got) == sorted(want)
        for k in want:
            assert same_bits(got[k], want[k]), (k, seed)
        ref = rotarykv.apply(feeds["qkv"], feeds["cos"], feeds["sin"], feeds.get("past_k"), feeds.get("past_v"),
                             hq, hkv)
        names = [o.name for o in m.graph.output][:3]
        for name, r in zip(names, ref):
            assert same_bits(want[name], r), (name, seed)


SPELLINGS = {
    "decode, GQA": dict(),
    "decode, fp16": dict(dtype=F16),
    "prompt B=2 S=3, cos [B, 1, S, D]": dict(b=2, s=3, cos_shape=(2, 1, 3, 8)),
    "cos [S, D], MHA": dict(s=2, hq=2, hkv=2, cos_shape=(2, 8)),
    "cos [1, S, D], one kv head": dict(s=2, hq=3, hkv=1, cos_shape=(1, 2, 8), dtype=F16),
    "empty past": dict(p=0),
    "Split axis 2": dict(axis=2),
    "Concat axis -2": dict(concat_axis=-2),
    "Split sizes attribute, opset 11": dict(opset=11),
    "Split sizes attribute, opset 12": dict(opset=12, s=2),
    "Split into equal parts, opset 13": dict(sizes="equal", opset=13, hq=2, hkv=2),
    "Split into equal parts, opset 11": dict(sizes="equal", opset=11, hq=2, hkv=2),
    "Split num_outputs, opset 18": dict(sizes="equal", opset=18, hq=2, hkv=2),
    "Reshape H = -1": dict(targets={"q": [1, 1, -1, 8], "k": [1, 1, -1, 8], "v": [1, 1, -1, 8]}),
    "Reshape B, S = 0 and -1": dict(s=2, targets={"q": [0, 0, 4, 8], "k": [1, -1, 2, 8], "v": [-1, 2, 2, 8]}),
    "TorchScript Concat targets, dynamic B and S": dict(dynamic=True),
    "TorchScript Concat targets, H = -1, fp16": dict(dynamic=True, dtype=F16, hq=2, hkv=1,
                                                     targets={p: [0, 0, -1, 8] for p in "qkv"}),
}


@pytest.mark.parametrize("kw", list(SPELLINGS.values()), ids=list(SPELLINGS))
def test_pattern_becomes_one_rotarykv(kw):
    m = kv_model(**kw)
    hq, hkv = kw.get("hq", 4), kw.get("hkv", 2)
    out, _ = assert_rewritten(m, hq, hkv)
    check_values(m, out, hq, hkv, dims={"B": 2, "S": 3, "P": 4})


@pytest.mark.parametrize("kw", [dict(), dict(dtype=F16, b=2, s=3, hq=2, hkv=1), dict(opset=11, axis=2)],
                         ids=["fp32", "fp16 prompt", "opset 11, axis 2"])
def test_without_a_cache_it_writes_k_and_v(kw):
    """No cache Concats (prompt-only exports): RotaryKV(qkv, cos, sin) writes Q, kr and vt; vt may have other
    readers (it stays an output)."""
    m = kv_model(cache=False, **kw)
    hq, hkv = kw.get("hq", 4), kw.get("hkv", 2)
    out, _ = assert_rewritten(m, hq, hkv, cache=False)
    check_values(m, out, hq, hkv)
    m = kv_model(cache=False, **kw)
    m.graph.node.append(oh.make_node("Relu", ["vt"], ["vt_relu"], name="other_use_of_vt"))
    m.graph.output.append(oh.make_tensor_value_info("vt_relu", ET[kw.get("dtype", F32)], None))
    out, rep = rewrite(m)
    assert len(rep.rewritten("rotarykv")) == 1 and ops(out).count(("onnx_lowbit", "RotaryKV")) == 1
    feeds = feeds_for(m)
    want, got = run_ours(m, feeds), run_ours(out, feeds)
    assert all(same_bits(got[k], want[k]) for k in want)


def test_two_layers_and_other_splits():
    """Two patterns in one graph (the second reads the first's Q as its qkv) each become a RotaryKV; a Split
    without Rotary readers is not reported."""
    m1, m2 = kv_model(), kv_model()
    g2 = m2.graph
    ren = lambda x: x if x in ("cos", "sin", "") else "l2_" + x  # noqa: E731
    for n in g2.node:
        n.input[:] = [ren(x) for x in n.input]
        n.output[:] = [ren(x) for x in n.output]
        n.name = ren(n.name)
    for t in g2.initializer:
        t.name = ren(t.name)
    # layer 2's qkv [1, 1, 64] from layer 1's Q [1, 4, 1, 8] (32 values) twice
    m1.graph.initializer.append(nh.from_array(np.array([1, 1, 32], np.int64), "flat"))
    m1.graph.node.extend([oh.make_node("Reshape", ["Q", "flat"], ["Qf"], name="flatten"),
                          oh.make_node("Concat", ["Qf", "Qf"], ["l2_qkv"], name="widen", axis=-1),
                          oh.make_node("Split", ["Qf"], ["h1", "h2"], name="plain_split", axis=-1)])
    m1.graph.node.extend(g2.node)
    m1.graph.initializer.extend(g2.initializer)
    m1.graph.input.extend(oh.make_tensor_value_info("l2_" + n, TP.FLOAT, [1, 2, 3, 8]) for n in ("past_k", "past_v"))
    m1.graph.output.extend(oh.make_tensor_value_info(n, TP.FLOAT, None) for n in ("l2_Q", "l2_present_k",
                                                                                  "l2_present_v", "h1"))
    out, rep = rewrite(m1)
    assert len(rep.rewritten("rotarykv")) == 2 and len(rep.entries) == 2
    assert ops(out).count(("onnx_lowbit", "RotaryKV")) == 2 and ops(out).count(("", "Split")) == 1
    feeds = feeds_for(m1)
    want, got = run_ours(m1, feeds), run_ours(out, feeds)
    assert len(want) == 7 and all(same_bits(got[k], want[k]) for k in want)


# ----------------------------------------------------------------------------------------------------------------
# skips
# ----------------------------------------------------------------------------------------------------------------
def _four_outputs(m):                         # a 4th, empty part: q, k, v, nothing
    node(m, "split").output.append("nothing")
    set_init(m, "split_sizes", np.array([32, 16, 16, 0], np.int64))


def _q_v_k(m):                                # parts in q, v, k order: outputs 0 and 2 rotated
    node(m, "split").output[:] = ["q", "v", "k"]


def _k_q_v(m):                                # k first: output 0's rotated part is the one concatenated
    node(m, "split").output[:] = ["k", "q", "v"]
    set_init(m, "split_sizes", np.array([16, 32, 16], np.int64))


def _v_not_transposed(m):                     # v's Reshape output is the output: no Transpose
    m.graph.node.remove(node(m, "transpose_v"))
    node(m, "reshape_v").output[0] = "vt"


def _other_cos(m):
    node(m, "rotary_k").input[1] = "cos2"
    m.graph.input.append(oh.make_tensor_value_info("cos2", TP.FLOAT, [1, 1, 1, 8]))


def _concat_new_past(m):
    node(m, "concat_v").input[:] = ["vt", "past_v"]


def _concat_three(m):
    node(m, "concat_k").input.append("past_k")


def _qkv_shape_unknown(m):
    vi = next(i for i in m.graph.input if i.name == "qkv")
    vi.type.tensor_type.ClearField("shape")


def _split_axis_1(m):                         # qkv [1, 3, 16] split into three rows
    set_input_shape(m, "qkv", [1, 3, 16])
    set_attr(node(m, "split"), "axis", 1)
    set_init(m, "split_sizes", np.array([1, 1, 1], np.int64))


def _q_perm(m):
    set_attr(node(m, "transpose_q"), "perm", [0, 1, 2, 3])


def _k_allowzero(m):
    set_attr(node(m, "reshape_k"), "allowzero", 1)


def _target_input(m):                         # q's target computed elsewhere: H and D unknown
    node(m, "reshape_q").input[1] = "q_target"
    m.graph.input.append(oh.make_tensor_value_info("q_target", TP.INT64, [4]))


def _past_k_other_d(m):
    set_input_shape(m, "past_k", [1, 2, 3, 4])


def _used_by(tensor):
    def f(m):
        m.graph.node.append(oh.make_node("Relu", [tensor], [tensor + "_relu"], name="other_use"))
        m.graph.output.append(oh.make_tensor_value_info(tensor + "_relu", TP.FLOAT, None))
    return f


def _sizes(sizes):
    def f(m):
        set_init(m, "split_sizes", np.array(sizes, np.int64))
        set_input_shape(m, "qkv", [1, 1, sum(sizes)])
    return f


def _k_and_v_sizes(m):                        # k: 2 heads, v: 1 head of 8 (a valid graph)
    _sizes([32, 16, 8])(m)
    set_input_shape(m, "past_v", [1, 1, 3, 8])


def _cos_other_type(m):
    set_input_shape(m, "cos", [1, 1, 1, 8], TP.FLOAT16)


# (id, kv_model arguments, change to its ModelProto, a piece of the reason)
SKIPS = [
    ("4 outputs", dict(), _four_outputs, "the Split has 4 outputs, not 3"),
    ("q, v, k order", dict(), _q_v_k, "Split outputs [0, 2] are rotated, not 0 and 1"),
    ("k, q, v order", dict(), _k_q_v, "Split output 0's rotated part is concatenated"),
    ("v not transposed", dict(cache=False), _v_not_transposed, "is not read by Reshape -> Transpose"),
    ("different cos", dict(), _other_cos, "read different cos / sin"),
    ("only k cached", dict(cache="k"), None, "only one of k and v is concatenated"),
    ("Concat(new, past)", dict(), _concat_new_past, "is not Concat(past_v, new v)"),
    ("Concat of three", dict(), _concat_three, "is not Concat(past_k, new k)"),
    ("Concat axis 1", dict(p=1, concat_axis=1), None, "is on axis 1, not the cache's axis 2"),
    ("QKV rank unknown", dict(), _qkv_shape_unknown, "QKV's rank is unknown"),
    ("Split axis 1", dict(hq=2, hkv=2), _split_axis_1, "the Split is on axis 1, not the last one"),
    ("Split sizes an input", dict(sizes="input"), None, "the Split's sizes are not constants"),
    ("perm", dict(), _q_perm, "has perm [0, 1, 2, 3], not [0, 2, 1, 3]"),
    ("allowzero with a 0 entry", dict(targets={"k": [0, 0, 2, 8]}), _k_allowzero,
     "has allowzero=1 and a 0 entry in its target [0, 0, 2, 8]"),
    ("Reshape rank 3", dict(targets={"v": [1, 2, 8]}), None, "reshapes to rank 3, not [B, S, H, D]"),
    ("target unknown", dict(), _target_input, "are not known to be (H, D)"),
    ("B and S swapped", dict(s=2, targets={"q": [2, 1, 4, 8]}), None, "does not keep the input's B and S"),
    ("D of cos and parts", dict(cos_shape=(1, 1, 1, 16)), None, "head sizes D disagree"),
    ("q heads of 4, k of 8", dict(hq=4, hkv=2, cos_shape=(1, 1, 1, 1), targets={"q": [1, 1, 8, 4]}), None,
     "head sizes D disagree"),
    ("D of past", dict(), _past_k_other_d, "head sizes D disagree"),
    ("odd D", dict(d=5, hq=2, hkv=2), None, "head size D = 5 is odd"),
    ("Split size vs Reshape", dict(targets={"q": [1, 1, 2, 8]}), None, "sizes of Split output 0 disagree"),
    ("k and v sizes", dict(targets={"v": [1, 1, 1, 8]}), _k_and_v_sizes, "the k and v parts differ in size (16 and 8)"),
    ("cos rank 5", dict(cos_shape=(1, 1, 1, 1, 8)), None, "cos has rank 5 > 4"),
    ("cos per head", dict(hq=2, hkv=2, cos_shape=(1, 2, 1, 8)), None, "has a head axis (-3) not known to be 1"),
    ("past P differ", dict(), lambda m: set_input_shape(m, "past_v", [1, 2, 4, 8]),
     "past_k [1, 2, 3, 8] and past_v [1, 2, 4, 8] differ in shape"),
    ("past heads", dict(), lambda m: [set_input_shape(m, n, [1, 3, 3, 8]) for n in ("past_k", "past_v")],
     "past_k of shape [1, 3, 3, 8] is not [B, 2, P, 8]"),
    ("double", dict(dtype=np.float64), None, "QKV is double: RotaryKV takes float or float16"),
    ("cos fp16", dict(), _cos_other_type, "cos is float16, QKV is float32"),
    ("q part a graph output", dict(outputs=("q",)), None, "intermediate q (Split) is used elsewhere: graph output"),
    ("kt read elsewhere", dict(), _used_by("kt"), "intermediate kt (Transpose) is used elsewhere: other_use"),
    ("kr read elsewhere, cache", dict(), _used_by("kr"), "intermediate kr (Rotary) is used elsewhere: other_use"),
    ("vt read elsewhere, cache", dict(), _used_by("vt"), "intermediate vt (Transpose) is used elsewhere"),
    ("v4 a graph output", dict(outputs=("v4",)), None, "intermediate v4 (Reshape) is used elsewhere: graph output"),
]


@pytest.mark.parametrize("what,kw,change,reason", SKIPS, ids=[s[0] for s in SKIPS])
def test_candidates_that_cannot_be_rewritten_are_skipped(what, kw, change, reason):
    m = kv_model(**kw)
    if change is not None:
        change(m)
    out, rep = rewrite(m)
    assert ops(out) == ops(m), what
    assert not rep.rewritten("rotarykv")
    (e,) = rep.skipped("rotarykv")
    assert e.pattern == PATTERN and reason in e.reason, e.reason
    assert "split" in e.nodes and {"rotary_q", "rotary_k"} & set(e.nodes)


def test_skipped_graph_still_runs_as_before():
    """A skipped candidate is left as it was: the k/v-of-different-sizes graph (valid ONNX) gives the same
    outputs before and after."""
    m = kv_model(targets={"v": [1, 1, 1, 8]})
    _k_and_v_sizes(m)
    out, rep = rewrite(m)
    assert "differ in size" in rep.skipped("rotarykv")[0].reason
    feeds = feeds_for(m)
    want, got = run_ours(m, feeds), run_ours(out, feeds)
    assert all(same_bits(got[k], want[k]) for k in want)


def test_no_rotary_no_entry():
    """A Split whose parts are not rotated (rotary not run: plain Mul/Add rotary spelling, or none at all) is no
    candidate: nothing reported, nothing changed."""
    m = kv_model()
    for n in m.graph.node:
        if n.op_type == "Rotary":
            n.op_type, n.domain = "Add", ""
            del n.input[2]
    out, rep = rewrite(m)
    assert ops(out) == ops(m) and not rep.entries


def _in_a_subgraph(targets):
    """The pattern (no cache) as the then-branch of an If reading the outer graph's qkv, cos and sin."""
    inner = kv_model(cache=False, targets=targets).graph
    shapes = {"Q": [1, 4, 1, 8], "kr": [1, 2, 1, 8], "vt": [1, 2, 1, 8]}
    vi = lambda n, s: oh.make_tensor_value_info(n, TP.FLOAT, s)  # noqa: E731
    then = oh.make_graph(list(inner.node), "then", [], [vi(k, s) for k, s in shapes.items()], list(inner.initializer))
    other = oh.make_graph([oh.make_node("Constant", [], [f"e_{k}"], value=nh.from_array(np.zeros(s, np.float32)))
                           for k, s in shapes.items()], "else", [], [vi(f"e_{k}", s) for k, s in shapes.items()])
    g = oh.make_graph([oh.make_node("If", ["flag"], ["yq", "yk", "yv"], name="if", then_branch=then,
                                    else_branch=other)], "sub",
                      list(inner.input) + [oh.make_tensor_value_info("flag", TP.BOOL, [])],
                      [vi(f"y{k}", s) for k, s in zip("qkv", shapes.values())])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17), domain.opset_import()], ir_version=8)
    domain.register_schemas()
    onnx.checker.check_model(m, full_check=True)                       # a valid model
    return m


def _check_subgraph_rewrite(m):
    out, rep = rewrite(m)
    assert len(rep.rewritten("rotarykv")) == 1 and not rep.skipped("rotarykv")
    body = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in body.node] == ["RotaryKV"]
    feeds = feeds_for(m)
    feeds["flag"] = np.array(True)
    want, got = run_ours(m, feeds), run_ours(out, feeds)
    assert len(want) == 3 and all(same_bits(got[k], want[k]) for k in want)


def test_pattern_in_a_subgraph_with_constant_targets():
    """In an If branch the Split outputs have no inferred shapes (run_passes fills the main graph's only), so the
    targets' constant B and S cannot be checked against them: skipped with that reason, the branch unchanged."""
    m = _in_a_subgraph(None)
    out, rep = rewrite(m)
    assert not rep.rewritten("rotarykv")
    (e,) = rep.skipped("rotarykv")
    assert "cannot be checked against the input's B and S (unknown)" in e.reason and len(e.nodes) == 9
    then = lambda model: next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")  # noqa: E731
    assert sorted(n.op_type for n in then(out).node) == sorted(n.op_type for n in then(m).node)


def test_pattern_in_a_subgraph_with_copied_b_and_s():
    """Targets [0, 0, H, D] (B and S copied): nothing needs the Split outputs' shapes; rewritten, same values."""
    _check_subgraph_rewrite(_in_a_subgraph({p: [0, 0, h, 8] for p, h in zip("qkv", (4, 2, 2))}))


# ----------------------------------------------------------------------------------------------------------------
# real exports: samples/llama_decode.py's decode step
# ----------------------------------------------------------------------------------------------------------------
DECODES = [dict(dtype=F32, heads=4, kv_heads=2, layers=1),
           dict(dtype=F32, heads=4, kv_heads=4, layers=2),
           dict(dtype=F16, heads=4, kv_heads=2, layers=2)]


def _pass_lists():
    """(the default passes, the same without rotarykv, the default passes up to rotarykv, those without it)."""
    names = [p.name for p in resolve(None)]
    assert "rotarykv" in names
    upto = names[:names.index("rotarykv") + 1]
    assert {"merge", "rotary"} <= set(upto[:-1])                        # rotarykv runs after merge and rotary
    return names, [n for n in names if n != "rotarykv"], upto, upto[:-1]


def check_decode_step(case, **opts):
    """The decode step rewritten with the default passes: per layer one RotaryKV(qkv, cos, sin, past_k, past_v)
    -> (Q, present.i.key, present.i.value) with the layer's head counts, no Split, Rotary or cache Concat left,
    reported; every output bit for bit as without rotarykv and close to the original's in onnxruntime."""
    layers, hq, hkv = case["layers"], case["heads"], case["kv_heads"]
    m, feeds = tiny_decode_export(**case)
    default, without, upto, upto_without = _pass_lists()
    src = m.SerializeToString()
    out, rep = onnx_lowbit.rewrite(m, **opts)
    ref, ref_rep = run_passes(m, without, **opts)
    assert m.SerializeToString() == src                                 # the input model is not modified
    assert not [e for e in ref_rep.entries if e.pass_name == "rotarykv"]
    assert len(ref_rep.rewritten("rotary")) == 2 * layers and len(ref_rep.rewritten("merge")) == layers

    entries = rep.rewritten("rotarykv")
    assert not rep.skipped("rotarykv"), rep.skipped("rotarykv")[0].reason
    kv = [n for n in out.graph.node if n.op_type == "RotaryKV"]
    assert len(kv) == layers == len(entries) and all(n.domain == domain.DOMAIN for n in kv)
    for i in range(layers):                                             # one per layer, writing its present.*
        (n,) = [n for n in kv if list(n.output[1:]) == [f"present.{i}.key", f"present.{i}.value"]]
        assert {a.name: a.i for a in n.attribute} == {"num_heads": hq, "kv_num_heads": hkv}
        assert len(n.input) == 5 and n.input[4] == f"past_key_values.{i}.value"
    assert not [n for n in out.graph.node if n.op_type in ("Split", "Rotary")]
    assert not [n for n in out.graph.node if n.op_type == "Concat" and len(n.input) > 1 and any(
        x.startswith("past_key_values.") or x.startswith("present.") for x in list(n.input) + list(n.output))]
    assert sorted(e.details["new_node"] for e in entries) == sorted(n.name for n in kv)
    assert all(e.details["cache"] and (e.details["num_heads"], e.details["kv_num_heads"]) == (hq, hkv)
               and e.pattern == PATTERN and len(e.nodes) == 11 and not e.reason for e in entries)
    assert sorted(o for e in entries for o in e.details["outputs"][1:]) == sorted(
        f"present.{i}.{k}" for i in range(layers) for k in ("key", "value"))

    # exactly the layers' prologues replaced (passes after rotarykv, e.g. attention, left out: they may differ)
    counts = [Counter(n.op_type for n in run_passes(m, names, **opts)[0].graph.node if n.op_type != "Constant")
              for names in (upto, upto_without)]                        # Constant: the Reshape targets
    counts[0].subtract(counts[1])
    assert {k: v for k, v in counts[0].items() if v} == {
        "RotaryKV": layers, "Split": -layers, "Reshape": -3 * layers, "Transpose": -3 * layers,
        "Rotary": -2 * layers, "Concat": -2 * layers}

    # values: every output bit for bit as without rotarykv; the cache's old rows as fed
    got, same = run_ours(out, feeds), run_ours(ref, feeds)
    names = [o.name for o in m.graph.output]
    assert sorted(got) == sorted(names) and len(names) == 1 + 2 * layers
    for k in names:
        assert same_bits(got[k], same[k]), k
    for i in range(layers):
        for k in ("key", "value"):
            past = feeds[f"past_key_values.{i}.{k}"]
            assert got[f"present.{i}.{k}"].shape == (1, hkv, past.shape[2] + 1, 64 // hq)
            assert same_bits(got[f"present.{i}.{k}"][:, :, :past.shape[2]], past)
    return m, feeds, src, got


@pytest.mark.parametrize("case", DECODES, ids=["fp32-gqa", "fp32-mha-2layers", "fp16-gqa-2layers"])
def test_decode_step(case):
    """check_decode_step, and the outputs close to the original's in onnxruntime (merge's blocking of the sums and,
    in fp16, the Rotary op's rounding differ from onnxruntime's own run: 1e-5 / 1e-2 of the largest value)."""
    m, feeds, src, got = check_decode_step(case)
    orig = ort.InferenceSession(src, providers=CPU)
    want = dict(zip([o.name for o in orig.get_outputs()], orig.run(None, feeds)))
    tol = 1e-5 if case["dtype"] == F32 else 1e-2
    for k, w in want.items():
        assert got[k].dtype == w.dtype == case["dtype"] and got[k].shape == w.shape, k
        g, w = got[k].astype(np.float64), w.astype(np.float64)
        assert np.abs(g - w).max() <= tol * np.abs(w).max(), k


def test_decode_step_nf4():
    """weights nf4 (q/k/v all 4-bit: weights_min_elements 0, so merge takes all three)."""
    check_decode_step(DECODES[0], weights="nf4", weights_min_elements=0)
