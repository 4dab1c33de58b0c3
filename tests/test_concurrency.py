"""Several sessions and 8 threads calling run() on one session give identical results, for models holding
every kind of our ops the passes emit (FPLUT, MatMulNF4, MatMulAWQ; FusedFFN* when the ffn pass emits them).
CPU here (CI); tests/test_native_plans_cuda.py does the same on the GPU machine."""
import os

import numpy as np
import pytest

import onnx_lowbit

from helpers import same_in_threads, swiglu_mlp

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "samples", "gpt2_mlp.onnx")
CPU = ["CPUExecutionProvider"]


CASES = {"gpt2-nf4": (SAMPLE, dict(weights="nf4"), {"FPLUT", "MatMulNF4"}),
         "gpt2-awq": (SAMPLE, dict(weights="awq"), {"FPLUT", "MatMulAWQ"}),
         "swiglu-fp32": (None, {}, {"FusedFFN"}),
         "swiglu-nf4": (None, dict(weights="nf4"), {"FusedFFNNF4", "MatMulNF4"}),
         "swiglu-awq": (None, dict(weights="awq"), {"FusedFFNAWQ", "MatMulAWQ"})}


@pytest.fixture(scope="module", params=list(CASES))
def model(request):
    src, opts, ops = CASES[request.param]
    m, _ = onnx_lowbit.rewrite(src or swiglu_mlp(), **opts)
    assert {n.op_type for n in m.graph.node if n.domain == "onnx_lowbit"} >= ops
    return m


def _inputs(n=8):
    return [np.random.default_rng(i).standard_normal((1, 1 + 3 * i, 128)).astype(np.float32) for i in range(n)]


def test_eight_threads_on_one_session(model):
    sess = onnx_lowbit.InferenceSession(model, providers=CPU)
    xs = _inputs()
    want = [sess.run(None, {"x": x})[0] for x in xs]
    assert not same_in_threads(lambda x: sess.run(None, {"x": x})[0], xs, want, np.array_equal, repeats=10)


def test_sessions_agree(model):
    sessions = [onnx_lowbit.InferenceSession(model, providers=CPU) for _ in range(3)]
    for x in _inputs(3):
        ys = [s.run(None, {"x": x})[0] for s in sessions]
        assert all(np.array_equal(ys[0], y) for y in ys[1:])


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_openmp_wait_policy(given):
    """Importing the kernels makes Numba's OpenMP pool passive (docs/reliability.md, "CPU threads") unless the user
    chose a policy, and the pool then really runs: a parallel kernel followed by a BLAS product gives the right sum."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = ("import os, numpy as np; from onnx_lowbit.custom_ops.ffn import fusedffn_cpu as f; "
            "b = np.arange(1, 65, dtype=np.float16).reshape(8, 8); out = np.empty((8, 8), np.float32); "
            "f.widen_f16(b.view(np.uint16), f.F16_TO_F32, out); "
            "print(os.environ['OMP_WAIT_POLICY'], float((out @ out).sum()))")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    want = np.arange(1, 65, dtype=np.float64).reshape(8, 8)
    assert res.stdout.split() == [given or "PASSIVE", str(float((want @ want).sum()))]
