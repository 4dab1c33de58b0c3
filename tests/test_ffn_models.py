"""The ffn pass on real architectures: transformers' LlamaMLP and Qwen2MLP (hidden 64, intermediate 176) and a tiny
LlamaForCausalLM (2 layers, hidden 64, intermediate 176, 4 heads / 2 KV heads, vocab 128), random weights, exported
by the TorchScript exporter (dynamo=False, opset 17) and the dynamo exporter (dynamo=True, opset 18), fp32 and fp16,
rewritten (ffn alone; fplut then ffn; all passes with --weights nf4 / awq) and run in onnxruntime CPU with our ops.

Each export is made once per test session (module-level cache). Errors are max |got - ref| / max |ref| per output.
Tolerances:
* ffn alone, fp32: <= 1e-5 (the fused kernel sums in fp32 like MatMul: only the summation order differs;
  observed ~1e-7 to 1e-6). fp16: <= 4e-3 for the MLPs (the original rounds g, Sigmoid, SiLU, u and the product to
  fp16, 2^-11 relative each, where the fused op rounds once) and <= 1e-2 for the decoder's logits (those
  differences pass through two more layers, attention and lm_head in fp16).
* fplut then ffn: ffn takes over the FPLUT silu node and computes the exact SiLU, so the result is bit-identical to
  ffn alone (no FPLUT node remains).
* --weights nf4 / awq (registry order fplut, weights4, ffn): against the same model quantised by weights4 alone
  (the very same packed bytes, unfused MatMulNF4 / MatMulAWQ and the exact SiLU): <= 1e-4 fp32, fp16 as above.
  Against the float original the 4-bit weights themselves move the outputs by their reconstruction error
  (~0.1 relative per matrix here): checked only to stay below 0.5 (a broken weight layout gives ~1 or more).
"""
from __future__ import annotations

import io
import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnx_lowbit
from onnx_lowbit.passes import run_passes

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

CPU = ["CPUExecutionProvider"]
HIDDEN, INTER, LAYERS, VOCAB, SEQ = 64, 176, 2, 128, 7
_CACHE: dict = {}


def _config(kind):
    from transformers import LlamaConfig, Qwen2Config
    cls = Qwen2Config if kind == "qwen2" else LlamaConfig
    cfg = cls(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    cfg._attn_implementation = "eager"  # plain MatMul / Softmax attention in both exporters
    return cfg


class _Logits(torch.nn.Module):
    """LlamaForCausalLM -> logits; an explicit all-ones attention mask (the TorchScript exporter cannot export
    transformers' packed-sequence detection, aten::diff, that runs without one)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits


def _module(arch):
    torch.manual_seed(0)
    if arch == "llama_mlp":
        from transformers.models.llama.modeling_llama import LlamaMLP
        return LlamaMLP(_config("llama")).eval()
    if arch == "qwen2_mlp":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
        return Qwen2MLP(_config("qwen2")).eval()
    from transformers import LlamaForCausalLM
    lm = LlamaForCausalLM(_config("llama")).eval()
    with torch.no_grad():  # unit-scale weights (transformers' init, std 0.02, makes the MLPs' share of the logits
        for mod in lm.modules():  # too small for fp16 to see it)
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0.0, mod.in_features ** -0.5)
            elif isinstance(mod, torch.nn.Embedding):
                mod.weight.normal_(0.0, 1.0)
    return _Logits(lm).eval()


def export(arch, exporter, dtype):
    """The exported ModelProto (cached for the session)."""
    key = (arch, exporter, dtype)
    if key not in _CACHE:
        mod = _module(arch)
        if dtype == "fp16":
            mod = mod.half()
        if arch == "llama":
            args, names = (torch.randint(0, VOCAB, (1, SEQ)),), ["input_ids"]
            ts_dyn, dy_dyn = None, None
        else:
            x = torch.randn(2, 5, HIDDEN, dtype=torch.float16 if dtype == "fp16" else torch.float32)
            args, names = (x,), ["x"]
            ts_dyn = {"x": {0: "B", 1: "T"}}
            dy_dyn = {"x": {0: torch.export.Dim("B"), 1: torch.export.Dim("T")}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            try:
                if exporter == "dynamo":
                    m = torch.onnx.export(mod, args, dynamo=True, opset_version=18, input_names=names,
                                          dynamic_shapes=dy_dyn, verbose=False).model_proto
                else:
                    f = io.BytesIO()
                    torch.onnx.export(mod, args, f, dynamo=False, opset_version=17, input_names=names,
                                      dynamic_axes=ts_dyn)
                    m = onnx.load_from_string(f.getvalue())
            finally:
                logging.disable(logging.NOTSET)
        _CACHE[key] = m
    return _CACHE[key]


def feeds_list(arch, dtype):
    rng = np.random.default_rng(1)
    if arch == "llama":
        return [{"input_ids": rng.integers(0, VOCAB, (1, SEQ)).astype(np.int64)}]
    dt = np.float16 if dtype == "fp16" else np.float32
    # M = 1 (decode kernel), 10 and 60 (BLAS path)
    return [{"x": rng.standard_normal(s).astype(dt)} for s in ((1, 1, HIDDEN), (2, 5, HIDDEN), (3, 20, HIDDEN))]


def run(model, feeds, ours=True):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if ours:
        return onnx_lowbit.InferenceSession(model, so, providers=CPU).run(None, feeds)
    return ort.InferenceSession(model.SerializeToString(), so, providers=CPU).run(None, feeds)


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape and np.all(np.isfinite(got))
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def ops(model):
    return [n.op_type for n in model.graph.node]


def fp_tol(arch, dtype):
    if dtype == "fp32":
        return 1e-5
    return 1e-2 if arch == "llama" else 4e-3


def n_blocks(arch):
    return LAYERS if arch == "llama" else 1


CASES = [(a, e, d) for a in ("llama_mlp", "qwen2_mlp", "llama") for e in ("torchscript", "dynamo")
         for d in ("fp32", "fp16")]
IDS = ["-".join(c) for c in CASES]


@pytest.mark.parametrize("arch,exporter,dtype", CASES, ids=IDS)
def test_ffn_alone_and_after_fplut(arch, exporter, dtype):
    m = export(arch, exporter, dtype)
    out, report = run_passes(m, ["ffn"])
    onnx.checker.check_model(out, full_check=True)
    assert ops(out).count("FusedFFN") == n_blocks(arch), report.to_table()
    assert "Sigmoid" not in ops(out) and not report.skipped("ffn")
    both, _ = run_passes(m, ["fplut", "ffn"])
    assert ops(both).count("FusedFFN") == n_blocks(arch) and "FPLUT" not in ops(both), ops(both)
    for feeds in feeds_list(arch, dtype):
        ref = run(m, feeds, ours=False)[0]
        got = run(out, feeds)[0]
        assert got.dtype == ref.dtype
        assert rel(got, ref) <= fp_tol(arch, dtype), rel(got, ref)
        np.testing.assert_array_equal(run(both, feeds)[0], got)


@pytest.mark.parametrize("fmt", ["nf4", "awq"])
@pytest.mark.parametrize("arch,exporter,dtype", CASES, ids=IDS)
def test_four_bit(arch, exporter, dtype, fmt):
    m = export(arch, exporter, dtype)
    out, report = run_passes(m, None, weights=fmt)  # registry order: fplut, weights4, ffn
    onnx.checker.check_model(out, full_check=True)
    op = "FusedFFNNF4" if fmt == "nf4" else "FusedFFNAWQ"
    assert ops(out).count(op) == n_blocks(arch), report.to_table()
    assert not {"Sigmoid", "FPLUT", "FusedFFN"} & set(ops(out)), ops(out)
    q, _ = run_passes(m, ["weights4"], weights=fmt)  # the same quantised bytes, unfused
    for feeds in feeds_list(arch, dtype):
        ref = run(m, feeds, ours=False)[0]
        expect = run(q, feeds)[0]
        got = run(out, feeds)[0]
        assert rel(got, expect) <= (1e-4 if dtype == "fp32" else fp_tol(arch, dtype)), rel(got, expect)
        assert rel(got, ref) <= 0.5, rel(got, ref)
