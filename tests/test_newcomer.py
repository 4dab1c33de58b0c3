"""Issue 35, the first hour of a newcomer, run as a user runs it (the CLI in a subprocess: exit status and the words
on the screen): README's first screen end to end (its rewrite command, then its Python snippet on the result), how
to install (not from PyPI) in every hint, `lut list` / `lut plot` (without matplotlib too), and the demo."""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from test_cli import ROOT, SAMPLE, assert_bad, cli

README = os.path.join(ROOT, "README.md")


def _first_screen() -> str:
    text = open(README).read()
    start = text.index("## Start here")
    return text[start:text.index("\n## ", start + 1)]


def _blocks(section: str, lang: str) -> list:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def _python(code: str, cwd, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=e, timeout=600)
    return p.returncode, p.stdout, p.stderr


def test_readme_first_screen_from_install_to_a_running_model(tmp_path):
    screen = _first_screen()
    (shell,) = _blocks(screen, "bash")
    lines = [ln.split("#")[0].strip() for ln in shell.splitlines() if ln.split("#")[0].strip()]
    assert lines[0].startswith("git clone ")
    assert any(ln.startswith('pip install ".[cpu]"') for ln in lines)          # a checkout, not PyPI
    assert "not on PyPI" in screen and '".[gpu]"' in screen
    assert not re.search(r"pip install onnx-lowbit\[", open(README).read())   # nowhere in the README
    # the rewrite command exactly as written there, on a model of ours standing in for "your model"
    rewrite, rewrite_cpu = [ln for ln in lines if ln.startswith("onnx-lowbit rewrite")]   # for a GPU, for the CPU
    shutil.copy(SAMPLE, tmp_path / "model.onnx")
    rc, out, err = cli(*rewrite.split()[1:], cwd=tmp_path)
    assert rc == 0, err
    assert out.splitlines()[0].startswith("model.onnx: 12 rewritten, 0 skipped by fplut")
    assert "result (tolerance 0.02 rel-L2)" in out and " ok" in out and "wrote model.lowbit.onnx" in out
    assert "--device cpu" not in rewrite and "--device cpu --tune" in rewrite_cpu
    rc, out, err = cli(*rewrite_cpu.split()[1:], cwd=tmp_path)
    assert rc == 0, err
    assert "tune: each pass timed against the model without it" in out and "wrote model.cpu.onnx" in out
    # then the snippet: a plain onnxruntime session with register(so)
    (snippet,) = _blocks(screen, "python")
    assert "onnx_lowbit.register(so)" in snippet and "ort.InferenceSession(" in snippet
    rc, out, err = _python(snippet, tmp_path)
    assert rc == 0, err
    assert out.strip() == "[(1, 27, 8, 8)]", out       # tiny_yolo's output
    # and what the snippet's comment says happens without the register line
    plain = "\n".join(ln for ln in snippet.splitlines() if "onnx_lowbit.register(so)" not in ln)
    rc, out, err = _python(plain, tmp_path)
    assert rc != 0 and "onnx_lowbit:FPLUT(-1) is not a registered function/op" in err


def test_unregistered_error_says_how_to_install_and_register(tmp_path):
    assert cli("rewrite", SAMPLE, str(tmp_path / "m.onnx"))[0] == 0
    code = textwrap.dedent("""
        import onnxruntime as ort, onnx_lowbit
        try:
            with onnx_lowbit.explained_errors("m.onnx"):
                ort.InferenceSession("m.onnx", providers=["CPUExecutionProvider"])
        except onnx_lowbit.LibraryNotRegistered as e:
            print(e)
        """)
    rc, out, err = _python(code, tmp_path)
    assert rc == 0, err
    for needle in ("not on PyPI", 'pip install ".[cpu]" or ".[gpu]"', "python -m build",
                   "onnx_lowbit.register(so)", "onnx_lowbit.FPLUT"):
        assert needle in out, needle
    assert "pip install 'onnx-lowbit[" not in out
    rc, out, _ = cli("inspect", str(tmp_path / "m.onnx"))
    assert rc == 0 and "onnx_lowbit.register(sess_options)" in out


def test_lut_list_shows_the_clipped_figures():
    rc, out, err = cli("lut", "list")
    assert rc == 0, err
    head = out.splitlines()[0].split()
    assert "(clip)" in head and head.count("(clip)") == 2
    (exp,) = [ln.split() for ln in out.splitlines() if re.match(r"exp +\d", ln)]
    assert exp[1] == "1.35e+308" and exp[3] == "8.12e+01" and exp[4] == "1.61e-03"   # abs / rel (clip)
    (silu,) = [ln.split() for ln in out.splitlines() if re.match(r"silu +\d", ln)]
    assert silu[1] == silu[3] and silu[2] == silu[4] == "3.93e-03"                   # no overflow: the same
    assert "exp (past x = 11.09375): f overflows fp16" in out and "the (clip) columns are the table's error" in out


def test_lut_plot_without_matplotlib(tmp_path):
    """matplotlib is an extra (plot): without it, one line saying what to install, exit 2, no file. The absence is
    simulated by an import hook in the subprocess (the test environment has matplotlib)."""
    code = textwrap.dedent("""
        import runpy, sys
        class NoMatplotlib:
            def find_spec(self, name, path=None, target=None):
                if name == "matplotlib" or name.startswith("matplotlib."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoMatplotlib())
        sys.argv = ["onnx-lowbit", "lut", "plot", "silu", "-o", "x.png"]
        runpy.run_module("onnx_lowbit.cli", run_name="__main__")
        """)
    rc, out, err = _python(code, tmp_path)
    assert_bad(rc, err, "lut plot draws with matplotlib, which is not installed: pip install matplotlib")
    assert '".[cpu,plot]"' in err and "internal error" not in err
    assert not (tmp_path / "x.png").exists()
    rc, out, err = cli("lut", "plot", "silu", "-o", str(tmp_path / "x.png"))        # with matplotlib: the plot
    assert rc == 0 and (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG", err


@pytest.mark.parametrize("name", ["silu", "tanh", "exp", "erf", "gelu"])
def test_plot_tick_labels_do_not_overlap(name):
    """The symlog x axis put -10^-3, 0 and 10^-3 (silu) next to each other at the centre, labels printed over
    each other: no two tick labels of the drawn figure may intersect."""
    from onnx_lowbit.fplut_plot import error_figure
    fig = error_figure(name)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labelled = 0
    for ax in fig.axes:         # the two panels share x: the lower one carries the labels
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        labelled += len(boxes) >= 5
        boxes.sort(key=lambda b: b.x0)
        for a, b in zip(boxes, boxes[1:]):
            assert a.x1 < b.x0, (name, a, b)
    assert labelled == 1, name


@pytest.mark.slow
def test_demo_says_what_it_does():
    rc, out, err = cli("demo", "--help")
    assert rc == 0 and "four embedded sample models" in " ".join(out.split())
    rc, out, err = cli("demo")
    assert rc == 0, err + out
    blocks = [b for b in out.split("\n== ")[1:]]
    assert len(blocks) == 5
    for b in blocks:                                   # each block gives a speed ratio, said as faster / slower
        assert re.search(r"ms: \d+\.\d\dx (faster|slower)$", b, re.M), b
        assert not re.search(r"\bx\d", b), b             # one direction, in words: no "x0.41" ratios left
        # on the CPU (as in CI) every block also says what `--device cpu --tune` keeps, each pass with its figure
        assert re.search(r"^   --device cpu --tune: .*(\d\.\d\dx (faster|slower)\)|nothing kept)", b, re.M), b
        m = re.search(r"skipped (\d+)", b)             # a count of skips comes with what was skipped
        if m:
            assert b.count("   skipped: ") == int(m.group(1)), b
    assert "written:" not in out                       # the files go to a temporary folder deleted at the end
    assert "deleted now; `onnx-lowbit demo --out DIR` keeps them" in out
    assert "for this CPU: onnx-lowbit rewrite model.onnx model.cpu.onnx --device cpu --tune" in out  # CI: the CPU
    assert "tiny_yolo" in out and "FPLUT ops" in out
    assert "FusedFFNNF4" in out and "QuantGRU" in out and "FAIL" not in out
