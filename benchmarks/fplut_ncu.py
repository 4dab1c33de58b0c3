"""Launch one FPLUT kernel variant once on 64M fp16 (for ncu / compute-sanitizer). Usage: fplut_ncu.py VARIANT"""
import sys

import numpy as np
import torch

from onnx_lowbit import fplut
from onnx_lowbit.custom_ops import fplut_cuda as fc
from onnx_lowbit.custom_ops.cuda_launch import Array, Launcher

SEED = [-20.359375, -17.109375, -8.3671875, -1.9755859375, -0.255615234375, -0.007244110107421875,
        0.0072174072265625, 0.228515625, 1.58203125, 10.46875, 65504.0]
variant = sys.argv[1] if len(sys.argv) > 1 else "base"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 64 << 20
kern = {"base": lambda: fc._make(fc._word16, fc._one16, 4, 4, smem32=False),
        "s32": lambda: fc._make(fc._word16b, fc._one16b, 4, 4),
        "s32u8": lambda: fc._make(fc._word16b, fc._one16b, 4, 8)}[variant]()
lv = Launcher(kern, [Array(np.uint64), Array(np.uint64), Array(np.uint16), Array(np.uint16), Array(np.uint64), "int64"],
              dynamic_shared=fc.SHARED_BYTES)
t = fplut.Table.build("silu", SEED)
dT = torch.from_numpy(fc.expanded(t.cut_points, t.values, 10).view(np.int64).copy()).cuda()
x = (torch.randn(n, device="cuda") * 4).half()
out = torch.empty_like(x)
grid = fc.grid_for(n, 4, torch.cuda.get_device_properties(0).multi_processor_count)
lv.launch(grid, fc.BLOCK, torch.cuda.current_stream().cuda_stream, (x.data_ptr(), (n // 4,)), (out.data_ptr(), (n // 4,)),
          (x.data_ptr(), (n,)), (out.data_ptr(), (n,)), (dT.data_ptr(), (fc.TABLE_WORDS,)), n)
torch.cuda.synchronize()
ref = fplut.apply(x[:4096].cpu().numpy(), t.cut_points, t.values)
print(variant, "ok" if np.array_equal(out[:4096].cpu().numpy().view(np.uint16), ref.view(np.uint16)) else "MISMATCH")
