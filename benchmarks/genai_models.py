"""Build onnxruntime-genai model folders of a random-weight LLaMA-style config for benchmarks/genai_loop.py (issue
32): the Hugging Face folder (transformers, random weights, a WordLevel tokenizer from `tokenizers`), then genai's
model builder once per precision, then `onnx-lowbit genai` on each (our fused FFN ops; int4: the builder's
MatMulNBits converted without loss).

    python benchmarks/genai_models.py OUT_DIR [--precisions fp16,int4] [--provider cuda] [--hidden 2048]
        [--layers 16] [--inter 8192] [--heads 16] [--vocab 4096] [--attention] [--variants lowbit,ca,default]

Defaults are samples/llama_decode.py's config (the one ../shared/device/genai_anchor.py measured genai on).
Writes OUT_DIR/hf, OUT_DIR/genai_<prec> and OUT_DIR/genai_<prec>.lowbit (`--passes matmulnbits,ffn`: the products
only); with --attention also genai_<prec>.ca (the cacheattention pass too) and genai_<prec>.default (no --passes:
the provider's default, on CUDA genai_config.CUDA_PASSES); prints each step's time and the op counts.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time


def hf_folder(path, a):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    if os.path.exists(os.path.join(path, "config.json")):
        return
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=a.vocab,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).half()
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(a.vocab)}
    vocab["<unk>"] = 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t1", eos_token="t2").save_pretrained(path)


def ops(folder):
    import onnx
    m = onnx.load(os.path.join(folder, "model.onnx"), load_external_data=False)
    return dict(collections.Counter(n.op_type for n in m.graph.node).most_common(12))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--precisions", default="fp16,int4")
    ap.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--attention", action="store_true",
                    help="also OUT_DIR/genai_<prec>.ca: the rewrite with the cacheattention pass too "
                         "(GroupQueryAttention -> CacheAttention)")
    ap.add_argument("--variants", default=None,
                    help="which rewrites to write, comma-separated from lowbit, ca, default, ortnorm ('' for none; "
                         "ortnorm: the CUDA default's passes named explicitly); default: lowbit, with --attention "
                         "lowbit, ca, default")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    hf = os.path.join(a.out, "hf")
    t0 = time.time()
    hf_folder(hf, a)
    print(f"hf folder: {time.time() - t0:.0f} s", flush=True)
    for prec in a.precisions.split(","):
        out = os.path.join(a.out, f"genai_{prec}")
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", out, "-p", prec,
                            "-e", a.provider], capture_output=True, text=True)
        if r.returncode:
            print(f"build {prec} failed (rc {r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}")
            return 1
        print(f"build {prec}: {time.time() - t0:.0f} s; ops {ops(out)}", flush=True)
        variants = [(".lowbit", ["--passes", "matmulnbits,ffn"])] + (
            [(".ca", ["--passes", "matmulnbits,ffn,cacheattention"]), (".default", [])] if a.attention else [])
        if a.variants is not None:
            every = {".lowbit": ["--passes", "matmulnbits,ffn"], ".ca": ["--passes", "matmulnbits,ffn,cacheattention"],
                     ".default": [], ".ortnorm": ["--passes", "matmulnbits,ffn,cacheattention,ortnorm"]}
            variants = [("." + v, every["." + v]) for v in a.variants.split(",") if v]
        for suffix, extra in variants:
            t0 = time.time()
            cmd = [sys.executable, "-m", "onnx_lowbit.cli", "genai", out, out + suffix, "--provider", a.provider,
                   *extra]
            r = subprocess.run(cmd, capture_output=True, text=True)
            print(r.stdout[-1500:], r.stderr[-1500:])
            if r.returncode:
                print(f"onnx-lowbit genai {prec} {' '.join(extra)} failed (rc {r.returncode})")
                return 1
            print(f"rewrite {prec}{suffix}: {time.time() - t0:.0f} s; ops {ops(out + suffix)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
