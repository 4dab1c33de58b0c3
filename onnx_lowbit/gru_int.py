"""QuantGRU reference semantics: the pure fixed-point GRU (the seed's haste formulation = ONNX GRU with
linear_before_reset=1, gates z, r, h). This module defines the integer pipeline, its rounding and saturation,
once; the CPU and CUDA kernels are bit-exact with ``quant_gru``. Spec: docs/gru.md.

Rounding and saturation (the only two roundings of the op):

* float -> integer (X and initial_h at entry, table building): ``rint`` (round half to even) of x * 2^e, computed
  exactly (a power-of-two scale), clamped to [qmin - zp, qmax - zp], then + zp. NaN counts as 0.
* integer rescale by 2^-s (``rshift``): s > 0: floor((v + 2^(s-1)) / 2^s) (round half up, i.e. towards +inf;
  an add and an arithmetic shift; s >= 63 gives 0 for |v| < 2^62); s <= 0: v * 2^-s (exact left shift).
* saturation (``sat``): clamp to the `bits`-wide signed range [-2^(bits-1), 2^(bits-1) - 1]; applied once to every
  named quantity after its zero point is added.

All arithmetic is exact integer arithmetic (int64 here); docs/gru.md gives the bounds that let kernels use
int32 where it suffices.
"""
from __future__ import annotations

import numpy as np

# The scalar quantities (order of the ``exponents`` / ``zero_points`` attributes, per direction).
QUANTITIES = ("x", "h", "Wx", "Rh", "z_pre", "r_pre", "g_pre", "z_out", "r_out", "g_out",
              "Rh_add_br", "rRh", "old", "new")
NQ = len(QUANTITIES)
Q = {name: i for i, name in enumerate(QUANTITIES)}
# Per-channel exponent rows of ``channel_exp`` [D, 4, 3H].
CH_W, CH_R, CH_BX, CH_BR = 0, 1, 2, 3
# Table scheme: index = (q - qmin) >> LUT_SHIFT, linear interpolation on the low LUT_SHIFT bits.
LUT_SHIFT = {8: 0, 16: 6}
MAX_LEFT_SHIFT = 8       # every scalar shift s satisfies s >= -MAX_LEFT_SHIFT; per-channel shifts are >= 0
MAX_EXP = 62             # |exponent| bound checked by ``check``
DIRECTIONS = ("forward", "reverse", "bidirectional")
QTYPES = {8: np.int8, 16: np.int16}


def qrange(bits: int):
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def lut_len(bits: int) -> int:
    return ((1 << bits) >> LUT_SHIFT[bits]) + 1


# ---------------------------------------------------------------------------------------------------- primitives
def sat(v, bits: int):
    lo, hi = qrange(bits)
    return np.clip(v, lo, hi)


def rshift(v, s):
    """v * 2^-s rounded half up (s > 0), exact for s <= 0. v int64 array, s int scalar or broadcastable int array."""
    v = np.asarray(v, np.int64)
    s = np.asarray(s, np.int64)
    if s.ndim == 0:
        s = int(s)
        if s <= 0:
            return v << np.int64(-s)
        if s >= 63:
            return np.zeros_like(v)
        return (v + np.int64(1 << (s - 1))) >> np.int64(s)
    left = v << np.clip(-s, 0, 62)
    sr = np.clip(s, 1, 62)
    right = (v + (np.int64(1) << (sr - 1))) >> sr
    right = np.where(s >= 63, 0, right)
    return np.where(s <= 0, left, right)


def quantize(x, e: int, zp: int, bits: int) -> np.ndarray:
    """float -> integer: rint(x * 2^e) clamped to [qmin - zp, qmax - zp], + zp (int64). NaN -> zp."""
    lo, hi = qrange(bits)
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.rint(np.ldexp(np.asarray(x, np.float64), int(e)))
    v = np.nan_to_num(v, nan=0.0, posinf=float(hi - zp), neginf=float(lo - zp))
    return np.clip(v, lo - zp, hi - zp).astype(np.int64) + zp


def dequantize(q, e: int, zp: int) -> np.ndarray:
    """(q - zp) * 2^-e as float32 (exact: |q - zp| < 2^24)."""
    return np.ldexp((np.asarray(q, np.int64) - zp).astype(np.float64), -int(e)).astype(np.float32)


def lut(q, table, bits: int):
    """Table lookup of a saturated `bits`-wide q: u = q - qmin, i = u >> S, f = u & (2^S - 1),
    y = T[i] + rshift((T[i+1] - T[i]) * f, S)  (S = LUT_SHIFT[bits]; S = 0: y = T[u])."""
    s = LUT_SHIFT[bits]
    t = np.asarray(table, np.int64)
    u = np.asarray(q, np.int64) - qrange(bits)[0]
    if s == 0:
        return t[u]
    i, f = u >> s, u & ((1 << s) - 1)
    return t[i] + rshift((t[i + 1] - t[i]) * f, s)


# ---------------------------------------------------------------------------------------------------- one step
def step(qWx, qh, Rq, R_rowsum, bx, br, ch, tables, e, z, bits):
    """One time step for one direction. qWx [N, 3H] (the step's quantised Wx), qh [N, H]; returns q_h_new [N, H].

    ch: the direction's channel_exp [4, 3H]; e, z: its 14 exponents / zero points (indexed by Q)."""
    H = qh.shape[1]
    zs, rs, gs_ = slice(0, H), slice(H, 2 * H), slice(2 * H, 3 * H)
    E = lambda n: int(e[Q[n]])  # noqa: E731
    Z = lambda n: int(z[Q[n]])  # noqa: E731
    acc = (qh.astype(np.float64) @ Rq.T.astype(np.float64)).astype(np.int64)   # exact: |sum| < 2^53
    qRh = sat(rshift(acc - Z("h") * R_rowsum, ch[CH_R] + E("h") - E("Rh")) + Z("Rh"), bits)
    dWx, dRh = qWx - Z("Wx"), qRh - Z("Rh")

    def pre(sl, name):
        return sat(rshift(dWx[:, sl], E("Wx") - E(name)) + rshift(dRh[:, sl], E("Rh") - E(name))
                   + rshift(bx[sl], ch[CH_BX, sl] - E(name)) + rshift(br[sl], ch[CH_BR, sl] - E(name))
                   + Z(name), bits)

    qz = lut(pre(zs, "z_pre"), tables[0], bits)
    qr = lut(pre(rs, "r_pre"), tables[1], bits)
    q_rb = sat(rshift(dRh[:, gs_], E("Rh") - E("Rh_add_br")) + rshift(br[gs_], ch[CH_BR, gs_] - E("Rh_add_br"))
               + Z("Rh_add_br"), bits)
    q_rrh = sat(rshift((qr - Z("r_out")) * (q_rb - Z("Rh_add_br")), E("r_out") + E("Rh_add_br") - E("rRh"))
                + Z("rRh"), bits)
    q_gpre = sat(rshift(dWx[:, gs_], E("Wx") - E("g_pre")) + rshift(q_rrh - Z("rRh"), E("rRh") - E("g_pre"))
                 + rshift(bx[gs_], ch[CH_BX, gs_] - E("g_pre")) + Z("g_pre"), bits)
    qg = lut(q_gpre, tables[2], bits)
    q_old = sat(rshift((qz - Z("z_out")) * (qh - Z("h")), E("z_out") + E("h") - E("old")) + Z("old"), bits)
    omz = (1 << E("z_out")) - (qz - Z("z_out"))          # (1 - z) * 2^e_z, reusing z's scale (not saturated)
    q_new = sat(rshift(omz * (qg - Z("g_out")), E("z_out") + E("g_out") - E("new")) + Z("new"), bits)
    return sat(rshift(q_old - Z("old"), E("old") - E("h")) + rshift(q_new - Z("new"), E("new") - E("h"))
               + Z("h"), bits)


def input_gemm(qx, Wq, W_rowsum, chW, e, z, bits):
    """qWx for all steps: qx [T, N, C] -> [T, N, 3H]: sat(rshift(W qx - zp_x rowsum(W), eW + e_x - e_Wx) + zp_Wx)."""
    acc = (qx.astype(np.float64) @ Wq.T.astype(np.float64)).astype(np.int64)   # exact: |sum| < 2^53
    return sat(rshift(acc - int(z[Q["x"]]) * W_rowsum, chW + int(e[Q["x"]]) - int(e[Q["Wx"]])) + int(z[Q["Wx"]]),
               bits)


# ---------------------------------------------------------------------------------------------------- the op
class GRUAttrs:
    """Validated attributes of a QuantGRU node (ValueError naming the problem)."""

    def __init__(self, hidden_size, bits, exponents, zero_points, direction="forward", layout=0):
        if isinstance(direction, bytes):
            direction = direction.decode()
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
        if bits not in LUT_SHIFT:
            raise ValueError(f"bits must be 8 or 16, got {bits}")
        if layout not in (0, 1):
            raise ValueError(f"layout must be 0 or 1, got {layout}")
        if not isinstance(hidden_size, (int, np.integer)) or not 1 <= hidden_size <= (1 << 15):
            raise ValueError(f"hidden_size must be in 1..32768, got {hidden_size}")
        self.hidden_size, self.bits, self.direction, self.layout = int(hidden_size), int(bits), direction, int(layout)
        self.num_directions = 2 if direction == "bidirectional" else 1
        d = self.num_directions
        e = np.asarray(list(exponents), np.int64)
        z = np.asarray(list(zero_points), np.int64)
        if e.shape != (d * NQ,) or z.shape != (d * NQ,):
            raise ValueError(f"exponents and zero_points must hold {d} x {NQ} = {d * NQ} ints "
                             f"({', '.join(QUANTITIES)} per direction), got {e.size} and {z.size}")
        self.exponents, self.zero_points = e.reshape(d, NQ), z.reshape(d, NQ)
        lo, hi = qrange(bits)
        for k in range(d):
            for i, name in enumerate(QUANTITIES):
                if not -MAX_EXP <= self.exponents[k, i] <= MAX_EXP:
                    raise ValueError(f"exponent of {name} (direction {k}) out of range: {self.exponents[k, i]}")
                if not lo <= self.zero_points[k, i] <= hi:
                    raise ValueError(f"zero point of {name} (direction {k}) outside the int{bits} range: "
                                     f"{self.zero_points[k, i]}")
            ee = {n: int(self.exponents[k, Q[n]]) for n in QUANTITIES}
            if not 0 <= ee["z_out"] <= bits:
                raise ValueError(f"exponent of z_out (direction {k}) must be in 0..{bits}, got {ee['z_out']}")
            if self.zero_points[k, Q["g_out"]] != 0:
                raise ValueError(f"g_out is symmetric: its zero point must be 0 (direction {k})")
            for a, b, s in scalar_shifts(ee):
                if s < -MAX_LEFT_SHIFT:
                    raise ValueError(f"rescale {a} -> {b} (direction {k}) is a left shift by {-s} bits; at most "
                                     f"{MAX_LEFT_SHIFT} are allowed (exponents {ee[a] if a in ee else a}, {ee[b]})")


def scalar_shifts(ee: dict):
    """(source, target, shift) of every rescale between scalar quantities (shift = e_source terms - e_target)."""
    return [("Wx", "z_pre", ee["Wx"] - ee["z_pre"]), ("Rh", "z_pre", ee["Rh"] - ee["z_pre"]),
            ("Wx", "r_pre", ee["Wx"] - ee["r_pre"]), ("Rh", "r_pre", ee["Rh"] - ee["r_pre"]),
            ("Rh", "Rh_add_br", ee["Rh"] - ee["Rh_add_br"]),
            ("r_out*Rh_add_br", "rRh", ee["r_out"] + ee["Rh_add_br"] - ee["rRh"]),
            ("Wx", "g_pre", ee["Wx"] - ee["g_pre"]), ("rRh", "g_pre", ee["rRh"] - ee["g_pre"]),
            ("z_out*h", "old", ee["z_out"] + ee["h"] - ee["old"]),
            ("z_out*g_out", "new", ee["z_out"] + ee["g_out"] - ee["new"]),
            ("old", "h", ee["old"] - ee["h"]), ("new", "h", ee["new"] - ee["h"])]


def check_inputs(a: GRUAttrs, X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None):
    """Shapes and dtypes of the inputs (ValueError naming the problem). Returns (T, N, C)."""
    d, h, bits = a.num_directions, a.hidden_size, a.bits
    qt = np.dtype(QTYPES[bits])
    if X.ndim != 3:
        raise ValueError(f"X must have rank 3, got shape {list(X.shape)}")
    t, n = (X.shape[0], X.shape[1]) if a.layout == 0 else (X.shape[1], X.shape[0])
    c = X.shape[2]
    want = {"W": ((d, 3 * h, c), qt, W), "R": ((d, 3 * h, h), qt, R), "B": ((d, 6 * h), np.dtype(np.int32), B),
            "channel_exp": ((d, 4, 3 * h), np.dtype(np.int32), channel_exp),
            "luts": ((d, 3, lut_len(bits)), qt, luts)}
    for name, (shape, dt, v) in want.items():
        if v is None:
            raise ValueError(f"input {name} is missing")
        if tuple(v.shape) != shape:
            raise ValueError(f"input {name} must have shape {list(shape)} (D={d}, H={h}, C={c}), got {list(v.shape)}")
        if np.dtype(v.dtype) != dt:
            raise ValueError(f"input {name} must be {dt} for bits={bits}, got {np.dtype(v.dtype)}")
    if sequence_lens is not None:
        if tuple(sequence_lens.shape) != (n,):
            raise ValueError(f"sequence_lens must have shape [{n}], got {list(sequence_lens.shape)}")
        if np.any(sequence_lens < 0) or np.any(sequence_lens > t):
            raise ValueError(f"sequence_lens must be in 0..{t}, got {sequence_lens.tolist()}")
    if initial_h is not None:
        shape = (d, n, h) if a.layout == 0 else (n, d, h)
        if tuple(initial_h.shape) != shape:
            raise ValueError(f"initial_h must have shape {list(shape)}, got {list(initial_h.shape)}")
    ce = np.asarray(channel_exp)
    if ce.size and (ce.min() < -MAX_EXP or ce.max() > MAX_EXP):
        raise ValueError(f"channel_exp values must be in -{MAX_EXP}..{MAX_EXP}")
    for k in range(d):
        e = a.exponents[k]
        checks = [("W x", ce[k, CH_W] + e[Q["x"]] - e[Q["Wx"]]), ("R h", ce[k, CH_R] + e[Q["h"]] - e[Q["Rh"]]),
                  ("bx_z", ce[k, CH_BX, :h] - e[Q["z_pre"]]), ("bx_r", ce[k, CH_BX, h:2 * h] - e[Q["r_pre"]]),
                  ("bx_g", ce[k, CH_BX, 2 * h:] - e[Q["g_pre"]]), ("br_z", ce[k, CH_BR, :h] - e[Q["z_pre"]]),
                  ("br_r", ce[k, CH_BR, h:2 * h] - e[Q["r_pre"]]),
                  ("br_g", ce[k, CH_BR, 2 * h:] - e[Q["Rh_add_br"]])]
        for name, s in checks:
            if s.size and s.min() < 0:
                raise ValueError(f"per-channel rescale of {name} (direction {k}) must be a right shift "
                                 f"(channel exponent >= target exponent); smallest shift {int(s.min())}")
    return t, n, c


def quant_gru(X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
              exponents, zero_points, direction="forward", layout=0):
    """The QuantGRU op: returns (Y, Y_h) float32 with ONNX GRU shapes for ``layout``.

    Y at steps t >= sequence_lens[n] is 0; Y_h is the state after the last valid step (0 if length 0, as onnxruntime)."""
    a = GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
    X = np.asarray(X, np.float32)
    t, n, c = check_inputs(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)
    d, h = a.num_directions, a.hidden_size
    x = X if layout == 0 else X.transpose(1, 0, 2)                                   # [T, N, C]
    h0 = None if initial_h is None else (initial_h if layout == 0 else initial_h.transpose(1, 0, 2))
    lens = np.full(n, t, np.int64) if sequence_lens is None else np.asarray(sequence_lens, np.int64)
    Y = np.zeros((t, d, n, h), np.float32)
    Yh = np.zeros((d, n, h), np.float32)
    for k in range(d):
        reverse = direction == "reverse" or k == 1
        qh_seq, qh_last = run_direction(a, k, x, W[k], R[k], B[k], channel_exp[k], luts[k], lens,
                                        None if h0 is None else h0[k], reverse)
        e_h, z_h = int(a.exponents[k, Q["h"]]), int(a.zero_points[k, Q["h"]])
        valid = np.arange(t)[:, None] < lens[None, :]                                  # [T, N]
        Y[:, k] = np.where(valid[:, :, None], dequantize(qh_seq, e_h, z_h), 0.0)
        Yh[k] = np.where((lens > 0)[:, None], dequantize(qh_last, e_h, z_h), 0.0)
    if layout == 1:
        return Y.transpose(2, 0, 1, 3).copy(), Yh.transpose(1, 0, 2).copy()
    return Y, Yh


def run_direction(a: GRUAttrs, k, x, Wq, Rq, B, ch, tables, lens, h0, reverse):
    """Integer states of one direction: (qh [T, N, H] at each step, its own time index; q_h after the last
    valid step [N, H]). Batch entry n runs steps 0..lens[n]-1 (reverse: lens[n]-1 down to 0)."""
    t, n, _ = x.shape
    h, bits = a.hidden_size, a.bits
    e, z = a.exponents[k], a.zero_points[k]
    qx = quantize(x, e[Q["x"]], z[Q["x"]], bits)
    Wq, Rq = Wq.astype(np.int64), Rq.astype(np.int64)
    qWx = input_gemm(qx, Wq, Wq.sum(1), ch[CH_W].astype(np.int64), e, z, bits)
    B = B.astype(np.int64)
    bx, br = B[:3 * h], B[3 * h:]
    chl = ch.astype(np.int64)
    qh = (np.full((n, h), z[Q["h"]], np.int64) if h0 is None
          else quantize(h0, e[Q["h"]], z[Q["h"]], bits))
    out = np.zeros((t, n, h), np.int64)
    r_rowsum = Rq.sum(1)
    tables = np.asarray(tables, np.int64)
    for s in range(t):
        active = s < lens                                                              # [N]
        if not active.any():
            continue
        # forward: time index s; reverse: batch entry n is at time lens[n] - 1 - s
        ti = np.full(n, s) if not reverse else np.maximum(lens - 1 - s, 0)
        qwx = qWx[ti, np.arange(n)]
        new = step(qwx, qh, Rq, r_rowsum, bx, br, chl, tables, e, z, bits)
        qh = np.where(active[:, None], new, qh)
        out[ti[active], np.arange(n)[active]] = new[active]
    return out, qh
