"""The ``onnx-lowbit`` command line. Bad input gives one line on stderr and exit status 2 (never a traceback);
a failed --verify gives exit status 1 and no output file."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .errors import LowbitError

EXIT_VERIFY_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 1, 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: same one-line form, exit 2
        self.print_usage(sys.stderr)
        raise LowbitError(message)


def _progress(iterable, desc, total=None):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return iterable
    return tqdm(iterable, desc=desc, total=total, disable=None, leave=False, file=sys.stderr)


def _same_file(a, b) -> bool:
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _pass_options(a) -> dict:
    options = {}
    if getattr(a, "fplut_functions", None):
        options["fplut_functions"] = set(f.strip() for f in a.fplut_functions.split(",") if f.strip())
    return options


def cmd_rewrite(a) -> int:
    from . import model_io, verify
    from onnx_lowbit import passes as passes_mod
    selected = passes_mod.resolve(a.passes)  # unknown names fail before any work
    if _same_file(a.input, a.output):
        raise LowbitError(f"OUT must differ from IN ({a.output}); the input is never overwritten")
    model = model_io.load(a.input)
    model_io.check_opset(model, a.input)
    options = _pass_options(a)
    out, report = None, passes_mod.Report()
    current = model
    for p in _progress(selected, "rewriting"):
        current, r = passes_mod.run_passes(current, passes=[p.name], **options)
        report.extend(r)
    out = current
    print(f"{a.input}: {len(report.rewritten())} rewritten, {len(report.skipped())} skipped "
          f"({', '.join(p.name for p in selected)})")
    if a.report:
        print(report.to_table())
    if a.report_json:
        with open(a.report_json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    status = 0
    if a.verify:
        errors, _ = verify.compare(model, out, tolerance=a.tolerance)
        print(verify.format_errors(errors, a.tolerance))
        if not all(e.ok for e in errors):
            print(f"onnx-lowbit: verification failed: {a.output} not written", file=sys.stderr)
            return EXIT_VERIFY_FAILED
    model_io.save(out, a.output)
    print(f"wrote {a.output}")
    return status


def cmd_inspect(a) -> int:
    from . import model_io
    from onnx_lowbit import passes as passes_mod
    from .domain import DOMAIN
    selected = passes_mod.resolve(a.passes)
    model = model_io.load(a.input)
    opset = model_io.check_opset(model, a.input)
    ours = {}
    for n in model.graph.node:
        if n.domain == DOMAIN:
            ours[n.op_type] = ours.get(n.op_type, 0) + 1
    versions = {o.domain: o.version for o in model.opset_import}
    print(f"{a.input}: opset {opset}, {len(model.graph.node)} nodes")
    if ours:
        print(f"uses onnx-lowbit ops (domain {DOMAIN} v{versions.get(DOMAIN, '?')}): "
              + ", ".join(f"{k} x{v}" for k, v in sorted(ours.items())))
    report = passes_mod.inspect(model, passes=[p.name for p in selected], **_pass_options(a))
    print(report.to_table() if len(report) else "nothing to rewrite")
    return 0


def cmd_demo(a) -> int:
    from . import demo
    return demo.run(out_dir=a.out)


def cmd_lut(a) -> int:
    from . import fplut_tables
    if a.lut_cmd == "list":
        print(f"{'function':12s} {'max abs':>9s} {'max rel':>9s} {'exact %':>8s} {'<=1ULP %':>9s}  range")
        for name in fplut_tables.available():
            st, t = fplut_tables.stats(name), fplut_tables.get_table(name)
            print(f"{name:12s} {st['max_abs']:9.2e} {st['max_rel']:9.2e} {st['exact_pct']:8.2f} "
                  f"{st['within_1ulp_pct']:9.2f}  [{t.cut_points[0]:g}, {t.cut_points[-1]:g}]")
        return 0
    if a.function not in fplut_tables.available():
        raise LowbitError(f"unknown function {a.function!r}; known: {', '.join(fplut_tables.available())}")
    from .fplut_plot import plot_error
    out = a.output or f"fplut-{a.function}.png"
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise LowbitError(f"{out}: directory {d} does not exist")
    plot_error(a.function, out)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="onnx-lowbit", description="Rewrite ONNX models with low-bit and fused onnx-lowbit ops.")
    p.add_argument("--version", action="version", version=f"onnx-lowbit {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("rewrite", help="rewrite IN into OUT")
    r.add_argument("input", metavar="IN")
    r.add_argument("output", metavar="OUT")
    r.add_argument("--passes", help="comma-separated pass names (default: all)")
    r.add_argument("--report", action="store_true", help="print what was rewritten and skipped")
    r.add_argument("--report-json", metavar="FILE", help="write the report as JSON")
    r.add_argument("--verify", action="store_true",
                   help="run original and rewritten on random inputs; fail past --tolerance")
    r.add_argument("--tolerance", type=float, default=2e-2,
                   help="max |err| / max |reference| per output for --verify (default 0.02)")
    r.add_argument("--fplut-functions", help="only these FPLUT functions (e.g. silu,gelu)")
    r.set_defaults(fn=cmd_rewrite)
    i = sub.add_parser("inspect", help="what would be rewritten, and which onnx-lowbit ops a model uses")
    i.add_argument("input", metavar="IN")
    i.add_argument("--passes")
    i.add_argument("--fplut-functions", help="only these FPLUT functions (e.g. silu,gelu)")
    i.set_defaults(fn=cmd_inspect)
    d = sub.add_parser("demo", help="rewrite the embedded sample model, run both, compare")
    d.add_argument("--out", help="directory for the rewritten sample (default: a temporary one)")
    d.set_defaults(fn=cmd_demo)
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
