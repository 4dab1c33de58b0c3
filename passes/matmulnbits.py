"""Pass "matmulnbits": the SwiGLU gate/up projections of onnxruntime's com.microsoft.MatMulNBits (4-bit; what
onnxruntime-genai's model builder writes with -p int4) -> our MatMulAWQ, converted without loss, so that the ffn
pass after it fuses them into one FusedFFNAWQ reading the same 4-bit integers.

genai's MLP (builder.make_mlp_proj), on MatMul or MatMulNBits:

    gate = MatMulNBits(x, B1, scales1[, zero_points1])      up = MatMulNBits(x, B3, scales3[, zero_points3])
    S = Mul(Mul(gate, Sigmoid(gate)), up)                   (the SiLU in any spelling the ffn pass knows)

With the builder's ``--extra_options fuse_mlp_gate_up=true`` gate and up are one product and a Split:

    gu = MatMulNBits(x, B, scales[, zero_points])   (N = 2 n: gate's n columns, then up's)
    gate, up = Split(gu, axis=-1, num_outputs=2)    (or split = [n, n]; gate and up may be either output)

This pass then cuts the columns of B, scales, zero points (and a constant bias) in two (MatMulNBits stores them
column by column: exact) and writes two MatMulAWQ nodes in place of the product and the Split.

The float spelling (MatMul gate/up, -p fp16 / fp32, also MatMul + Split) needs no conversion: the ffn pass fuses it
as it is. This pass rewrites only the MatMulNBits pairs of such a block (the down projection, attention and lm_head
MatMulNBits stay onnxruntime's). Each of the two becomes MatMulAWQ(x, qweight, qzeros, scales) with group_size =
block_size (onnx_lowbit/matmulnbits.py: same codes, same zero points, 8 where MatMulNBits has none, the fp16 scales
as they are): the dequantised fp16 weights are bit for bit MatMulNBits' (T = float16).

Skipped with the reason: bits other than 4 (the builder's -p int8 writes bits=8), g_idx, zero points in float
form, N not a multiple of 8, non-constant weights, gate and up reading different inputs, an intermediate read
elsewhere, a Split that is not two equal halves of the last axis, a non-constant bias on a fused gate_up product;
float32 scales (fp32 models: rounding them to fp16 is not lossless) unless the option ``matmulnbits_lossy`` is True
(the report gives each weight's relative change). With ``weights_target="ort"`` (a model for stock onnxruntime) the
pass changes nothing. Not a default pass: ``onnx-lowbit genai`` runs it (with ffn), ``--passes
...,matmulnbits,ffn`` names it.

Option ``matmulnbits_to`` = "int4" (what ``onnx-lowbit genai`` passes by default, genai_config.DEFAULT_TO): every
4-bit MatMulNBits of the symmetric form (no zero points, or all 8), not only the SwiGLU pairs, becomes our MatMulNF4
with quant_type "int4" (onnx_lowbit/matmulnbits.to_int4: exact for fp16 and fp32 scales) and the node's
accuracy_level, whose kernels beat MatMulNBits' on the CPU (at level 4 the column-lane VNNI kernels) and in genai's
loop on the GPU (docs/genai.md); a product read only by a Split into two equal halves (fuse_mlp_gate_up) becomes two
halves; the ffn pass then fuses the gate/up pairs into FusedFFNNF4. Skipped with the reason: zero points other than
8, K not a multiple of the block, a block size outside 32..4096, bits, g_idx, non-constant tensors. The pass's own
default ("awq", as named with --passes) is the SwiGLU pairs -> MatMulAWQ above.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from .base import (Names, Pass, Report, constant_value, consumers, is_alive, is_graph_output, iter_graphs,
                   node_label, producer)
from .ffn import find_silu, halves_split

MS_DOMAIN = "com.microsoft"


class _Skip(Exception):
    pass


def _nbits(t) -> gs.Node | None:
    p = producer(t)
    if p is not None and is_alive(p) and p.op == "MatMulNBits" and p.domain == MS_DOMAIN and len(p.outputs) == 1:
        return p
    return None


def _input(node: gs.Node, i: int):
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i].name else None


def _read(node: gs.Node, to: str = "awq"):
    """(K, N, block_size, B, scales, zero_points or None, bias tensor or None) of a MatMulNBits node, or _Skip
    (``to``: the target format, "awq" or "int4", for its own limits)."""
    a = node.attrs
    fmt = "AWQ" if to == "awq" else "int4"
    bits = int(a.get("bits", 4))
    if bits != 4:
        raise _Skip(f"bits={bits} (only 4-bit weights convert to {fmt})")
    K, N, bs = int(a.get("K", 0)), int(a.get("N", 0)), int(a.get("block_size", 0))
    if K <= 0 or N <= 0 or bs <= 0:
        raise _Skip("K, N or block_size missing")
    if N % 8 and to == "awq":
        raise _Skip(f"N={N} is not a multiple of 8 (AWQ packs 8 columns per int32)")
    if _input(node, 4) is not None:
        raise _Skip("g_idx given (act-order weights)")
    b = constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    s = constant_value(node.inputs[2]) if len(node.inputs) > 2 else None
    if b is None or s is None:
        raise _Skip("B or scales not a constant")
    zp_t = _input(node, 3)
    zp = None
    if zp_t is not None:
        zp = constant_value(zp_t)
        if zp is None:
            raise _Skip("zero_points not a constant")
        if zp.dtype != np.uint8:
            raise _Skip(f"zero_points in {zp.dtype} (float zero points are not {fmt}'s integer grid)")
    return K, N, bs, b, s, zp, _input(node, 5)


TARGETS = ("awq", "int4")


class MatMulNBitsPass(Pass):
    name = "matmulnbits"
    default = False  # runs when named: `onnx-lowbit genai` (genai_config.DEFAULT_PASSES), --passes ...,matmulnbits
    description = ("SwiGLU gate/up as onnxruntime's MatMulNBits (onnxruntime-genai int4) -> MatMulAWQ, lossless, "
                   "for the ffn pass to fuse (matmulnbits_to=int4: every symmetric MatMulNBits -> MatMulNF4 int4)")

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        if str(options.get("weights_target") or "lowbit").lower() == "ort":
            return  # a model for stock onnxruntime: its MatMulNBits stay
        to = str(options.get("matmulnbits_to") or "awq").lower()
        if to not in TARGETS:
            raise ValueError(f"matmulnbits_to must be one of {', '.join(TARGETS)}, got {to!r}")
        lossy = bool(options.get("matmulnbits_lossy", False))
        names = Names(graph)
        for g in list(iter_graphs(graph)):
            for node in list(g.nodes):
                if to == "int4" and node.outputs and _nbits(node.outputs[0]) is node:
                    self.one_int4(g, node, names, report)
                elif to == "awq" and is_alive(node) and node.op == "Mul" and not node.domain and len(node.inputs) == 2:
                    self.one(g, node, names, report, lossy)

    def one_int4(self, g, node: gs.Node, names: Names, report: Report) -> None:
        """One MatMulNBits -> MatMulNF4 (quant_type int4), or the reason it stays. A product read only by a Split
        into two equal halves of its columns (genai's fuse_mlp_gate_up) becomes two MatMulNF4 writing the Split's
        outputs (the columns cut exactly), so that the ffn pass fuses them as an unfused pair."""
        from onnx_lowbit import matmulnbits  # noqa: PLC0415 - the registry imports without numpy work
        label, pattern = [node_label(node)], "MatMulNBits"
        base = node.inputs[1].name
        try:
            K, N, bs, b, s, zp, bias = _read(node, "int4")
            split = self._halves_reader(g, node)
            parts = [(node.outputs[0], slice(0, N), "")]
            if split is not None:
                if bias is not None and constant_value(bias) is None:
                    raise _Skip("bias of the gate_up product not a constant")
                pattern, label = "MatMulNBits -> Split (halves)", label + [node_label(split)]
                parts = [(split.outputs[h], slice(h * (N // 2), (h + 1) * (N // 2)), f"_half{h}") for h in (0, 1)]
            by_col = _columns(b, s, zp, K, N, bs)
            made = []
            for out, cols, tag in parts:
                try:
                    packed, absmax = matmulnbits.to_int4(*_take(by_col, cols), K, cols.stop - cols.start, bs)
                except ValueError as e:
                    raise _Skip(str(e)) from None
                hb = bias
                if bias is not None and split is not None:
                    hb = _bias_cols(names(f"{base}_bias{tag}"), constant_value(bias), N, cols)
                made.append((out, cols.stop - cols.start, tag, packed, absmax, hb))
        except _Skip as e:
            self.skipped(report, pattern, label, str(e))
            return
        level = int(node.attrs.get("accuracy_level", 0))
        news = []
        for out, n, tag, packed, absmax, hb in made:
            inputs = [node.inputs[0], gs.Constant(names(f"{base}_int4{tag}"), packed),
                      gs.Constant(names(f"{base}_absmax{tag}"), absmax)] + ([hb] if hb is not None else [])
            news.append(gs.Node(op="MatMulNF4", domain=domain.DOMAIN, name=names(f"{node.name or base}_int4{tag}"),
                                attrs=dict(quant_type="int4", block_size=bs, K=K, N=n, accuracy_level=level),
                                inputs=inputs, outputs=[out]))
        for old in [node] + ([split] if split is not None else []):
            old.outputs.clear()
            old.inputs.clear()
        g.nodes.extend(news)
        self.rewritten(report, pattern, label, "MatMulNBits -> MatMulNF4 int4 (lossless)", op="MatMulNF4",
                       new_nodes=[n.name for n in news], K=K, N=N, block_size=bs, accuracy_level=level,
                       scales=str(np.asarray(s).dtype), zero_points=zp is not None,
                       bytes_before=int(b.nbytes + s.nbytes + (0 if zp is None else zp.nbytes)),
                       bytes_after=int(sum(p.nbytes + a.nbytes for _, _, _, p, a, _ in made)))

    @staticmethod
    def _halves_reader(g, node):
        """The Split that alone reads ``node``'s output, cutting it into two equal halves of the last axis (N
        even), else None."""
        y = node.outputs[0]
        readers = consumers(y)
        if is_graph_output(g, y) or len(readers) != 1 or int(node.attrs.get("N", 0)) % 2:
            return None
        sp = readers[0]
        if not is_alive(sp) or sp.op != "Split" or sp.domain or len(sp.outputs) != 2 or sp.inputs[0] is not y:
            return None
        found = halves_split(sp.outputs[0], sp.outputs[1])
        return sp if found is not None and found[2] is None else None

    def one(self, g, mul, names, report, lossy) -> None:
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            silu = find_silu(g, a)
            if silu is None:
                continue
            gate, up = _nbits(silu.z), _nbits(b)
            split = None
            if gate is None or up is None:
                found = halves_split(silu.z, b)
                gu = _nbits(found[0].inputs[0]) if found is not None and found[0].inputs else None
                if gu is None:
                    continue
                split, which, why = found
                pattern = f"swiglu: MatMulNBits gate_up -> Split, {silu.spelling}"
                labels = [node_label(n) for n in (gu, split, mul)]
            else:
                pattern = f"swiglu: MatMulNBits gate/up, {silu.spelling}"
                labels = [node_label(n) for n in (gate, up, mul)]
            try:
                if split is None:
                    self.check(g, mul, silu, gate, up)
                    done = [self.convert(g, n, names, lossy) for n in (gate, up)]
                else:
                    if why is not None:
                        raise _Skip(why)
                    self.check_split(g, mul, silu, gu, split)
                    done = self.convert_split(g, gu, split, which, names, lossy)
            except _Skip as e:
                self.skipped(report, pattern, labels, str(e))
                return
            for node in ([gate, up] if split is None else [gu, split]):
                node.outputs.clear()
                node.inputs.clear()
            done = [(node, spec(), details) for node, spec, details in done]  # the nodes, now that all converted
            for _, new, _ in done:
                g.nodes.append(new)
            rel = max(d["rel_error"] for _, _, d in done)
            self.rewritten(report, pattern, labels,
                           "MatMulNBits -> MatMulAWQ " + ("(lossless)" if rel == 0.0 else f"(lossy: scales rounded "
                                                                                          f"to fp16, rel {rel:.2g})"),
                           new_nodes=[n.name for _, n, _ in done], **done[0][2])
            return

    @staticmethod
    def check(g, mul, silu, gate, up) -> None:
        if gate.inputs[0] is not up.inputs[0]:
            raise _Skip(f"gate reads {gate.inputs[0].name!r}, up reads {up.inputs[0].name!r}: not one input")
        inside = {id(n) for n in silu.nodes} | {id(mul)}
        for node in (gate, up):
            y = node.outputs[0]
            if is_graph_output(g, y) or any(id(c) not in inside for c in consumers(y)):
                raise _Skip(f"{y.name!r} is also read outside the SwiGLU block")
        for n in silu.nodes:
            for y in n.outputs:
                if is_graph_output(g, y) or any(id(c) not in inside for c in consumers(y)):
                    raise _Skip(f"{y.name!r} is also read outside the SwiGLU block")

    @staticmethod
    def check_split(g, mul, silu, gu, split) -> None:
        y = gu.outputs[0]
        if is_graph_output(g, y) or len(consumers(y)) != 1:
            raise _Skip(f"{y.name!r} (gate_up) is also read outside the SwiGLU block")
        inside = {id(n) for n in silu.nodes} | {id(mul)}
        for t in list(split.outputs) + [o for n in silu.nodes for o in n.outputs]:
            if is_graph_output(g, t) or any(id(c) not in inside for c in consumers(t)):
                raise _Skip(f"{t.name!r} is also read outside the SwiGLU block")

    @staticmethod
    def convert(g, node, names: Names, lossy: bool):
        K, N, bs, b, s, zp, bias = _read(node)
        new, details = _awq_node(names, node.inputs[0], node.outputs[0], K, N, bs, b, s, zp, bias,
                                 node.inputs[1].name, node.name, lossy)
        return node, new, details

    @staticmethod
    def convert_split(g, gu, split, which, names: Names, lossy: bool):
        """The gate_up MatMulNBits cut into its two halves of columns (gate = the Split's output ``which``): two
        (node, MatMulAWQ maker, details), gate first, writing the Split's outputs."""
        K, N, bs, b, s, zp, bias = _read(gu)
        if N % 2:
            raise _Skip(f"N={N} is odd: no two equal halves")
        n = N // 2
        if bias is not None:
            bias = constant_value(bias)
            if bias is None:
                raise _Skip("bias of the gate_up product not a constant")
        by_col = _columns(b, s, zp, K, N, bs)
        done = []
        for half, out in ((which, split.outputs[which]), (1 - which, split.outputs[1 - which])):
            cols = slice(half * n, (half + 1) * n)
            hb = None if bias is None else _bias_cols(names(f"{gu.inputs[1].name}_bias{half}"), bias, N, cols)
            new, details = _awq_node(names, gu.inputs[0], out, K, n, bs, *_take(by_col, cols), hb,
                                     f"{gu.inputs[1].name}_half{half}", f"{gu.name}_half{half}", lossy)
            details["gate_up_half"] = half
            done.append((gu, new, details))
        return done


def _columns(b, s, zp, K, N, bs):
    """(B, scales, zero points or None) of a MatMulNBits weight as arrays of N rows, one per column (MatMulNBits
    stores them column by column, so rows [c0, c1) are those columns' weight); _Skip when they do not hold N
    columns of ceil(K / bs) blocks."""
    nb = -(-K // bs)
    if np.asarray(b).size != N * nb * (bs // 2) or np.asarray(s).size != N * nb or \
            (zp is not None and np.asarray(zp).size != N * ((nb + 1) // 2)):
        raise _Skip(f"B / scales / zero_points do not hold N={N} columns of {nb} blocks")
    return tuple(None if a is None else np.asarray(a).reshape(N, -1) for a in (b, s, zp))


def _take(by_col, cols):
    """``_columns``' arrays cut to the columns ``cols`` (a slice), contiguous."""
    return tuple(None if a is None else np.ascontiguousarray(a[cols]) for a in by_col)


def _bias_cols(name, bias, N, cols):
    """A constant holding the columns ``cols`` of a constant bias of N values."""
    return gs.Constant(name, np.ascontiguousarray(np.asarray(bias).reshape(N)[cols]))


def _awq_node(names: Names, x, y, K, N, bs, b, s, zp, bias, base: str, name: str, lossy: bool):
    """MatMulAWQ(x) -> y on the MatMulNBits tensors (b, s, zp) of a [K, N] weight: (a function making the node,
    the report details); raises _Skip when the tensors do not convert."""
    from onnx_lowbit import matmulnbits  # noqa: PLC0415 - the registry imports without numpy work
    try:
        qweight, qzeros, scales, rel = matmulnbits.to_awq(b, s, zp, K, N, bs, lossy=lossy)
    except ValueError as e:
        raise _Skip(f"{e}{'' if lossy else '; the option matmulnbits_lossy=True converts anyway'}") from None
    consts = [gs.Constant(names(f"{base}_qweight"), qweight), gs.Constant(names(f"{base}_qzeros"), qzeros),
              gs.Constant(names(f"{base}_scales"), scales)]
    inputs = [x] + consts + ([bias] if bias is not None else [])
    node_name = names(f"{name or base}_awq")

    def new():  # created only when every product of the block converted (a node attaches to its tensors)
        return gs.Node(op="MatMulAWQ", domain=domain.DOMAIN, name=node_name, attrs=dict(group_size=bs, K=K, N=N),
                       inputs=inputs, outputs=[y])
    details = dict(op="MatMulAWQ", K=K, N=N, group_size=bs, zero_points=zp is not None, rel_error=rel,
                   scales=str(np.asarray(s).dtype), bytes_before=int(b.nbytes + s.nbytes +
                                                                      (0 if zp is None else zp.nbytes)),
                   bytes_after=int(qweight.nbytes + qzeros.nbytes + scales.nbytes))
    return new, details
