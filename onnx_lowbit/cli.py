"""The ``onnx-lowbit`` command line. Bad input gives one line on stderr and exit status 2 (never a traceback);
a failed --verify gives exit status 1 and keeps the rewritten model as OUT with ``.unverified`` before its
extension (``y.onnx`` -> ``y.unverified.onnx``), never as OUT itself."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile

from . import __version__
from .cli_options import add_quality_arguments, pass_options
from .cpu_passes import add_arguments as _device_arguments, device_selection
from .errors import LowbitError
from .progress import Status

EXIT_VERIFY_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 1, 2, 3
EXIT_WEIGHTS_LEFT = 4  # --weights: some constant-weight products stayed in float for a reason the user must see


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: same one-line form, exit 2
        self.print_usage(sys.stderr)
        raise LowbitError(message)


def _progress(iterable, desc, total=None):
    """Iterate with a status line that names the step and counts (``desc i/n``); used by eval-ppl's windows."""
    n = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
    with Status() as st:
        for i, item in enumerate(iterable, 1):
            st.step(f"{desc} {i}/{n}" if n else f"{desc} {i}")
            yield item


def _same_file(a, b) -> bool:
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# Passes whose output stock onnxruntime runs (weights4 with --target ort emits com.microsoft MatMulNBits /
# MatMulBnb4; merge concatenates those products): the default selection of --target ort.
ORT_TARGET_PASSES = ("weights4", "merge")


def _selected_passes(a, passes_mod):
    """--passes (default: the default passes); --weights adds weights4 when --passes leaves it out, before the first
    selected pass that the registry orders after it (ffn: so quantised gate/up projections are fused as 4-bit)."""
    selected = passes_mod.resolve(a.passes)
    if getattr(a, "target", None) == "ort" and a.passes is None:
        # --target ort promises a model stock onnxruntime runs: by default only the passes that emit no op of ours
        left = [p.name for p in selected if p.name not in ORT_TARGET_PASSES]
        selected = [p for p in selected if p.name in ORT_TARGET_PASSES]
        if left:
            print(f"onnx-lowbit: --target ort: left out {', '.join(left)} (they emit onnx-lowbit ops, which stock "
                  "onnxruntime cannot run; name them in --passes to run them anyway)", file=sys.stderr)
    selected = device_selection(a, selected)   # --device cpu: onnx_lowbit/cpu_passes.py
    if getattr(a, "weights", None) and "weights4" in passes_mod.PASSES and \
            not any(p.name == "weights4" for p in selected):
        order = list(passes_mod.PASSES)
        later = [i for i, p in enumerate(selected) if order.index(p.name) > order.index("weights4")]
        selected.insert(later[0] if later else len(selected), passes_mod.PASSES["weights4"])
    return selected


def _weights_totals(report) -> dict | None:
    from onnx_lowbit.passes import weights4
    t = weights4.totals(report)
    return t if t["weights"] else None


def _weights_summary(report) -> str | None:
    t = _weights_totals(report)
    if not t:
        return None
    mib = 1024.0 * 1024.0
    head = (f"; output head kept in float ({t['head_kept_bytes'] / mib:.2f} MiB; --lm-head 4bit quantises it)"
            if t.get("head_kept") else "")
    by_op = t.get("accuracy_levels_by_op") or {}
    names = {"MatMulNBits": "onnxruntime's MatMulNBits", "MatMulNF4": "MatMulNF4"}
    ort = "".join(f"; {names.get(op, op)}, accuracy_level {', '.join(map(str, lv))}" for op, lv in by_op.items())
    return (f"weights4: {t['weights']} weights, {t['bytes_before'] / mib:.2f} MiB -> {t['bytes_after'] / mib:.2f} "
            f"MiB ({t['ratio']:.3f}x), relative reconstruction error max {t['max_rel_error']:.4f} "
            f"mean {t['mean_rel_error']:.4f}{ort}{head}")


def _loud_skips(report) -> str | None:
    """The float weights weights4 left in float for a reason the user did not choose (exit status 4)."""
    from onnx_lowbit.passes import weights4
    left = weights4.unquantised(report)
    if not left:
        return None
    lines = [f"onnx-lowbit: warning: {len(left)} constant weight{'s' if len(left) > 1 else ''} stayed in float "
             f"(exit status {EXIT_WEIGHTS_LEFT}; --exclude them to make that a choice):"]
    lines += [f"  {', '.join(e.nodes)}: {e.reason}" for e in left[:20]]
    if len(left) > 20:
        lines.append(f"  ... and {len(left) - 20} more (--report lists them)")
    return "\n".join(lines)


def unverified_path(out: str) -> str:
    """Where a rewrite that failed --verify is kept: ``y.onnx`` -> ``y.unverified.onnx``."""
    root, ext = os.path.splitext(out)
    return f"{root}.unverified{ext or '.onnx'}"


def _verify_feeds(a, model):
    """(feeds, dim values, names of random inputs, where the data came from) for --verify, made before the
    rewrite so that a bad file or --dim fails at once; None without --verify."""
    from . import feeds
    if not a.verify:
        return None
    data_path = a.verify_data or a.calibration
    flag = "--verify-data" if a.verify_data else "--calibration"
    sig = feeds.signature(model)
    data, runs = feeds.first_run(feeds.read_npz(data_path, flag)) if data_path else ({}, 1)
    data = feeds.check_arrays(data_path, data, sig, flag) if data_path else {}
    got, values, made_up = feeds.make_feeds(model, data=data, dims=feeds.parse_dims(a.dim))
    where = f"{data_path} ({flag})" if data_path else "made-up inputs (--verify-data FILE.npz for real ones)"
    if runs > 1:   # NAME#K: several calibration runs (docs/gru.md); verify runs the first
        where = f"{data_path} ({flag}, its first run of {runs})"
    return got, values, made_up, where


def cmd_rewrite(a) -> int:
    from . import model_io
    from onnx_lowbit import passes as passes_mod
    selected = _selected_passes(a, passes_mod)  # unknown names fail before any work
    if _same_file(a.input, a.output):
        raise LowbitError(f"OUT must differ from IN ({a.output}); the input is never overwritten")
    if a.verify_data or a.dim:
        a.verify = True    # --verify-data / --dim imply --verify
    head = model_io.load(a.input, load_external_data=False)  # the graph; weights in external data stay on disk
    model_io.check_opset(head, a.input)
    model_io.check_output_spares_input(a.output, a.input, head)
    if a.verify:
        model_io.check_output_spares_input(unverified_path(a.output), a.input, head)
    verify_feeds = _verify_feeds(a, head)
    tuning = None
    if getattr(a, "tune", False):   # --tune: onnx_lowbit/tune.py (checks its flags, reads its inputs now)
        from .tune import cli_setup
        tuning = cli_setup(a, head, verify_feeds)
    # Models with external data (all models over 2 GB) are streamed: weights are read one at a time and new ones
    # are written to OUT's data file as they are made. AWQ calibration runs the whole model: it loads it.
    streamed = model_io.uses_external_data(head) and not getattr(a, "calibration", None) and tuning is None
    model = head if streamed else model_io.load(a.input)
    options = pass_options(a, model)
    staged = None
    if streamed:
        staged = model_io.StagedOutput(a.output)
        options.update(external_data_dir=os.path.dirname(os.path.abspath(a.input)), spill=staged.spill)
    try:
        return _rewrite(a, model, selected, options, staged, verify_feeds, tuning)
    finally:
        if staged is not None:
            staged.abort()


def _verify(a, model, out, staged_path, report, verify_feeds) -> bool:
    """--verify: prints the inputs, the per-output figures and notes; True when every output is within the
    tolerance."""
    from . import verify
    feeds, values, made_up, where = verify_feeds
    tol = a.tolerance if a.tolerance is not None else verify.default_tolerance(_weights_totals(report))
    print(f"verify on {where}: " + verify.describe_inputs(feeds, made_up, values)[len("inputs: "):])
    original, rewritten = (os.path.abspath(a.input), staged_path) if staged_path else (model, out)
    try:
        with Status() as st:
            st.step("verify: the original and the rewritten model in onnxruntime on the same inputs")
            errors, _ = verify.compare(original, rewritten, tolerance=tol, feeds=feeds)
    except LowbitError as e:
        print(f"onnx-lowbit: {e}", file=sys.stderr)
        if made_up:
            print("onnx-lowbit: note: inputs were made up for " + ", ".join(made_up) + "; give real ones with "
                  "--verify-data FILE.npz, or the sizes of symbolic dims with --dim NAME=VALUE", file=sys.stderr)
        return False
    print(verify.format_errors(errors, tol))
    if all(e.ok for e in errors):   # (unchecked outputs are ok unless NaN / shape mismatches)
        return True
    t = _weights_totals(report)
    if t:
        print(f"onnx-lowbit: note: 4-bit weights change outputs by about their reconstruction error "
              f"(max {t['max_rel_error']:.3f} per weight here); --verify-tol sets the limit", file=sys.stderr)
    return False


def _rewrite(a, model, selected, options, staged, verify_feeds=None, tuning=None) -> int:
    """The passes, --verify and the write of cmd_rewrite; ``staged``: the streamed output (None: in memory)."""
    from . import model_io
    from onnx_lowbit import passes as passes_mod
    out, report = None, passes_mod.Report()
    current = model
    with Status() as status:
        options = dict(options, progress=status.note)
        if tuning is not None:      # --tune: passes kept only where they measured faster (onnx_lowbit/tune.py)
            current, report = tuning(current, selected, options, status.step)
        for i, p in enumerate(selected if tuning is None else []):
            status.step(f"pass {i + 1}/{len(selected)} {p.name}")
            current, r = passes_mod.run_passes(current, passes=[p.name], **options)
            report.extend(r)
        out = current
        if staged is not None:
            status.step("writing the rewritten weights")
        staged_path = staged.write(out, options["external_data_dir"]) if staged is not None else None
    print(_first_line(a.input, report, selected, options))
    if tuning is not None:
        print(report.tune.to_table())
    summary = _weights_summary(report)
    if summary:
        print(summary)
    from onnx_lowbit.passes.gru import calibration_note
    if calibration_note(report):
        print(calibration_note(report), file=sys.stderr)
    loud = _loud_skips(report)
    if loud:
        print(loud, file=sys.stderr)
    if a.report:
        print(report.to_table(width=shutil.get_terminal_size((120, 24)).columns))
    if a.report_json:
        with open(a.report_json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    status = EXIT_WEIGHTS_LEFT if loud else 0
    target = a.output
    if a.verify and not _verify(a, model, out, staged_path, report, verify_feeds):
        target, status = unverified_path(a.output), EXIT_VERIFY_FAILED
    if staged is not None:
        staged.commit(target)
    else:
        model_io.save(out, target)
    if target != a.output:
        print(f"onnx-lowbit: verification failed: the rewritten model is kept as {target} ({a.output} not "
              "written); judge the figures above, rename it to use it", file=sys.stderr)
    else:
        print(f"wrote {a.output}")
    return status


def _first_line(path, report, selected, options) -> str:
    """``IN: N rewritten, M skipped by <passes that ran>; not run: <pass> (needs <flag>)``: skips are candidates a
    pass looked at and left; passes that lacked an option they need are named apart (their candidates: --report)."""
    ran = [p.name for p in selected if p.needs(options) is None]
    idle = [f"{p.name} (needs {p.needs(options)})" for p in selected if p.needs(options) is not None]
    line = (f"{path}: {len(report.rewritten())} rewritten, {len(report.skipped())} skipped by "
            f"{', '.join(ran) or 'no pass'}")
    return line + (f"; not run: {', '.join(idle)}" if idle else "")


def cmd_inspect(a) -> int:
    from . import model_io
    from onnx_lowbit import passes as passes_mod
    from .domain import DOMAIN, DOMAIN_VERSION
    selected = _selected_passes(a, passes_mod)
    model = model_io.load(a.input, load_external_data=False)  # weights in external data are read when needed
    opset = model_io.check_opset(model, a.input)
    ours, ms = passes_mod.ops_used(model), passes_mod.ops_used(model, "com.microsoft")
    versions = {o.domain: o.version for o in model.opset_import}
    print(f"{a.input}: opset {opset}, {len(model.graph.node)} nodes")
    if ours:
        v = versions.get(DOMAIN, "?")
        print(f"uses onnx-lowbit ops (domain {DOMAIN} v{v}"
              + ("" if v == DOMAIN_VERSION else f"; this onnx-lowbit {__version__} implements v{DOMAIN_VERSION}")
              + "): " + ", ".join(f"{k} x{n}" for k, n in sorted(ours.items())))
        print("  to run it, register them: onnx_lowbit.register(sess_options), or onnx_lowbit.InferenceSession(...)")
    if ms:
        print(f"uses onnxruntime contrib ops (domain com.microsoft v{versions.get('com.microsoft', '?')}; stock "
              "onnxruntime runs them): " + ", ".join(f"{k} x{n}" for k, n in sorted(ms.items())))
    options = pass_options(a, model)
    with contextlib.ExitStack() as stack:
        if model_io.uses_external_data(model):  # streamed like rewrite; quantised weights go to a scratch file
            options["external_data_dir"] = os.path.dirname(os.path.abspath(a.input))
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="onnx-lowbit-inspect-"))
            options["spill"] = stack.enter_context(model_io.StagedOutput(os.path.join(scratch, "m.onnx"))).spill
        report = passes_mod.inspect(model, passes=[p.name for p in selected], **options)
    print(report.to_table(width=shutil.get_terminal_size((120, 24)).columns) if len(report) else "nothing to rewrite")
    summary = _weights_summary(report)
    if summary:
        print(summary)
    return 0


def cmd_bench(a) -> int:
    from . import api, bench
    return bench.main(a, session_factory=api.InferenceSession)


def cmd_eval_ppl(a) -> int:
    from . import api, evalppl

    def session(path):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.log_severity_level = 3
        return api.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return evalppl.main(a, session_factory=session, progress=_progress)


def cmd_genai(a) -> int:
    from . import genai_config
    opts = {"matmulnbits_lossy": True} if a.lossy else {}
    if a.to:
        opts["matmulnbits_to"] = a.to
    passes = a.passes.split(",") if a.passes else genai_config.default_passes(a.provider, a.input, a.to)
    if not a.passes:    # the default passes only where their CUDA kernels were measured (genai_config)
        opts.update({opt: True for name, opt in genai_config.DEFAULT_OPTIONS.items() if name in passes})
    report = genai_config.rewrite_folder(a.input, a.output, passes=passes, **opts)
    if a.provider:
        genai_config.set_provider(a.output, a.provider, cuda_graph=a.cuda_graph)
    if a.report:
        print(report.to_table(shutil.get_terminal_size().columns))
    lib = genai_config.library_file(a.output)
    print(f"{a.input}: {len(report.rewritten())} rewritten, {len(report.skipped())} skipped by {', '.join(passes)}"
          f"\nwrote {a.output}" + (f" (custom_ops_library {os.path.basename(lib)}: call "
          "onnx_lowbit.genai_config.prepare(folder) before og.Model(folder))" if lib else ""))
    on_cpu = not genai_config.on_cuda(a.output)
    if not a.passes and not report.rewritten() and on_cpu:
        print("note: on the CPU `onnx-lowbit genai` converts genai's int4 products (MatMulNBits) by default, and this "
              "build has none: the folder is the original's. The SwiGLU fusion (--passes ffn) measured no faster on "
              "the CPU (BENCHMARKS.md, onnxruntime-genai's int4 model on the CPU)")
    if report.rewritten("cacheattention") and on_cpu:
        print("note: CacheAttention on the CPU measured slower than onnxruntime's GroupQueryAttention (decode and "
              "prompts; BENCHMARKS.md, CacheAttention in genai's loop): the cacheattention pass pays off on CUDA")
    return 0


def cmd_demo(a) -> int:
    from . import demo
    return demo.run(out_dir=a.out)


def cmd_lut(a) -> int:
    from . import fplut_tables
    if a.lut_cmd == "list":
        return _lut_list(fplut_tables)
    if a.function not in fplut_tables.available():
        raise LowbitError(f"unknown function {a.function!r}; known: {', '.join(fplut_tables.available())}")
    out = a.output or f"fplut-{a.function}.png"
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise LowbitError(f"{out}: directory {d} does not exist")
    try:
        import matplotlib  # noqa: F401 - only to say clearly what is missing before any work
    except ImportError:
        raise LowbitError("lut plot draws with matplotlib, which is not installed: pip install matplotlib (or, "
                          "from an onnx-lowbit checkout, pip install \".[cpu,plot]\")") from None
    from .fplut_plot import plot_error
    plot_error(a.function, out)
    print(f"wrote {out}")
    return 0


def _lut_list(fplut_tables) -> int:
    """The shipped tables' exhaustive figures; (clip): against f clipped to +-65504, which differs only where f
    overflows fp16 (exp), and there is the figure that applies."""
    print(f"{'function':12s} {'max abs':>10s} {'max rel':>9s} {'abs (clip)':>10s} {'rel (clip)':>10s} "
          f"{'exact %':>8s} {'<=1ULP %':>9s}  range [c0, c10]")
    overflow = []
    for name in fplut_tables.available():
        st, cl, t = fplut_tables.stats(name), fplut_tables.clipped_stats(name), fplut_tables.get_table(name)
        print(f"{name:12s} {st['max_abs']:10.2e} {st['max_rel']:9.2e} {cl['max_abs']:10.2e} {cl['max_rel']:10.2e} "
              f"{st['exact_pct']:8.2f} {st['within_1ulp_pct']:9.2f}  [{t.cut_points[0]:.10g}, {t.cut_points[-1]:.10g}]")
        if st["max_abs"] > 2 * cl["max_abs"]:
            overflow.append(f"{name} (past x = {t.cut_points[-1]:.10g})")
    print("\nerrors over all 63,488 finite fp16 inputs against f in float64; (clip): against f clipped to +-65504, "
          "the largest fp16 value")
    if overflow:
        print(f"{', '.join(overflow)}: f overflows fp16 there, so every fp16 output stops at 65504 while f grows "
              "(max abs up to 1e308, max rel 1): the (clip) columns are the table's error")
    print("outside [c0, c10] a table returns f(c0) / f(c10); error vs x: onnx-lowbit lut plot NAME -o NAME.png")
    return 0


def _weights_arguments(p) -> None:
    g = p.add_argument_group("4-bit weights (the weights4 pass; --weights makes it run)")
    g.add_argument("--weights", choices=["nf4", "fp4", "awq"], help="quantise MatMul/Gemm constant weights")
    g.add_argument("--block-size", type=int, metavar="N", help="NF4/FP4 absmax block (power of two, default 64)")
    g.add_argument("--group-size", type=int, metavar="N", help="AWQ group along K (default 128)")
    g.add_argument("--exclude", action="append", metavar="NAME_OR_REGEX",
                   help="leave weights whose node or tensor name equals / matches this in float (repeatable)")
    g.add_argument("--lm-head", choices=["fp16", "float", "4bit"],
                   help="the output head over a vocabulary (an LLM's lm_head, tied to the embedding or not): fp16 "
                        "(default: float32 models store it, and a tied embedding table, once in fp16), float (as the "
                        "model has it, stored once), 4bit (quantised like the others: costs more accuracy than all "
                        "other weights together)")
    g.add_argument("--calibration", metavar="FILE.npz",
                   help="calibration inputs (AWQ's scale search; the gru pass's ranges), one array per model "
                        "input, named after it; for the gru pass NAME#0, NAME#1, ... give several runs (e.g. "
                        "utterances), and a streaming model's state inputs may be left out ([frames, ...] arrays)")
    g.add_argument("--awq-checkpoint", metavar="PATH",
                   help="take AWQ weights from a pre-quantised AutoAWQ checkpoint (.safetensors file or directory; "
                        "matched by weight / node names; unmatched weights stay in float); implies --weights awq")
    g.add_argument("--target", choices=["lowbit", "ort"],
                   help="lowbit: onnx-lowbit MatMulNF4/MatMulAWQ (default); ort: onnxruntime's com.microsoft "
                        "MatMulBnb4/MatMulNBits (stock onnxruntime)")
    g.add_argument("--ort-form", choices=["awq", "compact"],
                   help="with --weights awq --target ort: awq (default: MatMulNBits with AWQ's zero points, group "
                        "128) or compact (MatMulNBits' symmetric form onnxruntime runs fastest: block 32, no zero "
                        "points, scales in the model's dtype)")
    g.add_argument("--ort-accuracy-level", type=int, choices=range(5), metavar="{0..4}",
                   help="with --weights awq --target ort (or --device cpu's default for awq): MatMulNBits' "
                        "accuracy_level on every node; 4 = int8 activations, onnxruntime's fastest CPU 4-bit kernel "
                        "(--device cpu's default), 0 = fp32 activations (onnxruntime's default)")
    g.add_argument("--nf4-accuracy-level", type=int, choices=range(5), metavar="{0..4}",
                   help="with --weights nf4|fp4 and our MatMulNF4 (--target lowbit, the default): its accuracy_level "
                        "on every node; 4 = activations rounded to int8 per block and integer (VNNI) products on "
                        "the CPU (--device cpu's default), 0 = fp32 activations (the op's default; 1..3 alike); the "
                        "CUDA kernels compute in float at every level. --ort-accuracy-level is MatMulNBits'")
    add_quality_arguments(g)


def _non_negative(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v!r}")
    return n


def _merge_arguments(p) -> None:
    g = p.add_argument_group("fused SwiGLU FFN (the ffn pass)")
    g.add_argument("--ffn-weights", choices=["nk", "kn", "auto"],
                   help="layout of FusedFFN's float weights: nk = [N, K], transposed at rewrite time (fastest for "
                        "decode and up to 16 rows on CUDA, and on the CPU); kn = [K, N], the MatMul weights as they are "
                        "(FusedFFN weights_kn=1; fastest from 17 rows, never slower than the unfused graph on CUDA); "
                        "auto (default) = for fp16 models nk below 17 static rows, else kn (dynamic shapes "
                        "included); nk for fp32 / mixed")
    g = p.add_argument_group("sibling products (the merge pass)")
    g.add_argument("--merge-siblings", action="store_true", default=None,
                   help="merge products of one input with constant weights (e.g. q/k/v) into one and a Split "
                        "(the default)")
    g.add_argument("--no-merge-siblings", dest="merge_siblings", action="store_false",
                   help="leave sibling products as they are")
    g = p.add_argument_group("attention over a KV cache (the kvattention pass)")
    g.add_argument("--kvattention-max-query", type=_non_negative, metavar="S",
                   help="rewrite attention only where the query length is known to be <= S (default 4: decoding; "
                        "0: no limit)")


def _gru_arguments(p) -> None:
    g = p.add_argument_group("integer GRU (the gru pass; needs --calibration)")
    g.add_argument("--gru-bits", type=int, choices=[8, 16], help="width of QuantGRU's integers (default 16)")
    g.add_argument("--gru-weight-bits", type=int, choices=[8, 16],
                   help="8 with --gru-bits 16: int8 weights (int8's file size), int16 arithmetic (near int16's "
                        "accuracy); default: --gru-bits")
    g.add_argument("--gru-small", action="store_true", default=None,
                   help="rewrite GRUs too small to gain (QuantGRU not smaller than the float GRU: its tables "
                        "outweigh tiny weights; skipped by default)")


def _verify_arguments(p) -> None:
    g = p.add_argument_group("checking the rewrite (--verify)")
    g.add_argument("--verify", action="store_true",
                   help="run original and rewritten on the same inputs and compare every output (rel-L2, max abs, "
                        "top-1 for logits); past the tolerance: exit 1 and OUT kept as OUT.unverified.onnx")
    g.add_argument("--verify-data", metavar="FILE.npz",
                   help="inputs for --verify, one array per model input named after it (default: the "
                        "--calibration file when given; inputs it lacks, and all without it, are made up "
                        "consistent with the graph); implies --verify")
    g.add_argument("--dim", action="append", metavar="NAME=VALUE",
                   help="size of a symbolic input dim for made-up --verify (and --tune) inputs (repeatable; dims "
                        "named like 'past + seq' follow their parts; an unnamed dim, shown as '?', by input name "
                        "and axis: INPUT:AXIS=VALUE, e.g. x:0=2); implies --verify")
    g.add_argument("--verify-tol", "--tolerance", dest="tolerance", type=float, metavar="TOL",
                   help="largest rel-L2 error ||a - b|| / ||a|| per output (default 0.02; "
                        f"{_tol_4bit()} when 4-bit weights were written)")


def _tol_4bit():
    from .verify import WEIGHTS4_TOLERANCE
    return WEIGHTS4_TOLERANCE


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnx-lowbit", description="Rewrite ONNX models with low-bit and fused onnx-lowbit ops.")
    p.add_argument("--version", action="version", version=f"onnx-lowbit {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("rewrite", help="rewrite IN into OUT")
    r.add_argument("input", metavar="IN")
    r.add_argument("output", metavar="OUT")
    r.add_argument("--passes", help="comma-separated pass names (default: every default pass; kvattention and "
                                      "rmsnorm only when named)")
    r.add_argument("--report", action="store_true", help="print what was rewritten and skipped")
    r.add_argument("--report-json", metavar="FILE", help="write the report as JSON")
    _verify_arguments(r)
    r.add_argument("--fplut-functions", help="only these FPLUT functions (e.g. silu,gelu)")
    _weights_arguments(r)
    _merge_arguments(r)
    _gru_arguments(r)
    _device_arguments(r)
    r.set_defaults(fn=cmd_rewrite)
    i = sub.add_parser("inspect", help="what would be rewritten, and which onnx-lowbit ops a model uses")
    i.add_argument("input", metavar="IN")
    i.add_argument("--passes", help="comma-separated pass names (default: every default pass; kvattention and "
                                      "rmsnorm only when named)")
    i.add_argument("--fplut-functions", help="only these FPLUT functions (e.g. silu,gelu)")
    _weights_arguments(i)
    _merge_arguments(i)
    _gru_arguments(i)
    i.set_defaults(fn=cmd_inspect)
    what = ("rewrite the four embedded sample models (a YOLO-style CNN, a GPT-2 MLP, also with 4-bit weights, a "
            "LLaMA-style MLP, a GRU), run original and rewritten side by side, compare outputs, size and latency")
    d = sub.add_parser("demo", help=what, description=what[0].upper() + what[1:] + ".")
    d.add_argument("--out", help="keep the rewritten samples in this directory (default: a temporary one, deleted "
                                 "at the end)")
    d.set_defaults(fn=cmd_demo)
    b = sub.add_parser("bench", help="time ORIGINAL and one or more REWRITTEN side by side (latency, memory, "
                                     "weight bytes, output agreement); a markdown table and a PNG chart")
    b.add_argument("original", metavar="ORIGINAL")
    b.add_argument("rewritten", metavar="REWRITTEN", nargs="+",
                   help="one or more rewritten models, each timed and compared with ORIGINAL in the same run")
    b.add_argument("--provider", choices=["cpu", "cuda"], help="execution provider (default: cpu; cuda with "
                                                               "--cuda-graph)")
    b.add_argument("--cuda-graph", action="store_true", help="onnxruntime's enable_cuda_graph, io binding on "
                                                             "device buffers (needs onnxruntime-gpu)")
    b.add_argument("--warmup", type=int, default=10, metavar="N", help="untimed runs first (default 10)")
    b.add_argument("--runs", type=int, default=100, metavar="N", help="timed runs (default 100)")
    b.add_argument("--inputs", metavar="DATA.npz", help="inputs, one array per model input named after it "
                                                        "(default: random, the same for all models)")
    b.add_argument("--dim", action="append", metavar="NAME=VALUE",
                   help="value of a symbolic input dim for random inputs (repeatable; an unnamed dim, shown as '?', "
                        "by input name and axis: INPUT:AXIS=VALUE, e.g. x:0=2); unset dims are guessed as for "
                        "rewrite --verify (1 for batch-like names and an image's first axis, 8 for past lengths, "
                        "an image's height / width from imgsz metadata or 224, else 16) and the guesses printed")
    b.add_argument("--out", default=".", metavar="DIR", help="where bench-<mode>.png/.json go (default: .)")
    b.set_defaults(fn=cmd_bench)
    e = sub.add_parser("eval-ppl", help="perplexity and greedy-token agreement of a causal LM (ORIGINAL) and its "
                                        "rewrites on a text (CPU)")
    e.add_argument("original", metavar="ORIGINAL")
    e.add_argument("rewritten", metavar="REWRITTEN", nargs="*", help="rewrites of ORIGINAL, scored on the same windows")
    e.add_argument("--text", metavar="FILE", help="UTF-8 text to score")
    e.add_argument("--tokenizer", metavar="DIR|FILE.gguf|bytes",
                   help="the model's tokenizer: a transformers folder or .gguf file; 'bytes': UTF-8 bytes as ids")
    e.add_argument("--tokens", metavar="FILE.npy", help="token ids instead of --text/--tokenizer")
    e.add_argument("--window", type=int, default=512, metavar="N", help="tokens per window (default 512)")
    e.add_argument("--max-tokens", type=int, metavar="N", help="score only the first N tokens")
    e.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    e.set_defaults(fn=cmd_eval_ppl)
    gn = sub.add_parser("genai", help="rewrite an onnxruntime-genai model folder IN into the new folder OUT "
                                      "(int4 products -> our 4-bit ops, on CUDA also SwiGLU blocks -> fused FFN ops "
                                      "and attention; our library named in genai_config.json)")
    gn.add_argument("input", metavar="IN")
    gn.add_argument("output", metavar="OUT")
    gn.add_argument("--passes", help="comma-separated passes (default on CUDA, --provider cuda or a folder built for "
                                     "it: matmulnbits,ffn,cacheattention,ortnorm, CacheAttention only for fp16 "
                                     "heads of 16..128 (multiples of 16), RMSNorm only for fp16 rows of a multiple "
                                     "of 8 up to 8192; on the CPU matmulnbits: there the fused FFN, cacheattention "
                                     "and ortnorm measured no faster; BENCHMARKS.md)")
    gn.add_argument("--provider", choices=["cpu", "cuda"], help="set the decoder's execution provider in OUT")
    gn.add_argument("--cuda-graph", action="store_true", help="with --provider cuda: enable_cuda_graph=1")
    gn.add_argument("--to", choices=["awq", "int4"],
                    help="what MatMulNBits become: int4 (default) = every symmetric 4-bit product as our MatMulNF4 "
                         "int4 (lossless), awq = only the SwiGLU gate/up pairs, as MatMulAWQ")
    gn.add_argument("--lossy", action="store_true",
                    help="with --to awq: also convert MatMulNBits with float32 scales (scales rounded to fp16)")
    gn.add_argument("--report", action="store_true", help="print every candidate and why")
    gn.set_defaults(fn=cmd_genai)
    lut = sub.add_parser("lut", help="FPLUT tables")
    lsub = lut.add_subparsers(dest="lut_cmd", required=True, parser_class=_Parser)
    lsub.add_parser("list", help="shipped tables and their exhaustive error figures")
    lp = lsub.add_parser("plot", help="PNG plot of a table's error vs x")
    lp.add_argument("function")
    lp.add_argument("-o", "--output")
    lut.set_defaults(fn=cmd_lut)
    return p


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
        return a.fn(a)
    except LowbitError as e:
        print(f"onnx-lowbit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as e:  # e.g. unknown pass names from onnx_lowbit.passes.resolve
        print(f"onnx-lowbit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # the environment (full disk, permissions, I/O errors), not a bug: one line, exit 2
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"onnx-lowbit: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("onnx-lowbit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        if os.environ.get("ONNX_LOWBIT_DEBUG"):
            raise
        print(f"onnx-lowbit: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set ONNX_LOWBIT_DEBUG=1 for a traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
