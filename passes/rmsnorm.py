"""rmsnorm: LLaMA-family RMSNorm (transformers' LlamaRMSNorm as exporters spell it) -> one ``RMSNorm`` node
(onnx_lowbit.rmsnorm), with the residual Add in front of it when there is one.

Matched, anchored on ReduceMean (TorchScript opset 17 and dynamo opset 18 exports, fp32 and fp16):

    h32 = Cast(h, to=FLOAT)            absent in fp32 models, or a Cast to h's own type
    p   = Pow(h32, 2)  or  Mul(h32, h32)
    ms  = ReduceMean(p, axes=[-1] or [rank-1], keepdims=1)      axes an attribute (opset < 18) or a constant input
    v   = Add(ms, eps)                 eps a one-element constant, either order
    r   = Div(1, Sqrt(v))  or  Reciprocal(Sqrt(v))  or  Pow(v, -0.5)
    n   = Mul(h32, r) (either order)   or  n = Div(h32, Sqrt(v))
    y   = Cast(n, to=h's type)         absent in fp32 models (or a Cast to FLOAT)
    out = Mul(gamma, y)                gamma a constant [D] of h's type, either order

-> ``RMSNorm(h, gamma)`` with epsilon = eps, writing ``out`` (the same tensor). When h is the output of an
``Add(a, b)`` of two tensors of h's type with the same known shape (every dim an equal number or the same symbol
from shape inference: no broadcasting), the Add is fused too: ``RMSNorm(a, gamma, b)`` writes (out, h), so h's
other readers (the next residual Add) and graph outputs are unchanged. Each Add goes into at most one RMSNorm.
TorchScript fp32 exports feed the residual stream from the norm's Cast (to float, from float): that Cast is an
identity, and its readers outside the pattern are rewired to h (kept as a node only when it is a graph output).

A ReduceMean of Pow(t, 2) / Mul(t, t) followed by Add(., constant) and Sqrt (or Pow -0.5) is a candidate; it is
reported as skipped when: the reduction is not over the last axis with keepdims=1, h's rank or last dim D is
unknown, h is not float/float16, the arithmetic is not done in float32 (fp16 without the Casts) or the Cast back
does not go to h's type, gamma is not a constant [D] of h's type (a graph input, Gemma's ``1 + weight``, a
broadcast shape), eps or the numerator 1 is not a one-element constant, or an intermediate is read outside the
pattern or is a graph output. A residual Add whose shapes cannot be proven equal is left in place (the rewrite
is reported with residual_fused=False and the reason). Numerics: the op computes what the graph computes (a fp32
mean of squares, 1/sqrt, the product rounded to h's type, then the weight); Div(h32, Sqrt(v)) becomes
h32 * (1/sqrt(v)) (one fp32 rounding apart).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from .base import (Names, Pass, Report, constant_value, detach, dims, elem_type, is_alive, is_graph_output, is_op,
                   iter_graphs, known_dim, labels_in_order, node_label, outside_consumers, producer, scalar_value,
                   type_name)

PATTERN = "rmsnorm: Cast,Pow,ReduceMean,Add,Sqrt,Div,Mul,Cast,Mul"
FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
TYPES = (FLOAT, FLOAT16)


def _users(t, g_ids):
    """The nodes of this graph (ids in ``g_ids``) reading ``t``."""
    return [c for c in t.outputs if id(c) in g_ids]


def _other(node, t):
    """The input of the two-input ``node`` that is not ``t`` (the second one when both are ``t``)."""
    if len(node.inputs) != 2:
        return None
    return node.inputs[1] if node.inputs[0] is t else node.inputs[0] if node.inputs[1] is t else None


def _source(t, g, depth=0):
    """``t`` through Identity nodes (TorchScript exports read deduplicated weights through Identity)."""
    p = producer(t)
    while is_op(p, "Identity") and p.inputs and depth < 8:
        t, p, depth = p.inputs[0], producer(p.inputs[0]), depth + 1
    return t


def _is(t, value, max_ndim=None):
    v = scalar_value(t, max_ndim)
    return v is not None and v == value


def _head(rm, g_ids):
    """(p, h32, v, eps) when ``rm`` = ReduceMean(Pow(h32, 2) | Mul(h32, h32)) feeds Add(., one-element constant)
    (either order), else None: ReduceMeans of other shapes are no candidates."""
    if not rm.inputs or not rm.outputs:
        return None
    p = producer(rm.inputs[0])
    if p is None or id(p) not in g_ids or len(p.inputs) != 2:
        return None
    if is_op(p, "Pow") and _is(p.inputs[1], 2.0):
        h32 = p.inputs[0]
    elif is_op(p, "Mul") and p.inputs[0] is p.inputs[1]:
        h32 = p.inputs[0]
    else:
        return None
    users = _users(rm.outputs[0], g_ids)
    v = next((u for u in users if is_op(u, "Add") and len(u.inputs) == 2
              and scalar_value(_other(u, rm.outputs[0])) is not None), None)
    if v is None:
        return None
    return p, h32, v, _other(v, rm.outputs[0])


def _pick(t, g_ids, test):
    """The first reader of ``t`` in this graph for which ``test`` holds (others are reported by _why_not)."""
    return next((u for u in _users(t, g_ids) if test(u)), None)


def _tail(v, h32, g_ids):
    """The nodes after v = Add(ms, eps): (nodes [sqrt or Pow -0.5, r or None, n, y-Cast or None, out-Mul], gamma)
    or a reason string; None when v feeds neither Sqrt nor Pow(v, -0.5) (no candidate)."""
    vt = v.outputs[0]
    sq = _pick(vt, g_ids, lambda u: is_op(u, "Sqrt"))
    if sq is None:
        sq = _pick(vt, g_ids, lambda u: is_op(u, "Pow") and len(u.inputs) == 2 and u.inputs[0] is vt
                   and _is(u.inputs[1], -0.5))
        if sq is None:
            return None
        r = sq                                                      # r = Pow(v, -0.5)
    else:
        st = sq.outputs[0]
        r = _pick(st, g_ids, lambda u: (is_op(u, "Div") and len(u.inputs) == 2 and u.inputs[1] is st)
                  or is_op(u, "Reciprocal"))
        if r is None:
            return f"Sqrt {node_label(sq)} feeds no Div / Reciprocal"
        if is_op(r, "Div") and r.inputs[0] is not h32 and not _is(r.inputs[0], 1.0):
            return f"Div {node_label(r)} divides {r.inputs[0].name}, neither 1 nor the squared tensor"
    if is_op(r, "Div") and r.inputs[0] is h32:
        nodes, n = [sq], r                                          # n = Div(h32, Sqrt(v))
    else:
        rt = r.outputs[0]
        n = _pick(rt, g_ids, lambda u: is_op(u, "Mul") and _other(u, rt) is h32)
        if n is None:
            return f"1/sqrt {rt.name} is not multiplied by the squared tensor"
        nodes = [sq] if r is sq else [sq, r]
    nodes.append(n)
    nt = n.outputs[0]
    y = _pick(nt, g_ids, lambda u: is_op(u, "Cast"))
    yt = y.outputs[0] if y is not None else nt
    out = _pick(yt, g_ids, lambda u: is_op(u, "Mul") and _other(u, yt) is not None)
    if out is None:
        return f"the normalised tensor {yt.name} is not multiplied by a weight"
    nodes += [y, out]
    return nodes, _other(out, yt)


def _axes_ok(rm, opset, rank):
    """None when ``rm`` reduces the last axis only with keepdims=1, else the reason."""
    if rm.attrs.get("keepdims", 1) != 1:
        return "ReduceMean has keepdims=0"
    if opset < 18 and "axes" in rm.attrs:
        axes = list(rm.attrs["axes"])
    elif len(rm.inputs) > 1 and rm.inputs[1].name:
        v = constant_value(rm.inputs[1])
        if v is None:
            return "ReduceMean's axes are not a constant"
        axes = [int(a) for a in v.reshape(-1)]
    else:
        return "ReduceMean reduces over all axes"
    if len(axes) != 1 or axes[0] not in (-1, rank - 1):
        return f"ReduceMean reduces over axes {axes}, not the last axis"
    return None


def _same_shape(a, b):
    sa, sb = dims(a), dims(b)
    if sa is None or sb is None or len(sa) != len(sb):
        return False
    return all((isinstance(x, (int, np.integer)) and x > 0 and x == y) or (isinstance(x, str) and x and x == y)
               for x, y in zip(sa, sb))


def _h_info(h):
    """(h's element type, h's dims): graphsurgeon's (shape inference fills the main graph only), else, for the
    sum of a residual Add of two tensors of the same known type and shape, theirs (subgraphs; a sum that is a
    graph output declared with symbolic dims)."""
    dt, shape = elem_type(h), dims(h)
    add = producer(h)
    if (dt is None or not shape or known_dim(shape[-1]) is None) and is_op(add, "Add") and len(add.inputs) == 2:
        a, b = add.inputs
        if elem_type(a) is not None and elem_type(a) == elem_type(b) and _same_shape(a, b):
            dt, shape = (dt if dt is not None else elem_type(a)), dims(a)
    return dt, shape


def _residual(h, dt, g_ids, used):
    """(add, a, b) when h = Add(a, b) can be fused, else (None, reason or "")."""
    add = producer(h)
    if not (is_op(add, "Add") and id(add) in g_ids and len(add.inputs) == 2 and is_alive(add)):
        return None, ""
    if id(add) in used:
        return None, "the residual Add is already fused into another RMSNorm"
    a, b = add.inputs
    if any(elem_type(t) != dt for t in (a, b)):
        return None, "the residual Add's inputs are not both of h's type"
    if not _same_shape(a, b):
        return None, f"the residual Add's input shapes {dims(a)} and {dims(b)} are not provably equal"
    return (add, a, b), ""


class RMSNormPass(Pass):
    name = "rmsnorm"
    default = False     # opt-in: slower than onnxruntime's Add + LayerNormalization on the H100 (docs/passes.md)
    description = "LLaMA RMSNorm (Cast, Pow, ReduceMean, Add, Sqrt, Div, Mul, Cast, Mul) [+ residual Add] -> RMSNorm"

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        names = Names(graph)
        used: set = set()
        for g in iter_graphs(graph):
            g_ids = {id(n) for n in g.nodes}
            order = {id(node): i for i, node in enumerate(g.nodes)}
            for rm in list(g.nodes):
                if not (is_alive(rm) and is_op(rm, "ReduceMean")):
                    continue
                head = _head(rm, g_ids)
                if head is None:
                    continue
                p, h32, v, eps_t = head
                tail = _tail(v, h32, g_ids)
                if tail is None:
                    continue
                nodes = [p, rm, v]
                if isinstance(tail, str):
                    self.skipped(report, PATTERN, labels_in_order(nodes, order), tail)
                    continue
                rest, gamma = tail
                y = rest[-2]
                rest = [k for k in rest if k is not None]
                cast = producer(h32)
                cast = cast if is_op(cast, "Cast") and id(cast) in g_ids else None
                if cast is not None and y is None and elem_type(cast.inputs[0]) != FLOAT:
                    cast = None     # no Cast back: an fp32 graph whose h is a Cast output (e.g. of an int tensor)
                h = cast.inputs[0] if cast is not None else h32
                nodes = [n for n in [cast, p, rm, v] + rest if n is not None]
                labels = labels_in_order(nodes, order)
                why = self._why_not(g, nodes, cast, y, h, gamma, eps_t, rm)
                if why:
                    self.skipped(report, PATTERN, labels, why)
                    continue
                dt = _h_info(h)[0]
                out = rest[-1].outputs[0]
                res, note = _residual(h, dt, g_ids, used)
                # the Cast to h's own type: readers outside the pattern read h instead (the same values)
                keep_cast = False
                if cast is not None:
                    inside = {id(k) for k in nodes}
                    for c in [c for c in h32.outputs if id(c) not in inside]:
                        for i, t in enumerate(list(c.inputs)):
                            if t is h32:
                                c.inputs[i] = h
                    keep_cast = is_graph_output(g, h32)
                if res is not None:
                    add, a, b = res
                    used.add(id(add))
                    labels = labels_in_order(nodes + [add], order)
                for k in nodes:
                    if not (k is cast and keep_cast):
                        detach(k)
                eps = float(scalar_value(eps_t))
                base = (rest[-1].name or out.name) + "_rmsnorm"
                if res is not None:
                    detach(add)
                    new = gs.Node(op="RMSNorm", domain=domain.DOMAIN, name=names(base), attrs={"epsilon": eps},
                                  inputs=[a, gamma, b], outputs=[out, h])
                else:
                    new = gs.Node(op="RMSNorm", domain=domain.DOMAIN, name=names(base), attrs={"epsilon": eps},
                                  inputs=[h, gamma], outputs=[out])
                g.nodes.append(new)
                g_ids.add(id(new))
                self.rewritten(report, PATTERN, labels, note, new_node=new.name, input=h.name, gamma=gamma.name,
                               output=out.name, epsilon=eps, residual_fused=res is not None,
                               residual="yes" if res is not None else "no")

    @staticmethod
    def _why_not(g, nodes, cast, y, h, gamma, eps_t, rm):
        dt, xs = _h_info(h)
        if dt is None:
            return "h's type is unknown"
        if dt not in TYPES:
            return f"h is {type_name(dt)}: RMSNorm takes float or float16"
        if cast is not None and cast.attrs.get("to") != FLOAT:
            return f"the Cast of h goes to {type_name(cast.attrs.get('to'))}, not float"
        if cast is None and dt != FLOAT:
            return f"h is {type_name(dt)} and is squared without a Cast to float (the op computes in float)"
        if y is not None and y.attrs.get("to") != dt:
            return f"the Cast back goes to {type_name(y.attrs.get('to'))}, not h's type {type_name(dt)}"
        if y is None and dt != FLOAT:
            return f"no Cast back to {type_name(dt)} before the weight"
        if not xs:
            return "h's rank is unknown"
        d = known_dim(xs[-1])
        if d is None:
            return "h's last dim D is unknown"
        why = _axes_ok(rm, g.opset, len(xs))
        if why:
            return why
        if scalar_value(eps_t, len(xs)) is None:
            return "eps is not a one-element constant"
        src = _source(gamma, g)
        if any(t is src for t in g.inputs):
            return f"gamma {src.name} is a graph input, not a constant"
        gv = constant_value(src)
        if gv is None:
            p = producer(src)
            what = f"computed by {p.op} {node_label(p)}" if p is not None else "not an initializer"
            return f"gamma {gamma.name} is not a constant ({what})"
        if list(gv.shape) != [d]:
            return f"gamma has shape {list(gv.shape)}, not [D] = [{d}]"
        if gv.dtype != np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dt)):
            return f"gamma is {gv.dtype}, h is {type_name(dt)}"
        out = nodes[-1].outputs[0]
        if elem_type(out) not in (None, dt):
            return f"the output is {type_name(elem_type(out))}, h is {type_name(dt)}"
        inside = {id(k) for k in nodes}
        for m in nodes[:-1]:
            if m is cast and dt == FLOAT:      # a Cast float -> float: its other readers are rewired to h
                continue
            extra = outside_consumers(m, inside, g)
            if extra:
                who = ", ".join(o if isinstance(o, str) else node_label(o) for o in extra)
                return f"intermediate {m.outputs[0].name} ({m.op}) is used elsewhere: {who}"
        return None
