"""A release is one command away: ``python -m build`` makes the sdist and, from that sdist, the wheel (as a release
would), and the wheel holds what an install needs besides the Python modules: the bridge's C shim source (compiled
at install, or on first use), the embedded sample models and their calibration data, the shipped FPLUT tables, and
the ``onnx-lowbit`` command. The package is not on PyPI; README.md says to install from a checkout or this wheel."""
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a source tree holds besides the sources: never copied into the build
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.nbi", "*.nbc",
                                     "*.so", ".pytest_cache", ".devcache", ".whl", "out")


@pytest.mark.slow
def test_sdist_and_wheel(tmp_path):
    src = tmp_path / "src"   # a copy: the build writes build/ and *.egg-info into the tree it builds
    shutil.copytree(ROOT, src, ignore=NOT_SOURCES)
    dist = tmp_path / "dist"
    p = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    (sdist,) = dist.glob("onnx_lowbit-*.tar.gz")
    (wheel,) = dist.glob("onnx_lowbit-*.whl")

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    # the C shim's source, wherever custom_ops keeps it (custom_ops/ may move into subpackages)
    for part in ("ortshim.c", "ortplans.c"):   # ortshim.c includes ortplans.c
        assert [n for n in names if n.startswith("onnx_lowbit/custom_ops/") and n.endswith(part)], names
    for sample in ("tiny_yolo.onnx", "gpt2_mlp.onnx", "llama_mlp.onnx", "gru_small.onnx", "gru_small_calib.npz"):
        assert f"onnx_lowbit/samples/{sample}" in names, sample
    assert "onnx_lowbit/fplut_tables.json" in names
    for module in ("onnx_lowbit/cli.py", "onnx_lowbit/passes/__init__.py", "onnx_lowbit/custom_ops/__init__.py"):
        assert module in names, module
    assert "onnx-lowbit = onnx_lowbit.cli:main" in entry_points
    assert "Provides-Extra: cpu" in metadata and "Provides-Extra: gpu" in metadata and \
        "Provides-Extra: plot" in metadata

    with tarfile.open(sdist) as t:
        members = t.getnames()
    stem = os.path.basename(str(sdist))[:-len(".tar.gz")]
    for f in ("setup.py", "pyproject.toml", "README.md", "samples/tiny_yolo.onnx", "onnx_lowbit/fplut_tables.json"):
        assert f"{stem}/{f}" in members, f
    for part in ("ortshim.c", "ortplans.c"):
        assert [m for m in members if m.startswith(f"{stem}/custom_ops/") and m.endswith(part)], part
