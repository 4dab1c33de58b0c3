"""What QuantGRU's CUDA kernels (quantgru_xproj_cuda, quantgru_rec_cuda) and their per-call parameter kernel
(quantgru_prep_cuda) share: the layout of the parameter arrays (P_* indices into prm [D, NP], PC per-channel
parameters per unit in pch [D, PC H]), the host ``scalar_params`` (prm, qsc, dq from the attributes) and the device
shift ``rsh`` (gru_int.rshift), saturation ``sat`` and rounding to the nearest integer (``rint``, ``rintf``:
libdevice on the GPU, numpy under the simulator)."""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from onnx_lowbit import gru_int
from onnx_lowbit.gru_int import Q

from ..device.target import SIM

if SIM:
    rint = rintf = np.rint
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def rint(v):
        return libdevice.rint(v)

    @cuda.jit(device=True, inline=True)
    def rintf(v):
        return libdevice.rintf(v)

# scalar parameters per direction (int64 array prm[D, NP])
(P_ZPX, P_ZPH, P_ZPWX, P_ZPRH, P_SWXZ, P_SRHZ, P_ZPZ, P_SWXR, P_SRHR, P_ZPR, P_SRHAB, P_ZPAB, P_ZPROUT, P_SRRH,
 P_ZPRRH, P_SWXG, P_SRRHG, P_ZPG, P_ZPZOUT, P_ONE, P_ZPGOUT, P_SOLD, P_ZPOLD, P_SNEW, P_ZPNEW, P_SOH, P_SNH,
 NP) = range(28)
# per-channel parameters per direction (int64 array pch[D, 10H]): shifts of W x and R h (3H each), then the
# folded bias terms cz, cr (both biases of z_pre / r_pre), cbg (bx_g for g_pre), cbr (br_g for Rh_add_br)
PC = 10


@cuda.jit(device=True, inline=True)
def rsh(v, s):
    """gru_int.rshift: v 2^-s rounded half up (s > 0), exact left shift (s <= 0), 0 for s >= 63."""
    if s <= 0:
        return v << (-s)
    if s >= 63:
        return int64(0)
    return (v + (int64(1) << (s - 1))) >> s


@cuda.jit(device=True, inline=True)
def sat(v, lo, hi):
    """v clamped to [lo, hi] (gru_int's saturation)."""
    return min(max(v, lo), hi)


def scalar_params(a: gru_int.GRUAttrs):
    """Kernel parameters from the validated attributes alone (kernel-lifetime state): prm int64 [D, NP],
    qsc float64 [D, 2] (2^e_x, 2^e_h), dq float32 [D] (2^-e_h)."""
    d = a.num_directions
    prm = np.zeros((d, NP), np.int64)
    qsc = np.zeros((d, 2), np.float64)
    dq = np.zeros(d, np.float32)
    for k in range(d):
        E = {n: int(a.exponents[k, Q[n]]) for n in gru_int.QUANTITIES}
        Z = {n: int(a.zero_points[k, Q[n]]) for n in gru_int.QUANTITIES}
        p = prm[k]
        p[P_ZPX], p[P_ZPH], p[P_ZPWX], p[P_ZPRH] = Z["x"], Z["h"], Z["Wx"], Z["Rh"]
        p[P_SWXZ], p[P_SRHZ], p[P_ZPZ] = E["Wx"] - E["z_pre"], E["Rh"] - E["z_pre"], Z["z_pre"]
        p[P_SWXR], p[P_SRHR], p[P_ZPR] = E["Wx"] - E["r_pre"], E["Rh"] - E["r_pre"], Z["r_pre"]
        p[P_SRHAB], p[P_ZPAB], p[P_ZPROUT] = E["Rh"] - E["Rh_add_br"], Z["Rh_add_br"], Z["r_out"]
        p[P_SRRH], p[P_ZPRRH] = E["r_out"] + E["Rh_add_br"] - E["rRh"], Z["rRh"]
        p[P_SWXG], p[P_SRRHG], p[P_ZPG] = E["Wx"] - E["g_pre"], E["rRh"] - E["g_pre"], Z["g_pre"]
        p[P_ZPZOUT], p[P_ONE], p[P_ZPGOUT] = Z["z_out"], 1 << E["z_out"], Z["g_out"]
        p[P_SOLD], p[P_ZPOLD] = E["z_out"] + E["h"] - E["old"], Z["old"]
        p[P_SNEW], p[P_ZPNEW] = E["z_out"] + E["g_out"] - E["new"], Z["new"]
        p[P_SOH], p[P_SNH] = E["old"] - E["h"], E["new"] - E["h"]
        qsc[k] = np.ldexp(1.0, E["x"]), np.ldexp(1.0, E["h"])
        dq[k] = np.float32(np.ldexp(1.0, -E["h"]))
    return prm, qsc, dq
