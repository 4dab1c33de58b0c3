"""Which passes ``rewrite --device cpu`` runs by default: only those known not to make a model slower on the CPU
than onnxruntime alone. ``CPU_DEFAULTS`` is the one table to update when a kernel's CPU face is re-measured
(BENCHMARKS.md, "CPU"); ``--tune`` measures instead of trusting the table (onnx_lowbit/tune.py).

Passes named in ``--passes`` run whatever the table says (the user chose them); ``--weights`` still adds weights4
(4-bit weights are asked for their size, kept even when slower). ``CPU_WEIGHTS`` says which op the 4-bit weights
run on when no ``--target`` is given: onnxruntime's MatMulNBits at accuracy_level 4 for AWQ, our MatMulNF4 at
accuracy_level 4 for NF4 / FP4 (each the faster measured here)."""
from __future__ import annotations

import sys

# pass name -> (run by default on the CPU, why). A pass is True here only with a CPU measurement behind it that
# shows it not slower than onnxruntime's own graph; a pass missing from the table is not a CPU default.
CPU_DEFAULTS = {
    "fplut": (True, "GELU (erf and tanh spellings) and spelled-out HardSwish only (CPU_FPLUT_FUNCTIONS): FPLUT fp32 "
                    "1.35-1.75x faster than onnxruntime's fused Gelu (a BERT-style encoder 1.10x and the demo's GPT-2 "
                    "MLP 1.13x faster), 1.33-1.46x faster than a 4-op HardSwish; SiLU, Sigmoid, Tanh and the "
                    "HardSwish op stay onnxruntime's (1.1-1.7x faster than the table at 1e5+ elements: BENCHMARKS.md, "
                    "CPU)"),
    "weights4": (False, "4-bit weights run when --weights asks (for size); on which op: CPU_WEIGHTS below"),
    "ffn": (False, "the float FusedFFN is 1.05-3.5x slower than onnxruntime's MLAS graph on the CPU (BENCHMARKS.md)"),
    "merge": (True, "one MatMul + Split instead of sibling MatMuls, stock onnxruntime ops only: measured not slower "
                    "on the CPU (docs/tune.md)"),
    "rotary": (False, "not measured on the CPU: a Python callback per call, where onnxruntime runs its own ops"),
    "rotarykv": (False, "not measured on the CPU: a Python callback per call, where onnxruntime runs its own ops"),
    "gru": (False, "needs --calibration; int8 2.0-3.1x faster than onnxruntime's GRU at H = 400, T = 500, full-range "
                   "int16 1.25x faster on one thread and 1.08x slower on two, streaming frames faster on one thread "
                   "and slower on two except int8 at H = 600 (BENCHMARKS.md); runs when --gru-bits asks, --tune "
                   "measures it"),
    "kvattention": (False, "opt-in on every device"),
    "cacheattention": (False, "opt-in on every device"),
    "rmsnorm": (False, "opt-in on every device"),
}


# The activations FPLUT replaces by default on the CPU (the fplut pass's fplut_functions; a user's fplut_functions
# wins): those whose table beats onnxruntime's own kernels in fp32 (GELU: onnxruntime fuses its spellings into Gelu /
# FastGelu, 1.35-1.75x slower than the table, 1 thread, 2026-11-29), and HardSwish where an exporter spelled it out
# (paddle2onnx's x * Clip(x + 3, 0, 6) / 6: four onnxruntime ops, 1.33-1.46x slower than the table in fp32 sessions
# at 1e4-1e6 elements; onnxruntime's own HardSwish op is 1.10-1.37x faster than the table, so it stays:
# "hardswish/decomposed"; 1 thread, thread time, 2026-11-29, `python benchmarks/cpu_kernels.py --only fplut
# --threads 1 --clock thread --functions hardswish,hardswish_spelled`). onnxruntime computes SiLU (fused QuickGelu),
# Sigmoid and Tanh at about a cycle per element, which a table lookup does not beat on Zen 4.
CPU_FPLUT_FUNCTIONS = ("gelu", "gelu_tanh", "hardswish/decomposed")


def cpu_fplut_options(options: dict) -> dict:
    """``options`` with fplut_functions = CPU_FPLUT_FUNCTIONS unless they name their own (``--device cpu`` without
    ``--tune``; with it every function is a candidate and the measurement decides)."""
    return options if options.get("fplut_functions") else dict(options, fplut_functions=set(CPU_FPLUT_FUNCTIONS))


# --weights FORMAT -> (target, accuracy_level or None: MatMulNBits' for target ort, MatMulNF4's for nf4 / fp4 on
# lowbit, why, figures): what ``--device cpu`` emits when no --target is given; the faster of our op and
# onnxruntime's own on this table's measurement (1 intra-op thread, thread CPU time, 2-core AMD EPYC Zen 4 with
# AVX512-VNNI, onnxruntime 1.32, 2026-11-28, two runs: benchmarks/cpu_ort_target.py; BENCHMARKS.md, CPU). NF4 / FP4
# codes are not on a uniform grid: they are never converted to int4 (lossy), they stay NF4 / FP4 in our MatMulNF4 or
# onnxruntime's MatMulBnb4, whichever measured faster; MatMulNF4 at accuracy_level 4 (int8 activations,
# onnx_lowbit/nf4_int8.py) measured faster than at 0 (2026-11-29, benchmarks/cpu_kernels.py --only 4bit).
CPU_WEIGHTS = {
    # format: (target, accuracy_level, why (stderr and the report), the figures behind it (stderr))
    "awq": ("ort", 4, "int8 activations: onnxruntime's fastest CPU 4-bit kernel; --target lowbit keeps our MatMulAWQ",
            "MatMulNBits at accuracy_level 4 against our MatMulAWQ 5.3-9.7x faster at M = 1, 3.6-7.9x at M = 16 "
            "(K x N 2048 x 2048, 2048 x 5632, 5632 x 2048); the demo's LLaMA MLP 2.4-2.5x / 2.7-3.4x faster (M = 1 / "
            "16, two runs): 1.37-1.46x faster / 1.03-1.13x slower than its fp32 original; accuracy_level 0 only "
            "1.0-2.9x faster than "
            "MatMulAWQ. SmolLM2-135M (AWQ calibrated): decode step 2.4x faster than fp32 (1.5x at level 0), "
            "perplexity 17.009 against 16.994 at level 0 (fp32 14.792)"),
    "nf4": ("lowbit", 4, "int8 activations, VNNI integer products (--nf4-accuracy-level 0 keeps fp32 activations); "
                         "onnxruntime's MatMulBnb4 (--target ort) measured slower; NF4 codes are not on "
                         "int4's uniform grid, so they are not re-quantised: --weights awq gets MatMulNBits",
            "MatMulNF4 at accuracy_level 4 against level 0 (session, 2026-11-29, two runs): 3.3-5.2x faster at M = 1, "
            "3.4-4.3x at M = 4, 2.0-2.6x at M = 16, 1.4-1.7x at M = 64 (K x N 2048 x 2048, 2048 x 5632, 5632 x 2048; "
            "3.5-4.3x faster than MatMulNBits at level 0); with constant weights repacked into column lanes "
            "(nf4/nf4col_cpu.py, 2026-11-29) 1.37-1.41x faster than MatMulNBits at level 4 at M = 1 and 1.84-1.91x "
            "at M = 4 / 16, and the demo's LLaMA MLP 1.72x / 1.95x faster than its fp32 original (M = 1 / 16). "
            "MatMulBnb4 against level 0 8.6-12.5x slower at M = 1, 2.3-2.6x at M = 16 (the MLP 4.0-4.3x / "
            "1.17-1.21x). SmolLM2-135M (RTN NF4): perplexity 19.812 at level 4 against 19.449 at level 0 (fp32 "
            "14.928, its HF tokenizer)"),
    "fp4": ("lowbit", 4, "as for nf4: the same kernels (MatMulNF4 / MatMulBnb4, quant_type fp4)",
            "not measured apart from nf4 (the same kernels, another 16-value table)"),
}


def cpu_weights_options(options: dict) -> tuple:
    """``options`` (the weights4 pass's) with the CPU_WEIGHTS target when they ask for 4-bit weights and name no
    ``weights_target``; (options, the note saying what was picked, why and the figures; '' when nothing changed).
    The option weights_target_why puts the note, less its figures, on every rewrite in the report. An AWQ
    checkpoint, or a group size onnxruntime's MatMulNBits does not take, keeps our MatMulAWQ (said in the note)."""
    fmt = options.get("weights") or ("awq" if options.get("awq_checkpoint") else None)
    if not fmt or options.get("weights_target") or fmt not in CPU_WEIGHTS:
        return options, ""
    target, level, why, figures = CPU_WEIGHTS[fmt]
    out = dict(options, weights_target=target)
    group = options.get("group_size", options.get("block_size"))
    if target == "ort" and fmt == "awq" and options.get("awq_checkpoint"):
        out["weights_target"], why, figures = "lowbit", ("--awq-checkpoint keeps our MatMulAWQ: the checkpoint's group "
                                                         "sizes may be ones MatMulNBits does not take; --target ort "
                                                         "names it"), ""
    elif target == "ort" and fmt == "awq" and group is not None and str(group).lstrip("-").isdigit():
        from .matmulnbits import ORT_BLOCK_SIZES  # noqa: PLC0415
        if int(group) not in ORT_BLOCK_SIZES:
            out["weights_target"], why, figures = "lowbit", (f"group size {group} is not one onnxruntime's "
                                                             "MatMulNBits takes: "
                                                             f"{', '.join(map(str, ORT_BLOCK_SIZES))}"), ""
    ours = out["weights_target"] == "lowbit" and fmt in ("nf4", "fp4")     # our MatMulNF4: its own accuracy_level
    key = "weights_ort_accuracy" if out["weights_target"] == "ort" else "weights_nf4_accuracy" if ours else None
    if key and level is not None and out.get(key) is None:
        out[key] = level
    lvl = out.get(key) if key else None
    if lvl is not None and lvl != level:
        why, figures = f"accuracy_level {lvl} as asked; {level} is the CPU default", ""
    op = {"awq": ("our MatMulAWQ", "onnxruntime's MatMulNBits")}.get(fmt, ("our MatMulNF4", "onnxruntime's MatMulBnb4"))
    note = (f"--device cpu --weights {fmt}: {op[out['weights_target'] == 'ort']}"
            + (f" at accuracy_level {lvl}" if lvl is not None else "") + f" ({why})")
    out["weights_target_why"] = note
    return out, note + (f"; measured: {figures} (onnx_lowbit/cpu_passes.py)" if figures else "")


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
    if getattr(a, "device", None) is None and getattr(a, "passes", None) is None and \
            getattr(a, "target", None) != "ort" and not ort_has_cuda():
        print(f"onnx-lowbit: {GPU_DEFAULT_HINT}", file=sys.stderr)
    if getattr(a, "device", None) != "cpu" or getattr(a, "tune", False):
        return list(selected)
    from .tune import asked_for_size   # --gru-bits / --weights: asked for their size, kept
    return cpu_selection(selected, explicit=getattr(a, "passes", None) is not None, keep=asked_for_size(a))


GPU_DEFAULT_HINT = ("no --device: every default pass, as for a GPU; this onnxruntime runs on the CPU only. For a "
                    "CPU deployment add --device cpu (only the passes measured not slower there) or --device cpu "
                    "--tune (each pass timed on this model, this machine)")


def ort_has_cuda() -> bool:
    """Whether the installed onnxruntime offers the CUDA execution provider (False when it cannot be imported)."""
    try:
        import onnxruntime as ort
        return "CUDAExecutionProvider" in ort.get_available_providers()
    except Exception:  # noqa: BLE001 - no usable onnxruntime: no GPU either
        return False


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
                   help="timed runs of each model per comparison with --tune (default 20, in rounds alternating "
                        "between the two models)")
