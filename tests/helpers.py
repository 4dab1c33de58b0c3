"""Small model builders shared by the tests."""
import os
import subprocess
import sys

import numpy as np
from onnx import TensorProto, helper

from onnx_lowbit import domain, fplut

SEED = [-20.359375, -17.109375, -8.3671875, -1.9755859375, -0.255615234375, -0.007244110107421875,
        0.0072174072265625, 0.228515625, 1.58203125, 10.46875, 65504.0]


def seed_table():
    return fplut.Table.build("silu", SEED)


def fplut_model(elem_type=TensorProto.FLOAT, shape=("N", 8), attrs=None, name="act0", opset=17):
    attrs = attrs if attrs is not None else fplut.node_attributes(seed_table())
    node = helper.make_node("FPLUT", ["x"], ["y"], domain=domain.DOMAIN, name=name, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem_type, list(shape))],
                          [helper.make_tensor_value_info("y", elem_type, list(shape))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), domain.opset_import()], ir_version=10)


def random_like(dtype, shape, seed=0, specials=True):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    if specials and x.size >= 4:
        x.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, 1e6]
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def run_bf16(sess, bits, name_in="x", name_out="y"):
    """Runs ``sess`` on bfloat16 input given as raw uint16 ``bits`` (onnxruntime's Python API has no bfloat16 numpy
    type: an OrtValue of raw bits, output bound by I/O binding); returns (the output's raw uint16 bits, its
    onnxruntime type string)."""
    import onnxruntime as ort
    xv = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx_element_type=TensorProto.BFLOAT16)
    io = sess.io_binding()
    io.bind_ortvalue_input(name_in, xv)
    io.bind_output(name_out)
    sess.run_with_iobinding(io)
    yv = io.get_outputs()[0]
    n = int(np.prod(yv.shape()))
    y = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint16 * n).from_address(yv.data_ptr())).copy()
    return y.reshape(yv.shape()), yv.data_type()


def same_in_threads(run, inputs, want, equal, repeats=20, threads=8):
    """Calls ``run(inputs[i])`` ``repeats`` times in each of ``threads`` threads at once; returns the indices i
    whose result was ever not ``equal`` to ``want[i]`` (empty when every thread always agreed)."""
    import threading
    bad = []

    def work(i):
        for _ in range(repeats):
            if not equal(run(inputs[i]), want[i]):
                bad.append(i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return bad


def skip_module_unless_cuda_sessions():
    """Module-level skip unless onnxruntime has its CUDA EP and Numba sees a real GPU (not the simulator)."""
    import onnxruntime as ort
    import pytest
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here", allow_module_level=True)
    try:
        from numba import config, cuda
    except ImportError:
        pytest.skip("numba-cuda not installed", allow_module_level=True)
    if config.ENABLE_CUDASIM or not cuda.is_available():
        pytest.skip("no real GPU for Numba", allow_module_level=True)


def swiglu_mlp(dtype=np.float32):
    """x[1, S, 128] -> SwiGLU MLP (gate/up 128 -> 352, SiLU as x*Sigmoid(x), down 352 -> 128) in ``dtype``."""
    from onnx import numpy_helper
    et = TensorProto.FLOAT16 if np.dtype(dtype) == np.float16 else TensorProto.FLOAT
    rng = np.random.default_rng(0)
    w = {n: (rng.standard_normal(s) * 0.1).astype(dtype) for n, s in
         [("wg", (128, 352)), ("wu", (128, 352)), ("wd", (352, 128))]}
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("MatMul", ["x", "wu"], ["u"]),
             helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["a"]),
             helper.make_node("Mul", ["a", "u"], ["s"]), helper.make_node("MatMul", ["s", "wd"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", et, [1, "S", 128])],
                          [helper.make_tensor_value_info("y", et, [1, "S", 128])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


_LLAMA_EXPORTS: dict = {}


def tiny_llama_export(exporter, dtype, layers, vocab, seq, random_norms=False):
    """A transformers LlamaForCausalLM (hidden 64, 4 heads / 2 kv heads, random weights; ``random_norms``: norm
    weights 1 + 0.3 N(0, 1) instead of ones) returning logits for input_ids [1, seq], exported by ``exporter``
    ('torchscript': opset 17, sequence axis dynamic; 'dynamo': opset 18) in ``dtype``; cached per arguments.
    Skips the test when torch or transformers is missing."""
    import io
    import logging
    import warnings

    import onnx
    import pytest
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    key = (exporter, np.dtype(dtype).str, layers, vocab, seq, random_norms)
    if key in _LLAMA_EXPORTS:
        return _LLAMA_EXPORTS[key]
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    lm = LlamaForCausalLM(cfg).eval()
    if random_norms:
        with torch.no_grad():
            for name, p in lm.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.3 * torch.randn_like(p))

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits

    mod = Logits(lm).eval()
    if np.dtype(dtype) == np.float16:
        mod = mod.half()
    args = (torch.randint(0, vocab, (1, seq)),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            if exporter == "dynamo":
                m = torch.onnx.export(mod, args, dynamo=True, opset_version=18, input_names=["input_ids"],
                                      verbose=False).model_proto
            else:
                f = io.BytesIO()
                torch.onnx.export(mod, args, f, dynamo=False, opset_version=17, input_names=["input_ids"],
                                  dynamic_axes={"input_ids": {1: "S"}})
                m = onnx.load_from_string(f.getvalue())
        finally:
            logging.disable(logging.NOTSET)
    _LLAMA_EXPORTS[key] = m
    return m


_DECODE_EXPORTS: dict = {}


def tiny_decode_export(dtype=np.float32, heads=4, kv_heads=2, layers=1, past=8, hidden=64, seed=0):
    """samples/llama_decode.py's single-token decode step with a KV cache (TorchScript, opset 17, eager attention)
    at a tiny size: hidden ``hidden``, ``heads`` / ``kv_heads`` heads, ``layers`` layers, vocab 64, cache length
    ``past``; returns (ModelProto with weights inline, feeds {name: array}) for the inputs input_ids [1, 1] and
    past_key_values.<i>.key / .value [1, kv_heads, past, hidden / heads]; cached per arguments. Skips the test
    when torch or transformers is missing."""
    import io
    import logging
    import os
    import sys
    import warnings

    import onnx
    import pytest
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    key = (np.dtype(dtype).str, heads, kv_heads, layers, past, hidden, seed)
    if key in _DECODE_EXPORTS:
        return _DECODE_EXPORTS[key]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from samples import llama_decode as ld
    a = ld.parse_args(["--device", "cpu", "--layers", str(layers), "--hidden", str(hidden), "--intermediate",
                       str(hidden * 11 // 4), "--heads", str(heads), "--kv-heads", str(kv_heads), "--vocab", "64",
                       "--past", str(past), "--dtype", "fp16" if np.dtype(dtype) == np.float16 else "fp32",
                       "--seed", str(seed)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            model = ld.build_model(a)
            step = ld.make_step(model)
            ids, past_t = ld.example_inputs(a, model)
            ins, outs = ld.io_names(layers)
            f = io.BytesIO()
            with torch.no_grad():
                torch.onnx.export(step, (ids, *past_t), f, input_names=ins, output_names=outs, opset_version=17,
                                  dynamo=False, do_constant_folding=True)
            m = onnx.load_from_string(f.getvalue())
        finally:
            logging.disable(logging.NOTSET)
    feeds = {ins[0]: ids.numpy()}
    feeds.update({n: t.numpy() for n, t in zip(ins[1:], past_t)})
    _DECODE_EXPORTS[key] = (m, feeds)
    return m, feeds


# ---------------------------------------------------------------- CUDA kernel tests (simulator or a real GPU)
def gpu_or_sim():
    """Skips a CUDA-kernel test unless it can run: Numba's simulator (NUMBA_ENABLE_CUDASIM=1) or
    ONNX_LOWBIT_REAL_GPU=1."""
    import os

    import pytest
    from numba import config
    if not config.ENABLE_CUDASIM and os.environ.get("ONNX_LOWBIT_REAL_GPU") != "1":
        pytest.skip("CUDA kernels: simulator (NUMBA_ENABLE_CUDASIM=1) or ONNX_LOWBIT_REAL_GPU=1")


def ort_cuda_or_skip():
    """onnxruntime, when its CUDA execution provider and a real GPU are there (ONNX_LOWBIT_REAL_GPU=1, not the
    simulator); else the test is skipped."""
    import os

    import pytest
    from numba import config
    try:
        import onnxruntime as ort
    except ImportError:
        pytest.skip("onnxruntime not installed")
    if (config.ENABLE_CUDASIM or os.environ.get("ONNX_LOWBIT_REAL_GPU") != "1"
            or "CUDAExecutionProvider" not in ort.get_available_providers()):
        pytest.skip("onnxruntime's CUDA execution provider and a real GPU needed")
    return ort


def run_cpu(model, feeds, ours=True):
    """{output name: array} of one run of ``model`` (ModelProto) on onnxruntime's CPU EP: with our library
    registered (``ours``) or on stock onnxruntime."""
    import onnxruntime as ort
    make = lowbit_session if ours else (lambda m, p: ort.InferenceSession(m.SerializeToString(), providers=p))
    sess = make(model, ["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def input_specs(model, dims=None):
    """(name, shape, numpy dtype) of every graph input of ``model``; symbolic dims from ``dims`` ({name: size})."""
    from onnx import helper
    for i in model.graph.input:
        tt = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dims[d.dim_param] for d in tt.shape.dim]
        yield i.name, shape, helper.tensor_dtype_to_np_dtype(tt.elem_type)


def lowbit_session(model, providers):
    """An onnxruntime session of ``model`` (ModelProto) with our library registered."""
    import onnx_lowbit
    return onnx_lowbit.InferenceSession(model.SerializeToString(), providers=providers)


def cuda_binding(sess, x, name_in, name_out, out_shape, out_dtype=np.float16):
    """(io, x's OrtValue, y's OrtValue): an IOBinding of ``sess`` with input ``x`` and an output of ``out_shape``,
    both on the GPU (device 0), so that runs reuse the same device buffers (``xv.update_inplace`` changes x)."""
    import onnxruntime as ort
    io = sess.io_binding()
    xv = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    y = ort.OrtValue.ortvalue_from_shape_and_type(tuple(out_shape), out_dtype, "cuda", 0)
    io.bind_ortvalue_input(name_in, xv)
    io.bind_ortvalue_output(name_out, y)
    return io, xv, y


def replays(sess, io, y, runs=5):
    """Runs ``sess`` on binding ``io`` ``runs`` times: (outputs as host arrays, calls that reached Python, the
    bridge's scratch counters' deltas {"taken", "given_back", "bytes"})."""
    from onnx_lowbit.custom_ops.runtime import bridge
    before, counts = bridge.stats["python_computes"], bridge.scratch_counts()
    outs = []
    for _ in range(runs):
        sess.run_with_iobinding(io)
        outs.append(y.numpy())
    now = bridge.scratch_counts()
    return outs, bridge.stats["python_computes"] - before, {c: now[c] - counts[c] for c in now}


def assert_replayed_natively(sess, io, y, scratch_bytes, runs=5):
    """The first run records the node's launches, the others replay them from C (one Python call in all), every run
    takes one scratch buffer of ``scratch_bytes`` and gives it back, the outputs are the same bits every run;
    returns the first output."""
    outs, python_calls, scratch = replays(sess, io, y, runs)
    assert python_calls == 1, python_calls
    assert scratch == {"taken": runs, "given_back": runs, "bytes": runs * scratch_bytes}, scratch
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    return outs[0]


class SimContext:
    """bridge.Context's stand-in under the simulator: outputs are host buffers (the simulator's device memory), kept
    in ``keep`` as (buffer, shape)."""

    def __init__(self):
        self.stream, self.recorder, self.keep = 0, None, []

    def output(self, index, shape):
        b = np.zeros(max(int(np.prod(shape)) * 4, 8), np.uint64)
        self.keep.append((b, shape))
        return b.ctypes.data


def checked_rewrite(model, passes, check=True, **options):
    """run_passes on ``model`` (``passes`` a list, or None for the defaults), checking that the input model is not
    modified and the graph's inputs and outputs are kept; with ``check`` the output also passes onnx's full checker
    (our schemas registered)."""
    import onnx

    from onnx_lowbit.passes import run_passes
    src = model.SerializeToString()
    out, rep = run_passes(model, list(passes) if passes is not None else None, **options)
    assert model.SerializeToString() == src                             # the input model is not modified
    if check:
        domain.register_schemas()
        onnx.checker.check_model(out, full_check=True)
    assert [i.name for i in out.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    return out, rep


def direct_run(op, attrs, inputs, outputs, *, misalign=(), setup=None):
    """``op``'s CUDA face run once as a session node runs it (custom_ops.runtime.direct.call: the kernel object's
    compute, its routing and its launches), on device copies of the host ``inputs`` (None: an optional input left
    out; ``direct.typed(array, elem)``: another element type of the same width, e.g. bf16 in uint16). ``outputs``:
    (shape, dtype[, ONNX element type when not dtype's]) of each output, NaN-filled (integers: 0x5A bytes) before the call; ``misalign``: indices of
    inputs placed one element past their allocation's start (unaligned pointers); ``setup(kernel)``: adjusts the
    kernel object first (e.g. ``kernel.sms``). Returns the outputs as host arrays. Simulator or GPU."""
    from numba import cuda

    from onnx_lowbit.custom_ops.runtime import direct

    def dev(a, shift):
        a = np.ascontiguousarray(a)
        if not shift:
            return cuda.to_device(a)
        buf = cuda.to_device(np.concatenate([np.zeros(1, a.dtype), a.reshape(-1)]))
        return buf[1:].reshape(a.shape)

    ins = []
    for i, a in enumerate(inputs):
        if isinstance(a, direct.typed):
            ins.append(direct.typed(dev(a.array, i in misalign), a.elem))
        else:
            ins.append(None if a is None else dev(a, i in misalign))
    outs, given = [], []
    for shape, dtype, *elem in outputs:
        dt = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        fill = np.full(shape, np.nan, dt) if dt.kind == "f" else \
            np.full(size * dt.itemsize, 0x5A, np.uint8).view(dt).reshape(shape)
        outs.append(cuda.to_device(fill))
        given.append(direct.typed(outs[-1], elem[0]) if elem else outs[-1])
    run = direct.call(op, dict(attrs), ins, given, 0)
    if setup is not None:
        setup(run.kernel)
    run()
    cuda.synchronize()
    return [o.copy_to_host() for o in outs]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, cwd=None, timeout=600):
    """``onnx-lowbit ARGS`` in a fresh process (the checkout first on PYTHONPATH): (returncode, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", *args], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=timeout)
    return p.returncode, p.stdout, p.stderr
