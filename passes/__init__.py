"""Graph rewrites (onnx-graphsurgeon), one per file.

    PASSES                          ordered registry: pass name -> Pass instance (fplut, weights4, matmulnbits, ffn,
                                       merge, rotary, rotarykv, kvattention, cacheattention,
                                       rmsnorm, gru)
    available()                     the pass names, in the order run_passes applies them
    run_passes(model, passes, **o)  -> (rewritten ModelProto, Report); the input model is not modified
                                       (passes=None: the default passes; matmulnbits, kvattention,
                                       cacheattention and rmsnorm run only when named)
    inspect(model, passes, **o)     -> Report of what run_passes would rewrite / skip (changes nothing)

See docs/passes.md for how a pass is written.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain
from onnx_lowbit.errors import INSTALL

from .cacheattention import CacheAttentionPass
from .kvattention import KVAttentionPass
from .matmulnbits import MatMulNBitsPass
from .base import Entry, Pass, Report, module_paths  # noqa: F401 - re-exported
from .ffn import FFNPass
from .fplut import FPLUTPass
from .gru import GRUPass
from .merge import MergePass
from .ortnorm import OrtNormPass
from .rmsnorm import RMSNormPass
from .rotary import RotaryPass
from .rotarykv import RotaryKVPass
from .weights4 import WeightsPass

# weights4 runs after fplut and changes nothing unless its option ``weights`` is given. matmulnbits (onnxruntime-
# genai's int4 SwiGLU gate/up MatMulNBits -> MatMulAWQ, lossless; not a default pass) runs before ffn. ffn runs after
# weights4, so quantised gate/up projections become one FusedFFNNF4 / FusedFFNAWQ (docs/ffn.md). merge runs after
# both (it
# merges what they leave, e.g. q/k/v; on unless its option ``merge_siblings`` is False). rotarykv runs after merge
# and rotary (it needs both: it takes the merged q/k/v Split, their Rotary nodes and the KV-cache Concats into one
# RotaryKV node). kvattention runs after rotarykv (its Q is RotaryKV's output, its K and V the present tensors; it
# takes the K / V repeats, the scores' MatMul, scale, mask Add, Softmax and the MatMul with V into one KVAttention
# node). cacheattention (genai's GroupQueryAttention -> CacheAttention) runs on genai's graphs, which rotary / rotarykv
# / kvattention never match; ortnorm (genai's norms -> RMSNorm) likewise. kvattention, cacheattention, rmsnorm and
# ortnorm are not default passes of rewrite (measured no faster / slower than onnxruntime's own kernels outside
# genai's CUDA loop: docs/passes.md); onnx-lowbit genai runs cacheattention and ortnorm on CUDA (genai_config).
PASSES: "OrderedDict[str, Pass]" = OrderedDict((p.name, p) for p in [FPLUTPass(), WeightsPass(), MatMulNBitsPass(),
                                                                       FFNPass(),
                                                                       MergePass(), RotaryPass(), RotaryKVPass(),
                                                                       KVAttentionPass(), CacheAttentionPass(),
                                                                       RMSNormPass(), OrtNormPass(),
                                                                       GRUPass()])

# Other custom domains a pass may emit (weights4 with weights_target="ort": onnxruntime's com.microsoft ops):
# their opset import is added to the output when one of their ops is used.
FOREIGN_DOMAINS = {"com.microsoft": 1}


def available() -> list:
    """Names of the registered passes, in application order."""
    return list(PASSES)


def resolve(passes=None) -> list:
    """The Pass instances for ``passes`` (None: every default pass, in registry order; a name; a comma-separated
    string; or names, in the order given). Raises ValueError naming unknown passes and listing the known ones."""
    if passes is None:
        return [p for p in PASSES.values() if p.default]
    if isinstance(passes, str):
        passes = [p.strip() for p in passes.split(",") if p.strip()]
    names = list(passes)
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass{'es' if len(unknown) > 1 else ''}: {', '.join(map(repr, unknown))}; "
                         f"known passes: {', '.join(PASSES)}")
    return [PASSES[n] for n in names]


def _load(model) -> onnx.ModelProto:
    """A private copy of ``model`` (ModelProto, path or serialized bytes)."""
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model))
    raise TypeError(f"expected an onnx.ModelProto, a path or bytes, got {type(model).__name__}")


def _inferred_types(model: onnx.ModelProto) -> dict:
    """tensor name -> (ONNX element type or 0, shape list or None), from onnx shape inference (empty if it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - inference is only a help for the dtype/rank checks of the passes
        return {}
    g = inferred.graph
    types = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        shape = None
        if tt.HasField("shape"):
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        types[vi.name] = (tt.elem_type, shape)
    return types


def _fill_types(graph: gs.Graph, types: dict) -> list:
    """Gives main-graph variables without dtype / shape the inferred ones (so passes can check dtypes and
    ranks); returns (tensor, dtype filled, shape filled) records, reset before export so the output does not
    gain value_info from this."""
    filled = []
    if not types:
        return filled
    for name, t in graph.tensors().items():
        if not isinstance(t, gs.Variable) or name not in types:
            continue
        et, shape = types[name]
        fill_dtype = t.dtype is None and bool(et)
        fill_shape = t.shape is None and shape is not None
        if fill_dtype:
            np_type = onnx.helper.tensor_dtype_to_np_dtype(et) if et != onnx.TensorProto.BFLOAT16 else None
            t.dtype = np_type if np_type is not None else et
        if fill_shape:
            t.shape = shape
        if fill_dtype or fill_shape:
            filled.append((t, fill_dtype, fill_shape))
    return filled


def _emits_domain(model: onnx.ModelProto, name: str = domain.DOMAIN) -> bool:
    def walk(graph):
        for n in graph.node:
            if n.domain == name:
                return True
            for a in n.attribute:
                subs = ([a.g] if a.HasField("g") else []) + list(a.graphs)
                if any(walk(s) for s in subs):
                    return True
        return False
    return walk(model.graph)


_emits_our_domain = _emits_domain


def run_passes(model, passes=None, **options):
    """Applies ``passes`` (default: the default passes, ``Pass.default``, in registry order; rmsnorm only when
    named) to a copy of ``model``.

    Returns ``(rewritten ModelProto, Report)``. Graph input/output names are kept; opset imports, ir_version,
    producer and metadata of the input are restored on the output, plus our domain's opset import when one of
    our ops was emitted. Options are read by the passes (see each pass, e.g. ``fplut_functions``).

    Streaming (models with external data, see passes/external.py): ``model`` loaded without its external data,
    ``external_data_dir`` the folder its data files are relative to, and optionally ``spill`` (e.g.
    onnx_lowbit.model_io.StagedOutput.spill) to write new large constants out as soon as they are made.
    """
    selected = resolve(passes)
    domain.register_schemas()
    src = _load(model)
    report = Report()
    try:
        return _apply(src, selected, report, options)
    except Exception as e:
        from onnx_lowbit import model_io
        from onnx_lowbit.errors import LowbitError
        why = None if isinstance(e, LowbitError) else model_io.malformed(src)
        if why is None:  # a valid model: option errors (ValueError) and our own bugs surface unchanged
            raise
        raise LowbitError(f"the model is malformed, onnx's checker says: {why}") from e


def _apply(src: onnx.ModelProto, selected: list, report: Report, options: dict):
    graph = gs.import_onnx(src)
    if options.get("external_data_dir") is not None:  # streaming: weights read from their file when needed
        from . import external
        external.attach(graph, options["external_data_dir"])
    filled = _fill_types(graph, _inferred_types(src))
    for p in selected:
        p.apply(graph, report, dict(options, module_paths=module_paths(src)))
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    for t, fill_dtype, fill_shape in filled:
        if fill_dtype:
            t.dtype = None
        if fill_shape:
            t.shape = None

    out = gs.export_onnx(graph, do_type_check=False)
    _restore_model_fields(out, src)
    return out, report


def _restore_model_fields(out: onnx.ModelProto, src: onnx.ModelProto) -> None:
    out.ir_version = src.ir_version
    for f in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(out, f, getattr(src, f))
    del out.metadata_props[:]
    out.metadata_props.extend(src.metadata_props)
    del out.opset_import[:]
    out.opset_import.extend(src.opset_import)
    if _emits_our_domain(out) and not any(o.domain == domain.DOMAIN for o in out.opset_import):
        out.opset_import.append(domain.opset_import())
    for name, version in FOREIGN_DOMAINS.items():
        if _emits_domain(out, name) and not any(o.domain == name for o in out.opset_import):
            out.opset_import.append(onnx.helper.make_opsetid(name, version))
    note_requirements(out)
    if src.graph.name:
        out.graph.name = src.graph.name
    if len(src.training_info):
        out.training_info.extend(src.training_info)


# metadata_props written on every rewritten model that uses our ops: onnxruntime's own error for an unregistered
# op ("onnx_lowbit:FPLUT(-1) is not a registered function/op") cannot name the package; these keys can, and
# onnx_lowbit.api.explain_error / `onnx-lowbit inspect` read them.
REQUIRES_KEY = "onnx_lowbit.requires"
OPS_KEY = "onnx_lowbit.ops"


def ops_used(model: onnx.ModelProto, name: str = domain.DOMAIN) -> dict:
    """{op type: count} of the nodes of domain ``name`` in the graph and its subgraphs."""
    counts: dict = {}

    def walk(graph):
        for n in graph.node:
            if n.domain == name:
                counts[n.op_type] = counts.get(n.op_type, 0) + 1
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    walk(sub)
    walk(model.graph)
    return counts


def note_requirements(model: onnx.ModelProto) -> None:
    """Sets (or removes, when no op of ours is left) the onnx_lowbit.* metadata_props of ``model``."""
    from onnx_lowbit import __version__
    keep = [p for p in model.metadata_props if p.key not in (REQUIRES_KEY, OPS_KEY)]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    ops = ops_used(model)
    if not ops:
        return
    version = next((o.version for o in model.opset_import if o.domain == domain.DOMAIN), domain.DOMAIN_VERSION)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in keep},
        REQUIRES_KEY: f"onnx-lowbit>={__version__} ({INSTALL}); "
                      "register its ops before creating the session: onnx_lowbit.register(sess_options), or use "
                      "onnx_lowbit.InferenceSession(model, providers=...)",
        OPS_KEY: f"{','.join(sorted(ops))} (domain {domain.DOMAIN} v{version})"})


def inspect(model, passes=None, **options) -> Report:
    """What ``run_passes`` would rewrite and skip; ``model`` is left untouched and no model is returned."""
    return run_passes(model, passes, **options)[1]


__all__ = ["PASSES", "Pass", "Report", "Entry", "available", "resolve", "run_passes", "inspect", "ops_used",
           "note_requirements", "REQUIRES_KEY", "OPS_KEY"]
