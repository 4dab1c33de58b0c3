"""tests/numba_cache_dir.py: the Numba cache folder follows the kernels' sources (a changed callee module gets a new,
empty folder), not other files; old folders are pruned to the newest KEEP."""
import os
import time

import numba_cache_dir as ncd


def _tree(root):
    for rel, text in (("custom_ops/gru/a.py", "from onnx_lowbit import gru_int\nX = 1\n"),
                      ("custom_ops/gru/b.py", "from onnx_lowbit.halfbits import f16\n"),
                      ("onnx_lowbit/gru_int.py", "NQ = 14\n"), ("onnx_lowbit/halfbits.py", "f16 = 1\n"),
                      ("onnx_lowbit/cli.py", "print('hi')\n"), ("README.md", "x\n")):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_folder_follows_the_kernel_sources(tmp_path):
    _tree(tmp_path)
    names = sorted(os.path.relpath(p, tmp_path) for p in ncd.sources(str(tmp_path)))
    assert names == ["custom_ops/gru/a.py", "custom_ops/gru/b.py", "onnx_lowbit/gru_int.py", "onnx_lowbit/halfbits.py"]
    d0 = ncd.digest(str(tmp_path))
    (tmp_path / "onnx_lowbit/cli.py").write_text("print('other')\n")     # not compiled by Numba
    (tmp_path / "README.md").write_text("y\n")
    assert ncd.digest(str(tmp_path)) == d0
    (tmp_path / "onnx_lowbit/halfbits.py").write_text("f16 = 2\n")       # a callee module imported by a kernel
    d1 = ncd.digest(str(tmp_path))
    assert d1 != d0
    (tmp_path / "custom_ops/gru/b.py").write_text("from onnx_lowbit.halfbits import f16\nY = 2\n")
    assert ncd.digest(str(tmp_path)) not in (d0, d1)


def test_folder_prunes_old_ones(tmp_path):
    base = tmp_path / "cache"
    base.mkdir()
    for i in range(5):
        (base / f"old{i}").mkdir()
        os.utime(base / f"old{i}", (time.time() - 100 + i, time.time() - 100 + i))
    src = tmp_path / "src"
    _tree(src)
    here = ncd.folder(str(base), str(src))
    assert os.path.isdir(here) and os.path.basename(here) == ncd.digest(str(src))
    assert sorted(os.listdir(base)) == sorted([os.path.basename(here), "old4", "old3"][:ncd.KEEP])
