"""Greedy generation with optimum's ``ORTModelForCausalLM`` on an optimum export and its onnx-lowbit rewrites.

optimum builds its onnxruntime session from the ``session_options`` it is given, so our ops need one line:
``onnx_lowbit.register(so)`` on that SessionOptions (without it onnxruntime refuses the rewritten model:
"onnx_lowbit:RotaryKV(-1) is not a registered function/op")::

    so = onnxruntime.SessionOptions(); onnx_lowbit.register(so)
    model = ORTModelForCausalLM.from_pretrained(folder, file_name="model.lowbit.onnx", session_options=so)

``python samples/optimum_generate.py FOLDER model.onnx model.lowbit.onnx ... [--new-tokens 32] [--prompt TEXT]...``
loads each file of FOLDER (an ``optimum-cli export onnx --task text-generation-with-past`` folder: config.json and
the tokenizer beside the .onnx files) in ORTModelForCausalLM, generates greedily from each prompt and prints, per
rewrite, how many of the new tokens equal the first file's and the first position where they part, plus the
seconds each took. Exit status 1 when ``--expect-same`` is given and a rewrite's tokens differ.
Needs optimum-onnx (``pip install "optimum-onnx[onnxruntime]"``; 0.1.0 pins transformers < 4.58: see
docs/pipelines.md for the separate environment and the rope pitfall).
"""
from __future__ import annotations

import argparse
import sys
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def load(folder: str, file_name: str):
    """ORTModelForCausalLM for ``folder/file_name`` on the CPU, with the onnx-lowbit ops registered."""
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForCausalLM

    import onnx_lowbit
    so = ort.SessionOptions()
    onnx_lowbit.register(so)
    return ORTModelForCausalLM.from_pretrained(folder, file_name=file_name, session_options=so,
                                               provider="CPUExecutionProvider")


def greedy(model, tokenizer, prompt: str, new_tokens: int) -> list:
    """The ``new_tokens`` token ids greedy decoding appends to ``prompt`` (no early stop at end-of-sequence)."""
    enc = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         num_beams=1, pad_token_id=tokenizer.eos_token_id)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def first_difference(a: list, b: list) -> int | None:
    """The first position where the token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="optimum's export folder (config.json, tokenizer, .onnx files)")
    p.add_argument("files", nargs="+", help="the .onnx files in FOLDER; the first is the reference")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt", action="append", help=f"repeatable; default: {PROMPTS}")
    p.add_argument("--expect-same", action="store_true", help="exit 1 when a rewrite's tokens differ")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.folder)
    prompts = a.prompt or PROMPTS
    ref = None
    differ = False
    for name in a.files:
        t0 = time.perf_counter()
        model = load(a.folder, name)
        t1 = time.perf_counter()
        toks = [greedy(model, tok, q, a.new_tokens) for q in prompts]
        t2 = time.perf_counter()
        print(f"{name}: session {t1 - t0:.1f} s, {len(prompts)} x {a.new_tokens} new tokens {t2 - t1:.1f} s")
        if ref is None:
            ref = toks
            for q, t in zip(prompts, toks):
                print(f"  {q!r} -> {tok.decode(t)!r}")
            continue
        for q, t, r in zip(prompts, toks, ref):
            d = first_difference(t, r)
            same = sum(x == y for x, y in zip(t, r))
            differ |= d is not None
            where = "identical" if d is None else f"first difference at new token {d}: {tok.decode(t)!r}"
            print(f"  {q!r}: {same}/{len(r)} tokens equal, {where}")
    return 1 if a.expect_same and differ else 0


if __name__ == "__main__":
    sys.exit(main())
