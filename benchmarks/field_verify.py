"""Real models, real inputs for `rewrite --verify` (issue 33): the inputs, and the task-level check of a rewrite.

    python benchmarks/field_verify.py inputs OUT            # OUT/*.npz (and PNGs of the rendered text lines / page)
    python benchmarks/field_verify.py check KIND ORIGINAL REWRITTEN DATA.npz   # KIND: rec cls det yolo den
    bash benchmarks/field_verify.sh                         # both, with every rewrite (paths: see the script)

Inputs: PP-OCRv4 det gets skimage.data.page() (a scanned page) preprocessed as rapidocr_onnxruntime's
DetPreProcess (limit_type min, 736; PIL bilinear resize in place of cv2); rec and the mobile direction classifier
get text lines rendered with PIL's default FreeType font (rec: TextRecognizer.resize_norm_img, one batch; cls:
48 x 192, upright and turned 180 degrees), AWQ's calibration other lines; the YOLOv8 layout detector (static 1024)
a rendered document page and skimage's astronaut, letterboxed as ultralytics does; the denoiser of tests/data the
6 calibration utterances as NAME#K runs and each held-out one; ddddocr's recogniser a rendered line, nudenet's
YOLOv8 (320n) matplotlib's sample photo letterboxed to 320 (inputs only: bench's agreement table compares them).
Checks: rec: strings by CTC greedy decode with the
model's own character list; cls: labels; det: connected regions of the map > 0.3; yolo: detections after
confidence 0.25 and per-class NMS 0.45; den: the mask's rel-L2. Needs scikit-image and scipy (not project deps).
"""
import math
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort

import onnx_lowbit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINES = ["Hello World 2026", "The quick brown fox jumps", "onnx-lowbit verify", "Invoice No. 4821-B"]


def inputs(OUT):  # noqa: N803
    from PIL import Image, ImageDraw, ImageFont
    import skimage.data as sd
    os.makedirs(OUT, exist_ok=True)

    def rgb(a):
        return np.stack([a] * 3, -1) if a.ndim == 2 else a[..., :3]

    def resize(img, w, h):
        return np.asarray(Image.fromarray(img).resize((w, h), Image.BILINEAR))

    # ---- det: rapidocr DetPreProcess (limit_type min, 736), BGR order (gray page: same), (x/255 - .5)/.5
    page = rgb(sd.page())
    h, w = page.shape[:2]
    ratio = 736 / min(h, w) if min(h, w) < 736 else 1.0
    rh, rw = int(round(int(h * ratio) / 32) * 32), int(round(int(w * ratio) / 32) * 32)
    x = (resize(page, rw, rh).astype(np.float32) / 255 - 0.5) / 0.5
    np.savez(f"{OUT}/det_page.npz", x=x.transpose(2, 0, 1)[None].astype(np.float32))

    # ---- text lines: rendered with PIL's default (FreeType) font, black on white, BGR
    font = ImageFont.load_default(size=32)
    crops = []
    for s in LINES:
        l, t, r, b = font.getbbox(s)
        im = Image.new("RGB", (r + 16, b - t + 16), "white")
        ImageDraw.Draw(im).text((8, 8 - t), s, font=font, fill="black")
        crops.append(np.asarray(im)[..., ::-1].copy())
    for i, c in enumerate(crops):
        Image.fromarray(c[..., ::-1]).save(f"{OUT}/line{i}.png")

    # rec: TextRecognizer.resize_norm_img, one batch, width 48 * max ratio
    max_ratio = max(320 / 48, max(c.shape[1] / c.shape[0] for c in crops))
    W = int(48 * max_ratio)
    batch = []
    for c in crops:
        hh, ww = c.shape[:2]
        rw_ = min(W, int(math.ceil(48 * ww / hh)))
        r_ = resize(c, rw_, 48).astype(np.float32).transpose(2, 0, 1) / 255
        pad = np.zeros((3, 48, W), np.float32)
        pad[:, :, :rw_] = (r_ - 0.5) / 0.5
        batch.append(pad)
    np.savez(f"{OUT}/rec_lines.npz", x=np.stack(batch))

    # cls: 3 x 48 x 192; the lines upright and rotated 180 degrees
    batch = []
    for c in crops + [np.ascontiguousarray(c[::-1, ::-1]) for c in crops]:
        hh, ww = c.shape[:2]
        rw_ = min(192, int(math.ceil(48 * ww / hh)))
        r_ = resize(c, rw_, 48).astype(np.float32).transpose(2, 0, 1) / 255
        pad = np.zeros((3, 48, 192), np.float32)
        pad[:, :, :rw_] = (r_ - 0.5) / 0.5
        batch.append(pad)
    np.savez(f"{OUT}/cls_lines.npz", x=np.stack(batch))

    # ---- YOLOv8 (doclaynet, static 1024): ultralytics LetterBox (centred, pad 114), RGB, /255, NCHW
    def letterbox(img, size=1024):
        h, w = img.shape[:2]
        r = min(size / h, size / w)
        nw, nh = int(round(w * r)), int(round(h * r))
        out = np.full((size, size, 3), 114, np.uint8)
        top, left = (size - nh) // 2, (size - nw) // 2
        out[top:top + nh, left:left + nw] = resize(img, nw, nh)
        return out

    def doc_page():
        """An A4-like page: a title, section headers, paragraphs, a picture (skimage's astronaut) with a caption."""
        im = Image.new("RGB", (850, 1100), "white")
        d = ImageDraw.Draw(im)
        big, mid, small = (ImageFont.load_default(size=s) for s in (40, 26, 16))
        d.text((70, 60), "Low-bit Inference on Real Models", font=big, fill="black")
        y = 140
        words = ("the rewritten model runs in a plain onnxruntime session and is checked against the original on the "
                 "same inputs so that a user can judge its outputs before deploying it ").split()
        for sec in ("1 Introduction", "2 Method"):
            d.text((70, y), sec, font=mid, fill="black"); y += 45
            for k in range(7):
                line = " ".join(words[(k * 5 + j) % len(words)] for j in range(12))
                d.text((70, y), line, font=small, fill="black"); y += 24
            y += 20
        pic = Image.fromarray(sd.astronaut()).resize((360, 360))
        im.paste(pic, (245, y)); y += 370
        d.text((245, y), "Figure 1: a photograph (skimage.data.astronaut).", font=small, fill="black")
        d.text((400, 1060), "3", font=small, fill="black")
        return np.asarray(im)

    doc = doc_page()
    Image.fromarray(doc).save(f"{OUT}/doc_page.png")
    for name, img in (("doc", doc), ("photo", sd.astronaut())):
        lb = letterbox(img)
        np.savez(f"{OUT}/yolo_{name}.npz", images=(lb.astype(np.float32) / 255).transpose(2, 0, 1)[None])

    # ---- denoiser: calibration = the 6 calibration utterances (x#K: one run each), verify = each held-out one
    sys.path.insert(0, ROOT)
    from samples import denoiser as dn  # noqa: E402
    with np.load(os.path.join(ROOT, "tests", "data", "denoiser_audio.npz")) as z:
        a = {k: z[k] for k in z.files}
    cal = {f"x#{k}": dn.features(a[f"cal_noisy_{k}"].astype(np.float64) / 32767)[None].astype(np.float32)
           for k in range(6) if f"cal_noisy_{k}" in a}
    np.savez(f"{OUT}/den_calib.npz", **cal)
    for k in range(6):
        if f"test_noisy_{k}" in a:
            f = dn.features(a[f"test_noisy_{k}"].astype(np.float64) / 32767)[None].astype(np.float32)
            np.savez(f"{OUT}/den_test{k}.npz", x=f)

    # ---- calibration lines for AWQ (other strings than the verify lines)
    CAL = ["Total amount due: 1,250.00", "Meeting at 10:30 in room B", "Python 3.11 release notes", "Page 7 of 12"]
    crops = []
    for s in CAL:
        l, t, r, b = font.getbbox(s)
        im = Image.new("RGB", (r + 16, b - t + 16), "white")
        ImageDraw.Draw(im).text((8, 8 - t), s, font=font, fill="black")
        crops.append(np.asarray(im)[..., ::-1].copy())
    max_ratio = max(320 / 48, max(c.shape[1] / c.shape[0] for c in crops)); W = int(48 * max_ratio)
    rb, cb = [], []
    for c in crops:
        hh, ww = c.shape[:2]
        for width, lst in ((W, rb), (192, cb)):
            rw_ = min(width, int(math.ceil(48 * ww / hh)))
            r_ = resize(c, rw_, 48).astype(np.float32).transpose(2, 0, 1) / 255
            pad = np.zeros((3, 48, width), np.float32); pad[:, :, :rw_] = (r_ - 0.5) / 0.5
            lst.append(pad)
    np.savez(f"{OUT}/rec_calib.npz", x=np.stack(rb))
    np.savez(f"{OUT}/cls_calib.npz", x=np.stack(cb + [p[:, ::-1, ::-1].copy() for p in cb]))
    # ---- ddddocr's recogniser (common.onnx): a rendered line as its OCR engine prepares it (grey, height 64, /255)
    img = Image.new("RGB", (30 + 26 * 8, 64), "white")
    ImageDraw.Draw(img).text((12, 8), "Xk7pQ2ab", fill=(20, 20, 20), font=ImageFont.load_default(size=40))
    np.savez(f"{OUT}/ocr_line.npz", input1=(np.asarray(img.convert("L"), np.float32) / 255)[None, None])
    # ---- nudenet's YOLOv8 (320n.onnx): matplotlib's sample photo (Grace Hopper), letterboxed to 320, RGB /255 NCHW
    import matplotlib.cbook
    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as fh:
        im = Image.open(fh).convert("RGB")
    sc = 320 / max(im.size)
    im = im.resize((round(im.size[0] * sc), round(im.size[1] * sc)), Image.BILINEAR)
    canvas = Image.new("RGB", (320, 320), (114, 114, 114))
    canvas.paste(im, ((320 - im.size[0]) // 2, (320 - im.size[1]) // 2))
    np.savez(f"{OUT}/nude_photo.npz", images=(np.asarray(canvas, np.float32) / 255).transpose(2, 0, 1)[None])
    for f in sorted(os.listdir(OUT)):
        if f.endswith(".npz"):
            with np.load(f"{OUT}/{f}") as z:
                print(f, {k: (z[k].shape, z[k].dtype) for k in z.files})


def sess(path, ours):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if ours:
        onnx_lowbit.register(so)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def run(path, ours, feeds):
    return sess(path, ours).run(None, feeds)[0]


def ctc(preds, chars):
    out = []
    for row in preds.argmax(-1):
        s, prev = [], -1
        for i in row:
            if i != prev and i != 0:
                s.append(chars[i])
            prev = i
        out.append("".join(s))
    return out


def nms(boxes, scores, iou=0.45):
    order, keep = np.argsort(-scores), []
    while order.size:
        i = order[0]; keep.append(i)
        xx1 = np.maximum(boxes[i, 0], boxes[order[1:], 0]); yy1 = np.maximum(boxes[i, 1], boxes[order[1:], 1])
        xx2 = np.minimum(boxes[i, 2], boxes[order[1:], 2]); yy2 = np.minimum(boxes[i, 3], boxes[order[1:], 3])
        inter = np.clip(xx2 - xx1, 0, None) * np.clip(yy2 - yy1, 0, None)
        area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # noqa: E731
        o = inter / (area(boxes[i]) + area(boxes[order[1:]]) - inter)
        order = order[1:][o < iou]
    return keep


def yolo(out, conf=0.25):
    p = out[0].T                      # [anchors, 4 + classes]
    cls, sc = p[:, 4:].argmax(1), p[:, 4:].max(1)
    m = sc > conf
    b = p[m, :4]; b = np.c_[b[:, 0] - b[:, 2] / 2, b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2]
    dets = []
    for c in np.unique(cls[m]):       # per-class NMS, as ultralytics (agnostic=False)
        idx = np.where(cls[m] == c)[0]
        for k in nms(b[idx], sc[m][idx]):
            dets.append((int(c), float(sc[m][idx][k]), b[idx][k]))
    return sorted(dets, key=lambda d: -d[1])


def iou1(a, b):
    x1, y1, x2, y2 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    i = max(0, x2 - x1) * max(0, y2 - y1)
    return i / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - i)


def det_regions(prob, thresh=0.3):
    from scipy import ndimage
    lab, n = ndimage.label(prob[0, 0] > thresh)
    objs = ndimage.find_objects(lab)
    return n, [(s[0].start, s[1].start, s[0].stop, s[1].stop) for s in objs]


def check(kind, a_path, b_path, npz):
    with np.load(npz) as z:
        feeds = {k: z[k] for k in z.files}
    a, b = run(a_path, False, feeds), run(b_path, True, feeds)
    if kind == "rec":
        m = onnx.load(a_path, load_external_data=False)
        chars = ["blank"] + {p.key: p.value for p in m.metadata_props}["character"].splitlines() + [" "]
        ta, tb = ctc(a, chars), ctc(b, chars)
        print("rec original :", ta); print("rec rewritten:", tb)
        print(f"rec strings equal: {sum(x == y for x, y in zip(ta, tb))}/{len(ta)}; per-step arg-max agreement "
              f"{np.mean(a.argmax(-1) == b.argmax(-1)):.4f}")
    elif kind == "cls":
        print("cls original :", a.argmax(1).tolist(), np.round(a.max(1), 3).tolist())
        print("cls rewritten:", b.argmax(1).tolist(), np.round(b.max(1), 3).tolist())
        print(f"cls labels equal: {int(np.sum(a.argmax(1) == b.argmax(1)))}/{len(a)}")
    elif kind == "det":
        na, ra = det_regions(a); nb, rb = det_regions(b)
        agree = np.mean((a > 0.3) == (b > 0.3))
        print(f"det: text regions (map > 0.3, connected) original {na}, rewritten {nb}; same boxes: {ra == rb}; "
              f"bitmap agreement {agree:.6f}; map max abs diff {np.abs(a - b).max():.3g}")
    elif kind == "yolo":
        import ast
        names = ast.literal_eval({p.key: p.value for p in onnx.load(a_path, load_external_data=False).metadata_props}["names"])
        da, db = yolo(a), yolo(b)
        print(f"yolo: detections (conf > 0.25, per-class NMS 0.45) original {len(da)}, rewritten {len(db)}")
        for x, y in zip(da[:10], db[:10]):
            print(f"  {names[x[0]]:15s} {x[1]:.3f} {np.round(x[2]).astype(int).tolist()}   |   {names[y[0]]:15s} "
                  f"{y[1]:.3f} {np.round(y[2]).astype(int).tolist()}  IoU {iou1(x[2], y[2]):.4f}")
        same = len(da) == len(db) and all(x[0] == y[0] and iou1(x[2], y[2]) > 0.99 for x, y in zip(da, db))
        print(f"yolo: same classes and boxes (IoU > 0.99, in score order): {same}; max score diff "
              f"{max([abs(x[1] - y[1]) for x, y in zip(da, db)] or [0]):.4g}")
    elif kind == "den":
        print(f"denoiser mask: rel-L2 {np.linalg.norm(a - b) / np.linalg.norm(a):.3g}, max abs {np.abs(a - b).max():.3g}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "inputs":
        inputs(sys.argv[2])
    elif len(sys.argv) == 6 and sys.argv[1] == "check":
        check(*sys.argv[2:6])
    else:
        raise SystemExit(__doc__)
