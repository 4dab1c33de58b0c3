"""cacheattention: onnxruntime's ``com.microsoft.GroupQueryAttention`` as onnxruntime-genai's model builder writes it
-> one ``CacheAttention`` node (onnx_lowbit.cacheattention), which computes the same thing in one CUDA launch.

Matched: GroupQueryAttention(query, "", "", past_key, past_value, seqlens_k, total_sequence_length, cos_cache,
sin_cache[, "", "", ""]) with packed q/k/v (key and value inputs empty), do_rotary=1, rotary_interleaved=0,
local_window_size=-1 (or absent), softcap 0 (or absent), smooth_softmax 0 (or absent), qk_output 0 (or absent), no
position_ids / attention_bias / head_sink, three outputs. -> ``CacheAttention(query, past_key, past_value,
seqlens_k, cos_cache, sin_cache)`` (total_sequence_length is not read: the op takes a row's first prompt from its
length; the CPU nodes genai computes it with go, so the session can use CUDA graphs) with num_heads, kv_num_heads,
scale and ``share_buffer`` (the option ``cacheattention_share_buffer``: genai_config.json's
past_present_share_buffer, which rewrite_folder passes; default 0), writing the node's three outputs.

Other GroupQueryAttention nodes are reported as skipped with the attribute or input that differs. Option
``cacheattention_tc_only``: also skip heads whose prompts the tensor-core kernel would not take (fp16, head size a
multiple of 16 up to 128, read from cos_cache), which would fall to the slow rows route. Not a default pass of
``rewrite``; ``onnx-lowbit genai`` runs it (with cacheattention_tc_only) for folders that run on CUDA: in genai's
decode it is faster than onnxruntime's GroupQueryAttention (one launch of 8.1 us instead of four kernels of 12.0 us
per layer), prompts on tensor cores are level with it at 1024 tokens and faster at 128; on the CPU both are slower
(BENCHMARKS.md, "CacheAttention in genai's loop")."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from .base import Names, Pass, Report, iter_graphs, node_label

PATTERN = "cacheattention: GroupQueryAttention (packed q/k/v, rotary)"
MUST = {"do_rotary": 1, "rotary_interleaved": 0}
DEFAULTS = {"local_window_size": -1, "softcap": 0.0, "smooth_softmax": 0, "qk_output": 0}


def _why_not(node) -> str | None:
    """The reason this GroupQueryAttention cannot become CacheAttention, else None."""
    names = [t.name if t is not None else "" for t in node.inputs]
    names += [""] * (12 - len(names))
    if not names[0] or names[1] or names[2]:
        return "q, k and v are not packed into the query input (key / value inputs given)"
    if not all(names[i] for i in (3, 4, 5, 6)):
        return "past_key, past_value, seqlens_k or total_sequence_length is missing"
    if not names[7] or not names[8]:
        return "no cos_cache / sin_cache (rotary outside the node)"
    if any(names[9:]):
        return "position_ids, attention_bias or head_sink is given"
    for k, v in MUST.items():
        if int(node.attrs.get(k, 0)) != v:
            return f"{k}={node.attrs.get(k, 0)} (CacheAttention: {k}={v})"
    for k, v in DEFAULTS.items():
        if k in node.attrs and float(node.attrs[k]) != float(v):
            return f"{k}={node.attrs[k]} (CacheAttention: {v})"
    if len(node.outputs) != 3 or not all(o.name for o in node.outputs):
        return "not all three outputs (output, present_key, present_value) are used"
    return None


def _why_not_tc(node) -> str | None:
    """With the option cacheattention_tc_only (``onnx-lowbit genai``'s CUDA default): why the tensor-core prompt
    route (custom_ops/attention/cacheattention_tc_cuda: fp16, head size a multiple of 16 up to 128) would not take
    this node's prompts, read from its cos_cache constant [positions, head_size / 2], else None."""
    cos = node.inputs[7]
    if not isinstance(cos, gs.Constant):
        return "cos_cache is not a constant (head size unknown; cacheattention_tc_only)"
    d = 2 * int(cos.shape[-1])         # shape and dtype without loading the values (external data)
    if np.dtype(cos.dtype) != np.float16:
        return f"{np.dtype(cos.dtype)} caches: the tensor-core prompt kernel is fp16 (cacheattention_tc_only)"
    if d % 16 or d > 128:
        return f"head size {d}: the tensor-core prompt kernel takes multiples of 16 up to 128 (cacheattention_tc_only)"
    return None


class CacheAttentionPass(Pass):
    name = "cacheattention"
    default = False     # not for `rewrite`: `onnx-lowbit genai` names it on CUDA (genai_config.CUDA_PASSES); the CPU slower
    description = "genai's GroupQueryAttention (packed q/k/v, rotary) -> CacheAttention"

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        share = int(bool(options.get("cacheattention_share_buffer", False)))
        tc_only = bool(options.get("cacheattention_tc_only", False))
        names = Names(graph)
        for g in iter_graphs(graph):
            for node in list(g.nodes):
                if not (node.op == "GroupQueryAttention" and node.domain == "com.microsoft"):
                    continue
                why = _why_not(node) or (_why_not_tc(node) if tc_only else None)
                if why is not None:
                    self.skipped(report, PATTERN, [node_label(node)], why)
                    continue
                ins = [node.inputs[i] for i in (0, 3, 4, 5, 7, 8)]
                outs = list(node.outputs)
                attrs = {"num_heads": int(node.attrs["num_heads"]), "kv_num_heads": int(node.attrs["kv_num_heads"]),
                         "scale": float(node.attrs.get("scale", 0.0)), "share_buffer": share}
                label = node_label(node)
                name = names(f"{node.name or 'gqa'}/CacheAttention")
                node.inputs.clear()
                node.outputs.clear()
                g.nodes.append(gs.Node("CacheAttention", name, attrs, ins, outs, domain=domain.DOMAIN))
                self.rewritten(report, PATTERN, [label], new_node=name, share_buffer=share)
