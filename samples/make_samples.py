"""Builds the embedded sample models (random weights, fixed seed) with torch's ONNX exporter.

    python samples/make_samples.py          # rewrites samples/*.onnx

tiny_yolo.onnx  a YOLO-style CNN: Conv-BN-SiLU blocks, a C2f-like split/concat, SPPF pooling, a sigmoid head.
gpt2_mlp.onnx   a GPT-2 style transformer MLP stack (LayerNorm, Linear, GELU tanh form, Linear, residual).
llama_mlp.onnx  a LLaMA-style SwiGLU MLP stack (RMS norm, gate/up Linear, SiLU * up, down Linear, residual).
gru_small.onnx  a GRU (batch_first, 64 -> 128, one layer) + gru_small_calib.npz, calibration inputs for it.
"""
from __future__ import annotations

import os

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


class ConvBnSiLU(nn.Sequential):
    def __init__(self, cin, cout, k=3, s=1):
        super().__init__(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), nn.SiLU())


class C2f(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.cv1 = ConvBnSiLU(c, c, 1)
        self.m = nn.Sequential(ConvBnSiLU(c // 2, c // 2), ConvBnSiLU(c // 2, c // 2))
        self.cv2 = ConvBnSiLU(c + c // 2, c, 1)

    def forward(self, x):
        a, b = self.cv1(x).chunk(2, 1)
        return self.cv2(torch.cat([a, b, self.m(b)], 1))


class TinyYolo(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(ConvBnSiLU(3, 16, 3, 2), ConvBnSiLU(16, 32, 3, 2), C2f(32), ConvBnSiLU(32, 64, 3, 2),
                                  C2f(64))
        self.pool = nn.MaxPool2d(5, 1, 2)
        self.head = nn.Conv2d(64 * 2, 3 * (5 + 4), 1)

    def forward(self, x):
        y = self.body(x)
        y = torch.cat([y, self.pool(y)], 1)
        return torch.sigmoid(self.head(y))


class GPT2MLP(nn.Module):
    def __init__(self, d=128, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d),
                                                   "proj": nn.Linear(4 * d, d)}) for _ in range(layers))
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        for b in self.blocks:
            x = x + b["proj"](self.act(b["fc"](b["ln"](x))))
        return x


class RMSNorm(nn.Module):
    """LLaMA's RMS norm, written out (torch's exporter has no opset-17 RMSNormalization)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(1 + 0.1 * torch.randn(d)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaMLP(nn.Module):
    def __init__(self, d=128, h=352, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": RMSNorm(d), "gate_proj": nn.Linear(d, h, bias=False),
                                                   "up_proj": nn.Linear(d, h, bias=False),
                                                   "down_proj": nn.Linear(h, d, bias=False)}) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            h = b["norm"](x)
            x = x + b["down_proj"](nn.functional.silu(b["gate_proj"](h)) * b["up_proj"](h))
        return x


class SmallGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(64, 128, batch_first=True)

    def forward(self, x):
        return self.gru(x)[0]


def _bn_stats(model):
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)


def export(model, example, path, dynamic=None):
    model.eval()
    torch.onnx.export(model, example, path, input_names=["x"], output_names=["y"], opset_version=17,
                      dynamo=False, dynamic_axes=dynamic)


def main(out_dir=HERE):
    torch.manual_seed(0)
    yolo = TinyYolo()
    _bn_stats(yolo)
    export(yolo, torch.randn(1, 3, 64, 64), os.path.join(out_dir, "tiny_yolo.onnx"))
    torch.manual_seed(0)
    export(GPT2MLP(), torch.randn(1, 16, 128), os.path.join(out_dir, "gpt2_mlp.onnx"), {"x": {1: "seq"}, "y": {1: "seq"}})
    torch.manual_seed(0)
    export(LlamaMLP(), torch.randn(1, 16, 128), os.path.join(out_dir, "llama_mlp.onnx"),
           {"x": {1: "seq"}, "y": {1: "seq"}})
    torch.manual_seed(0)
    export(SmallGRU(), torch.randn(2, 20, 64), os.path.join(out_dir, "gru_small.onnx"),
           {"x": {0: "batch", 1: "time"}, "y": {0: "batch", 1: "time"}})
    import numpy as np
    g = np.random.default_rng(0)
    np.savez(os.path.join(out_dir, "gru_small_calib.npz"), x=g.standard_normal((8, 40, 64)).astype(np.float32))


if __name__ == "__main__":
    main()
