"""What the attention family's CUDA faces share: the routing rows of the kernels that read in 8-byte units where
the head size and the pointers allow, else element by element (RotaryKV's copies, KVAttention's K / V units), and
the (element type, wide) of a row's kernel name. Used by rotarykv_cuda.py and kvattention_cuda.py."""
from __future__ import annotations

from ..runtime.routing import Route, always


def unit_routes(op, pointers, measured16):
    """ROUTES of ``op``: per element type, 8-byte units when D (Case.k) is a multiple of the unit (4 fp16 / 2 fp32
    elements) and ``pointers`` are 8-byte aligned (Case.aligned; onnxruntime's buffers always are), else elements.
    ``measured16``: where the fp16 8-byte kernel, the one sessions take, was measured."""
    wide = f"D a multiple of the 8-byte unit (4 fp16 / 2 fp32) and {pointers} 8-byte aligned: 8-byte units"
    return (
        Route(f"{op}16.wide", "fp16, " + wide, lambda c: c.dtype == "float16" and c.aligned and c.k % 4 == 0,
              measured16),
        Route(f"{op}16", "fp16, otherwise: element units", lambda c: c.dtype == "float16",
              "correctness fallback (unaligned views, odd D); not timed"),
        Route(f"{op}32.wide", "fp32, " + wide, lambda c: c.aligned and c.k % 2 == 0,
              "the fp16 kernel's measurement (the same code on fp32); fp32 not timed"),
        Route(f"{op}32", "fp32, otherwise: element units", always, "correctness fallback; not timed"),
    )


def unit_variant(name):
    """(ONNX element type, wide) of a unit_routes kernel name."""
    return (10 if name.split(".")[0].endswith("16") else 1), name.endswith(".wide")
