"""weights4 with ``weights_target="ort"`` and ``weights_ort_form="compact"`` (CLI ``--ort-form compact``): onnxruntime's
MatMulNBits in its compact symmetric form, the one onnxruntime-genai's builder writes and onnxruntime 1.30+ runs
with its fastest kernels by default (CUDA: the fpA_intB set): bits 4, block 32 (``group_size`` may pick another of
16..256), no zero points (MatMulNBits' zero point is then 8), scales in A's dtype (fp16 scales for fp16 models).

Quantisation is onnxruntime's own symmetric blockwise one (MLAS, ``quantize_matmul_4bits(..., is_symmetric=True)``):
per block of ``block`` rows of W [K, N] and column, m = the value of largest magnitude (its sign kept), scale =
m / -8, q = clamp(round(w / scale) + 8, 0, 15) (round half to even), so m itself is code 0 exactly. The scale is
rounded to A's dtype first and the codes are computed with the stored scale (for float32 weights this is the same
as onnxruntime's quantiser, code for code: tests/test_pass_nbits_compact.py). K not a multiple of the block: the
rows past K are zeros (code 8).
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

MS_DOMAIN = "com.microsoft"
FORMS = ("awq", "compact")
COMPACT_BLOCK = 32


def quantize_symmetric(w: np.ndarray, block: int = COMPACT_BLOCK, dtype=np.float32):
    """W [K, N] (float) -> (B uint8 [N, nb, block/2], scales [N * nb] in ``dtype``, codes uint8 [Kp, N], scales
    [nb, N] float32 as stored): MatMulNBits' inputs and the values they stand for."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or block < 2 or block % 2:
        raise ValueError(f"W must be 2-D and block even, got {w.shape}, {block}")
    if not np.all(np.isfinite(w)):
        raise ValueError("weight holds NaN or Inf")
    K, N = w.shape
    nb = -(-K // block)
    wp = np.zeros((nb * block, N), np.float32)
    wp[:K] = w
    g = wp.reshape(nb, block, N)
    idx = np.argmax(np.abs(g), axis=1)                                       # [nb, N]
    m = np.take_along_axis(g, idx[:, None, :], axis=1)[:, 0, :]
    with np.errstate(over="ignore"):
        s = (m / np.float32(-8.0)).astype(dtype)
    if not np.all(np.isfinite(s)):
        raise ValueError(f"a block's scale overflows {np.dtype(dtype).name}")
    s32 = s.astype(np.float32)
    inv = np.divide(np.float32(1.0), s32, out=np.zeros_like(s32), where=s32 != 0)
    q = np.clip(np.round(g * inv[:, None, :]) + 8, 0, 15).astype(np.uint8).reshape(nb * block, N)
    qt = q.T.reshape(N, nb, block)
    b = (qt[:, :, 0::2] | (qt[:, :, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(b), np.ascontiguousarray(s.T.reshape(-1)), q, s32


def dequantize(q: np.ndarray, s32: np.ndarray, K: int, block: int) -> np.ndarray:
    """W [K, N] float64 = (q - 8) * scale."""
    return ((q.astype(np.float64) - 8.0) * np.repeat(s32.astype(np.float64), block, axis=0))[:K]


def emit(run, g: gs.Graph, cand, notes: list, block: int):
    """weights4's AWQ slot for target ort, compact form: one MatMulNBits(A, B, scales[, , , bias]) writing cand's
    output. ``run`` is weights4's pass run (its ``const`` and ``names``). Returns (node, report details)."""
    w = cand.w
    dtype = cand.dtype
    b, sc, q, s32 = quantize_symmetric(w, block, dtype)
    w_hat = dequantize(q, s32, int(cand.K), block)
    den = float(np.linalg.norm(w.astype(np.float64)))
    rel = float(np.linalg.norm(w.astype(np.float64) - w_hat) / den) if den else 0.0
    base = cand.weight_name
    base_name = cand.node.name or cand.out.name
    inputs = [cand.a, run.const(f"{base}_nbits", b), run.const(f"{base}_scales", sc)]
    if cand.bias is not None:
        bias_t = gs.Constant(run.names(f"{base_name}_bias"), cand.bias.astype(dtype))
        inputs += [gs.Variable.empty(), gs.Variable.empty(), bias_t]   # zero_points, g_idx absent; bias (input 5)
    level = getattr(run.o, "ort_accuracy", None)
    new = gs.Node(op="MatMulNBits", domain=MS_DOMAIN, name=run.names(f"{base_name}_nbits"),
                  attrs=dict(bits=4, block_size=int(block), K=int(cand.K), N=int(cand.N),
                             **accuracy_attrs(level, notes)), inputs=inputs,
                  outputs=[cand.out])
    g.nodes.append(new)
    notes.append(f"MatMulNBits compact form: symmetric, block {block}, no zero points, "
                 f"{np.dtype(dtype).name} scales")
    info = dict(target="ort", op=new.op, new_node=new.name, group_size=int(block), ort_form="compact",
                bytes_before=cand.bytes_before, bytes_after=int(b.nbytes + sc.nbytes), rel_error=rel,
                bias=cand.bias is not None, calibrated=False, new_nodes=[new.name], accuracy_level=int(level or 0))
    return new, info


def accuracy_attrs(level, notes: list) -> dict:
    """MatMulNBits' ``accuracy_level`` attribute for weights4's option weights_ort_accuracy (None: not written,
    onnxruntime's default 0); a note for the report when written."""
    if level is None:
        return {}
    notes.append(f"MatMulNBits accuracy_level {level}" + (" (int8 activations)" if level == 4 else ""))
    return {"accuracy_level": int(level)}
