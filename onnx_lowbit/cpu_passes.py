"""Which passes ``rewrite --device cpu`` runs by default: only those known not to make a model slower on the CPU
than onnxruntime alone. ``CPU_DEFAULTS`` is the one table to update when a kernel's CPU face is re-measured
(BENCHMARKS.md, "CPU"); ``--tune`` measures instead of trusting the table (onnx_lowbit/tune.py).

Passes named in ``--passes`` run whatever the table says (the user chose them); ``--weights`` still adds weights4
(4-bit weights are asked for their size, kept even when slower)."""
from __future__ import annotations

import sys

# pass name -> (run by default on the CPU, why). A pass is True here only with a CPU measurement behind it that
# shows it not slower than onnxruntime's own graph; a pass missing from the table is not a CPU default.
CPU_DEFAULTS = {
    "fplut": (False, "FPLUT made every real model tried 1.05-1.7x slower on the CPU (a Python callback per op per "
                     "run; BENCHMARKS.md, CPU)"),
    "weights4": (False, "4-bit weights are for size: 1.1-3.2x slower on the CPU; they run when --weights asks"),
    "ffn": (False, "the float FusedFFN is 1.05-3.5x slower than onnxruntime's MLAS graph on the CPU (BENCHMARKS.md)"),
    "merge": (True, "one MatMul + Split instead of sibling MatMuls, stock onnxruntime ops only: measured not slower "
                    "on the CPU (docs/tune.md)"),
    "rotary": (False, "not measured on the CPU: a Python callback per call, where onnxruntime runs its own ops"),
    "rotarykv": (False, "not measured on the CPU: a Python callback per call, where onnxruntime runs its own ops"),
    "gru": (False, "QuantGRU made the GRU models tried 1.5-4.7x slower on the CPU (a bit-exact reference kernel)"),
    "kvattention": (False, "opt-in on every device"),
    "rmsnorm": (False, "opt-in on every device"),
}


def cpu_default(name: str) -> bool:
    return CPU_DEFAULTS.get(name, (False, ""))[0]


def cpu_selection(selected: list, explicit: bool, keep=(), quiet: bool = False) -> list:
    """``selected`` (Pass objects) less the passes ``CPU_DEFAULTS`` keeps off the CPU, except those in ``keep``
    (asked for their size, e.g. weights4 with weights=...); unchanged when ``explicit`` (the user named the
    passes). Says on stderr which were left out and why, unless ``quiet``."""
    if explicit:
        return list(selected)
    kept = [p for p in selected if cpu_default(p.name) or p.name in keep]
    left = [p.name for p in selected if p not in kept]
    if left and not quiet:
        print(f"onnx-lowbit: --device cpu: left out {', '.join(left)} (not known to be faster on the CPU: "
              "onnx_lowbit/cpu_passes.py; --tune measures them on your model, --passes names them to run them "
              "anyway)", file=sys.stderr)
    return kept


def device_selection(a, selected: list) -> list:
    """The CLI's hook (``--device``): cpu_selection for --device cpu (with --tune every selected pass stays a
    candidate: tune measures them), else ``selected`` unchanged."""
    from .errors import LowbitError
    if getattr(a, "tune_runs", None) is not None and not getattr(a, "tune", False):
        raise LowbitError("--tune-runs needs --tune (with --device cpu)")
    if getattr(a, "tune", False) and getattr(a, "device", None) != "cpu":
        raise LowbitError("--tune measures in onnxruntime CPU sessions: give --device cpu with it (tuning for "
                          "CUDA is not built)")
    if getattr(a, "device", None) != "cpu" or getattr(a, "tune", False):
        return list(selected)
    return cpu_selection(selected, explicit=getattr(a, "passes", None) is not None)


def add_arguments(p) -> None:
    """The rewrite flags of the device a model is rewritten for (--device, --tune, --tune-runs)."""
    g = p.add_argument_group("the device the rewrite is for")
    g.add_argument("--device", choices=["cpu", "cuda"],
                   help="cpu: by default only the passes known not to be slower on the CPU (onnx_lowbit/"
                        f"cpu_passes.py: {', '.join(n for n, (on, _) in CPU_DEFAULTS.items() if on) or 'none'} "
                        "today; 4-bit weights with --weights); cuda: every default pass (the default)")
    g.add_argument("--tune", action="store_true",
                   help="with --device cpu: time each pass's rewrite against the model without it on this machine "
                        "(onnxruntime CPU sessions, the --verify-data / --calibration inputs or made-up ones, "
                        "--dim) and keep only those measured faster; 4-bit weights asked for with --weights (and "
                        "gru with --gru-bits) are kept even when slower; the decisions and figures are printed "
                        "(and in --report-json under 'tune')")
    g.add_argument("--tune-runs", type=int, metavar="N",
                   help="timed runs of each model per comparison with --tune (default 20, alternating)")
