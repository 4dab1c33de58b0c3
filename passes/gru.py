"""Pass "gru": ONNX GRU -> QuantGRU (pure fixed-point int8/int16 GRU, onnx_lowbit.gru_int; docs/gru.md).

Matched: GRU nodes (default domain) of the main graph. Rewritten when
    linear_before_reset = 1 (torch's nn.GRU exports 1; the integer pipeline is the seed's / haste's formulation,
                          r * (R_h h + Rb_h); linear_before_reset = 0 GRUs are skipped with that reason)
    activations           absent or Sigmoid, Tanh per direction (the op's integer tables are sigmoid/tanh)
    X                     float32, rank 3
    W, R, B               initializers / Constant outputs, or constant subgraphs of them (Slice, Concat,
                          Unsqueeze, Transpose, ... of initializers: folded with onnx's reference evaluator)
    hidden_size           1..32768
Any direction, layout 0/1, initial_h and sequence_lens given or absent, Y and Y_h used or not, clip (baked into
the tables). The QuantGRU node writes the GRU's output tensors (an omitted output gets a fresh dangling name).

Options:
    calibration           {graph input name: np.ndarray} (shared with weights4's AWQ; ``gru_calibration``, when
                          given, is used instead, e.g. with weights nf4 which rejects calibration), a list of such
                          dicts, or NAME#K keys (one run per K: utterances of different lengths): the model runs
                          in onnxruntime with every GRU's inputs as extra outputs; a run that leaves out the
                          state inputs of a streaming model (state_pairs) holds [frames, ...] arrays and runs frame
                          by frame, states carried. onnx_lowbit.gru_calib searches the parameters that minimise
                          the integer GRU's Y error on all sequences. Without calibration every GRU is skipped
                          ("pass calibration data: --calibration DATA.npz ...").
    calibration_session   optional session factory (as weights4): needed when the graph already holds onnx_lowbit ops
    gru_bits              8 or 16 (default 16)
    gru_weight_bits       8 with gru_bits 16: int8 weights, int16 arithmetic (W and R on the int8 grid, stored int8
                          and widened by a Cast to int16 that onnxruntime folds at load: int8's file size with
                          int16's accuracy; default: gru_bits)
    gru_headroom          bits of headroom above the calibrated [min, max] ranges where the search starts (default 0)
    gru_search            the error-minimising range search (onnx_lowbit.gru_calib.search; default on): off
                          takes every quantity's [min, max] over the calibration data with gru_headroom bits
    gru_small             rewrite GRUs whose QuantGRU would not be smaller than the float GRU (default: skipped,
                          "too small to gain")

Calibration arrays whose names or shapes do not match the graph inputs raise ValueError before any change.
Every rewrite reports the relative L2 error of Y (QuantGRU reference vs float GRU) on the calibration inputs.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain, gru_calib, gru_float, gru_int

from . import calibration as _calibration
from .base import (Names, Pass, Report, constant_value, elem_type, is_constant, iter_graphs, node_label, producer,
                   progress)

MAX_FOLD_NODES = 64
INT8_HINT_ERROR = 2e-2   # int8 rewrites above this calibration error suggest int8 weights with int16 arithmetic
NO_CALIBRATION = ("no calibration data: QuantGRU's scales come from calibration; pass --calibration DATA.npz "
                  "(numpy.savez with one array per model input, named after it) or calibration={input: array}")


class GRUPass(Pass):
    name = "gru"
    description = "ONNX GRU -> QuantGRU: pure fixed-point int8/int16 GRU (needs calibration data)"

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        bits = options.get("gru_bits", 16)
        if bits not in (8, 16):
            raise ValueError(f"gru_bits must be 8 or 16, got {bits!r}")
        wbits = options.get("gru_weight_bits") or bits
        if wbits not in (8, bits):
            raise ValueError(f"gru_weight_bits must be 8 (with gru_bits 16) or equal gru_bits, got {wbits!r}")
        headroom = options.get("gru_headroom")
        search = options.get("gru_search")
        search = True if search is None else bool(search)
        names = Names(graph)
        cands = []
        for g in iter_graphs(graph):
            for node in list(g.nodes):
                if node.op != "GRU" or (node.domain or "") not in ("", "ai.onnx"):
                    continue
                if g is not graph:
                    self.skipped(report, "GRU", [node_label(node)], "inside a subgraph (If/Loop/Scan body): "
                                 "calibration covers the main graph only")
                    continue
                spec, why = _check(node, int(graph.opset or 17))
                why = why or (None if options.get("gru_small") else _too_small(spec, bits, wbits))
                if why:
                    self.skipped(report, "GRU", [node_label(node)], why)
                else:
                    cands.append((node, spec))
        if not cands:
            return
        cal = options.get("gru_calibration", options.get("calibration"))
        if cal is None:
            for node, _ in cands:
                self.not_run(report, "GRU", [node_label(node)], NO_CALIBRATION)
            return
        runs = _calibration.runs(cal)
        progress(options, f"calibration run{'s' if len(runs) > 1 else ''}: the model in onnxruntime on the "
                          f"calibration data, recording the input of {len(cands)} GRU{'s' if len(cands) > 1 else ''}")
        seqs, how = _calibration_sequences(graph, cands, runs, options.get("calibration_session"))
        for i, (node, spec) in enumerate(cands):
            where = f"GRU {i + 1}/{len(cands)} {node_label(node)!r} ({mode_name(bits, wbits)}, H={spec['H']})"
            self.rewrite(graph, report, names, node, spec, seqs[i], how, bits, headroom, search,
                         lambda what: progress(options, f"{where}: {what}"), wbits)

    def needs(self, options: dict) -> str | None:
        has = options.get("gru_calibration", options.get("calibration")) is not None
        return None if has else "--calibration DATA.npz"

    def rewrite(self, graph, report, names, node, spec, seqs, how, bits, headroom, search, note=lambda what: None,
                wbits=None):
        if not seqs:
            self.skipped(report, "GRU", [node_label(node)], "the calibration run did not produce its input X")
            return
        W, R, B, clip, h = spec["W"], spec["R"], spec["B"], spec["clip"], spec["H"]
        wbits = wbits or bits
        notes = [mode_name(bits, wbits), how]

        def trial(i, n, e):
            note(f"range search {i}/{n} (Y rel error {e:.2e})")
        note("ranges of the gate quantities from the calibration data")
        res = gru_calib.search(W, R, B, seqs, bits=bits, hidden_size=h, direction=spec["direction"], clip=clip,
                               rounds=2 if search else 0, headroom=headroom, on_trial=trial, weight_bits=wbits)
        if search:
            moved = gru_calib.describe(res)
            notes.append(f"range search {res.error_start:.2e} -> {res.error:.2e} in {res.trials} trials"
                         + (f" ({moved})" if moved else ""))
        note("the error of the integer GRU against the float one on all calibration data")
        p = res.params
        x, lens, h0 = gru_calib.gather(seqs, W.shape[0], h)
        kw = dict(direction=spec["direction"], hidden_size=h)
        try:  # the parameters must pass the op's own checks
            y_q, _ = gru_int.quant_gru(x, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], lens.astype(np.int32),
                                       h0, bits=bits, exponents=p["exponents"], zero_points=p["zero_points"], **kw)
        except ValueError as e:
            self.skipped(report, "GRU", [node_label(node)], f"no valid integer parameters: {e}")
            return
        y_f, _ = gru_float.gru(x, W, R, B, lens, h0, linear_before_reset=1, clip=clip, **kw)
        den = float(np.linalg.norm(y_f))
        rel = float(np.linalg.norm(y_q - y_f) / den) if den > 0 else 0.0
        base = node.name or node.outputs[0].name
        consts = [gs.Constant(names(f"{base}_q{k}"), np.ascontiguousarray(p[k]))
                  for k in ("W", "R", "B", "channel_exp", "luts")]
        if wbits != bits:   # int8 weights in the file, widened for the op by a Cast onnxruntime folds at load
            for j, k in ((0, "W"), (1, "R")):
                small = gs.Constant(names(f"{base}_q{k}8"), np.ascontiguousarray(p[k].astype(np.int8)))
                wide = gs.Variable(names(f"{base}_q{k}"), dtype=p[k].dtype, shape=list(p[k].shape))
                graph.nodes.append(gs.Node(op="Cast", name=names(f"{base}_q{k}_widen"), inputs=[small],
                                           outputs=[wide], attrs=dict(to=onnx.TensorProto.INT16)))
                consts[j] = wide
        inputs = [spec["X"], *consts]
        opt = [spec["sequence_lens"], spec["initial_h"]]
        if opt[1] is not None:
            inputs += [opt[0] if opt[0] is not None else gs.Variable.empty(), opt[1]]
        elif opt[0] is not None:
            inputs.append(opt[0])
        outs = list(node.outputs) + [None] * (2 - len(node.outputs))
        outs = [o if o is not None and o.name else gs.Variable(names(f"{base}_{n}_unused"), dtype=np.float32)
                for o, n in zip(outs, ("Y", "Y_h"))]
        new = gs.Node(op="QuantGRU", domain=domain.DOMAIN, name=names(f"{base}_quant"), inputs=inputs, outputs=outs,
                      attrs=dict(hidden_size=h, direction=spec["direction"], layout=spec["layout"], bits=bits,
                                 exponents=p["exponents"], zero_points=p["zero_points"]))
        node.inputs.clear()
        node.outputs.clear()
        graph.nodes.append(new)
        notes.append(f"Y rel L2 error on the calibration data {rel:.2e}")
        if bits == 8 and rel > INT8_HINT_ERROR:
            notes.append("int8 arithmetic is coarse here: --gru-bits 16 --gru-weight-bits 8 keeps int8 weights "
                         "(the same file size) with int16 arithmetic")
        if spec["folded"]:
            notes.append(f"folded constant subgraph{'s' if len(spec['folded']) > 1 else ''} of "
                         f"{', '.join(spec['folded'])}")
        self.rewritten(report, "GRU", [node_label(node)], "; ".join(notes), new_node=new.name, bits=bits,
                       weight_bits=wbits, rel_error=rel, exponents=p["exponents"], zero_points=p["zero_points"])


def mode_name(bits, wbits=None) -> str:
    """'int16', 'int8', or 'int8 weights, int16 arithmetic' (the report's words for a QuantGRU's mode)."""
    return f"int{bits}" if (wbits or bits) == bits else f"int{wbits} weights, int{bits} arithmetic"


def stored_bytes(d, h, c, bits=None, wbits=None) -> int:
    """Bytes of a GRU's stored parameters: float32 W, R, B (bits None) or QuantGRU's W, R (wbits wide, default
    bits), B int32, channel_exp int32 and the three tables per direction (attributes not counted)."""
    if bits is None:
        return 4 * d * (3 * h * c + 3 * h * h + 6 * h)
    q, qw = bits // 8, (wbits or bits) // 8
    return d * (qw * (3 * h * c + 3 * h * h) + 4 * 6 * h + 4 * 4 * 3 * h + q * 3 * gru_int.lut_len(bits))


def _too_small(spec, bits, wbits=None):
    d, h, c = spec["W"].shape[0], spec["H"], spec["W"].shape[2]
    fb, qb = stored_bytes(d, h, c), stored_bytes(d, h, c, bits, wbits)
    if qb < fb:
        return None
    return (f"too small to gain: QuantGRU {mode_name(bits, wbits)} would store {qb} bytes (its sigmoid/tanh tables alone "
            f"{d * 3 * gru_int.lut_len(bits) * bits // 8}) against the float GRU's {fb} (H={h}, C={c}); "
            "--gru-small (gru_small=True) rewrites it anyway")


# ---------------------------------------------------------------------------------------------------- matching
def _attr(node, name, default=None):
    v = node.attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else v


def _check(node, opset):
    """(spec, None) for a rewritable GRU, else (None, reason)."""
    ins = list(node.inputs) + [None] * (6 - len(node.inputs))
    present = lambda t: t is not None and t.name != ""  # noqa: E731
    direction = _attr(node, "direction", "forward")
    if direction not in gru_int.DIRECTIONS:
        return None, f"direction {direction!r} is not forward, reverse or bidirectional"
    d = 2 if direction == "bidirectional" else 1
    lbr = int(_attr(node, "linear_before_reset", 0))
    if lbr != 1:
        return None, ("linear_before_reset=0 is not supported by the integer path (QuantGRU computes the seed's "
                      "linear_before_reset=1 formulation r * (R_h h + Rb_h); the float GRU is kept)")
    acts = node.attrs.get("activations")
    if acts is not None:
        acts = [a.decode() if isinstance(a, bytes) else str(a) for a in acts]
        if [a.lower() for a in acts] != ["sigmoid", "tanh"] * d:
            return None, (f"activations {acts}: QuantGRU's integer tables compute the default Sigmoid, Tanh only")
    layout = int(_attr(node, "layout", 0))
    if layout not in (0, 1):
        return None, f"layout {layout} is not 0 or 1"
    x = ins[0]
    if not present(x):
        return None, "X is missing"
    et = elem_type(x)
    if et is not None and et != onnx.TensorProto.FLOAT:
        return None, f"X is {onnx.helper.tensor_dtype_to_string(et)}: QuantGRU takes float32 X"
    if x.shape is not None and len(x.shape) != 3:
        return None, f"X has rank {len(x.shape)}, not 3"
    folded = []
    vals = {}
    for i, name in ((1, "W"), (2, "R"), (3, "B")):
        t = ins[i]
        if not present(t):
            if name == "B":
                vals[name] = None
                continue
            return None, f"{name} is missing"
        v, how = _fold(t, opset)
        if v is None:
            return None, f"{name} ({t.name}) is not a constant (nor a constant subgraph of initializers): {how}"
        if how == "folded":
            folded.append(name)
        vals[name] = np.asarray(v, np.float64)
    W, R, B = vals["W"], vals["R"], vals["B"]
    if W.ndim != 3 or R.ndim != 3 or W.shape[0] != d or R.shape[0] != d:
        return None, f"W {list(W.shape)} / R {list(R.shape)} do not match direction {direction!r} (D={d})"
    h = R.shape[2]
    hs = _attr(node, "hidden_size")
    if hs is not None and int(hs) != h:
        return None, f"hidden_size {hs} does not match R {list(R.shape)}"
    if W.shape[1] != 3 * h or R.shape[1] != 3 * h or (B is not None and B.shape != (d, 6 * h)):
        return None, f"W {list(W.shape)}, R {list(R.shape)}, B {None if B is None else list(B.shape)} are not " \
                     f"[D, 3H, C], [D, 3H, H], [D, 6H] with H={h}"
    if not 1 <= h <= 1 << 15:
        return None, f"hidden_size {h} is outside what the kernels take (1..32768)"
    if x.shape is not None and isinstance(x.shape[2], (int, np.integer)) and x.shape[2] != W.shape[2]:
        return None, f"X's last dim {x.shape[2]} does not match W {list(W.shape)}"
    if not (np.all(np.isfinite(W)) and np.all(np.isfinite(R)) and (B is None or np.all(np.isfinite(B)))):
        return None, "W, R or B holds NaN or Inf"
    clip = node.attrs.get("clip")
    return dict(X=x, W=W, R=R, B=B, H=h, direction=direction, layout=layout, clip=None if clip is None else float(clip),
                sequence_lens=ins[4] if present(ins[4]) else None, initial_h=ins[5] if present(ins[5]) else None,
                Y_h=node.outputs[1] if len(node.outputs) > 1 and node.outputs[1].name else None,
                folded=folded), None


def _fold(t, opset):
    """(value, "constant" | "folded") of a constant or a constant subgraph of initializers; (None, why) else."""
    v = constant_value(t)
    if v is not None:
        return v, "constant"
    nodes, seen, stack, leaves = [], set(), [t], {}
    while stack:
        cur = stack.pop()
        if is_constant(cur):
            leaves[cur.name] = constant_value(cur)
            continue
        p = producer(cur)
        if p is None:
            return None, f"it depends on the graph input {cur.name!r}"
        if id(p) in seen:
            continue
        seen.add(id(p))
        if (p.domain or "") not in ("", "ai.onnx") or any(isinstance(a, gs.Graph) for a in p.attrs.values()):
            return None, f"it is computed by {p.op} ({node_label(p)})"
        nodes.append(p)
        if len(nodes) > MAX_FOLD_NODES:
            return None, f"its subgraph has more than {MAX_FOLD_NODES} nodes"
        stack.extend(i for i in p.inputs if i is not None and i.name)
    try:
        from onnx.reference import ReferenceEvaluator
        protos = []
        for n in nodes:
            attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in n.attrs.items()}
            protos.append(onnx.helper.make_node(n.op, [i.name if i is not None else "" for i in n.inputs],
                                                [o.name for o in n.outputs], **attrs))
        inits = [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in leaves.items()]
        g = onnx.helper.make_graph(protos[::-1], "fold", [], [onnx.helper.make_tensor_value_info(t.name, 0, None)],
                                   initializer=inits)
        g = _toposorted(g)
        model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", opset)])
        (val,) = ReferenceEvaluator(model).run(None, {})
        return np.asarray(val), "folded"
    except Exception as e:  # noqa: BLE001 - any failure leaves the GRU in float, with the reason
        return None, f"folding its constant subgraph failed: {type(e).__name__}: {str(e)[:200]}"


def _toposorted(g):
    done = {i.name for i in g.initializer}
    pending, order = list(g.node), []
    while pending:
        ready = [n for n in pending if all(i == "" or i in done for i in n.input)]
        if not ready:
            raise ValueError("cycle in the constant subgraph")
        for n in ready:
            order.append(n)
            done.update(n.output)
            pending.remove(n)
    del g.node[:]
    g.node.extend(order)
    return g


def _value(t, got):
    if t is None:
        return None
    v = constant_value(t)
    return np.asarray(v) if v is not None else got.get(t.name)


# ---------------------------------------------------------------------------------------------------- calibration
SHAPE_ONLY = ("Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast")


def state_pairs(graph: gs.Graph, cands) -> dict:
    """{graph input: graph output} of GRU states a streaming model carries between calls: an input that reaches a
    GRU's initial_h, and an output reached from that GRU's Y_h, through shape-only ops (SHAPE_ONLY)."""
    ins = {t.name for t in graph.inputs}
    outs = {t.name for t in graph.outputs}
    pairs = {}
    for node, spec in cands:
        t = spec["initial_h"]
        while t is not None and t.name not in ins:
            p = producer(t)
            t = p.inputs[0] if p is not None and p.op in SHAPE_ONLY and p.inputs else None
        if t is None or len(node.outputs) < 2 or not node.outputs[1].name:
            continue
        o = node.outputs[1]
        while o is not None and o.name not in outs:
            nxt = [c for c in o.outputs if c.op in SHAPE_ONLY]
            o = nxt[0].outputs[0] if len(nxt) == 1 and len(o.outputs) == 1 else None
        if o is not None:
            pairs[t.name] = o.name
    return pairs


def _calibration_sequences(graph: gs.Graph, cands, runs, factory):
    """Per GRU, its calibration sequences (gru_calib.Sequence, layout 0) from every run, and a note on how they
    were made. A run that gives no array for the state inputs of a streaming model (state_pairs) holds frames:
    the model runs frame by frame, each frame's states are the last one's outputs (zeros at first)."""
    wanted = []
    for _, spec in cands:
        for k in ("X", "sequence_lens", "initial_h"):
            t = spec[k]
            if t is not None and not is_constant(t) and t.name not in wanted:
                wanted.append(t.name)
    seqs = [[] for _ in cands]
    frames_total = 0
    for r in runs:
        pairs = _streaming(graph, cands, r)
        if not pairs:
            feeds = _calibration.check_feeds(graph, r)
            got = dict(feeds)
            got.update(_calibration.collect(graph, wanted, feeds, factory, transform=_layout0))
            for i, (_, spec) in enumerate(cands):
                s = _sequence(spec, got)
                if s is not None:
                    seqs[i].append(s)
            continue
        yh = [spec["Y_h"].name for _, spec in cands if spec["Y_h"] is not None]
        frames = _calibration.stream(graph, wanted + [n for n in yh if n not in wanted], r, pairs, factory,
                                     transform=_layout0)
        frames_total += len(frames)
        for i, (_, spec) in enumerate(cands):
            seqs[i] += _stream_sequences(spec, frames)
    how = f"calibrated on {len(runs)} run{'s' if len(runs) > 1 else ''}"
    if frames_total:
        how += f" ({frames_total} streamed frames, states carried)"
    return seqs, how


def _streaming(graph, cands, run) -> dict:
    """The state pairs when ``run`` gives every graph input but (some of) the states, else {}."""
    pairs = state_pairs(graph, cands)
    missing = {t.name for t in graph.inputs} - set(run)
    if not missing or not pairs or not missing <= set(pairs):
        return {}
    return {k: v for k, v in pairs.items() if k in missing}


def _sequence(spec, got):
    x = got.get(spec["X"].name)
    if x is None:
        return None
    lens = _value(spec["sequence_lens"], got)
    h0 = _value(spec["initial_h"], got)
    x = np.asarray(x, np.float32)
    if spec["layout"] == 1:
        x = x.transpose(1, 0, 2)
        h0 = None if h0 is None else np.asarray(h0).transpose(1, 0, 2)
    return gru_calib.Sequence(x, None if lens is None else np.asarray(lens), None if h0 is None else
                              np.asarray(h0, np.float32))


def _stream_sequences(spec, frames):
    """One sequence of all frames when each frame's initial state is the previous frame's Y_h (the state carried
    unchanged: the GRU sees one long sequence), else one sequence per frame."""
    per = [_sequence(spec, f) for f in frames]
    per = [p for p in per if p is not None]
    if not per:
        return []
    yh = [f.get(spec["Y_h"].name) if spec["Y_h"] is not None else None for f in frames]
    chained = all(p.lens is None for p in per) and all(v is not None for v in yh) and all(
        b.h0 is not None and np.allclose(b.h0, np.asarray(y).transpose(1, 0, 2) if spec["layout"] == 1 else y,
                                         rtol=1e-5, atol=1e-6) for b, y in zip(per[1:], yh[:-1]))
    if chained:
        return [gru_calib.Sequence(np.concatenate([p.x for p in per]), None, per[0].h0)]
    return per


def _layout0(g: onnx.GraphProto) -> None:
    """GRU layout 1 -> Transpose, GRU layout 0, Transpose (onnxruntime's CPU GRU takes layout 0 only)."""
    new_nodes = []
    for n in g.node:
        layout = next((a.i for a in n.attribute if a.name == "layout"), 0)
        if n.op_type != "GRU" or n.domain not in ("", "ai.onnx") or layout != 1:
            new_nodes.append(n)
            continue
        pre, post = [], []
        ins, outs = list(n.input), list(n.output)
        for i, perm in ((0, [1, 0, 2]), (5, [1, 0, 2])):
            if i < len(ins) and ins[i]:
                t = f"{n.name}_{ins[i]}_layout0"
                pre.append(onnx.helper.make_node("Transpose", [ins[i]], [t], perm=perm))
                ins[i] = t
        for i, perm in ((0, [2, 0, 1, 3]), (1, [1, 0, 2])):
            if i < len(outs) and outs[i]:
                t = f"{n.name}_{outs[i]}_layout0"
                post.append(onnx.helper.make_node("Transpose", [t], [outs[i]], perm=perm))
                outs[i] = t
        attrs = [a for a in n.attribute if a.name != "layout"]
        gru = onnx.helper.make_node("GRU", ins, outs, name=n.name)
        gru.attribute.extend(attrs)
        new_nodes += pre + [gru] + post
    del g.node[:]
    g.node.extend(new_nodes)


def calibration_note(report: Report) -> str | None:
    """One line for the CLI when GRUs stayed in float for want of calibration data (None otherwise)."""
    n = sum(1 for e in report.not_run("gru") if e.reason == NO_CALIBRATION)
    if not n:
        return None
    return (f"onnx-lowbit: note: {n} GRU{'s' if n > 1 else ''} left in float: the gru pass needs calibration data; "
            "pass --calibration DATA.npz (numpy.savez with one array per model input, named after it)")
