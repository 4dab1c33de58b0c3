"""``onnx-lowbit eval-ppl ORIGINAL REWRITTEN... --text FILE --tokenizer DIR``: perplexity and greedy-token agreement
of a causal LM and its rewrites on a text, so that a user can judge a quantised model before deploying it.
Application layer (it runs sessions with our ops registered, through api.py).

The models take ``input_ids`` [batch, sequence] and optionally ``attention_mask`` [batch, past + sequence],
``position_ids`` [batch, sequence] and a KV cache (``past_key_values.<i>.key`` / ``.value``, rank 4, as optimum and
samples/export_causal_lm.py export them; fed empty: past length 0) and give ``logits`` [batch, sequence, vocab]
(the first output when none is named so). The text is tokenized once and cut into windows of ``window`` tokens
(the last one shorter; ``max_tokens`` caps the total); every model sees the same windows. In each window token t
is predicted from tokens 0..t-1 of the window, so all models are scored on the same predictions:
  ppl           exp(mean negative log-likelihood of the actual next tokens)
  greedy agree  fraction of positions where a rewrite's arg-max token equals the original's
  > 2 nats      fraction of positions where a rewrite's log-likelihood of the actual token is more than 2 nats
                below the original's (the heavy tail that a mean hides)
Tokenizers: a transformers folder or a .gguf file (``AutoTokenizer``), or ``bytes`` (the UTF-8 bytes as token ids,
for models with a vocabulary of at least 256: tests, byte-level models). ``tokens`` (an .npy of ids) skips the
tokenizer.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field

import numpy as np
from onnx import helper

from . import model_io
from .bench import weight_bytes
from .errors import LowbitError
from .feeds import index_ranges

PAST = re.compile(r"past|cache", re.IGNORECASE)
DEFAULT_WINDOW = 512


@dataclass
class ModelScore:
    path: str
    weight_bytes: int
    ppl: float
    nll: float                     # mean negative log-likelihood (nats per token)
    greedy_agree: float | None = None   # vs the original (None for the original itself)
    worse_2nats: float | None = None
    tokens: int = 0


@dataclass
class EvalResult:
    tokens: int
    windows: int
    window: int
    models: list = field(default_factory=list)

    def to_dict(self):
        return asdict(self)


def tokenize(text_path: str | None, tokenizer: str | None, tokens_path: str | None) -> np.ndarray:
    """The token ids of the text (int64 [T])."""
    if tokens_path:
        if not os.path.isfile(tokens_path):
            raise LowbitError(f"{tokens_path}: no such file (--tokens)")
        try:
            ids = np.load(tokens_path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise LowbitError(f"{tokens_path}: not a readable .npy array (--tokens): {type(e).__name__}") from None
        if ids.dtype.kind not in "iu" or ids.size < 2:
            raise LowbitError(f"{tokens_path}: expected at least 2 integer token ids, got {ids.dtype} "
                              f"{list(ids.shape)} (--tokens)")
        return ids.reshape(-1).astype(np.int64)
    if not text_path:
        raise LowbitError("give --text FILE (with --tokenizer) or --tokens FILE.npy")
    if not os.path.isfile(text_path):
        raise LowbitError(f"{text_path}: no such file (--text)")
    with open(text_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not tokenizer:
        raise LowbitError("--text needs --tokenizer (a transformers folder, a .gguf file, or 'bytes')")
    if tokenizer == "bytes":
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    if not os.path.exists(tokenizer):
        raise LowbitError(f"{tokenizer}: no such tokenizer folder or file (--tokenizer)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise LowbitError("--tokenizer DIR needs the transformers package (pip install transformers); or give "
                          "--tokens FILE.npy") from None
    try:
        if tokenizer.endswith(".gguf"):
            tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(tokenizer)),
                                                gguf_file=os.path.basename(tokenizer))
        else:
            tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise LowbitError(f"{tokenizer}: transformers could not load a tokenizer from it ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    return np.asarray(tok(text)["input_ids"], np.int64)


class _Runner:
    """One model's session and how to feed it a window."""

    def __init__(self, path: str, session_factory):
        self.path = path
        head = model_io.load(path, load_external_data=False)
        inits = {i.name for i in head.graph.initializer}
        self.inputs = {}
        for vi in head.graph.input:
            if vi.name in inits:
                continue
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in vi.type.tensor_type.shape.dim]
            self.inputs[vi.name] = (vi.type.tensor_type.elem_type, dims)
        if "input_ids" not in self.inputs:
            raise LowbitError(f"{path}: no input named input_ids; eval-ppl runs causal LMs exported with "
                              f"input_ids (inputs: {', '.join(self.inputs)})")
        seq = self.inputs["input_ids"][1]
        if len(seq) != 2 or isinstance(seq[1], int):
            raise LowbitError(f"{path}: input_ids has shape {seq}; eval-ppl needs [batch, sequence] with a "
                              "symbolic sequence length (a model exported for whole sequences, not one decode step)")
        unknown = [n for n in self.inputs if n not in ("input_ids", "attention_mask", "position_ids", "token_type_ids")
                   and not (PAST.search(n) and len(self.inputs[n][1]) == 4)]
        if unknown:
            raise LowbitError(f"{path}: eval-ppl does not know how to feed input{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(unknown)}")
        self.vocab = index_ranges(head).get("input_ids")  # the embedding table's rows, when input_ids indexes one
        outs = [o.name for o in head.graph.output]
        self.logits = "logits" if "logits" in outs else outs[0]
        self.session = session_factory(path)

    def feeds(self, ids: np.ndarray) -> dict:
        n = ids.shape[1]
        f = {"input_ids": ids}
        for name, (et, dims) in self.inputs.items():
            dt = helper.tensor_dtype_to_np_dtype(et)
            if name == "attention_mask":
                f[name] = np.ones((1, n), dt)
            elif name == "position_ids":
                f[name] = np.arange(n, dtype=dt)[None]
            elif name == "token_type_ids":
                f[name] = np.zeros((1, n), dt)
            elif name != "input_ids":
                if isinstance(dims[2], int) and dims[2] > 0:
                    raise LowbitError(f"{self.path}: {name} has a fixed past length {dims[2]}; eval-ppl feeds "
                                      "an empty cache (past length 0)")
                shape = [1 if i == 0 else 0 if i == 2 else d for i, d in enumerate(dims)]
                if any(not isinstance(d, int) for d in shape):
                    raise LowbitError(f"{self.path}: {name} has symbolic dims {dims} other than batch and past")
                f[name] = np.zeros(shape, dt)
        return f

    def logits_of(self, ids: np.ndarray) -> np.ndarray:
        try:
            out = self.session.run([self.logits], self.feeds(ids))[0]
        except LowbitError:
            raise
        except Exception as e:  # noqa: BLE001 - onnxruntime's own exception types
            raise LowbitError(f"{self.path}: onnxruntime could not run it: {str(e).splitlines()[0][:300]}") from None
        out = np.asarray(out, np.float32)
        if out.ndim != 3 or out.shape[:2] != ids.shape:
            raise LowbitError(f"{self.path}: output {self.logits!r} has shape {list(out.shape)}, expected "
                              f"[1, {ids.shape[1]}, vocab]")
        return out[0]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def evaluate(paths, ids: np.ndarray, *, session_factory, window: int = DEFAULT_WINDOW,
             max_tokens: int | None = None, progress=None) -> EvalResult:
    """Scores of ``paths`` (the original first) on the token ids (module docstring)."""
    if window < 2:
        raise LowbitError(f"--window {window}: at least 2 tokens")
    if max_tokens:
        ids = ids[:max_tokens]
    if ids.size < 2:
        raise LowbitError("the text gives fewer than 2 tokens")
    windows = [ids[i:i + window] for i in range(0, ids.size, window)]
    windows = [w for w in windows if w.size >= 2]
    runners = [_Runner(p, session_factory) for p in paths]
    for r in runners:
        if r.vocab is not None and int(ids.max()) >= r.vocab:
            raise LowbitError(f"token id {int(ids.max())} is outside the model's vocabulary of {r.vocab} ({r.path}): "
                              "is it the model's tokenizer?")
    lp = [[] for _ in runners]      # per model: log-likelihood of the actual next tokens
    top = [[] for _ in runners]     # per model: arg-max tokens
    vocab = None
    it = progress(windows, "windows") if progress else windows
    for w in it:
        x = w[None, :].astype(np.int64)
        for i, r in enumerate(runners):
            logits = r.logits_of(x)
            if vocab is None:
                vocab = logits.shape[-1]
                if int(ids.max()) >= vocab:
                    raise LowbitError(f"token id {int(ids.max())} is outside the model's vocabulary of {vocab}: "
                                      "is it the model's tokenizer?")
            ls = _log_softmax(logits[:-1])
            lp[i].append(ls[np.arange(w.size - 1), w[1:]])
            top[i].append(np.argmax(logits[:-1], axis=-1))
    lp = [np.concatenate(v) for v in lp]
    top = [np.concatenate(v) for v in top]
    res = EvalResult(tokens=int(lp[0].size), windows=len(windows), window=window)
    for i, r in enumerate(runners):
        nll = float(-lp[i].mean())
        score = ModelScore(r.path, weight_bytes(model_io.load(r.path, load_external_data=False)), float(np.exp(nll)),
                           nll, tokens=int(lp[i].size))
        if i:
            score.greedy_agree = float(np.mean(top[i] == top[0]))
            score.worse_2nats = float(np.mean(lp[i] < lp[0] - 2.0))
        res.models.append(score)
    return res


def table(res: EvalResult) -> str:
    base = res.models[0]
    width = max(12, *(len(os.path.basename(m.path)) for m in res.models))
    lines = [f"{res.tokens} predicted tokens in {res.windows} window(s) of up to {res.window}",
             f"{'model':{width}s} {'weights':>10s} {'x orig':>7s} {'ppl':>9s} {'d ppl':>8s} {'greedy agree':>13s} "
             f"{'> 2 nats':>9s}"]
    for m in res.models:
        ratio = m.weight_bytes / base.weight_bytes if base.weight_bytes else float("nan")
        d = f"{100 * (m.ppl / base.ppl - 1):+7.2f}%" if m is not base else f"{'-':>8s}"
        agree = f"{100 * m.greedy_agree:12.2f}%" if m.greedy_agree is not None else f"{'-':>13s}"
        worse = f"{100 * m.worse_2nats:8.2f}%" if m.worse_2nats is not None else f"{'-':>9s}"
        lines.append(f"{os.path.basename(m.path):{width}s} {m.weight_bytes / 2 ** 20:9.2f}M {ratio:7.3f} "
                     f"{m.ppl:9.3f} {d} {agree} {worse}")
    return "\n".join(lines)


def main(a, session_factory, progress=None) -> int:
    for p in [a.original, *a.rewritten]:
        model_io.load(p, load_external_data=False)  # one-line errors for missing / bad files, before any work
    ids = tokenize(a.text, a.tokenizer, a.tokens)
    res = evaluate([a.original, *a.rewritten], ids, session_factory=session_factory, window=a.window,
                   max_tokens=a.max_tokens, progress=progress)
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res.to_dict(), f, indent=1)
        print(f"wrote {a.json}")
    return 0
