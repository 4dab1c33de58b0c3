"""Issue 35, continued (the CLI in a subprocess, exit status and the words on the screen): rewrite's first line and
report (passes that did not run named apart, real skips only in the counts, nothing cut off), the status line of
long steps (it names the pass and the node and moves), and `bench` on a model with symbolic image dims."""
import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import pytest

from onnx_lowbit import bench, feeds
from onnx_lowbit.errors import LowbitError
from onnx_lowbit.progress import Status
from test_cli import ROOT, SAMPLE, assert_bad, cli

GRU = os.path.join(ROOT, "samples", "gru_small.onnx")
GRU_CAL = os.path.join(ROOT, "samples", "gru_small_calib.npz")


def _env(**extra):
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def test_first_line_and_report_name_passes_that_did_not_run(tmp_path):
    rc, out, err = cli("rewrite", GRU, str(tmp_path / "a.onnx"), "--report")
    assert rc == 0, err
    first = out.splitlines()[0]
    assert first == (f"{GRU}: 0 rewritten, 0 skipped by fplut, ffn, merge, rotary, rotarykv; not run: weights4 "
                     "(needs --weights nf4|fp4|awq), gru (needs --calibration DATA.npz)")
    assert "not run: gru: no calibration data: QuantGRU's scales come from calibration" in out
    assert "(/gru/GRU)" in out and "gru: 0 rewritten" not in out
    assert "1 GRU left in float: the gru pass needs calibration data" in err
    # real skips count: FPLUT restricted to gelu leaves tiny_yolo's activations, each row with its reason
    rc, out, err = cli("rewrite", SAMPLE, str(tmp_path / "b.onnx"), "--fplut-functions", "gelu", "--report")
    assert rc == 0, err
    n = int(re.match(rf"{re.escape(SAMPLE)}: 0 rewritten, (\d+) skipped by fplut, ffn", out).group(1))
    assert n >= 12 and f"fplut: 0 rewritten, {n} skipped" in out
    assert len(re.findall(r"^fplut +skipped ", out, re.M)) == n and "function 'silu' not enabled" in out


def test_report_is_complete_on_a_narrow_terminal(tmp_path):
    """The reason column was cut at 60 characters, hiding the GRU's error figure, the one that decides whether an
    int8 GRU is usable: on an 80-column terminal every word of it is on the screen, rows wrapped to fit."""
    for columns in ("80", "200"):
        p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", "rewrite", GRU, str(tmp_path / "q.onnx"),
                            "--calibration", GRU_CAL, "--gru-bits", "8", "--report", "--report-json",
                            str(tmp_path / "r.json")], capture_output=True, text=True, env=_env(COLUMNS=columns),
                           timeout=600)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines()[0].endswith("by fplut, ffn, merge, rotary, rotarykv, gru; not run: weights4 "
                                                 "(needs --weights nf4|fp4|awq)")
        (entry,) = json.load(open(tmp_path / "r.json"))["entries"][:1]
        reason = entry["reason"]
        assert "Y rel L2 error on the calibration data" in reason and len(reason) > 60
        table = p.stdout[p.stdout.index("pass "):]
        rows = [ln for ln in table.splitlines() if ln.strip()]
        if columns == "80":
            assert max(len(ln) for ln in rows[:-1]) <= 80 and len(rows) > 4   # wrapped onto more lines
        # every word of the reason, in order, across the wrapped lines of its column
        start = rows[0].index("reason")
        column = " ".join(ln[start:].strip() for ln in rows[2:] if len(ln) > start)
        assert reason in column, (reason, column)
        assert "gru: 1 rewritten, 0 skipped" in table


def test_long_steps_say_what_they_do_in_a_log(tmp_path):
    """Not a terminal (a pipe, a log): a step's first note goes out as a line naming the pass and what it does."""
    rc, out, err = cli("rewrite", GRU, str(tmp_path / "q.onnx"), "--calibration", GRU_CAL, "--gru-bits", "8")
    assert rc == 0, err
    assert "onnx-lowbit: [" in err and "pass 7/7 gru: calibration run: the model in onnxruntime" in err
    assert "\r" not in err and "%|" not in err                  # no redrawn bar in a log


def test_long_steps_move_on_a_terminal(tmp_path):
    """On a terminal one line is redrawn: the pass, the GRU node, the range-search trial, the step's clock."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "onnx_lowbit.cli", "rewrite", GRU, str(tmp_path / "q.onnx"),
                          "--calibration", GRU_CAL, "--gru-bits", "8"], stdout=subprocess.PIPE, stderr=slave,
                         env=_env(), cwd=tmp_path)
    os.close(slave)
    screen = b""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:            # the child closed its end
                break
            if not chunk:
                break
            screen += chunk
        elif p.poll() is not None:
            break
    os.close(master)
    assert p.wait() == 0
    frames = [f.strip() for f in screen.decode().split("\r") if f.strip()]
    trials = [f for f in frames if re.search(r"pass 7/7 gru: GRU 1/1 '/gru/GRU' \(int8, H=128\): range search "
                                             r"\d+/\d+", f)]
    assert len({re.search(r"search (\d+)/", f).group(1) for f in trials}) >= 10, frames
    # the step's clock: 9.9s, then 10s, then 1m05s (progress._clock): a loaded machine passes 10 s here
    odd = [f for f in frames if not re.match(r"\[(\d\.\ds|\d+s|\d+m\d\ds)\] pass \d/7 ", f)
           and not f.startswith("onnx-lowbit: no --device")]    # cpu_passes.GPU_DEFAULT_HINT, before the passes
    assert not odd, odd
    assert "%|" not in screen.decode() and "86%" not in screen.decode()


def test_clock_never_reads_ten_point_zero():
    """Under 10 s the clock shows tenths truncated, like the whole seconds above: 9.96 s read "10.0s" (rounded),
    a frame test_long_steps_move_on_a_terminal rejected on a loaded machine."""
    from onnx_lowbit.progress import _clock
    assert [_clock(t) for t in (0.04, 9.94, 9.96, 9.999, 10.0, 59.99, 60.0, 65.5)] == \
        ["0.0s", "9.9s", "9.9s", "9.9s", "10s", "59s", "1m00s", "1m05s"]


def test_status_line_clock_moves_during_one_long_call():
    """While one call runs (no notes), the redrawn line's clock advances."""
    class Tty(io.StringIO):
        def isatty(self):
            return True
    stream = Tty()
    with Status(stream, interval=0.05) as s:
        s.step("pass 1/1 gru")
        time.sleep(0.6)
    frames = [f.strip() for f in stream.getvalue().split("\r") if f.strip()]
    clocks = {re.match(r"\[(\d+\.\d)s\]", f).group(1) for f in frames}
    assert len(clocks) >= 3 and all("pass 1/1 gru: running" in f for f in frames), frames
    assert stream.getvalue().endswith("\r")                     # erased at the end


def _yolo_like(path, imgsz=None):
    """A strided CNN like a YOLOv8 export: input [batch, 3, height, width], five stride-2 convs, the /32 map
    upsampled and concatenated with the /16 one: at 16 x 16 the two disagree (onnxruntime's Concat fails)."""
    rng = np.random.default_rng(0)
    nodes, inits, x, c = [], [], "images", 3
    for i in range(5):
        w = numpy_helper.from_array((rng.standard_normal((8, c, 3, 3)) * 0.2).astype(np.float32), f"w{i}")
        inits.append(w)
        nodes += [helper.make_node("Conv", [x, w.name], [f"c{i}"], strides=[2, 2], pads=[1, 1, 1, 1]),
                  helper.make_node("Sigmoid", [f"c{i}"], [f"s{i}"]), helper.make_node("Mul", [f"c{i}", f"s{i}"],
                                                                                       [f"a{i}"])]
        x, c = f"a{i}", 8
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    nodes += [helper.make_node("Resize", [x, "", "scales"], ["up"], mode="nearest"),
              helper.make_node("Concat", ["up", "a3"], ["y"], axis=1)]
    g = helper.make_graph(nodes, "yolo_like",
                          [helper.make_tensor_value_info("images", T.FLOAT, ["batch", 3, "height", "width"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["batch", 16, None, None])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    if imgsz:
        helper.set_model_props(m, {"imgsz": str(list(imgsz))})
    onnx.save(m, path)


def test_bench_guesses_image_dims_and_says_so(tmp_path):
    src, dst = str(tmp_path / "y.onnx"), str(tmp_path / "y.lowbit.onnx")
    _yolo_like(src)
    assert cli("rewrite", src, dst)[0] == 0
    fast = ["--warmup", "1", "--runs", "2", "--out", str(tmp_path / "b")]
    rc, out, err = cli("bench", src, dst, *fast)
    assert rc == 0, err
    assert ("symbolic input dims guessed: batch=1 (batch-like name), height=224 (image input, a multiple of 32), "
            "width=224 (image input, a multiple of 32); set them with --dim NAME=VALUE") in err
    assert "inputs images float32[1, 3, 224, 224]" in out
    # sizes that do not line up: onnxruntime's error, then which dims the inputs had and what to pass
    rc, out, err = cli("bench", src, dst, *fast, "--dim", "height=16", "--dim", "width=16")
    assert_bad(rc, err, "Concat")
    assert ("(the inputs were random with symbolic dims batch=1 (guessed), height=16 (given), width=16 (given): "
            "give the sizes the model takes with --dim NAME=VALUE, or real inputs with --inputs DATA.npz)") in err
    assert len(err.strip().splitlines()) == 2          # the note and the error: no onnxruntime log lines
    # ultralytics writes the export's image size into the metadata: that is the guess then
    _yolo_like(src, imgsz=(64, 96))
    rc, out, err = cli("bench", src, dst, *fast)
    assert rc == 0, err
    assert "height=64 (the model's imgsz metadata), width=96 (the model's imgsz metadata)" in err
    assert "inputs images float32[1, 3, 64, 96]" in out
    assert feeds.make_feeds(onnx.load(src))[0]["images"].shape == (1, 3, 64, 96)   # --verify's inputs: the same


def test_image_batch_axis_of_any_name_is_one():
    """PaddleOCR exports name every free dim p2o.DynamicDimension.<i>: an image input's first axis is still 1."""
    sig = {"x": (np.dtype(np.float32), ["p2o.DynamicDimension.0", 3, "p2o.DynamicDimension.1",
                                          "p2o.DynamicDimension.2"])}
    assert bench.guess_dims([sig], {}) == {"p2o.DynamicDimension.0": (1, "batch axis of an image input"),
                                           "p2o.DynamicDimension.1": (224, "image input, a multiple of 32"),
                                           "p2o.DynamicDimension.2": (224, "image input, a multiple of 32")}
    seq = {"ids": (np.dtype(np.int64), ["batch_size", "seq"])}       # not an image: as before
    assert bench.resolve_dims([seq], {}) == {"batch_size": 1, "seq": bench.OTHER_DIM}
    # one guesser: --verify's inputs (onnx_lowbit.feeds) take the same values as bench's, with the same reasons
    assert feeds.guess_dims(sig) == bench.guess_dims([sig], {})
    assert feeds.shapes(sig, feeds.resolve_dims(sig)) == {"x": [1, 3, 224, 224]}
    with pytest.raises(LowbitError) as e1:
        bench.guess_dims([sig], {"h": 3})
    with pytest.raises(LowbitError) as e2:
        feeds.resolve_dims(sig, {"h": 3})
    assert str(e1.value) == str(e2.value) and str(e1.value).startswith("--dim h: no input has such a symbolic")
