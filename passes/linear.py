"""Constant-weight linear layers, as the weights4 and ffn passes find them: ``match`` recognises MatMul / Gemm nodes
whose weight is a constant (an initializer or a Constant-node output, optionally behind a Transpose; Gemm's
transB, alpha and C folded) and returns a ``Linear`` (the node, its activation, the [K, N] weight, the bias) or the
reason it is skipped; ``following_bias`` finds a MatMul's constant bias Add. Spellings: passes/weights4.py's
docstring."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .base import constant_value, elem_type, is_alive, is_graph_output, node_label, producer, single_consumer

FLOAT = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}


@dataclass
class Linear:
    node: gs.Node
    spelling: str          # e.g. "MatMul(A, Transpose(W))"
    a: object              # the activation input
    out: object            # the tensor the new op writes
    value: np.ndarray      # the weight as stored (float32 or float16)
    transpose: bool        # value is [N, K] (a Transpose node, or Gemm transB=1, but not both)
    alpha: float           # Gemm alpha, folded into the weight
    stored: object         # the constant tensor holding the weight (initializer / Constant output)
    weight_name: str
    w_node: gs.Node | None  # the Transpose / Constant node between the constant and the op, if any
    bias: np.ndarray | None = None
    bias_add: gs.Node | None = None   # a MatMul's following Add whose constant is the bias
    flat: bool = False     # MatMul whose A has an unknown rank or rank 1 (match(any_rank=True)): run on A as [-1, K]
    _w: np.ndarray | None = None

    @property
    def dtype(self):
        return self.value.dtype.type

    @property
    def bytes_before(self) -> int:
        return int(self.value.nbytes)

    @property
    def size(self) -> int:
        return int(self.value.size)

    @property
    def K(self):  # noqa: N802
        return self.value.shape[1 if self.transpose else 0]

    @property
    def N(self):  # noqa: N802
        return self.value.shape[0 if self.transpose else 1]

    @property
    def w(self) -> np.ndarray:
        """The effective [K, N] weight in float32 (alpha folded), built on first use."""
        if self._w is None:
            w = self.value.T if self.transpose else self.value
            w = np.ascontiguousarray(w, dtype=np.float32)
            if self.alpha != 1.0:
                w = w * np.float32(self.alpha)
            self._w = w
        return self._w


def constant_weight(t):
    """(value as stored, stored tensor, via node, transposed) for a constant or a Transpose of a constant."""
    v = constant_value(t)
    if v is not None:
        return v, t, producer(t), False
    p = producer(t)
    if p is not None and p.op == "Transpose" and not p.domain and is_alive(p) and p.inputs:
        src = p.inputs[0]
        v = constant_value(src)
        perm = p.attrs.get("perm")
        if v is not None and v.ndim == 2 and (perm is None or list(perm) == [1, 0]):
            return v, src, p, True
    return None


def source(t) -> str:
    p = producer(t)
    if p is None:
        return "a graph input" if not isinstance(t, gs.Constant) else "a constant"
    return f"{p.op} {node_label(p)!r}"


def rank(t):
    shape = getattr(t, "shape", None)
    return None if shape is None else len(shape)


def bias_vector(v: np.ndarray, n: int, max_rank: int | None):
    """A bias-shaped constant as a [N] vector: a scalar, [N], or [1, .., 1, N] of rank <= max_rank; else None."""
    if v.size == 1 and (max_rank is None or v.ndim <= max_rank):
        return np.full(n, v.reshape(-1)[0], dtype=v.dtype)
    if v.ndim >= 1 and v.shape[-1] == n and v.size == n and (max_rank is None or v.ndim <= max_rank):
        return v.reshape(n)
    return None


class Skip(Exception):
    pass


def match(node: gs.Node, any_rank: bool = False):
    """(Linear, None) for a candidate, (None, (spelling, reason)) for a skipped one, (None, None) for no match.
    ``any_rank``: a MatMul whose A has an unknown rank or rank 1 is a candidate too (``flat`` set: the caller runs
    its op on A reshaped to [-1, K]); otherwise it is skipped."""
    if node.domain or node.op not in ("MatMul", "Gemm") or not is_alive(node) or len(node.outputs) != 1:
        return None, None
    ins = node.inputs
    if len(ins) < 2:
        return None, None
    a, b = ins[0], ins[1]
    spelling = f"{node.op}(A, W)"
    try:
        found = constant_weight(b)
        if found is None:
            raise Skip(f"weight (input B {b.name!r}) is not a constant: computed by {source(b)}")
        value, stored, via, transposed = found
        if via is not None and via.op == "Transpose":
            spelling = f"{node.op}(A, Transpose(W))"
        elif via is not None:
            spelling = f"{node.op}(A, Constant W)"
        if value.ndim != 2:
            raise Skip(f"weight {stored.name!r} has shape {list(value.shape)}, not 2-D")
        if value.dtype not in (np.float32, np.float16):
            raise Skip(f"weight {stored.name!r} is {value.dtype}, not float32/float16")
        et = elem_type(a)
        if et is not None and FLOAT.get(et) != value.dtype.type:
            raise Skip(f"A is {onnx.TensorProto.DataType.Name(et).lower()}, the weight {value.dtype}")
        transpose, alpha, bias = transposed, 1.0, None
        n_out = value.shape[0 if transposed else 1]
        if node.op == "Gemm":
            at = node.attrs
            alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
            if int(at.get("transA", 0)):
                raise Skip("Gemm with transA=1")
            if int(at.get("transB", 0)):
                transpose = not transpose
                n_out = value.shape[0 if transpose else 1]
                spelling = f"Gemm(A, {'Transpose(W)' if transposed else 'W'}, transB=1)"
            if len(ins) > 2 and ins[2].name:
                c = constant_value(ins[2])
                if c is None:
                    raise Skip(f"Gemm bias C {ins[2].name!r} is not a constant (computed by {source(ins[2])})")
                vec = bias_vector(np.asarray(c), n_out, 2)
                if vec is None:
                    raise Skip(f"Gemm C of shape {list(np.shape(c))} is not a bias (a scalar, [N] or [1, N] "
                                f"with N={n_out})")
                bias = (vec.astype(np.float32) * np.float32(beta)).astype(value.dtype) if beta != 1.0 else \
                    vec.astype(value.dtype)
                spelling += " + C"
        flat = False
        if node.op == "MatMul":
            r = rank(a)
            if r is None or r < 2:
                if not any_rank:
                    raise Skip("rank of A unknown (shape inference gave none)" if r is None else
                               f"A has rank {r}; a rank >= 2 A is needed")
                flat = True
        cand = Linear(node=node, spelling=spelling, a=a, out=node.outputs[0], value=value, transpose=transpose,
                      alpha=alpha, stored=stored, weight_name=stored.name, w_node=via, bias=bias, flat=flat)
        return cand, None
    except Skip as e:
        return None, (spelling, str(e))


def following_bias(graph: gs.Graph, cand: Linear):
    """A MatMul's single following Add with a constant bias [N] (as (Add node, vector)), else None."""
    y = cand.out
    add = single_consumer(y)
    if add is None or add.op != "Add" or add.domain or not is_alive(add) or is_graph_output(graph, y):
        return None
    other = [t for t in add.inputs if t is not y]
    if len(other) != 1 or len(add.outputs) != 1:
        return None
    v = constant_value(other[0])
    if v is None or v.dtype.type is not cand.dtype:
        return None
    r = 1 if cand.flat else rank(cand.a)  # a bias of higher rank than A would broadcast the output's rank up
    vec = bias_vector(np.asarray(v), cand.N, r)
    return None if vec is None else (add, vec)
