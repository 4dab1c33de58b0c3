"""The host runner of the AWQ decode / generic kernels (gemv_cuda) for tests and benchmarks/kernel_once.py: host
arrays in, the output out, reaching what sessions never take (so runtime/direct.py cannot either)."""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..device.inputs import check_x_biases
from ..device.launch import arg
from ..device.target import SIM
from .dequantawq_cpu import check_a_bias, check_both, check_weights, parse_attrs
from .gemv_cuda import (BLOCK, CT, MAX_M_FAST, WARPS, blocks_per_sm, bucket, decode_plan, launcher, make_gemv,
                        make_generic)
from ..device.host import sm_count


def run(x, w1, w3, b1, b3, group_size, K, N, *, generic=False, ct=CT, warps=WARPS, rows=None,  # noqa: N803
        repeat=1):
    """Runs the decode kernel of x's row bucket (with ``generic``: the generic kernel) on host arrays and returns
    Y (w3 and b3 None: MatMulAWQ) or S (FusedFFNAWQ); w1 / w3 = (qweight, qzeros, scales). For tests: it reaches
    what sessions (and so runtime/direct.py) never take, at the simulator's cost: blocks of ``ct`` x ``warps``
    threads (the simulator runs a Python thread per CUDA thread), a forced K slice ``rows`` (one split, or many
    splits at a small K), the generic kernel at any M. ``repeat`` launches on the same counters (each launch
    must leave them zeroed). Inputs are checked as a session checks them. The Numba dispatcher under the
    simulator (SIM_SMS SMs); on a GPU the sessions' launchers at their geometry (``ct`` / ``warps`` ignored)."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    nw = 1 if w3 is None else 2
    if nw == 1:
        check_weights(*w1, sh, first=1)
        m = check_a_bias(x, b1, sh)
    else:
        check_both(w1, w3, sh)
        m = check_x_biases(x, b1, b3, K, N, 7, 8)
    lead = tuple(x.shape[:-1])
    if m == 0:
        return np.empty(lead + (N,), x.dtype)
    a16 = x.dtype == np.float16
    if not SIM:
        ct, warps = CT, WARPS
    bits = np.uint16 if a16 else np.float32
    dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))  # noqa: E731
    dx = dev(x, bits)
    dw = [dev(a, dt) for w in (w1, w3)[:nw] for a, dt in zip(w, (np.uint32, np.uint32, np.uint16))]
    dy = cuda.device_array(m * N, bits)
    db = [dev(b, bits) if b is not None else dy for b in (b1, b3)[:nw]]
    flags = [int(b is not None) for b in (b1, b3)[:nw]]
    mt = None if generic or m > MAX_M_FAST else bucket(m, nw)
    lau = launcher(a16, mt, nw)
    if mt is None:
        grid = -(-(N // 8) // ct) * -(-m // warps)
        args = (dx, *dw, *db, dy, m, K, N, group_size, *flags)
        kern = make_generic(a16, nw, ct, warps) if SIM else None
    else:
        grid, r, splits = decode_plan(m, K, N, group_size, sm_count(), blocks_per_sm(lau), nw, ct, warps, rows)
        dacc = cuda.to_device(np.zeros(max(1, splits * nw * m * N), np.float32))
        dcnt = cuda.to_device(np.zeros(-(-(N // 8) // ct), np.uint32))
        args = (dx, *dw, *db, dy, dacc, dcnt, m, K, N, group_size, r, splits, *flags)
        kern = make_gemv(mt, a16, nw, ct, warps) if SIM else None
    for _ in range(repeat):
        if SIM:
            kern[grid, ct * warps](*args)
        else:
            lau.launch(grid, BLOCK, 0, *[arg(a) for a in args])
    if not SIM:
        cuda.synchronize()
    return dy.copy_to_host().view(x.dtype).reshape(lead + (N,))
