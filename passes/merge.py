"""merge: sibling weight products of one input -> one product and a Split (option ``merge_siblings``; off by default).

Attention's q/k/v projections (and any other products reading the same activation) become one MatMul-family node
over the weights concatenated along N, followed by a Split of its output along the last axis into the original
tensors: one kernel launch and one pass over the activation instead of three (a decode step of a LLaMA-style model
runs 48 fewer launches). Runs after weights4 and ffn, so it merges what they leave:

- ``MatMul`` with a constant 2-D weight [K, N_i] (same dtype): weights concatenated along axis 1;
- our ``MatMulNF4`` (same quant_type, block_size, K; every weight but the last holds whole absmax blocks and whole
  bytes, N_i * K % block_size == 0): packed bytes and absmax concatenated (W^T is N-major, so the blocks of the
  merged weight are exactly the blocks of the parts: the same bits as quantising the concatenated weight);
- our ``MatMulAWQ`` (same group_size, K): qweight, qzeros and scales concatenated along axis 1 (per-column groups).

Biases: kept (concatenated; zeros for a part without one). The outputs keep their names, so graph outputs and
later consumers are unchanged. Products reading one input with different kinds or attributes are merged per kind.
Everything else (non-constant weights, Gemm, onnxruntime's com.microsoft ops, a single product) is left alone;
candidates that cannot be merged are reported as skipped with the reason.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from . import external
from .base import Pass, Report, constant_value, is_alive, iter_graphs, node_label


def _kind(node):
    """(group key, weights) of a mergeable product, else (None, reason or None)."""
    if node.op == "MatMul" and not node.domain and len(node.inputs) == 2:
        w = constant_value(node.inputs[1])
        if w is None or w.ndim != 2:
            return None, None           # activations times activations (attention): not a weight product
        return ("MatMul", str(w.dtype), int(w.shape[0])), {"w": w, "n": int(w.shape[1])}
    if node.domain != domain.DOMAIN or node.op not in ("MatMulNF4", "MatMulAWQ"):
        return None, None
    k, n = int(node.attrs["K"]), int(node.attrs["N"])
    vals = [constant_value(t) for t in node.inputs[1:4 if node.op == "MatMulAWQ" else 3]]
    if any(v is None for v in vals):
        return None, "packed weights are not constants"
    bias = constant_value(node.inputs[-1]) if len(node.inputs) > (4 if node.op == "MatMulAWQ" else 3) else None
    if node.op == "MatMulNF4":
        key = ("MatMulNF4", node.attrs["quant_type"], int(node.attrs["block_size"]), k)
    else:
        key = ("MatMulAWQ", int(node.attrs["group_size"]), k)
    return key, {"vals": vals, "n": n, "bias": bias}


class MergePass(Pass):
    name = "merge"
    description = "products of one input with constant weights (q/k/v) -> one product + Split (--merge-siblings)"

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        if not options.get("merge_siblings"):
            return
        self.spill = options.get("spill")
        self.count = 0
        for g in iter_graphs(graph):
            for x in list(g.tensors().values()):
                groups = {}
                for node in list(x.outputs):
                    if not is_alive(node) or not node.inputs or node.inputs[0] is not x:
                        continue
                    key, info = _kind(node)
                    if key is not None:
                        groups.setdefault(key, []).append((node, info))
                    elif info and node.domain == domain.DOMAIN:   # one of our products the merge cannot read
                        self.skipped(report, f"{node.op} sibling", [node_label(node)], info)
                for key, members in groups.items():
                    if len(members) > 1:
                        self._merge(g, x, key, members, report)

    def _const(self, base, array):
        self.count += 1
        return external.constant(f"{base}_merged{self.count}", np.ascontiguousarray(array), self.spill)

    def _merge(self, g, x, key, members, report):
        op = key[0]
        nodes = [m[0] for m in members]
        ns = [m[1]["n"] for m in members]
        labels = [node_label(n) for n in nodes]
        base = nodes[0].name or nodes[0].outputs[0].name
        if g.opset < 11:
            self.skipped(report, f"{op} siblings", labels, f"opset {g.opset} < 11: Split has no negative axis")
            return
        if op == "MatMulNF4":
            bs, k = key[2], key[3]
            if any((n * k) % bs or (n * k) % 2 for n in ns[:-1]):
                self.skipped(report, "MatMulNF4 siblings", labels,
                             "a weight's N*K is not a whole number of absmax blocks: blocks would straddle parts")
                return
        out_dtype = nodes[0].outputs[0].dtype
        y = gs.Variable(f"{base}_merged{self.count + 1}_out", dtype=out_dtype)
        attrs = dict(nodes[0].attrs)
        if op == "MatMul":
            inputs = [x, self._const(base, np.concatenate([m[1]["w"] for m in members], axis=1))]
            new = gs.Node(op="MatMul", name=f"{base}_merged", inputs=inputs, outputs=[y])
        else:
            axis = 0 if op == "MatMulNF4" else 1
            parts = [np.concatenate([m[1]["vals"][i].reshape(-1) if axis == 0 else m[1]["vals"][i] for m in members],
                                    axis=axis) for i in range(len(members[0][1]["vals"]))]
            inputs = [x] + [self._const(base, p) for p in parts]
            if any(m[1]["bias"] is not None for m in members):
                bdt = next(m[1]["bias"].dtype for m in members if m[1]["bias"] is not None)
                inputs.append(self._const(base, np.concatenate(
                    [m[1]["bias"].reshape(-1).astype(bdt) if m[1]["bias"] is not None else np.zeros(m[1]["n"], bdt)
                     for m in members])))
            attrs["N"] = int(sum(ns))
            new = gs.Node(op=op, domain=domain.DOMAIN, name=f"{base}_merged", attrs=attrs, inputs=inputs, outputs=[y])
        outs = [n.outputs[0] for n in nodes]
        if g.opset >= 13:
            split = gs.Node(op="Split", name=f"{base}_merged_split", attrs={"axis": -1},
                            inputs=[y, self._const(base, np.asarray(ns, np.int64))], outputs=outs)
        else:
            split = gs.Node(op="Split", name=f"{base}_merged_split", attrs={"axis": -1, "split": ns},
                            inputs=[y], outputs=outs)
        for n in nodes:
            n.inputs.clear()
            n.outputs.clear()
        g.nodes.extend([new, split])
        self.rewritten(report, f"{op} x{len(nodes)} siblings", labels, new_node=new.name, n=ns)
        return new
