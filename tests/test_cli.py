"""The command line: bad input gives one line and exit 2 with no traceback and no OUT file; the good paths work."""
import os

import onnx
from onnx import TensorProto, helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "samples", "tiny_yolo.onnx")


from helpers import cli  # noqa: E402  (the CLI in a fresh process)


def assert_bad(rc, err, needle):
    assert rc == 2, err
    assert "Traceback" not in err
    assert needle in err
    assert err.strip().splitlines()[-1].startswith("onnx-lowbit: error:")


def test_missing_file(tmp_path):
    rc, _, err = cli("rewrite", str(tmp_path / "nope.onnx"), str(tmp_path / "out.onnx"))
    assert_bad(rc, err, "no such file")
    assert not (tmp_path / "out.onnx").exists()


def test_not_onnx_and_truncated(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not a model\x00\xff" * 10)
    rc, _, err = cli("rewrite", str(junk), str(tmp_path / "o.onnx"))
    assert_bad(rc, err, "not an ONNX model")
    data = open(SAMPLE, "rb").read()
    trunc = tmp_path / "trunc.onnx"
    trunc.write_bytes(data[: len(data) // 2])
    rc, _, err = cli("rewrite", str(trunc), str(tmp_path / "o.onnx"))
    assert_bad(rc, err, "trunc.onnx")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    rc, _, err = cli("inspect", str(empty))
    assert_bad(rc, err, "empty")
    assert not (tmp_path / "o.onnx").exists()


def test_out_equal_in(tmp_path):
    rc, _, err = cli("rewrite", SAMPLE, SAMPLE)
    assert_bad(rc, err, "OUT must differ from IN")


def test_unknown_pass(tmp_path):
    rc, _, err = cli("rewrite", SAMPLE, str(tmp_path / "o.onnx"), "--passes", "fplut,bogus")
    assert_bad(rc, err, "bogus")
    assert "fplut" in err


def test_unsupported_opset(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 5)], ir_version=3)
    p = tmp_path / "old.onnx"
    onnx.save(m, str(p))
    rc, _, err = cli("rewrite", str(p), str(tmp_path / "o.onnx"))
    assert_bad(rc, err, "opset 5")


def test_missing_out_dir(tmp_path):
    rc, _, err = cli("rewrite", SAMPLE, str(tmp_path / "no" / "such" / "o.onnx"))
    assert_bad(rc, err, "does not exist")


def test_argparse_errors_are_one_line():
    rc, _, err = cli("rewrite", SAMPLE)
    assert rc == 2 and "Traceback" not in err


def test_rewrite_verify_report(tmp_path):
    out = tmp_path / "y.onnx"
    rc, so, err = cli("rewrite", SAMPLE, str(out), "--verify", "--report", "--report-json", str(tmp_path / "r.json"))
    assert rc == 0, err
    assert out.exists() and "rewritten" in so and "ok" in so
    m = onnx.load(str(out))
    assert sum(n.op_type == "FPLUT" for n in m.graph.node) > 0
    assert [i.name for i in m.graph.input] == [i.name for i in onnx.load(SAMPLE).graph.input]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".onnx-lowbit-")]  # no temp leftovers


def test_verify_failure_writes_nothing(tmp_path):
    out = tmp_path / "y.onnx"
    rc, so, err = cli("rewrite", SAMPLE, str(out), "--verify", "--tolerance", "1e-9")
    assert rc == 1 and "FAIL" in so and not out.exists()


def test_inspect_and_lut(tmp_path):
    rc, so, err = cli("inspect", SAMPLE)
    assert rc == 0 and "silu" in so
    out = tmp_path / "y.onnx"
    assert cli("rewrite", SAMPLE, str(out))[0] == 0
    rc, so, _ = cli("inspect", str(out))
    assert rc == 0 and "FPLUT" in so and "onnx_lowbit" in so
    rc, so, _ = cli("lut", "list")
    assert rc == 0 and "silu" in so
    png = tmp_path / "silu.png"
    rc, so, err = cli("lut", "plot", "silu", "-o", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG"
    rc, _, err = cli("lut", "plot", "nosuchfn")
    assert_bad(rc, err, "nosuchfn")

# the demo: tests/test_newcomer.py (test_demo_says_what_it_does)


def test_target_ort_runs_on_stock_onnxruntime(tmp_path):
    """--target ort: the default passes that emit our ops (fplut: the sample's GELU) are left out, said on stderr,
    so the model runs in a plain onnxruntime session; naming fplut in --passes still runs it."""
    import numpy as np
    import onnxruntime as ort
    src, out = os.path.join(ROOT, "samples", "gpt2_mlp.onnx"), tmp_path / "g.ort.onnx"
    rc, so, err = cli("rewrite", src, str(out), "--weights", "nf4", "--target", "ort")
    assert rc == 0, err
    assert "--target ort: left out fplut" in err and "by weights4, merge" in so
    model = onnx.load(str(out))
    assert {n.domain for n in model.graph.node} <= {"", "com.microsoft"}
    assert "MatMulBnb4" in [n.op_type for n in model.graph.node]
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.random.default_rng(0).standard_normal(
        [d if isinstance(d, int) else 2 for d in i.shape]).astype(np.float32) for i in sess.get_inputs()}
    assert all(np.isfinite(o).all() for o in sess.run(None, feeds))
    rc, so, err = cli("rewrite", src, str(tmp_path / "g2.onnx"), "--weights", "nf4", "--target", "ort",
                      "--passes", "fplut,weights4")
    assert rc == 0 and "left out" not in err
    assert "onnx_lowbit" in {n.domain for n in onnx.load(str(tmp_path / "g2.onnx")).graph.node}


def test_genai_default_passes_follow_the_provider(tmp_path):
    """`onnx-lowbit genai` without --passes: on CUDA (--provider cuda, or a folder whose genai_config.json names the
    cuda provider) CUDA_PASSES, on the CPU CPU_PASSES (the int4 products only), neither known: DEFAULT_PASSES."""
    import json
    from onnx_lowbit import genai_config
    for prov, opts in (("cuda", [{"cuda": {"enable_cuda_graph": "0"}}]), ("cpu", [])):
        d = tmp_path / prov
        d.mkdir()
        (d / "genai_config.json").write_text(json.dumps(
            {"model": {"decoder": {"filename": "model.onnx", "session_options": {"provider_options": opts}}}}))
        want = genai_config.CUDA_PASSES if prov == "cuda" else genai_config.CPU_PASSES
        assert genai_config.default_passes(None, d) == want
        assert genai_config.default_passes("cpu", d) == genai_config.CPU_PASSES
        assert genai_config.default_passes("cuda", d) == genai_config.CUDA_PASSES
    assert "cacheattention" in genai_config.CUDA_PASSES and "cacheattention" not in genai_config.DEFAULT_PASSES
    assert genai_config.CPU_PASSES == ("matmulnbits",) and genai_config.default_passes(None) == \
        genai_config.DEFAULT_PASSES
    assert genai_config.default_passes("cpu", to="awq") == ("matmulnbits", "ffn")     # awq's pairs are for the fusion
    assert genai_config.default_passes("cuda", to="awq") == genai_config.CUDA_PASSES
