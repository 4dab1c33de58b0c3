"""``rewrite --device cpu --tune``: keep only the rewrites that measured faster on this machine.

The passes run one at a time, in their usual order. After each pass that rewrote something, the model before it and
the model after it run in onnxruntime CPU sessions (our ops registered) on the same inputs, alternately (A B, B A, A
B, ... in rounds of several runs, each round after an untimed run: onnx_lowbit/rounds.py; slow drifts of a shared
machine hit both), and the medians of their run times are compared: the pass is kept
only when its model's median is lower (``faster``), else its rewrites are undone and the next pass starts from the
model before it. A pass that rewrote nothing is not timed. weights4 on --device cpu's default 4-bit target
(onnx_lowbit/cpu_passes.py's CPU_WEIGHTS; no --target given) is also run on the other target (our MatMulAWQ /
MatMulNF4 <-> onnxruntime's MatMulNBits at accuracy_level 4 / MatMulBnb4) when quantising twice is cheap (round to
nearest: not with --calibration, --rounding, --budget, --awq-checkpoint or --ort-form), the two rewrites timed
against each other and the faster kept (both figures in the decision, ``targets``). Passes the user asked for their
size (4-bit weights: ``--weights`` / ``--awq-checkpoint``, or weights4 / gru named in ``--passes``, or
``--gru-bits``) are kept even when slower, and the decision says by how much. At the end the original and the
kept model are timed against each other once more (the figure for the whole model).

The per-pass costs form the cost table (``Decision``s) that the selection consults; it goes to the report (the
CLI prints it, ``--report-json`` holds it under ``tune``). Timing is injected: ``measure(model_a, model_b)``
returns the two medians in ms, so tests decide with made-up costs; ``alternate`` takes a clock."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from onnx_lowbit.passes import Report, run_passes
from onnx_lowbit.passes.base import REWRITTEN, SKIPPED

from . import rounds
from .errors import LowbitError
from .ratios import speed

SIZE_PASSES = ("weights4", "gru")   # rewrites asked for their size: kept even when measured slower
DEFAULT_RUNS = 20                   # timed runs of each model per comparison (in rounds: onnx_lowbit/rounds.py)
WARMUP = 3


@dataclass
class Decision:
    """What --tune did with one pass."""
    pass_name: str
    kept: bool
    rewrites: int                   # candidates the pass rewrote
    before_ms: float | None = None  # median of the model without the pass (None: not timed)
    after_ms: float | None = None   # median of the model with it
    asked: str = ""                 # the flag that asked for it (kept whatever it measures), else ""
    why: str = ""
    targets: dict | None = None     # weights4 on --device cpu's default target: {target: median ms} of both

    def to_dict(self) -> dict:
        d = asdict(self)
        d["speed"] = speed(self.before_ms, self.after_ms) if self.after_ms else None
        return d


@dataclass
class TuneResult:
    decisions: list
    inputs: str                     # where the inputs came from
    runs: int
    original_ms: float | None = None
    final_ms: float | None = None
    fallback: str = ""              # why the original graph was written after all ("" when it was not)

    def kept(self) -> list:
        return [d.pass_name for d in self.decisions if d.kept and d.rewrites]

    def dropped(self) -> list:
        return [d.pass_name for d in self.decisions if not d.kept]

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "runs": self.runs, "original_ms": self.original_ms,
                "final_ms": self.final_ms, "kept": self.kept(), "dropped": self.dropped(),
                "speed": speed(self.original_ms, self.final_ms) if self.final_ms else None,
                "fallback": self.fallback,
                "passes": [d.to_dict() for d in self.decisions]}

    def to_table(self) -> str:
        lines = [f"tune: each pass timed against the model without it, medians of {self.runs} runs in alternating "
                 f"rounds per model in onnxruntime CPU sessions, on {self.inputs}",
                 f"{'pass':12s} {'rewrites':>8s} {'without ms':>11s} {'with ms':>9s}  decision"]
        for d in self.decisions:
            fig = (f"{d.before_ms:11.3f} {d.after_ms:9.3f}" if d.after_ms is not None else f"{'-':>11s} {'-':>9s}")
            lines.append(f"{d.pass_name:12s} {d.rewrites:8d} {fig}  {d.why}")
        if self.final_ms is not None:
            lines.append(f"whole model: original {self.original_ms:.3f} ms, rewritten {self.final_ms:.3f} ms: "
                         f"{speed(self.original_ms, self.final_ms)}" + (f"; {self.fallback}" if self.fallback else ""))
        elif not self.kept():
            lines.append("whole model: no rewrite kept, the output is the original graph")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- timing

def alternate(run_a, run_b, runs: int = DEFAULT_RUNS, warmup: int = WARMUP, clock=time.perf_counter) -> tuple:
    """(median ms of run_a, median ms of run_b) over ``runs`` calls each, after ``warmup`` untimed calls of each,
    in rounds alternating between the two (onnx_lowbit/rounds.py: per round one untimed call, then a run of timed
    ones; A B, B A, ...)."""
    ta, tb = rounds.timed_rounds([run_a, run_b], runs, clock, warmup)
    return statistics.median(ta), statistics.median(tb)


def cpu_session(model):
    """An onnxruntime CPU session of ``model`` (ModelProto) with our ops registered."""
    import onnxruntime as ort

    from .api import InferenceSession
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return InferenceSession(model, so, providers=["CPUExecutionProvider"])


class SessionTimer:
    """``measure(model_a, model_b)`` for real: both in CPU sessions on ``feeds``, ``alternate``d. The two sessions
    of a comparison are kept for the next one (its "before" model is one of them); the cache holds the models
    themselves, so an id is never reused while cached."""

    def __init__(self, feeds: dict, runs: int = DEFAULT_RUNS, warmup: int = WARMUP, clock=time.perf_counter,
                 session=cpu_session):
        self.feeds, self.runs, self.warmup, self.clock, self.session = feeds, runs, warmup, clock, session
        self._cache = {}

    def _runner(self, model):
        key = id(model)
        if key not in self._cache:
            try:
                sess = self.session(model)
            except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
                raise LowbitError(f"--tune: onnxruntime could not create a session: {_first_line(e)}") from None
            names = {i.name for i in sess.get_inputs()}
            self._cache[key] = (model, sess, {k: v for k, v in self.feeds.items() if k in names})
        _, sess, feeds = self._cache[key]

        def run():
            try:
                sess.run(None, feeds)
            except Exception as e:  # noqa: BLE001
                raise LowbitError(f"--tune: onnxruntime failed to run the model on these inputs: "
                                  f"{_first_line(e)}") from None
        return run

    def __call__(self, model_a, model_b) -> tuple:
        run_a = self._runner(model_a)
        run_b = self._runner(model_b)
        out = alternate(run_a, run_b, self.runs, self.warmup, self.clock)
        self._cache = {k: v for k, v in self._cache.items() if v[0] is model_a or v[0] is model_b}
        return out


def _first_line(e) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:300]


# ---------------------------------------------------------------------------------------------- selection

def tuned_rewrite(model, selected: list, options: dict, measure, asked: dict | None = None, inputs: str = "",
                  runs: int = DEFAULT_RUNS, progress=None):
    """Runs ``selected`` (Pass objects) one at a time on ``model``, keeping a pass only when ``measure(before,
    after)`` (two medians in ms) says it is faster, or when ``asked`` ({pass name: the flag that asked for it})
    names it. Returns (model, Report, TuneResult); the report's entries of a dropped pass are turned into
    skipped entries saying why."""
    asked = dict(asked or {})
    report, decisions = Report(), []
    current = model
    for i, p in enumerate(selected):
        if progress:
            progress(f"tune: pass {i + 1}/{len(selected)} {p.name}")
        candidate, r = run_passes(current, passes=[p.name], **options)
        n = len(r.rewritten())
        if not n:
            report.extend(r)
            need = p.needs(options)
            decisions.append(Decision(p.name, True, 0, asked=asked.get(p.name, ""),
                                      why=f"not run (needs {need})" if need else "nothing rewritten: not timed"))
            continue
        if progress:
            progress(f"tune: pass {i + 1}/{len(selected)} {p.name}: timing the model without and with it")
        targets, picked = None, ""
        alt_options = other_target(options) if p.name == "weights4" else None
        if alt_options is not None:   # weights4 on the CPU's default target: the other one timed too, faster kept
            if progress:
                progress(f"tune: pass {i + 1}/{len(selected)} {p.name}: the other 4-bit target")
            try:
                alt, r_alt = run_passes(current, passes=[p.name], **alt_options)
            except ValueError:   # an option the other target does not take (e.g. an NF4 block size): not compared
                alt, r_alt = None, Report()
            if alt is not None and len(r_alt.rewritten()) == n:
                names = (target_name(options), target_name(alt_options))
                t_default, t_alt = measure(candidate, alt)
                targets = {names[0]: t_default, names[1]: t_alt}
                if t_alt < t_default:
                    candidate, r, options = alt, r_alt, alt_options
                picked = (f"{names[0]} {t_default:.3f} ms, {names[1]} {t_alt:.3f} ms: "
                          f"{names[1] if t_alt < t_default else names[0]}; ")
        before, after = measure(current, candidate)
        faster = after < before
        flag = asked.get(p.name, "")
        d = Decision(p.name, faster or bool(flag), n, before, after, flag, targets=targets)
        if faster:
            d.why = f"kept: {speed(before, after)}"
        elif flag:
            d.why = f"kept as asked ({flag}, for size) though {speed(before, after)}"
        else:
            d.why = f"left out: {speed(before, after)}"
        d.why = picked + d.why
        decisions.append(d)
        if d.kept:
            current = candidate
            report.extend(r)
            continue
        for e in r.entries:
            if e.action == REWRITTEN:
                report.add(e.pass_name, SKIPPED, e.pattern, e.nodes,
                           f"--tune: the {p.name} pass made the model {speed(before, after)} on this machine "
                           f"({before:.3f} -> {after:.3f} ms): left out", **e.details)
            else:
                report.entries.append(e)
    result = TuneResult(decisions, inputs, runs)
    report = TunedReport(report.entries, result)
    if current is not model:
        if progress:
            progress("tune: timing the original against the rewritten model")
        result.original_ms, result.final_ms = measure(model, current)
        if result.final_ms >= result.original_ms and not any(d.asked and d.rewrites for d in decisions):
            # the kept passes' gains did not add up (noise, or passes that only pay together): the original wins
            result.fallback = (f"the rewritten model measured {speed(result.original_ms, result.final_ms)} than "
                               "the original: the original graph is written")
            for d in decisions:
                if d.kept and d.rewrites:
                    d.kept, d.why = False, d.why + "; undone (whole model not faster)"
            report = TunedReport(_undone(report.entries), result)
            current = model
    return current, report, result


def other_target(options: dict) -> dict | None:
    """weights4's options on the other 4-bit target (our ops <-> onnxruntime's), for --tune to time both, when the
    target is --device cpu's default (onnx_lowbit/cpu_passes.py: option weights_target_why), not the user's, and
    quantising twice is cheap: round to nearest, no calibration (the AWQ / GPTQ search would run twice), no
    checkpoint, no --ort-form. None otherwise."""
    if not options.get("weights_target_why") or options.get("weights_target") not in ("ort", "lowbit"):
        return None
    if any(options.get(k) is not None for k in ("calibration", "awq_checkpoint", "weights_ort_form",
                                                "weights_rounding", "weights_budget")):
        return None
    out = {k: v for k, v in options.items() if k not in ("weights_ort_accuracy", "weights_target_why")}
    if options["weights_target"] == "ort":
        out["weights_target"] = "lowbit"
    else:
        out["weights_target"] = "ort"
        if out.get("weights") == "awq":
            out["weights_ort_accuracy"] = 4
    return out


def target_name(options: dict) -> str:
    """How the tune table names a 4-bit target: "lowbit", "ort", "ort lvl4"."""
    lvl = options.get("weights_ort_accuracy")
    return options.get("weights_target", "lowbit") + (f" lvl{lvl}" if options.get("weights_target") == "ort"
                                                      and lvl is not None else "")


def _undone(entries) -> list:
    """The report entries once every rewrite is undone: rewritten entries become skipped ones."""
    out = []
    for e in entries:
        if e.action == REWRITTEN:
            e = type(e)(e.pass_name, SKIPPED, e.pattern, e.nodes, "--tune: the rewritten model measured no faster "
                        "than the original as a whole: left out", dict(e.details))
        out.append(e)
    return out


def asked_for_size(a, passes=None, cli=True) -> dict:
    """{pass name: how it was asked} of the size rewrites the user asked for (kept by --tune even when slower):
    ``a`` the CLI's arguments (an argparse namespace; their ``passes`` a comma list) or the API's options (a dict,
    the selection in ``passes``: names, or a comma string). ``cli``: the flags as the CLI spells them
    ("--weights nf4"), else as the API's keywords ("weights='nf4'")."""
    get = a.get if isinstance(a, dict) else (lambda k: getattr(a, k, None))
    say = (lambda k, v: f"--{k.replace('_', '-')} {v}") if cli else (lambda k, v: f"{k}={v!r}")
    if passes is None and not isinstance(a, dict):
        passes = get("passes")
    if isinstance(passes, str):
        passes = passes.split(",")
    named = [n.strip() for n in passes or () if isinstance(n, str) and n.strip()]
    out = {}
    if get("weights") or get("awq_checkpoint"):
        out["weights4"] = say("weights", get("weights")) if get("weights") else \
            ("--awq-checkpoint" if cli else "awq_checkpoint=...")
    if get("gru_bits") is not None or get("gru_weight_bits") is not None:
        out["gru"] = " ".join(say(k, get(k)) for k in ("gru_bits", "gru_weight_bits") if get(k) is not None)
    for n in named:
        if n in SIZE_PASSES and n not in out:
            out[n] = f"--passes {n}" if cli else f"passes=[{n!r}]"
    return out


class TunedReport(Report):
    """The Report of a tuned rewrite: ``tune`` holds the decisions (TuneResult), to_dict() gains them."""

    def __init__(self, entries=(), tune: TuneResult | None = None):
        super().__init__(entries)
        self.tune = tune

    def to_dict(self) -> dict:
        d = super().to_dict()
        if self.tune is not None:
            d["tune"] = self.tune.to_dict()
        return d


# ---------------------------------------------------------------------------------------------- the CLI

def tune_feeds(model, data_path: str | None, flag: str, dims=None) -> tuple:
    """(feeds, where they came from): the arrays of ``data_path`` (a --calibration file's first run NAME#0 when it
    holds several), inputs it lacks made up (onnx_lowbit.feeds), with --dim values."""
    from . import feeds as feeds_mod
    sig = feeds_mod.signature(model)
    data = {}
    if data_path:
        arrays, _ = feeds_mod.first_run(feeds_mod.read_npz(data_path, flag))  # several runs: time on the first
        data = feeds_mod.check_arrays(data_path, arrays, sig, flag)
    got, values, made_up = feeds_mod.make_feeds(model, data=data, dims=dims)
    where = f"{data_path} ({flag})" if data_path else "made-up inputs"
    if made_up and data_path:
        where += f", made up: {', '.join(made_up)}"
    dims_text = ", ".join(f"{k}={v}" for k, v in values.items())
    return got, where + (f"; dims {dims_text}" if dims_text and made_up else "")


def cli_setup(a, head, verify_feeds=None):
    """Checks --tune's flags and makes its inputs (before any work, like --verify's); returns
    ``tuning(model, selected, options, step) -> (model, TunedReport)`` for the CLI's rewrite."""
    from . import feeds as feeds_mod
    from . import model_io
    if getattr(a, "device", None) != "cpu":
        raise LowbitError("--tune measures in onnxruntime CPU sessions: give --device cpu with it (tuning for "
                          "CUDA is not built)")
    runs = a.tune_runs if getattr(a, "tune_runs", None) is not None else DEFAULT_RUNS
    if runs < 1:
        raise LowbitError(f"--tune-runs must be >= 1 (got {runs})")
    if model_io.uses_external_data(head):
        size = sum(t.ByteSize() for t in head.graph.initializer)
        ext = sum(int(e.value) for t in head.graph.initializer for e in t.external_data if e.key == "length")
        if size + ext >= model_io.TWO_GB:
            raise LowbitError("--tune times the model in memory, and this one is over 2 GB (weights in external "
                              "data): leave out --tune (--device cpu alone picks the CPU defaults)")
    if verify_feeds is not None:
        feeds, _, _, where = verify_feeds
    else:
        data_path = getattr(a, "verify_data", None) or getattr(a, "calibration", None)
        flag = "--verify-data" if getattr(a, "verify_data", None) else "--calibration"
        feeds, where = tune_feeds(head, data_path, flag, feeds_mod.parse_dims(getattr(a, "dim", None)))
    asked = asked_for_size(a)

    def tuning(model, selected, options, step=None):
        measure = SessionTimer(feeds, runs)
        out, report, _ = tuned_rewrite(model, selected, options, measure, asked, where, runs, step)
        return out, report
    return tuning
