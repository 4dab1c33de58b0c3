"""The memory side of FusedFFNNF4's M=1 decode kernel alone: the same weight streams (W1 and W3 NF4 rows of W^T,
column slices per block, COLS columns per step with the next step prefetched, one wave of blocks held to the
decode kernel's 3 per SM by 64 KiB of dynamic shared memory), with the decode replaced by an XOR of the words, so
the time is what the access pattern alone costs. Variants: 8-byte words per thread (today's kernel) or 16-byte
(two words, ld.global.nc.L1::no_allocate.v4), with or without the absmax loads.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/nf4stream_gpu.py
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64
from timing import copy_gbps, time_graph

from onnx_lowbit.custom_ops.fusedffn_cuda import LOAD, _make_ld4
from onnx_lowbit.custom_ops.matmulnf4_cuda import TAB_BYTES, add32, mad32, min32, shr32

K, N, BS, POOL = 4096, 11008, 64, 3
ld4 = _make_ld4(LOAD)


def make(wide, absmax, cols=4):
    """Kernel (q1 uint32, am1, q3 uint32, am3, out uint32, n_dim, wpr, parts): thread t reads 8 * (2 if wide else
    1) bytes of every row of its step's 2 * cols rows."""
    per = 4 if wide else 2      # uint32 words per thread and row
    src = ["def k(q1, am1, q3, am3, out, n_dim, wpr, parts):",
           "    tab = cuda.shared.array(0, uint32)",
           "    tid = uint32(cuda.threadIdx.x)",
           "    part = uint32(cuda.blockIdx.x)",
           "    n_lo = uint32(part * uint32(n_dim) // uint32(parts))",
           "    n_hi = uint32((part + uint32(1)) * uint32(n_dim) // uint32(parts))",
           f"    tw = tid * uint32({per})",
           "    rw = uint32(wpr)",
           "    acc = uint32(0)",
           "    facc = float32(0.0)",
           "    n0 = n_lo"]

    def loads(pref, nb):
        out = []
        for c in range(cols):
            out.append(f"wi_{c} = mad32(min32(add32({nb}, uint32({c})), n_hi - uint32(1)), rw, tw)")
            for w in (1, 3):
                if wide:
                    out.append(f"{pref}a{w}_{c}, {pref}b{w}_{c}, {pref}c{w}_{c}, {pref}d{w}_{c} = "
                               f"ld4(q{w}, wi_{c} >> uint32(2))")
                else:
                    out.append(f"{pref}a{w}_{c} = q{w}[wi_{c} >> uint32(1)]")      # one 8-byte load
                if absmax:
                    out.append(f"{pref}s{w}_{c} = am{w}[shr32(wi_{c}, uint32(3))]")
        return out
    src += ["    " + ln for ln in loads("", "n0")]
    body = ["nn = add32(n0, uint32(%d))" % cols] + loads("n", "nn")
    for c in range(cols):
        for w in (1, 3):
            body.append(f"acc ^= a{w}_{c} ^ b{w}_{c} ^ c{w}_{c} ^ d{w}_{c}" if wide else
                        f"acc ^= uint32(a{w}_{c} & M32) ^ uint32(a{w}_{c} >> U32)")
            if absmax:
                body.append(f"facc += s{w}_{c}")
    for c in range(cols):
        for w in (1, 3):
            for v in (("a", "b", "c", "d") if wide else ("a",)) + (("s",) if absmax else ()):
                body.append(f"{v}{w}_{c} = n{v}{w}_{c}")
    body.append("n0 = nn")
    src.append("    while n0 < n_hi:")
    src += ["        " + ln for ln in body]
    src.append("    if facc == float32(-1.0):")
    src.append("        acc += uint32(1)")
    src.append("    if acc == uint32(0x12345678):")
    src.append("        out[tid] = acc + tab[tid]")
    ns = {"cuda": cuda, "uint32": uint32, "uint64": uint64, "float32": float32, "ld4": ld4, "add32": add32,
          "mad32": mad32, "min32": min32, "shr32": shr32, "M32": np.uint64(0xFFFFFFFF), "U32": np.uint64(32)}
    exec("\n".join(src), ns)  # noqa: S102 - generated from constants
    return cuda.jit(ns["k"])


def main():
    import torch

    from onnx_lowbit.custom_ops import nf4_common
    from onnx_lowbit.custom_ops.cuda_launch import Array, Launcher, current_device, sm_count
    torch.zeros(1, device="cuda")
    print("GPU:", torch.cuda.get_device_name(0))
    bw, _ = copy_gbps()
    print(f"device copy 256 MiB: {bw:.0f} GB/s")
    sms = sm_count(current_device())
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = [[(torch.randint(0, 2 ** 31, (K * N // 8,), device="cuda", dtype=torch.int32, generator=g),
              torch.rand(K * N // BS, device="cuda", generator=g)) for _ in range(2)] for _ in range(POOL)]
    out = torch.zeros(1024, device="cuda", dtype=torch.int32)
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    ptr = lambda t: (t.data_ptr(), (t.numel(),))  # noqa: E731
    def sig(wide):
        q = Array(np.uint32 if wide else np.uint64)
        return [q, Array(np.float32), q, Array(np.float32), Array(np.uint32)] + ["int64"] * 3
    nbytes = 2 * (K * N // 2 + K * N // BS * 4)
    for wide in (False, True):
        for absmax in (True, False):
            lau = Launcher(make(wide, absmax), sig(wide), dynamic_shared=TAB_BYTES)
            block = K // 16 // (2 if wide else 1)
            occ = max(1, lau.blocks_per_sm(block))
            parts = nf4_common.even_parts(-(-N // 4), sms * occ)
            qp = (lambda t: (t.data_ptr(), (t.numel(),))) if wide else (lambda t: (t.data_ptr(), (t.numel() // 2,)))
            calls = [lambda w=w: lau.launch(parts, block, stream(), qp(w[0][0]), ptr(w[0][1]), qp(w[1][0]),
                                            ptr(w[1][1]), ptr(out), N, K // 8, parts) for w in pool]
            it = iter(range(1 << 30))
            t = time_graph(lambda: calls[next(it) % len(calls)](), batch=len(calls) * 4)
            gbs = (nbytes if absmax else 2 * K * N // 2) / t / 1e3
            print(f"{'16 B' if wide else ' 8 B'} per thread and row, absmax {'on ' if absmax else 'off'}: "
                  f"{t:6.2f} us  {gbs:5.0f} GB/s  {100 * gbs / bw:5.1f}% copy  [{parts} x {block}, {occ}/SM]",
                  flush=True)


if __name__ == "__main__":
    main()
