"""Pass "fplut": activations -> one FPLUT node (onnx_lowbit domain) with a shipped lookup table.

Two kinds of matches, applied in this order on the main graph and every subgraph:

1. Decomposed activations, anchored on a Sigmoid / Erf / Tanh / HardSigmoid / Clip node. The arithmetic around
   the anchor (Add, Sub, Mul, Div, Neg, Pow, Identity with one-element constants) is evaluated symbolically as a
   polynomial in x (the anchor's argument side) and t (the anchor's output), so every association, operand
   order and Mul/Div spelling of the same formula matches:
     silu        x * Sigmoid(x)
     quick_gelu  x * Sigmoid(1.702 * x)
     gelu        0.5 * x * (1 + Erf(x / sqrt(2)))                     (x * 0.70710678 just as well)
     gelu_tanh   0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))   (x^3 = Pow(x, 3) or x*x*x)
     hardswish   x * HardSigmoid(x; alpha=1/6, beta=0.5),  x * Clip(x + 3, 0, 6) / 6
   Constants are compared with a relative tolerance of 1e-3 (fp16 constants are accepted).
     mish        x * Tanh(Softplus(x))
2. Single ops: Swish (alpha 1 -> silu, 1.702 -> quick_gelu), HardSwish, Gelu (approximate none/tanh), Mish,
   Softplus, Elu (alpha 1), com.microsoft Gelu / FastGelu / QuickGelu, and the remaining standalone Sigmoid
   and Tanh.

The FPLUT node reads x and writes the matched output tensor (so tensor names, and graph output names, stay).
Intermediates other nodes still read are kept (and reported); a kept Sigmoid/Tanh then becomes its own FPLUT.
Only float / float16 / bfloat16 tensors are rewritten (when the dtype is known).

Options: ``fplut_functions``: an iterable (or comma-separated string) of function names to rewrite; default all.
``NAME/decomposed`` enables NAME only where it is spelled out in several ops (kind 1 above), not as its single op:
``--device cpu`` takes ``hardswish/decomposed`` (FPLUT fp32 beats onnxruntime's 4-op x * Clip(x + 3, 0, 6) / 6 by
1.33-1.46x, but not its own HardSwish kernel: onnx_lowbit/cpu_passes.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from onnx_lowbit import domain
from onnx_lowbit import fplut as fplut_core

from .base import (Names, Pass, Report, close, elem_type, is_alive, is_constant, is_float_type, iter_graphs,
                   node_label, outside_consumers, producer, remove_dead, scalar_value, type_name)

FUNCTIONS = ("silu", "sigmoid", "tanh", "gelu", "gelu_tanh", "hardswish", "quick_gelu", "mish", "softplus", "elu")
RTOL = 1e-3
QUICK_GELU_ALPHA = 1.702
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TANH_KAPPA = 0.044715

_ARITH = {"Add", "Sub", "Mul", "Div", "Neg", "Pow", "Identity"}
_MAX_EXPR_NODES = 24       # nodes one symbolic evaluation may visit
_MAX_DEGREE = (6, 3)       # highest powers of x and t an evaluation may build
_MAX_CANDIDATES = 12       # tensors tried as "x" behind an anchor
_MAX_FORWARD_DEPTH = 4     # arithmetic steps from the anchor's output to the activation's output


# ---------------------------------------------------------------------------------------------------------------
# polynomials in (x, t): {(power of x, power of t): coefficient}
# ---------------------------------------------------------------------------------------------------------------
def _trim(p: dict) -> dict:
    return {k: v for k, v in p.items() if v != 0.0}


def _padd(p: dict, q: dict, sign: float = 1.0) -> dict:
    r = dict(p)
    for k, v in q.items():
        r[k] = r.get(k, 0.0) + sign * v
    return _trim(r)


def _pmul(p: dict, q: dict) -> dict | None:
    r: dict = {}
    for (a, b), v in p.items():
        for (c, d), w in q.items():
            k = (a + c, b + d)
            if k[0] > _MAX_DEGREE[0] or k[1] > _MAX_DEGREE[1]:
                return None
            r[k] = r.get(k, 0.0) + v * w
    return _trim(r)


def _pclose(p: dict, target: dict, rtol: float = RTOL) -> bool:
    scale = max(abs(v) for v in target.values())
    for k in set(p) | set(target):
        a, b = p.get(k, 0.0), target.get(k, 0.0)
        if b == 0.0:
            if abs(a) > 1e-5 * scale:
                return False
        elif abs(a - b) > rtol * abs(b):
            return False
    return True


def _is_const_poly(p: dict) -> bool:
    return all(k == (0, 0) for k in p)


class _Expr:
    """Symbolic evaluation of a tensor as a polynomial in ``x`` (and ``t``), through arithmetic nodes with
    one-element constants. ``nodes`` collects the arithmetic nodes an evaluation went through."""

    def __init__(self, x, t=None, max_const_ndim=None):
        self.x, self.t = x, t
        self.max_const_ndim = max_const_ndim
        self.nodes: dict = {}  # id -> node
        self.memo: dict = {}

    def poly(self, tensor):
        if tensor is self.x:
            return {(1, 0): 1.0}
        if self.t is not None and tensor is self.t:
            return {(0, 1): 1.0}
        key = id(tensor)
        if key in self.memo:
            return self.memo[key]
        result = self._eval(tensor)
        self.memo[key] = result
        return result

    def _eval(self, tensor):
        if is_constant(tensor):
            v = scalar_value(tensor, self.max_const_ndim)
            return None if v is None or not math.isfinite(v) else _trim({(0, 0): v})
        node = producer(tensor)
        if node is None or node.op not in _ARITH or node.domain or not is_alive(node):
            return None
        if id(node) not in self.nodes and len(self.nodes) >= _MAX_EXPR_NODES:
            return None
        self.nodes[id(node)] = node
        ins = node.inputs
        op = node.op
        if op in ("Neg", "Identity"):
            a = self.poly(ins[0]) if len(ins) == 1 else None
            return None if a is None else ({k: -v for k, v in a.items()} if op == "Neg" else a)
        if len(ins) != 2:
            return None
        if op == "Pow":
            base = self.poly(ins[0])
            e = scalar_value(ins[1], self.max_const_ndim)
            if base is None or e is None or e != int(e) or not 1 <= e <= _MAX_DEGREE[0]:
                return None
            r = base
            for _ in range(int(e) - 1):
                r = _pmul(r, base)
                if r is None:
                    return None
            return r
        a, b = self.poly(ins[0]), self.poly(ins[1])
        if a is None or b is None:
            return None
        if op == "Add":
            return _padd(a, b)
        if op == "Sub":
            return _padd(a, b, -1.0)
        if op == "Mul":
            return _pmul(a, b)
        # Div: only by a non-zero constant
        if not _is_const_poly(b) or not b:
            return None
        return {k: v / b[(0, 0)] for k, v in a.items()}


def _x_only(p: dict | None) -> dict | None:
    return p if p is not None and all(k[1] == 0 for k in p) else None


# ---------------------------------------------------------------------------------------------------------------
# decomposed forms, per anchor op
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Form:
    function: str | None  # None: recognised, but there is no table for it (skip with ``reason``)
    pattern: str
    outer: dict           # the activation output as a polynomial in (x, t)
    reason: str = ""


_GELU_OUTER = {(1, 0): 0.5, (1, 1): 0.5}  # 0.5*x*(1+t)
_XT = {(1, 1): 1.0}


def _attr(node, name, default):
    v = node.attrs.get(name, default)
    return default if v is None else v


def _sigmoid_forms(node, p):
    if set(p) != {(1, 0)}:
        return []
    a = p[(1, 0)]
    if close(a, 1.0, RTOL):
        return [_Form("silu", "silu: x*Sigmoid(x)", _XT)]
    if close(a, QUICK_GELU_ALPHA, RTOL):
        return [_Form("quick_gelu", "quick_gelu: x*Sigmoid(1.702*x)", _XT)]
    return [_Form(None, f"swish: x*Sigmoid({a:.6g}*x)", _XT,
                  f"x*sigmoid(beta*x) with beta={a:.6g}: only beta=1 (silu) and 1.702 (quick_gelu) have tables")]


def _erf_forms(node, p):
    if _pclose(p, {(1, 0): 1.0 / math.sqrt(2.0)}):
        return [_Form("gelu", "gelu: 0.5*x*(1+Erf(x/sqrt(2)))", _GELU_OUTER)]
    return []


def _tanh_forms(node, p):
    if _pclose(p, {(1, 0): SQRT_2_OVER_PI, (3, 0): SQRT_2_OVER_PI * GELU_TANH_KAPPA}):
        return [_Form("gelu_tanh", "gelu_tanh: 0.5*x*(1+Tanh(sqrt(2/pi)*(x+0.044715*x^3)))", _GELU_OUTER)]
    return []


def _linear(p):
    """(a, b) for p = a*x + b with a > 0, else None."""
    if not set(p) <= {(0, 0), (1, 0)} or p.get((1, 0), 0.0) <= 0:
        return None
    return p[(1, 0)], p.get((0, 0), 0.0)


def _hardsigmoid_forms(node, p):
    lin = _linear(p)
    if lin is None:
        return []
    alpha, beta = float(_attr(node, "alpha", 0.2)), float(_attr(node, "beta", 0.5))
    a, b = alpha * lin[0], alpha * lin[1] + beta  # gate = clip(a*x + b, 0, 1)
    if close(a, 1.0 / 6.0, RTOL) and close(b, 0.5, RTOL):
        return [_Form("hardswish", "hardswish: x*HardSigmoid(x)", _XT)]
    return []


def _clip_bounds(node):
    """(min, max) of a Clip: attributes before opset 11, constant inputs since (None where not constant)."""
    if "min" in node.attrs or "max" in node.attrs:
        return float(_attr(node, "min", -math.inf)), float(_attr(node, "max", math.inf))

    def bound(i):
        return scalar_value(node.inputs[i]) if len(node.inputs) > i and node.inputs[i].name else None
    return bound(1), bound(2)


def _clip_forms(node, p):
    lin = _linear(p)
    lo, hi = _clip_bounds(node)
    if lin is None or lo is None or hi is None or lo != 0.0:
        return []
    a, b = lin  # gate = clip(a*x + b, 0, hi) = a * clip(x + b/a, 0, hi/a)
    if close(b / a, 3.0, RTOL) and close(hi / a, 6.0, RTOL):
        return [_Form("hardswish", "hardswish: x*Clip(x+3,0,6)/6", {(1, 1): 1.0 / (6.0 * a)})]
    return []


_ANCHORS = {"Sigmoid": _sigmoid_forms, "Erf": _erf_forms, "Tanh": _tanh_forms,
            "HardSigmoid": _hardsigmoid_forms, "Clip": _clip_forms}


@dataclass
class _Match:
    form: _Form
    x: object
    y: object
    final: gs.Node
    nodes: list = field(default_factory=list)  # every matched node, anchor included


# ---------------------------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------------------------
def _tables():
    from onnx_lowbit.fplut_tables import get_table  # noqa: PLC0415 - optional until the tables ship
    return get_table


DECOMPOSED = "/decomposed"   # fplut_functions suffix: the function's multi-op spellings only


def _parse_functions(value) -> set:
    if value is None:
        return set(FUNCTIONS)
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    chosen = set(value)
    unknown = sorted(f for f in chosen if f.removesuffix(DECOMPOSED) not in FUNCTIONS)
    if unknown:
        raise ValueError(f"fplut_functions: unknown function(s) {', '.join(map(repr, unknown))}; "
                         f"the fplut pass rewrites: {', '.join(FUNCTIONS)} (NAME{DECOMPOSED}: only where NAME is "
                         "spelled out in several ops)")
    return chosen


class FPLUTPass(Pass):
    name = "fplut"
    description = ("activations (SiLU/Swish, QuickGELU, GELU erf/tanh, HardSwish, Mish, Sigmoid, Tanh, Softplus, "
                   "Elu; op or decomposed) -> FPLUT lookup-table op")

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        run = _Run(self, report, _parse_functions(options.get("fplut_functions")), Names(graph))
        for g in list(iter_graphs(graph)):
            run.graph(g)


class _Run:
    """State of one application of the pass (enabled functions, table cache, name generator)."""

    def __init__(self, owner: FPLUTPass, report: Report, functions: set, names: Names):
        self.owner, self.report, self.functions, self.names = owner, report, functions, names
        self.attrs: dict = {}
        self.order: dict = {}

    # -- helpers -------------------------------------------------------------------------------------------
    def table_attrs(self, function: str):
        """(FPLUT attributes, None) or (None, reason)."""
        if function not in self.attrs:
            try:
                table = _tables()(function)
                self.attrs[function] = (fplut_core.node_attributes(table), None)
            except Exception as e:  # noqa: BLE001 - no table is a reason to skip, reported
                self.attrs[function] = (None, f"no FPLUT table for {function!r}: {type(e).__name__}: {e}")
        return self.attrs[function]

    def check(self, function: str | None, x, y, decomposed: bool = False) -> str | None:
        """Why this candidate cannot be rewritten, or None (``decomposed``: a multi-op spelling)."""
        if function is None:
            return "no table"
        if function not in self.functions:
            if function + DECOMPOSED not in self.functions:
                return f"function {function!r} not enabled (fplut_functions)"
            if not decomposed:
                return (f"function {function!r} enabled only where spelled out in several ops (fplut_functions: "
                        f"{function}{DECOMPOSED})")
        ets = {et for et in (elem_type(x), elem_type(y)) if et is not None}
        bad = [et for et in ets if not is_float_type(et)]
        if bad:
            return f"dtype {type_name(bad[0])} (FPLUT takes float, float16, bfloat16)"
        if len(ets) > 1:
            return f"input dtype {type_name(elem_type(x))} differs from output dtype {type_name(elem_type(y))}"
        _, reason = self.table_attrs(function)
        return reason

    def emit(self, g: gs.Graph, function: str, x, y, final: gs.Node) -> gs.Node:
        """FPLUT(x) -> y in place of ``final`` (which is detached)."""
        attrs, _ = self.table_attrs(function)
        final.outputs.clear()
        final.inputs.clear()
        node = gs.Node(op="FPLUT", name=self.names(f"{final.name or y.name}_fplut"), domain=domain.DOMAIN,
                       attrs=dict(attrs), inputs=[x], outputs=[y])
        g.nodes.append(node)
        return node

    # -- per graph -----------------------------------------------------------------------------------------
    def graph(self, g: gs.Graph) -> None:
        self.order = {id(nd): i for i, nd in enumerate(g.nodes)}  # report matched nodes in graph order
        for node in list(g.nodes):
            if is_alive(node) and not node.domain and node.op in _ANCHORS:
                self.composite(g, node)
        for node in list(g.nodes):
            if is_alive(node):
                self.single(g, node)

    # -- decomposed activations ----------------------------------------------------------------------------
    def composite(self, g: gs.Graph, anchor: gs.Node) -> None:
        rejected: set = set()  # ids of final nodes of matches that were skipped
        done = []                # (report entry, matched nodes) of the rewrites around this anchor
        while is_alive(anchor):
            m = self.match(g, anchor, rejected)
            if m is None:
                break
            labels = [node_label(n) for n in m.nodes]
            reason = m.form.reason if m.form.function is None else self.check(m.form.function, m.x, m.y, True)
            if reason:
                self.owner.skipped(self.report, m.form.pattern, labels, reason, function=m.form.function)
                rejected.add(id(m.final))
                continue
            new = self.emit(g, m.form.function, m.x, m.y, m.final)
            remove_dead(g, m.nodes)
            entry = self.owner.rewritten(self.report, m.form.pattern, labels, function=m.form.function,
                                         fplut_node=new.name, input=m.x.name, output=m.y.name)
            done.append((entry, m.nodes))
        for entry, nodes in done:  # after all rewrites around the anchor: what stays for other consumers
            inside = {id(n) for n in nodes}
            notes = []
            for n in nodes:
                if is_alive(n):
                    users = outside_consumers(n, inside, g)
                    if users:
                        who = ", ".join(u if isinstance(u, str) else node_label(u) for u in users)
                        notes.append(f"kept {n.op} {node_label(n)!r}: its output also feeds {who}")
            entry.reason = "; ".join(notes)
        if anchor.op == "Sigmoid" and is_alive(anchor):
            self.report_gating(anchor, rejected)

    def match(self, g: gs.Graph, anchor: gs.Node, rejected: set) -> _Match | None:
        if len(anchor.inputs) < 1 or len(anchor.outputs) != 1:
            return None
        u, t = anchor.inputs[0], anchor.outputs[0]
        sp = producer(u)
        if anchor.op == "Tanh" and sp is not None and sp.op == "Softplus" and not sp.domain and is_alive(sp):
            x = sp.inputs[0]  # mish: x * Tanh(Softplus(x))
            nd = len(x.shape) if getattr(x, "shape", None) is not None else 1
            found = self.forward(t, x, _XT, nd, rejected)
            if found is not None:
                y, outer_nodes = found
                nodes = self.in_order([sp, anchor] + outer_nodes)
                return _Match(_Form("mish", "mish: x*Tanh(Softplus(x))", _XT), x, y, producer(y), nodes)
        for x in self.candidates(u):
            nd = len(x.shape) if getattr(x, "shape", None) is not None else 1
            inner = _Expr(x, max_const_ndim=nd)
            p = _x_only(inner.poly(u))
            if p is None:
                continue
            for form in _ANCHORS[anchor.op](anchor, p):
                found = self.forward(t, x, form.outer, nd, rejected)
                if found is not None:
                    y, outer_nodes = found
                    nodes = list(inner.nodes.values()) + [anchor] + outer_nodes
                    nodes = self.in_order(nodes)
                    return _Match(form, x, y, producer(y), nodes)
        return None

    def in_order(self, nodes: list) -> list:
        """``nodes`` without duplicates, in graph order."""
        return sorted(_unique(nodes), key=lambda nd: self.order.get(id(nd), 1 << 62))

    @staticmethod
    def candidates(u) -> list:
        """Tensors tried as x: the anchor's input, then what it is computed from (nearest first)."""
        out, seen, queue = [], set(), [u]
        while queue and len(out) < _MAX_CANDIDATES:
            tns = queue.pop(0)
            if id(tns) in seen or is_constant(tns):
                continue
            seen.add(id(tns))
            out.append(tns)
            node = producer(tns)
            if node is not None and node.op in _ARITH and not node.domain:
                queue.extend(node.inputs)
        return out

    @staticmethod
    def forward(t, x, target: dict, nd: int, rejected: set):
        """The nearest tensor downstream of t that equals ``target`` in (x, t): (tensor, nodes) or None."""
        frontier, seen = [t], set()
        for _ in range(_MAX_FORWARD_DEPTH):
            nxt = []
            for tns in frontier:
                for c in list(tns.outputs):
                    if id(c) in seen or c.op not in _ARITH or c.domain or not is_alive(c):
                        continue
                    seen.add(id(c))
                    for o in c.outputs:
                        if id(c) not in rejected:
                            ev = _Expr(x, t, max_const_ndim=nd)
                            p = ev.poly(o)
                            if p is not None and _pclose(p, target):
                                return o, list(ev.nodes.values())
                        nxt.append(o)
            frontier = nxt
            if not frontier:
                break
        return None

    def report_gating(self, sig: gs.Node, rejected: set) -> None:
        """A Sigmoid feeding a Mul that does not multiply by the Sigmoid's input: a gate, not a SiLU."""
        u, s = sig.inputs[0], sig.outputs[0]
        seen = set(rejected)
        for c in s.outputs:
            if c.op != "Mul" or c.domain or id(c) in seen:
                continue
            seen.add(id(c))
            others = [i for i in c.inputs if i is not s]
            other = others[0].name if others else s.name
            self.owner.skipped(
                self.report, "silu: x*Sigmoid(x)", [node_label(sig), node_label(c)],
                f"Mul multiplies Sigmoid({u.name}) by {other!r}, not by the Sigmoid's input {u.name!r} "
                f"(gate / squeeze-excitation): not a SiLU", function="silu")

    # -- single ops ----------------------------------------------------------------------------------------
    def single(self, g: gs.Graph, node: gs.Node) -> None:
        fn, pattern, reason = _single_op(node)
        if pattern is None:
            return
        label = [node_label(node)]
        x = node.inputs[0] if node.inputs else None
        y = node.outputs[0] if len(node.outputs) == 1 else None
        if reason is None and (x is None or y is None or len([i for i in node.inputs if i.name]) != 1):
            reason = "not a one-input one-output node"
        if reason is None and is_constant(x):
            reason = "input is a constant (left to constant folding)"
        if reason is None:
            reason = self.check(fn, x, y)
        if reason:
            self.owner.skipped(self.report, pattern, label, reason, function=fn)
            return
        new = self.emit(g, fn, x, y, node)
        self.owner.rewritten(self.report, pattern, label, function=fn, fplut_node=new.name, input=x.name,
                             output=y.name)


def _unique(nodes: list) -> list:
    seen, out = set(), []
    for n in nodes:
        if id(n) not in seen:
            seen.add(id(n))
            out.append(n)
    return out


def _single_op(node: gs.Node):
    """(function, pattern, reason) for a single-op activation; pattern None if the node is none."""
    op, dom = node.op, node.domain or ""
    if dom in ("", "ai.onnx"):
        if op == "Sigmoid":
            return "sigmoid", "sigmoid: Sigmoid", None
        if op == "Tanh":
            return "tanh", "tanh: Tanh", None
        if op == "HardSwish":
            return "hardswish", "hardswish: HardSwish", None
        if op == "Mish":
            return "mish", "mish: Mish", None
        if op == "Softplus":
            return "softplus", "softplus: Softplus", None
        if op == "Elu":
            alpha = float(_attr(node, "alpha", 1.0))
            if close(alpha, 1.0, RTOL):
                return "elu", "elu: Elu", None
            return None, f"elu: Elu(alpha={alpha:.6g})", f"alpha={alpha:.6g}: only alpha=1 has a table"
        if op == "Gelu":
            approx = _attr(node, "approximate", "none")
            approx = approx.decode() if isinstance(approx, bytes) else str(approx)
            if approx == "none":
                return "gelu", "gelu: Gelu", None
            if approx == "tanh":
                return "gelu_tanh", "gelu_tanh: Gelu(approximate=tanh)", None
            return None, f"gelu: Gelu(approximate={approx})", f"unknown approximate={approx!r}"
        if op == "Swish":
            alpha = float(_attr(node, "alpha", 1.0))
            if close(alpha, 1.0, RTOL):
                return "silu", "silu: Swish(alpha=1)", None
            if close(alpha, QUICK_GELU_ALPHA, RTOL):
                return "quick_gelu", f"quick_gelu: Swish(alpha={alpha:.6g})", None
            return None, f"swish: Swish(alpha={alpha:.6g})", \
                f"alpha={alpha:.6g}: only alpha=1 (silu) and 1.702 (quick_gelu) have tables"
    elif dom == "com.microsoft":
        if op == "Gelu":
            return "gelu", "gelu: com.microsoft.Gelu", None
        if op == "FastGelu":
            if len([i for i in node.inputs if i.name]) > 1:
                return None, "gelu_tanh: com.microsoft.FastGelu", "has a bias input (not fused)"
            return "gelu_tanh", "gelu_tanh: com.microsoft.FastGelu", None
        if op == "QuickGelu":
            alpha = float(_attr(node, "alpha", QUICK_GELU_ALPHA))
            if close(alpha, QUICK_GELU_ALPHA, RTOL):
                return "quick_gelu", "quick_gelu: com.microsoft.QuickGelu", None
            if close(alpha, 1.0, RTOL):
                return "silu", "silu: com.microsoft.QuickGelu(alpha=1)", None
            return None, f"swish: com.microsoft.QuickGelu(alpha={alpha:.6g})", \
                f"alpha={alpha:.6g}: only alpha=1 (silu) and 1.702 (quick_gelu) have tables"
    return None, None, None
