"""The bridge in onnxruntime CUDA sessions (GPU machine only; skipped without onnxruntime-gpu and a GPU):
every FPLUT node on the CUDA EP, no Memcpy nodes, bit-exact with the reference, concurrent runs agree."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import onnx_lowbit
from onnx_lowbit import fplut, halfbits

from helpers import SEED, fplut_model, random_like, same_in_threads, seed_table, skip_module_unless_cuda_sessions

skip_module_unless_cuda_sessions()

CUDA = ["CUDAExecutionProvider"]


def _session(model, tmp_path):
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    onnx_lowbit.register(so)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=CUDA)
    opt = onnx.load(so.optimized_model_filepath)
    return sess, opt


@pytest.mark.parametrize("et,dtype", [(TensorProto.FLOAT16, np.float16), (TensorProto.FLOAT, np.float32)])
@pytest.mark.parametrize("n", [1, 5, 4096, 1 << 20])
def test_cuda_session_bit_exact_no_memcpy(tmp_path, et, dtype, n):
    sess, opt = _session(fplut_model(et, shape=["n"]), tmp_path)
    assert not [nd.op_type for nd in opt.graph.node if nd.op_type.startswith("Memcpy")]
    x = random_like(dtype, (n,), seed=n)
    xv = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xv)
    io.bind_output("y", "cuda")
    sess.run_with_iobinding(io)
    y = io.copy_outputs_to_cpu()[0]
    ref = fplut.apply(x, SEED, seed_table().values)
    assert np.array_equal(y.view(np.uint8), ref.view(np.uint8))


def test_cuda_exhaustive_fp16(tmp_path):
    sess, _ = _session(fplut_model(TensorProto.FLOAT16, shape=["n"]), tmp_path)
    x = halfbits.all_fp16().copy()
    y = sess.run(None, {"x": x})[0]
    assert np.array_equal(y.view(np.uint16), fplut.apply(x, SEED, seed_table().values).view(np.uint16))


def test_cuda_threads_agree(tmp_path):
    sess, _ = _session(fplut_model(TensorProto.FLOAT, shape=["n"]), tmp_path)
    xs = [random_like(np.float32, (10000 + i,), seed=i) for i in range(8)]
    want = [fplut.apply(x, SEED, seed_table().values) for x in xs]
    assert not same_in_threads(lambda x: sess.run(None, {"x": x})[0], xs, want,
                               lambda a, b: np.array_equal(a.view(np.uint32), b.view(np.uint32)), repeats=25)


def test_cuda_bad_attribute_is_an_error_status(tmp_path):
    attrs = fplut.node_attributes(seed_table())
    attrs["table"] = attrs["table"][:7]
    with pytest.raises(Exception, match="259"):
        _session(fplut_model(attrs=attrs, name="bad_node"), tmp_path)
