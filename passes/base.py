"""The pass framework: the ``Pass`` interface, the ``Report`` every pass writes to, and small graph helpers
shared by the passes (all on onnx-graphsurgeon graphs).

A pass rewrites a ``gs.Graph`` in place. It may leave detached nodes behind (nodes whose inputs and outputs were
cleared); ``run_passes`` calls ``graph.cleanup().toposort()`` after the last pass. Every candidate a pass matches
is written to the report, either as "rewritten" or as "skipped" with the reason.
"""
from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs

REWRITTEN = "rewritten"
SKIPPED = "skipped"
ACTIONS = (REWRITTEN, SKIPPED)
NOT_RUN = "not_run"     # Entry.details key (True) of a "skipped" entry whose pass lacked an option it needs


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Entry:
    """One matched candidate: what a pass did with it, and why."""
    pass_name: str
    action: str                 # "rewritten" or "skipped"
    pattern: str                # what matched, e.g. "silu: Sigmoid->Mul"
    nodes: tuple                # names of the matched nodes (labels for unnamed ones)
    reason: str = ""            # why it was skipped, or notes on a rewrite (e.g. intermediates kept)
    details: dict = field(default_factory=dict)  # pass-specific extras (function, new node name, ...)

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
        self.nodes = tuple(self.nodes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        return d


class Report:
    """What the passes of one run matched, rewrote and skipped (in the order they did it)."""

    def __init__(self, entries: Iterable[Entry] = ()):
        self.entries: list[Entry] = list(entries)

    def add(self, pass_name: str, action: str, pattern: str, nodes, reason: str = "", **details) -> Entry:
        if isinstance(nodes, str):
            nodes = (nodes,)
        entry = Entry(pass_name, action, pattern, tuple(nodes), reason, dict(details))
        self.entries.append(entry)
        return entry

    def rewritten(self, pass_name: str | None = None) -> list[Entry]:
        return [e for e in self.entries if e.action == REWRITTEN and pass_name in (None, e.pass_name)]

    def skipped(self, pass_name: str | None = None) -> list[Entry]:
        """Candidates a pass looked at and left as they were, each with its reason (not the not_run ones)."""
        return [e for e in self.entries if e.action == SKIPPED and not e.details.get(NOT_RUN)
                and pass_name in (None, e.pass_name)]

    def not_run(self, pass_name: str | None = None) -> list[Entry]:
        """Candidates of a pass that did not run because an option it needs was not given (weights4 without
        ``weights``, gru without calibration data): what it would take, not a decision about the candidate."""
        return [e for e in self.entries if e.action == SKIPPED and e.details.get(NOT_RUN)
                and pass_name in (None, e.pass_name)]

    def extend(self, other: "Report") -> "Report":
        self.entries.extend(other.entries)
        return self

    def summary(self) -> dict:
        """{pass name: {"rewritten": n, "skipped": n, "not_run": n}} (skipped: real skips only)"""
        out: dict = {}
        for e in self.entries:
            counts = out.setdefault(e.pass_name, {REWRITTEN: 0, SKIPPED: 0, NOT_RUN: 0})
            counts[NOT_RUN if e.details.get(NOT_RUN) else e.action] += 1
        return out

    def to_dict(self) -> dict:
        return {"entries": [e.to_dict() for e in self.entries], "summary": self.summary()}

    def to_table(self, width: int | None = None) -> str:
        """A text table, one row per rewritten or skipped candidate, then the candidates of passes that did not
        run and the counts. Nothing is cut: with ``width`` (e.g. the terminal's), long cells wrap onto more lines
        so rows fit in ``width`` characters where they can; without it every row is one line."""
        if not self.entries:
            return "(no candidates matched)"
        header = ("pass", "action", "pattern", "nodes", "reason")
        flat = lambda s: " ".join(str(s).split())  # noqa: E731
        done = [e for e in self.entries if not e.details.get(NOT_RUN)]
        rows = [tuple(flat(c) for c in (e.pass_name, e.action, e.pattern, ", ".join(e.nodes), e.reason))
                for e in done]
        lines = []
        if rows:
            natural = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
            widths = _fit(natural, width)
            fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
            lines += [fmt(header), fmt(tuple("-" * w for w in widths))]
            for r in rows:
                cells = [_wrap(c, w) for c, w in zip(r, widths)]
                for k in range(max(len(c) for c in cells)):
                    lines.append(fmt(tuple(c[k] if k < len(c) else "" for c in cells)))
        counts = "; ".join(f"{p}: {c[REWRITTEN]} rewritten, {c[SKIPPED]} skipped"
                           for p, c in self.summary().items() if c[REWRITTEN] or c[SKIPPED])
        if counts:
            lines += ["", counts]
        for p, es in _group(self.not_run()).items():
            text = (f"not run: {p}: {'; '.join(dict.fromkeys(flat(e.reason) for e in es))} "
                    f"({', '.join(n for e in es for n in e.nodes)})")
            lines += ([""] if lines and not lines[-1].startswith("not run") else []) + _wrap(text, width, "    ")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __str__(self) -> str:
        return self.to_table()


def _fit(natural: list, width: int | None) -> list:
    """Column widths for the report table: the natural ones when they fit in ``width`` (or no width is given);
    else pattern and nodes are held to at most 36 characters each and the reason takes what is left (at least
    40), so a long row wraps instead of running off the screen."""
    gaps = 2 * (len(natural) - 1)
    if width is None or sum(natural) + gaps <= width:
        return list(natural)
    w = list(natural)
    w[2], w[3] = min(w[2], 36), min(w[3], 36)
    w[4] = max(40, min(natural[4], width - gaps - sum(w[:4])))
    return w


def _wrap(text: str, width: int | None, indent: str = "") -> list:
    """``text`` as lines of at most ``width`` characters (words kept whole where they fit; one line without a
    width); continuation lines start with ``indent``."""
    if width is None or len(text) <= width:
        return [text]
    return textwrap.wrap(text, max(width, 8), subsequent_indent=indent, break_on_hyphens=False) or [""]


def _group(entries) -> dict:
    out: dict = {}
    for e in entries:
        out.setdefault(e.pass_name, []).append(e)
    return out


def progress(options: dict, message: str) -> None:
    """Tells the caller what a long step of a pass is doing now (option ``progress``: a callable taking one line,
    e.g. the CLI's status line); nothing when no one listens."""
    listener = options.get("progress")
    if listener is not None:
        listener(message)


# ----------------------------------------------------------------------------------------------------------------
# Pass interface
# ----------------------------------------------------------------------------------------------------------------
class Pass:
    """Base class of a graph rewrite.

    Subclasses set ``name`` (the registry key, e.g. "fplut") and ``description`` (one line) and implement
    ``apply``, which rewrites ``graph`` in place, records every candidate in ``report`` and reads its options
    (prefixed with the pass name, e.g. ``fplut_functions``) from ``options``.
    """
    name: str = ""
    description: str = ""
    default: bool = True        # in the default pass list (False: runs only when named, e.g. --passes ...,rmsnorm)

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        raise NotImplementedError

    # conveniences for subclasses
    def rewritten(self, report: Report, pattern: str, nodes, reason: str = "", **details) -> Entry:
        return report.add(self.name, REWRITTEN, pattern, nodes, reason, **details)

    def skipped(self, report: Report, pattern: str, nodes, reason: str, **details) -> Entry:
        return report.add(self.name, SKIPPED, pattern, nodes, reason, **details)

    def not_run(self, report: Report, pattern: str, nodes, reason: str, **details) -> Entry:
        """Candidates left alone because an option the pass needs was not given (see ``needs``)."""
        return report.add(self.name, SKIPPED, pattern, nodes, reason, **details, **{NOT_RUN: True})

    def needs(self, options: dict) -> str | None:
        """The option this pass needs and ``options`` lacks, as the CLI flag to give (e.g. "--weights
        nf4|fp4|awq"); None when the pass runs."""
        return None

    def __repr__(self) -> str:
        return f"<pass {self.name}: {self.description}>"


# ----------------------------------------------------------------------------------------------------------------
# Graph helpers (onnx-graphsurgeon). gs tensors and nodes define __eq__ (by name / by content) and are not
# hashable: compare them with ``is`` and keep sets of ``id()``.
# ----------------------------------------------------------------------------------------------------------------
def iter_graphs(graph: gs.Graph) -> Iterator[gs.Graph]:
    """``graph`` and every subgraph (If/Loop/Scan bodies), recursively."""
    yield graph
    yield from graph.subgraphs(recursive=True)


def producer(tensor) -> gs.Node | None:
    """The node producing ``tensor`` (None for graph inputs, initializers and dangling tensors)."""
    return tensor.inputs[0] if isinstance(tensor, gs.Variable) and len(tensor.inputs) == 1 else None


def consumers(tensor) -> list:
    return list(tensor.outputs)


def single_consumer(tensor) -> gs.Node | None:
    """The only node consuming ``tensor`` (None if there are zero or several)."""
    return tensor.outputs[0] if len(tensor.outputs) == 1 else None


def is_op(node: gs.Node | None, op: str) -> bool:
    """``node`` is the standard-domain op ``op`` (False for None)."""
    return node is not None and node.op == op and node.domain in (None, "", "ai.onnx")


def dims(tensor) -> list | None:
    """The tensor's shape as a list (a constant's array shape; None when unknown)."""
    shape = tensor.values.shape if isinstance(tensor, gs.Constant) else tensor.shape
    return None if shape is None else list(shape)


def known_dim(v) -> int | None:
    """A dim as a positive int, None when symbolic / unknown."""
    return int(v) if isinstance(v, (int, np.integer)) and v > 0 else None


def is_alive(node: gs.Node) -> bool:
    """False for nodes a pass detached (no outputs left); cleanup removes those."""
    return len(node.outputs) > 0


def graph_output_names(graph: gs.Graph) -> set:
    return {t.name for t in graph.outputs}


def is_graph_output(graph: gs.Graph, tensor) -> bool:
    return any(t is tensor or t.name == tensor.name for t in graph.outputs)


def is_constant(tensor) -> bool:
    """An initializer, or the output of a Constant node."""
    if isinstance(tensor, gs.Constant):
        return True
    p = producer(tensor)
    return p is not None and p.op == "Constant" and not p.domain


def constant_value(tensor) -> np.ndarray | None:
    """The value of an initializer / Constant-node output as a numpy array (None if not a constant or not
    readable, e.g. bfloat16 without a numpy type)."""
    try:
        if isinstance(tensor, gs.Constant):
            lazy = getattr(tensor, "_values", None)
            if getattr(lazy, "streamed", False):  # external data being streamed (passes.external): read, never cache
                return np.asarray(lazy.load())
            return np.asarray(tensor.values)
        p = producer(tensor)
        if p is None or p.op != "Constant" or p.domain:
            return None
        a = p.attrs
        if "value" in a:
            v = a["value"]
            return np.asarray(v.values if isinstance(v, gs.Constant) else
                              onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v)
        for key in ("value_float", "value_int"):
            if key in a:
                return np.asarray(a[key])
        for key in ("value_floats", "value_ints"):
            if key in a:
                return np.asarray(list(a[key]))
    except Exception:  # noqa: BLE001 - an unreadable constant is simply "not a known constant"
        return None
    return None


def scalar_value(tensor, max_ndim: int | None = None) -> float | None:
    """The value of a one-element constant (None otherwise). With ``max_ndim``, constants of higher rank are
    refused (they would broadcast a lower-rank tensor to a higher rank)."""
    v = constant_value(tensor)
    if v is None or v.size != 1 or (max_ndim is not None and v.ndim > max_ndim):
        return None
    try:
        return float(v.reshape(-1)[0])
    except (TypeError, ValueError):
        return None


def close(value: float | None, target: float, rtol: float = 1e-3) -> bool:
    return value is not None and abs(value - target) <= rtol * abs(target)


_FLOAT_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                onnx.TensorProto.BFLOAT16: "bfloat16"}


def elem_type(tensor) -> int | None:
    """The tensor's ONNX element type (TensorProto.FLOAT, ...) or None if graphsurgeon does not know it."""
    dt = getattr(tensor, "dtype", None)
    if dt is None:
        return None
    if isinstance(dt, (int, np.integer)) and not isinstance(dt, bool):
        return int(dt)
    try:
        npdt = np.dtype(dt)
    except TypeError:
        return None
    if npdt.name == "bfloat16":
        return onnx.TensorProto.BFLOAT16
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(npdt))
    except (KeyError, ValueError, TypeError):
        return None


def type_name(et: int | None) -> str:
    if et is None:
        return "unknown"
    return _FLOAT_TYPES.get(et) or onnx.TensorProto.DataType.Name(et).lower()


def is_float_type(et: int | None) -> bool:
    return et in _FLOAT_TYPES


def node_label(node: gs.Node) -> str:
    """The node's name, or ``Op(->first output)`` for unnamed nodes."""
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else "?"
    return f"{node.op}(->{out})"


class Names:
    """Unique node/tensor names for a graph (and its subgraphs, whose names share one namespace)."""

    def __init__(self, graph: gs.Graph):
        root = graph
        self.used = set()
        for g in iter_graphs(root):
            self.used.update(n.name for n in g.nodes if n.name)
            self.used.update(g.tensors().keys())

    def __call__(self, base: str) -> str:
        base = base or "node"
        name, i = base, 1
        while name in self.used:
            name = f"{base}_{i}"
            i += 1
        self.used.add(name)
        return name


def labels_in_order(nodes, order: dict) -> list:
    """node_label of ``nodes`` in graph order: ``order`` maps id(node) to its position (nodes not in it last)."""
    return [node_label(k) for k in sorted(nodes, key=lambda k: order.get(id(k), len(order)))]


def scope_stem(node: gs.Node) -> str:
    """A name stem for a node that replaces ``node``: the scope of its name (``/a/b/MatMul_1`` -> ``/a/b/``), or the
    name and ``_`` when it has no scope."""
    name = node.name or node.outputs[0].name
    return name.rsplit("/", 1)[0] + "/" if "/" in name else name + "_"


def detach(node: gs.Node) -> None:
    """Disconnects ``node`` from its inputs and outputs (cleanup then drops it)."""
    node.inputs.clear()
    node.outputs.clear()


def remove_dead(graph: gs.Graph, nodes: Iterable[gs.Node]) -> list:
    """Detaches those of ``nodes`` whose outputs feed nothing and are no graph outputs, repeatedly (a node can
    become dead once a later one is gone). Returns the detached nodes."""
    nodes = [n for n in nodes if is_alive(n)]
    outs = graph_output_names(graph)
    dead = []
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if not is_alive(n):
                continue
            if any(t.outputs or t.name in outs for t in n.outputs):
                continue
            detach(n)
            dead.append(n)
            changed = True
    return dead


def outside_consumers(node: gs.Node, inside_ids: set, graph: gs.Graph) -> list:
    """Consumers of ``node``'s outputs that are not in ``inside_ids`` (ids of nodes), plus the string
    "graph output" for outputs that are graph outputs."""
    outs = graph_output_names(graph)
    found = []
    for t in node.outputs:
        found.extend(c for c in t.outputs if id(c) not in inside_ids)
        if t.name in outs:
            found.append("graph output")
    return found


def module_paths(model: onnx.ModelProto) -> dict:
    """node name -> the source module's dotted path (e.g. 'model.layers.0.mlp.up_proj'), from the node metadata
    torch's dynamo exporter writes (``pkg.torch.onnx.name_scopes``: the module scopes, then the op's own name).
    onnx-graphsurgeon drops node metadata, so passes get this map from run_passes (option ``module_paths``)."""
    import ast
    out = {}

    def walk(graph):
        for n in graph.node:
            for p in n.metadata_props:
                if p.key == "pkg.torch.onnx.name_scopes" and n.name:
                    try:
                        scopes = ast.literal_eval(p.value)
                    except (ValueError, SyntaxError):
                        continue
                    if isinstance(scopes, list) and len(scopes) >= 2 and scopes[-2]:
                        out[n.name] = str(scopes[-2])
            for a in n.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    walk(g)
    walk(model.graph)
    return out

