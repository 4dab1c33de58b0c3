"""Graph plumbing of the weights4 pass (passes/weights4.py) around the op it emits:

* ``pad_columns``: AWQ packs 8 output columns per int32, so a weight whose N is not a multiple of 8 is quantised
  with zero columns appended (they quantise to exactly 0) and the op runs with the padded N; ``slice_columns``
  adds the Slice that gives the model its N columns back. No kernel needs to know.
* ``flatten_around``: a MatMul whose A has an unknown rank (shape inference gave none: exporters that keep weights
  in Constant nodes) or rank 1 is quantised as ``Reshape(A, [-1, K])`` -> op -> ``Reshape(., shape(A)[:-1] + [N])``,
  which is MatMul's result for every rank of A (rank 1 included: shape(A)[:-1] is empty).
* ``fold_plan`` / ``apply_plan``: AWQ's activation scale folded into the op producing A (its weight and bias
  columns, a norm's scale and bias, a constant Mul), see the weights4 docstring.
* ``head_reason``: the weight that turns the last hidden state into logits over a vocabulary (an LLM's lm_head):
  N >= HEAD_MIN_N columns, and tied to an embedding table (a Gather reads the same constant, or a constant equal
  to its transpose), or named lm_head, or writing a graph output named like logits. 4-bit rounding of this one weight costs more
  accuracy than all the others (issue 33: SmolLM2-135M, perplexity +68% with it quantised, +29% without), and a
  tied one must stay in float for the embedding anyway, so the pass keeps it in float unless told otherwise.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .base import (Names, constant_value, graph_output_names, is_alive, is_graph_output, node_label, producer,
                   single_consumer)
from .linear import rank

MS_DOMAIN = "com.microsoft"
PACK = 8             # AWQ columns per int32
HEAD_MIN_N = 1024    # a vocabulary: output heads narrower than this (classifiers, projections) are not lm_heads


def padding(n: int) -> int:
    """Zero columns to append to N for AWQ's packing."""
    return (-int(n)) % PACK


def pad_columns(w: np.ndarray, extra: int) -> np.ndarray:
    """[K, N] -> [K, N + extra] with zero columns (``w`` itself when extra == 0)."""
    if not extra:
        return w
    return np.concatenate([w, np.zeros((w.shape[0], extra), w.dtype)], axis=1)


def _opset(g: gs.Graph) -> int:
    return int(getattr(g, "opset", None) or 13)


def _int64(names, base: str, values) -> gs.Constant:
    return gs.Constant(names(base), np.asarray(values, np.int64))


def slice_columns(g: gs.Graph, names, y: gs.Variable, out: gs.Variable, n: int, axis: int) -> gs.Node:
    """Slice(y)[..., :n] along ``axis`` (>= 0) written into ``out``."""
    label = names(f"{out.name}_unpad")
    if _opset(g) < 10:  # Slice-1: starts / ends / axes as attributes
        node = gs.Node("Slice", name=label, inputs=[y], outputs=[out], attrs=dict(starts=[0], ends=[n], axes=[axis]))
    else:
        node = gs.Node("Slice", name=label, inputs=[y, _int64(names, f"{label}_starts", [0]),
                                                    _int64(names, f"{label}_ends", [n]),
                                                    _int64(names, f"{label}_axes", [axis])], outputs=[out])
    g.nodes.append(node)
    return node


def flatten_around(g: gs.Graph, names, op: gs.Node, a: gs.Variable, y2d: gs.Variable, out: gs.Variable,
                   k: int, n: int) -> list:
    """Makes ``op`` (reading a tensor of A's shape as input 0, writing ``y2d``) run on A flattened to [-1, K] and
    reshapes its result into ``out`` = shape(A)[:-1] + [N]. Returns the new nodes."""
    label = names(f"{op.name}_2d")
    dtype = out.dtype if out.dtype is not None else None
    a2 = gs.Variable(names(f"{label}_a"), dtype=dtype)
    nodes = [gs.Node("Reshape", name=names(f"{label}_in"), inputs=[op.inputs[0], _int64(names, f"{label}_kshape",
                                                                                        [-1, k])], outputs=[a2])]
    op.inputs[0] = a2
    shape = gs.Variable(names(f"{label}_ashape"), dtype=np.int64)
    lead = gs.Variable(names(f"{label}_lead"), dtype=np.int64)
    target = gs.Variable(names(f"{label}_yshape"), dtype=np.int64)
    nodes.append(gs.Node("Shape", name=names(f"{label}_shape"), inputs=[a], outputs=[shape]))
    if _opset(g) < 10:
        nodes.append(gs.Node("Slice", name=names(f"{label}_slice"), inputs=[shape], outputs=[lead],
                             attrs=dict(starts=[0], ends=[-1], axes=[0])))
    else:
        nodes.append(gs.Node("Slice", name=names(f"{label}_slice"), outputs=[lead],
                             inputs=[shape, _int64(names, f"{label}_s0", [0]), _int64(names, f"{label}_s1", [-1]),
                                     _int64(names, f"{label}_s2", [0])]))
    nodes.append(gs.Node("Concat", name=names(f"{label}_concat"), inputs=[lead, _int64(names, f"{label}_n", [n])],
                         outputs=[target], attrs=dict(axis=0)))
    nodes.append(gs.Node("Reshape", name=names(f"{label}_out"), inputs=[y2d, target], outputs=[out]))
    g.nodes.extend(nodes)
    return nodes


def _tied_gather(cand) -> gs.Node | None:
    """A Gather reading cand's weight as its table: the same constant, or (exports that fold lm_head's Transpose
    into a second initializer) a constant whose values equal the weight transposed."""
    for c in cand.stored.outputs:
        if is_alive(c) and c.op == "Gather" and not c.domain and c.inputs and c.inputs[0] is cand.stored:
            return c
    return None


def _equal_table(g: gs.Graph, cand) -> gs.Node | None:
    want = (cand.N, cand.K)
    for node in g.nodes:
        if node.op != "Gather" or node.domain or not is_alive(node) or not node.inputs:
            continue
        table = node.inputs[0]
        shape = getattr(table, "shape", None)
        if shape is None or tuple(shape) != want or table is cand.stored:
            continue
        v = constant_value(table)
        if v is not None and v.dtype == cand.value.dtype and \
                np.array_equal(v, cand.value if cand.transpose else cand.value.T):
            return node
    return None


def store_head(g: gs.Graph, names, const, cand, fp16: bool) -> str:
    """Stores the kept head's weight once: when the export holds a second copy of the embedding table for it
    (TorchScript folds lm_head's Transpose into a new initializer), the head reads the table through a Transpose
    instead; with ``fp16`` (float32 models) the one table is stored in fp16 (``const(name, array)`` makes the
    constant) and Cast to float32 in the graph. Returns a note for the report."""
    notes = []
    table = cand.stored
    other = _equal_table(g, cand) if _tied_gather(cand) is None else None
    if other is not None:   # MatMul(A, W) with W == table^T: MatMul(A, Transpose(table)); W's copy becomes dead
        table = other.inputs[0]
        t = gs.Variable(names(f"{table.name}_T"), dtype=cand.value.dtype)
        g.nodes.append(gs.Node("Transpose", name=names(f"{cand.node.name or 'head'}_table_T"), inputs=[table],
                               outputs=[t], attrs=dict(perm=[1, 0])))
        cand.node.inputs[1] = t
        notes.append(f"reads the embedding table {table.name!r} (Transpose): its copy {cand.stored.name!r} is "
                     "dropped")
    value = constant_value(table) if fp16 and isinstance(table, gs.Constant) else None
    if value is not None and value.dtype == np.float32:
        t16 = const(f"{table.name}_fp16", value.astype(np.float16))
        t32 = gs.Variable(names(f"{table.name}_f32"), dtype=np.float32, shape=list(value.shape))
        for node in list(table.outputs):
            if is_alive(node):
                for i, x in enumerate(list(node.inputs)):
                    if x is table:
                        node.inputs[i] = t32
        g.nodes.append(gs.Node("Cast", name=names(f"{table.name}_cast"), inputs=[t16], outputs=[t32],
                               attrs=dict(to=1)))
        notes.append(f"stored in fp16 ({value.nbytes // 2} bytes), Cast to float")
    return "; ".join(notes)


def head_reason(g: gs.Graph, cand, module_path: str | None) -> str | None:
    """Why ``cand`` is the model's output head over a vocabulary (module docstring), or None."""
    if cand.N < HEAD_MIN_N:
        return None
    tied = _tied_gather(cand) or _equal_table(g, cand)
    if tied is not None:
        return f"tied to the embedding table of Gather {node_label(tied)!r}"
    names = [x for x in (cand.node.name, cand.weight_name, module_path) if x]
    if any("lm_head" in x for x in names):
        return "named lm_head"
    if cand.out.name in graph_output_names(g) and "logit" in cand.out.name.lower():
        return f"writes the graph output {cand.out.name!r} (N={cand.N})"
    return None


_NORM_OPS = {("", "LayerNormalization"): (1, 2), ("", "RMSNormalization"): (1, None),
             (MS_DOMAIN, "SimplifiedLayerNormalization"): (1, None), (MS_DOMAIN, "LayerNormalization"): (1, 2)}


def _channel_scaled(v: np.ndarray, inv: np.ndarray, axis: int) -> np.ndarray:
    """``v`` with its channels along ``axis`` (-1: the last) multiplied by ``inv``, in v's dtype."""
    shape = [1] * v.ndim
    shape[axis] = -1
    return np.ascontiguousarray((v.astype(np.float64) * inv.reshape(shape)).astype(v.dtype))


def fold_plan(p: gs.Node, g: gs.Graph, inv: np.ndarray, k: int, depth: int = 0):
    """How to multiply the K output channels of A's producer ``p`` by ``inv``, by rewriting its constants:
    ([(node, input index, new value)], description), or None when ``p`` is not foldable."""
    dom = p.domain or ""
    if not is_alive(p) or any(t.outputs or is_graph_output(g, t) for t in p.outputs[1:]):
        return None
    if dom == "" and p.op == "MatMul" and len(p.inputs) == 2:
        w = constant_value(p.inputs[1])
        if w is None or w.ndim != 2 or w.shape[1] != k:
            return None
        return [(p, 1, _channel_scaled(w, inv, -1))], f"the weight of MatMul {node_label(p)!r}"
    if dom == "" and p.op == "Gemm" and len(p.inputs) >= 2 and not int(p.attrs.get("transA", 0)):
        w = constant_value(p.inputs[1])
        trans_b = int(p.attrs.get("transB", 0))
        if w is None or w.ndim != 2 or (w.shape[0] if trans_b else w.shape[1]) != k:
            return None
        plan = [(p, 1, _channel_scaled(w, inv, 0 if trans_b else -1))]
        if len(p.inputs) > 2 and p.inputs[2].name:
            c = constant_value(p.inputs[2])
            if c is None or c.ndim > 2 or not (c.size == 1 or c.shape[-1] == k):
                return None
            c = np.broadcast_to(c, c.shape[:-1] + (k,)) if c.ndim else np.full(k, c, dtype=c.dtype)
            plan.append((p, 2, _channel_scaled(c, inv, -1)))
        return plan, f"the weight{' and bias' if len(plan) > 1 else ''} of Gemm {node_label(p)!r}"
    if (dom, p.op) in _NORM_OPS:
        if int(p.attrs.get("axis", -1)) != -1:
            return None
        plan = []
        for i in _NORM_OPS[(dom, p.op)]:
            if i is None or len(p.inputs) <= i or not p.inputs[i].name:
                continue
            v = constant_value(p.inputs[i])
            if v is None or v.size != k or v.shape[-1] != k:
                return None
            plan.append((p, i, _channel_scaled(v, inv, -1)))
        if not plan:
            return None
        return plan, f"the scale{' and bias' if len(plan) > 1 else ''} of {p.op} {node_label(p)!r}"
    if dom == "" and p.op in ("Mul", "Add") and len(p.inputs) == 2:
        for i in (0, 1):
            v, other = constant_value(p.inputs[i]), p.inputs[1 - i]
            r = rank(other)
            if v is None or constant_value(other) is not None or v.size != k or v.shape[-1] != k or \
                    r is None or v.ndim > r:
                continue
            if p.op == "Mul":  # a per-channel scale (e.g. a decomposed norm's gamma)
                return [(p, i, _channel_scaled(v, inv, -1))], f"the constant of Mul {node_label(p)!r}"
            # Add(bias): also scale what is added to, when its producer folds (MatMul/Gemm/Mul before a bias)
            q = producer(other)
            if depth or q is None or single_consumer(other) is not p or is_graph_output(g, other):
                return None
            inner = fold_plan(q, g, inv, k, depth + 1)
            if inner is None:
                return None
            return inner[0] + [(p, i, _channel_scaled(v, inv, -1))], f"{inner[1]} and the bias of Add {node_label(p)!r}"
    return None


def apply_plan(plan, names: Names) -> None:
    for node, i, value in plan:
        node.inputs[i] = gs.Constant(names(f"{node.inputs[i].name}_awq"), value)
