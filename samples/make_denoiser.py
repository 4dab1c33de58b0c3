"""Builds the speech-denoiser test material of tests/test_gru_denoiser.py (not run by the tests; ~3 min of CPU).

    apt-get install espeak-ng            # the speech synthesiser
    python samples/make_denoiser.py      # writes tests/data/denoiser.onnx and tests/data/denoiser_audio.npz

Speech: espeak-ng sentences in several voices, speeds and pitches (16 kHz). Noise: white, pink, and babble (a
sum of 3-4 other synthesised utterances), mixed at 0-15 dB SNR. The model (nsnet-style, samples/denoiser.py):
log10 power spectrum [N, T, 257] -> GRU 257 -> 128 -> GRU 128 -> 128 -> Linear 128 -> 257 -> sigmoid mask,
trained briefly (Adam, compressed-magnitude MSE of the masked noisy spectrum against the clean one) on mixtures of
training sentences, exported with torch.onnx.export (TorchScript exporter, opset 17; input "x" [N, T, 257],
output "mask"). denoiser_audio.npz holds int16 waveforms of mixtures of sentences never used in training:
``cal_clean_K`` / ``cal_noisy_K`` (calibration) and ``test_clean_K`` / ``test_noisy_K`` (held out), and
``*_snr`` / ``*_noise`` descriptions.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
import time
import warnings
import wave

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from samples import denoiser as dn  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data")
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "Please call Stella and ask her to bring these things.",
    "She sells sea shells by the sea shore every summer.", "A large fawn jumped quickly over white zinc boxes.",
    "We will meet at the station at half past seven tomorrow.", "The weather today is cloudy with a chance of rain.",
    "Turn left at the second traffic light and keep going.", "My grandmother baked bread every Sunday morning.",
    "Numbers like forty two and nineteen eighty four are famous.", "Open the window, it is getting warm in here.",
    "The committee approved the budget after a long debate.", "Bright stars shine above the quiet mountain lake.",
    "He forgot his umbrella on the bus again this week.", "Music fills the hall as the orchestra begins to play.",
    "Could you repeat the last part of the message please?", "The children laughed while chasing bubbles outside.",
    "Engineers tested the bridge with heavy trucks overnight.", "Fresh coffee and warm toast make a good breakfast.",
    "The library closes early on public holidays.", "Seven silver swans swam silently through the mist.",
    "Remember to save your work before the battery runs out.", "A gentle breeze carried the smell of the ocean.",
    "The train to the airport leaves every fifteen minutes.", "Her voice echoed through the empty corridor.",
    "Thick fog delayed all flights until the afternoon.", "They painted the fence green and the door yellow.",
    "Every answer raised three new questions for the team.", "The old clock in the tower struck midnight.",
    "Quiet please, the recording starts in ten seconds.", "A hungry cat watched the birds from the windowsill.",
    "Snow covered the village during the long winter night.", "Our neighbours grow tomatoes, beans and pumpkins.",
    "The pilot announced a short delay before take off.", "Reading by candlelight strains the eyes after a while.",
    "Sharp rocks lined the narrow path along the cliff.", "The museum displays paintings from five centuries.",
]
VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-029", "en-us+f3", "en-gb+f2", "en-us+m5", "en-gb-x-rp+f4"]
N_TRAIN, N_CAL, N_TEST = 24, 6, 6   # sentences (disjoint): training, calibration, held-out
STEPS = 400


def speak(text, voice, speed, pitch):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.wav")
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "-w", path, text], check=True)
        with wave.open(path) as w:
            sr, raw = w.getframerate(), w.readframes(w.getnframes())
    x = np.frombuffer(raw, np.int16).astype(np.float64) / 32768
    if sr != dn.SR:   # espeak-ng voices speak at 22.05 kHz: resample (linear interpolation after a low-pass)
        spec = np.fft.rfft(x)
        spec[int(len(spec) * (dn.SR / 2) / (sr / 2)):] = 0
        x = np.fft.irfft(spec, len(x))
        x = np.interp(np.arange(int(len(x) * dn.SR / sr)) * sr / dn.SR, np.arange(len(x)), x)
    return x / (np.abs(x).max() + 1e-9) * 0.5


def noise(kind, n, rng, others):
    if kind == "white":
        return rng.standard_normal(n)
    if kind == "pink":
        spec = np.fft.rfft(rng.standard_normal(n))
        spec /= np.sqrt(np.maximum(np.arange(len(spec)), 1))
        return np.fft.irfft(spec, n)
    out = np.zeros(n)
    for k in rng.choice(len(others), size=int(rng.integers(3, 5)), replace=False):   # babble
        o = others[k]
        start = int(rng.integers(0, max(1, n - len(o))))
        seg = o[:n - start]
        out[start:start + len(seg)] += seg
    return out


def mix(clean, kind, snr, rng, others):
    nz = noise(kind, len(clean), rng, others)
    nz *= np.sqrt(np.sum(clean ** 2) / max(np.sum(nz ** 2), 1e-12) / 10 ** (snr / 10))
    noisy = clean + nz
    g = 0.9 / max(np.abs(noisy).max(), 1e-9)
    return clean * g, noisy * g


def utterances(rng, sentences):
    out = []
    for s in sentences:
        v = VOICES[int(rng.integers(len(VOICES)))]
        out.append(speak(s, v, int(rng.integers(140, 190)), int(rng.integers(30, 70))))
    return out


def main():
    import torch
    from torch import nn
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    train_s = utterances(rng, SENTENCES[:N_TRAIN]) + utterances(rng, SENTENCES[:N_TRAIN])
    cal_s = utterances(rng, SENTENCES[N_TRAIN:N_TRAIN + N_CAL])
    test_s = utterances(rng, SENTENCES[N_TRAIN + N_CAL:N_TRAIN + N_CAL + N_TEST])
    kinds = ["white", "pink", "babble"]

    feats, targets, mags = [], [], []
    for _ in range(6):
        for i, c in enumerate(train_s):
            others = train_s[:i] + train_s[i + 1:]
            cl, no = mix(c, kinds[int(rng.integers(3))], float(rng.uniform(0, 15)), rng, others)
            feats.append(dn.features(no))
            mags.append(np.abs(dn.stft(no)).astype(np.float32))
            targets.append(np.abs(dn.stft(cl)).astype(np.float32))

    class Net(nn.Module):
        def __init__(self, h=128):
            super().__init__()
            self.gru1 = nn.GRU(dn.BINS, h, batch_first=True)
            self.gru2 = nn.GRU(h, h, batch_first=True)
            self.fc = nn.Linear(h, dn.BINS)

        def forward(self, x):
            y, _ = self.gru1(x)
            y, _ = self.gru2(y)
            return torch.sigmoid(self.fc(y))

    net = Net()
    opt = torch.optim.Adam(net.parameters(), 2e-3)
    crop, batch = 96, 16
    torch.set_num_threads(2)
    t_start = time.time()
    for it in range(STEPS):
        xb, mb, tb = [], [], []
        for k in rng.integers(0, len(feats), batch):
            t0 = int(rng.integers(0, max(1, len(feats[k]) - crop)))
            sl = slice(t0, t0 + crop)
            f = np.zeros((crop, dn.BINS), np.float32) - 12
            m = np.zeros((crop, dn.BINS), np.float32)
            c = np.zeros((crop, dn.BINS), np.float32)
            n = len(feats[k][sl])
            f[:n], m[:n], c[:n] = feats[k][sl], mags[k][sl], targets[k][sl]
            xb.append(f), mb.append(m), tb.append(c)
        x, m, c = (torch.from_numpy(np.stack(v)) for v in (xb, mb, tb))
        loss = ((net(x) * m + 1e-6) ** 0.3 - (c + 1e-6) ** 0.3).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if it % 25 == 0:
            print(f"step {it} loss {loss.item():.4f} ({time.time() - t_start:.0f} s)", flush=True)
    net.eval()

    os.makedirs(OUT, exist_ok=True)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, 20, dn.BINS),), f, input_names=["x"], output_names=["mask"],
                          dynamo=False, opset_version=17, dynamic_axes={"x": {0: "n", 1: "t"}, "mask": {0: "n", 1: "t"}})
    with open(os.path.join(OUT, "denoiser.onnx"), "wb") as fh:
        fh.write(f.getvalue())

    arrays = {}
    for tag, ss in (("cal", cal_s), ("test", test_s)):
        for i, c in enumerate(ss):
            others = [o for o in train_s]   # babble from training speech only
            kind, snr = kinds[i % 3], float(rng.uniform(0, 15))
            cl, no = mix(c, kind, snr, rng, others)
            arrays[f"{tag}_clean_{i}"] = np.round(cl * 32767).astype(np.int16)
            arrays[f"{tag}_noisy_{i}"] = np.round(no * 32767).astype(np.int16)
            arrays[f"{tag}_noise_{i}"] = np.array(kind)
            arrays[f"{tag}_snr_{i}"] = np.array(snr, np.float32)
            with torch.no_grad():
                mask = net(torch.from_numpy(dn.features(no / 1.0)[None]))[0].numpy()
            print(f"{tag} {i}: {kind:6s} {snr:5.1f} dB in, denoised {dn.snr_db(cl, dn.enhance(no, mask)):5.1f} dB, "
                  f"noisy {dn.snr_db(cl, no):5.1f} dB")
    np.savez_compressed(os.path.join(OUT, "denoiser_audio.npz"), **arrays)


if __name__ == "__main__":
    main()
