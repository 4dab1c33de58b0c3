"""merge: sibling weight products of one input -> one product and a Split (on by default; option
``merge_siblings=False``, CLI ``--no-merge-siblings``, turns it off).

Attention's q/k/v projections (and any other products reading the same activation) become one MatMul-family node
over the weights concatenated along N, followed by a Split of its output along the last axis into the original
tensors: one kernel launch and one pass over the activation instead of three (a decode step of a 16-layer
LLaMA-style model runs 32 fewer product launches and 16 Splits). Runs after weights4 and ffn, so it merges what
they leave:

- ``MatMul`` with a constant 2-D weight [K, N_i] (same dtype): weights concatenated along axis 1;
- our ``MatMulNF4`` (same quant_type, block_size, accuracy_level, K; every weight but the last holds whole absmax blocks and whole
  bytes, N_i * K % block_size == 0): packed bytes and absmax concatenated (W^T is N-major, so the blocks of the
  merged weight are exactly the blocks of the parts: the same bits as quantising the concatenated weight);
- our ``MatMulAWQ`` (same group_size, K): qweight, qzeros and scales concatenated along axis 1 (per-column groups);
- onnxruntime's ``com.microsoft`` ``MatMulBnb4`` (as MatMulNF4) and ``MatMulNBits`` (same bits, block_size, K; B,
  scales and zero points N-major, concatenated; not with g_idx), so ``--target ort`` models merge too.

Biases: kept (concatenated; zeros for a part without one). The outputs keep their names, so graph outputs and
later consumers are unchanged. Products reading one input with different kinds or attributes are merged per kind.
Everything else (non-constant weights, Gemm, a single product) is left alone;
candidates that cannot be merged are reported as skipped with the reason.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from . import external
from .base import Names, Pass, Report, constant_value, detach, is_alive, iter_graphs, node_label


MS_DOMAIN = "com.microsoft"
# packed products: (domain, op) -> (packed inputs from input 1, bias input index or None, concat axis, absmax blocks
# along the flat N-major weight (parts but the last must hold whole blocks), attributes that must agree)
PACKED = {
    (domain.DOMAIN, "MatMulNF4"): (2, 3, 0, True, ("quant_type", "block_size", "accuracy_level")),
    (domain.DOMAIN, "MatMulAWQ"): (3, 4, 1, False, ("group_size",)),
    (MS_DOMAIN, "MatMulBnb4"): (2, None, 0, True, ("quant_type", "block_size")),
    (MS_DOMAIN, "MatMulNBits"): (3, 5, 0, False, ("bits", "block_size", "accuracy_level")),
}


def _present(node, i):
    return len(node.inputs) > i and not (isinstance(node.inputs[i], gs.Variable) and not node.inputs[i].name)


def _candidate(node):
    """A product the merge may take (its weights not read yet)."""
    return (node.op == "MatMul" and not node.domain and len(node.inputs) == 2) or (node.domain, node.op) in PACKED


def _kind(node):
    """(group key, weights) of a mergeable product, else (None, reason or None)."""
    if node.op == "MatMul" and not node.domain and len(node.inputs) == 2:
        w = constant_value(node.inputs[1])
        if w is None or w.ndim != 2:
            return None, None           # activations times activations (attention): not a weight product
        return ("MatMul", str(w.dtype), int(w.shape[0])), {"w": w, "n": int(w.shape[1])}
    spec = PACKED.get((node.domain, node.op))
    if spec is None:
        return None, None
    npk, bias_at, _, _, agree = spec
    if node.op == "MatMulNBits":
        if _present(node, 4):
            return None, "g_idx given (act-order): columns are not contiguous blocks"
        npk = 3 if _present(node, 3) else 2                 # zero points optional
    vals = [constant_value(t) for t in node.inputs[1:1 + npk]]
    if any(v is None for v in vals):
        return None, "packed weights are not constants"
    bias = constant_value(node.inputs[bias_at]) if bias_at is not None and _present(node, bias_at) else None
    if bias_at is not None and _present(node, bias_at) and bias is None:
        return None, "bias is not a constant"
    key = (node.op, node.domain, npk, int(node.attrs["K"])) + tuple(str(node.attrs.get(a)) for a in agree)
    return key, {"vals": vals, "n": int(node.attrs["N"]), "bias": bias}


class MergePass(Pass):
    name = "merge"
    description = ("products of one input with constant weights (q/k/v) -> one product + Split "
                   "(off: --no-merge-siblings)")

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        if not options.get("merge_siblings", True):
            return
        self.spill = options.get("spill")
        self.names = Names(graph)
        for g in iter_graphs(graph):
            # parts in graph order (q, k, v as exported; a consumer list follows the order in which earlier passes
            # attached nodes): rotarykv needs the packed product as q, then k, then v
            pos = {id(n): i for i, n in enumerate(g.nodes)}
            for x in list(g.tensors().values()):
                cands = [n for n in x.outputs if is_alive(n) and n.inputs and n.inputs[0] is x and _candidate(n)]
                cands.sort(key=lambda n: pos.get(id(n), len(pos)))
                if len(cands) < 2:      # read no weights for a product without a sibling
                    continue
                groups = {}
                for node in cands:
                    key, info = _kind(node)
                    if key is not None:
                        groups.setdefault(key, []).append((node, info))
                    elif info:          # a product the merge cannot read
                        self.skipped(report, f"{node.op} sibling", [node_label(node)], info)
                for key, members in groups.items():
                    if len(members) > 1:
                        self._merge(g, x, key, members, report)

    def _const(self, base, array):
        return external.constant(self.names(f"{base}_merged_w"), np.ascontiguousarray(array), self.spill)

    def _merge(self, g, x, key, members, report):
        op = key[0]
        nodes = [m[0] for m in members]
        ns = [m[1]["n"] for m in members]
        labels = [node_label(n) for n in nodes]
        base = nodes[0].name or nodes[0].outputs[0].name
        if g.opset < 11:
            self.skipped(report, f"{op} siblings", labels, f"opset {g.opset} < 11: Split has no negative axis")
            return
        spec = PACKED.get((nodes[0].domain, op))
        if spec is not None and spec[3]:
            bs, k = int(nodes[0].attrs["block_size"]), int(nodes[0].attrs["K"])
            if any((n * k) % bs or (n * k) % 2 for n in ns[:-1]):
                self.skipped(report, f"{op} siblings", labels,
                             "a weight's N*K is not a whole number of absmax blocks: blocks would straddle parts")
                return
        out_dtype = nodes[0].outputs[0].dtype
        y = gs.Variable(self.names(f"{base}_merged_out"), dtype=out_dtype)
        attrs = dict(nodes[0].attrs)
        if op == "MatMul":
            inputs = [x, self._const(base, np.concatenate([m[1]["w"] for m in members], axis=1))]
            new = gs.Node(op="MatMul", name=self.names(f"{base}_merged"), inputs=inputs, outputs=[y])
        else:   # every packed layout is N-major along its concat axis (AWQ: axis 1 of [K, N/8] / [K/G, N])
            npk, bias_at, axis = len(members[0][1]["vals"]), spec[1], spec[2]
            parts = [np.concatenate([m[1]["vals"][i] for m in members], axis=axis) for i in range(npk)]
            inputs = [x] + [self._const(base, p) for p in parts]
            if any(m[1]["bias"] is not None for m in members):
                bdt = next(m[1]["bias"].dtype for m in members if m[1]["bias"] is not None)
                inputs += [gs.Variable.empty()] * (bias_at - len(inputs))     # MatMulNBits: zero points, g_idx
                inputs.append(self._const(base, np.concatenate(
                    [m[1]["bias"].reshape(-1).astype(bdt) if m[1]["bias"] is not None else np.zeros(m[1]["n"], bdt)
                     for m in members])))
            attrs["N"] = int(sum(ns))
            new = gs.Node(op=op, domain=nodes[0].domain, name=self.names(f"{base}_merged"), attrs=attrs,
                          inputs=inputs, outputs=[y])
        outs = [n.outputs[0] for n in nodes]
        if g.opset >= 13:
            split = gs.Node(op="Split", name=self.names(f"{base}_merged_split"), attrs={"axis": -1},
                            inputs=[y, self._const(base, np.asarray(ns, np.int64))], outputs=outs)
        else:
            split = gs.Node(op="Split", name=self.names(f"{base}_merged_split"), attrs={"axis": -1, "split": ns},
                            inputs=[y], outputs=outs)
        for n in nodes:
            detach(n)
        g.nodes.extend([new, split])
        self.rewritten(report, f"{op} x{len(nodes)} siblings", labels, new_node=new.name, n=ns)
