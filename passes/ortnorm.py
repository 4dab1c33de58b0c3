"""ortnorm: onnxruntime's fused RMS norms as onnxruntime-genai's model builder writes them -> ``RMSNorm``
(onnx_lowbit.rmsnorm). Opt-in for ``rewrite``; ``onnx-lowbit genai`` runs it by default for folders that run on
CUDA, with the option ``ortnorm_vector_only``: only fp16 norms of D % 8 == 0, D <= VECTOR_MAX, the rows RMSNorm's
CUDA vector kernel takes (custom_ops/attention/rmsnorm_cuda.py). There RMSNorm is a programmatic dependent launch
that lets the next product stream its weights while it runs (onnxruntime's norm kernels never let the next kernel
start early): genai's loop on the H200 1.54-1.56x genai int4's decode against 1.47x with onnxruntime's norms in the
same run (BENCHMARKS.md, genai's loop). Other norms (fp32, odd D, rows past 8192) would run on RMSNorm's register
or two-pass kernel, ~1.8 us per norm slower than onnxruntime's (docs/lab-log.md), so the option leaves them to
onnxruntime (buffers that are not 16-byte aligned also take the register kernel, at run time; onnxruntime's
allocations are).

Matched:

    com.microsoft SkipSimplifiedLayerNormalization(input, skip, gamma) -> (output, [mean], [inv_std_var], [sum])
        -> RMSNorm(input, gamma, skip) -> (output, sum)          (sum: input + skip, the residual stream)
    SimplifiedLayerNormalization(X, scale; axis = -1) -> (Y, [inv_std_var])
        -> RMSNorm(X, scale) -> (Y)

with epsilon kept (absent: onnxruntime's defaults, 1e-12 for the skip form, 1e-5 for the plain one). A candidate is
skipped (and reported) when: it has a bias input, its mean / inv_std_var outputs are read or are graph outputs, the
normalised axis is not the last one, the input type is not float / float16, gamma (scale) is not a constant [D] of
the input's type, or skip's shape is known to differ from the input's (RMSNorm does not broadcast skip as
onnxruntime's kernel does for [1, S, D] or [S, D]; unknown shapes pass: the kernels check them at run time and
name a mismatch).

Numerics: RMSNorm rounds H = input + skip to T and normalises float32(H); onnxruntime's kernels normalise the fp32
sum before rounding and, for fp16, multiply by gamma in fp32 (one rounding at the end, where RMSNorm rounds the
normalised value, then the product): results agree within an fp16 ulp or two of the output, the residual sums
bit-equal (tests/test_pass_ortnorm.py, CPU sessions).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from .base import (Names, Pass, Report, constant_value, detach, dims, elem_type, is_alive, is_graph_output,
                   iter_graphs, known_dim, node_label, producer, type_name)

SKIP, PLAIN = "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"
PATTERNS = {SKIP: "ortnorm: SkipSimplifiedLayerNormalization", PLAIN: "ortnorm: SimplifiedLayerNormalization"}
FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
# onnxruntime's schema defaults when a node has no epsilon attribute (kDefaultSkipLayerNormEpsilon for the skip form)
DEFAULT_EPS = {SKIP: 1e-12, PLAIN: 1e-5}
VECTOR_MAX = 8192   # the vector kernel's longest row: rmsnorm_cuda.VEC_MAX (tests/test_pass_ortnorm.py checks it)


def _kind(node):
    """SKIP or PLAIN for the node kinds this pass takes, else None."""
    if node.op == SKIP and node.domain == "com.microsoft":
        return SKIP
    if node.op == PLAIN and node.domain in (None, "", "ai.onnx", "com.microsoft"):
        return PLAIN
    return None


def _read(g, t) -> bool:
    """Whether tensor ``t`` (an optional output) is read by a node or is a graph output."""
    return t is not None and t.name != "" and (len(t.outputs) > 0 or is_graph_output(g, t))


def _may_equal(a, b) -> bool:
    """False where the shapes are known to differ (a rank, or two dims that are numbers or symbols); unknown
    shapes pass (the kernels check X and skip at run time and name a mismatch)."""
    da, db = dims(a), dims(b)
    if da is None or db is None:
        return True
    if len(da) != len(db):
        return False
    return all(not (isinstance(x, (int, np.integer, str)) and isinstance(y, (int, np.integer, str))) or x == y
               for x, y in zip(da, db))


def why_not(g, node, kind):
    """The reason ``node`` cannot become an RMSNorm, or None."""
    ins = list(node.inputs)
    x = ins[0] if ins else None
    if x is None:
        return "no input"
    dt = elem_type(x)
    if dt not in (FLOAT, FLOAT16):
        return f"the input is {type_name(dt) if dt is not None else 'of unknown type'}: RMSNorm takes float or float16"
    xs = dims(x)
    if not xs:
        return "the input's rank is unknown"
    d = known_dim(xs[-1])
    if d is None:
        return "the input's last dim D is unknown"
    gi = 2 if kind == SKIP else 1
    if len(ins) <= gi:
        return "no gamma input"
    gamma = ins[gi]
    gv = constant_value(gamma)
    if gv is None:
        return f"gamma {gamma.name} is not a constant"
    if list(gv.shape) != [d]:
        return f"gamma has shape {list(gv.shape)}, not [D] = [{d}]"
    if gv.dtype != np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dt)):
        return f"gamma is {gv.dtype}, the input is {type_name(dt)}"
    if kind == SKIP:
        if len(ins) > 3 and ins[3] is not None and ins[3].name != "":
            return "it has a bias input (RMSNorm adds skip only)"
        skip = ins[1]
        if elem_type(skip) != dt:
            return f"skip is {type_name(elem_type(skip))}, the input is {type_name(dt)}"
        if not _may_equal(x, skip):
            return f"skip's shape {dims(skip)} is not the input's {xs} (RMSNorm does not broadcast)"
        extra = [o for o in node.outputs[1:3] if _read(g, o)]
    else:
        axis = int(node.attrs.get("axis", -1))
        if axis not in (-1, len(xs) - 1):
            return f"axis {axis} is not the last axis"
        extra = [o for o in node.outputs[1:2] if _read(g, o)]
    if extra:
        return f"its statistics output {extra[0].name} is read (RMSNorm does not write it)"
    return None


def why_not_vector(node):
    """With the option ortnorm_vector_only (``onnx-lowbit genai``'s CUDA default): why RMSNorm's CUDA vector
    kernel would not take this norm's rows, or None."""
    x = node.inputs[0]
    if elem_type(x) != FLOAT16:
        return f"{type_name(elem_type(x))} rows: RMSNorm's CUDA vector kernel is fp16 (ortnorm_vector_only)"
    d = known_dim(dims(x)[-1])
    if d % 8 or d > VECTOR_MAX:
        return (f"D = {d}: RMSNorm's CUDA vector kernel takes multiples of 8 up to {VECTOR_MAX} "
                "(ortnorm_vector_only)")
    return None


class OrtNormPass(Pass):
    name = "ortnorm"
    default = False     # opt-in for rewrite; onnx-lowbit genai's CUDA default (genai_config.CUDA_PASSES)
    description = ("onnxruntime's SkipSimplifiedLayerNormalization / SimplifiedLayerNormalization (genai's norms) "
                   "-> RMSNorm")

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        names = Names(graph)
        vector_only = bool(options.get("ortnorm_vector_only", False))
        for g in iter_graphs(graph):
            for node in list(g.nodes):
                kind = _kind(node) if is_alive(node) else None
                if kind is None:
                    continue
                why = why_not(g, node, kind) or (why_not_vector(node) if vector_only else None)
                if why:
                    self.skipped(report, PATTERNS[kind], [node_label(node)], why)
                    continue
                eps = float(node.attrs.get("epsilon", DEFAULT_EPS[kind]))
                ins, outs = list(node.inputs), list(node.outputs)
                out = outs[0]
                if kind == SKIP:
                    h = outs[3] if len(outs) > 3 and _read(g, outs[3]) else None
                    inputs = [ins[0], ins[2], ins[1]]
                else:
                    h, inputs = None, [ins[0], ins[1]]
                label = node_label(node)
                detach(node)
                new = gs.Node(op="RMSNorm", domain=domain.DOMAIN, name=names((node.name or out.name) + "_rmsnorm"),
                              attrs={"epsilon": eps}, inputs=inputs, outputs=[out] + ([h] if h is not None else []))
                g.nodes.append(new)
                self.rewritten(report, PATTERNS[kind], [label], "", new_node=new.name, input=ins[0].name,
                               epsilon=eps, residual="yes" if h is not None else "no")
