"""Pass "weights4": 4-bit weight quantisation of MatMul / Gemm nodes with a constant weight.

Matched (main graph and subgraphs), with W the [K, N] weight of ``Y = A x W``:

    MatMul(A, W)                  W an initializer or a Constant-node output; A of rank >= 2, or of unknown rank /
                                  rank 1: then run on Reshape(A, [-1, K]) and reshaped back (weights4_graph.py)
    MatMul(A, Transpose(Wt))      Wt a constant stored [N, K] (perm absent or [1, 0])
    Gemm(A, B, C)                 transA=0; B constant (or Transpose of a constant), transB=0/1; alpha folded into
                                  W, beta into the bias; C absent or a constant scalar / [N] / [1, N]
    MatMul(A, W) -> Add(., b)     b a constant [N] (or [1, .., 1, N] of rank <= rank(A)): fused as the bias input
                                  when the emitted op has one (not MatMulBnb4, which keeps the Add)

Formats (option ``weights``): "nf4" / "fp4" (bitsandbytes blockwise 4-bit codes, onnx_lowbit.nf4) and "awq"
(AutoAWQ GEMM layout, onnx_lowbit.awq; RTN quantisation, or AWQ's activation-aware scale search when
``calibration`` is given). Targets (option ``weights_target``): "lowbit" emits our MatMulNF4 / MatMulAWQ (domain
onnx_lowbit); "ort" emits onnxruntime's own com.microsoft MatMulBnb4 (+ Add for a bias) / MatMulNBits, which stock
onnxruntime runs without our library (verified on the CPU EP of onnxruntime 1.31).

Options (``block_size``, ``group_size`` and ``calibration`` are shared names, the rest are prefixed):
    weights               "nf4" | "fp4" | "awq"; None: the pass changes nothing (one report entry says so when
                          the graph has candidates)
    block_size            NF4/FP4 absmax block, a power of two in 32..4096 (default 64); target "ort": 32..256
                          (onnxruntime's MatMulBnb4 kernels take 16..256)
    group_size            AWQ group along K (default: block_size when that is given, else 128); 1..65536 (K is
                          zero-padded up to a multiple of it, so any size divides); target "ort": 16, 32, 64, 128
                          or 256 (MatMulNBits)
    weights_target        "lowbit" (default) | "ort"
    weights_ort_form      target "ort", weights "awq": "awq" (default: AWQ's zero points) | "compact" (MatMulNBits'
                          symmetric form, block 32, no zero points, scales in A's dtype: passes/nbits_compact.py)
    weights_ort_accuracy  target "ort", weights "awq": MatMulNBits' accuracy_level 0..4 written on every node (both
                          forms; default: not written, onnxruntime's 0); 4 = int8 activations, onnxruntime's fastest
                          CPU kernel (VNNI / AVX2), at the cost of rounding A to int8 per block
    weights_nf4_accuracy  target "lowbit", weights "nf4" / "fp4": our MatMulNF4's accuracy_level 0..4 written on every
                          node (default: not written, the op's 0); 4 = A rounded to int8 per block on the CPU (VNNI
                          integer products, onnx_lowbit.nf4_int8; the CUDA face computes in float at every level)
    weights_target_why    a note on every rewrite saying why this target (rewrite --device cpu's default:
                          onnx_lowbit/cpu_passes.py's CPU_WEIGHTS)
    weights_min_elements  weights with fewer than K*N elements stay in float (default 4096 = 64x64: smaller
                          matrices are < 8 KiB in fp16, irrelevant to the model size, and their per-block scales
                          would be a large overhead)
    weights_exclude       names or regular expressions (a string or a list): a weight stays in float when a pattern
                          equals, or ``re.search``-matches, its node name, its weight tensor name or its source
                          module path (TorchScript exports: "lm_head" matches "/lm_head/MatMul"; dynamo exports
                          name nodes generically, e.g. "node_MatMul_11", but record the module path, e.g.
                          "lm_head" or "model.layers.0.mlp.up_proj", in node metadata)
    awq_checkpoint        path of a pre-quantised AutoAWQ checkpoint (.safetensors file or a directory of shards;
                          implies weights="awq"): each weight whose module path / weight name / node name
                          matches a checkpoint module takes its qweight/qzeros/scales (and group size) as they
                          are; weights without a match stay in float (onnx_lowbit.awq_checkpoint)
    calibration           {graph input name: np.ndarray} (AWQ only): run once through the model in onnxruntime
                          (every candidate's A added as a graph output on a copy) to collect the activations;
                          at most MAX_CALIBRATION_ROWS rows per MatMul are used (evenly subsampled)
    calibration_session   optional callable(model bytes, or a path for models past 2 GB) -> session with
                          ``.run(None, feeds)`` and ``.get_outputs()`` for that run;
                          needed when the graph already holds onnx_lowbit ops (e.g. FPLUT from the fplut pass),
                          which stock onnxruntime cannot run; the CLI passes one built on onnx_lowbit's session
    awq_holdout           fraction of the calibration rows (the last ones) the AWQ search does not see; a layer keeps
                          its searched scales only when they beat RTN on those rows too (default 0.25; 0: off)
    weights_lm_head       "fp16" (default) | "float" | "4bit": the output head over a vocabulary (weights4_graph.
                          head_reason) stays in float, stored once (fp16 for float32 models), or is quantised
    weights_rounding      "rtn" (default) | "gptq": GPTQ's error-compensating rounding on the calibration
                          activations (onnx_lowbit.gptq; after AWQ's scales; RTN kept where it loses on held-out rows)
    weights_budget        fraction of the model's fp32 weight bytes; the most sensitive products stay in
                          weights_budget_form "int8" (DequantizeLinear) or "fp16" within it (weights4_mixed.py)

AWQ activation scales: ``awq.search_scales`` (its grid includes s = 1, plain RTN; with held-out rows RTN is kept
when the searched s loses there) gives s; W * s (rows) is quantised and act_scale = 1 / s is what A must be
multiplied by. It is folded into the op producing A when A has no other reader and that op is a MatMul / Gemm
with a constant weight (its output columns and bias times act_scale; also through a following constant bias Add),
a LayerNormalization / RMSNormalization / com.microsoft (Simplified)LayerNormalization over the last axis (scale
and bias), or a Mul by a constant [K] vector (a decomposed norm's gamma); otherwise ``Mul(A, act_scale)`` is
inserted in front of the quantised op. For fp16 models act_scale is first rounded to fp16 and the weight is
re-quantised with s = 1 / that, so the rewritten op computes exactly (A * act_scale) x dequant(W * s).
Candidates are processed from the graph's end backwards, so a producer that is itself quantised receives the fold
before it is quantised. Without ``calibration`` AWQ is round-to-nearest (``awq.quantize_rtn``), no scales.

AWQ with N not a multiple of 8: zero columns up to the next multiple (dequantised to exactly 0), the op's N is the
padded one and a Slice returns the model's N columns (target "ort": the padded columns are dropped from
MatMulNBits' tensors). Bad options raise ValueError naming the option. A weight a quantiser refuses (NaN/Inf for
AWQ) is skipped with the quantiser's message and marked "unquantised" (``unquantised(report)``; the CLI exits 4).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

from . import calibration, external, nbits_compact
from . import weights4_mixed as mixed
from . import weights4_graph as w4g
from .base import Names, Pass, Report, is_alive, is_graph_output, iter_graphs, node_label, producer, single_consumer
from .linear import Linear, Skip, constant_weight, following_bias, match, rank
from .weights4_graph import apply_plan, fold_plan
from .weights4_quant import (DEFAULT_MIN_ELEMENTS, FORMATS, LM_HEAD, MAX_CALIBRATION_ROWS, MS_DOMAIN,  # noqa: F401
                             ORT_BLOCK_SIZES, TARGETS, Options, _awq, _format_call, _int_option, _rel_fro,
                             _search_details, _usable_act, gptq_round, hessians, nbits_layout, parse_options,
                             quantize_nf4_chunked, quantize_rtn_chunked)

BNB4_QUANT_TYPE = {"fp4": 0, "nf4": 1}  # com.microsoft.MatMulBnb4's quant_type attribute
# onnxruntime's CUDA MatMulBnb4 (1.31) copies its 16-entry code table from a host array on the stack in every run
# (SetBnbQuantMap), so a CUDA graph captures a copy from a stack address that holds something else at replay time:
# every replay measured here (enable_cuda_graph, sessions 21-28, BENCHMARKS.md) gave NaN / inf. Said on each entry.
BNB4_GRAPH_NOTE = ("onnxruntime's CUDA MatMulBnb4 is not safe in CUDA graphs (enable_cuda_graph replays gave NaN): "
                   "use MatMulNBits (weights=awq) or our MatMulNF4 there")


# matching helpers (the matcher itself: passes/linear.py)
class _ByDesign(Skip):
    """A weight left in float by the options' design (e.g. a module an AWQ checkpoint does not hold), not a
    failure the user must be told about."""


@dataclass
class _Kept:
    """What the end-of-graph check of a rewrite needs (not the weight arrays: those are released at once)."""
    stored: object
    w_node: gs.Node | None
    weight_name: str


def _excluded(cand: Linear, patterns, module_paths=None, names=None) -> str | None:
    if names is None:
        names = [cand.node.name, cand.weight_name, (module_paths or {}).get(cand.node.name)]
    names = [n for n in names if n]
    for pat, rx in patterns:
        for n in names:
            if n == pat or rx.search(n):
                return f"excluded by --exclude / weights_exclude {pat!r} (matches {n!r})"
    return None


def nf4_accuracy_attrs(level, k: int, notes: list) -> dict:
    """MatMulNF4's ``accuracy_level`` for the option weights_nf4_accuracy (None: not written, the op's 0); a note for
    the report when written (level 4 on a K that is not a multiple of 32 computes as level 0: said)."""
    if level is None:
        return {}
    note = f"MatMulNF4 accuracy_level {level}"
    if level == 4:
        note += " (int8 activations on the CPU" + (")" if k % 32 == 0 else f"; K={k} is not a multiple of 32: "
                                                                           "computed as level 0)")
    notes.append(note)
    return {"accuracy_level": int(level)}


# the pass
def unquantised(report: Report) -> list:
    """weights4 skips of float constant weights left in float for a reason other than the user's choice
    (--exclude, the size floor, the kept output head): the quantiser refused them, or the pattern around them is
    one the pass does not handle."""
    return [e for e in report.skipped(WeightsPass.name) if e.details.get("unquantised")]


def totals(report: Report) -> dict:
    """Totals over the weights4 rewrites of ``report``: weights, bytes before/after, their ratio and the
    worst / mean relative reconstruction error (also stored in the last rewrite's details as ``totals``)."""
    entries = [e for e in report.rewritten(WeightsPass.name) if "bytes_before" in e.details]
    before = sum(e.details["bytes_before"] for e in entries)
    after = sum(e.details["bytes_after"] + e.details.get("float_kept_bytes", 0) for e in entries)
    errs = [e.details["rel_error"] for e in entries]
    heads = [e for e in report.skipped(WeightsPass.name) if e.details.get("head_kept")]
    return {"weights": len(entries), "bytes_before": before, "bytes_after": after,
            "head_kept": len(heads), "head_kept_bytes": sum(e.details.get("float_bytes", 0) for e in heads),
            "ratio": (after / before) if before else None,
            "max_rel_error": max(errs) if errs else None,
            "mean_rel_error": float(np.mean(errs)) if errs else None,
            "skipped": len(report.skipped(WeightsPass.name)),
            "accuracy_levels": sorted({e.details["accuracy_level"] for e in entries if "accuracy_level" in e.details}),
            "accuracy_levels_by_op": {op: sorted({e.details["accuracy_level"] for e in entries
                                                  if e.details.get("op") == op and "accuracy_level" in e.details})
                                      for op in sorted({e.details.get("op") for e in entries
                                                        if "accuracy_level" in e.details})}}


class WeightsPass(Pass):
    name = "weights4"
    description = ("MatMul/Gemm constant weights -> 4-bit NF4/FP4/AWQ (MatMulNF4/MatMulAWQ, or onnxruntime's "
                   "MatMulBnb4/MatMulNBits); only with the option weights=nf4|fp4|awq")

    def apply(self, graph: gs.Graph, report: Report, options: dict) -> None:
        opts = parse_options(options)
        if opts is None:
            least = _int_option(options, "weights_min_elements", DEFAULT_MIN_ELEMENTS)
            cands = [node_label(c.node) for g in iter_graphs(graph) for c in
                     (match(n)[0] for n in g.nodes) if c is not None and c.size >= least]
            if cands:
                self.not_run(report, "weights4: no format", cands[:8] + (["..."] if len(cands) > 8 else []),
                             f"option weights (nf4, fp4 or awq) not given: {len(cands)} constant-weight "
                             "MatMul/Gemm left in float", format=None)
            return
        _Run(self, graph, report, opts).run()

    def needs(self, options: dict) -> str | None:
        return None if options.get("weights") or options.get("awq_checkpoint") else "--weights nf4|fp4|awq"


class _Run:
    def __init__(self, owner: WeightsPass, graph: gs.Graph, report: Report, opts: Options):
        self.owner, self.root, self.report, self.o = owner, graph, report, opts
        self.names = Names(graph)
        self.entries: list = []       # (action, pattern, nodes, reason, details) buffered per graph
        self.shared: dict = {}        # (id(stored), transpose, alpha) -> (Q, absmax, rel_error, first node)
        self.kept_checks: list = []   # (index in entries, Linear) of rewrites whose float weight may stay
        self.activations: dict = {}   # tensor name -> [rows, K] float32 calibration activations
        self.shared_act: dict = {}    # A's name -> (act_scale [K] float32 or None for RTN, the weight rows' scale,
                                      # ids of the candidate nodes sharing it, the search's figures for the report)
        self.applied: dict = {}       # A's name -> (tensor, note) once a shared act_scale has been applied
        self.hessians: dict = {}      # A's name -> (H of the fitted rows, H of the held-out rows): GPTQ
        self.promote: dict = {}       # id(node) -> what weights_budget keeps it in (weights4_mixed.plan)
        self.sensitivity: dict = {}   # id(node) -> its relative output errors in 4-bit / the higher form
        self.budget_info: dict = {}   # the budget's plan, for the report

    def const(self, base: str, array: np.ndarray) -> gs.Constant:
        """A new constant with a unique name; spilled to the output file at once when streaming."""
        return external.constant(self.names(base), array, self.o.spill)

    # -- report --------------------------------------------------------------------------------------------
    def skip(self, pattern, nodes, reason, **details):
        self.entries.append(("skipped", pattern, nodes, reason, details))

    def done(self, pattern, nodes, reason, **details):
        self.entries.append(("rewritten", pattern, nodes, reason, details))

    def flush(self):
        for i, cand in self.kept_checks:  # after every rewrite of the graph: float weights other ops still read
            users = {node_label(c) for c in cand.stored.outputs if is_alive(c) and c is not cand.w_node}
            if cand.w_node is not None and cand.w_node.op == "Transpose" and is_alive(cand.w_node):
                users |= {node_label(c) for t in cand.w_node.outputs for c in t.outputs if is_alive(c)}
            details = self.entries[i][4]
            if users and details.get("bytes_before"):
                note = f"float weight {cand.weight_name!r} kept: also read by {', '.join(sorted(users))}"
                reason = self.entries[i][3]
                self.entries[i] = self.entries[i][:3] + ("; ".join(r for r in (reason, note) if r), details)
                details["float_kept_bytes"] = details["bytes_before"]
        self.kept_checks = []
        for action, pattern, nodes, reason, details in reversed(self.entries):
            if action == "rewritten":
                self.owner.rewritten(self.report, pattern, nodes, reason, **details)
            else:
                self.owner.skipped(self.report, pattern, nodes, reason, **details)
        self.entries = []

    # -- main ----------------------------------------------------------------------------------------------
    def wanted(self, node):
        """The candidate ``node`` is, when the options let it be quantised; else None."""
        cand, _ = match(node, any_rank=True)
        if cand is None or cand.size < self.o.min_elements or _excluded(cand, self.o.exclude, self.o.module_paths):
            return None
        if self.o.lm_head != "4bit" and w4g.head_reason(self.root, cand, self.o.module_paths.get(node.name)):
            return None
        return cand

    def run(self):
        if self.o.calibration is not None:
            self.calibrate()
        for g in list(iter_graphs(self.root)):
            g.toposort()
            # from the end: AWQ folds reach producers before they quantise; the nodes one() appends then take the
            # place of the node they came from, so the graph keeps its order (merge packs q/k/v in that order)
            key = {id(n): (i, 0) for i, n in enumerate(g.nodes)}
            for node in reversed(list(g.nodes)):
                n0 = len(g.nodes)
                self.one(g, node)
                for k, new in enumerate(g.nodes[n0:]):
                    key[id(new)] = (key[id(node)][0], k + 1)
            g.nodes.sort(key=lambda n: key[id(n)])
            self.flush()
        done = self.report.rewritten(self.owner.name)
        if done:
            done[-1].details["totals"] = totals(self.report)
            if self.budget_info:
                done[-1].details["budget"] = self.budget_info

    def pattern(self, spelling: str) -> str:
        return f"{self.o.fmt}: {spelling}"

    def one(self, g: gs.Graph, node: gs.Node):
        cand, skip = match(node, any_rank=True)
        label = [node_label(node)]
        if skip is not None:
            details = dict(format=self.o.fmt)
            found = constant_weight(node.inputs[1]) if len(node.inputs) > 1 else None
            if found is not None and found[0].ndim == 2 and found[0].dtype in (np.float32, np.float16) and not \
                    _excluded(None, self.o.exclude, names=[node.name, found[1].name,
                                                           self.o.module_paths.get(node.name)]):
                details["unquantised"] = True  # a float weight left in float for a reason the user must see
            self.skip(self.pattern(skip[0]), label, skip[1], **details)
            return
        if cand is None:
            return
        details = dict(format=self.o.fmt, weight=cand.weight_name, K=int(cand.K), N=int(cand.N))
        if cand.size < self.o.min_elements:
            self.skip(self.pattern(cand.spelling), label, f"K*N = {cand.size} < weights_min_elements "
                      f"{self.o.min_elements}", **details)
            return
        why = _excluded(cand, self.o.exclude, self.o.module_paths)
        if why:
            self.skip(self.pattern(cand.spelling), label, why, **details)
            return
        with_bias_input = not (self.o.target == "ort" and self.o.fmt in ("nf4", "fp4"))
        if node.op == "MatMul" and with_bias_input:
            found = following_bias(g, cand)
            if found is not None:
                cand.bias_add, cand.bias = found
                cand.out = cand.bias_add.outputs[0]
                cand.spelling += " -> Add(bias)"
        head = w4g.head_reason(g, cand, self.o.module_paths.get(node.name)) if self.o.lm_head != "4bit" else None
        if head:
            how = w4g.store_head(g, self.names, self.const, cand, self.o.lm_head == "fp16" and
                                 cand.dtype is np.float32)
            stored = cand.bytes_before // (2 if "fp16" in how else 1)
            self.skip(self.pattern(cand.spelling), label, f"output head kept in float ({head}{'; ' if how else ''}"
                      f"{how}): 4-bit rounding of it costs more accuracy than any other weight; --lm-head 4bit "
                      "(weights_lm_head='4bit') quantises it", head_kept=True, float_bytes=stored, **details)
            return
        notes = [self.o.target_why] if self.o.target_why else []
        if id(node) in self.promote:   # weights_budget: kept in higher precision, the node stays as it is
            reason, info = mixed.emit(self, g, cand, details)
            self.done(f"{self.promote[id(node)]}: {cand.spelling}", label, reason, **info)
            return
        details.update(self.sensitivity.get(id(node), {}))
        final = cand.out
        if cand.flat:  # A of unknown rank / rank 1: the op runs on A as [-1, K], reshaped back after
            cand.out = gs.Variable(self.names(f"{final.name}_2d"), dtype=final.dtype)
            cand.spelling += " (A flattened)"
        try:
            new, info = (self.emit_awq if self.o.fmt == "awq" else self.emit_nf4)(g, cand, notes)
        except Skip as e:  # the format refused the weight (e.g. NaN/Inf for AWQ); nothing was changed yet
            if not isinstance(e, _ByDesign):
                details["unquantised"] = True
            self.skip(self.pattern(cand.spelling), label, str(e), **details)
            return
        if cand.flat:
            made = w4g.flatten_around(g, self.names, new, cand.a, cand.out, final, int(cand.K),
                                      int(cand.N))
            cand.out = final
            info["new_nodes"] = info.get("new_nodes", []) + [n.name for n in made]
            notes.append("rank of A unknown or 1: the op runs on A reshaped to [-1, K], its result reshaped to "
                         "shape(A)[:-1] + [N]")
        details.update(info)
        nodes = label + ([node_label(cand.bias_add)] if cand.bias_add is not None else [])
        self.kept_checks.append((len(self.entries), _Kept(cand.stored, cand.w_node, cand.weight_name)))
        # detach what was replaced
        node.inputs.clear()
        node.outputs.clear()
        if cand.bias_add is not None:
            cand.bias_add.inputs.clear()
            cand.bias_add.outputs.clear()
        self.done(self.pattern(cand.spelling), nodes, "; ".join(notes), **details)

    # -- NF4 / FP4 -----------------------------------------------------------------------------------------
    def emit_nf4(self, g: gs.Graph, cand: Linear, notes: list):
        o = self.o
        key = (id(cand.stored), cand.transpose, cand.alpha)
        shared = self.shared.get(key)
        bytes_before = cand.bytes_before
        if shared is not None:
            q_t, absmax_t, rel, first = shared  # the same weight read by several ops: one quantised copy
            notes.append(f"shares the quantised weight of {first!r}")
            bytes_after = bytes_before = 0  # counted once, on the first op
        else:
            res, extra = self.gptq(g, cand, cand.w, None, notes)
            if res is not None:
                packed, absmax, rel = res.packed, res.absmax, _rel_fro(cand.w, res.w_hat)
            else:
                packed, absmax, rel = quantize_nf4_chunked(cand, o.fmt, o.block_size)
            if o.target == "ort":
                absmax = absmax.astype(cand.dtype)  # MatMulBnb4: absmax has A's type
            q_t = self.const(f"{cand.weight_name}_{o.fmt}", packed)
            absmax_t = self.const(f"{cand.weight_name}_absmax", absmax)
            bytes_after = int(packed.nbytes + absmax.nbytes)
            self.shared[key] = (q_t, absmax_t, rel, node_label(cand.node))
        base_name = cand.node.name or cand.out.name
        attrs = dict(K=int(cand.K), N=int(cand.N), block_size=int(o.block_size))
        if o.target == "lowbit":
            inputs = [cand.a, q_t, absmax_t]
            if cand.bias is not None:
                inputs.append(gs.Constant(self.names(f"{base_name}_bias"), cand.bias.astype(cand.dtype)))
            attrs.update(nf4_accuracy_attrs(o.nf4_accuracy, int(cand.K), notes))
            new = gs.Node(op="MatMulNF4", domain=domain.DOMAIN, name=self.names(f"{base_name}_{o.fmt}"),
                          attrs=dict(quant_type=o.fmt, **attrs), inputs=inputs, outputs=[cand.out])
            g.nodes.append(new)
            nodes = [new]
        else:
            attrs["quant_type"] = BNB4_QUANT_TYPE[o.fmt]
            notes.append(BNB4_GRAPH_NOTE)
            y = cand.out
            if cand.bias is not None:
                y = gs.Variable(self.names(f"{cand.out.name}_nobias"), dtype=cand.dtype, shape=cand.out.shape)
            new = gs.Node(op="MatMulBnb4", domain=MS_DOMAIN, name=self.names(f"{base_name}_bnb4"),
                          attrs=attrs, inputs=[cand.a, q_t, absmax_t], outputs=[y])
            g.nodes.append(new)
            nodes = [new]
            if cand.bias is not None:
                b = gs.Constant(self.names(f"{base_name}_bias"), cand.bias.astype(cand.dtype))
                add = gs.Node(op="Add", name=self.names(f"{base_name}_bias_add"), inputs=[y, b], outputs=[cand.out])
                g.nodes.append(add)
                nodes.append(add)
        info = dict(target=o.target, op=new.op, new_node=new.name, block_size=o.block_size,
                    bytes_before=bytes_before, bytes_after=bytes_after, rel_error=rel,
                    bias=cand.bias is not None, new_nodes=[n.name for n in nodes])
        info.update(extra if shared is None else {})
        if "accuracy_level" in attrs:
            info["accuracy_level"] = attrs["accuracy_level"]
        return new, info

    def gptq(self, g: gs.Graph, cand: Linear, w: np.ndarray, act, notes: list):
        """(GPTQ's result for w, or None: round to nearest; details) with weights_rounding='gptq'."""
        x = self.activations.get(cand.a.name) if g is self.root else None
        if self.o.rounding != "gptq" or x is None:
            if self.o.rounding == "gptq":
                notes.append("no calibration activations for A (inside a subgraph or not reached): RTN")
            return None, {}
        res, details, note = gptq_round(self.o, w, hessians(self.hessians, cand.a.name, x, self.o.awq_holdout), act)
        notes.append(note)
        return res, details

    # -- AWQ -----------------------------------------------------------------------------------------------
    def emit_awq(self, g: gs.Graph, cand: Linear, notes: list):
        awq, o = _awq(), self.o
        if o.ort_form == "compact":  # MatMulNBits' compact symmetric form (passes/nbits_compact.py)
            try:
                return nbits_compact.emit(self, g, cand, notes, o.group_size)
            except ValueError as e:
                raise Skip(str(e)) from None
        group_size = o.group_size
        if o.checkpoint is not None:
            return self.emit_awq_tensors(g, cand, notes, *self.from_checkpoint(cand, notes))
        x = self.activations.get(cand.a.name) if g is self.root else None
        act = None  # AWQ's act_scale = 1 / s [K]: the activation is multiplied by it, the weight rows by s
        extra = w4g.padding(cand.N)
        search = {}
        shared = self.shared_act.get(cand.a.name) if x is not None else None
        if shared is not None and id(cand.node) in shared[2]:
            # one scale for every projection reading this A (AutoAWQ's grouping, e.g. gate+up, q/k/v)
            act, s_w, search = shared[0], shared[1], shared[3]
            notes.append(f"activation scale searched jointly with the {len(shared[2]) - 1} other projection(s) "
                         f"of {cand.a.name!r}: {search['search']}")
        elif x is not None:
            fit, held = awq.split_holdout(x, o.awq_holdout) if o.awq_holdout else (x, None)
            found = _format_call(awq.search_scales, w4g.pad_columns(cand.w, extra), fit, o.group_size, 20, False,
                                 held)
            search = _search_details(found)
            notes.append(search["search"])
            act, s_w, why = _usable_act(found, cand.K, cand.dtype)
            if why:
                notes.append(why)
        elif o.calibration is not None:
            notes.append("no calibration activations for A (inside a subgraph or not reached): RTN")
        a_in = cand.a
        res, gdetails = self.gptq(g, cand, w4g.pad_columns(cand.w if act is None else cand.w * s_w[:, None], extra),
                                  act, notes)
        search = {**search, **gdetails}
        if act is None and res is None:
            qweight, qzeros, scales, rel = quantize_rtn_chunked(cand, o.group_size)
        else:
            w32 = cand.w
            if res is not None:
                qweight, qzeros, scales = awq.pack(res.q, res.z, res.s)
            else:
                qweight, qzeros, scales = _format_call(awq.quantize_rtn, w4g.pad_columns(w32 * s_w[:, None], extra),
                                                       o.group_size)
            qweight = np.ascontiguousarray(qweight, dtype=np.int32)
            qzeros = np.ascontiguousarray(qzeros, dtype=np.int32)
            scales = np.ascontiguousarray(scales, dtype=np.float16)
            w_hat = np.asarray(awq.dequantize(qweight, qzeros, scales, o.group_size, cand.K, cand.N + extra),
                               np.float64)[:, :cand.N]
            if act is not None:
                w_hat = w_hat * act.astype(np.float64)[:, None]  # the effective weight: act_scale * dequantised
                a_in, how = self.apply_act_scale(g, cand, act)
                notes.append(how)
            rel = _rel_fro(w32, w_hat)
        new, info = self.emit_awq_tensors(g, cand, notes, qweight, qzeros, scales, group_size, rel, a_in)
        info["calibrated"] = act is not None
        info.update({k: v for k, v in search.items() if k != "search"})
        return new, info

    def from_checkpoint(self, cand: Linear, notes: list):
        """The checkpoint's tensors for cand (qweight, qzeros, scales, group size, rel. error vs the model's
        weight, A), or Skip when no module matches or its shape differs."""
        awq = _awq()
        mod, why = self.o.checkpoint.find(self.o.module_paths.get(cand.node.name, ""), cand.weight_name,
                                          cand.node.name)
        if mod is None:
            raise _ByDesign(f"not in the AWQ checkpoint: {why}")
        if (mod.K, mod.N) != (cand.K, cand.N):
            raise Skip(f"AWQ checkpoint module {mod.name} is [K={mod.K}, N={mod.N}], the weight [K={cand.K}, "
                        f"N={cand.N}]")
        qweight, qzeros = np.array(mod.qweight, np.int32), np.array(mod.qzeros, np.int32)
        scales = np.array(mod.scales, np.float16)
        w_hat = np.asarray(awq.dequantize(qweight, qzeros, scales, mod.group_size, cand.K, cand.N), np.float64)
        rel = _rel_fro(cand.w, w_hat)
        notes.append(f"from AWQ checkpoint module {mod.name} (group size {mod.group_size})")
        if not rel < 0.5:
            notes.append(f"the checkpoint's weight differs from the model's (relative error {rel:.3g}): is it the "
                         f"same model?")
        return qweight, qzeros, scales, mod.group_size, rel, cand.a

    def emit_awq_tensors(self, g: gs.Graph, cand: Linear, notes: list, qweight, qzeros, scales, group_size, rel, a_in):
        o = self.o
        if o.target == "ort" and group_size not in ORT_BLOCK_SIZES:
            raise Skip(f"group size {group_size} is not supported by onnxruntime's MatMulNBits "
                        f"(weights_target='ort'): one of {', '.join(map(str, ORT_BLOCK_SIZES))}")
        base = cand.weight_name
        base_name = cand.node.name or cand.out.name
        extra = int(np.shape(scales)[1]) - int(cand.N)  # zero columns AWQ's packing needed (N not a multiple of 8)
        attrs = dict(K=int(cand.K), N=int(cand.N))
        bias = cand.bias
        if bias is not None and extra and o.target == "lowbit":
            bias = np.concatenate([bias, np.zeros(extra, bias.dtype)])
        bias_t = (gs.Constant(self.names(f"{base_name}_bias"), bias.astype(cand.dtype))
                  if bias is not None else None)
        made = []
        if o.target == "lowbit":
            arrays = [qweight, qzeros, scales]
            consts = [self.const(f"{base}_qweight", qweight), self.const(f"{base}_qzeros", qzeros),
                      self.const(f"{base}_scales", scales)]
            inputs = [a_in] + consts + ([bias_t] if bias_t is not None else [])
            y = cand.out
            if extra:  # the op computes N + extra columns; a Slice gives the model its N
                attrs["N"] += extra
                y = gs.Variable(self.names(f"{cand.out.name}_padded"), dtype=cand.out.dtype)
                made.append(w4g.slice_columns(g, self.names, y, cand.out, int(cand.N),
                                              1 if cand.flat else rank(cand.a) - 1))
                notes.append(f"N={cand.N} padded to {cand.N + extra} zero columns for AWQ's packing; a Slice "
                             "takes the first N")
            new = gs.Node(op="MatMulAWQ", domain=domain.DOMAIN, name=self.names(f"{base_name}_awq"),
                          attrs=dict(group_size=int(group_size), **attrs), inputs=inputs, outputs=[y])
        else:
            b, sc, zp = nbits_layout(qweight, qzeros, scales, cand.K, group_size, cand.dtype, int(cand.N))
            arrays = [b, sc, zp]
            consts = [self.const(f"{base}_nbits", b), self.const(f"{base}_scales", sc),
                      self.const(f"{base}_zero_points", zp)]
            inputs = [a_in] + consts
            if bias_t is not None:
                inputs += [gs.Variable.empty(), bias_t]  # g_idx absent, bias (input 5)
            attrs.update(nbits_compact.accuracy_attrs(o.ort_accuracy, notes))
            new = gs.Node(op="MatMulNBits", domain=MS_DOMAIN, name=self.names(f"{base_name}_nbits"),
                          attrs=dict(bits=4, block_size=int(group_size), **attrs), inputs=inputs,
                          outputs=[cand.out])
        g.nodes.append(new)
        bytes_after = int(sum(a.nbytes for a in arrays))
        info = dict(target=o.target, op=new.op, new_node=new.name, group_size=group_size,
                    bytes_before=cand.bytes_before, bytes_after=bytes_after, rel_error=rel,
                    bias=cand.bias is not None, calibrated=False, new_nodes=[new.name] + [n.name for n in made])
        if o.target == "ort":
            info["accuracy_level"] = int(o.ort_accuracy or 0)
        return new, info

    # -- AWQ calibration -----------------------------------------------------------------------------------
    def calibrate(self):
        """Runs the graph once per calibration run (one dict, or NAME#K keys: one run per K); keeps every
        candidate's A as [rows, K] float32, the runs' rows in order."""
        g = self.root
        wanted, cands = [], []
        for node in g.nodes:
            cand = self.wanted(node)
            if cand is not None:
                cands.append(cand)
                if cand.a.name not in wanted:
                    wanted.append(cand.a.name)
        if not wanted:
            return
        tensors = g.tensors()
        rows = {}
        # several runs (NAME#K keys: the gru pass's format, utterances of different lengths): their rows in order
        for run in calibration.runs(self.o.calibration):
            feeds = calibration.check_feeds(g, run)
            got = calibration.collect(g, wanted, feeds, self.o.calibration_session,
                                      hint=" or run weights4 before fplut")
            for n in wanted:
                v = feeds.get(n) if n in feeds else got.get(n)
                if v is None and isinstance(tensors.get(n), gs.Constant):
                    v = np.asarray(tensors[n].values)
                if v is not None and np.ndim(v) >= 1:
                    rows.setdefault(n, []).append(np.asarray(v, np.float32).reshape(-1, np.shape(v)[-1]))
        for n, parts in rows.items():
            x = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if x.shape[0] > MAX_CALIBRATION_ROWS:
                x = x[np.linspace(0, x.shape[0] - 1, MAX_CALIBRATION_ROWS).astype(np.int64)]
            self.activations[n] = x
        if self.o.budget is not None:
            self.promote = mixed.plan(self, cands)
        if self.o.fmt == "awq":
            self.group_scales([c for c in cands if id(c.node) not in self.promote])

    def group_scales(self, cands_all: list):
        """Projections reading the same A (gate and up of a SwiGLU block, q/k/v) get one activation scale,
        searched on their weights side by side: A is scaled once (folded into its producer when those
        projections are its only readers, else one Mul), so they still share one input and the ffn pass can
        fuse gate and up."""
        awq = _awq()
        groups = {}
        for cand in cands_all:
            if cand.a.name in self.activations:
                groups.setdefault(cand.a.name, []).append(cand)
        for name, cands in groups.items():
            if len(cands) < 2 or len({c.K for c in cands}) != 1 or len({c.dtype for c in cands}) != 1:
                continue
            x = self.activations[name]
            fit, held = awq.split_holdout(x, self.o.awq_holdout) if self.o.awq_holdout else (x, None)
            w = np.concatenate([c.w for c in cands], axis=1)
            try:
                found = awq.search_scales(w4g.pad_columns(w, w4g.padding(w.shape[1])), fit, self.o.group_size,
                                          20, False, held)
            except ValueError:
                continue  # each projection then searches its own scale (and reports why that fails, if it does)
            act, s_w, why = _usable_act(found, cands[0].K, cands[0].dtype)
            if act is not None or not why:  # a usable scale, or RTN chosen: shared by the group
                self.shared_act[name] = (act, s_w, {id(c.node) for c in cands}, _search_details(found))
            for c in cands:
                c._w = None

    def apply_act_scale(self, g: gs.Graph, cand: Linear, act: np.ndarray):
        """Makes cand's A become A * act (per input channel): folded into A's producer when possible, else a
        Mul in front. Returns (the tensor to feed the quantised op, a note for the report)."""
        a = cand.a
        if a.name in self.applied:  # a shared scale, already applied for another projection of the group
            return self.applied[a.name]
        members = self.shared_act.get(a.name, (None, None, set()))[2]
        if id(cand.node) not in members:
            members = set()
        only_readers = (all(id(c) in members for c in a.outputs) if members else single_consumer(a) is cand.node)
        p = producer(a)
        result = None
        if p is not None and only_readers and not is_graph_output(g, a):
            found = fold_plan(p, g, act.astype(np.float64), cand.K)
            if found is not None:
                apply_plan(found[0], self.names)
                result = (a, f"AWQ activation scale folded into {found[1]}")
        if result is None:
            label = cand.node.name or a.name
            c = gs.Constant(self.names(f"{label}_awq_act_scale"), act.astype(cand.dtype))
            scaled = gs.Variable(self.names(f"{a.name}_awq_scaled"), dtype=cand.dtype, shape=a.shape)
            mul = gs.Node(op="Mul", name=self.names(f"{label}_awq_scale"), inputs=[a, c], outputs=[scaled])
            g.nodes.append(mul)
            result = (scaled, f"AWQ activation scale applied by Mul {mul.name!r} in front")
        if members:
            self.applied[a.name] = result
        return result
