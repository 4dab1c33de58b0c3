"""Float GRU reference with ONNX semantics (opset 14 GRU): gates z, r, h; linear_before_reset 0 and 1; forward,
reverse, bidirectional; layout 0 and 1; sequence_lens; initial_h; clip; default activations (sigmoid, tanh).

``gru(...)`` computes in float64 and returns float32 (Y, Y_h). With ``trace`` it calls
``trace(direction, step_values)`` once per time step with the float values of the seed's quantities for the
batch entries active at that step (calibration, onnx_lowbit.gru_quant):
x, h (the new state: the state entering the first step is often all 0), Wx, Rh (the GEMMs, no bias, all 3H), z_pre, r_pre, g_pre (after clip),
z_out, r_out, g_out, Rh_add_br (Rh_g + br_g), rRh (r * Rh_add_br), old (z * h), new ((1 - z) * g).
"""
from __future__ import annotations

import numpy as np


def _sigmoid(v):
    return 0.5 * (np.tanh(0.5 * v) + 1.0)


def gru(X, W, R, B=None, sequence_lens=None, initial_h=None, *, hidden_size=None, direction="forward", layout=0,
        linear_before_reset=0, clip=None, trace=None):
    X = np.asarray(X, np.float64)
    W, R = np.asarray(W, np.float64), np.asarray(R, np.float64)
    d = W.shape[0]
    h = R.shape[-1] if hidden_size is None else int(hidden_size)
    x = X if layout == 0 else X.transpose(1, 0, 2)
    t, n, _ = x.shape
    B = np.zeros((d, 6 * h)) if B is None else np.asarray(B, np.float64)
    lens = np.full(n, t, np.int64) if sequence_lens is None else np.asarray(sequence_lens, np.int64)
    if initial_h is None:
        h0 = np.zeros((d, n, h))
    else:
        h0 = np.asarray(initial_h, np.float64)
        h0 = h0 if layout == 0 else h0.transpose(1, 0, 2)
    Y = np.zeros((t, d, n, h))
    Yh = np.zeros((d, n, h))
    clipf = (lambda v: v) if clip is None else (lambda v: np.clip(v, -clip, clip))  # noqa: E731
    for k in range(d):
        reverse = direction == "reverse" or k == 1
        bx, br = B[k, :3 * h], B[k, 3 * h:]
        hs = h0[k].copy()
        for s in range(t):
            active = s < lens
            if not active.any():
                continue
            ti = np.full(n, s) if not reverse else np.maximum(lens - 1 - s, 0)
            xt = x[ti, np.arange(n)]
            wx = xt @ W[k].T
            rh = hs @ R[k].T
            z_pre = clipf(wx[:, :h] + rh[:, :h] + bx[:h] + br[:h])
            r_pre = clipf(wx[:, h:2 * h] + rh[:, h:2 * h] + bx[h:2 * h] + br[h:2 * h])
            z, r = _sigmoid(z_pre), _sigmoid(r_pre)
            if linear_before_reset:
                rb = rh[:, 2 * h:] + br[2 * h:]
                rrh = r * rb
            else:
                rb = (r * hs) @ R[k, 2 * h:].T + br[2 * h:]
                rrh = rb
            g_pre = clipf(wx[:, 2 * h:] + rrh + bx[2 * h:])
            g = np.tanh(g_pre)
            old, new = z * hs, (1.0 - z) * g
            hn = old + new
            if trace is not None:
                a = active
                trace(k, {"x": xt[a], "h": hn[a], "Wx": wx[a], "Rh": rh[a], "z_pre": z_pre[a], "r_pre": r_pre[a],
                          "g_pre": g_pre[a], "z_out": z[a], "r_out": r[a], "g_out": g[a], "Rh_add_br": rb[a],
                          "rRh": rrh[a], "old": old[a], "new": new[a]})
            hs = np.where(active[:, None], hn, hs)
            Y[ti[active], k, np.arange(n)[active]] = hn[active]
        Yh[k] = np.where((lens > 0)[:, None], hs, 0.0)          # onnxruntime: 0 for length-0 entries
    Y, Yh = Y.astype(np.float32), Yh.astype(np.float32)
    if layout == 1:
        return Y.transpose(2, 0, 1, 3).copy(), Yh.transpose(1, 0, 2).copy()
    return Y, Yh
