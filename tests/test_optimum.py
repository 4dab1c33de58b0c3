"""optimum's pipeline end to end, where optimum-onnx is installed (skipped otherwise: it pins transformers < 4.58, so
it is not in the ``test`` extra; docs/pipelines.md has the separate environment, and
test_pass_rotarykv_exports.py covers optimum's graph spelling through a TorchScript SDPA export in CI).

A tiny random LLaMA (2 layers, 4 query and 2 kv heads of 16, rope_theta 100000 as SmolLM2's) saved as a transformers
folder, exported by optimum's ``main_export`` (what ``optimum-cli export onnx --task text-generation-with-past`` runs),
rewritten by onnx-lowbit (the default passes; ``weights`` nf4 / awq), loaded by ``ORTModelForCausalLM`` with a
SessionOptions on which ``onnx_lowbit.register`` was called, generating greedily:
  * float rewrite: one RotaryKV per layer (and merge, rotary, fplut, ffn), the same 24 new tokens as optimum's own
    model of the original export and as transformers' torch model, for two prompts (batch 1);
  * nf4 / awq (every product 4-bit but the tied head): RotaryKV in every layer; the rewritten model generates 24
    tokens in optimum, and its logits there are those of a plain session of our library (random weights say
    nothing of 4-bit quality: the SmolLM2 figures in BENCHMARKS.md do).
The initializer range is 0.2 (not 0.02) so that the random model's next-token margins are far above the float
rewrite's rounding (FPLUT's fp16 SiLU, about 1e-3 relative), and greedy tokens are a fair test.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

pytest.importorskip("optimum.onnxruntime", reason="optimum-onnx not installed (docs/pipelines.md)")
torch = pytest.importorskip("torch")

import onnxruntime as ort  # noqa: E402
from optimum.onnxruntime import ORTModelForCausalLM  # noqa: E402

import onnx_lowbit  # noqa: E402

LAYERS, NEW = 2, 24
PROMPTS = [[5, 17, 99, 3, 250], [900, 42]]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """(folder with optimum's model.onnx and config.json, the torch model)."""
    from optimum.exporters.onnx import main_export
    from transformers import LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("optimum")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256, rope_theta=100000.0,
                      tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(str(root / "hf"), str(root / "onnx"), task="text-generation-with-past", do_validation=False)
    return root / "onnx", model


def load(folder, name, registered=True):
    so = ort.SessionOptions()
    if registered:
        onnx_lowbit.register(so)
    return ORTModelForCausalLM.from_pretrained(folder, file_name=name, session_options=so,
                                               provider="CPUExecutionProvider")


def greedy(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         min_new_tokens=NEW, do_sample=False, num_beams=1, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rewrite(folder, name, **options):
    report = onnx_lowbit.rewrite_file(str(folder / "model.onnx"), str(folder / name), **options)
    assert not report.skipped("rotarykv"), report.skipped("rotarykv")[0].reason
    assert len(report.rewritten("rotarykv")) == LAYERS
    return report


def test_float_rewrite_generates_the_same_tokens(export_dir):
    folder, torch_model = export_dir
    rep = rewrite(folder, "model.lowbit.onnx")
    summary = {k: v["rewritten"] for k, v in rep.summary().items() if v["rewritten"]}
    assert summary == {"fplut": LAYERS, "ffn": LAYERS, "merge": LAYERS, "rotary": 2 * LAYERS, "rotarykv": LAYERS}
    orig, ours = load(folder, "model.onnx", registered=False), load(folder, "model.lowbit.onnx")
    for prompt in PROMPTS:
        want = greedy(orig, prompt)
        with torch.no_grad():
            assert greedy(torch_model, prompt) == want     # optimum's export is the torch model (rope_theta kept)
        assert greedy(ours, prompt) == want


def test_unregistered_session_options_name_the_op(export_dir):
    folder, _ = export_dir
    if not os.path.exists(folder / "model.lowbit.onnx"):
        rewrite(folder, "model.lowbit.onnx")
    with pytest.raises(Exception, match="onnx_lowbit"):
        load(folder, "model.lowbit.onnx", registered=False)


@pytest.mark.parametrize("weights", ["nf4", "awq"])
def test_4bit_rewrite_runs_in_optimum(export_dir, weights):
    """The 4-bit rewrite in ORTModelForCausalLM: 24 greedy tokens; its prompt logits bit for bit those of a plain
    onnx_lowbit.InferenceSession fed what optimum feeds (positions 0.., an empty cache)."""
    folder, _ = export_dir
    name = f"model.{weights}.onnx"
    rep = rewrite(folder, name, weights=weights, weights_min_elements=0)
    assert len(rep.rewritten("weights4")) == 7 * LAYERS
    ours = load(folder, name)
    toks = greedy(ours, PROMPTS[0])
    assert len(toks) == NEW and all(0 <= t < 1024 for t in toks)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.numpy()
    sess = onnx_lowbit.InferenceSession(str(folder / name), providers=["CPUExecutionProvider"])
    n = len(PROMPTS[0])
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n, dtype=np.int64)[None]}
    for i in sess.get_inputs()[3:]:
        feeds[i.name] = np.zeros((1, 2, 0, 16), np.float32)
    want = sess.run(["logits"], feeds)[0]
    assert got.shape == want.shape and np.array_equal(got, want)
