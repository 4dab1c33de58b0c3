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

OPS = {op.name: op for op in [FPLUT]}


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
