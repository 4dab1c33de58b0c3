"""What the ``rewrite`` / ``inspect`` flags mean for the passes: each pass's options from the parsed arguments, and
the calibration file (``--calibration``: one array per model input, checked against the model), read once."""
from __future__ import annotations

import sys

import numpy as np

from .errors import LowbitError
from .feeds import read_npz


def pass_options(a, model=None) -> dict:
    options = {}
    if getattr(a, "fplut_functions", None):
        options["fplut_functions"] = set(f.strip() for f in a.fplut_functions.split(",") if f.strip())
    if getattr(a, "device", None) == "cpu" and not getattr(a, "tune", False) and not getattr(a, "passes", None):
        from .cpu_passes import cpu_fplut_options  # the CPU's FPLUT functions (--tune measures every function,
        options = cpu_fplut_options(options)       # --passes fplut asks for every one)
    options.update(weights_options(a, model))
    if getattr(a, "ffn_weights", None) is not None:
        options["ffn_weights"] = a.ffn_weights
    if getattr(a, "merge_siblings", None) is not None:
        options["merge_siblings"] = a.merge_siblings
    if getattr(a, "kvattention_max_query", None) is not None:
        options["kvattention_max_query"] = a.kvattention_max_query
    options.update(gru_options(a, model, options.get("calibration")))
    return options


def gru_options(a, model, loaded=None) -> dict:
    """Options of the gru pass: --gru-bits, --gru-weight-bits, --gru-small, and --calibration (shared with AWQ) for its ranges."""
    options = {}
    if getattr(a, "gru_bits", None) is not None:
        options["gru_bits"] = a.gru_bits
    if getattr(a, "gru_weight_bits", None) is not None:
        bits = options.get("gru_bits", 16)
        if a.gru_weight_bits > bits:
            raise LowbitError(f"--gru-weight-bits {a.gru_weight_bits} is wider than --gru-bits {bits}: the weights "
                              "can be narrower than the arithmetic, not wider")
        options["gru_weight_bits"] = a.gru_weight_bits
    if getattr(a, "gru_small", None):
        options["gru_small"] = True
    if getattr(a, "calibration", None):
        has_gru = model is None or any(n.op_type == "GRU" for n in model.graph.node)
        if loaded is None and not has_gru:
            fmt = getattr(a, "weights", None)
            raise LowbitError(f"--calibration is only used by --weights awq{f' (not {fmt})' if fmt else ''}, "
                              "--rounding gptq, --budget and by the gru pass (the model has no GRU)")
        if has_gru:
            options["gru_calibration"] = loaded if loaded is not None else load_calibration(a.calibration, model)
            options["calibration_session"] = calibration_session
    return options


def weights_options(a, model) -> dict:
    """Options of the weights4 pass from --weights, --block-size, --group-size, --exclude, --calibration,
    --target (LowbitError for flags given without --weights, or a bad calibration file)."""
    fmt = getattr(a, "weights", None)
    ckpt = getattr(a, "awq_checkpoint", None)
    if ckpt and fmt is None:
        fmt = "awq"  # the checkpoint's weights are AWQ
    if fmt is None:
        given = [flag for flag, v in (("--block-size", a.block_size), ("--group-size", a.group_size),
                                      ("--exclude", a.exclude), ("--target", a.target), ("--lm-head", a.lm_head),
                                      ("--ort-form", getattr(a, "ort_form", None)),
                                      ("--ort-accuracy-level", getattr(a, "ort_accuracy_level", None) is not None),
                                      ("--nf4-accuracy-level", getattr(a, "nf4_accuracy_level", None) is not None),
                                      ("--rounding", getattr(a, "rounding", None)),
                                      ("--budget", getattr(a, "budget", None)),
                                      ("--budget-form", getattr(a, "budget_form", None)))
                 if v]
        if given:
            raise LowbitError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --weights nf4|fp4|awq")
        return {}
    options = {"weights": fmt}
    if a.target:        # (none given: lowbit, or --device cpu's default: _target_options)
        options["weights_target"] = a.target
    if ckpt:
        options["awq_checkpoint"] = ckpt
    if a.block_size is not None:
        options["block_size"] = a.block_size
    if a.group_size is not None:
        options["group_size"] = a.group_size
    if a.exclude:
        options["weights_exclude"] = list(a.exclude)
    if getattr(a, "ort_form", None):
        options["weights_ort_form"] = a.ort_form
    if getattr(a, "lm_head", None):
        options["weights_lm_head"] = a.lm_head
    options.update(quality_options(a))
    options = _target_options(a, options)
    needs = fmt == "awq" or "weights_rounding" in options or "weights_budget" in options
    if not a.calibration and ("weights_rounding" in options or "weights_budget" in options):
        raise LowbitError(f"{'--rounding gptq' if 'weights_rounding' in options else '--budget'} needs "
                          "--calibration FILE.npz (the activations it is measured on)")
    if a.calibration and needs:  # (the gru pass also reads --calibration: gru_options)
        options["calibration"] = load_calibration(a.calibration, model)
        options["calibration_session"] = calibration_session
    return options


def _target_options(a, options: dict) -> dict:
    """--ort-accuracy-level (only where the target is onnxruntime's MatMulNBits: --target ort with --weights awq, or
    --device cpu's default for awq), --nf4-accuracy-level (our MatMulNF4's: --weights nf4|fp4, target lowbit) and
    --device cpu's default target when --target is not given (onnx_lowbit/cpu_passes.py's CPU_WEIGHTS, said on
    stderr)."""
    level = getattr(a, "ort_accuracy_level", None)
    if level is not None:
        options["weights_ort_accuracy"] = level
    nf4_level = getattr(a, "nf4_accuracy_level", None)
    if nf4_level is not None:
        if options.get("weights") not in ("nf4", "fp4") or a.target == "ort":
            why = ("--target ort emits onnxruntime's MatMulBnb4, which has none" if a.target == "ort"
                   else f"not --weights {options.get('weights')}: --ort-accuracy-level is MatMulNBits'")
            raise LowbitError(f"--nf4-accuracy-level is our MatMulNF4's accuracy_level: it needs --weights nf4|fp4 "
                              f"and the lowbit target ({why})")
        options["weights_nf4_accuracy"] = nf4_level
    if getattr(a, "device", None) == "cpu" and not a.target:
        from .cpu_passes import cpu_weights_options
        options, note = cpu_weights_options(options)
        if note:
            print(f"onnx-lowbit: {note}", file=sys.stderr)
    if level is not None and (options.get("weights_target") != "ort" or options.get("weights") != "awq"):
        why = (f"not --weights {options.get('weights')}: MatMulBnb4, the ort target of nf4 / fp4, has none"
               if options.get("weights") != "awq" else "--target ort names it")
        raise LowbitError(f"--ort-accuracy-level is MatMulNBits' accuracy_level: it needs --weights awq --target ort "
                          f"({why})")
    return options


def add_quality_arguments(g) -> None:
    """--rounding, --budget, --budget-form (in the weights4 group of ``rewrite`` / ``inspect``)."""
    g.add_argument("--rounding", choices=["rtn", "gptq"],
                   help="rtn: round to nearest (default); gptq: GPTQ's error-compensating rounding on the calibration "
                        "activations (needs --calibration; any grid: NF4/FP4 blocks, AWQ groups, after AWQ's scales)")
    g.add_argument("--budget", type=_fraction, metavar="FRACTION",
                   help="total weight bytes at most FRACTION of the model's fp32 weight bytes (e.g. 0.30): the "
                        "products most sensitive on the calibration data (needs --calibration) stay in a higher "
                        "precision (--budget-form) while the budget allows")
    g.add_argument("--budget-form", choices=["int8", "fp16"],
                   help="the higher precision --budget keeps products in: int8 (default; per-channel, standard "
                        "DequantizeLinear + MatMul) or fp16")


def _fraction(v: str) -> float:
    import argparse
    try:
        f = float(v)
    except ValueError:
        f = -1.0
    if not 0 < f <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {v!r}")
    return f


def quality_options(a) -> dict:
    options = {}
    if getattr(a, "rounding", None) == "gptq":
        options["weights_rounding"] = "gptq"
    if getattr(a, "budget", None) is not None:
        options["weights_budget"] = a.budget
    if getattr(a, "budget_form", None):
        options["weights_budget_form"] = a.budget_form
    return options


def calibration_session(model):
    """Sessions for the AWQ calibration run (``model``: bytes or a path): our ops registered when earlier passes
    (fplut) emitted some; stock onnxruntime when the model has none (no shim build needed)."""
    import onnx
    import onnxruntime as ort
    from .domain import DOMAIN
    so = ort.SessionOptions()
    so.log_severity_level = 3
    proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model, load_external_data=False)
    if any(n.domain == DOMAIN for n in proto.graph.node):
        from .api import InferenceSession
        return InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def load_calibration(path, model=None) -> dict:
    """The arrays of a calibration .npz, one per graph input of ``model`` (checked: names, ranks, fixed dims)."""
    arrays = read_npz(path, "--calibration")
    if model is not None:
        inits = {i.name for i in model.graph.initializer}
        inputs = {vi.name: vi for vi in model.graph.input if vi.name not in inits}
        # NAME#K: run K of several (the gru pass: utterances of different lengths)
        base = {k: (k.rpartition("#")[0] if "#" in k and k.rpartition("#")[2].isdigit() else k) for k in arrays}
        unknown = sorted(k for k in arrays if base[k] not in inputs)
        if unknown:
            raise LowbitError(f"{path}: array{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                              f"name{'' if len(unknown) > 1 else 's'} no model input; inputs: "
                              f"{', '.join(map(repr, inputs))} (--calibration)")
        missing = [n for n in inputs if n not in base.values()]
        has_gru = any(n.op_type == "GRU" for n in model.graph.node)
        if missing and not has_gru:   # (a streaming GRU model's states may be left out: the gru pass checks)
            raise LowbitError(f"{path}: no array for model input{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(repr, missing))} (--calibration)")
        for key, v in arrays.items():
            vi = inputs[base[key]]
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                    for d in vi.type.tensor_type.shape.dim]
            if not missing and vi.type.tensor_type.HasField("shape") and (
                    len(dims) != v.ndim or any(isinstance(d, int) and d > 0 and d != n for d, n in zip(dims, v.shape))):
                raise LowbitError(f"{path}: array {key!r} has shape {list(v.shape)}, the model input {dims} "
                                  "(--calibration)")
            if not np.issubdtype(v.dtype, np.number) and v.dtype != np.bool_:
                raise LowbitError(f"{path}: array {key!r} has dtype {v.dtype}, not numeric (--calibration)")
    return arrays
