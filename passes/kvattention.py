"""kvattention: the eager attention of LLaMA-family exports -> one ``KVAttention`` node (onnx_lowbit.kvattention).

Runs after rotarykv (Q is then its output; any tensor feeding the first MatMul will do). Matched, per attention
layer, in the main graph and in subgraphs (transformers' eager attention as the TorchScript exporter writes it,
static or with dynamic axes, and as the dynamo exporter does; opset 13+ and, with ``axes`` attributes, older):

    Kr = Reshape(Expand(Unsqueeze(K, axis 2), [B, Hkv, rep, T, D]), [B, Hkv * rep, T, D])     (grouped-query
    Vr = the same repeat of V                                                         repeat; absent: Kr = K)
    A = MatMul(Q, Transpose(Kr, perm [0, 1, 3, 2]))          (or the repeat after the Transpose, of K^T)
    A = Mul(A, c) | Mul(c, A) | Div(A, c)                    c a one-element constant (absent: scale 1)
    A = Add(A, mask) | Add(mask, A)                          (optional)
    P = Cast* (Softmax(Cast* (A), axis -1 or the last axis))
    O = MatMul(P, Vr)

becomes ``KVAttention(Q, K, V[, mask])`` with scale = c (divide = 1 for the Div), writing O (the same tensor); the
Transpose / Reshape after the second MatMul stay as they are. A K or V not written by Reshape(Expand(Unsqueeze))
is taken as it is (no repeat).

Casts: each to float or, in an fp16 model, to float16, and P back in Q's type: identities, or the fp32 round trip
of an fp16 model: Cast(float) -> Softmax -> Cast(float16) (the op's definition), or Softmax in fp16 ->
Cast(float) -> Cast(float16) (the TorchScript export of softmax(..., dtype=float32) in fp16: the op computes that
softmax in fp32 and rounds once, the correctly rounded result up to fp32's own rounding).

The repeat: the Expand shape and the Reshape target may be constants or computed (TorchScript with dynamic axes
builds them from Shape(K), with Where(Equal(s, -1), 1, s) around the expand's): they are evaluated with the
unknown dims of K as symbols (_Dim), else the inferred output dims are used. The Expand must keep B, H, T, D (or
broadcast a 1 there) and expand the new axis to a known rep; the Reshape's entries must be B, H x rep, T, D (a 0
copies B, with allowzero 0), one entry may be left unproven (-1, or computed otherwise): the element count fixes it.

Candidates are Softmax nodes whose output reaches (through Casts) the first input of a MatMul. One that cannot be
rewritten is reported as skipped with the reason: the Softmax's input is not [Cast] [Add] [Mul / Div] MatMul, the
scores are the divisor, the scale is not a one-element constant (rank <= 4), the Softmax is on another axis
(opset < 13: its default axis 1 too), K is not Transpose(perm [0, 1, 3, 2]) (another perm, or none), a repeat
that is not Unsqueeze(axis 2) -> Expand -> Reshape as above (or cannot be proven to be: e.g. an Expand of the
batch axis, heads tiled h0 h1 h0 h1), K and V repeated differently or of different shapes, Q, K or V not of rank
4, heads that disagree (Hq != rep x Hkv where known; also Hkv = 1 broadcast by the MatMul) or batch sizes that
differ (B broadcast by the MatMul), a mask of unknown rank or rank > 4 or with a known dim that would broadcast
the scores up (the Add's inferred output dims must keep the scores' where known; unknown dims are checked by the
kernel at run time), a Cast to another type (or a rounding Cast in an fp32 model), dtypes other than float /
float16 or mixed, an intermediate (Kt, the repeats, scores, scaled / masked scores, the Casts' outputs, P) read
outside the pattern (also from a subgraph) or a graph output, or an input (Q, K, V, mask) computed inside the
pattern, or a query length S not known to be <= the option ``kvattention_max_query`` (default MAX_QUERY; 0: no
limit).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from .base import (Names, Pass, Report, constant_value, detach, dims, elem_type, is_alive, is_graph_output, is_op,
                   iter_graphs, known_dim, labels_in_order, node_label, producer, scalar_value, scope_stem, type_name)

PATTERN = "kvattention: MatMul,Transpose,Mul,Add,Softmax,MatMul"
TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
FLOAT = onnx.TensorProto.FLOAT
KT_PERM = [0, 1, 3, 2]
# The longest query (S, Q's axis 2) rewritten by default: the CUDA kernel runs one block per query row and re-reads
# K / V for each; measured with CUDA graphs on the H100 against onnxruntime's kernels: 1.04x at S = 1, 1.19x at 4,
# 0.93x at 16, 0.17x at 64 (BENCHMARKS.md); 0 or None: no limit.
MAX_QUERY = 4


# ----------------------------------------------------------------------------------------------------------------
# shape tensors (the repeat's Expand shape and Reshape target): ints, or dims of a tensor not known statically
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Dim:
    """``factor`` x dim ``axis`` of the tensor with id ``tid`` (a dim the graph reads with Shape at run time)."""
    tid: int
    axis: int
    factor: int = 1


class _Unknown(Exception):
    pass


def _as_int(v):
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return int(v)
    if isinstance(v, _Dim):
        return v
    raise _Unknown


def _mul(a, b):
    if isinstance(a, _Dim) and isinstance(b, _Dim):
        raise _Unknown
    if isinstance(a, _Dim):
        a, b = b, a
    if isinstance(b, _Dim):
        if a <= 0:
            raise _Unknown
        return _Dim(b.tid, b.axis, b.factor * a)
    return a * b


def _equal(a, b):
    if isinstance(a, _Dim) or isinstance(b, _Dim):
        if isinstance(a, _Dim) and isinstance(b, _Dim):
            if a == b:
                return True
            raise _Unknown
        n = b if isinstance(a, _Dim) else a
        if n < 0:
            return False        # a dim is never negative (TorchScript's expand compares with -1)
        raise _Unknown
    return a == b


def _elementwise(fn, *arrays):
    arrays = np.broadcast_arrays(*arrays)
    out = np.empty(arrays[0].shape, object)
    for idx in np.ndindex(out.shape):
        out[idx] = fn(*(a[idx] for a in arrays))
    return out


def _shape_values(t, depth=0, memo=None):
    """The value of an int shape tensor as an object array of ints and _Dim, or None when it cannot be told."""
    memo = {} if memo is None else memo
    if id(t) in memo:
        return memo[id(t)]
    try:
        v = _eval(t, depth, memo)
    except (_Unknown, ValueError, IndexError, TypeError, KeyError):
        v = None
    memo[id(t)] = v
    return v


def _ints(v):
    if v is None:
        raise _Unknown
    return [_as_int(x) for x in np.asarray(v).reshape(-1)]


def _eval(t, depth, memo):
    c = constant_value(t)
    if c is not None:
        if c.dtype.kind not in "iub":
            raise _Unknown
        return np.array(c.tolist(), dtype=object)
    p = producer(t)
    if p is None or depth > 24 or p.domain not in (None, "", "ai.onnx"):
        raise _Unknown
    ins = lambda i: _shape_values(p.inputs[i], depth + 1, memo)  # noqa: E731
    need = lambda i: _must(ins(i))  # noqa: E731
    op, at = p.op, p.attrs
    if op == "Shape":
        s = dims(p.inputs[0])
        if s is None:
            raise _Unknown
        start, end = at.get("start", 0), at.get("end", len(s))
        rank = len(s)
        start, end = (max(0, min(rank, v + rank if v < 0 else v)) for v in (start, end))
        return np.asarray([known_dim(s[i]) or _Dim(id(p.inputs[0]), i) for i in range(start, end)], object)
    if op in ("Identity", "Cast"):
        if op == "Cast" and at.get("to") not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            raise _Unknown
        return need(0)
    if op in ("Unsqueeze", "Squeeze"):
        x = need(0)
        axes = at["axes"] if "axes" in at else _ints(ins(1)) if len(p.inputs) > 1 and p.inputs[1].name else None
        if op == "Unsqueeze" and axes is None:
            raise _Unknown
        if op == "Unsqueeze":
            out_rank = x.ndim + len(axes)
            axes = sorted(a + out_rank if a < 0 else a for a in axes)
            for a in axes:
                x = np.expand_dims(x, a)
            return x
        return np.squeeze(x, axis=None if axes is None else tuple(a + x.ndim if a < 0 else a for a in axes))
    if op == "Reshape":
        x, shape = need(0), _ints(ins(1))
        if any(isinstance(s, _Dim) for s in shape):
            raise _Unknown
        shape = [x.shape[i] if s == 0 and not at.get("allowzero", 0) else s for i, s in enumerate(shape)]
        return x.reshape(shape)
    if op == "Concat":
        return np.concatenate([need(i) for i in range(len(p.inputs))], axis=at.get("axis", 0))
    if op == "Gather":
        idx = ins(1)
        if idx is None or any(isinstance(i, _Dim) for i in np.asarray(idx).reshape(-1)):
            raise _Unknown
        return np.take(need(0), np.asarray(idx, np.int64), axis=at.get("axis", 0))
    if op == "Mul":
        return _elementwise(_mul, need(0), need(1))
    if op == "Equal":
        return _elementwise(_equal, need(0), need(1))
    if op == "Where":
        cond = need(0)
        if any(isinstance(c, _Dim) for c in cond.reshape(-1)):
            raise _Unknown
        return _elementwise(lambda c, a, b: a if c else b, cond, need(1), need(2))
    if op == "ConstantOfShape":
        shape = _ints(ins(0))
        if any(isinstance(s, _Dim) for s in shape):
            raise _Unknown
        value = at.get("value")
        fill = 0
        if value is not None:
            arr = np.asarray(value.values if isinstance(value, gs.Constant) else
                             onnx.numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value)
            if arr.size != 1 or arr.dtype.kind not in "iub":
                raise _Unknown
            fill = int(arr.reshape(-1)[0])
        out = np.empty(shape, object)
        out.fill(fill)
        return out
    raise _Unknown


def _must(v):
    if v is None:
        raise _Unknown
    return np.asarray(v, object)


# ----------------------------------------------------------------------------------------------------------------
# the K / V repeat (transformers' repeat_kv): Reshape(Expand(Unsqueeze(X, 2), [B, H, rep, x, y]), [B, H rep, x, y])
# ----------------------------------------------------------------------------------------------------------------
def _repeat_nodes(t):
    """(Unsqueeze, Expand, Reshape) when ``t`` is written by Reshape(Expand(Unsqueeze(.))), else None."""
    r = producer(t)
    if not (is_op(r, "Reshape") and len(r.inputs) == 2):
        return None
    e = producer(r.inputs[0])
    if not (is_op(e, "Expand") and len(e.inputs) == 2):
        return None
    u = producer(e.inputs[0])
    if not (is_op(u, "Unsqueeze") and u.inputs):
        return None
    return u, e, r


def _unsqueeze_axes(u, opset):
    if opset < 13:
        return u.attrs.get("axes")
    if len(u.inputs) < 2:
        return None
    v = constant_value(u.inputs[1])
    return None if v is None or v.dtype.kind not in "iu" else [int(a) for a in v.reshape(-1)]


def _repeat(nodes, opset, what):
    """(X, rep) of a repeat (X the rank-4 tensor repeated), or a reason."""
    u, e, r = nodes
    x = u.inputs[0]
    xs = dims(x)
    if xs is None or len(xs) != 4:
        return f"{what} repeat: the rank of {x.name} is {'unknown' if xs is None else len(xs)}, not 4"
    axes = _unsqueeze_axes(u, opset)
    if axes is None or len(axes) != 1 or axes[0] not in (2, -3):
        return f"{what} repeat: Unsqueeze {node_label(u)} has axes {axes}, not [2]"
    us = xs[:2] + [1] + xs[2:]                      # the Unsqueeze output's dims

    def same_dim(v, j, factor=1):
        """``v`` (int or _Dim) is known to be factor x the Unsqueeze output's dim j."""
        if isinstance(v, _Dim):
            if v.tid == id(x):
                at = [0, 1, 3, 4][v.axis] if 0 <= v.axis < 4 else None
            elif v.tid == id(u.outputs[0]):
                at = v.axis
            else:
                return False
            return at == j and v.factor == factor
        k = known_dim(us[j])
        return k is not None and v == k * factor

    shape = _shape_values(e.inputs[1])
    if shape is not None and (shape.ndim != 1 or len(shape) > 5):
        return f"{what} repeat: Expand {node_label(e)} expands to rank {len(shape)}, not 5"
    if shape is not None:
        shape = [1] * (5 - len(shape)) + list(shape)    # Expand aligns a shorter shape to the right
    else:
        es = dims(e.outputs[0])
        if es is None or len(es) != 5 or not all(known_dim(v) for v in es):
            return f"{what} repeat: the shape of Expand {node_label(e)} is not known"
        shape = [int(v) for v in es]     # inferred output dims: each axis proven like a constant shape
    rep = shape[2]
    if isinstance(rep, _Dim) or rep < 1:
        return f"{what} repeat: Expand {node_label(e)} repeats by {_show([rep])[1:-1]}, not a known count"
    for j in (0, 1, 3, 4):
        v = shape[j]
        if not (not isinstance(v, _Dim) and v == 1) and not same_dim(v, j):
            return (f"{what} repeat: Expand {node_label(e)} to {_show(shape)} is not [B, H, rep, x, y] of "
                    f"{x.name}'s dims {xs}")
    copy0 = not r.attrs.get("allowzero", 0)            # a 0 entry copies the input's dim (else it is a 0)
    target = _shape_values(r.inputs[1])
    outs = dims(r.outputs[0])
    if target is None:
        if outs is None or len(outs) != 4:
            return f"{what} repeat: the target of Reshape {node_label(r)} is not known"
        target = [None] * 4
    elif target.ndim != 1 or len(target) != 4:
        return f"{what} repeat: Reshape {node_label(r)} does not reshape to rank 4"
    target = list(target)
    outs = outs if outs is not None and len(outs) == 4 else [None] * 4
    unproven = []
    for i, (v, (j, f)) in enumerate(zip(target, ((0, 1), (1, rep), (3, 1), (4, 1)))):
        ok = v is not None and (same_dim(v, j, f) or (  # 0 copies the Expand output's dim i
            copy0 and not isinstance(v, _Dim) and v == 0 and (i == 0 or (i == 1 and rep == 1))))
        if not ok:                                     # the inferred output dim may prove it
            k, want = known_dim(outs[i]), known_dim(us[j])
            ok = k is not None and want is not None and k == want * f
        if not ok:
            unproven.append(i)
    if len(unproven) > 1:   # one entry left open (-1, computed) is fixed by the element count
        return (f"{what} repeat: Reshape {node_label(r)} to {_show(target)} is not [B, H x {rep}, x, y] of "
                f"{x.name}'s dims {xs}")
    return x, int(rep)


def _show(entries):
    return "[" + ", ".join("?" if v is None else f"{v.factor} x dim {v.axis}" if isinstance(v, _Dim) and v.factor != 1
                           else f"dim {v.axis}" if isinstance(v, _Dim) else str(v) for v in entries) + "]"


def _side(t, opset, what):
    """(X, rep, nodes) for a MatMul input: a repeat of X or X itself (rep 1); or a reason."""
    nodes = _repeat_nodes(t)
    if nodes is None:
        return t, 1, []
    m = _repeat(nodes, opset, what)
    return m if isinstance(m, str) else (m[0], m[1], list(nodes))


def _k_side(kt, opset):
    """(K, rep, nodes) for the first MatMul's second input (Transpose(repeat(K)) or repeat(Transpose(K))), or a
    reason."""
    t = producer(kt)
    if is_op(t, "Transpose"):
        perm = t.attrs.get("perm")
        if perm is None or list(perm) != KT_PERM:
            return f"K^T: Transpose {node_label(t)} has perm {None if perm is None else list(perm)}, not {KT_PERM}"
        m = _side(t.inputs[0], opset, "K")
        return m if isinstance(m, str) else (m[0], m[1], [t] + m[2])
    if _repeat_nodes(kt) is not None:       # the repeat after the Transpose
        m = _side(kt, opset, "K^T")
        if isinstance(m, str):
            return m
        t = producer(m[0])
        if is_op(t, "Transpose"):
            perm = t.attrs.get("perm")
            if perm is None or list(perm) != KT_PERM:
                return (f"K^T: Transpose {node_label(t)} has perm {None if perm is None else list(perm)}, not "
                        f"{KT_PERM}")
            return t.inputs[0], m[1], [t] + m[2]
    what = "a graph input or initializer" if producer(kt) is None else f"{producer(kt).op} {node_label(producer(kt))}"
    return f"the first MatMul's second input {kt.name} is not Transpose(K, perm {KT_PERM}) (written by {what})"


# ----------------------------------------------------------------------------------------------------------------
# matching
# ----------------------------------------------------------------------------------------------------------------
def _reader(t, op, pos=0):
    return next((c for c in t.outputs if is_op(c, op) and len(c.inputs) > pos and c.inputs[pos] is t and c.outputs),
                None)


def _forward(sm):
    """(post Casts, second MatMul) from a Softmax's output, or None when it reaches no MatMul's first input."""
    casts, t = [], sm.outputs[0]
    for _ in range(8):
        mm = _reader(t, "MatMul")
        if mm is not None:
            return casts, mm
        c = _reader(t, "Cast")
        if c is None:
            return None
        casts.append(c)
        t = c.outputs[0]
    return None


def _found(t):
    p = producer(t)
    return "a graph input or initializer" if p is None else f"{p.op} {node_label(p)}"


def _backward(sm):
    """(pre Casts, Add or None, mask or None, scale node or None, scale, divide, MatMul) for a Softmax's input,
    or a reason."""
    casts, t = [], sm.inputs[0]
    while is_op(producer(t), "Cast") and len(casts) < 8:
        casts.insert(0, producer(t))
        t = producer(t).inputs[0]
    add = mask = None
    p = producer(t)
    if is_op(p, "Add") and len(p.inputs) == 2:
        for i in (0, 1):
            q = producer(p.inputs[i])
            if is_op(q, "MatMul") or (is_op(q, "Mul") or is_op(q, "Div")) and any(
                    is_op(producer(x), "MatMul") for x in q.inputs):
                add, mask, t = p, p.inputs[1 - i], p.inputs[i]
                break
        if add is None:
            return (f"the Softmax's input is not [Cast] [Add mask] [Mul / Div scale] MatMul(Q, K^T): Add "
                    f"{node_label(p)} adds {_found(p.inputs[0])} and {_found(p.inputs[1])}")
    p = producer(t)
    scale_node, scale, divide = None, 1.0, False
    if (is_op(p, "Mul") or is_op(p, "Div")) and len(p.inputs) == 2:
        i = next((i for i in (0, 1) if is_op(producer(p.inputs[i]), "MatMul")), None)
        if i is None:
            return (f"the Softmax's input is not [Cast] [Add mask] [Mul / Div scale] MatMul(Q, K^T): {p.op} "
                    f"{node_label(p)} of {_found(p.inputs[0])} and {_found(p.inputs[1])}")
        if p.op == "Div" and i == 1:
            return f"Div {node_label(p)} divides by the scores (c / scores), not the scores by a constant"
        scale_node, divide, c = p, p.op == "Div", p.inputs[1 - i]
        scale = scalar_value(c, max_ndim=4)
        if scale is None:
            return f"the scale {c.name} of {p.op} {node_label(p)} is not a one-element constant (of rank <= 4)"
        et = elem_type(c)
        if et is not None and et not in TYPES:
            return f"the scale {c.name} is {type_name(et)}: KVAttention takes float or float16"
        t = p.inputs[i]
    mm = producer(t)
    if not (is_op(mm, "MatMul") and len(mm.inputs) == 2):
        return f"the Softmax's input is not [Cast] [Add mask] [Mul / Div scale] MatMul(Q, K^T): found {_found(t)}"
    return casts, add, mask, scale_node, scale, divide, mm


def _casts_ok(casts, start, t_type, where):
    """The type after ``casts`` from ``start``, or a reason: each Cast to float or (fp16 model) float16; an fp32
    model may not round to float16."""
    cur = start
    for c in casts:
        to = c.attrs.get("to")
        if to not in TYPES or (t_type == FLOAT and to != FLOAT):
            return f"Cast {node_label(c)} {where} the Softmax is to {type_name(to)} in a {type_name(t_type)} model"
        cur = to
    return cur


def _why_not(g, sm, fwd, max_query):
    """(inputs, output, scale, divide, rep, nodes) of the KVAttention node, or the reason it cannot be one."""
    post, mm2 = fwd
    b = _backward(sm)
    if isinstance(b, str):
        return b
    pre, add, mask, scale_node, scale, divide, mm1 = b
    opset = getattr(g, "opset", None) or 17
    axis = sm.attrs.get("axis", -1 if opset >= 13 else 1)
    q = mm1.inputs[0]
    k_side = _k_side(mm1.inputs[1], opset)
    if isinstance(k_side, str):
        return k_side
    k, rep_k, k_nodes = k_side
    v_side = _side(mm2.inputs[1], opset, "V")
    if isinstance(v_side, str):
        return v_side
    v, rep_v, v_nodes = v_side
    nodes = k_nodes + v_nodes + [mm1] + ([scale_node] if scale_node else []) + ([add] if add else []) + pre + [sm] \
        + post + [mm2]
    out = mm2.outputs[0]

    # ranks, the softmax axis
    shapes = {"Q": dims(q), "K": dims(k), "V": dims(v)}
    for (name, s), x in zip(shapes.items(), (q, k, v)):
        if s is None or len(s) != 4:
            return f"{name} ({x.name}) has rank {'unknown' if s is None else len(s)}, not 4"
    if axis not in (-1, 3):
        return f"Softmax {node_label(sm)} is on axis {axis}, not the last one"

    # types
    ets = [(name, elem_type(x)) for name, x in (("Q", q), ("K", k), ("V", v), ("mask", mask), ("output", out),
                                                 ("scores", mm1.outputs[0])) if x is not None]
    if scale_node is not None:
        ets.append(("scale", elem_type(scale_node.inputs[1] if scale_node.inputs[0] is mm1.outputs[0]
                                       else scale_node.inputs[0])))
    dt = next((et for _, et in ets if et is not None), None)
    if dt is None:
        return "the type of Q is unknown"
    if dt not in TYPES:
        return f"Q is {type_name(dt)}: KVAttention takes float or float16"
    for name, et in ets:
        if et is not None and et != dt:
            return f"{name} is {type_name(et)}, Q is {type_name(dt)}"
    sm_in = _casts_ok(pre, dt, dt, "before")
    if isinstance(sm_in, str):
        return sm_in
    p_type = _casts_ok(post, sm_in, dt, "after")
    if isinstance(p_type, str):
        return p_type
    if p_type != dt:
        return f"P reaches the second MatMul as {type_name(p_type)}, not {type_name(dt)}"

    # heads, batch, K / V shapes
    qs, ks, vs = shapes["Q"], shapes["K"], shapes["V"]
    if rep_k != rep_v:
        return f"K and V are repeated differently (K x{rep_k}, V x{rep_v})"
    for i, what in ((0, "batch size B"), (1, "heads"), (2, "length T"), (3, "head size D")):
        a, c = known_dim(ks[i]), known_dim(vs[i])
        if a and c and a != c:
            return f"K {ks} and V {vs} differ in {what}: KVAttention takes V of K's shape"
    bq, bk = known_dim(qs[0]), known_dim(ks[0]) or known_dim(vs[0])
    if bq and bk and bq != bk:
        return f"Q's batch size {bq} differs from K's {bk}"
    hq, hkv = known_dim(qs[1]), known_dim(ks[1]) or known_dim(vs[1])
    if hq and hkv and hq != rep_k * hkv:
        return (f"Q has {hq} heads, K and V {hkv}" + (f" repeated x{rep_k}" if rep_k > 1 else " (not repeated)") +
                ": not Hq = rep x Hkv")

    # the mask broadcasts to the scores' shape, not beyond
    s_dims = [qs[0], qs[1], qs[2], ks[2]]
    inferred = dims(mm1.outputs[0])
    if inferred is not None and len(inferred) == 4:
        s_dims = [known_dim(a) or known_dim(c) or a for a, c in zip(s_dims, inferred)]
    if max_query:
        s_len = known_dim(s_dims[2])
        if s_len is None or s_len > max_query:
            return (f"the query length S = {s_dims[2] if s_len is None else s_len} is not known to be <= "
                    f"{max_query} (option kvattention_max_query): KVAttention is a decode kernel (one block per "
                    "query row), prompt-length attention stays on onnxruntime's GEMMs")
    if mask is not None:
        ms = dims(mask)
        if ms is None:
            return f"the mask {mask.name} has unknown rank: cannot check that it broadcasts to the scores"
        if len(ms) > 4:
            return f"the mask {mask.name} has rank {len(ms)} > 4: it would broadcast the scores up"
        for m_d, s_d in zip(ms[::-1], s_dims[::-1]):
            m_k, s_k = known_dim(m_d), known_dim(s_d)
            if m_k and m_k != 1 and s_k and s_k != m_k:
                return (f"the mask {mask.name} of shape {ms} does not broadcast to the scores' shape {s_dims}: it "
                        "would broadcast the scores up")
        a_dims = dims(add.outputs[0])
        if a_dims is not None and (len(a_dims) != 4 or any(
                known_dim(a) and known_dim(s) and known_dim(a) != known_dim(s) for a, s in zip(a_dims, s_dims))):
            return f"the masked scores have shape {a_dims}, not the scores' {s_dims}: the mask broadcasts them up"

    # intermediates read only inside the pattern; its inputs computed outside it
    inside = {id(n) for n in nodes}
    inputs = [q, k, v] + ([mask] if mask is not None else [])
    for name, x in zip(("Q", "K", "V", "mask"), inputs):
        if id(producer(x)) in inside:
            return f"{name} ({x.name}) is computed inside the pattern"
    for n in nodes:
        if n is mm2:
            continue
        for t in n.outputs:
            who = [node_label(c) for c in t.outputs if id(c) not in inside]
            who += ["graph output"] if is_graph_output(g, t) else []
            if who:
                return f"intermediate {t.name} ({n.op}) is used elsewhere: {', '.join(who)}"
    return inputs, out, scale, divide, rep_k, nodes



class KVAttentionPass(Pass):
    name = "kvattention"
    default = False     # opt-in: no faster than onnxruntime's kernels in the H100 decode step (docs/passes.md)
    description = ("eager attention (MatMul with Transpose(K), scale, mask, Softmax, MatMul with V; K / V repeats of "
                   "grouped-query attention) -> one KVAttention node")

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        names = Names(graph)
        max_query = options.get("kvattention_max_query", MAX_QUERY)
        if max_query is not None and (isinstance(max_query, bool) or not isinstance(max_query, (int, np.integer))
                                      or max_query < 0):
            raise ValueError(f"kvattention_max_query must be an integer >= 0 (0 or None: no limit), got "
                             f"{max_query!r}")
        for g in iter_graphs(graph):
            order = {id(node): i for i, node in enumerate(g.nodes)}
            for sm in list(g.nodes):
                if not (is_alive(sm) and is_op(sm, "Softmax") and sm.inputs):
                    continue
                fwd = _forward(sm)
                if fwd is None:
                    continue
                m = _why_not(g, sm, fwd, max_query)
                if isinstance(m, str):
                    self.skipped(report, PATTERN, labels_in_order([sm] + fwd[0] + [fwd[1]], order), m)
                    continue
                inputs, out, scale, divide, rep, nodes = m
                for k in nodes:
                    detach(k)
                attrs = {"scale": float(scale)}
                if divide:
                    attrs["divide"] = 1
                new = gs.Node(op="KVAttention", domain=domain.DOMAIN,
                              name=names(scope_stem(fwd[1]) + "KVAttention"), attrs=attrs, inputs=inputs, outputs=[out])
                g.nodes.append(new)
                self.rewritten(report, PATTERN, labels_in_order(nodes, order),
                               "" if len(inputs) == 4 else "no mask",
                               new_node=new.name, scale=float(scale), divide=int(divide), kv_repeat=rep,
                               q=inputs[0].name, k=inputs[1].name, v=inputs[2].name,
                               mask=inputs[3].name if len(inputs) == 4 else None, output=out.name)
