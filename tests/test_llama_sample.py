"""samples/llama_decode.py end to end at a tiny size on the CPU: export (transformers LlamaForCausalLM, random
weights, one decode step with a KV cache), ``onnx-lowbit rewrite --weights nf4`` (all passes), ``onnx-lowbit bench``.

Logits are checked in two steps:
  * the exported original against the PyTorch model itself (fp32: the export is exact up to summation order);
  * the rewritten model against the script's --reference model (llama_decode.fakequant.onnx): the original
    rewritten with weights4 only, each MatMulNF4 replaced by a float MatMul on its dequantised weight
    (onnx_lowbit.nf4.dequantize), run in stock onnxruntime. Both then hold the very same 4-bit weights, so what is left between them is the FPLUT silu
    table (max relative error 3.9e-3 per element, `onnx-lowbit lut list`; it feeds the down projection and the
    residual stream, so the logits move by a fraction of it) and float summation order (~1e-6): tolerance 4e-3
    of max |logits|. Against the float original the 4-bit weights themselves change the logits by ~10-20 %
    here (weights4 reports ~9 % relative error per matrix, compounded over 2 layers and lm_head): checked only
    to be of that order, which the fake-quant reference reproduces.
"""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")

from onnx_lowbit import api, model_io, passes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "samples", "llama_decode.py")
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "128", "--intermediate", "352", "--heads", "4",
        "--kv-heads", "2", "--vocab", "256", "--past", "16"]
TOLERANCE = 4e-3


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(a).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, SCRIPT, *TINY, "--out", str(out), "--warmup", "1", "--runs", "3",
                        "--reference", "--compare", "ort-nbits"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p.stdout


def test_script_writes_models_table_and_chart(tiny):
    out, stdout = tiny
    for f in ("llama_decode.onnx", "llama_decode.onnx.data", "llama_decode.nf4.onnx", "bench-cpu.png",
              "bench-cpu.json", "llama_decode.fakequant.onnx", "reference/bench-cpu.json"):
        assert (out / f).is_file(), f
    assert not (out / ".export").exists() and not list(out.glob("*weights4*"))
    assert "| latency median (ms) |" in stdout and "| logits |" in stdout
    orig = onnx.load(str(out / "llama_decode.onnx"), load_external_data=False)
    assert model_io.uses_external_data(orig)
    assert [i.name for i in orig.graph.input][:3] == ["input_ids", "past_key_values.0.key",
                                                      "past_key_values.0.value"]
    assert [d.dim_value for d in orig.graph.output[1].type.tensor_type.shape.dim] == [1, 2, 17, 32]
    rew = onnx.load(str(out / "llama_decode.nf4.onnx"), load_external_data=False)
    ops = [n.op_type for n in rew.graph.node]
    if "merge" in passes.available():  # q/k/v merged (+ Split), o, down per layer + lm_head; gate/up fused
        assert ops.count("FusedFFNNF4") == 2 and ops.count("MatMulNF4") == 2 * 3 + 1
        assert sum(n.name.endswith("_merged") for n in rew.graph.node) == 2
    elif "ffn" in passes.available():  # q, k, v, o, down per layer + lm_head; gate/up fused with the silu
        assert ops.count("FusedFFNNF4") == 2 and ops.count("MatMulNF4") == 2 * 5 + 1
    else:
        assert ops.count("MatMulNF4") == 2 * 7 + 1 and ops.count("FPLUT") == 2
    d = json.loads((out / "bench-cpu.json").read_text())
    o, r, nb = d["models"]      # --compare ort-nbits: onnxruntime's MatMulNBits model in the same bench run
    assert r["weight_bytes"] < 0.35 * o["weight_bytes"] and nb["weight_bytes"] < 0.35 * o["weight_bytes"]
    assert nb["path"].endswith("llama_decode.ort-nbits.onnx")
    assert [(a["model"], a["output"]) for a in d["agreement"]][:2] == [("rewritten 1", "logits"),
                                                                      ("rewritten 1", "present.0.key")]
    nbits = [a for a in d["agreement"] if a["model"] == "rewritten 2"]
    assert len(nbits) == len(d["agreement"]) // 2 and all(np.isfinite(a["max_rel"]) for a in nbits)
    ort_ops = {(n.domain, n.op_type) for n in onnx.load(nb["path"], load_external_data=False).graph.node}
    assert ("com.microsoft", "MatMulNBits") in ort_ops and not any(dm == "onnx_lowbit" for dm, _ in ort_ops)


def test_logits(tiny, tmp_path):
    import torch
    sys.path.insert(0, ROOT)
    from samples import llama_decode as ld
    out, _ = tiny
    a = ld.parse_args(TINY)
    model = ld.build_model(a)
    ids, past = ld.example_inputs(a, model)
    with torch.no_grad():
        ref = ld.make_step(model)(ids, *past)
    names, _ = ld.io_names(a.layers)
    feeds = dict(zip(names, [ids.numpy()] + [p.numpy() for p in past]))
    orig = out / "llama_decode.onnx"
    got = api.InferenceSession(str(orig), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert _rel(ref[0].numpy(), got[0]) < 1e-5           # the export itself
    assert np.array_equal(got[1][:, :, :a.past], feeds[names[1]])   # present = concat(past, new)
    assert _rel(ref[1].numpy(), got[1]) < 1e-5
    rew = api.InferenceSession(str(out / "llama_decode.nf4.onnx"), providers=["CPUExecutionProvider"])
    lowbit = rew.run(None, feeds)
    import onnxruntime as ort
    fq = out / "llama_decode.fakequant.onnx"
    assert not [n for n in onnx.load(str(fq), load_external_data=False).graph.node if n.domain]
    expect = ort.InferenceSession(str(fq), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert _rel(expect[0], lowbit[0]) < TOLERANCE, _rel(expect[0], lowbit[0])
    for e, g in zip(expect[1:], lowbit[1:]):           # the cache: k/v projections only (no FPLUT before layer 0)
        assert _rel(e, g) < TOLERANCE
    assert 0.02 < _rel(got[0], lowbit[0]) < 0.4          # 4-bit weights: visible, same order as the reference's
    assert abs(_rel(got[0], lowbit[0]) - _rel(got[0], expect[0])) < TOLERANCE
    ref = json.loads((out / "reference" / "bench-cpu.json").read_text())   # the script's own reference bench
    assert ref["agreement"][0]["output"] == "logits" and ref["agreement"][0]["max_rel"] < TOLERANCE
