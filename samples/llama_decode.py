"""End-to-end decode benchmark: a LLaMA-style decoder (transformers' LlamaForCausalLM, random weights) exported
as ONE single-token decode step with a KV cache, rewritten with 4-bit weights + the fused FFN + FPLUT, and timed
against the original with ``onnx-lowbit bench``.

    python samples/llama_decode.py --device cuda --out /tmp/llama              # full size (issue 6), fp16
    python samples/llama_decode.py --device cpu --layers 2 --hidden 128 --intermediate 352 --out /tmp/tiny

Steps (each a plain call, output in --out):
  1. export   llama_decode.onnx (+ .data): inputs input_ids [1, 1] int64 and past_key_values.<i>.key / .value
              [1, kv_heads, past, head_dim]; outputs logits [1, 1, vocab] and present.<i>.key / .value
              [1, kv_heads, past + 1, head_dim]. Static shapes (CUDA graphs need them; a decode step with a fixed
              cache length is the usual benchmark unit). TorchScript exporter, opset 17, weights as external data.
              The step is a thin wrapper around the model's own forward: the past tensors are put into a
              transformers DynamicCache and the updated cache is returned as the present tensors; eager attention.
  2. rewrite  ``onnx-lowbit rewrite llama_decode.onnx llama_decode.<weights>.onnx --weights nf4 [--passes ...]``
              (the merge of q/k/v is on by default; --no-merge: ``--no-merge-siblings``)
              (default passes: fplut, weights4, ffn, merge, rotary, rotarykv, gru; kvattention and rmsnorm are opt-in).
  3. bench    ``onnx-lowbit bench`` on both: --device cpu: CPU EP; --device cuda: CUDA EP without and with
              --cuda-graph (--no-graph: without only). Tables on stdout, bench-*.png/.json in --out.
  (--compare) more rewrites of the same original, timed in the same bench runs (one column each):
              nf4 / fp4 / awq: our ops with those weights (the default passes, as step 2); ort-nbits / ort-bnb4:
              onnxruntime's own MatMulNBits (int4, AWQ group 128) / MatMulBnb4 (NF4) from ``--target ort``
              (passes weights4 and merge only, so the model runs on stock onnxruntime): the side-by-side of our
              ops against onnxruntime's at the whole-model level. nf4-no-rotary / nf4-no-rotarykv: the
              default passes up to merge / rotary (what the later ones add); nf4-kvattention / nf4-rmsnorm: the
              default passes and the opt-in kvattention / rmsnorm.
  (--reference) llama_decode.fakequant.onnx: the original with the same 4-bit weights dequantised to float (stock
              onnxruntime runs it), benched against the rewritten model into --out/reference. With random
              weights the 4-bit rounding alone moves a 16-layer model's logits a lot (measured: max rel diff 0.69
              in PyTorch fp32 for the full size); this comparison shows what our kernels add on top of it.

--skip-export / --skip-rewrite reuse the files already in --out (a long run split over several calls).
Everything runs with ``sys.executable``; the repository root goes on PYTHONPATH, so a source checkout needs no
install. Needs torch and transformers (>= 4.56 for the DynamicCache layers API; tested with 5.23), onnx,
onnxruntime(-gpu) and onnx-lowbit's own dependencies.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "llama_decode.onnx"
# --compare: name -> the rewrite's options (None: our ops with those weights, default passes, like the main rewrite)
COMPARE = {"nf4": None, "fp4": None, "awq": None,
           "ort-nbits": ["--weights", "awq", "--target", "ort", "--passes", "weights4,merge"],
           "ort-bnb4": ["--weights", "nf4", "--target", "ort", "--passes", "weights4,merge"],
           "nf4-no-rotary": ["--weights", "nf4", "--passes", "fplut,weights4,ffn,merge"],
           "nf4-no-rotarykv": ["--weights", "nf4", "--passes", "fplut,weights4,ffn,merge,rotary"],
           "nf4-kvattention": ["--weights", "nf4", "--passes", "fplut,weights4,ffn,merge,rotary,rotarykv,kvattention"],
           "nf4-rmsnorm": ["--weights", "nf4", "--passes", "fplut,weights4,ffn,merge,rotary,rotarykv,rmsnorm"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16, help="key/value heads (< --heads: grouped-query attention)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--past", type=int, default=128, help="KV cache length the step reads (default 128)")
    p.add_argument("--dtype", choices=["fp16", "fp32"], help="default: fp16 on cuda, fp32 on cpu (onnxruntime's "
                                                            "CPU EP lacks fp16 kernels for several ops)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                   help="where the model is built/traced and which execution provider bench uses (default cuda)")
    p.add_argument("--out", default="llama_decode_out", help="output directory (default ./llama_decode_out)")
    p.add_argument("--skip-export", action="store_true", help="reuse --out/llama_decode.onnx")
    p.add_argument("--skip-rewrite", action="store_true", help="reuse --out/llama_decode.<weights>.onnx")
    p.add_argument("--weights", choices=["nf4", "fp4", "awq"], default="nf4")
    p.add_argument("--passes", help="passes for the rewrite, comma-separated (default: the default passes)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--no-graph", action="store_true", help="cuda: skip the --cuda-graph bench")
    p.add_argument("--no-bench", action="store_true", help="stop after the rewrite")
    p.add_argument("--no-merge", action="store_true",
                   help="rewrite with --no-merge-siblings (q/k/v stay three products; the merge is on by default)")
    p.add_argument("--reference", action="store_true",
                   help="also write llama_decode.fakequant.onnx (the original with each 4-bit weight replaced by "
                        "its dequantised value; nf4/fp4) and bench it against the rewritten model into "
                        "--out/reference: their outputs differ by kernel arithmetic only, not by 4-bit rounding")
    p.add_argument("--compare", default="", metavar="LIST",
                   help="comma-separated more rewrites benched in the same runs: " + ", ".join(COMPARE))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error(f"--hidden ({a.hidden}) must be a multiple of --heads ({a.heads}), and --heads of --kv-heads "
                f"({a.kv_heads})")
    a.dtype = a.dtype or ("fp16" if a.device == "cuda" else "fp32")
    a.compare = [c for c in a.compare.split(",") if c]
    bad = [c for c in a.compare if c not in COMPARE]
    if bad:
        p.error(f"--compare: unknown {', '.join(bad)}; choose from {', '.join(COMPARE)}")
    return a


def build_model(a):
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                      max_position_embeddings=max(2048, a.past + 1), tie_word_embeddings=False)
    cfg._attn_implementation = "eager"   # plain MatMul/Softmax in the graph; sdpa's export path varies by version
    torch.manual_seed(a.seed)
    major = int(transformers.__version__.split(".")[0])
    _DTYPE_KW = "dtype" if major >= 5 else "torch_dtype"  # noqa: N806 - renamed in transformers 5
    dtype = torch.float16 if a.dtype == "fp16" else torch.float32
    with torch.device(a.device):
        model = LlamaForCausalLM._from_config(cfg, **{_DTYPE_KW: dtype})
    return model.eval()


def make_step(model):
    import torch
    from transformers.cache_utils import DynamicCache

    class DecodeStep(torch.nn.Module):
        """(input_ids, k0, v0, k1, v1, ...) -> (logits, k0', v0', ...): one token through the model's forward."""

        def __init__(self, m):
            super().__init__()
            self.m, self.n = m, m.config.num_hidden_layers

        def forward(self, input_ids, *past):
            cache = DynamicCache(config=self.m.config)
            for i in range(self.n):
                cache.update(past[2 * i], past[2 * i + 1], i)
            start = past[0].shape[2]
            pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            out = self.m(input_ids=input_ids, past_key_values=cache, position_ids=pos, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return DecodeStep(model)


def io_names(layers):
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return ["input_ids"] + past, ["logits"] + [n.replace("past_key_values", "present") for n in past]


def example_inputs(a, model):
    import torch
    head_dim = a.hidden // a.heads
    g = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, a.vocab, (1, 1), generator=g).to(a.device)
    past = [torch.randn(1, a.kv_heads, a.past, head_dim, generator=g).to(a.device, model.dtype)
            for _ in range(2 * a.layers)]
    return ids, past


def export(a, path):
    """Exports the decode step to ``path`` with all weights in one external data file ``<name>.data``."""
    import onnx
    import torch
    t = time.time()
    model = build_model(a)
    step = make_step(model)
    ids, past = example_inputs(a, model)
    ins, outs = io_names(a.layers)
    tmp = os.path.join(os.path.dirname(path), ".export")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with torch.no_grad():
            torch.onnx.export(step, (ids, *past), os.path.join(tmp, NAME), input_names=ins, output_names=outs,
                              opset_version=17, dynamo=False, do_constant_folding=True)
        del step, model, past
        m = onnx.load(os.path.join(tmp, NAME))    # the exporter may spread > 2 GB over one file per tensor
        for f in (path, path + ".data"):
            if os.path.exists(f):
                os.unlink(f)
        onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=os.path.basename(path) + ".data", size_threshold=1024)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = os.path.getsize(path) + os.path.getsize(path + ".data")
    print(f"exported {path} (+ .data, {size / 2 ** 20:.1f} MiB) in {time.time() - t:.1f} s: {a.layers} layers, "
          f"hidden {a.hidden}, intermediate {a.intermediate}, heads {a.heads}/{a.kv_heads}, vocab {a.vocab}, "
          f"past {a.past}, {a.dtype}", flush=True)


def fake_quant(rewritten_w4, dst):
    """``dst``: the model ``rewritten_w4`` (weights4 only) with every MatMulNF4 replaced by MatMul on its
    dequantised weight (onnx_lowbit.nf4.dequantize, in the model's float type) plus Add for a bias: the 4-bit
    weights' accuracy without our kernels, in stock onnxruntime."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import numpy as np
    from onnx import helper, numpy_helper
    from onnx_lowbit import model_io, nf4
    model = model_io.load(rewritten_w4)
    dtype = helper.tensor_dtype_to_np_dtype(model.graph.input[1].type.tensor_type.elem_type)
    inits = {t.name: t for t in model.graph.initializer}
    nodes, used = [], set()
    for n in model.graph.node:
        if n.op_type != "MatMulNF4":
            nodes.append(n)
            continue
        at = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        q, absmax = (numpy_helper.to_array(inits[x]) for x in n.input[1:3])
        used.update(n.input[1:3])
        w = nf4.dequantize(q, absmax, at["quant_type"].decode(), at["block_size"], at["K"], at["N"], dtype)
        model.graph.initializer.append(numpy_helper.from_array(w, n.name + "_W"))
        mm = n.output[0] + ("_mm" if len(n.input) > 3 and n.input[3] else "")
        nodes.append(helper.make_node("MatMul", [n.input[0], n.name + "_W"], [mm], name=n.name))
        if mm != n.output[0]:
            nodes.append(helper.make_node("Add", [mm, n.input[3]], [n.output[0]], name=n.name + "_bias"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    keep = [t for t in model.graph.initializer if t.name not in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    model_io.save(model, dst, external_data=True)
    print(f"wrote {dst} (4-bit weights dequantised to {np.dtype(dtype)})", flush=True)


def cli(*args):
    """Runs ``onnx-lowbit`` (this checkout's) in a subprocess; exits with its status on failure."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "onnx_lowbit.cli", *args]
    print("$ onnx-lowbit " + " ".join(args), flush=True)
    t = time.time()
    rc = subprocess.run(cmd, env=env).returncode
    print(f"  ({time.time() - t:.1f} s)", flush=True)
    if rc:
        sys.exit(rc)


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    original = os.path.join(a.out, NAME)
    rewritten = os.path.join(a.out, NAME.replace(".onnx", f".{a.weights}.onnx"))
    for skip, path, flag in ((a.skip_export, original, "--skip-export"),
                             (a.skip_rewrite, rewritten, "--skip-rewrite")):
        if skip and not os.path.exists(path):
            print(f"llama_decode: {flag} but {path} does not exist", file=sys.stderr)
            return 2
    if not a.skip_export:
        export(a, original)
    ours = [*(["--passes", a.passes] if a.passes else []), *(["--no-merge-siblings"] if a.no_merge else [])]
    if not a.skip_rewrite:
        cli("rewrite", original, rewritten, "--weights", a.weights, *ours)
    extra = []
    for c in a.compare:
        path = os.path.join(a.out, NAME.replace(".onnx", f".{c}.onnx"))
        if path == rewritten:
            continue
        if not (a.skip_rewrite and os.path.exists(path)):
            opts = (COMPARE[c] + (["--no-merge-siblings"] if a.no_merge else [])) if COMPARE[c] else \
                ["--weights", c, *ours]
            cli("rewrite", original, path, *opts)
        extra.append(path)
    reference = os.path.join(a.out, NAME.replace(".onnx", ".fakequant.onnx"))
    if a.reference:
        if a.weights == "awq":
            print("llama_decode: --reference handles nf4/fp4 weights only", file=sys.stderr)
            return 2
        w4 = os.path.join(a.out, NAME.replace(".onnx", f".{a.weights}-weights4.onnx"))
        cli("rewrite", original, w4, "--weights", a.weights, "--passes", "weights4")
        fake_quant(w4, reference)
        for f in (w4, w4 + ".data"):
            if os.path.exists(f):
                os.unlink(f)
    if a.no_bench:
        return 0
    common = ["--warmup", str(a.warmup), "--runs", str(a.runs)]
    provider = ["--provider", a.device]
    cli("bench", original, rewritten, *extra, *provider, *common, "--out", a.out)
    if a.device == "cuda" and not a.no_graph:
        cli("bench", original, rewritten, *extra, *provider, "--cuda-graph", *common, "--out", a.out)
    if a.reference:
        cli("bench", reference, rewritten, *provider, *common, "--out", os.path.join(a.out, "reference"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
