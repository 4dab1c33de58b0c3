"""The generation loop of onnxruntime-genai model folders, side by side: genai's Generator, greedy, a fixed random
prompt of --prompt tokens and --new new tokens (min_length = max_length, so no early end), the folders run in
turn round after round (alternating, so drift of the machine hits all alike), one table at the end.

    prefill ms      append_tokens(prompt) + the first generate_next_token (the prompt's forward pass and the
                    first token), median over the rounds (the JSON has each round's, and prefill_ms_min)
    decode ms/tok   each later generate_next_token (one token's forward pass and its selection) timed alone:
                    median and p90 over all tokens of all rounds
    tok/s           1000 / the decode median
    tokens          whether the folder's greedy tokens equal the first folder's (same prompt)

Folders rewritten by onnx_lowbit.genai_config.rewrite_folder name our shim in genai_config.json; the script calls
genai_config.prepare on each before loading any model (the shim genai dlopens must be the file this process's
bridge loaded). CUDA graphs: with a "cuda" provider in a folder's genai_config.json, enable_cuda_graph is set to 1
on the loaded config (not in the file) unless --no-cuda-graph; CPU folders run as configured.

    python benchmarks/genai_loop.py FOLDER [FOLDER ...] [--prompt 128[,1024...]] [--new 128] [--rounds 3]
                                    [--warmup 1] [--no-cuda-graph] [--json out.json]

Several prompt lengths (comma-separated) run one after another on the models loaded once (a table each; the JSON
holds one entry per folder and length, with its "prompt").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import print_table, write_json  # noqa: E402


def load(folder, cuda_graph: bool):
    import onnxruntime_genai as og

    from onnx_lowbit import genai_config
    config = og.Config(os.fspath(folder))
    graph = False
    if cuda_graph and genai_config.on_cuda(folder):
        config.set_provider_option("cuda", "enable_cuda_graph", "1")
        graph = True
    return og.Model(config), graph


def one_run(model, prompt: np.ndarray, new: int):
    """(prefill ms, [decode ms per later token], tokens)."""
    import onnxruntime_genai as og
    params = og.GeneratorParams(model)
    total = int(prompt.size) + int(new)
    params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=1)
    g = og.Generator(model, params)
    t0 = time.perf_counter()
    g.append_tokens(prompt.reshape(1, -1))
    g.generate_next_token()
    prefill = (time.perf_counter() - t0) * 1e3
    decode = []
    while not g.is_done():
        t = time.perf_counter()
        g.generate_next_token()
        decode.append((time.perf_counter() - t) * 1e3)
    tokens = [int(t) for t in g.get_sequence(0)]
    del g
    return prefill, decode, tokens


def run(folders, prompt_len=128, new=128, rounds=3, warmup=1, cuda_graph=True, seed=0):
    """Loads every folder, runs the loop alternating; returns one result dict per folder (``prompt_len`` a list:
    per length in turn, on the same loaded models, the lists concatenated)."""
    from onnx_lowbit import genai_config
    for f in folders:
        genai_config.prepare(f)
    models = [load(f, cuda_graph) for f in folders]
    vocab = min(int(genai_config.read_config(f)["model"].get("vocab_size", 1000)) for f in folders)
    lengths = prompt_len if isinstance(prompt_len, (list, tuple)) else [prompt_len]
    return [r for n in lengths for r in _loop(folders, models, vocab, int(n), new, rounds, warmup, seed)]


def _loop(folders, models, vocab, prompt_len, new, rounds, warmup, seed):
    prompt = np.random.default_rng(seed).integers(3, max(vocab, 4), prompt_len).astype(np.int32)
    res = [dict(folder=os.fspath(f), prompt=prompt_len, cuda_graph=g, prefill=[], decode=[], tokens=None)
           for f, (_, g) in zip(folders, models)]
    for r in range(warmup + rounds):
        for (model, _), out in zip(models, res):
            prefill, decode, tokens = one_run(model, prompt, new)
            out["tokens"] = tokens
            if r >= warmup:
                out["prefill"].append(prefill)
                out["decode"].extend(decode)
    for out in res:
        d = out["decode"]
        out["prefill_ms"] = statistics.median(out["prefill"])
        out["prefill_ms_min"] = min(out["prefill"])
        out["decode_ms_median"] = statistics.median(d) if d else float("nan")
        out["decode_ms_p90"] = float(np.percentile(d, 90)) if d else float("nan")
        out["tokens_per_s"] = 1e3 / out["decode_ms_median"] if d else float("nan")
        out["same_tokens"] = out["tokens"] == res[0]["tokens"]
    return res


def table(res):
    base = res[0]["decode_ms_median"]
    rows = [[os.path.basename(os.path.normpath(o["folder"])) + (" (CUDA graph)" if o["cuda_graph"] else ""),
             f"{o['prefill_ms']:.2f}", f"{o['decode_ms_median']:.3f}", f"{o['decode_ms_p90']:.3f}",
             f"{o['tokens_per_s']:.1f}", f"{base / o['decode_ms_median']:.2f}x",
             "=" if o["same_tokens"] else "differ"] for o in res]
    print_table(["folder", "prefill ms", "decode ms/tok median", "decode p90", "tok/s", "vs first", "tokens"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--prompt", default="128", help="prompt tokens (default 128; comma-separated: each in turn)")
    ap.add_argument("--new", type=int, default=128, help="new tokens (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per folder (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--no-cuda-graph", action="store_true", help="leave enable_cuda_graph as the folder has it")
    ap.add_argument("--json", default="", help="write the figures (and tokens) to this file")
    a = ap.parse_args(argv)
    try:
        lengths = [int(v) for v in a.prompt.split(",")]
    except ValueError:
        ap.error(f"--prompt takes comma-separated token counts, got {a.prompt!r}")
    if min(lengths) < 1 or a.new < 2 or a.rounds < 1 or a.warmup < 0:
        ap.error("--prompt >= 1, --new >= 2, --rounds >= 1, --warmup >= 0")
    res = run(a.folders, lengths, a.new, a.rounds, a.warmup, not a.no_cuda_graph)
    for n in lengths:
        print(f"onnxruntime-genai generation loop: prompt {n}, {a.new} new tokens, greedy, {a.rounds} rounds "
              f"(+{a.warmup} warm-up), folders alternating")
        table([r for r in res if r["prompt"] == n])
    write_json(a.json, res)
    return res


if __name__ == "__main__":
    main()
