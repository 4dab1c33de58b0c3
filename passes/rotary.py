"""rotary: the half-rotation rotary embedding of LLaMA-family exports -> one ``Rotary`` node (onnx_lowbit.rotary).

Matched (q and k of every attention layer; TorchScript and dynamo exporters spell it alike, opset 17 / 18):

    a = Mul(X, cos)    s1 = Slice(X, [0], [h], [-1 or rank-1])    s2 = Slice(X, [h], [>= D, e.g. INT64_MAX], ...)
    c = Concat([Neg(s2), s1], axis=-1 or rank-1)    b = Mul(c, sin)    out = Add(a, b)

in any operand order of the Muls and the Add, Slice parameters as constant inputs (steps 1 or absent) or, before
opset 10, as attributes; negative starts/ends are normalised the way Slice does; h may also be computed from X's
shape (TorchScript with dynamic axes: Unsqueeze(Cast(Div(Gather(Shape(X), 3), 2))), see _index).
``Rotary(X, cos, sin)`` writes ``out`` (the same tensor, so consumers and graph outputs are unchanged).

An Add of ``Mul`` and ``Mul(Concat(Neg(Slice), Slice), .)`` is a candidate; it is reported as skipped when the
Slices and the Mul read different tensors, X's last dim D is unknown or odd, h != D/2, the slices are not step-1
slices of the last axis, X's type is not float/float16 (or cos/sin differ from it), cos or sin would broadcast X
to a larger shape (known dims only: unknown ones are checked by the kernel at run time), or an intermediate is
read outside the pattern / is a graph output.

D: X's last dim from shape inference; exports with a dynamic sequence axis reshape q/k through computed shapes, so
onnx infers no dims for X: then a last dim > 1 of cos or sin gives D (broadcasting leaves X only that D or 1, and
the kernel refuses the absurd D = 1 at run time instead of computing). The op rounds each product and the sum as
the unfused ops do in X's type (onnx_lowbit.rotary; note that onnxruntime's CPU EP runs fp16 Mul/Add chains in
fp32 and rounds once, so there fp16 results can differ from the unfused original by an fp16 rounding).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain, rotary

from .base import (Names, Pass, Report, constant_value, detach, dims, elem_type, is_alive, is_op, iter_graphs,
                   known_dim, labels_in_order, node_label, outside_consumers, producer, type_name)

PATTERN = "rotary: Mul,Slice,Slice,Neg,Concat,Mul,Add"
TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _present(node, i):
    return len(node.inputs) > i and not (isinstance(node.inputs[i], gs.Variable) and not node.inputs[i].name)


def _match(add):
    """(a, b, c, n, s1, s2, X, cos, sin) when ``add`` is Add(Mul(., .), Mul(Concat(Neg(Slice), Slice), .)) in
    either order, else None. X is the first Slice's data (checked against the rest by _why_not)."""
    if len(add.inputs) != 2:
        return None
    for ia in (0, 1):
        a, b = producer(add.inputs[ia]), producer(add.inputs[1 - ia])
        if not (is_op(a, "Mul") and is_op(b, "Mul")) or a is b or len(a.inputs) != 2 or len(b.inputs) != 2:
            continue
        for ic in (0, 1):
            c = producer(b.inputs[ic])
            if not (is_op(c, "Concat") and len(c.inputs) == 2):
                continue
            n, s1 = producer(c.inputs[0]), producer(c.inputs[1])
            s2 = producer(n.inputs[0]) if is_op(n, "Neg") and n.inputs else None
            if not (is_op(s1, "Slice") and is_op(s2, "Slice")) or s1 is s2:
                continue
            x = s1.inputs[0]
            if a.inputs[0] is x:
                cos = a.inputs[1]
            elif a.inputs[1] is x:
                cos = a.inputs[0]
            else:
                cos = None      # the Mul does not read the Slices' tensor: reported by _why_not
            return a, b, c, n, s1, s2, x, cos, b.inputs[1 - ic]
    return None


_SAME = ("Cast", "Unsqueeze", "Squeeze", "Reshape", "Identity")     # one-element index tensors pass through these


def _index(t, x, rank, depth=0):
    """A one-element Slice input as an int, "D" (X's last dim at run time: Gather(Shape(X), -1), or Shape(X) from
    the last axis) or "h" (that Div 2, floor), through Cast / Unsqueeze / Squeeze / Reshape / Identity; else None.
    TorchScript exports with dynamic axes compute h this way (x.shape[-1] // 2)."""
    v = constant_value(t)
    if v is not None:
        if v.size != 1 or v.dtype.kind not in "iuf" or not float(v.reshape(-1)[0]).is_integer():
            return None
        return int(v.reshape(-1)[0])
    p = producer(t)
    if p is None or depth > 8 or not p.inputs or p.domain not in (None, "", "ai.onnx"):
        return None
    last = (-1, rank - 1)
    if p.op in _SAME:
        return _index(p.inputs[0], x, rank, depth + 1)
    if p.op == "Div" and len(p.inputs) == 2 and _index(p.inputs[1], x, rank, depth + 1) == 2:
        return "h" if _index(p.inputs[0], x, rank, depth + 1) == "D" else None
    if p.op == "Shape" and p.inputs[0] is x and p.attrs.get("start", 0) in last and p.attrs.get("end", rank) >= rank:
        return "D"
    if p.op == "Gather" and len(p.inputs) == 2 and _index(p.inputs[1], x, rank, depth + 1) in last:
        sh = producer(p.inputs[0])
        if is_op(sh, "Shape") and sh.inputs[0] is x and not sh.attrs.get("start", 0) and sh.attrs.get("end") is None:
            return "D"
    return None


def _slice_params(node, opset, x, rank):
    """(start, end, axis, step) of a one-axis Slice (axis 0 and step 1 when absent), start / end possibly "D" or
    "h" (_index), or a reason string."""
    if opset < 10:
        at = node.attrs
        if "starts" not in at or "ends" not in at:
            return "has no starts/ends attributes"
        vals = [at["starts"], at["ends"], at.get("axes"), None]
        if any(v is not None and len(v) != 1 for v in vals):
            return "slices more than one axis"
        vals = [None if v is None else int(v[0]) for v in vals]
    else:
        vals = []
        for i in (1, 2, 3, 4):
            if not _present(node, i):
                vals.append(None)
                continue
            v = constant_value(node.inputs[i])
            if v is not None and v.size != 1:
                return "slices more than one axis"
            k = _index(node.inputs[i], x, rank)
            if k is None:
                return "starts/ends/axes/steps are neither constants nor X's last dim (/ 2)"
            vals.append(k)
    start, end, axis, step = vals
    if start is None or end is None:
        return "has no starts/ends"
    return start, end, 0 if axis is None else axis, 1 if step is None else step


def _bound(v, d):
    """A Slice start/end on an axis of length d (step 1), as Slice normalises it."""
    return min(max(v + d if v < 0 else v, 0), d)


def _why_not(g, nodes, x, cos, sin):
    """Why the matched pattern cannot become Rotary(X, cos, sin); None when it can."""
    a, b, c, n, s1, s2, add = nodes
    if cos is None or s2.inputs[0] is not x:
        return "the Slices and the Mul by cos read different tensors"
    if any(producer(t) is not None and any(producer(t) is m for m in nodes) for t in (cos, sin)):
        return "cos or sin is computed inside the pattern"
    dts = [(name, elem_type(t)) for name, t in (("X", x), ("cos", cos), ("sin", sin), ("output", add.outputs[0]))]
    dt = next((et for _, et in dts if et is not None), None)
    if dt is not None and dt not in TYPES:
        return f"X is {type_name(dt)}: Rotary takes float or float16"
    for name, et in dts:
        if et is not None and et != dt:
            return f"{name} is {type_name(et)}, X is {type_name(dt)}"
    xs = dims(x)
    if not xs:
        return "X's rank is unknown"
    rank, d = len(xs), known_dim(xs[-1])
    if d is None:   # X's D not inferred (dynamic reshapes): a cos / sin last dim > 1 fixes it (else X's D is 1)
        d = next((k for k in (known_dim((dims(t) or [None])[-1]) for t in (cos, sin)) if k and k > 1), None)
        if d is None:
            return "X's last dim D is unknown (and cos and sin do not fix it)"
    if d % 2:
        return f"X's last dim D = {d} is odd"
    h = d // 2
    for s, want, what in ((s1, (0, h), "first half"), (s2, (h, d), "second half")):
        p = _slice_params(s, g.opset, x, rank)
        if isinstance(p, str):
            return f"Slice {node_label(s)} {p}"
        start, end, axis, step = ({"D": d, "h": h}.get(v, v) for v in p)
        if axis not in (-1, rank - 1) or step != 1:
            return f"Slice {node_label(s)} is not a step-1 slice of the last axis (axis {axis}, step {step})"
        if (_bound(start, d), _bound(end, d)) != want:
            return (f"Slice {node_label(s)} takes [{start}:{end}] of D = {d}, not the {what} "
                    f"[{want[0]}:{want[1] if want[1] < d else ''}]")
    if c.attrs.get("axis") not in (-1, rank - 1):
        return f"Concat axis {c.attrs.get('axis')} is not the last axis"
    for name, t in (("cos", cos), ("sin", sin)):
        s = dims(t)
        if s is None:
            return f"the shape of {name} is unknown: cannot check that it broadcasts to X"
        if len(s) > rank or any(isinstance(k, (int, np.integer)) and isinstance(v, (int, np.integer))
                                and k not in (1, v) for k, v in zip(s[::-1], xs[::-1])):
            return f"{name} of shape {s} does not broadcast to X's shape {xs}: it would broadcast X up"
    if all(known_dim(v) for v in xs + dims(cos) + dims(sin)):
        try:    # fully known shapes: also the kernels' layout (at most four runs of broadcast leading axes)
            rotary.layout(xs, dims(cos), dims(sin))
        except rotary.RotaryError as e:
            return str(e)
    inside = {id(m) for m in nodes}
    for m in (a, b, c, n, s1, s2):
        out = outside_consumers(m, inside, g)
        if out:
            who = ", ".join(o if isinstance(o, str) else node_label(o) for o in out)
            return f"intermediate {m.outputs[0].name} ({m.op}) is used elsewhere: {who}"
    return None


class RotaryPass(Pass):
    name = "rotary"
    description = "half-rotation rotary embedding (Mul, Slice, Slice, Neg, Concat, Mul, Add) -> one Rotary node"

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        names = Names(graph)
        for g in iter_graphs(graph):
            order = {id(node): i for i, node in enumerate(g.nodes)}
            for add in list(g.nodes):
                if not (is_alive(add) and is_op(add, "Add")):
                    continue
                m = _match(add)
                if m is None:
                    continue
                a, b, c, n, s1, s2, x, cos, sin = m
                nodes = (a, b, c, n, s1, s2, add)
                labels = labels_in_order(nodes, order)
                why = _why_not(g, nodes, x, cos, sin)
                if why:
                    self.skipped(report, PATTERN, labels, why)
                    continue
                out = add.outputs[0]
                note = "" if known_dim(dims(x)[-1]) else "X's last dim not inferred: D taken from cos / sin"
                for k in nodes:
                    detach(k)
                new = gs.Node(op="Rotary", domain=domain.DOMAIN, name=names((add.name or out.name) + "_rotary"),
                              inputs=[x, cos, sin], outputs=[out])
                g.nodes.append(new)
                self.rewritten(report, PATTERN, labels, note, new_node=new.name, input=x.name, cos=cos.name,
                               sin=sin.name, output=out.name)
