"""QuantGRU on the GPU: bit-exactness against the integer reference (onnx_lowbit.gru_int) and speed against
torch nn.GRU on cuDNN (fp32, fp16), measured in the same run.

    PYTHONPATH=.:tests python benchmarks/gru_gpu.py [--quick] [--json OUT.json]

Cases: T=100, N=1, C=H=256 and T=100, N=32, C=H=512, forward, parameters from gru_quant's calibration of a
random float GRU; our kernels (xproj GEMM + persistent recurrent kernel) for bits 8 and 16, several block splits
(units per block; the default plan is marked), plus the two kernels timed alone, and every xproj tile
(quantgru_cuda.XTILES; the default is marked): its qWx checked against gru_int.input_gemm, then timed alone and
in the whole call. CUDA events around 20 back-to-back calls (median of 30), benchmarks/timing.py.
"""
from __future__ import annotations

import argparse
import time
import traceback

import numpy as np

from timing import time_cuda, write_json  # noqa: E402 - benchmarks/ is on sys.path when run as a script

CASES = [(100, 1, 256, 256), (100, 32, 512, 512)]
UNITS = {256: [2, 4, 8, 16, 32], 512: [2, 4, 8, 16]}


def calibrated(T, N, C, H, bits, seed=0):  # noqa: N803
    from onnx_lowbit import gru_quant
    rng = np.random.default_rng(seed)
    k = 1 / np.sqrt(H)
    W, R, B = (rng.uniform(-k, k, s) for s in [(1, 3 * H, C), (1, 3 * H, H), (1, 6 * H)])
    X = rng.standard_normal((T, N, C)).astype(np.float32)
    ranges = gru_quant.calibrate(X[:20], W, R, B, hidden_size=H)
    p = gru_quant.quant_params(W, R, B, ranges, bits=bits)
    attrs = dict(hidden_size=H, bits=bits, exponents=p["exponents"], zero_points=p["zero_points"])
    return (X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], None, None), attrs, (X, W, R, B)


def qwx_exact(p, a, attrs):
    """The xproj output of Prepared ``p`` (after a launch) equals gru_int.input_gemm (forward, layout 0)."""
    from onnx_lowbit import gru_int
    X, W, R, B, ch = a[:5]
    e, z = np.array(attrs["exponents"]), np.array(attrs["zero_points"])
    qx = gru_int.quantize(X, e[gru_int.Q["x"]], z[gru_int.Q["x"]], attrs["bits"])
    wq = W[0].astype(np.int64)
    want = gru_int.input_gemm(qx, wq, wq.sum(1), ch[0, gru_int.CH_W].astype(np.int64), e, z, attrs["bits"])
    got = p.qwx.copy_to_host()[: want.size].reshape(want.shape)
    return np.array_equal(got, want)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="default plan only")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from onnx_lowbit import gru_int
    from onnx_lowbit.custom_ops.gru import quantgru_cuda as qg
    torch.cuda.init()
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    rows, out = [], []
    print(f"device: {torch.cuda.get_device_name()}")
    for T, N, C, H in CASES:  # noqa: N806
        name = f"T={T} N={N} C={C} H={H}"
        fl = None
        for bits in (8, 16):
            try:
                a, attrs, fl = calibrated(T, N, C, H, bits, seed=N)
                t0 = time.perf_counter()
                want = gru_int.quant_gru(*a, **attrs)
                t_ref = time.perf_counter() - t0
                p = qg.Prepared(*a, **attrs)
                t0 = time.perf_counter()
                p.launch(stream())
                y, yh = p.result()
                t_first = time.perf_counter() - t0
                ok = np.array_equal(y.view(np.uint32), want[0].view(np.uint32)) and \
                    np.array_equal(yh.view(np.uint32), want[1].view(np.uint32))
                print(f"{name} int{bits}: bit-exact {ok} (numpy reference {t_ref:.1f} s, first call incl. "
                      f"compile {t_first:.1f} s); plan units={p.plan.units} blocks={p.plan.grid} ks={p.plan.ks} "
                      f"tn={p.plan.tn} smem={p.plan.smem} per_step={p.per_step}")
                out.append({"case": name, "bits": bits, "bit_exact": bool(ok)})
                units = [None] if args.quick else [None] + [u for u in UNITS.get(H, []) if u != p.plan.units]
                for u in units:
                    pu = p if u is None else qg.Prepared(*a, **attrs, units=u)
                    t = time_cuda(lambda: pu.launch(stream()))
                    if u is not None:
                        y2, yh2 = pu.result()
                        ok2 = np.array_equal(y2.view(np.uint32), want[0].view(np.uint32))
                    else:
                        ok2 = ok
                    label = (f"ours int{bits}, units={pu.plan.units} ({pu.plan.grid} blocks)"
                             f"{' default' if u is None else ''}")
                    rows.append((name, label, t, ok2))
                    print(f"  {label}: {t:.1f} us  bit-exact {ok2}")
                tx = time_cuda(lambda: p.launch(stream(), "xproj"))
                tr = time_cuda(lambda: p.launch(stream(), "rec"))
                rows.append((name, f"  int{bits} xproj kernel alone (tile {p.xt.name})", tx, None))
                rows.append((name, f"  int{bits} recurrent kernel alone", tr, None))
                print(f"  xproj alone {tx:.1f} us (tile {p.xt.name}), recurrent alone {tr:.1f} us "
                      f"({tr / T:.2f} us/step)")
                for xt in qg.XTILES[bits]:      # every xproj tile: exact, alone, whole call
                    px = qg.Prepared(*a, **attrs, xtile=xt.name)
                    px.launch(stream(), "xproj")
                    torch.cuda.synchronize()
                    okx = qwx_exact(px, a, attrs)
                    tx = time_cuda(lambda: px.launch(stream(), "xproj"))
                    ta = time_cuda(lambda: px.launch(stream()))
                    mark = " default" if xt.name == p.xt.name else ""
                    label = f"  int{bits} xproj tile {xt.name}{mark} ({xt.blocks(T * N, 3 * H, 1)} blocks)"
                    rows.append((name, label + " alone", tx, okx))
                    rows.append((name, label + " whole call", ta, None))
                    print(f"{label}: qWx exact {okx}, alone {tx:.1f} us, whole call {ta:.1f} us")
                pp = qg.Prepared(*a, **attrs, per_step=True)
                tp = time_cuda(lambda: pp.launch(stream()), iters=5, batch=3)
                rows.append((name, f"  int{bits} one launch per step (fallback)", tp, None))
                print(f"  per-step launches: {tp:.1f} us")
            except Exception as e:  # noqa: BLE001 - a benchmark run must go on
                traceback.print_exc()
                rows.append((name, f"int{bits} FAILED {type(e).__name__}: {e}", None, None))
        if fl is None:
            continue
        X, W, R, B = fl
        for dt in (torch.float32, torch.float16):
            try:
                gru = torch.nn.GRU(C, H).cuda().to(dt)
                x = torch.from_numpy(X).cuda().to(dt)
                with torch.no_grad():
                    gru(x)
                    t = time_cuda(lambda: gru(x))
                rows.append((name, f"torch nn.GRU cuDNN {str(dt).split('.')[-1]}", t, None))
                print(f"  torch cuDNN {dt}: {t:.1f} us")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append((name, f"torch {dt} FAILED {e}", None, None))
    print("\n| case | implementation | time (us) | bit-exact |\n| --- | --- | --- | --- |")
    for case, label, t, ok in rows:
        print(f"| {case} | {label} | {'-' if t is None else f'{t:.1f}'} | {'' if ok is None else ok} |")
    write_json(args.json, {"rows": rows, "checks": out})


if __name__ == "__main__":
    main()
