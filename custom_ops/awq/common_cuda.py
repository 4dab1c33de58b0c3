"""Constants of the AWQ tensor-core decode (the nibbles as exact fp16 subnormals fed to mma.sync, matmulawq1_cuda):
the PRMT selectors (TC_SEL), the nibble masks of a packed half2 (LO16, HI16), fp16 ones (ONES16) and the powers of
two that undo the subnormal scaling."""
from __future__ import annotations

import numpy as np

LO16 = np.uint32(0x000F000F)
HI16 = np.uint32(0x00F000F0)
ONES16 = np.uint32(0x3C003C00)
TC_SEL = tuple(np.uint32(b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12)) for b in range(4))
F2P24, F2P20 = np.float32(2.0 ** 24), np.float32(2.0 ** 20)
