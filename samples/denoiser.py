"""Audio helpers of the speech-denoiser test material (numpy only; tests/data/denoiser*, samples/make_denoiser.py).

16 kHz audio, 512-point STFT with a sqrt-Hann window and hop 256 (perfect reconstruction), 257 bins.
The model's input is the log10 power spectrum (no normalisation, as nsnet-style models take it), [N, T, 257];
its output a [N, T, 257] mask in 0..1 applied to the noisy spectrum.

    feats = features(noisy)                        # [T, 257] float32
    den = enhance(noisy, mask)                     # waveform from the masked noisy spectrum
    snr_db(clean, den)                             # 10 log10(|s|^2 / |s - s_hat|^2) over the common samples
"""
from __future__ import annotations

import numpy as np

SR, NFFT, HOP = 16000, 512, 256
BINS = NFFT // 2 + 1
WINDOW = np.sqrt(0.5 - 0.5 * np.cos(2 * np.pi * np.arange(NFFT) / NFFT))   # periodic sqrt-Hann


def stft(x):
    """[T, 257] complex spectrum of a waveform (zero-padded to whole frames)."""
    x = np.asarray(x, np.float64)
    n = max(1, int(np.ceil((len(x) - NFFT) / HOP)) + 1)
    pad = np.zeros((n - 1) * HOP + NFFT)
    pad[:len(x)] = x
    idx = np.arange(NFFT)[None, :] + HOP * np.arange(n)[:, None]
    return np.fft.rfft(pad[idx] * WINDOW, axis=1)


def istft(spec, length=None):
    frames = np.fft.irfft(spec, n=NFFT, axis=1) * WINDOW
    out = np.zeros((len(spec) - 1) * HOP + NFFT)
    for t, f in enumerate(frames):
        out[t * HOP:t * HOP + NFFT] += f
    return out if length is None else out[:length]


def features(x):
    """log10 power spectrum [T, 257] float32."""
    return np.log10(np.abs(stft(x)) ** 2 + 1e-12).astype(np.float32)


def enhance(noisy, mask):
    """The waveform of mask [T, 257] times the noisy spectrum."""
    return istft(stft(noisy) * np.asarray(mask, np.float64), len(noisy))


def snr_db(clean, est):
    """SNR of ``est`` against ``clean``, skipping the first and last frame (window edges)."""
    clean, est = np.asarray(clean, np.float64), np.asarray(est, np.float64)
    n = min(len(clean), len(est))
    s, e = clean[HOP:n - NFFT], est[HOP:n - NFFT]
    return float(10 * np.log10(np.sum(s ** 2) / max(np.sum((s - e) ** 2), 1e-30)))
