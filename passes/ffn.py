"""Pass "ffn": the gate/up half of a SwiGLU feed-forward block -> one fused op (domain onnx_lowbit).

    S = SiLU(x W1 + b1) * (x W3 + b3)          ->  FusedFFN(x, W1^T, W3^T, b1, b3)       (float weights)
                                                   FusedFFN(x, W1, W3, b1, b3, weights_kn=1) (ffn_weights="kn")
                                                   FusedFFNNF4(x, Q1, absmax1, Q3, absmax3, b1, b3)
                                                   FusedFFNAWQ(x, qweight1, qzeros1, scales1, qweight3, ..., b1, b3)

The down projection that reads S stays as it is (MatMul, or MatMulNF4 / MatMulAWQ after the weights4 pass).

Anchored on a Mul (either input order) with one input SiLU(gate) and the other input up, where gate and up are
projections of the SAME tensor x:
  * a projection: MatMul(x, W), MatMul(x, Transpose(Wt)), Gemm(x, B[, C]) (transA=0, transB 0/1, alpha/beta
    folded), W an initializer or a Constant node's output (the matcher of the weights4 pass), optionally followed by
    Add(., b) with a constant bias [N]; MatMul(x, Cast(W16, to=float)) with an fp16 constant W16 (fp32 activations,
    fp16 weights: FusedFFN's mixed mode); or our MatMulNF4 / MatMulAWQ (weights4 already ran: their packed tensors
    are reused as they are, no requantisation; both projections must have the same format and attributes);
  * SiLU: every spelling the fplut pass recognises (its matcher is reused: x*Sigmoid(x) in any operand order and
    association, Swish(alpha=1), com.microsoft.QuickGelu(alpha=1)), or an FPLUT node with function='silu' (the
    fplut pass ran first).
x may have any leading dims (MatMul) or be 2-D (Gemm). Float weights are transposed to [N, K] at rewrite time
(ffn_weights "nk"), or kept [K, N] (ffn_weights "kn": the stored weight itself when it is [K, N] and no Gemm alpha
is folded in; a transposed copy for an [N, K] one, i.e. Gemm transB=1 or MatMul(x, Transpose(Wt))).

Skipped candidates (both Mul inputs look like SiLU(projection) and projection) are reported with the reason:
non-constant weight, gate and up read different tensors, different formats / 4-bit attributes, K/N mismatch,
an intermediate (gate, up, the SiLU or its parts) read by another node or a graph output, X of a non-float type,
gate and up weights of different dtypes, onnxruntime's com.microsoft 4-bit ops (weights4 target "ort").

Order (registry): fplut, weights4, ffn. ffn after weights4 fuses the quantised gate/up (FusedFFNNF4/AWQ);
ffn before weights4 (an explicit --passes order) gives a correct model with float gate/up in FusedFFN (weights4
then quantises only the down projection). ffn before or after fplut gives the same FusedFFN.

Options: ``ffn_weights`` "nk", "kn" or "auto" (default DEFAULT_WEIGHTS): the layout of the float FusedFFN's W1, W3
([N, K], or [K, N] with weights_kn=1: onnxruntime's CUDA prefill GEMMs on [K, N] are the same kernels as the
unfused graph's); "auto" takes, for fp16 X and weights, nk when X has at most AUTO_KN_MIN_M - 1 static rows
(decode models of fixed shape: nk's decode kernels are the fastest) and kn otherwise (prefill or batch models of
fixed shape, and dynamic shapes: the one layout never slower than the unfused graph at any M on the H100), and nk
for fp32 / mixed models (kn there is unmeasured against the unfused graph). Bad values raise ValueError naming the
option. Select the pass with ``passes=[...]`` /
``--passes``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from . import external
from .base import (Names, Pass, Report, constant_value, elem_type, is_alive, is_graph_output, is_float_type,
                   iter_graphs, node_label, outside_consumers, producer, remove_dead, type_name)
from .fplut import _ANCHORS, _ARITH, _Run as _FplutRun, _single_op
from .linear import bias_vector, constant_weight, rank
from .linear import match as _match_linear

_SEARCH_DEPTH = 4  # arithmetic steps from a SiLU's output back to its Sigmoid
_FOUR_BIT = {"MatMulNF4": ("nf4", ("quant_type", "block_size", "K", "N"), 2),
             "MatMulAWQ": ("awq", ("group_size", "K", "N"), 3)}
_ORT_FOUR_BIT = {"MatMulBnb4", "MatMulNBits"}
DEFAULT_WEIGHTS = "auto"  # option ffn_weights: layout of the float FusedFFN's W1, W3
LAYOUTS = ("nk", "kn", "auto")
# "auto" with fp16 X and weights: nk where X's rows M (the product of its leading dims) are static and fewer than
# this, else kn (dynamic M included). H100 sessions with CUDA graphs (docs/ffn.md, BENCHMARKS.md 2026-11-27,
# session 30): nk is 1.05-1.15x the unfused graph at M = 1..16 and 0.92-1.00x from M = 17; kn is 0.98-1.03x from
# M = 9 (never below 0.98, within the runs' noise) and 1.06-1.10x at M = 1..8 (kernel alone at M = 17..32: kn
# 69.2-71.2 us, nk 75.5-76.8, torch 69.0-71.5).
AUTO_KN_MIN_M = 17


def weights_layout(options: dict) -> str:
    """The option ``ffn_weights`` ("nk", "kn" or "auto"; default DEFAULT_WEIGHTS), validated (ValueError naming
    it)."""
    v = options.get("ffn_weights")
    v = DEFAULT_WEIGHTS if v is None else v
    if not isinstance(v, str) or v not in LAYOUTS:
        raise ValueError(f"ffn_weights must be 'nk' (FusedFFN weights [N, K], transposed at rewrite time), 'kn' "
                         f"([K, N], the MatMul weights as they are) or 'auto' (fp16 models: nk for fewer than "
                         f"{AUTO_KN_MIN_M} static rows of X, else kn; fp32 / mixed: nk), got {v!r}")
    return v


def static_rows(x: gs.Variable):
    """M = the product of x's leading dims when all are known integers, else None."""
    shape = getattr(x, "shape", None)
    if not shape:
        return None
    m = 1
    for d in shape[:-1]:
        if not isinstance(d, (int, np.integer)) or d < 0:
            return None
        m *= int(d)
    return m


def auto_layout(x: gs.Variable, x_fp16: bool, w_fp16: bool) -> tuple[str, str]:
    """(layout, why) for ffn_weights="auto"."""
    m = static_rows(x)
    if not (x_fp16 and w_fp16):
        return "nk", "auto: nk (kn is chosen for fp16 X and weights only)"
    if m is None:
        return "kn", ("auto: kn (rows of X not static: [K, N] is never slower than the unfused graph at any M; "
                      "ffn_weights='nk' is faster for decode-only use)")
    if m >= AUTO_KN_MIN_M:
        return "kn", f"auto: kn (M = {m} static rows >= {AUTO_KN_MIN_M})"
    return "nk", f"auto: nk (M = {m} static rows < {AUTO_KN_MIN_M})"


# ---------------------------------------------------------------------------------------------------------------
# SiLU
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Silu:
    z: object           # the SiLU's input
    nodes: list         # the nodes computing SiLU(z) from z
    spelling: str


def _attr_str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def find_silu(g: gs.Graph, s) -> _Silu | None:
    """s = SiLU(z) in any spelling the fplut pass knows (or an FPLUT 'silu' node): the match, else None."""
    p = producer(s)
    if p is None or not is_alive(p) or len(p.outputs) != 1:
        return None
    if p.domain == domain.DOMAIN and p.op == "FPLUT":
        if _attr_str(p.attrs.get("function", "")) == "silu" and p.inputs:
            return _Silu(p.inputs[0], [p], "FPLUT(function=silu)")
        return None
    fn, pattern, reason = _single_op(p)
    if pattern is not None:
        if fn == "silu" and reason is None and p.inputs:
            return _Silu(p.inputs[0], [p], pattern.split(": ", 1)[-1])
        return None
    # decomposed: find the Sigmoid behind s, let the fplut matcher decide whether s is x * Sigmoid(x)
    run = _FplutRun(None, None, {"silu"}, None)
    run.order = {id(n): i for i, n in enumerate(g.nodes)}
    frontier, seen = [p], set()
    for _ in range(_SEARCH_DEPTH):
        nxt = []
        for node in frontier:
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op == "Sigmoid" and not node.domain and "Sigmoid" in _ANCHORS:
                m = run.match(g, node, set())
                if m is not None and m.y is s and m.form.function == "silu":
                    return _Silu(m.x, list(m.nodes), m.form.pattern.split(": ", 1)[-1])
                continue
            if node.op in _ARITH and not node.domain:
                nxt.extend(q for q in (producer(t) for t in node.inputs) if q is not None and is_alive(q))
        frontier = nxt
    return None


def halves_split(gate_t, up_t):
    """(Split node, gate's output index, reason) when ``gate_t`` and ``up_t`` are the two outputs of one Split
    (onnxruntime-genai's ``fuse_mlp_gate_up=true``: one gate_up product, then Split(axis=-1, num_outputs=2));
    reason is None for two equal halves of the last axis, else why not. None when they are no such pair."""
    p, q = producer(gate_t), producer(up_t)
    if p is None or p is not q or not is_alive(p) or p.op != "Split" or p.domain or len(p.outputs) != 2 or \
            gate_t is up_t:
        return None
    idx = 0 if p.outputs[0] is gate_t else 1
    axis = int(p.attrs.get("axis", 0))
    r = rank(p.inputs[0]) if p.inputs else None
    if axis != -1 and (r is None or axis != r - 1):
        return p, idx, f"Split on axis {axis}, not the last axis"
    sizes = constant_value(p.inputs[1]) if len(p.inputs) > 1 and p.inputs[1].name else p.attrs.get("split")
    if len(p.inputs) > 1 and p.inputs[1].name and sizes is None:
        return p, idx, "Split sizes not a constant"
    if sizes is not None:
        sizes = [int(v) for v in np.asarray(sizes).reshape(-1)]
        if len(sizes) != 2 or sizes[0] != sizes[1]:
            return p, idx, f"Split sizes {sizes}, not two equal halves"
    return p, idx, None


# ---------------------------------------------------------------------------------------------------------------
# projections
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Proj:
    kind: str                 # "float", "nf4", "awq"
    x: object                 # the input tensor
    out: object               # the projection's output tensor
    nodes: list               # the nodes computing out from x (and the weight)
    spelling: str
    K: int = 0
    N: int = 0
    w: np.ndarray | None = None       # float: the weight as stored ([K, N], or [N, K] when w_nk)
    w_nk: bool = False                # float: the stored weight is [N, K] (Transpose node, Gemm transB=1)
    alpha: float = 1.0                # float: Gemm alpha, folded into the weight when it is written
    stored: object = None             # float: the stored constant tensor (reused as it is when the layout fits)
    w_name: str = ""
    bias: object = None               # np.ndarray (float path, a constant) or a tensor (4-bit op's bias input)
    tensors: list = field(default_factory=list)  # 4-bit: the packed weight tensors, in the op's order
    attrs: dict = field(default_factory=dict)    # 4-bit: the op's attributes


class _Skip(Exception):
    def __init__(self, spelling, reason):
        super().__init__(reason)
        self.spelling, self.reason = spelling, reason


def _mixed_proj(node: gs.Node) -> _Proj | None:
    """MatMul(x, Cast(W16, to=float)): fp16 weights with fp32 activations (the mixed mode, TW=float16)."""
    if node.op != "MatMul" or len(node.inputs) != 2 or len(node.outputs) != 1:
        return None
    cast = producer(node.inputs[1])
    if cast is None or cast.op != "Cast" or cast.domain or not is_alive(cast) or \
            int(cast.attrs.get("to", 0)) != onnx.TensorProto.FLOAT:
        return None
    found = constant_weight(cast.inputs[0])
    if found is None:
        return None
    value, stored, via, transposed = found
    if value.ndim != 2 or value.dtype != np.float16:
        return None
    r = rank(node.inputs[0])
    if r is None or r < 2:
        raise _Skip("MatMul(A, Cast(W))", f"rank of A {'unknown' if r is None else r}; a rank >= 2 A is needed")
    n, k = value.shape if transposed else value.shape[::-1]
    nodes = [node, cast] + ([via] if via is not None else [])
    return _Proj("float", node.inputs[0], node.outputs[0], nodes, "MatMul(A, Cast(W fp16))", int(k), int(n),
                 w=value, w_nk=transposed, stored=stored, w_name=stored.name)


def _float_proj(node: gs.Node) -> _Proj | None:
    mixed = _mixed_proj(node)
    if mixed is not None:
        return mixed
    cand, skip = _match_linear(node)
    if skip is not None:
        raise _Skip(skip[0], skip[1])
    if cand is None:
        return None
    nodes = [node] + ([cand.w_node] if cand.w_node is not None else [])
    return _Proj("float", cand.a, cand.out, nodes, cand.spelling, int(cand.K), int(cand.N), w=cand.value,
                 w_nk=cand.transpose, alpha=cand.alpha, stored=cand.stored, w_name=cand.weight_name, bias=cand.bias)


def _four_bit_proj(node: gs.Node) -> _Proj:
    kind, attr_names, n_weights = _FOUR_BIT[node.op]
    spelling = f"{node.op}(A, W)"
    ins = node.inputs
    if len(ins) < 1 + n_weights or len(node.outputs) != 1:
        raise _Skip(spelling, f"{node.op} with {len(ins)} inputs")
    attrs = {a: node.attrs.get(a) for a in attr_names}
    if any(v is None for v in attrs.values()):
        raise _Skip(spelling, f"{node.op} lacks attribute(s) {[a for a, v in attrs.items() if v is None]}")
    attrs = {a: (_attr_str(v) if isinstance(v, (str, bytes)) else int(v)) for a, v in attrs.items()}
    if node.op == "MatMulNF4" and node.attrs.get("accuracy_level") is not None:   # optional: FusedFFNNF4 takes it too
        attrs["accuracy_level"] = int(node.attrs["accuracy_level"])
    tensors = list(ins[1:1 + n_weights])
    for t in tensors:
        if constant_value(t) is None:
            raise _Skip(spelling, f"packed weight {t.name!r} is not a constant")
    bias = ins[1 + n_weights] if len(ins) > 1 + n_weights and ins[1 + n_weights].name else None
    return _Proj(kind, ins[0], node.outputs[0], [node], spelling, attrs["K"], attrs["N"], bias=bias,
                 tensors=tensors, attrs=attrs)


def _split_proj(g: gs.Graph, split: gs.Node, t) -> _Proj | None:
    """t = one half of Split(x W (+ b), axis=-1) (genai's fuse_mlp_gate_up; x W any float projection spelling):
    the projection onto that half of W's columns (a new weight; the Split's halves are checked by the caller,
    halves_split)."""
    if not split.inputs:
        return None
    y = split.inputs[0]
    src = producer(y)
    if src is None or src.op == "Split":
        return None
    proj = find_projection(g, y)
    if proj is None:
        return None
    if proj.kind != "float":
        raise _Skip(proj.spelling + " -> Split", f"a {proj.kind} gate_up product is not cut in halves (float only)")
    if len(y.outputs) != 1 or is_graph_output(g, y):
        raise _Skip(proj.spelling + " -> Split", f"gate_up output {y.name!r} is also read elsewhere")
    if proj.N % 2:
        raise _Skip(proj.spelling + " -> Split", f"N={proj.N} is odd: no two equal halves")
    n, which = proj.N // 2, list(split.outputs).index(t)
    cols = slice(which * n, (which + 1) * n)
    w = proj.w[cols] if proj.w_nk else proj.w[:, cols]
    bias = proj.bias[cols] if isinstance(proj.bias, np.ndarray) else proj.bias
    return _Proj("float", proj.x, t, proj.nodes + [split], proj.spelling + " -> Split", proj.K, n,
                 w=np.ascontiguousarray(w), w_nk=proj.w_nk, alpha=proj.alpha, stored=None,
                 w_name=f"{proj.w_name}_half{which}", bias=bias)


def find_projection(g: gs.Graph, t) -> _Proj | None:
    """t = x W (+ b) for a constant W (see the module doc): the match; None when t is no projection at all.
    Raises _Skip for a projection that cannot be fused (e.g. a non-constant weight)."""
    p = producer(t)
    if p is not None and is_alive(p) and p.op == "Split" and not p.domain and len(p.outputs) == 2:
        return _split_proj(g, p, t)
    if p is None or not is_alive(p) or len(p.outputs) != 1:
        return None
    add, bias_vec = None, None
    if p.op == "Add" and not p.domain and len(p.inputs) == 2:
        for i in (0, 1):
            inner, c = p.inputs[i], p.inputs[1 - i]
            q = producer(inner)
            v = constant_value(c)
            if q is not None and v is not None and is_alive(q) and (q.op in ("MatMul", "Gemm") and not q.domain
                                                                    or q.domain == domain.DOMAIN and q.op in _FOUR_BIT):
                if len(inner.outputs) != 1 or is_graph_output(g, inner):
                    raise _Skip(f"{q.op} -> Add(bias)", f"projection output {inner.name!r} is also read elsewhere")
                add, bias_vec, p = p, np.asarray(v), q
                break
        if add is None:
            return None
    if p.op in ("MatMul", "Gemm") and not p.domain:
        proj = _float_proj(p)
    elif p.domain == domain.DOMAIN and p.op in _FOUR_BIT:
        proj = _four_bit_proj(p)
    elif p.domain == "com.microsoft" and p.op in _ORT_FOUR_BIT:
        bits = int(p.attrs.get("bits", 4)) if p.op == "MatMulNBits" else 4
        if bits != 4:
            raise _Skip(f"com.microsoft.{p.op}", f"onnxruntime's MatMulNBits with bits={bits} (e.g. genai's -p int8) "
                                                "has no fused form: our fused ops read 4-bit weights")
        raise _Skip(f"com.microsoft.{p.op}", "onnxruntime's 4-bit op (weights4 target 'ort') has no fused form; "
                                            "use the lowbit target (MatMulNBits from onnxruntime-genai: the "
                                            "matmulnbits pass converts them first, see its report entry)")
    else:
        return None
    if proj is None:
        return None
    if add is not None:
        if proj.bias is not None:
            raise _Skip(proj.spelling + " -> Add(bias)", "projection already has a bias and is followed by an Add")
        vec = bias_vector(bias_vec, proj.N, rank(proj.x))
        if vec is None:
            raise _Skip(proj.spelling + " -> Add(bias)",
                        f"Add constant of shape {list(bias_vec.shape)} is not a bias [N={proj.N}]")
        proj.bias = vec
        proj.nodes.append(add)
        proj.out = add.outputs[0]
        proj.spelling += " -> Add(bias)"
    return proj


def _x_type(proj: _Proj):
    """X's element type: known from shape inference, else implied by a float MatMul/Gemm's weight (ONNX requires the
    same type; fp32 for the Cast spelling); None when unknown."""
    et = elem_type(proj.x)
    if et is None and proj.kind == "float":
        return onnx.TensorProto.FLOAT if "Cast(" in proj.spelling or proj.w.dtype == np.float32 else \
            onnx.TensorProto.FLOAT16
    return et


def _how(w, proj: _Proj) -> str:
    """How a [K, N] weight of the kn layout was made (for the report)."""
    if proj.stored is None:
        return "half of the gate_up weight"
    return "as stored" if w is proj.stored else "transposed" if proj.w_nk else "alpha folded"


# ---------------------------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------------------------
class FFNPass(Pass):
    name = "ffn"
    description = "SwiGLU gate/up projections + SiLU + Mul -> FusedFFN / FusedFFNNF4 / FusedFFNAWQ (down stays)"

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        run = _Run(self, report, Names(graph), options.get("spill"), weights_layout(options))
        for g in list(iter_graphs(graph)):
            for node in list(g.nodes):
                if is_alive(node) and node.op == "Mul" and not node.domain:
                    run.one(g, node)


class _Run:
    def __init__(self, owner: FFNPass, report: Report, names: Names, spill=None, layout=DEFAULT_WEIGHTS):
        self.owner, self.report, self.names, self.spill, self.layout = owner, report, names, spill, layout
        self.shared: dict = {}  # (id(stored), w_nk, alpha, layout) -> (stored, the written constant)

    def one(self, g: gs.Graph, mul: gs.Node) -> None:
        if len(mul.inputs) != 2 or len(mul.outputs) != 1:
            return
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            silu = find_silu(g, a)
            if silu is None:
                continue
            try:
                gate = find_projection(g, silu.z)
                up = find_projection(g, b) if gate is not None else None
            except _Skip as e:
                self.owner.skipped(self.report, f"swiglu: {e.spelling}, {silu.spelling}",
                                   self._labels(g, silu.nodes + [mul]), e.reason)
                return
            if gate is None or up is None:
                continue
            self.fuse(g, mul, silu, gate, up)
            return

    @staticmethod
    def _labels(g, nodes):
        order = {id(n): i for i, n in enumerate(g.nodes)}
        uniq = {id(n): n for n in nodes}
        return [node_label(n) for n in sorted(uniq.values(), key=lambda n: order.get(id(n), 1 << 62))]

    def why_not(self, g, mul, silu, gate, up) -> str | None:
        if gate.x is not up.x:
            pg, pu = producer(gate.x), producer(up.x)
            if pg is not None and pu is not None and pg.op == pu.op == "Mul" and \
                    any(a is b for a in pg.inputs for b in pu.inputs):
                return (f"gate reads {gate.x.name!r}, up reads {up.x.name!r}: the same input scaled by two different "
                        "Muls (e.g. AWQ activation scales from weights4's calibration, one per projection)")
            return f"gate reads {gate.x.name!r}, up reads {up.x.name!r}: not one input"
        if gate.spelling.endswith("-> Split") or up.spelling.endswith("-> Split"):
            found = halves_split(gate.out, up.out)
            if found is None:
                return "gate and up are not the two outputs of one Split"
            if found[2] is not None:
                return found[2]
        if gate.kind != up.kind:
            return f"gate is {gate.kind}, up is {up.kind} (weights of different formats)"
        if (gate.K, gate.N) != (up.K, up.N):
            return f"shape mismatch: gate weight K={gate.K} N={gate.N}, up weight K={up.K} N={up.N}"
        if gate.kind == "float" and gate.w.dtype != up.w.dtype:
            return f"gate weight is {gate.w.dtype}, up weight {up.w.dtype}"
        if gate.kind != "float" and gate.attrs != up.attrs:
            return f"4-bit attributes differ: gate {gate.attrs}, up {up.attrs}"
        et = _x_type(gate)
        if et is None:
            return f"dtype of {gate.x.name!r} unknown (shape inference gave none)"
        if et not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            return f"input dtype {type_name(et)} (the fused ops take float, float16)"
        if gate.kind == "float" and not is_float_type(elem_type(gate.out) or et):
            return f"output dtype {type_name(elem_type(gate.out))}"
        inside = {id(n) for n in gate.nodes + up.nodes + silu.nodes + [mul]}
        for n in gate.nodes + up.nodes + silu.nodes:
            if n.op in ("Constant", "Transpose", "Cast"):
                continue  # weight producers may be shared: they stay while others read them
            users = outside_consumers(n, inside, g)
            if users:
                who = ", ".join(u if isinstance(u, str) else node_label(u) for u in users)
                return f"shared intermediate: {n.op} {node_label(n)!r} output also feeds {who}"
        return None

    def fuse(self, g, mul, silu, gate, up) -> None:
        pattern = f"swiglu: {gate.spelling}, {silu.spelling}" + ("" if up.spelling == gate.spelling
                                                                    else f", up {up.spelling}")
        labels = self._labels(g, gate.nodes + up.nodes + silu.nodes + [mul])
        reason = self.why_not(g, mul, silu, gate, up)
        if reason:
            self.owner.skipped(self.report, pattern, labels, reason)
            return
        x, s = gate.x, mul.outputs[0]
        t_np = np.float32 if _x_type(gate) == onnx.TensorProto.FLOAT else np.float16
        base = mul.name or s.name
        layout, note = {}, ""
        if gate.kind == "float":
            op = "FusedFFN"
            choice, why = self.layout, ""
            if choice == "auto":
                choice, why = auto_layout(x, t_np == np.float16, gate.w.dtype == np.float16)
            kn = choice == "kn"
            weights = [self.weight(gate, kn), self.weight(up, kn)]
            attrs = {"weights_kn": 1} if kn else {}
            layout = {"weights": choice}
            if kn:
                note = f"weights [K, N] (kn): W1 {_how(weights[0], gate)}, W3 {_how(weights[1], up)}"
            if why:
                layout["weights_choice"] = why
                note = f"{why}; {note}" if note else why
        else:
            op = "FusedFFNNF4" if gate.kind == "nf4" else "FusedFFNAWQ"
            weights = gate.tensors + up.tensors
            attrs = dict(gate.attrs)
        biases = [self.bias(p, t_np, base, tag) for p, tag in ((gate, "b1"), (up, "b3"))]
        while biases and biases[-1] is None:
            biases.pop()
        biases = [b if b is not None else gs.Variable.empty() for b in biases]
        mul.outputs.clear()
        mul.inputs.clear()
        new = gs.Node(op=op, domain=domain.DOMAIN, name=self.names(f"{base}_ffn"), attrs=attrs,
                      inputs=[x] + weights + biases, outputs=[s])
        g.nodes.append(new)
        remove_dead(g, gate.nodes + up.nodes + silu.nodes)
        self.owner.rewritten(self.report, pattern, labels, note, op=op, new_node=new.name, input=x.name,
                             output=s.name, K=gate.K, N=gate.N, bias=any(b.name for b in biases), **layout)

    def weight(self, proj: _Proj, kn: bool):
        """The W1/W3 tensor of a float projection: [K, N] with ``kn``, else [N, K]. With ``kn`` the stored tensor
        itself when it is [K, N] and no alpha is folded in (no copy); otherwise one new constant per stored weight
        and layout."""
        if kn and not proj.w_nk and proj.alpha == 1.0 and proj.stored is not None:
            proj.w = None
            return proj.stored
        owner = proj.stored if proj.stored is not None else proj  # a Split's half: its own new weight
        key = (id(owner), proj.w_nk, proj.alpha, kn)
        hit = self.shared.get(key)
        if hit is None:
            w = proj.w.T if proj.w_nk == kn else proj.w
            if proj.alpha != 1.0:
                w = (w.astype(np.float32) * np.float32(proj.alpha)).astype(proj.w.dtype)
            # streaming (option spill): written to OUT's data file now, so memory stays bounded
            t = external.constant(self.names(f"{proj.w_name}_{'kn' if kn else 't'}"), np.ascontiguousarray(w),
                                  self.spill)
            hit = self.shared[key] = (owner, t)  # (owner kept alive: its id stays unique)
        proj.w = None
        return hit[1]

    def bias(self, proj: _Proj, t_np, base: str, tag: str):
        if proj.bias is None:
            return None
        if isinstance(proj.bias, np.ndarray):
            return gs.Constant(self.names(f"{base}_{tag}"), np.ascontiguousarray(proj.bias.astype(t_np)))
        return proj.bias
