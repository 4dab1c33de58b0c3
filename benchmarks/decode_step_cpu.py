"""One decode step of causal-LM exports with past (optimum's text-generation-with-past), timed on the CPU: the
original and its rewrites side by side (issue 34).

    python benchmarks/decode_step_cpu.py ORIGINAL.onnx REWRITTEN.onnx [...] [--past 128] [--threads 1]

With ``--tokens FILE.npy`` (token ids) the past is real: the original runs the first ``--past`` tokens (an empty
past), its present.* become every model's past and the next token is the step's input. Without it the inputs are
made up as ``--verify`` makes them (onnx_lowbit/feeds.py: random past values, whose logits say little about
accuracy). Models holding onnx_lowbit ops run with our library registered. All sessions in one process, alternating
rounds; each figure is the median over rounds of the per-call median of a batch. Clock: one intra-op thread runs
every node on the calling thread, so time.thread_time (thread CPU time, which other jobs on a shared machine do not
disturb); more threads: time.perf_counter (wall). The last column: relative L2 distance of the step's logits from
the original's.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kernels import words  # noqa: E402
from ffn4_cpu import _clock, timed  # noqa: E402
from timing import print_table  # noqa: E402


def _session(path, threads):
    import onnx
    import onnxruntime as ort

    import onnx_lowbit
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    head = onnx.load(path, load_external_data=False)
    if any(n.domain == "onnx_lowbit" for n in head.graph.node):
        return onnx_lowbit.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _real_past(original, ids, past, feeds, threads):
    """The step's feeds with the original's own past: it runs ids[:past] from an empty past; ids[past] is the step's
    token."""
    sess = _session(original, threads)
    pre = {}
    for k, v in feeds.items():
        if k == "input_ids":
            pre[k] = ids[None, :past]
        elif k == "attention_mask":
            pre[k] = np.ones((1, past), v.dtype)
        elif k == "position_ids":
            pre[k] = np.arange(past, dtype=v.dtype)[None]
        else:   # past_key_values.*: empty
            pre[k] = np.zeros(v.shape[:2] + (0,) + v.shape[3:], v.dtype)
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, pre)))
    out = dict(feeds)
    out["input_ids"] = ids[None, past:past + 1]
    out["attention_mask"] = np.ones((1, past + 1), feeds["attention_mask"].dtype)
    out["position_ids"] = np.array([[past]], feeds["position_ids"].dtype)
    for k in feeds:
        if k.startswith("past_key_values."):
            out[k] = got["present." + k[len("past_key_values."):]]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="the original first, then its rewrites")
    p.add_argument("--past", type=int, default=128, help="past tokens in the KV cache")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=5, help="calls per round and model")
    p.add_argument("--tokens", metavar="FILE.npy", help="token ids: a real past (the original's, on the first --past)")
    a = p.parse_args(argv)
    import onnx

    import onnx_lowbit.custom_ops  # noqa: F401  (sets OMP_WAIT_POLICY before Numba's pool starts)
    from onnx_lowbit import feeds as feeds_mod
    head = onnx.load(a.models[0], load_external_data=False)
    dims = {"batch_size": 1, "sequence_length": 1, "past_sequence_length": a.past}
    feeds, values, _ = feeds_mod.make_feeds(head, dims=dims)
    del head
    if a.tokens:
        feeds = _real_past(a.models[0], np.load(a.tokens).reshape(-1).astype(np.int64), a.past, feeds, a.threads)
    print("inputs: " + ", ".join(f"{k} {list(v.shape)}" for k, v in list(feeds.items())[:4]) + ", ...",
          file=sys.stderr)
    clock, cname = _clock(a.threads)
    runs, logits = {}, {}
    for path in a.models:
        sess = _session(path, a.threads)
        names = {i.name for i in sess.get_inputs()}
        f = {k: v for k, v in feeds.items() if k in names}
        logits[path] = sess.run(["logits"], f)[0]
        runs[path] = (lambda s=sess, f=f: s.run(["logits"], f))
    got = timed(runs, a.rounds, clock, a.batch)
    ref = logits[a.models[0]]
    rows = []
    for path in a.models:
        err = float(np.linalg.norm(logits[path] - ref) / np.linalg.norm(ref))
        rows.append([os.path.basename(path), a.threads, cname, a.past, f"{got[path] / 1e3:.2f}",
                     "-" if path == a.models[0] else words(got[path], got[a.models[0]]), f"{err:.4f}"])
    print_table(["model", "threads", "clock", "past", "decode step ms", "vs original", "logits rel-L2"], rows,
                numeric=[1, 3, 4, 6])


if __name__ == "__main__":
    main()
