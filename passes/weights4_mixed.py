"""Mixed precision within a byte budget for the weights4 pass (option ``weights_budget``, CLI ``--budget``).

The budget is a fraction of the fp32 bytes of the model's float constants (every float initializer at 4 bytes
per value, a table an export stores twice, as a tied lm_head's transposed copy, counted once). The plan:

1. bytes that do not depend on the choice: every constant that is not a candidate weight, as it will be stored
   (the kept output head in fp16 and its dropped copy as weights4_graph.store_head does); for AWQ a [K] activation
   scale per 4-bit product is reserved (it is a Mul's constant where it cannot be folded);
2. per candidate (root graph, with calibration activations X): its 4-bit bytes and those of the higher form, and
   its sensitivity: the relative output error ||X (W - W_hat)||^2 / ||X W||^2 on the calibration rows of
   round-to-nearest in the chosen 4-bit grid, minus that of the higher form;
3. greedily, most sensitive per extra byte first, products move to the higher form while the total stays within
   the budget. A product read by several quantised ops (a shared weight) stays 4-bit.

Higher forms (only what stock ONNX ops and onnxruntime's kernels run; no new op):
  int8  (default) symmetric per output channel: the int8 weight and a float32 scale per column through a standard
        DequantizeLinear (opset >= 13; axis = the weight's N axis) into the unchanged MatMul / Gemm; a Cast to fp16
        for fp16 models. Older opsets get fp16.
  fp16  the weight stored in fp16 and Cast to float for float32 models; an fp16 model's weight stays as it is.
The report entry of a kept product says its form, bytes and sensitivity; the last weights4 rewrite's
``details["budget"]`` holds the plan (fp32 bytes, limit, planned bytes, products per form).
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from . import weights4_graph as w4g
from .base import iter_graphs
from .linear import match

SENSITIVITY_ROWS = 512    # calibration rows the sensitivity is measured on (evenly subsampled)


def _opset(g: gs.Graph) -> int:
    return int(getattr(g, "opset", None) or 0)


def four_bit_bytes(o, k: int, n: int) -> int:
    """Bytes of the 4-bit tensors of a [K, N] weight in the chosen format (as weights4 writes them)."""
    if o.fmt == "awq":
        n8 = n + w4g.padding(n)
        groups = -(-k // o.group_size)
        return groups * o.group_size * n8 // 2 + groups * n8 // 8 * 4 + groups * n8 * 2
    return -(-k * n // 2) + 4 * -(-k * n // o.block_size)


def high_form(o, cand, graph_opset: int) -> str:
    return "int8" if o.budget_form == "int8" and graph_opset >= 13 else "fp16"


def high_bytes(form: str, cand) -> int:
    k, n = int(cand.K), int(cand.N)
    if form == "int8":
        return k * n + 4 * n
    return 2 * k * n


def int8_weight(value: np.ndarray, axis: int):
    """Symmetric int8 per output channel of the weight as stored (``axis``: its N axis): (q int8, scale float32
    [N]); value = q * scale."""
    v = np.asarray(value, np.float32)
    am = np.max(np.abs(v), axis=1 - axis)
    scale = np.where(am > 0, am / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    shape = (1, -1) if axis == 1 else (-1, 1)
    q = np.clip(np.round(v / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale


def _high_hat(form: str, w: np.ndarray) -> np.ndarray:
    if form == "int8":
        q, s = int8_weight(w, 1)
        return q.astype(np.float32) * s[None, :]
    return w.astype(np.float16).astype(np.float32)


def _four_bit_hat(o, w: np.ndarray) -> np.ndarray:
    from onnx_lowbit import awq, nf4  # noqa: PLC0415
    k, n = w.shape
    if o.fmt == "awq":
        return awq.fake_quantize(w4g.pad_columns(w, w4g.padding(n)), o.group_size)[:, :n]
    packed, absmax = nf4.quantize(w, o.fmt, o.block_size)
    return nf4.dequantize(packed, absmax, o.fmt, o.block_size, k, n)


def _rel_out(x: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    y = (x @ w).astype(np.float64)
    ref = float(np.sum(y * y))
    err = float(np.sum((x @ (w - w_hat.astype(np.float32))).astype(np.float64) ** 2))
    return err / ref if ref > 0 else err


def model_bytes(run, cands) -> tuple:
    """(fp32 bytes of the model's float constants, a table stored twice counted once; bytes of the constants that
    are not candidate weights, as the pass will leave them)."""
    from .weights4 import _excluded  # noqa: PLC0415 (weights4 imports this module)
    o = run.o
    consts = {}
    for g in iter_graphs(run.root):
        for t in list(g.tensors().values()) + [n.attrs.get("value") for n in g.nodes if n.op == "Constant"]:
            if isinstance(t, gs.Constant):
                consts[id(t)] = t
    dropped, halved = set(), set()
    for g in iter_graphs(run.root):
        for node in g.nodes:
            cand, _ = match(node, any_rank=True)
            if cand is None or o.lm_head == "4bit" or cand.size < o.min_elements or \
                    _excluded(cand, o.exclude, o.module_paths):
                continue
            if not w4g.head_reason(g, cand, o.module_paths.get(node.name)):
                continue
            table = cand.stored
            other = w4g._equal_table(g, cand) if w4g._tied_gather(cand) is None else None
            if other is not None:
                dropped.add(id(cand.stored))
                table = other.inputs[0]
            if o.lm_head == "fp16" and cand.dtype is np.float32 and isinstance(table, gs.Constant):
                halved.add(id(table))
    mine = {id(c.stored) for c in cands}
    fp32 = fixed = 0
    for key, t in consts.items():
        if key in dropped:
            continue
        size = int(np.prod(t.shape)) if t.shape is not None else 0
        dt = np.dtype(t.dtype) if t.dtype is not None else np.dtype(np.float32)
        if np.issubdtype(dt, np.floating):
            fp32 += 4 * size
        if key not in mine:
            fixed += size * dt.itemsize // (2 if key in halved else 1)
    return fp32, fixed


def plan(run, cands) -> dict:
    """{id(node): form} of the products kept in the higher form; sets ``run.budget_info`` and
    ``run.sensitivity`` (id(node) -> figures for the report)."""
    o = run.o
    opset = _opset(run.root)
    fp32, fixed = model_bytes(run, cands)
    readers = {}
    for c in cands:
        readers.setdefault(id(c.stored), []).append(c)
    items, total = [], fixed
    run.sensitivity = {}
    for key, group in readers.items():
        cand = group[0]
        b4 = four_bit_bytes(o, int(cand.K), int(cand.N))
        if o.fmt == "awq":   # AWQ's activation scale: a [K] constant (a Mul) where it cannot be folded
            b4 += int(cand.K) * cand.value.dtype.itemsize
        total += b4
        x = run.activations.get(cand.a.name)
        if x is None or len(group) > 1:
            continue
        if x.shape[0] > SENSITIVITY_ROWS:
            x = x[np.linspace(0, x.shape[0] - 1, SENSITIVITY_ROWS).astype(np.int64)]
        x = x.astype(np.float32)
        w = cand.w
        form = high_form(o, cand, opset)
        e4 = _rel_out(x, w, _four_bit_hat(o, w))
        eh = _rel_out(x, w, _high_hat(form, w))
        cand._w = None
        extra = high_bytes(form, cand) - b4
        run.sensitivity[id(cand.node)] = dict(rel_out_error_4bit=e4, rel_out_error_high=eh)
        if e4 > eh and extra > 0:
            items.append(((e4 - eh) / extra, extra, form, cand))
    limit = o.budget * fp32
    all4 = total
    promote = {}
    for _, extra, form, cand in sorted(items, key=lambda t: -t[0]):
        if total + extra <= limit:
            promote[id(cand.node)] = form
            total += extra
    forms = {f: sum(1 for v in promote.values() if v == f) for f in ("int8", "fp16")}
    run.budget_info = dict(budget=o.budget, fp32_bytes=int(fp32), limit_bytes=int(limit), fixed_bytes=int(fixed),
                           all_4bit_bytes=int(all4), planned_bytes=int(total), products=len(readers),
                           kept=forms, met=bool(all4 <= limit))
    return promote


def emit(run, g: gs.Graph, cand, details: dict) -> tuple:
    """Keeps cand's product in its planned higher form: the node stays, its constant weight input is replaced.
    Returns (the report entry's reason, its details)."""
    form = run.promote[id(cand.node)]
    reader = cand.w_node if cand.w_node is not None and cand.w_node.op == "Transpose" else cand.node
    idx = next(i for i, t in enumerate(reader.inputs) if t is cand.stored)
    value = np.asarray(cand.value)
    axis = 0 if cand.transpose else 1          # the N axis of the stored weight
    base = cand.weight_name
    nodes = []
    if form == "int8":
        q, scale = int8_weight(value, axis)
        qc, sc = run.const(f"{base}_int8", q), run.const(f"{base}_int8_scale", scale)
        y = gs.Variable(run.names(f"{base}_dq"), dtype=np.float32, shape=list(value.shape))
        nodes.append(gs.Node("DequantizeLinear", name=run.names(f"{base}_dequantize"), inputs=[qc, sc],
                             outputs=[y], attrs=dict(axis=axis)))
        w_hat = q.astype(np.float32) * (scale[None, :] if axis == 1 else scale[:, None])
        after = int(q.nbytes + scale.nbytes)
        how = f"int8 per output channel, DequantizeLinear -> {cand.node.op}"
        if value.dtype == np.float16:
            y16 = gs.Variable(run.names(f"{base}_dq16"), dtype=np.float16, shape=list(value.shape))
            nodes.append(gs.Node("Cast", name=run.names(f"{base}_dq_cast"), inputs=[y], outputs=[y16],
                                 attrs=dict(to=10)))
            y = y16
    elif value.dtype == np.float32:
        c16 = run.const(f"{base}_fp16", value.astype(np.float16))
        y = gs.Variable(run.names(f"{base}_f32"), dtype=np.float32, shape=list(value.shape))
        nodes.append(gs.Node("Cast", name=run.names(f"{base}_cast"), inputs=[c16], outputs=[y], attrs=dict(to=1)))
        w_hat = value.astype(np.float16).astype(np.float32)
        after = int(value.nbytes // 2)
        how = f"fp16, Cast to float -> {cand.node.op}"
    else:
        y, w_hat, after, how = cand.stored, value, int(value.nbytes), "fp16 as the model stores it"
    g.nodes.extend(nodes)
    reader.inputs[idx] = y
    w = np.asarray(value, np.float64)
    rel = float(np.linalg.norm(w - w_hat) / max(np.linalg.norm(w), 1e-30))
    info = dict(details, format=form, op=cand.node.op, bytes_before=cand.bytes_before, bytes_after=after,
                rel_error=rel, new_nodes=[n.name for n in nodes], **run.sensitivity.get(id(cand.node), {}))
    s = run.sensitivity.get(id(cand.node))
    why = (f"kept in {how} by weights_budget {run.o.budget:g}: relative output error on the calibration rows "
           f"{s['rel_out_error_4bit']:.3g} in 4-bit, {s['rel_out_error_high']:.3g} in {form}" if s else how)
    return why, info
