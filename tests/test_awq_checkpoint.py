"""Import of pre-quantised AutoAWQ checkpoints (onnx_lowbit.awq_checkpoint + the weights4 pass option
awq_checkpoint / CLI --awq-checkpoint). The checkpoint is written the way AutoAWQ saves one (safetensors via the
safetensors library, <module>.qweight/.qzeros/.scales in the GEMM layout; our RTN packing is byte-identical with
AutoAWQ's, see test_awq_format.py) for a small torch model exported with both exporters."""
import os

import numpy as np
import onnx
import pytest
import torch
from safetensors.numpy import save_file

import onnx_lowbit
from onnx_lowbit import awq
from onnx_lowbit.awq_checkpoint import Checkpoint, CheckpointError, read_safetensors

from test_cli import assert_bad, cli

K, H = 128, 256


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = torch.nn.Linear(K, H, bias=False)
        self.down_proj = torch.nn.Linear(H, K, bias=True)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)))


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _MLP()

    def forward(self, x):
        return x + self.mlp(x)


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = _Inner()
        self.lm_head = torch.nn.Linear(K, 64, bias=False)

    def forward(self, x):
        return self.lm_head(self.model(x))


def _checkpoint(model, path, group_size=64, prefix=""):
    """AutoAWQ-style checkpoint of every mlp Linear (lm_head left in float, as AutoAWQ does)."""
    tensors = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".mlp." in name:
            w = mod.weight.detach().numpy().T.astype(np.float16).astype(np.float32)  # [in, out]
            qw, qz, sc = awq.quantize_rtn(w, group_size)
            tensors[prefix + name + ".qweight"] = qw
            tensors[prefix + name + ".qzeros"] = qz
            tensors[prefix + name + ".scales"] = sc
            if mod.bias is not None:
                tensors[prefix + name + ".bias"] = mod.bias.detach().numpy().astype(np.float16)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}  # save_file writes raw buffers
    save_file(tensors, str(path))
    return tensors


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("awqckpt")
    m = _Model().eval()
    x = torch.randn(1, 3, K)
    paths = {}
    for dynamo in (False, True):
        p = d / f"model_{'dynamo' if dynamo else 'ts'}.onnx"
        torch.onnx.export(m, (x,), str(p), input_names=["x"], output_names=["y"], dynamo=dynamo,
                          dynamic_axes=None if dynamo else {"x": {1: "seq"}})
        paths[dynamo] = str(p)
    return m, paths, d


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("prefix", ["", "base."])
def test_import_matches_modules_and_runs(exported, dynamo, prefix, tmp_path):
    m, paths, _ = exported
    tensors = _checkpoint(m, tmp_path / "model.safetensors", prefix=prefix)
    out, report = onnx_lowbit.rewrite(paths[dynamo], passes="weights4", awq_checkpoint=str(tmp_path / "model.safetensors"),
                                      weights_min_elements=0)
    nodes = [n for n in out.graph.node if n.op_type == "MatMulAWQ"]
    assert len(nodes) == 4, report.to_table()
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
    used = set()
    for n in nodes:
        qw = inits[n.input[1]]
        hits = [k for k, v in tensors.items() if k.endswith(".qweight") and v.shape == qw.shape and np.array_equal(v, qw)]
        assert len(hits) == 1
        used.add(hits[0])
        assert {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["group_size"] == 64
    assert len(used) == 4
    # lm_head is not in the checkpoint: it stays a float MatMul, reported as skipped with the reason
    assert any("not in the AWQ checkpoint" in e.reason for e in report.skipped())
    # the rewritten model computes with the checkpoint's weights
    x = np.random.default_rng(0).standard_normal((1, 3, K)).astype(np.float32)
    y = onnx_lowbit.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = x
    for i in range(2):
        base = f"{prefix}model.layers.{i}.mlp."
        w_up = awq.dequantize(tensors[base + "up_proj.qweight"], tensors[base + "up_proj.qzeros"],
                              tensors[base + "up_proj.scales"], 64, K, H).astype(np.float32)
        w_dn = awq.dequantize(tensors[base + "down_proj.qweight"], tensors[base + "down_proj.qzeros"],
                              tensors[base + "down_proj.scales"], 64, H, K).astype(np.float32)
        b = m.model.layers[i].mlp.down_proj.bias.detach().numpy()
        ref = ref + (np.maximum(ref @ w_up, 0) @ w_dn + b)
    ref = ref @ m.lm_head.weight.detach().numpy().T
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3)


def test_shape_mismatch_is_skipped_with_reason(exported, tmp_path):
    m, paths, _ = exported
    tensors = _checkpoint(m, tmp_path / "a.safetensors")
    name = "model.layers.0.mlp.up_proj"
    tensors[name + ".qweight"] = tensors[name + ".qweight"][:64]
    tensors[name + ".qzeros"] = tensors[name + ".qzeros"][:1]
    tensors[name + ".scales"] = tensors[name + ".scales"][:1]
    save_file(tensors, str(tmp_path / "a.safetensors"))
    out, report = onnx_lowbit.rewrite(paths[False], passes="weights4", awq_checkpoint=str(tmp_path / "a.safetensors"))
    assert len([n for n in out.graph.node if n.op_type == "MatMulAWQ"]) == 3
    assert any("[K=64, N=256], the weight [K=128, N=256]" in e.reason for e in report)


def test_directory_of_shards(exported, tmp_path):
    m, paths, _ = exported
    tensors = _checkpoint(m, tmp_path / "all.safetensors")
    os.remove(tmp_path / "all.safetensors")
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[: len(names) // 2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[len(names) // 2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert len(Checkpoint(str(tmp_path)).modules) == 4


def test_reader_agrees_with_safetensors(tmp_path):
    rng = np.random.default_rng(1)
    t = {"a": rng.integers(-5, 5, (3, 4), dtype=np.int32), "b": rng.standard_normal(7).astype(np.float16),
         "c": np.zeros((0, 2), np.float32)}
    save_file(t, str(tmp_path / "t.safetensors"))
    got = read_safetensors(str(tmp_path / "t.safetensors"))
    assert set(got) == set(t) and all(np.array_equal(got[k], t[k]) and got[k].dtype == t[k].dtype for k in t)


@pytest.mark.parametrize("content,needle", [(b"", "not a safetensors file"), (b"\xff" * 64, "not a safetensors file"),
                                            (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", "no AWQ-quantised module")])
def test_bad_files(tmp_path, content, needle):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(content)
    with pytest.raises(CheckpointError, match=needle):
        Checkpoint(str(p))


def test_truncated_tensor_data(tmp_path):
    save_file({"x.qweight": np.zeros((64, 2), np.int32), "x.qzeros": np.zeros((1, 2), np.int32),
               "x.scales": np.ones((1, 16), np.float16)}, str(tmp_path / "t.safetensors"))
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="byte range"):
        Checkpoint(str(tmp_path / "t.safetensors"))


def test_cli(exported, tmp_path):
    m, paths, _ = exported
    _checkpoint(m, tmp_path / "c.safetensors")
    out = tmp_path / "out.onnx"
    rc, so, err = cli("rewrite", paths[False], str(out), "--awq-checkpoint", str(tmp_path / "c.safetensors"))
    assert rc == 0, err
    assert sum(n.op_type == "MatMulAWQ" for n in onnx.load(str(out)).graph.node) == 4
    rc, so, err = cli("rewrite", paths[False], str(tmp_path / "o2.onnx"), "--weights", "nf4", "--awq-checkpoint",
                      str(tmp_path / "c.safetensors"))
    assert_bad(rc, err, "awq_checkpoint")
    assert not (tmp_path / "o2.onnx").exists()
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    rc, so, err = cli("rewrite", paths[False], str(tmp_path / "o3.onnx"), "--awq-checkpoint",
                      str(tmp_path / "junk.safetensors"))
    assert_bad(rc, err, "junk.safetensors")
    assert not (tmp_path / "o3.onnx").exists()


def test_exclude_matches_module_paths_of_dynamo_exports(exported):
    """dynamo names nodes generically (node_linear_4) but records the module path in node metadata."""
    _, paths, _ = exported
    out, report = onnx_lowbit.rewrite(paths[True], passes="weights4", weights="nf4", weights_min_elements=0,
                                      weights_exclude=["lm_head", r"layers\.1\.mlp\.down_proj$"])
    assert sum(n.op_type == "MatMulNF4" for n in out.graph.node) == 3
    reasons = [e.reason for e in report.skipped()]
    assert any("'lm_head'" in r for r in reasons) and any("model.layers.1.mlp.down_proj" in r for r in reasons)
