"""rewrite --device cpu [--tune]: the CPU default table, and the per-pass timing that keeps only what measured faster
(decided here with injected costs, so the tests are deterministic; one real run checks the sessions path and the
CLI's report lines)."""
import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_lowbit import api, cpu_passes, tune
from onnx_lowbit.passes import resolve



def qkv_silu(d=32, seq="seq"):
    """x @ wq, x @ wk, x @ wv (siblings: merge), each through x * Sigmoid(x) (SiLU: fplut)."""
    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    for n in "qkv":
        inits.append(numpy_helper.from_array((rng.standard_normal((d, d)) * 0.1).astype(np.float32), f"w{n}"))
        nodes += [helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}0"], name=f"mm_{n}"),
                  helper.make_node("Sigmoid", [f"{n}0"], [f"{n}s"], name=f"sig_{n}"),
                  helper.make_node("Mul", [f"{n}0", f"{n}s"], [n], name=f"silu_{n}")]
        outs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, seq, d]))
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, d])], outs,
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def gelu_erf(d=32):
    """x @ w -> GELU spelled with Erf (0.5 y (1 + erf(y / sqrt 2)), as torch exports nn.GELU)."""
    rng = np.random.default_rng(1)
    c = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
         (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    c.append(numpy_helper.from_array((rng.standard_normal((d, d)) * 0.1).astype(np.float32), "w"))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Div", ["y", "sqrt2"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]), helper.make_node("Add", ["e", "one"], ["a"]),
             helper.make_node("Mul", ["y", "a"], ["m"]), helper.make_node("Mul", ["m", "half"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", d])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, "seq", d])], c)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def hardswish(spelled, d=32):
    """x [2, d] -> HardSwish, as paddle2onnx spells it (x * Clip(x + 3, 0, 6) / 6) or as the op."""
    if spelled:
        nodes = [helper.make_node("Add", ["x", "three"], ["a"]), helper.make_node("Clip", ["a", "zero", "six"], ["c"]),
                 helper.make_node("Mul", ["x", "c"], ["m"]), helper.make_node("Div", ["m", "six"], ["y"])]
        inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in (("three", 3), ("zero", 0), ("six", 6))]
    else:
        nodes, inits = [helper.make_node("HardSwish", ["x"], ["y"])], []
    g = helper.make_graph(nodes, "hs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, d])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def cost(model, table):
    """Made-up run time of a model: the sum of its nodes' costs (1 for ops not in ``table``)."""
    return float(sum(table.get(n.op_type, 1.0) for n in model.graph.node))


def measuring(table, calls=None):
    def measure(a, b):
        if calls is not None:
            calls.append((a, b))
        return cost(a, table), cost(b, table)
    return measure


def ops(model):
    return [n.op_type for n in model.graph.node]


def test_slower_pass_dropped_faster_pass_kept():
    m = qkv_silu()
    # FPLUT dearer than Sigmoid + Mul: fplut measures slower; one MatMul + Split cheaper than three MatMuls
    table = {"FPLUT": 5.0, "MatMul": 4.0, "Split": 1.0}
    calls = []
    out, report, res = tune.tuned_rewrite(m, resolve(["fplut", "merge"]), {}, measuring(table, calls))
    assert "FPLUT" not in ops(out) and ops(out).count("MatMul") == 1 and "Split" in ops(out)
    fp, mg = res.decisions
    assert (fp.pass_name, fp.kept, fp.rewrites, fp.before_ms, fp.after_ms) == ("fplut", False, 3, 18.0, 27.0)
    assert fp.why == "left out: 1.50x slower"
    assert (mg.pass_name, mg.kept, mg.before_ms, mg.after_ms) == ("merge", True, 18.0, 11.0)
    assert mg.why == "kept: 1.64x faster"
    # merge was timed on the model without fplut's rewrites; the whole model once more at the end
    assert calls[1][0] is m and calls[-1][0] is m and len(calls) == 3
    assert (res.original_ms, res.final_ms, res.kept(), res.dropped()) == (18.0, 11.0, ["merge"], ["fplut"])
    # the report: fplut's candidates are skipped, saying why; the merge rewritten
    fplut_entries = [e for e in report if e.pass_name == "fplut"]
    assert len(fplut_entries) == 3 and all(e.action == "skipped" for e in fplut_entries)
    assert "--tune: the fplut pass made the model 1.50x slower on this machine (18.000 -> 27.000 ms)" in \
        fplut_entries[0].reason
    assert len(report.rewritten("merge")) == 1
    d = report.to_dict()["tune"]
    assert d["kept"] == ["merge"] and d["dropped"] == ["fplut"] and d["speed"] == "1.64x faster"
    assert d["passes"][0]["speed"] == "1.50x slower"
    table_text = res.to_table()
    assert "fplut               3      18.000    27.000  left out: 1.50x slower" in table_text
    assert "merge               1      18.000    11.000  kept: 1.64x faster" in table_text
    assert "whole model: original 18.000 ms, rewritten 11.000 ms: 1.64x faster" in table_text


def test_asked_for_size_kept_though_slower_and_said_by_how_much():
    m = qkv_silu(d=64)
    table = {"MatMulNF4": 10.0, "MatMul": 4.0, "FPLUT": 5.0}
    asked = tune.asked_for_size(type("A", (), {"weights": "nf4", "passes": None})())
    assert asked == {"weights4": "--weights nf4"}
    out, report, res = tune.tuned_rewrite(m, resolve(["fplut", "weights4"]), {"weights": "nf4"},
                                          measuring(table), asked)
    assert ops(out).count("MatMulNF4") == 3 and "FPLUT" not in ops(out)
    w = res.decisions[1]
    assert w.kept and w.asked == "--weights nf4"
    assert w.why == "kept as asked (--weights nf4, for size) though 2.00x slower"   # 18 -> 36
    assert res.final_ms == 36.0 and not res.fallback        # asked for: written though slower as a whole
    assert len(report.rewritten("weights4")) == 3


def test_asked_for_size_one_reading_for_the_cli_and_the_api():
    """The CLI's arguments and the API's options name the same size rewrites, each in its own spelling; a size
    pass named in the selection counts as asked for, other passes do not."""
    import argparse
    cli = argparse.Namespace(weights="awq", passes="gru,ffn", gru_bits=None, gru_weight_bits=16, awq_checkpoint=None)
    assert tune.asked_for_size(cli) == {"weights4": "--weights awq", "gru": "--gru-weight-bits 16"}
    assert tune.asked_for_size({"weights": "awq", "gru_weight_bits": 16}, ["gru", "ffn"], cli=False) == \
        {"weights4": "weights='awq'", "gru": "gru_weight_bits=16"}
    assert tune.asked_for_size({"awq_checkpoint": "ckpt"}, "ffn,gru", cli=False) == \
        {"weights4": "awq_checkpoint=...", "gru": "passes=['gru']"}
    assert tune.asked_for_size({}, None, cli=False) == {}
    assert tune.asked_for_size(argparse.Namespace(passes="weights4", weights=None)) == \
        {"weights4": "--passes weights4"}


def test_whole_model_not_faster_falls_back_to_the_original():
    m = qkv_silu()
    table = {"MatMul": 4.0, "Split": 1.0}

    def measure(a, b):   # each step says merge is faster, the final comparison (noise) says it is not
        if a is m and len(b.graph.node) < len(m.graph.node) and measure.steps:
            return 10.0, 10.5
        measure.steps += 1
        return cost(a, table), cost(b, table)
    measure.steps = 0
    out, report, res = tune.tuned_rewrite(m, resolve(["merge"]), {}, measure)
    assert ops(out) == ops(m)
    assert res.decisions[0].kept is False and "undone (whole model not faster)" in res.decisions[0].why
    assert res.fallback.startswith("the rewritten model measured 1.05x slower than the original")
    assert not report.rewritten() and "measured no faster than the original" in report.skipped("merge")[0].reason


def test_passes_that_change_nothing_are_not_timed():
    calls = []
    out, _, res = tune.tuned_rewrite(qkv_silu(), resolve(["ffn", "gru"]), {}, measuring({}, calls))
    assert not calls and res.final_ms is None
    assert [d.why for d in res.decisions] == ["nothing rewritten: not timed", "not run (needs --calibration DATA.npz)"]
    assert "no rewrite kept, the output is the original graph" in res.to_table()


def test_alternate_takes_medians_of_alternating_runs():
    now, order = [0.0], []

    def clock():
        return now[0]

    def run(name, seconds):
        def f():
            order.append(name)
            now[0] += seconds
        return f
    a_ms, b_ms = tune.alternate(run("a", 0.002), run("b", 0.001), runs=10, warmup=1, clock=clock)
    assert (round(a_ms, 6), round(b_ms, 6)) == (2.0, 1.0)
    # warm-up a b; 2 rounds of 5: per round and model one untimed call, then 5 timed ones; A B, then B A
    assert order == ["a", "b"] + ["a"] * 6 + ["b"] * 6 + ["b"] * 6 + ["a"] * 6


def test_rounds_settle_before_each_turn():
    """rounds.timed_rounds pauses (``settle``; default SETTLE_S of sleep) before each model's turn in a round, so that
    the model timed before it has its intra-op threads idle again (without it the first of two sessions of one model
    measured 1.3x slower: onnx_lowbit/rounds.py)."""
    from onnx_lowbit import rounds
    order = []
    runners = [lambda: order.append("a"), lambda: order.append("b")]
    rounds.timed_rounds(runners, 10, warmup=1, settle=lambda: order.append("settle"))
    turn = lambda m: ["settle"] + [m] * 6  # noqa: E731 - one untimed call, then 5 timed ones
    assert order == ["a", "b"] + turn("a") + turn("b") + turn("b") + turn("a")
    assert rounds.SETTLE_S >= 0.04   # onnxruntime's intra-op threads spun 30-35 ms after a run (rounds' doc)


def test_cpu_defaults_table_and_selection(capsys):
    sel = resolve(None)
    kept = cpu_passes.cpu_selection(sel, explicit=False)
    assert [p.name for p in kept] == [n for n in [p.name for p in sel] if cpu_passes.CPU_DEFAULTS[n][0]]
    assert "fplut" in [p.name for p in kept] and "ffn" not in [p.name for p in kept]
    assert "--device cpu: left out weights4, ffn" in capsys.readouterr().err
    assert cpu_passes.cpu_selection(resolve(["fplut"]), explicit=True) == resolve(["fplut"])
    assert [p.name for p in cpu_passes.cpu_selection(sel, False, keep={"weights4": "w"}, quiet=True)] == \
        [p.name for p in sel if cpu_passes.cpu_default(p.name) or p.name == "weights4"]
    out, rep = api.rewrite(qkv_silu(), device="cpu")      # SiLU: not one of the CPU's FPLUT functions
    assert "FPLUT" not in ops(out) and any("not enabled" in e.reason for e in rep.skipped("fplut"))
    out, _ = api.rewrite(gelu_erf(), device="cpu")         # GELU: FPLUT beats onnxruntime's Gelu on the CPU
    assert "FPLUT" in ops(out)
    out, _ = api.rewrite(hardswish(spelled=True), device="cpu")     # 4 onnxruntime ops: the table is faster
    assert ops(out) == ["FPLUT"]
    out, rep = api.rewrite(hardswish(spelled=False), device="cpu")  # onnxruntime's HardSwish op: faster, kept
    assert ops(out) == ["HardSwish"] and any("spelled out" in e.reason for e in rep.skipped("fplut"))
    out, _ = api.rewrite(qkv_silu(), ["fplut"], device="cpu")   # named: every function
    assert "FPLUT" in ops(out)
    out, _ = api.rewrite(qkv_silu(d=64), device="cpu", weights="nf4")
    assert "MatMulNF4" in ops(out) and "FPLUT" not in ops(out)


def test_no_device_on_a_cpu_only_onnxruntime_says_how_to_rewrite_for_the_cpu(capsys, monkeypatch):
    """No --device on an onnxruntime without CUDA: every default pass still runs (as for a GPU) and stderr names
    --device cpu / --tune; not with --device, --passes, --target ort, nor where onnxruntime has CUDA."""
    import argparse
    sel = resolve(None)

    def args(**kw):
        return argparse.Namespace(**{"device": None, "passes": None, "target": None, "tune": False, **kw})
    monkeypatch.setattr(cpu_passes, "ort_has_cuda", lambda: False)
    assert cpu_passes.device_selection(args(), sel) == list(sel)
    assert cpu_passes.GPU_DEFAULT_HINT in capsys.readouterr().err
    for kw in ({"device": "cuda"}, {"passes": ["fplut"]}, {"target": "ort"}):
        cpu_passes.device_selection(args(**kw), sel)
        assert "no --device" not in capsys.readouterr().err, kw
    cpu_passes.device_selection(args(device="cpu"), sel)
    assert "no --device" not in capsys.readouterr().err
    monkeypatch.setattr(cpu_passes, "ort_has_cuda", lambda: True)
    cpu_passes.device_selection(args(), sel)
    assert "no --device" not in capsys.readouterr().err


from helpers import cli  # noqa: E402  (the CLI in a fresh process)


def test_cli_tune_real_sessions_report_lines(tmp_path):
    src, dst, rep = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(qkv_silu(), src)
    rc, out, err = cli("rewrite", str(src), str(dst), "--device", "cpu", "--tune", "--tune-runs", "3",
                       "--dim", "seq=4", "--report-json", str(rep))
    assert rc == 0, err
    assert "tune: each pass timed against the model without it, medians of 3 runs in alternating rounds per model in " \
           "onnxruntime CPU sessions, on made-up inputs" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in ("fplut", "merge")}
    for name, n in (("fplut", 3), ("merge", 1)):     # timed for real: the decision follows the figures
        _, rewrites, before, after, *why = lines[name].split()
        assert int(rewrites) == n and float(before) > 0 and float(after) > 0
        if float(after) != float(before):   # equal as printed (rounded): either decision follows the exact medians
            assert " ".join(why).startswith("kept" if float(after) < float(before) else "left out")
        else:
            assert " ".join(why).startswith(("kept", "left out"))
    d = json.loads(rep.read_text())["tune"]
    assert {p["pass_name"] for p in d["passes"]} >= {"fplut", "merge"} and d["runs"] == 3
    kept = onnx.load(dst)
    assert ("FPLUT" in ops(kept)) == ("fplut" in d["kept"]) and ("Split" in ops(kept)) == ("merge" in d["kept"])


def test_cli_device_cpu_defaults_and_bad_flags(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(qkv_silu(), src)
    rc, out, err = cli("rewrite", str(src), str(tmp_path / "o.onnx"), "--device", "cpu")
    assert rc == 0 and "--device cpu: left out weights4, ffn" in err
    assert "FPLUT" not in ops(onnx.load(tmp_path / "o.onnx"))
    rc, out, err = cli("rewrite", str(src), str(tmp_path / "p.onnx"), "--device", "cpu", "--passes", "fplut")
    assert rc == 0 and "FPLUT" in ops(onnx.load(tmp_path / "p.onnx"))
    for args, needle in ((["--tune"], "--tune measures in onnxruntime CPU sessions: give --device cpu"),
                         (["--device", "cpu", "--tune", "--tune-runs", "0"], "--tune-runs must be >= 1"),
                         (["--device", "cpu", "--tune-runs", "3"], "--tune-runs needs --tune"),
                         (["--device", "cpu", "--tune", "--dim", "nope=3"], "--dim nope")):
        rc, _, err = cli("rewrite", str(src), str(tmp_path / "q.onnx"), *args)
        assert rc == 2 and needle in err and "Traceback" not in err, err
        assert not (tmp_path / "q.onnx").exists()


def test_api_tune_real_sessions():
    out, report = api.rewrite(qkv_silu(), device="cpu", tune=True, tune_runs=2, dims={"seq": 4})
    d = report.to_dict()["tune"]
    assert d["runs"] == 2 and d["inputs"].startswith("made-up inputs") and "seq=4" in d["inputs"]
    fplut = next(p for p in d["passes"] if p["pass_name"] == "fplut")
    assert fplut["rewrites"] == 3 and fplut["before_ms"] > 0 and fplut["after_ms"] > 0
    assert ("FPLUT" in ops(out)) == ("fplut" in d["kept"])
    x = {"x": np.ones((1, 5, 32), np.float32)}
    _, report = api.rewrite(qkv_silu(), device="cpu", tune=True, tune_runs=2, feeds=x)
    assert report.tune.inputs == "the given feeds"


def test_weights4_on_the_cpu_default_target_times_the_other_target_too():
    from onnx_lowbit.cpu_passes import cpu_weights_options
    m = qkv_silu(d=64)
    options, _ = cpu_weights_options({"weights": "awq"})      # --device cpu's default: MatMulNBits, level 4
    for table, kept_op in (({"MatMulNBits": 1.0, "MatMulAWQ": 5.0}, "MatMulNBits"),
                           ({"MatMulNBits": 5.0, "MatMulAWQ": 1.0}, "MatMulAWQ")):
        calls = []
        out, report, res = tune.tuned_rewrite(m, resolve(["weights4"]), options, measuring(table, calls),
                                              asked={"weights4": "--weights awq"})
        assert kept_op in ops(out) and ({"MatMulNBits", "MatMulAWQ"} - {kept_op}).isdisjoint(ops(out))
        d = res.decisions[0]
        assert set(d.targets) == {"ort lvl4", "lowbit"} and d.targets["ort lvl4"] == cost(calls[0][0], table)
        winner = "ort lvl4" if kept_op == "MatMulNBits" else "lowbit"
        assert d.why.startswith(f"ort lvl4 {d.targets['ort lvl4']:.3f} ms, lowbit {d.targets['lowbit']:.3f} ms: "
                                f"{winner}; ")
        assert report.to_dict()["tune"]["passes"][0]["targets"] == d.targets
    # the user's own target, or a calibrated AWQ (its search would run twice): one target, not compared
    for opts in ({"weights": "awq", "weights_target": "ort"}, dict(options, calibration={"x": np.ones((1, 4, 64))})):
        assert tune.other_target(opts) is None
    _, _, res = tune.tuned_rewrite(m, resolve(["weights4"]), {"weights": "awq", "weights_target": "ort"},
                                   measuring({}), asked={"weights4": "--weights awq"})
    assert res.decisions[0].targets is None


def test_device_cpu_keeps_gru_when_gru_bits_ask(capsys):
    """--device cpu leaves gru out by default, but --gru-bits / --gru-weight-bits ask for it (for its size, as
    --weights asks for weights4): then it stays, and stderr does not list it as left out."""
    import argparse
    sel = resolve(None)
    assert "gru" in [p.name for p in sel] and not cpu_passes.cpu_default("gru")

    def args(**kw):
        return argparse.Namespace(**{"device": "cpu", "passes": None, "target": None, "tune": False, "weights": None,
                                     "awq_checkpoint": None, "gru_bits": None, "gru_weight_bits": None, **kw})
    assert "gru" not in [p.name for p in cpu_passes.device_selection(args(), sel)]
    assert "gru" in capsys.readouterr().err
    for kw in ({"gru_bits": 16}, {"gru_bits": 8}, {"gru_weight_bits": 8}):
        assert "gru" in [p.name for p in cpu_passes.device_selection(args(**kw), sel)], kw
        err = capsys.readouterr().err
        assert "left out" in err and "gru" not in err, (kw, err)
