"""A tiny random LLaMA exported as optimum exports causal LMs (samples/export_causal_lm.py: input_ids,
attention_mask [batch, past + seq], position_ids, past KV; tied embedding / lm_head, vocabulary 1024):
``rewrite --verify`` runs it on consistent made-up inputs (no "Gather indices out of bounds"), the tied lm_head
stays in float by default (no second copy of the table) and ``--lm-head 4bit`` quantises it, and ``eval-ppl``
scores the original and its rewrites on a text (the original's perplexity equals PyTorch's)."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from onnx_lowbit import evalppl  # noqa: E402
from onnx_lowbit.bench import weight_bytes  # noqa: E402
from onnx_lowbit.errors import LowbitError  # noqa: E402
from onnx_lowbit.samples import export_causal_lm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("The quick brown fox jumps over the lazy dog. A small model reads this text twice, and its rewrites read "
        "it too; perplexity tells how surprised each one is by the next character.\n") * 3


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("llm")
    model = export_causal_lm.tiny_llama(layers=2, hidden=64, intermediate=176, vocab=1024, tie=True)
    path = d / "llm.onnx"
    export_causal_lm.export(model, str(path))
    return d, path, model


def test_verify_made_up_inputs_on_past_kv_export(llm):
    d, src, _ = llm
    out = d / "plain.onnx"
    rc, so, err = run_cli("rewrite", str(src), str(out), "--verify", "--dim", "sequence_length=5")
    assert rc == 0, so + err
    assert "attention_mask [1, 13]" in so and "past_sequence_length=8" in so  # 8 past + 5 new tokens
    assert "logits" in so and "100.00%" in so and "FAIL" not in so and "out of bounds" not in err


def _tables(path):
    """(dtype, shape) of the initializers shaped like the 1024 x 64 table or its transpose."""
    m = onnx.load(str(path))
    return sorted((onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name, tuple(t.dims))
                  for t in m.graph.initializer if sorted(t.dims) == [64, 1024])


def test_lm_head_kept_and_quantised(llm):
    d, src, _ = llm
    # TorchScript folds lm_head's Transpose of the tied table into a second initializer: two float copies
    assert _tables(src) == [("float32", (64, 1024)), ("float32", (1024, 64))]
    out = {k: d / f"head_{k}.onnx" for k in ("fp16", "float", "4bit")}
    rc, so, err = run_cli("rewrite", str(src), str(out["fp16"]), "--weights", "nf4", "--report", "--verify")
    assert rc == 0, so + err
    flat = " ".join(so.replace("|", " ").split())    # the report's table wraps its reason column
    assert "output head kept in float" in flat and "tied to the embedding table" in flat and "fp16" in flat
    assert _tables(out["fp16"]) == [("float16", (1024, 64))]        # one table, for the embedding and the head
    rc, so, err = run_cli("rewrite", str(src), str(out["float"]), "--weights", "nf4", "--lm-head", "float")
    assert rc == 0 and _tables(out["float"]) == [("float32", (1024, 64))], so + err
    rc, so, err = run_cli("rewrite", str(src), str(out["4bit"]), "--weights", "nf4", "--lm-head", "4bit", "--verify")
    assert rc == 0 and "output head kept" not in so, so + err
    assert _tables(out["4bit"]) == [("float32", (1024, 64))]        # the embedding's; the head is 4-bit
    assert "MatMulNF4" in [n.op_type for n in onnx.load(str(out["4bit"])).graph.node]
    sizes = {k: weight_bytes(onnx.load(str(p))) for k, p in out.items()}
    assert sizes["fp16"] < sizes["float"] < sizes["4bit"] < weight_bytes(onnx.load(str(src)))


def test_eval_ppl(llm):
    d, src, model = llm
    text = d / "text.txt"
    text.write_text(TEXT)
    nf4 = d / "ppl_nf4.onnx"
    assert run_cli("rewrite", str(src), str(nf4), "--weights", "nf4")[0] == 0
    js = d / "ppl.json"
    rc, so, err = run_cli("eval-ppl", str(src), str(src), str(nf4), "--text", str(text), "--tokenizer", "bytes",
                          "--window", "64", "--json", str(js))
    assert rc == 0, so + err
    res = json.loads(js.read_text())
    ids = np.frombuffer(TEXT.encode(), np.uint8).astype(np.int64)
    windows = [ids[i:i + 64] for i in range(0, ids.size, 64)]
    windows = [w for w in windows if w.size >= 2]
    assert res["tokens"] == sum(w.size - 1 for w in windows) and res["windows"] == len(windows)
    nll = []
    with torch.no_grad():
        for w in windows:
            logits = model(torch.tensor(w[None])).logits[0, :-1].double()
            nll.append(-torch.log_softmax(logits, -1)[torch.arange(w.size - 1), torch.tensor(w[1:])].numpy())
    ppl = float(np.exp(np.concatenate(nll).mean()))
    o, same, q = res["models"]
    assert abs(o["ppl"] - ppl) < 1e-4 * ppl, (o["ppl"], ppl)
    assert same["ppl"] == o["ppl"] and same["greedy_agree"] == 1.0 and same["worse_2nats"] == 0.0
    assert np.isfinite(q["ppl"]) and 0.5 < q["greedy_agree"] <= 1.0 and q["weight_bytes"] < o["weight_bytes"]
    assert "d ppl" in so and "greedy agree" in so


def test_eval_ppl_errors(llm, tmp_path):
    d, src, _ = llm
    rc, _, err = run_cli("eval-ppl", str(src), "--text", str(tmp_path / "none.txt"), "--tokenizer", "bytes")
    assert rc == 2 and "none.txt: no such file" in err
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([5, 6, 5000]))
    rc, _, err = run_cli("eval-ppl", str(src), "--tokens", str(ids))
    assert rc == 2 and "outside the model's vocabulary of 1024" in err
    rc, _, err = run_cli("eval-ppl", os.path.join(ROOT, "samples", "gpt2_mlp.onnx"), "--tokens", str(ids))
    assert rc == 2 and "no input named input_ids" in err
    with pytest.raises(LowbitError, match="--text needs --tokenizer"):
        evalppl.tokenize(str(d / "text.txt") if (d / "text.txt").exists() else __file__, None, None)
