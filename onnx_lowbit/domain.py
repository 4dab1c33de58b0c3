"""The onnx-lowbit op domain: one versioned custom domain for all our ops, their schemas, and their
registration with onnx (so ``onnx.checker.check_model(full_check=True)`` and shape inference work).

An op is described once here (``OpSpec``); the onnxruntime bridge (onnx_lowbit.custom_ops) registers the same
specs as onnxruntime custom ops, one registration per concrete type variant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import onnx
from onnx import TensorProto, defs

DOMAIN = "onnx_lowbit"
DOMAIN_VERSION = 1

TYPE_NAMES = {  # onnx type string -> TensorProto element type
    "tensor(float)": TensorProto.FLOAT,
    "tensor(float16)": TensorProto.FLOAT16,
    "tensor(bfloat16)": TensorProto.BFLOAT16,
    "tensor(double)": TensorProto.DOUBLE,
    "tensor(int8)": TensorProto.INT8,
    "tensor(uint8)": TensorProto.UINT8,
    "tensor(int16)": TensorProto.INT16,
    "tensor(int32)": TensorProto.INT32,
    "tensor(int64)": TensorProto.INT64,
}
FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


@dataclass(frozen=True)
class Param:
    name: str
    type_str: str  # a type variable ("T") or a concrete type ("tensor(float)")
    doc: str = ""
    optional: bool = False


@dataclass(frozen=True)
class Attr:
    name: str
    kind: str  # "float", "int", "string", "floats", "ints"
    doc: str = ""
    required: bool = True


@dataclass
class OpSpec:
    name: str
    doc: str
    inputs: list
    outputs: list
    type_constraints: dict  # type variable -> list of onnx type strings
    attributes: list = field(default_factory=list)
    infer: Callable | None = None  # (InferenceContext) -> None

    def variants(self):
        """Concrete (input types, output types) combinations, as TensorProto element types."""
        import itertools
        tvars = sorted(self.type_constraints)
        for combo in itertools.product(*(self.type_constraints[v] for v in tvars)):
            binding = dict(zip(tvars, combo))
            resolve = lambda p: TYPE_NAMES[binding.get(p.type_str, p.type_str)]  # noqa: E731
            yield [resolve(p) for p in self.inputs], [resolve(p) for p in self.outputs]


def _same_as_input0(ctx) -> None:
    ctx.set_output_type(0, ctx.get_input_type(0))


_ATTR_KINDS = {
    "float": defs.OpSchema.AttrType.FLOAT,
    "int": defs.OpSchema.AttrType.INT,
    "string": defs.OpSchema.AttrType.STRING,
    "floats": defs.OpSchema.AttrType.FLOATS,
    "ints": defs.OpSchema.AttrType.INTS,
}

FPLUT = OpSpec(
    name="FPLUT",
    doc="Unary function through an fp16 lookup table: 11 fp16 cut points, 259 fp16 values, linear "
        "interpolation in fp32 (reference: onnx_lowbit.fplut). Output has the input's type and shape.",
    inputs=[Param("X", "T")],
    outputs=[Param("Y", "T")],
    type_constraints={"T": FLOATS},
    attributes=[
        Attr("function", "string", "name of the approximated function (informational, e.g. 'silu')", required=False),
        Attr("cut_points", "floats", "11 strictly increasing fp16-representable cut points"),
        Attr("table", "floats", "259 fp16-representable table values"),
    ],
    infer=_same_as_input0,
)

def _matmul4_infer(ctx) -> None:
    """Y = A[..., K] x W[K, N] (+ bias): A's type, A's leading dims, last dim N (attribute)."""
    a = ctx.get_input_type(0)
    n = ctx.get_attribute("N")
    out = onnx.TypeProto()
    out.CopyFrom(a)
    if n is not None and a.tensor_type.HasField("shape") and len(a.tensor_type.shape.dim) > 0:
        last = out.tensor_type.shape.dim[len(out.tensor_type.shape.dim) - 1]
        last.Clear()
        last.dim_value = onnx.helper.get_attribute_value(n)
    ctx.set_output_type(0, out)


def _dequant_infer(elem_type_of):
    def infer(ctx) -> None:
        k = onnx.helper.get_attribute_value(ctx.get_attribute("K"))
        n = onnx.helper.get_attribute_value(ctx.get_attribute("N"))
        ctx.set_output_type(0, onnx.helper.make_tensor_type_proto(elem_type_of(ctx), [k, n]))
    return infer


_NF4_ATTRS = [
    Attr("quant_type", "string", "'nf4' or 'fp4' (bitsandbytes' 16-level codes), or 'int4' (code (q - 8) / 8: "
         "symmetric 4-bit integers, absmax = 8 x scale; onnxruntime MatMulNBits weights converted without loss)"),
    Attr("block_size", "int", "elements per absmax block: a power of two in 32..4096"),
    Attr("K", "int", "input features (rows of the MatMul weight)"),
    Attr("N", "int", "output features (columns of the MatMul weight)"),
]
_NF4_LEVEL = Attr("accuracy_level", "int", "0 (default; 1..3 alike): fp32 activations; 4: activations quantised to "
                  "int8 per group of block_size elements (32 where block_size does not divide K; K % 32 != 0: as 0), "
                  "int8 code levels, exact integer sums (reference: onnx_lowbit.nf4_int8; the CUDA kernels compute "
                  "in float at every level, as onnxruntime's MatMulNBits takes it as a minimum)", required=False)
_NF4_DOC = ("Weight W[K, N] stored as bitsandbytes 4-bit blockwise quantisation of W^T ([N, K] row-major, flat, "
            "blocks of block_size consecutive elements, the last block may be partial): packed uint8 with the first "
            "element of each pair in the high nibble, one fp32 absmax per block (reference: onnx_lowbit.nf4).")

MATMUL_NF4 = OpSpec(
    name="MatMulNF4",
    doc="Y = A x W (+ bias) with W dequantised in registers. " + _NF4_DOC,
    inputs=[Param("A", "T"), Param("Q", "tensor(uint8)"), Param("absmax", "tensor(float)"),
            Param("bias", "T", optional=True)],
    outputs=[Param("Y", "T")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=_NF4_ATTRS + [_NF4_LEVEL],
    infer=_matmul4_infer,
)

def _dequant_nf4_infer(ctx) -> None:
    k = onnx.helper.get_attribute_value(ctx.get_attribute("K"))
    n = onnx.helper.get_attribute_value(ctx.get_attribute("N"))
    t = ctx.get_attribute("transposed")
    shape = [n, k] if t is not None and onnx.helper.get_attribute_value(t) else [k, n]
    ctx.set_output_type(0, onnx.helper.make_tensor_type_proto(ctx.get_input_type(1).tensor_type.elem_type, shape))


DEQUANT_NF4 = OpSpec(
    name="DequantNF4",
    doc="W[K, N] (or W^T [N, K] with transposed=1, the storage order: a streaming kernel, for Gemm transB=1) "
        "of absmax's type (float or float16). " + _NF4_DOC,
    inputs=[Param("Q", "tensor(uint8)"), Param("absmax", "T")],
    outputs=[Param("W", "T")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=_NF4_ATTRS + [Attr("transposed", "int", "1: output W^T [N, K] (default 0: W [K, N])",
                                  required=False)],
    infer=_dequant_nf4_infer,
)

_AWQ_ATTRS = [
    Attr("group_size", "int", "input features per scale/zero group (AutoAWQ default 128)"),
    Attr("K", "int", "input features; qweight may carry zero rows up to a multiple of group_size"),
    Attr("N", "int", "output features (a multiple of 8)"),
]
_AWQ_DOC = ("AutoAWQ GEMM layout: qweight int32 [Kp, N/8] and qzeros int32 [Kp/G, N/8] with the nibble order "
            "[0,2,4,6,1,3,5,7], scales float16 [Kp/G, N]; W = (q - z) * s (reference: onnx_lowbit.awq).")

MATMUL_AWQ = OpSpec(
    name="MatMulAWQ",
    doc="Y = A x W (+ bias), W dequantised in registers. " + _AWQ_DOC,
    inputs=[Param("A", "T"), Param("qweight", "tensor(int32)"), Param("qzeros", "tensor(int32)"),
            Param("scales", "tensor(float16)"), Param("bias", "T", optional=True)],
    outputs=[Param("Y", "T")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=_AWQ_ATTRS,
    infer=_matmul4_infer,
)

DEQUANT_AWQ = OpSpec(
    name="DequantAWQ",
    doc="W[K, N] float16. " + _AWQ_DOC,
    inputs=[Param("qweight", "tensor(int32)"), Param("qzeros", "tensor(int32)"), Param("scales", "tensor(float16)")],
    outputs=[Param("W", "tensor(float16)")],
    type_constraints={},
    attributes=_AWQ_ATTRS,
    infer=_dequant_infer(lambda ctx: TensorProto.FLOAT16),
)

def _ffn_infer(ctx) -> None:
    """S = SwiGLU(X): X's type, X's leading dims, last dim N (attribute N, else W1's dim 0, dim 1 with weights_kn=1)."""
    x = ctx.get_input_type(0)
    n_attr = ctx.get_attribute("N")
    kn_attr = ctx.get_attribute("weights_kn")
    n = None
    if n_attr is not None:
        n = onnx.helper.get_attribute_value(n_attr)
    else:
        w1 = ctx.get_input_type(1)
        if w1 is not None and w1.tensor_type.HasField("shape") and len(w1.tensor_type.shape.dim) == 2:
            kn = kn_attr is not None and onnx.helper.get_attribute_value(kn_attr) == 1
            d = w1.tensor_type.shape.dim[1 if kn else 0]
            n = d.dim_value if d.HasField("dim_value") else None
    out = onnx.TypeProto()
    out.CopyFrom(x)
    if x.tensor_type.HasField("shape") and len(x.tensor_type.shape.dim) > 0:
        last = out.tensor_type.shape.dim[len(out.tensor_type.shape.dim) - 1]
        last.Clear()
        if n is not None:
            last.dim_value = n
    ctx.set_output_type(0, out)


_FFN_DOC = ("S[..., N] = SiLU(X W1^T + B1) * (X W3^T + B3) (SwiGLU gate/up of a gated FFN; the down projection stays "
            "outside), products accumulated and SiLU computed in fp32, output in X's type (reference: "
            "onnx_lowbit.ffn). ")
_FFN_BIASES = [Param("B1", "T", "gate bias [N]", optional=True), Param("B3", "T", "up bias [N]", optional=True)]

FUSED_FFN = OpSpec(
    name="FusedFFN",
    doc=_FFN_DOC + "W1, W3 are [N, K] (the MatMul weights transposed), or [K, N] with weights_kn=1 (the MatMul "
                   "weights as they are: S = SiLU(X W1 + B1) * (X W3 + B3)); TW=float16 with T=float is the mixed "
                   "mode.",
    inputs=[Param("X", "T"), Param("W1", "TW", "gate weight [N, K] ([K, N] with weights_kn=1)"),
            Param("W3", "TW", "up weight [N, K] ([K, N] with weights_kn=1)"), *_FFN_BIASES],
    outputs=[Param("S", "T")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"], "TW": ["tensor(float)", "tensor(float16)"]},
    attributes=[Attr("weights_kn", "int", "1: W1, W3 are [K, N] (default 0: [N, K])", required=False)],
    infer=_ffn_infer,
)

FUSED_FFN_NF4 = OpSpec(
    name="FusedFFNNF4",
    doc=_FFN_DOC + "W1, W3 each stored as MatMulNF4's weight: " + _NF4_DOC,
    inputs=[Param("X", "T"), Param("Q1", "tensor(uint8)"), Param("absmax1", "tensor(float)"),
            Param("Q3", "tensor(uint8)"), Param("absmax3", "tensor(float)"), *_FFN_BIASES],
    outputs=[Param("S", "T")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=_NF4_ATTRS + [_NF4_LEVEL],
    infer=_ffn_infer,
)

FUSED_FFN_AWQ = OpSpec(
    name="FusedFFNAWQ",
    doc=_FFN_DOC + "W1, W3 each stored as MatMulAWQ's weight: " + _AWQ_DOC,
    inputs=[Param("X", "T"), Param("qweight1", "tensor(int32)"), Param("qzeros1", "tensor(int32)"),
            Param("scales1", "tensor(float16)"), Param("qweight3", "tensor(int32)"), Param("qzeros3", "tensor(int32)"),
            Param("scales3", "tensor(float16)"), *_FFN_BIASES],
    outputs=[Param("S", "T")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=_AWQ_ATTRS,
    infer=_ffn_infer,
)

# The 4-bit weight ops (onnx_lowbit.nf4 / onnx_lowbit.awq formats).
PLANNED_OPS = {op.name: op for op in [MATMUL_NF4, DEQUANT_NF4, MATMUL_AWQ, DEQUANT_AWQ]}
# The fused SwiGLU FFN ops (onnx_lowbit.ffn).
FFN_OPS = {op.name: op for op in [FUSED_FFN, FUSED_FFN_NF4, FUSED_FFN_AWQ]}
OPS = {op.name: op for op in [FPLUT, *PLANNED_OPS.values(), *FFN_OPS.values()]}


def _quant_gru_infer(ctx) -> None:
    """Y: layout 0 [T, D, N, H], layout 1 [N, T, D, H]; Y_h: layout 0 [D, N, H], layout 1 [N, D, H]; float."""
    get = lambda n, d: (onnx.helper.get_attribute_value(ctx.get_attribute(n))  # noqa: E731
                        if ctx.get_attribute(n) is not None else d)
    h, layout = get("hidden_size", None), get("layout", 0)
    direction = get("direction", b"forward")
    d = 2 if (direction.decode() if isinstance(direction, bytes) else direction) == "bidirectional" else 1
    x = ctx.get_input_type(0)
    dims = [None, None, None]
    if x is not None and x.tensor_type.HasField("shape") and len(x.tensor_type.shape.dim) == 3:
        dims = [dd.dim_value if dd.HasField("dim_value") else (dd.dim_param or None) for dd in x.tensor_type.shape.dim]
    t, n = (dims[0], dims[1]) if layout == 0 else (dims[1], dims[0])
    shapes = ([t, d, n, h], [d, n, h]) if layout == 0 else ([n, t, d, h], [n, d, h])
    for i, s in enumerate(shapes):
        ctx.set_output_type(i, onnx.helper.make_tensor_type_proto(TensorProto.FLOAT, s))


QUANT_GRU = OpSpec(
    name="QuantGRU",
    doc="ONNX GRU (linear_before_reset=1, gates z, r, h) computed in pure fixed point (reference: "
        "onnx_lowbit.gru_int; spec: docs/gru.md). X (float) and initial_h are quantised at entry, every "
        "intermediate is a `bits`-wide integer with a power-of-two scale 2^-e and a zero point, sigmoid/tanh are "
        "integer lookup tables; Y/Y_h are the dequantised hidden states (float).",
    inputs=[Param("X", "tensor(float)", "[T, N, C] (layout 0) or [N, T, C] (layout 1)"),
            Param("W", "TQ", "per-channel symmetric input weights [D, 3H, C], gates z, r, h"),
            Param("R", "TQ", "per-channel symmetric recurrent weights [D, 3H, H]"),
            Param("B", "tensor(int32)", "per-channel symmetric biases [D, 6H]: bx (3H) then br (3H)"),
            Param("channel_exp", "tensor(int32)", "per-channel exponents [D, 4, 3H]: W, R, bx, br"),
            Param("luts", "TQ", "integer tables [D, 3, L]: sigmoid(z), sigmoid(r), tanh(g); L = 257 (int8), "
                                "1025 (int16)"),
            Param("sequence_lens", "tensor(int32)", "[N]", optional=True),
            Param("initial_h", "tensor(float)", "[D, N, H] (layout 0) or [N, D, H] (layout 1)", optional=True)],
    outputs=[Param("Y", "tensor(float)", "all hidden states (0 at padded steps)"),
             Param("Y_h", "tensor(float)", "the last hidden state")],
    type_constraints={"TQ": ["tensor(int8)", "tensor(int16)"]},
    attributes=[
        Attr("hidden_size", "int", "H"),
        Attr("direction", "string", "forward (default), reverse or bidirectional", required=False),
        Attr("layout", "int", "0 (default): [T, N, ...]; 1: [N, T, ...] (ONNX GRU layout)", required=False),
        Attr("bits", "int", "8 or 16: width of every quantised quantity (TQ is int8 / int16)"),
        Attr("exponents", "ints", "D x 14 exponents e (scale 2^-e) of x, h, Wx, Rh, z_pre, r_pre, g_pre, z_out, "
                                  "r_out, g_out, Rh_add_br, rRh, old (z*h), new ((1-z)*g), per direction"),
        Attr("zero_points", "ints", "D x 14 zero points, same order"),
    ],
    infer=_quant_gru_infer,
)
# The integer GRU (onnx_lowbit.gru_int).
OPS[QUANT_GRU.name] = QUANT_GRU

ROTARY = OpSpec(
    name="Rotary",
    doc="Rotary position embedding, half-rotation form: Y = X * cos + rotate_half(X) * sin with rotate_half(X) = "
        "concat(-X[..., D/2:], X[..., :D/2]) over X's last axis (D even); cos and sin broadcast to X's shape. Each "
        "product and the sum rounded to T, as the unfused ONNX ops round them (reference: onnx_lowbit.rotary).",
    inputs=[Param("X", "T", "[..., D]"), Param("cos", "T", "broadcasts to X"), Param("sin", "T", "broadcasts to X")],
    outputs=[Param("Y", "T", "X's shape")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    infer=_same_as_input0,
)
# Rotary position embedding (onnx_lowbit.rotary).
OPS[ROTARY.name] = ROTARY


def _input_dims(ctx, i):
    """Input i's dims (None where unknown), or None without a shape."""
    t = ctx.get_input_type(i)
    if t is None or not t.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim]


def _rotarykv_infer(ctx) -> None:
    """Q [B, Hq, S, D], present_key / present_value [B, Hkv, P + S, D], each dim where the inputs give it."""
    attr = lambda n: onnx.helper.get_attribute_value(ctx.get_attribute(n))  # noqa: E731
    hq, hkv = attr("num_heads"), attr("kv_num_heads")

    shape = lambda i: _input_dims(ctx, i)  # noqa: E731

    elem = ctx.get_input_type(0).tensor_type.elem_type
    qkv, pk = shape(0), (shape(3) if ctx.get_num_inputs() > 3 and ctx.has_input(3) else [None, None, 0, None])
    b = s = d = p = None
    if qkv is not None and len(qkv) == 3:
        b, s = qkv[0], qkv[1]
        d = qkv[2] // (hq + 2 * hkv) if qkv[2] else None
    if pk is not None and len(pk) == 4:
        b, p, d = b or pk[0], pk[2], d or pk[3]
    total = p + s if p is not None and s is not None else None
    dim = lambda v, sym: v if v is not None else sym  # noqa: E731 - unknown: a fresh symbolic dim
    ctx.set_output_type(0, onnx.helper.make_tensor_type_proto(elem, [dim(b, None), hq, dim(s, None), dim(d, None)]))
    for o in (1, 2):
        ctx.set_output_type(o, onnx.helper.make_tensor_type_proto(elem, [dim(b, None), hkv, dim(total, None),
                                                                         dim(d, None)]))


ROTARY_KV = OpSpec(
    name="RotaryKV",
    doc="Attention prologue of a decode step: QKV [B, S, (Hq + 2 Hkv) * D] (q heads, then k, then v) is split into "
        "heads ([B, H, S, D] each); Q = Rotary(q, cos, sin), present_key = concat(past_key, Rotary(k, cos, sin), "
        "axis 2), present_value = concat(past_value, v, axis 2). Rotary rounds as the Rotary op (reference: "
        "onnx_lowbit.rotarykv).",
    inputs=[Param("QKV", "T", "[B, S, (num_heads + 2 kv_num_heads) * D]"),
            Param("cos", "T", "broadcasts to [B, 1, S, D]"), Param("sin", "T", "broadcasts to [B, 1, S, D]"),
            Param("past_key", "T", "[B, kv_num_heads, P, D]; absent with past_value: no cache (P = 0)", optional=True),
            Param("past_value", "T", "past_key's shape", optional=True)],
    outputs=[Param("Q", "T", "[B, num_heads, S, D]"), Param("present_key", "T", "[B, kv_num_heads, P + S, D]"),
             Param("present_value", "T", "[B, kv_num_heads, P + S, D]")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=[Attr("num_heads", "int", "Hq, query heads"), Attr("kv_num_heads", "int", "Hkv, key/value heads")],
    infer=_rotarykv_infer,
)
# Split + rotary + KV-cache append (onnx_lowbit.rotarykv).
OPS[ROTARY_KV.name] = ROTARY_KV


def _kvattention_infer(ctx) -> None:
    ctx.set_output_type(0, ctx.get_input_type(0))


KV_ATTENTION = OpSpec(
    name="KVAttention",
    doc="Scaled dot-product attention over a KV cache: O = T(softmax(T(T(T(Q K^T) * scale) + mask)) V) with Q [B, "
        "Hq, S, D], K and V [B, Hkv, T, D] (query head h reads kv head h // (Hq / Hkv)), mask broadcasting to [B, "
        "Hq, S, T]; each step rounded to T as the unfused ops round it, softmax and sums in fp32 (reference: "
        "onnx_lowbit.kvattention).",
    inputs=[Param("Q", "T", "[B, Hq, S, D]"), Param("K", "T", "[B, Hkv, T, D]"), Param("V", "T", "K's shape"),
            Param("mask", "T", "additive, broadcasts to [B, Hq, S, T]", optional=True)],
    outputs=[Param("O", "T", "Q's shape")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=[Attr("scale", "float", "multiplies the scores (default 1)", required=False),
                Attr("divide", "int", "1: the scores are divided by scale instead (default 0)", required=False)],
    infer=_kvattention_infer,
)
# Attention over the KV cache (onnx_lowbit.kvattention); not named Attention: ONNX has an Attention op (opset 23) and
# onnx.reference refuses one name in two domains.
OPS[KV_ATTENTION.name] = KV_ATTENTION


def _cacheattention_infer(ctx) -> None:
    sb = ctx.get_attribute("share_buffer")
    share = int(onnx.helper.get_attribute_value(sb)) if sb is not None else 0

    shape = lambda i: _input_dims(ctx, i)  # noqa: E731

    elem = ctx.get_input_type(0).tensor_type.elem_type
    qkv, pk = shape(0), shape(1)
    b = s = w = None
    if qkv is not None and len(qkv) == 3:
        b, s, w = qkv
    ctx.set_output_type(0, onnx.helper.make_tensor_type_proto(elem, [b, s, None]))
    present = None
    if pk is not None and len(pk) == 4:
        p = pk[2]
        length = p if share else (p + s if p is not None and s is not None else None)
        present = [pk[0], pk[1], length, pk[3]]
    for o in (1, 2):
        ctx.set_output_type(o, onnx.helper.make_tensor_type_proto(elem, present))


CACHE_ATTENTION = OpSpec(
    name="CacheAttention",
    doc="Attention over a KV cache with rotary and the cache append, as onnxruntime's GroupQueryAttention computes it "
        "for packed q/k/v with do_rotary=1 (half rotation), no local window and no softcap: each new token's q and k "
        "rotated at its position (a row's first prompt, seqlens_k + 1 <= S: 0..S-1; else seqlens_k + 1 - S + s), its "
        "k and v written into the "
        "present cache there, then softmax(scale q K^T) V over the keys up to that position, in fp32 (reference: "
        "onnx_lowbit.cacheattention).",
    inputs=[Param("QKV", "T", "[B, S, (num_heads + 2 kv_num_heads) * D]"),
            Param("past_key", "T", "[B, kv_num_heads, P, D]"), Param("past_value", "T", "past_key's shape"),
            Param("seqlens_k", "tensor(int32)", "[B]: each row's total length - 1"),
            Param("cos_cache", "T", "[max positions, D / 2]"), Param("sin_cache", "T", "cos_cache's shape")],
    outputs=[Param("O", "T", "[B, S, num_heads * D]"),
             Param("present_key", "T", "share_buffer: past's shape; else [B, kv_num_heads, P + S, D]"),
             Param("present_value", "T", "present_key's shape")],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=[Attr("num_heads", "int", "Hq, query heads"), Attr("kv_num_heads", "int", "Hkv, key/value heads"),
                Attr("scale", "float", "multiplies q.k (0 or absent: 1 / sqrt(D))", required=False),
                Attr("share_buffer", "int", "1: present is past's buffer (genai's past_present_share_buffer), of "
                     "past's shape; 0 (default): present = past then the new tokens", required=False)],
    infer=_cacheattention_infer,
)
# GroupQueryAttention's computation for genai's graphs (onnx_lowbit.cacheattention).
OPS[CACHE_ATTENTION.name] = CACHE_ATTENTION


def _rmsnorm_infer(ctx) -> None:
    ctx.set_output_type(0, ctx.get_input_type(0))
    if ctx.get_num_outputs() > 1:
        ctx.set_output_type(1, ctx.get_input_type(0))


RMS_NORM = OpSpec(
    name="RMSNorm",
    doc="RMS normalisation over X's last axis with an optional residual add in front: H = X + skip (rounded to T), "
        "Y = gamma * T(float32(H) / sqrt(mean(float32(H)^2) + epsilon)) (LLaMA's RMSNorm: fp32 inside, narrowed to "
        "T before the weight); outputs Y and, optionally, H (reference: onnx_lowbit.rmsnorm).",
    inputs=[Param("X", "T", "[..., D]"), Param("gamma", "T", "[D]"),
            Param("skip", "T", "X's shape, added to X first", optional=True)],
    outputs=[Param("Y", "T", "X's shape"), Param("H", "T", "X + skip (X without skip)", optional=True)],
    type_constraints={"T": ["tensor(float)", "tensor(float16)"]},
    attributes=[Attr("epsilon", "float", "added to the mean of squares")],
    infer=_rmsnorm_infer,
)
# RMS normalisation (onnx_lowbit.rmsnorm).
OPS[RMS_NORM.name] = RMS_NORM


def _schema(op: OpSpec) -> defs.OpSchema:
    opt = defs.OpSchema.FormalParameterOption
    params = lambda ps: [  # noqa: E731
        defs.OpSchema.FormalParameter(p.name, p.type_str, p.doc,
                                      param_option=opt.Optional if p.optional else opt.Single)
        for p in ps]
    schema = defs.OpSchema(
        op.name, DOMAIN, DOMAIN_VERSION, op.doc,
        inputs=params(op.inputs), outputs=params(op.outputs),
        type_constraints=[(v, ts, "") for v, ts in op.type_constraints.items()],
        attributes=[defs.OpSchema.Attribute(a.name, _ATTR_KINDS[a.kind], a.doc, required=a.required)
                    for a in op.attributes],
    )
    if op.infer is not None:
        schema.set_type_and_shape_inference_function(op.infer)
    return schema


_registered = False


def register_schemas() -> None:
    """Register every op schema of the domain with onnx (idempotent)."""
    global _registered
    if _registered:
        return
    for op in OPS.values():
        if not defs.has(op.name, DOMAIN_VERSION, DOMAIN):
            defs.register_schema(_schema(op))
    _registered = True


def opset_import() -> onnx.OperatorSetIdProto:
    return onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION)
