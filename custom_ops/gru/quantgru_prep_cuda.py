"""QuantGRU, CUDA face: the call's parameters -- the host reference and the per-call device kernel ``prep``.

Parameters that depend on the attributes alone (common_cuda.scalar_params: zero points, scalar shifts, 2^e_x,
2^e_h, 2^-e_h) are made once per node and kept on the device (quantgru_cuda.Params). What the recurrence needs
from B and channel_exp -- the per-channel shifts of W x and R h and the folded bias terms, pch int64 [D, 10H] --
is computed on the device at the start of every call from the call's B and channel_exp in device memory, exactly
as the host reference ``channel_params`` (bit-identical on valid inputs: tests/test_gru_ort_cuda.py), so a call never
copies values to the host. The same launch writes the sequence lengths the recurrence reads and zeroes the
barrier counters, so a call depends on no state left by an earlier one: its launches are a function of the
shapes (a native plan, a CUDA graph) and everything it writes lives in the call's scratch.

Values the host cannot check without reading them (compute checks attributes, shapes and dtypes) and the kernel
cannot reject (docs/gru.md):

* a channel exponent below its target (a per-channel rescale that would be a left shift), however far: every
  per-channel shift is clamped to >= 0, so no shift is undefined; entries outside -62..62 that leave the shift
  >= 0 are used as they are (shifts >= 63 give 0); values that pass the reference's checks give exactly its
  parameters.
* sequence_lens outside 0..T: clamped to 0..T, so the recurrence never indexes past the sequence.

One thread per (direction, channel c in 0..3H), also the thread of batch row c (lengths) and of group c
(counters): one small launch of D 3H threads (40 registers on sm_90, benchmarks/sass.py). Not timed on a GPU yet.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint64

from onnx_lowbit import gru_int
from onnx_lowbit.gru_int import CH_BR, CH_BX, CH_R, CH_W, Q

from ..device.launch import Array
from ..device.target import SIM
from .common_cuda import PC, rsh, scalar_params

TPB = 32 if SIM else 256
NQ = gru_int.NQ
QX, QH, QWX, QRH, QZP, QRP, QGP, QAB = (Q[n] for n in ("x", "h", "Wx", "Rh", "z_pre", "r_pre", "g_pre",
                                                         "Rh_add_br"))


# ---------------------------------------------------------------------------------------------------- host
def channel_params(a: gru_int.GRUAttrs, B, channel_exp):
    """pch int64 [D, 10H] from the host values of B [D, 6H] and channel_exp [D, 4, 3H] (validated): the shifts of
    W x and R h (3H each), then cz, cr (both biases of z_pre / r_pre), cbg (bx_g), cbr (br_g for Rh_add_br).
    The reference of the device kernel that computes them per call (quantgru_prep_cuda.prep)."""
    d, h = a.num_directions, a.hidden_size
    pch = np.zeros((d, PC * h), np.int64)
    B = np.asarray(B, np.int64)
    ce = np.asarray(channel_exp, np.int64)
    for k in range(d):
        E = {n: int(a.exponents[k, Q[n]]) for n in gru_int.QUANTITIES}
        c = pch[k]
        c[:3 * h] = ce[k, CH_W] + E["x"] - E["Wx"]
        c[3 * h:6 * h] = ce[k, CH_R] + E["h"] - E["Rh"]
        bx, br, cbx, cbr = B[k, :3 * h], B[k, 3 * h:], ce[k, CH_BX], ce[k, CH_BR]
        zs, rs_, gs = slice(0, h), slice(h, 2 * h), slice(2 * h, 3 * h)
        c[6 * h:7 * h] = (gru_int.rshift(bx[zs], cbx[zs] - E["z_pre"]) + gru_int.rshift(br[zs], cbr[zs] - E["z_pre"]))
        c[7 * h:8 * h] = (gru_int.rshift(bx[rs_], cbx[rs_] - E["r_pre"])
                          + gru_int.rshift(br[rs_], cbr[rs_] - E["r_pre"]))
        c[8 * h:9 * h] = gru_int.rshift(bx[gs], cbx[gs] - E["g_pre"])
        c[9 * h:] = gru_int.rshift(br[gs], cbr[gs] - E["Rh_add_br"])
    return pch


def prepare(a: gru_int.GRUAttrs, B, channel_exp):
    """(prm, pch, qsc, dq) on the host: scalar_params and channel_params."""
    prm, qsc, dq = scalar_params(a)
    return prm, channel_params(a, B, channel_exp), qsc, dq


def standin_channel_exp(a: gru_int.GRUAttrs):
    """A channel_exp [D, 4, 3H] for gru_int.check_inputs where only the shapes are known (compute: the values stay
    on the device): every row at the smallest exponent the checks allow (each per-channel rescale a shift by 0),
    at least -62. It passes the value checks whenever any channel_exp does, so compute rejects what check_inputs
    would reject whatever the values."""
    d, h = a.num_directions, a.hidden_size
    ce = np.zeros((d, 4, 3 * h), np.int64)
    for k in range(d):
        E = {n: int(a.exponents[k, Q[n]]) for n in gru_int.QUANTITIES}
        ce[k, CH_W] = E["Wx"] - E["x"]
        ce[k, CH_R] = E["Rh"] - E["h"]
        ce[k, CH_BX] = np.repeat([E["z_pre"], E["r_pre"], E["g_pre"]], h)
        ce[k, CH_BR] = np.repeat([E["z_pre"], E["r_pre"], E["Rh_add_br"]], h)
    return np.maximum(ce, -gru_int.MAX_EXP).astype(np.int32)


# ---------------------------------------------------------------------------------------------------- device
@cuda.jit
def prep(b, ce, seql, ex, pch, lens, cnt, dirs, hd, n_dim, t_dim, groups, has_lens):
    """b int32 [D*6H] (bx then br), ce int32 [D*4*3H] (channel_exp), seql int32 [N] (sequence_lens; read when
    has_lens), ex int64 [D*NQ] (the exponents attribute) -> pch int64 [D*10H] (shifts of W x, R h; cz, cr, cbg,
    cbr: channel_params), lens int32 [N] (seql clamped to 0..T, or T), cnt uint64 [groups] = 0."""
    i = cuda.grid(1)
    g3 = 3 * hd
    if i < dirs * g3:
        d = i // g3
        j = i - d * g3
        eb = d * NQ
        cb = d * 4 * g3 + j
        pb = d * PC * hd
        zero = int64(0)
        pch[pb + j] = max(int64(ce[cb + CH_W * g3]) + ex[eb + QX] - ex[eb + QWX], zero)
        pch[pb + g3 + j] = max(int64(ce[cb + CH_R * g3]) + ex[eb + QH] - ex[eb + QRH], zero)
        bx = int64(b[d * 2 * g3 + j])
        br = int64(b[d * 2 * g3 + g3 + j])
        cbx = int64(ce[cb + CH_BX * g3])
        cbr = int64(ce[cb + CH_BR * g3])
        gate = j // hd
        u = j - gate * hd
        if gate < 2:                            # z, r: both biases at the pre-activation's exponent
            et = ex[eb + QZP] if gate == 0 else ex[eb + QRP]
            pch[pb + (6 + gate) * hd + u] = rsh(bx, max(cbx - et, zero)) + rsh(br, max(cbr - et, zero))
        else:                                   # g: bx at g_pre's, br at Rh_add_br's
            pch[pb + 8 * hd + u] = rsh(bx, max(cbx - ex[eb + QGP], zero))
            pch[pb + 9 * hd + u] = rsh(br, max(cbr - ex[eb + QAB], zero))
    if i < n_dim:
        v = int64(t_dim)
        if has_lens:
            v = min(max(int64(seql[i]), int64(0)), int64(t_dim))
        lens[i] = int32(v)
    if i < groups:
        cnt[i] = uint64(0)


def signature():
    return [Array(np.int32), Array(np.int32), Array(np.int32), Array(np.int64), Array(np.int64), Array(np.int32),
            Array(np.uint64)] + ["int64"] * 6


def grid(dirs, h, n, groups):
    """Blocks of TPB threads covering D 3H channels, N batch rows and the groups' counters."""
    return -(-max(dirs * 3 * h, n, groups, 1) // TPB)
