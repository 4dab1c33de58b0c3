"""The "rotarykv" pass (passes/rotarykv.py) and the passes around it on whole decoders exported with dynamic shapes,
as optimum and torch's dynamo exporter write them (test_pass_rotarykv.py covers the hand-built spellings and
samples/llama_decode.py's static decode step).

A tiny random LLaMA (2 layers, 4 query and 2 kv heads of 16) exported by samples/export_causal_lm.py with
optimum's text-generation-with-past inputs and outputs and dynamic batch / sequence / past:
  torchscript-eager   TorchScript, eager attention
  torchscript-sdpa    TorchScript, opset 18, SDPA attention: the spelling of ``optimum-cli export onnx --task
                      text-generation-with-past`` (optimum-onnx 0.1.0; tests/test_optimum.py runs optimum itself
                      where it is installed). rotary leaves the Shape -> Gather -> Div chain that sized the Slices
                      it replaced reading the transposed q and k: dead, it must not stop rotarykv.
  dynamo              torch.onnx.export(dynamo=True), opset 18: its head Reshapes have allowzero=1 (targets
                      Concat(Shape(.)[0:1], Shape(.)[1:2], [-1], [D]), no 0 entry), which read as allowzero=0.
Each is rewritten with the default passes: one RotaryKV per layer, nothing skipped; every output bit for bit that of
the default passes without rotarykv and close to the original's, for a prompt after a cache (S = 2) and a decode
step (S = 1). On the dynamo export every float pass that applies to a LLaMA rewrites what it rewrites on TorchScript
(rmsnorm too), and with 4-bit weights rotarykv still matches.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper as oh

from test_pass_rotarykv import assert_rewritten, check_values, kv_model, node, set_attr, same_bits

import onnx_lowbit
from onnx_lowbit import domain
from onnx_lowbit.passes import resolve, run_passes

CPU = ["CPUExecutionProvider"]
LAYERS, HQ, HKV, D = 2, 4, 2, 16
EXPORTS = {"torchscript-eager": dict(attn="eager", opset=17, dynamo=False),
           "torchscript-sdpa": dict(attn="sdpa", opset=18, dynamo=False),
           "dynamo": dict(attn="eager", opset=18, dynamo=True)}
_CACHE = {}


def exported(kind, tmp_path_factory):
    """The tiny decoder exported as ``kind`` (a ModelProto, cached for the module)."""
    if kind not in _CACHE:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
        if EXPORTS[kind]["dynamo"]:
            pytest.importorskip("onnxscript")
        import warnings

        from samples import export_causal_lm as ecl
        kw = EXPORTS[kind]
        path = str(tmp_path_factory.mktemp(kind) / "model.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ecl.export(ecl.tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, attn=kw["attn"]), path,
                       opset=kw["opset"], dynamo=kw["dynamo"])
        _CACHE[kind] = onnx.load(path)
    return _CACHE[kind]


def feeds(seq, past=3, seed=0):
    rng = np.random.default_rng(seed)
    f = {"input_ids": rng.integers(0, 1024, (1, seq)).astype(np.int64),
         "attention_mask": np.ones((1, past + seq), np.int64),
         "position_ids": np.arange(past, past + seq, dtype=np.int64)[None]}
    for i in range(LAYERS):
        for kv in ("key", "value"):
            f[f"past_key_values.{i}.{kv}"] = rng.standard_normal((1, HKV, past, D)).astype(np.float32)
    return f


def run(model, f):
    sess = onnx_lowbit.InferenceSession(model.SerializeToString(), providers=CPU)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, f)))


@pytest.mark.parametrize("kind", list(EXPORTS))
def test_rotarykv_on_dynamic_exports(kind, tmp_path_factory):
    m = exported(kind, tmp_path_factory)
    if kind == "dynamo":
        assert any(n.op_type == "Reshape" and any(a.name == "allowzero" and a.i == 1 for a in n.attribute)
                   for n in m.graph.node)
    out, rep = onnx_lowbit.rewrite(m)
    assert not rep.skipped("rotarykv"), rep.skipped("rotarykv")[0].reason
    entries = rep.rewritten("rotarykv")
    kv = [n for n in out.graph.node if n.op_type == "RotaryKV"]
    assert len(entries) == len(kv) == LAYERS and all(n.domain == domain.DOMAIN for n in kv)
    assert all({a.name: a.i for a in n.attribute} == {"num_heads": HQ, "kv_num_heads": HKV} for n in kv)
    assert sorted(o for n in kv for o in n.output[1:]) == sorted(
        f"present.{i}.{k}" for i in range(LAYERS) for k in ("key", "value"))
    assert not [n for n in out.graph.node if n.op_type in ("Rotary", "Split")]
    without = [p.name for p in resolve(None) if p.name != "rotarykv"]
    ref, _ = run_passes(m, without)
    orig = ort.InferenceSession(m.SerializeToString(), providers=CPU)
    for seq in (2, 1):
        f = feeds(seq)
        got, same = run(out, f), run(ref, f)
        want = dict(zip([o.name for o in orig.get_outputs()], orig.run(None, f)))
        assert sorted(got) == sorted(want)
        for k in want:
            assert same_bits(got[k], same[k]), (k, seq)
            assert got[k].shape == want[k].shape, k
            # FPLUT's fp16 SiLU and the fused FFN / merged products' sums: about 1e-3 of the largest logit
            assert np.abs(got[k] - want[k]).max() <= 5e-3 * np.abs(want[k]).max(), (k, seq)
        for i in range(LAYERS):
            assert same_bits(got[f"present.{i}.key"][:, :, :3], f[f"past_key_values.{i}.key"])


def test_dynamo_export_other_passes(tmp_path_factory):
    """Every float pass rewrites the dynamo export as the TorchScript one (rmsnorm: 2 per layer and the final
    norm), nothing skipped; kvattention is reported skipped on both (TorchScript: the query length is dynamic;
    dynamo: the repeat_kv Expand's shape is computed)."""
    names = "fplut,ffn,merge,rotary,rotarykv,rmsnorm,kvattention"
    want = {"fplut": LAYERS, "ffn": LAYERS, "merge": LAYERS, "rotary": 2 * LAYERS, "rotarykv": LAYERS,
            "rmsnorm": 2 * LAYERS + 1}
    for kind in ("torchscript-eager", "dynamo"):
        out, rep = run_passes(exported(kind, tmp_path_factory), names)
        got = {k: v["rewritten"] for k, v in rep.summary().items() if v["rewritten"]}
        assert got == want, (kind, got)
        assert {e.pass_name for e in rep.skipped()} == {"kvattention"}, kind
        assert len(rep.skipped("kvattention")) == LAYERS
        onnx.checker.check_model(out, full_check=True)
    f = feeds(2)
    orig = ort.InferenceSession(exported("dynamo", tmp_path_factory).SerializeToString(), providers=CPU)
    want_logits = orig.run(["logits"], f)[0]
    got = run(out, f)["logits"]
    assert np.abs(got - want_logits).max() <= 5e-3 * np.abs(want_logits).max()


def test_dynamo_export_nf4(tmp_path_factory):
    """--weights nf4 on the dynamo export (q/k/v all 4-bit: weights_min_elements 0, so merge packs all three):
    rotarykv still takes every layer; the logits' top-1 mostly as the original's (random weights, 4-bit)."""
    m = exported("dynamo", tmp_path_factory)
    out, rep = onnx_lowbit.rewrite(m, weights="nf4", weights_min_elements=0)
    assert len(rep.rewritten("rotarykv")) == LAYERS and not rep.skipped("rotarykv")
    assert len(rep.rewritten("weights4")) == 7 * LAYERS
    f = feeds(2)
    got = run(out, f)
    orig = ort.InferenceSession(m.SerializeToString(), providers=CPU)
    want = orig.run(["logits"], f)[0]
    assert got["logits"].shape == want.shape and np.isfinite(got["logits"]).all()
    rel = np.linalg.norm(got["logits"] - want) / np.linalg.norm(want)
    assert rel < 0.25, rel


# ----------------------------------------------------------------------------------------------------------------
# the two spellings, hand-built (test_pass_rotarykv.kv_model)
# ----------------------------------------------------------------------------------------------------------------
def test_allowzero_without_zero_entries_is_rewritten():
    """allowzero=1 on every head Reshape, targets [B, S, H, D] and [1, 1, -1, 8] (no 0 entry): the same Reshape as
    allowzero=0; rewritten, bit for bit."""
    for targets in (None, {p: [1, 1, -1, 8] for p in "qkv"}):
        m = kv_model(targets=targets)
        for p in "qkv":
            set_attr(node(m, f"reshape_{p}"), "allowzero", 1)
        out, _ = assert_rewritten(m, 4, 2)
        check_values(m, out, 4, 2)


def _shape_reader(m, tensor, live):
    """A Shape of ``tensor`` -> Gather(-1); its result a graph output when ``live``, else read by nothing."""
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(-1, np.int64), "last"))
    m.graph.node.extend([oh.make_node("Shape", [tensor], [tensor + "_shape"], name=tensor + "_shape"),
                         oh.make_node("Gather", [tensor + "_shape", "last"], [tensor + "_d"], name=tensor + "_d",
                                      axis=0)])
    if live:
        m.graph.output.append(oh.make_tensor_value_info(tensor + "_d", onnx.TensorProto.INT64, []))


@pytest.mark.parametrize("tensor", ["qt", "kt"])
def test_dead_shape_readers_do_not_count(tensor):
    """A Shape chain reading qt / kt whose result reaches no graph output (what rotary leaves in optimum's
    exports) does not stop the rewrite and is gone after cleanup; one that reaches a graph output does."""
    m = kv_model()
    _shape_reader(m, tensor, live=False)
    out, rep = onnx_lowbit.rewrite(m, "rotarykv")
    assert len(rep.rewritten("rotarykv")) == 1
    assert not [n for n in out.graph.node if n.op_type in ("Shape", "Gather", "Transpose")]
    check_values(m, out, 4, 2)
    m = kv_model()
    _shape_reader(m, tensor, live=True)
    out, rep = onnx_lowbit.rewrite(m, "rotarykv")
    (e,) = rep.skipped("rotarykv")
    assert f"intermediate {tensor} (Transpose) is used elsewhere: {tensor}_shape" in e.reason


def test_reader_inside_a_subgraph_counts():
    """qt read from inside an If's branches (outer-scope reference), the If's output unused: the reader is in
    another graph, so it counts (the branch would lose its input); skipped, nothing changed."""
    m = kv_model()
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(True), "cond"))
    branches = [oh.make_graph([oh.make_node("Identity", ["qt"], [f"{b}_out"], name=f"{b}_id")], b, [],
                              [oh.make_tensor_value_info(f"{b}_out", onnx.TensorProto.FLOAT, None)])
                for b in ("then", "else")]
    m.graph.node.append(oh.make_node("If", ["cond"], ["if_out"], name="if_qt", then_branch=branches[0],
                                     else_branch=branches[1]))
    out, rep = onnx_lowbit.rewrite(m, "rotarykv")
    (e,) = rep.skipped("rotarykv")
    assert "intermediate qt (Transpose) is used elsewhere: else_id, then_id" in e.reason, e.reason
    assert not rep.rewritten("rotarykv")
