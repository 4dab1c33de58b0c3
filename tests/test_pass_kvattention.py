"""Tests of the "kvattention" pass (passes/kvattention.py): eager attention (K / V repeats, MatMul with Transpose(K),
scale, mask, Softmax, MatMul with V) -> one KVAttention node.

Values: the rewritten model in onnx_lowbit.InferenceSession (the CPU kernel) against onnxruntime's CPU run of the
original on the same feeds, and against onnx_lowbit.kvattention.apply (the reference) where the graph is ours.
The op is KVAttention, not Attention: ONNX's standard domain has an Attention op since opset 23, and once our schema
of that name was registered, importing onnx.reference (so onnxscript, torch's dynamo exporter) raised
NotImplementedError ("every operator has a unique name 'Attention' even across multiple domains", onnx 1.23);
test_registering_our_schemas_keeps_onnx_reference_importable checks that.
Tolerances (max |got - want| / max |want| of the compared tensor; measured on this box, onnxruntime's CPU EP):
  against onnxruntime's run of the original, TOL: fp32 1e-5 (measured <= 3.4e-7 everywhere: the fp32 sums run in
  another order than onnxruntime's GEMMs); fp16 3e-3 (measured: hand-built graphs <= 7.9e-4, one KVAttention's
  output in the decode export <= 6.0e-4, the exports' logits <= 6.6e-4: the op rounds every step to fp16 where
  onnxruntime's CPU EP runs fp16 Mul / Add in fp32 and rounds once, and its fp16 Softmax is not always the fp32
  one rounded);
  against the same rewrite without "kvattention" (TOL): fp32 measured <= 3.4e-7, fp16 <= 6.6e-4 (nf4: 5.7e-4);
  the kernel against kvattention.apply, REF_TOL: fp32 1e-6 (measured 2.2e-7), fp16 2e-3 (measured 0 on the
  hand-built graphs, 5.8e-4 = one fp16 ulp on the export's values: the reference sums in float64).
"""
from __future__ import annotations

from functools import partial

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from helpers import checked_rewrite, input_specs, run_cpu, tiny_decode_export, tiny_llama_export

from onnx_lowbit import domain, kvattention
from onnx_lowbit.passes import PASSES, run_passes
from onnx_lowbit.passes.kvattention import PATTERN

CPU = ["CPUExecutionProvider"]
# the default passes and kvattention (opt-in: Pass.default False)
WITH_KV = [p.name for p in PASSES.values() if p.default or p.name == "kvattention"]
ET = {np.float32: TP.FLOAT, np.float16: TP.FLOAT16, np.float64: TP.DOUBLE}
TOL = {np.float32: 1e-5, np.float16: 3e-3}
REF_TOL = {np.float32: 1e-6, np.float16: 2e-3}


# ----------------------------------------------------------------------------------------------------------------
# hand-built graphs
# ----------------------------------------------------------------------------------------------------------------
def attention_model(dtype=np.float32, b=2, hq=4, hkv=2, s=3, t=5, d=16, scale="mul", c=0.25, mask=(2, 1, 3, 5),
                    mask_first=False, pre=(), post=(), axis=-1, perm=(0, 1, 3, 2), rep_k=None, rep_v=None, hv=None,
                    dv=None, k_transposed=False, repeat_after_t=False, computed=False, target_order=(0, 1, 2, 3),
                    unsq_axis=2, opset=17, outputs=(), q_shape=None, k_shape=None, sym=False,
                    scale_shape=(), extra=None):
    """Q [b, hq, s, d], K [b, hkv, t, d], V [b, hv or hkv, t, dv or d] (graph inputs q, k, v; mask of shape ``mask``
    when given) through the eager-attention spelling -> graph output o.

    scale: "mul" | "mul_first" | "div" | "div_first" (c / scores) | "input" (Mul by a graph input) | None;
    pre / post: Cast types around the Softmax; rep_k / rep_v: the repeat counts (default hq // hkv; 1: none);
    k_transposed: K is a graph input already [b, hkv, d, t] (no Transpose); repeat_after_t: K^T is repeated;
    computed: the repeat's Expand shape and Reshape target computed from Shape(K) as TorchScript writes them with
    dynamic axes (target_order: the order of its entries); sym: B and T symbolic in the graph's inputs;
    outputs: intermediates made graph outputs too; extra: function(nodes, inits, scores) -> the tensor the Softmax
    (or its first Cast) reads, adding nodes between."""
    et = ET[dtype]
    rep_k = hq // hkv if rep_k is None else rep_k
    rep_v = rep_k if rep_v is None else rep_v
    hv, dv = hv or hkv, dv or d
    nodes, inits = [], []

    def const(name, v, dt=np.int64):
        inits.append(nh.from_array(np.asarray(v, dt), name))
        return name

    def repeat(x, dims_, rep, tag):
        nonlocal nodes
        if opset < 13:
            nodes.append(oh.make_node("Unsqueeze", [x], [f"{tag}_u"], name=f"{tag}_unsqueeze", axes=[unsq_axis]))
        else:
            nodes.append(oh.make_node("Unsqueeze", [x, const(f"{tag}_ax", [unsq_axis])], [f"{tag}_u"],
                                      name=f"{tag}_unsqueeze"))
        bb, h, x2, x3 = dims_
        if computed:
            nodes.append(oh.make_node("Shape", [x], [f"{tag}_shape"]))
            g = []
            for i in range(4):
                nodes += [oh.make_node("Gather", [f"{tag}_shape", const(f"{tag}_i{i}", i)], [f"{tag}_g{i}"], axis=0),
                          oh.make_node("Unsqueeze", [f"{tag}_g{i}", const(f"{tag}_z{i}", [0])], [f"{tag}_d{i}"])]
                g.append(f"{tag}_d{i}")
            nodes += [oh.make_node("Concat", [g[0], g[1], const(f"{tag}_rep", [rep]), g[2], g[3]], [f"{tag}_es0"],
                                   axis=0),     # TorchScript's expand: Where(Equal(s, -1), 1, s)
                      oh.make_node("ConstantOfShape", [const(f"{tag}_five", [5])], [f"{tag}_ones"],
                                   value=nh.from_array(np.array([1], np.int64))),
                      oh.make_node("Mul", [f"{tag}_ones", const(f"{tag}_m1", -1)], [f"{tag}_neg"]),
                      oh.make_node("Equal", [f"{tag}_es0", f"{tag}_neg"], [f"{tag}_eq"]),
                      oh.make_node("Where", [f"{tag}_eq", f"{tag}_ones", f"{tag}_es0"], [f"{tag}_es"]),
                      oh.make_node("Mul", [f"{tag}_g1", const(f"{tag}_rc", rep)], [f"{tag}_hr0"]),
                      oh.make_node("Unsqueeze", [f"{tag}_hr0", const(f"{tag}_z4", [0])], [f"{tag}_hr"])]
            entries = [g[0], f"{tag}_hr", g[2], g[3]]
            nodes.append(oh.make_node("Concat", [entries[i] for i in target_order], [f"{tag}_rs"], axis=0))
            es, rs = f"{tag}_es", f"{tag}_rs"
        else:
            es = const(f"{tag}_es", [bb, h, rep, x2, x3])
            rs = const(f"{tag}_rs", [[bb, h * rep, x2, x3][i] for i in target_order])
        nodes += [oh.make_node("Expand", [f"{tag}_u", es], [f"{tag}_e"], name=f"{tag}_expand"),
                  oh.make_node("Reshape", [f"{tag}_e", rs], [f"{tag}_r"], name=f"{tag}_reshape")]
        return f"{tag}_r"

    # K side
    if k_transposed:
        kt = "k"
    elif repeat_after_t:
        nodes.append(oh.make_node("Transpose", ["k"], ["k_t0"], name="k_transpose", perm=list(perm)))
        kt = repeat("k_t0", [b, hkv, d, t], rep_k, "kr") if rep_k > 1 else "k_t0"
    else:
        kr = repeat("k", [b, hkv, t, d], rep_k, "kr") if rep_k > 1 else "k"
        nodes.append(oh.make_node("Transpose", [kr], ["k_t"], name="k_transpose", perm=list(perm)))
        kt = "k_t"
    nodes.append(oh.make_node("MatMul", ["q", kt], ["scores"], name="qk_matmul"))
    x = "scores"
    if scale in ("mul", "mul_first", "div", "div_first"):
        cn = const("c", np.full(scale_shape, c), dtype)
        ins = {"mul": [x, cn], "mul_first": [cn, x], "div": [x, cn], "div_first": [cn, x]}[scale]
        nodes.append(oh.make_node("Div" if scale.startswith("div") else "Mul", ins, ["scaled"], name="scale"))
        x = "scaled"
    elif scale == "input":
        nodes.append(oh.make_node("Mul", [x, "c_in"], ["scaled"], name="scale"))
        x = "scaled"
    if mask is not None:
        nodes.append(oh.make_node("Add", ["mask", x] if mask_first else [x, "mask"], ["masked"], name="add_mask"))
        x = "masked"
    if extra is not None:
        x = extra(nodes, inits, x)
    for i, to in enumerate(pre):
        nodes.append(oh.make_node("Cast", [x], [f"pre{i}"], name=f"cast_pre{i}", to=to))
        x = f"pre{i}"
    sm_attrs = {} if axis is None else {"axis": axis}
    nodes.append(oh.make_node("Softmax", [x], ["probs"], name="softmax", **sm_attrs))
    x = "probs"
    for i, to in enumerate(post):
        nodes.append(oh.make_node("Cast", [x], [f"post{i}"], name=f"cast_post{i}", to=to))
        x = f"post{i}"
    vr = repeat("v", [b, hv, t, dv], rep_v, "vr") if rep_v > 1 else "v"
    nodes.append(oh.make_node("MatMul", [x, vr], ["o"], name="pv_matmul"))

    B, T = ("B", "T") if sym else (b, t)
    qs = list(q_shape or [B, hq, s, d])
    ks = list(k_shape or ([B, hkv, d, T] if k_transposed else [B, hkv, T, d]))
    inputs = [oh.make_tensor_value_info("q", et, qs), oh.make_tensor_value_info("k", et, ks),
              oh.make_tensor_value_info("v", et, [B, hv, T, dv])]
    if mask is not None:
        inputs.append(oh.make_tensor_value_info("mask", et, list(mask)))
    if scale == "input":
        inputs.append(oh.make_tensor_value_info("c_in", et, []))
    outs = [oh.make_tensor_value_info("o", et, None)] + [oh.make_tensor_value_info(o, et, None) for o in outputs]
    g = oh.make_graph(nodes, "attn", inputs, outs, inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)
    inferred = {o.name: o for o in onnx.shape_inference.infer_shapes(m).graph.output}
    for o in m.graph.output:        # the outputs' shapes as onnx infers them (the checker wants one)
        o.CopyFrom(inferred[o.name])
    return m


def ops(model):
    return sorted((n.domain, n.op_type) for n in model.graph.node)


def feeds_for(model, seed=0, dims=None):
    """Normal q / k / v; a mask of 0 and the type's lowest value (about a third; last axis' first entry 0)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, dt in input_specs(model, dims):
        if name == "mask":
            m = np.where(rng.random(shape) < 0.35, np.finfo(dt).min, 0).astype(dt)
            if m.ndim:
                m[..., 0] = 0
            out[name] = m
        else:
            out[name] = rng.standard_normal(shape).astype(dt)
    return out


run_ort = partial(run_cpu, ours=False)


run_ours = run_cpu


def rel_err(got, want):
    """max |got - want| / max |want| (NaNs must sit in the same places)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    return float(np.abs(got[ok] - want[ok]).max() / max(np.abs(want[ok]).max(), 1e-30)) if ok.any() else 0.0


def rewrite(model, passes=("kvattention",), **options):
    return checked_rewrite(model, passes, **options)


def attention_nodes(graph):
    return [n for n in graph.node if n.domain == domain.DOMAIN and n.op_type == "KVAttention"]


def attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def assert_rewritten(m, scale=0.25, divide=0, mask=True, rep=None):
    out, rep_ = rewrite(m)
    (node,) = attention_nodes(out.graph)
    assert len(rep_.rewritten("kvattention")) == 1 and not rep_.skipped("kvattention"), rep_.to_table()
    e = rep_.rewritten("kvattention")[0]
    assert e.pattern == PATTERN and e.details["scale"] == pytest.approx(scale)
    assert list(node.input) == ["q", "k", "v"] + (["mask"] if mask else []) and list(node.output) == ["o"]
    a = attrs(node)
    assert a.get("scale", 1.0) == pytest.approx(scale, rel=1e-7) and a.get("divide", 0) == divide
    assert not [n for n in out.graph.node if n.op_type in ("Softmax", "MatMul", "Expand", "Transpose")]
    if rep is not None:
        assert e.details["kv_repeat"] == rep
    assert [(o.domain, o.version) for o in out.opset_import][-1] == (domain.DOMAIN, domain.DOMAIN_VERSION)
    return out, rep_


def check_values(m, out, dtype, scale=0.25, divide=False, seeds=(0, 1), dims=None):
    """The rewritten model (our CPU kernel) against onnxruntime's run of the original (TOL) and against
    kvattention.apply of the feeds (REF_TOL); returns the largest errors seen."""
    worst = [0.0, 0.0]
    for seed in seeds:
        feeds = feeds_for(m, seed, dims)
        want, got = run_ort(m, feeds)["o"], run_ours(out, feeds)["o"]
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        e1 = rel_err(got, want)
        assert e1 <= TOL[dtype], (seed, e1)
        ref = kvattention.apply(feeds["q"], feeds["k"], feeds["v"], feeds.get("mask"), scale, divide)
        e2 = rel_err(got, ref)
        assert e2 <= REF_TOL[dtype], (seed, e2)
        worst = [max(worst[0], e1), max(worst[1], e2)]
    return worst


F16C, F32C = TP.FLOAT16, TP.FLOAT
SPELLINGS = [
    ("mul-mask-b1st-gqa", dict(), {}),
    ("mul-first-mask-111t-mha", dict(scale="mul_first", hkv=4, mask=(1, 1, 1, 5)), {}),
    ("div-mask-st-gqa", dict(scale="div", c=4.0, mask=(3, 5)), dict(scale=4.0, divide=1)),
    ("add-mask-first", dict(mask_first=True, mask=(1, 4, 3, 5)), {}),
    ("mul-nomask-gqa", dict(mask=None), dict(mask=False)),
    ("div-nomask-mha", dict(scale="div", c=4.0, hkv=4, mask=None), dict(scale=4.0, divide=1, mask=False)),
    ("no-scale", dict(scale=None), dict(scale=1.0)),
    ("scale-of-shape-1111", dict(scale_shape=(1, 1, 1, 1)), {}),
    ("mqa-repeat-4", dict(hkv=1, mask=(2, 1, 1, 5)), {}),
    ("repeat-after-transpose", dict(repeat_after_t=True), {}),
    ("computed-repeat-shapes", dict(computed=True), {}),
    ("computed-repeat-symbolic-dims", dict(computed=True, sym=True, mask=(1, 1, 1, "T")), {}),
    ("opset11-attrs", dict(opset=11, axis=3), {}),
    ("fp32-identity-casts", dict(pre=(F32C,), post=(F32C, F32C)), {}),
    ("fp16-cast-wrapped-softmax", dict(dtype=np.float16, pre=(F32C,), post=(F16C,)), {}),
    ("fp16-export-casts", dict(dtype=np.float16, post=(F32C, F16C), mask=(1, 1, 1, 5)), {}),
    ("fp16-no-casts-div", dict(dtype=np.float16, scale="div", c=4.0, mask=(3, 5)), dict(scale=4.0, divide=1)),
    ("fp16-mqa-roundtrips", dict(dtype=np.float16, hkv=1, pre=(F32C, F16C, F32C), post=(F16C, F32C, F16C)), {}),
]


@pytest.mark.parametrize("kw,want", [s[1:] for s in SPELLINGS], ids=[s[0] for s in SPELLINGS])
def test_spellings_become_one_attention(kw, want):
    """Mul / Mul with the constant first / Div, with and without a mask ([B, 1, S, T], [1, 1, 1, T], [S, T],
    [1, Hq, S, T]; Add either way round), with and without the GQA repeat (also Hkv = 1, after the Transpose,
    with computed shapes), no scale, opset 11, identity / fp32 round-trip Casts: one KVAttention node; its output
    close to the original's (onnxruntime) and to kvattention.apply."""
    m = attention_model(**kw)
    dtype = kw.get("dtype", np.float32)
    out, rep = assert_rewritten(m, scale=want.get("scale", 0.25), divide=want.get("divide", 0),
                                mask=want.get("mask", True), rep=4 // kw.get("hkv", 2))
    dims = {"B": 2, "T": 5} if kw.get("sym") else None
    check_values(m, out, dtype, want.get("scale", 0.25), bool(want.get("divide", 0)), dims=dims)
    if kw.get("computed"):      # the Shape / Concat / Where nodes computing the repeat's shapes are gone too
        assert ops(out) == [(domain.DOMAIN, "KVAttention")]


def test_k_transposed_without_repeat():
    """MatMul(Q, Transpose(K)) with K read straight from the input (no repeat: Hq = Hkv), the decode export's
    form for 4 / 4 heads; the report names the inputs."""
    m = attention_model(hkv=4, mask=(2, 1, 3, 5))
    out, rep = assert_rewritten(m, rep=1)
    assert rep.rewritten("kvattention")[0].nodes == ("k_transpose", "qk_matmul", "scale", "add_mask", "softmax",
                                                   "pv_matmul")
    d = rep.rewritten("kvattention")[0].details
    assert (d["q"], d["k"], d["v"], d["mask"], d["output"]) == ("q", "k", "v", "mask", "o")
    check_values(m, out, np.float32)


def test_pattern_in_a_subgraph():
    """The pattern inside an If branch reading the outer graph's tensors."""
    inner = attention_model(hkv=2).graph
    shape = [2, 4, 3, 16]
    then = oh.make_graph(list(inner.node), "then", [], [oh.make_tensor_value_info("o", TP.FLOAT, shape)],
                         list(inner.initializer))
    other = oh.make_graph([oh.make_node("Identity", ["q"], ["q_id"])], "else", [],
                          [oh.make_tensor_value_info("q_id", TP.FLOAT, shape)])
    g = oh.make_graph([oh.make_node("If", ["flag"], ["y"], name="if", then_branch=then, else_branch=other)], "sub",
                      list(inner.input) + [oh.make_tensor_value_info("flag", TP.BOOL, [])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, shape)])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    out, rep = rewrite(m)
    body = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in body.node] == ["KVAttention"] and len(rep.rewritten("kvattention")) == 1
    feeds = feeds_for(attention_model(hkv=2))
    feeds["flag"] = np.array(True)
    want, got = run_ort(m, feeds)["y"], run_ours(out, feeds)["y"]
    assert rel_err(got, want) <= TOL[np.float32]


def test_two_layers_sharing_the_mask():
    """Two attention blocks reading one mask (as every layer of an export does): two KVAttention nodes."""
    m = attention_model()
    g = m.graph
    for n in list(g.node):      # a second block on the first one's output, same K, V and mask
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = n.name + "_2"
        c.input[:] = ["o" if i == "q" else (i + "_2" if any(i == x.output[0] for x in g.node) else i)
                      for i in n.input]
        c.output[:] = [o + "_2" for o in n.output]
        g.node.append(c)
    g.output.append(oh.make_tensor_value_info("o_2", TP.FLOAT, [2, 4, 3, 16]))
    out, rep = rewrite(m)
    assert [n.op_type for n in out.graph.node] == ["KVAttention", "KVAttention"]
    assert len(rep.rewritten("kvattention")) == 2 and not rep.skipped("kvattention")
    assert [list(n.input) for n in out.graph.node] == [["q", "k", "v", "mask"], ["o", "k", "v", "mask"]]
    feeds = feeds_for(m)
    want, got = run_ort(m, feeds), run_ours(out, feeds)
    for k in ("o", "o_2"):
        assert rel_err(got[k], want[k]) <= TOL[np.float32], k


# ----------------------------------------------------------------------------------------------------------------
# skips and non-matches
# ----------------------------------------------------------------------------------------------------------------
def _tanh(nodes, inits, x):
    nodes.append(oh.make_node("Tanh", [x], ["capped"], name="softcap"))
    return "capped"


def _mask_is_the_scores(nodes, inits, x):
    nodes.append(oh.make_node("Add", ["scaled", "scaled"], ["doubled"], name="add_mask"))
    return "doubled"


SKIPS = [
    ("scale a graph input", dict(scale="input"), "is not a one-element constant"),
    ("scale of two elements", dict(scale_shape=(1, 5)), "is not a one-element constant"),
    ("scale of rank 5", dict(scale_shape=(1, 1, 1, 1, 1)), "is not a one-element constant (of rank <= 4)"),
    ("c / scores", dict(scale="div_first"), "divides by the scores"),
    ("softmax on axis 2", dict(axis=2, s=5, mask=(2, 1, 5, 5)), "is on axis 2, not the last one"),
    ("softmax opset-11 default axis 1", dict(opset=11, axis=None), "is on axis 1, not the last one"),
    ("K^T with another perm", dict(perm=(1, 0, 3, 2), k_shape=[4, 2, 5, 16], hkv=4, mask=None),
     "has perm [1, 0, 3, 2], not [0, 1, 3, 2]"),
    ("K given transposed", dict(k_transposed=True, hkv=4), "is not Transpose(K, perm [0, 1, 3, 2])"),
    ("mask broadcasting B up", dict(b=1, mask=(2, 1, 3, 5)), "would broadcast the scores up"),
    ("mask broadcasting S up", dict(s=1, mask=(1, 1, 3, 5)), "would broadcast the scores up"),
    ("mask of rank 5", dict(mask=(1, 2, 1, 3, 5)), "rank 5 > 4"),
    ("Cast to float16 in an fp32 model", dict(post=(F16C, F32C)), "is to float16 in a float32 model"),
    ("Cast to double", dict(pre=(TP.DOUBLE,), post=(F32C,)), "is to double"),
    ("K and V repeats disagree", dict(rep_v=4, hv=1), "repeated differently (K x2, V x4)"),
    ("double", dict(dtype=np.float64), "double: KVAttention takes float or float16"),
    ("scores also a graph output", dict(outputs=("scores",)), "scores (MatMul) is used elsewhere: graph output"),
    ("P also a graph output", dict(outputs=("probs",)), "probs (Softmax) is used elsewhere: graph output"),
    ("repeated K also a graph output", dict(outputs=("kr_r",)), "kr_r (Reshape) is used elsewhere"),
    ("Unsqueeze on axis 1", dict(unsq_axis=1, computed=False), "has axes [1], not [2]"),
    ("repeat's Reshape with T and D swapped", dict(computed=True, sym=True, target_order=(0, 1, 3, 2)),
     "is not [B, H x 2, x, y]"),
    ("no repeat and Hq != Hkv (MatMul broadcast)", dict(hkv=1, rep_k=1, rep_v=1), "Q has 4 heads, K and V 1"),
    ("Q of rank 3", dict(q_shape=[4, 3, 16], mask=None, b=1), "has rank 3, not 4"),
    ("V with another head size", dict(dv=8), "differ in head size D"),
    ("softcapping before the Softmax", dict(extra=_tanh), "found Tanh softcap"),
    ("Add(scaled, scaled)", dict(mask=None, extra=_mask_is_the_scores), "mask (scaled) is computed inside the pattern"),
]


@pytest.mark.parametrize("what,kw,reason", SKIPS, ids=[s[0] for s in SKIPS])
def test_candidates_that_cannot_be_rewritten_are_skipped(what, kw, reason):
    m = attention_model(**kw)
    out, rep = rewrite(m)
    assert ops(out) == ops(m), what
    (e,) = rep.skipped("kvattention")
    assert e.pattern == PATTERN and "softmax" in e.nodes and "pv_matmul" in e.nodes
    assert reason in e.reason, e.reason
    assert not rep.rewritten("kvattention")


def test_tiled_kv_heads_are_skipped():
    """Expand over the batch axis then Reshape: heads h0 h1 h0 h1 (a tile), not repeat_kv's h0 h0 h1 h1."""
    m = attention_model(b=1, hkv=2, mask=None)
    for init in m.graph.initializer:     # Expand [2, 2, 1, T, D] (the batch axis broadcast), Reshape [1, 4, T, D]
        if init.name in ("kr_es", "vr_es"):
            init.CopyFrom(nh.from_array(np.array([2, 2, 1, 5, 16], np.int64), init.name))
    out, rep = rewrite(m)
    assert ops(out) == ops(m)
    (e,) = rep.skipped("kvattention")
    assert "K repeat: Expand kr_expand to [2, 2, 1, 5, 16] is not [B, H, rep, x, y]" in e.reason, e.reason
    feeds = feeds_for(m)     # the graph is valid (and not attention with repeat_kv): onnxruntime runs it
    assert run_ort(m, feeds)["o"].shape == (1, 4, 3, 16)


def test_batch_broadcast_by_matmul_is_skipped():
    """Q with B = 2 against K and V with B = 1: MatMul broadcasts K; KVAttention needs one B."""
    m = attention_model(b=2, hkv=4, mask=None)
    for vi in m.graph.input:
        if vi.name in ("k", "v"):
            vi.type.tensor_type.shape.dim[0].dim_value = 1
    out, rep = rewrite(m)
    assert ops(out) == ops(m)
    (e,) = rep.skipped("kvattention")
    assert "batch size 2 differs from K's 1" in e.reason, e.reason


def test_p_read_elsewhere_is_skipped():
    """P also feeding another node (e.g. returned attention weights through an Identity)."""
    m = attention_model()
    m.graph.node.append(oh.make_node("Identity", ["probs"], ["probs_copy"], name="copy"))
    m.graph.output.append(oh.make_tensor_value_info("probs_copy", TP.FLOAT, [2, 4, 3, 5]))
    out, rep = rewrite(m)
    (e,) = rep.skipped("kvattention")
    assert "probs (Softmax) is used elsewhere: copy" in e.reason and ops(out) == ops(m)


def test_p_read_by_a_subgraph_is_skipped():
    """P read (as an outer-scope tensor) inside an If branch."""
    m = attention_model()
    shape = [2, 4, 3, 5]
    then = oh.make_graph([oh.make_node("Identity", ["probs"], ["p_then"])], "then", [],
                         [oh.make_tensor_value_info("p_then", TP.FLOAT, shape)])
    other = oh.make_graph([oh.make_node("Identity", ["mask"], ["p_else"])], "else", [],
                          [oh.make_tensor_value_info("p_else", TP.FLOAT, [2, 1, 3, 5])])
    m.graph.node.append(oh.make_node("If", ["flag"], ["p_if"], name="if", then_branch=then, else_branch=other))
    m.graph.input.append(oh.make_tensor_value_info("flag", TP.BOOL, []))
    m.graph.output.append(oh.make_tensor_value_info("p_if", TP.FLOAT, None))
    out, rep = run_passes(m, ["kvattention"])
    (e,) = rep.skipped("kvattention")
    assert "probs (Softmax) is used elsewhere: Identity(->p_then)" in e.reason and ops(out) == ops(m)


def test_softmax_not_feeding_a_matmul_is_not_reported():
    """A classifier-style Softmax (no MatMul after it) and one feeding a MatMul's second input: left alone,
    unreported."""
    vi = lambda n, s: oh.make_tensor_value_info(n, TP.FLOAT, list(s))  # noqa: E731
    nodes = [oh.make_node("MatMul", ["x", "w"], ["logits"]), oh.make_node("Softmax", ["logits"], ["p"], axis=-1),
             oh.make_node("Softmax", ["x"], ["px"], axis=-1), oh.make_node("MatMul", ["w2", "px"], ["y"])]
    g = oh.make_graph(nodes, "cls", [vi("x", (2, 8)), vi("w", (8, 3)), vi("w2", (4, 2))],
                      [vi("p", (2, 3)), vi("y", (4, 8))])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    out, rep = rewrite(m)
    assert ops(out) == ops(m) and not rep.entries


def test_input_model_is_not_modified():
    m = attention_model(computed=True)
    before = m.SerializeToString()
    out, rep = run_passes(m, ["kvattention"])
    assert m.SerializeToString() == before and len(rep.rewritten("kvattention")) == 1
    assert attention_nodes(out.graph) and not attention_nodes(m.graph)
    m, _ = tiny_decode_export(np.float32, 4, 2)
    before = m.SerializeToString()
    out, _ = run_passes(m, WITH_KV)
    assert m.SerializeToString() == before and attention_nodes(out.graph) and not attention_nodes(m.graph)


# ----------------------------------------------------------------------------------------------------------------
# real exports: samples/llama_decode.py's decode step (TorchScript, static shapes, KV cache); a tiny LlamaForCausalLM
# over a prompt (TorchScript with a dynamic sequence axis, dynamo)
# ----------------------------------------------------------------------------------------------------------------
def default_passes_but_attention():
    return [p.name for p in PASSES.values() if p.default]


DECODES = [(np.float32, 4, 2, 1, None), (np.float32, 4, 4, 2, None), (np.float16, 4, 2, 2, None),
           (np.float16, 4, 4, 1, None), (np.float16, 4, 2, 1, "nf4")]


@pytest.mark.parametrize("dtype,heads,kv_heads,layers,weights", DECODES,
                         ids=["fp32-gqa", "fp32-mha-2layers", "fp16-gqa-2layers", "fp16-mha", "fp16-gqa-nf4"])
def test_decode_export(dtype, heads, kv_heads, layers, weights):
    """The default passes: every layer's attention becomes one KVAttention(RotaryKV's Q, present key, present value,
    the mask) with scale 1/sqrt(16); no Softmax left. Logits and present.* from our session: close to the
    original's onnxruntime run (TOL; not for nf4, whose weights differ) and to the same rewrite without
    "kvattention" (TOL)."""
    m, feeds = tiny_decode_export(dtype, heads, kv_heads, layers=layers)
    opts = {"weights": weights} if weights else {}
    out, rep = rewrite(m, passes=WITH_KV, **opts)
    att = attention_nodes(out.graph)
    assert len(att) == layers and len(rep.rewritten("kvattention")) == layers and not rep.skipped("kvattention")
    assert not [n for n in out.graph.node if n.op_type == "Softmax"]
    writer = {o: n for n in out.graph.node for o in n.output}
    for i in range(layers):
        (n,) = [a for a in att if f"layers.{i}/" in a.name]
        assert attrs(n)["scale"] == pytest.approx(0.25) and attrs(n).get("divide", 0) == 0
        assert list(n.input[1:3]) == [f"present.{i}.key", f"present.{i}.value"] and len(n.input) == 4
        q = writer[n.input[0]]     # Q: RotaryKV's first output (with nf4 at this size merge leaves q apart: Rotary)
        kinds = ("RotaryKV",) if weights is None else ("RotaryKV", "Rotary")
        assert q.domain == domain.DOMAIN and q.op_type in kinds and q.output[0] == n.input[0]
        assert rep.rewritten("kvattention")[i].details["kv_repeat"] == heads // kv_heads
    got = run_ours(out, feeds)
    without, _ = rewrite(m, passes=default_passes_but_attention(), **opts)
    assert not attention_nodes(without.graph)
    ref = run_ours(without, feeds)
    want = run_ort(m, feeds) if weights is None else None
    assert set(got) == {"logits"} | {f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")}
    for k, v in got.items():
        assert v.dtype == dtype and rel_err(v, ref[k]) <= TOL[dtype], k
        if want is not None:
            assert rel_err(v, want[k]) <= TOL[dtype], k


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_decode_export_attention_outputs(dtype):
    """Each KVAttention's output, read from our session, against the tensor the original computes there
    (onnxruntime, same inputs since everything upstream agrees) and against kvattention.apply on the KVAttention's
    inputs as the original computes them."""
    m, feeds = tiny_decode_export(dtype, 4, 2, layers=2)
    out, _ = rewrite(m, passes=WITH_KV)
    att = attention_nodes(out.graph)
    names = sorted({t for n in att for t in list(n.input) + list(n.output)})

    def probe(model):
        p = onnx.ModelProto()
        p.CopyFrom(model)
        have = {o.name for o in p.graph.output}
        p.graph.output.extend(oh.make_tensor_value_info(t, ET[dtype], None) for t in names if t not in have)
        return p
    want, got = run_ort(probe(m), feeds), run_ours(probe(out), feeds)
    for n in att:
        o = n.output[0]
        assert rel_err(got[o], want[o]) <= TOL[dtype], n.name
        ref = kvattention.apply(*(want[i] for i in n.input), scale=attrs(n)["scale"])
        assert rel_err(got[o], ref) <= REF_TOL[dtype], n.name


LLAMAS = [("torchscript", np.float32), ("torchscript", np.float16), ("dynamo", np.float32)]


@pytest.mark.parametrize("exporter,dtype", LLAMAS, ids=["ts-fp32", "ts-fp16", "dynamo-fp32"])
def test_llama_prompt_exports(exporter, dtype):
    """A prompt of 7 tokens (no cache; TorchScript with a dynamic sequence axis: the repeat's shapes are computed
    from Shape(K); dynamo: constants, Reshape allowzero=1): one KVAttention per layer; logits close to the
    original's. By default they are skipped: the query length (7, or the dynamic axis) is not known to be <=
    kvattention_max_query (default 4) for the dynamic one; the option 0 lifts the limit."""
    m = tiny_llama_export(exporter, dtype, 2, 128, 7)
    default = WITH_KV
    if exporter == "torchscript":       # dynamic S: not rewritten by default, with the reason
        _, rep0 = rewrite(m, passes=default)
        assert len(rep0.skipped("kvattention")) == 2 and not rep0.rewritten("kvattention")
        assert all("kvattention_max_query" in e.reason for e in rep0.skipped("kvattention"))
    out, rep = rewrite(m, passes=default, kvattention_max_query=0)
    assert len(attention_nodes(out.graph)) == 2 and len(rep.rewritten("kvattention")) == 2
    assert not rep.skipped("kvattention") and not [n for n in out.graph.node if n.op_type == "Softmax"]
    assert all(e.details["kv_repeat"] == 2 for e in rep.rewritten("kvattention"))
    feeds = {"input_ids": np.random.default_rng(2).integers(0, 128, (1, 7)).astype(np.int64)}
    logits = m.graph.output[0].name
    assert rel_err(run_ours(out, feeds)[logits], run_ort(m, feeds)[logits]) <= TOL[dtype]


def test_registering_our_schemas_keeps_onnx_reference_importable():
    """Our op names must not clash with the standard domain's (onnx.reference keys its ops by name alone)."""
    import subprocess
    import sys
    code = "import onnx_lowbit.domain as d; d.register_schemas(); import onnx.reference; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("limit,rewritten", [(None, True), (3, True), (2, False), (0, True)])
def test_query_length_limit(limit, rewritten):
    """S = 3: rewritten by default (MAX_QUERY 4) and with kvattention_max_query 3 or 0 (no limit); skipped with 2,
    the reason naming the option."""
    from onnx_lowbit.passes.kvattention import MAX_QUERY
    assert MAX_QUERY >= 3
    m = attention_model(s=3, mask=(2, 1, 3, 5))
    out, rep = rewrite(m, **({} if limit is None else {"kvattention_max_query": limit}))
    assert bool(attention_nodes(out.graph)) == rewritten
    if not rewritten:
        (e,) = rep.skipped("kvattention")
        assert "query length S = 3 is not known to be <= 2" in e.reason and "kvattention_max_query" in e.reason


def test_kvattention_is_opt_in():
    """Not a default pass (no faster than onnxruntime's kernels in the decode step): the default rewrite of the
    decode export keeps its Softmax; named, it runs."""
    assert not PASSES["kvattention"].default
    m, _ = tiny_decode_export(np.float32, 4, 2)
    out, rep = rewrite(m, passes=[p.name for p in PASSES.values() if p.default])
    assert not attention_nodes(out.graph) and any(n.op_type == "Softmax" for n in out.graph.node)
    out, rep = rewrite(m, passes=WITH_KV)
    assert len(attention_nodes(out.graph)) == 1


@pytest.mark.parametrize("bad", [-1, "4", 2.5, True])
def test_bad_max_query_option_is_refused(bad):
    with pytest.raises(ValueError, match="kvattention_max_query must be an integer >= 0"):
        run_passes(attention_model(), ["kvattention"], kvattention_max_query=bad)
