"""rotarykv: the attention prologue of a decode step -> one ``RotaryKV`` node (onnx_lowbit.rotarykv).

Runs after merge (which writes the packed q/k/v product and its Split) and rotary (which writes the Rotary nodes).
Matched, per attention layer:

    q, k, v = Split(qkv, [Hq D, Hkv D, Hkv D], axis -1 or 2)
    qt, kt, vt = Transpose(Reshape(q | k | v, [B, S, H_i, D]), perm [0, 2, 1, 3])
    Q = Rotary(qt, cos, sin)    kr = Rotary(kt, cos, sin)                       (the same cos and sin)
    present_k = Concat(past_k, kr, axis 2 or -2)    present_v = Concat(past_v, vt, axis 2 or -2)

becomes ``RotaryKV(qkv, cos, sin, past_k, past_v)`` writing (Q, present_k, present_v), the same tensors, with
num_heads = Hq and kv_num_heads = Hkv. Without a cache (neither kr nor vt concatenated: prompt-only exports)
``RotaryKV(qkv, cos, sin)`` writes (Q, kr, vt).

Candidates are Splits whose outputs lead (Reshape -> Transpose -> Rotary) to two Rotary nodes; one that cannot be
rewritten is reported as skipped with the reason: not three outputs, parts in another order (outputs 0 and 1 must
be rotated, output 0's result not concatenated), k and v of different sizes, another axis or perm, a Reshape
whose target's last two entries are not known to be (H_i, D) (a constant, a Concat of one-element pieces ending
in constants as TorchScript writes with dynamic axes, or the inferred output dims; H_i may be -1; allowzero=1,
as the dynamo exporter writes it, only when no entry of the target is 0), head sizes D
that disagree (cos / sin, Reshape targets, past, inferred dims) or are odd, cos / sin that do not broadcast to
[B, 1, S, D] (rank > 4, or an axis -3 not known to be 1), only one of the two cache Concats, a Concat on another
axis or not of the form Concat(past, new), dtypes other than float / float16, or an intermediate (Split,
Reshape, Transpose outputs, kr; vt too with a cache) read outside the pattern or a graph output (a reader whose
results reach no graph output, such as the Shape chain that sized the Slices rotary replaced in optimum's exports,
does not count: cleanup removes it).
"""
from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from .base import (Names, Pass, Report, constant_value, detach, dims, elem_type, is_alive, is_graph_output, is_op,
                   iter_graphs, known_dim, labels_in_order, node_label, producer, scope_stem, type_name)

PATTERN = "rotarykv: Split,Reshape,Transpose,Rotary,Concat"
TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
PERM = [0, 2, 1, 3]


def _is_rotary(node):
    return node is not None and node.op == "Rotary" and node.domain == domain.DOMAIN


def _reader(t, pred):
    """The first consumer of ``t`` that ``pred`` accepts and that reads ``t`` as its first input."""
    return next((c for c in t.outputs if pred(c) and c.inputs and c.inputs[0] is t and c.outputs), None)


def _chains(split):
    """Per Split output: (Reshape, Transpose, Rotary) along Reshape -> Transpose -> Rotary (None where it stops)."""
    out = []
    for t in split.outputs:
        r = _reader(t, lambda c: is_op(c, "Reshape"))
        tr = _reader(r.outputs[0], lambda c: is_op(c, "Transpose")) if r else None
        out.append((r, tr, _reader(tr.outputs[0], _is_rotary) if tr else None))
    return out


def _split_sizes(split, opset):
    """The Split's sizes (ints), "equal" (num_outputs, or no sizes: equal parts) or None (not constants)."""
    if opset >= 13:
        if len(split.inputs) > 1 and split.inputs[1].name:
            v = constant_value(split.inputs[1])
            return None if v is None else [int(x) for x in v.reshape(-1)]
        return "equal"
    sizes = split.attrs.get("split")
    return "equal" if sizes is None else [int(x) for x in sizes]


def _target(reshape):
    """The Reshape target's entries (ints; None where computed) from a constant or a Concat of one-element pieces,
    else None."""
    t = reshape.inputs[1] if len(reshape.inputs) > 1 else None
    if t is None:
        return None
    v = constant_value(t)
    if v is not None:
        return [int(x) for x in v.reshape(-1)]
    p = producer(t)
    if not (is_op(p, "Concat") and p.attrs.get("axis") in (0, -1)):
        return None
    entries = []
    for x in p.inputs:
        c = constant_value(x)
        if c is not None:
            entries += [int(k) for k in c.reshape(-1)]
        elif dims(x) == [1]:
            entries.append(None)
        else:
            return None
    return entries


def _heads(reshape, ins):
    """(H entry, D entry) of a part's Reshape (ints, H possibly -1), or a reason. ``ins``: its input's dims."""
    label = f"Reshape {node_label(reshape)}"
    allowzero = bool(reshape.attrs.get("allowzero", 0))
    e = _target(reshape)
    if allowzero and e is not None and 0 in e:
        # allowzero=1 (the dynamo exporter writes it) reads a 0 entry as a zero-sized dim, not as a copy of the
        # input's: the same Reshape as allowzero=0 only where no entry is 0
        return f"{label} has allowzero=1 and a 0 entry in its target {e} (a zero-sized dim, not a copy)"
    if e is not None and len(e) != 4:
        return f"{label} reshapes to rank {len(e)}, not [B, S, H, D]"
    e = e or [None] * 4
    out = dims(reshape.outputs[0])
    if out is not None and len(out) == 4:          # inferred dims fill what the target leaves open
        e[2:] = [known_dim(o) if v is None or (v == -1 and known_dim(o)) else v for v, o in zip(e[2:], out[2:])]
    h, d = e[2], e[3]
    if d is None or d <= 0 or h is None or h == 0 or h < -1:
        return f"{label}: the target's last two entries {e[2:]} are not known to be (H, D)"
    ins = ins if ins is not None and len(ins) == 3 else [None] * 3
    for j in (0, 1):        # the leading entries must keep the input's B and S
        v = e[j]
        if v is None or v == 0:
            continue        # computed (exporters take B and S from shapes: trusted) or copied (allowzero 0)
        if v == -1 and h > 0 and e[1 - j] != -1:
            continue        # the rest once the other entry and H x D (checked against the part's width) are kept
        if known_dim(ins[j]) is None:
            return f"{label}: target {e} cannot be checked against the input's B and S (unknown)"
        if known_dim(ins[j]) != v:
            return f"{label}: target {e} does not keep the input's B and S ({ins[:2]})"
    return h, d


def _agree(what, found):
    """The one value of ``found`` ({label: value}), None when empty, or a reason when they differ."""
    vals = set(found.values())
    if len(vals) > 1:
        return f"{what} disagree: " + ", ".join(f"{k} {v}" for k, v in found.items())
    return next(iter(vals)) if vals else None


def _feeds(g, node, memo) -> bool:
    """Whether ``node``'s outputs reach a graph output of ``g``; False for what an earlier pass left dead (rotary
    leaves the Shape -> Gather -> Div chain that sized the Slices it replaced: cleanup removes it after the last
    pass). A node of another graph (a subgraph reading the tensor from outside) or one holding subgraphs counts as
    a live reader."""
    if "nodes" not in memo:
        memo["nodes"] = {id(n) for n in g.nodes}
    if id(node) not in memo["nodes"] or any(isinstance(v, gs.Graph) for v in node.attrs.values()):
        return True
    if id(node) not in memo:
        memo[id(node)] = False
        memo[id(node)] = any(is_graph_output(g, t) or any(_feeds(g, c, memo) for c in t.outputs)
                             for t in node.outputs)
    return memo[id(node)]


def _why_not(g, split, chains):
    """(inputs, outputs, Hq, Hkv, nodes) of the RotaryKV node the candidate becomes, or the reason it cannot."""
    if len(split.outputs) != 3:
        return f"the Split has {len(split.outputs)} outputs, not 3 (q, k, v)"
    rot = [c[2] for c in chains]
    if rot[0] is None or rot[1] is None or rot[2] is not None:
        parts = [i for i, r in enumerate(rot) if r is not None]
        return f"Split outputs {parts} are rotated, not 0 and 1: the parts are not in q, k, v order"
    (r0, t0, q_rot), (r1, t1, k_rot), (r2, t2, _) = chains
    if t2 is None:
        return f"Split output 2 ({split.outputs[2].name}) is not read by Reshape -> Transpose"
    if len(q_rot.inputs) != 3 or len(k_rot.inputs) != 3 or any(a is not b for a, b in
                                                                 zip(q_rot.inputs[1:], k_rot.inputs[1:])):
        return "the two Rotary nodes read different cos / sin"
    cos, sin = q_rot.inputs[1], q_rot.inputs[2]
    q_out, kr, vt = q_rot.outputs[0], k_rot.outputs[0], t2.outputs[0]
    concats = [[c for c in t.outputs if is_op(c, "Concat")] for t in (q_out, kr, vt)]
    if concats[0]:
        return "Split output 0's rotated part is concatenated: the parts are not in q, k, v order"
    cache = bool(concats[1] or concats[2])
    if cache and (len(concats[1]) != 1 or len(concats[2]) != 1):
        return (f"only one of k and v is concatenated (k: {len(concats[1])} Concat, v: {len(concats[2])}): "
                "not a KV cache append")
    nodes = [split] + [n for c in chains for n in c if n is not None]
    past = []
    if cache:
        for (cat,), new, what in zip(concats[1:], (kr, vt), ("k", "v")):
            if len(cat.inputs) != 2 or cat.inputs[1] is not new:
                return f"Concat {node_label(cat)} is not Concat(past_{what}, new {what})"
            if cat.attrs.get("axis") not in (2, -2):
                return f"Concat {node_label(cat)} is on axis {cat.attrs.get('axis')}, not the cache's axis 2"
            past.append(cat.inputs[0])
            nodes.append(cat)
    outs = [q_out] + ([c[0].outputs[0] for c in concats[1:]] if cache else [kr, vt])
    qkv = split.inputs[0]

    # the Split: axis, rank, sizes
    ranks = {len(s) for s in [dims(qkv)] + [dims(t) for t in split.outputs] if s is not None}
    if ranks != {3}:
        return "QKV's rank is unknown" if not ranks else f"QKV has rank {sorted(ranks)}, not 3 ([B, S, W])"
    axis = split.attrs.get("axis", 0)
    if axis not in (-1, 2):
        return f"the Split is on axis {axis}, not the last one"
    sizes = _split_sizes(split, g.opset)
    if sizes is None:
        return "the Split's sizes are not constants"
    if isinstance(sizes, list) and len(sizes) != 3:
        return f"the Split has {len(sizes)} sizes for 3 outputs"
    for _, t, _ in chains:
        if t.attrs.get("perm") is None or list(t.attrs["perm"]) != PERM:
            return f"Transpose {node_label(t)} has perm {t.attrs.get('perm')}, not {PERM}"
    heads = []
    for i, (r, _, _) in enumerate(chains):
        hd = _heads(r, dims(split.outputs[i]))
        if isinstance(hd, str):
            return hd
        heads.append(hd)

    # the head size D and the parts' sizes
    found = {}
    for name, t in (("cos", cos), ("sin", sin)):
        k = known_dim((dims(t) or [None])[-1])
        if k and k > 1:
            found[name] = k
    for i, (_, dd) in enumerate(heads):
        found[f"Reshape {i}"] = dd
    for name, t in [*zip(("past_k", "past_v"), past), *((t.name, t) for t in (t0.outputs[0], t1.outputs[0], vt,
                                                                             *outs))]:
        s = dims(t)
        if s is not None and len(s) == 4 and known_dim(s[-1]):
            found[name] = known_dim(s[-1])
    d = _agree("head sizes D", found)
    if isinstance(d, str):
        return d
    if d % 2:
        return f"head size D = {d} is odd"
    w_total = known_dim(dims(qkv)[-1]) if dims(qkv) else None
    widths = []
    for i, (h, _) in enumerate(heads):
        found = {}
        if isinstance(sizes, list):
            found["Split size"] = sizes[i]
        elif w_total:
            found["QKV / 3"] = w_total // 3 if w_total % 3 == 0 else -1
        so = dims(split.outputs[i])
        k = known_dim(so[-1]) if so else None
        if k:
            found["inferred"] = k
        if h > 0:
            found["Reshape H x D"] = h * d
        w = _agree(f"sizes of Split output {i}", found)
        if isinstance(w, str):
            return w
        if w is None:
            return f"the size of Split output {i} is unknown"
        if w <= 0 or w % d:
            return f"Split output {i} of size {w} is not a whole number of heads of D = {d}"
        widths.append(w)
    if widths[1] != widths[2]:
        return f"the k and v parts differ in size ({widths[1]} and {widths[2]})"
    hq, hkv = widths[0] // d, widths[1] // d

    # cos / sin broadcast to [B, 1, S, D]; past [B, Hkv, P, D]; types
    for name, t in (("cos", cos), ("sin", sin)):
        s = dims(t)
        if s is None:
            return f"the shape of {name} is unknown"
        if len(s) > 4:
            return f"{name} has rank {len(s)} > 4"
        if len(s) >= 3 and known_dim(s[-3]) != 1:
            return f"{name} of shape {s} has a head axis (-3) not known to be 1: it must broadcast to [B, 1, S, D]"
    shapes = [dims(p) for p in past]
    for name, s in zip(("past_k", "past_v"), shapes):
        if s is not None and (len(s) != 4 or known_dim(s[1]) not in (None, hkv)):
            return f"{name} of shape {s} is not [B, {hkv}, P, {d}]"
    if len(shapes) == 2 and shapes[0] and shapes[1] and any(
            known_dim(a) and known_dim(b) and a != b for a, b in zip(*shapes)):
        return f"past_k {shapes[0]} and past_v {shapes[1]} differ in shape"
    ets = [(t.name, elem_type(t)) for t in [qkv, cos, sin, *past, *outs]]
    dt = next((et for _, et in ets if et is not None), None)
    if dt is not None and dt not in TYPES:
        return f"QKV is {type_name(dt)}: RotaryKV takes float or float16"
    for name, et in ets:
        if et is not None and et != dt:
            return f"{name} is {type_name(et)}, QKV is {type_name(dt)}"

    # intermediates read only inside the pattern (readers left dead by an earlier pass do not count)
    inside = {id(n) for n in nodes}
    memo = {}
    for n in [split, r0, r1, r2, t0, t1] + ([k_rot, t2] if cache else []):
        for t in n.outputs:
            who = [node_label(c) for c in t.outputs if id(c) not in inside and _feeds(g, c, memo)]
            who += ["graph output"] if is_graph_output(g, t) else []
            if who:
                return f"intermediate {t.name} ({n.op}) is used elsewhere: {', '.join(who)}"
    return [qkv, cos, sin, *past], outs, hq, hkv, nodes



class RotaryKVPass(Pass):
    name = "rotarykv"
    description = ("q/k/v Split, Reshapes, Transposes, the two Rotary nodes and the KV-cache Concats -> one "
                   "RotaryKV node (after merge and rotary)")

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        names = Names(graph)
        for g in iter_graphs(graph):
            order = {id(node): i for i, node in enumerate(g.nodes)}
            for split in list(g.nodes):
                if not (is_alive(split) and is_op(split, "Split") and split.inputs):
                    continue
                chains = _chains(split)
                if sum(c[2] is not None for c in chains) < 2:
                    continue
                m = _why_not(g, split, chains)
                if isinstance(m, str):
                    nodes = [split] + [n for c in chains for n in c if n is not None]
                    labels = labels_in_order(nodes, order)
                    self.skipped(report, PATTERN, labels, m)
                    continue
                inputs, outs, hq, hkv, nodes = m
                labels = labels_in_order(nodes, order)
                q_rot = chains[0][2]
                for k in nodes:
                    detach(k)
                new = gs.Node(op="RotaryKV", domain=domain.DOMAIN, name=names(scope_stem(q_rot) + "RotaryKV"),
                              attrs={"num_heads": hq, "kv_num_heads": hkv}, inputs=inputs, outputs=outs)
                g.nodes.append(new)
                cache = len(inputs) == 5
                self.rewritten(report, PATTERN, labels, "" if cache else "no KV cache: writes k and v as they are",
                               new_node=new.name, num_heads=hq, kv_num_heads=hkv, cache=cache,
                               outputs=[t.name for t in outs])
