"""``onnx-lowbit bench``: both sample models rewritten and timed side by side on the CPU (table, PNG, JSON, the
figures it reports checked against independent computations), and every bad input gives exit 2 and one line."""
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_lowbit import api, bench, cli, model_io, passes, rounds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join(ROOT, "samples", "gpt2_mlp.onnx")
YOLO = os.path.join(ROOT, "samples", "tiny_yolo.onnx")
FAST = ["--warmup", "1", "--runs", "3"]


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    out = {}
    for src, name, opts in ((GPT2, "gpt2_nf4.onnx", dict(passes=["fplut", "weights4"], weights="nf4")),
                            (YOLO, "yolo_fplut.onnx", dict(passes=["fplut"]))):
        m, _ = passes.run_passes(model_io.load(src), **opts)
        model_io.save(m, str(d / name))
        out[name] = str(d / name)
    return out


def _main(capsys, *args):
    rc = cli.main(["bench", *args])
    o, e = capsys.readouterr()
    return rc, o, e


def _bad(capsys, needle, *args):
    rc, _, err = _main(capsys, *args)
    assert rc == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("onnx-lowbit: error:") and needle in err, err
    return err


def _initializer_bytes(path):
    """Initializers and Constant node tensors, as loaded arrays (external data included)."""
    m = onnx.load(path)
    consts = [a.t for n in m.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    return sum(numpy_helper.to_array(t).nbytes for t in list(m.graph.initializer) + consts)


def test_bench_gpt2_nf4_table_png_json(rewritten, tmp_path, capsys):
    out = tmp_path / "out"
    rc, o, e = _main(capsys, GPT2, rewritten["gpt2_nf4.onnx"], *FAST, "--dim", "seq=8", "--out", str(out))
    assert rc == 0, e
    for field in ("latency median (ms)", "latency p90 (ms)", "peak memory", "weight bytes", "max abs diff",
                  "max rel diff", "| y |", "x float32[1, 8, 128]", "peak RSS delta"):
        assert field in o, field
    png = out / "bench-cpu.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    d = json.loads((out / "bench-cpu.json").read_text())
    orig, rew = d["models"]
    assert len(orig["latency_ms"]) == 3 and all(t > 0 for t in orig["latency_ms"] + rew["latency_ms"])
    assert orig["median_ms"] == pytest.approx(float(np.median(orig["latency_ms"])))
    assert orig["p90_ms"] <= max(orig["latency_ms"]) and orig["p90_ms"] >= orig["median_ms"]
    # weight bytes: the initializers' sizes, computed independently from the loaded arrays
    assert orig["weight_bytes"] == _initializer_bytes(GPT2)
    assert rew["weight_bytes"] == _initializer_bytes(rewritten["gpt2_nf4.onnx"])
    assert rew["weight_bytes"] < 0.2 * orig["weight_bytes"]
    assert orig["peak_memory_bytes"] > 0 and rew["peak_memory_bytes"] > 0
    assert f"{orig['weight_bytes']:,}" in o
    # ratios in words, one direction: the rewritten model against the original
    rows = {ln.split("|")[1].strip(): ln.split("|")[4].strip() for ln in o.splitlines() if ln.count("|") == 5}
    assert rows["weight bytes"] == f"{orig['weight_bytes'] / rew['weight_bytes']:.2f}x smaller"
    r = orig["median_ms"] / rew["median_ms"]
    assert rows["latency median (ms)"] == (f"{r:.2f}x faster" if r > 1 else f"{1 / r:.2f}x slower")
    assert "of gpt2_nf4.onnx compiled by one untimed run each, so no model is charged" in o
    # agreement: recomputed here from plain sessions on the same (seeded) inputs
    feeds = bench.random_inputs(bench._signature(onnx.load(GPT2)), {"seq": 8})
    a = ort.InferenceSession(GPT2, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    b = api.InferenceSession(rewritten["gpt2_nf4.onnx"], providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    diff = np.abs(a.astype(np.float64) - b)
    (agr,) = d["agreement"]
    assert agr["max_abs"] == pytest.approx(diff.max(), rel=1e-6)
    assert agr["max_rel"] == pytest.approx(diff.max() / np.abs(a).max(), rel=1e-6)
    assert 0 < agr["max_rel"] < 0.1   # NF4 weights: a few percent


def test_bench_identical_models_agree_exactly_and_inputs_file(rewritten, tmp_path):
    path = rewritten["yolo_fplut.onnx"]
    x = np.random.default_rng(3).standard_normal((1, 3, 64, 64)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    res = bench.run(path, path, session_factory=api.InferenceSession, warmup=0, runs=2,
                    inputs=str(tmp_path / "in.npz"), out_dir=None)
    assert [(a.max_abs, a.max_rel) for a in res.agreement] == [(0.0, 0.0)]
    assert res.inputs == {"x": [[1, 3, 64, 64], "float32"]}
    assert not list(tmp_path.glob("bench-*"))
    # FPLUT vs the float original on those inputs: table-lookup accuracy
    res = bench.run(YOLO, path, session_factory=api.InferenceSession, warmup=0, runs=2,
                    inputs=str(tmp_path / "in.npz"), out_dir=str(tmp_path))
    assert 0 < res.agreement[0].max_rel < 1e-2
    assert (tmp_path / "bench-cpu.png").exists()


def test_bench_several_rewritten_models_side_by_side(tmp_path, capsys):
    """ORIGINAL against two rewritten models in one run (here NF4 and FP4 weights of the GPT-2 MLP): one column
    pair per model in the table, every model in the JSON, one agreement row per model and output, each equal to
    the agreement of a two-model run on the same inputs."""
    paths = []
    for wt in ("nf4", "fp4"):
        m, _ = passes.run_passes(model_io.load(GPT2), passes=["weights4"], weights=wt)
        paths.append(str(tmp_path / f"gpt2_{wt}.onnx"))
        model_io.save(m, paths[-1])
    out = tmp_path / "out"
    rc, o, e = _main(capsys, GPT2, *paths, *FAST, "--dim", "seq=8", "--out", str(out))
    assert rc == 0, e
    assert "| | original | rewritten 1 | rewritten 1 vs original | rewritten 2 | rewritten 2 vs original |" in o
    assert "gpt2_nf4.onnx" in o and "gpt2_fp4.onnx" in o
    d = json.loads((out / "bench-cpu.json").read_text())
    assert [m["label"] for m in d["models"]] == ["original", "rewritten 1", "rewritten 2"]
    assert [(a["model"], a["output"]) for a in d["agreement"]] == [("rewritten 1", "y"), ("rewritten 2", "y")]
    assert (out / "bench-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for path, agr in zip(paths, d["agreement"]):
        single = bench.run(GPT2, path, session_factory=api.InferenceSession, warmup=0, runs=1, dims={"seq": 8},
                           out_dir=None)
        assert single.agreement[0].max_abs == agr["max_abs"] and single.agreement[0].model == "rewritten"
    assert d["agreement"][0]["max_abs"] != d["agreement"][1]["max_abs"]     # NF4 and FP4 round differently
    assert d["models"][1]["weight_bytes"] == d["models"][2]["weight_bytes"]  # same packing, same bytes


def test_weight_bytes_external_data_and_constants(tmp_path):
    m = model_io.load(GPT2)
    model_io.save(m, str(tmp_path / "ext.onnx"), external_data=True)
    ext = onnx.load(str(tmp_path / "ext.onnx"), load_external_data=False)
    assert model_io.uses_external_data(ext)
    assert bench.weight_bytes(ext) == bench.weight_bytes(m) == _initializer_bytes(GPT2)
    c = onnx.helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.zeros((3, 5), np.float16)))
    m.graph.node.insert(0, c)
    assert bench.weight_bytes(m) == _initializer_bytes(GPT2) + 30


def test_symbolic_dims():
    sig = {"ids": (np.dtype(np.int64), ["batch_size", "seq", 4, None])}
    values = bench.resolve_dims([sig], {})
    assert values == {"batch_size": 1, "seq": bench.OTHER_DIM, "ids:3": 16}
    assert bench.random_inputs(sig, values)["ids"].shape == (1, 16, 4, 16)
    assert bench.resolve_dims([sig], bench.parse_dims(["seq=5"]))["seq"] == 5
    with pytest.raises(bench.LowbitError, match="symbolic dims: batch_size, seq; unnamed ones \\('\\?'\\) by "
                                                "INPUT:AXIS: ids:3"):
        bench.resolve_dims([sig], {"past": 3})
    # the unnamed axis is set by INPUT:AXIS; other axes of the input are named as what they are
    values = bench.resolve_dims([sig], bench.parse_dims(["ids:3=7"]))
    assert values["ids:3"] == 7 and bench.random_inputs(sig, values)["ids"].shape == (1, 16, 4, 7)
    with pytest.raises(bench.LowbitError, match="axis 1 of input 'ids' is the symbolic dim 'seq': set it with --dim "
                                                "seq=VALUE"):
        bench.resolve_dims([sig], {"ids:1": 3})
    with pytest.raises(bench.LowbitError, match="axis 2 of input 'ids' is fixed at 4"):
        bench.resolve_dims([sig], {"ids:2": 3})
    with pytest.raises(bench.LowbitError, match="input 'ids' has 4 axes"):
        bench.resolve_dims([sig], {"ids:9": 3})


def test_cuda_graph_without_gpu(rewritten, tmp_path, capsys):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    err = _bad(capsys, "--cuda-graph needs onnxruntime-gpu", GPT2, rewritten["gpt2_nf4.onnx"], "--cuda-graph",
               "--out", str(tmp_path))
    assert "CPUExecutionProvider" in err
    _bad(capsys, "--provider cuda needs onnxruntime-gpu", GPT2, rewritten["gpt2_nf4.onnx"], "--provider", "cuda",
         "--out", str(tmp_path))
    _bad(capsys, "--cuda-graph needs --provider cuda", GPT2, rewritten["gpt2_nf4.onnx"], "--cuda-graph",
         "--provider", "cpu", "--out", str(tmp_path))
    assert not list(tmp_path.iterdir())


def test_bad_input(rewritten, tmp_path, capsys):
    r = rewritten["gpt2_nf4.onnx"]
    o = ["--out", str(tmp_path / "o")]
    _bad(capsys, "nope.onnx: no such file", str(tmp_path / "nope.onnx"), r, *o)
    _bad(capsys, "nope2.onnx: no such file", GPT2, str(tmp_path / "nope2.onnx"), *o)
    _bad(capsys, "is a directory", GPT2, str(tmp_path), *o)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model" * 20)
    _bad(capsys, "not an ONNX model", GPT2, str(junk), *o)
    (tmp_path / "file").write_text("x")
    _bad(capsys, "exists and is not a directory", GPT2, r, "--out", str(tmp_path / "file"))
    _bad(capsys, "expected NAME=VALUE", GPT2, r, "--dim", "seq", *o)
    _bad(capsys, "no input has such a symbolic dimension", GPT2, r, "--dim", "past=3", *o)
    _bad(capsys, "--runs must be >= 1", GPT2, r, "--runs", "0", *o)
    _bad(capsys, "invalid choice", GPT2, r, "--provider", "tpu", *o)
    _bad(capsys, "(--inputs)", GPT2, r, "--inputs", str(tmp_path / "missing.npz"), *o)
    np.savez(tmp_path / "wrong.npz", z=np.zeros(3, np.float32))
    _bad(capsys, "no array for input 'x'", GPT2, r, "--inputs", str(tmp_path / "wrong.npz"), *o)
    np.savez(tmp_path / "shape.npz", x=np.zeros((1, 4, 7), np.float32))
    _bad(capsys, "has shape [1, 4, 7]", GPT2, r, "--inputs", str(tmp_path / "shape.npz"), *o)
    _bad(capsys, "differs between the models", GPT2, YOLO, *o)
    _bad(capsys, "nope3.onnx: no such file", GPT2, r, str(tmp_path / "nope3.onnx"), *o)   # the third model
    _bad(capsys, "differs between the models", GPT2, r, YOLO, *o)
    assert not (tmp_path / "o").exists()      # no --out directory is left behind by a failed run


def test_without_matplotlib(rewritten, tmp_path, capsys, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    rc, o, e = _main(capsys, GPT2, rewritten["gpt2_nf4.onnx"], *FAST, "--out", str(tmp_path))
    assert rc == 0 and "| latency median (ms) |" in o and "matplotlib is not installed" in e
    assert [p.name for p in tmp_path.iterdir()] == ["bench-cpu.json"]


def test_library_load_not_charged_to_the_first_model(rewritten, tmp_path):
    """In a fresh process, the same rewritten model listed twice gets the same peak memory: the library's one-time
    load (numba, our kernels' compilation, the shim: ~100 MiB on the first FPLUT session) is paid before measuring,
    not by whichever model comes first."""
    import subprocess
    import sys
    path = rewritten["yolo_fplut.onnx"]
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", "bench", YOLO, path, path, "--warmup", "1", "--runs",
                        "2", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert p.returncode == 0, p.stderr
    first, second = [m["peak_memory_bytes"] for m in json.loads((out / "bench-cpu.json").read_text())["models"][1:]]
    assert abs(first - second) < 16 * 2 ** 20 + 0.5 * min(first, second), (first, second)


def _recording_sessions(monkeypatch):
    """bench._make_session wrapped: every run of every session appends its model's file name to the list returned."""
    calls = []
    make = bench._make_session

    class Rec:
        def __init__(self, sess, name):
            self.sess, self.name = sess, name

        def run(self, *a, **k):
            calls.append(self.name)
            return self.sess.run(*a, **k)

        def __getattr__(self, attr):
            return getattr(self.sess, attr)
    monkeypatch.setattr(bench, "_make_session",
                        lambda path, *a: Rec(make(path, *a), os.path.basename(os.fspath(path))))
    return calls


def test_cpu_runs_alternate_between_the_models(rewritten, monkeypatch):
    """CPU: after each session's warm-up, rounds: per model one untimed run and its timed runs in a row, round r
    starting with model r mod n (a drift reaches every model alike, each in each place); each model gets --runs
    timings, the outputs compared are real; the method line says so."""
    calls = _recording_sessions(monkeypatch)
    res = bench.run(YOLO, [rewritten["yolo_fplut.onnx"], rewritten["yolo_fplut.onnx"]],
                    session_factory=api.InferenceSession, warmup=2, runs=11, out_dir=None)
    assert rounds.rounds_of(11) == [6, 5] and rounds.rounds_of(3) == [3] and len(rounds.rounds_of(500)) == 10
    a, b = "tiny_yolo.onnx", "yolo_fplut.onnx"
    timed = calls[-(3 * 13):]                       # 2 rounds: per model 1 untimed + its timed runs
    assert timed == [a] * 7 + [b] * 7 + [b] * 7 + [b] * 6 + [b] * 6 + [a] * 6     # A B C, then B C A
    assert calls[:-(3 * 13)].count(a) == 2          # its warm-up runs, before any round
    assert [len(m.latency_ms) for m in res.models] == [11, 11, 11] and all(m.peak_memory_bytes for m in res.models)
    assert res.timing_method.startswith("rounds alternating between the models (2 rounds")
    assert all(a.max_rel < 1e-2 for a in res.agreement)
    assert "\ntiming: rounds alternating between the models" in bench.table(res)


def test_cpu_models_too_large_together_are_timed_in_turn(rewritten, monkeypatch):
    calls = _recording_sessions(monkeypatch)
    monkeypatch.setattr(bench, "ALTERNATE_MAX_BYTES", 0)
    res = bench.run(YOLO, rewritten["yolo_fplut.onnx"], session_factory=api.InferenceSession, warmup=1, runs=3,
                    out_dir=None)
    assert calls[-8:] == ["tiny_yolo.onnx"] * 4 + ["yolo_fplut.onnx"] * 4
    assert res.timing_method.startswith("each model timed in turn (the models' weights exceed")
