"""Arrows point one way: cli/api -> passes, custom_ops -> core. The core never imports the layers above it,
and passes and custom_ops never import each other."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = {"api.py", "cli.py", "demo.py", "verify.py", "evalppl.py", "__init__.py"}  # the application layer inside onnx_lowbit/


def _imports(path):
    tree = ast.parse(open(path).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(("." * node.level) + node.module)
    return names


def _files(folder):
    d = os.path.join(ROOT, folder)
    return [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".py")]


def test_core_does_not_import_upper_layers():
    for f in _files("onnx_lowbit"):
        if os.path.basename(f) in TOP:
            continue
        bad = [m for m in _imports(f) if "passes" in m or "custom_ops" in m or m.endswith(("api", "cli"))]
        assert not bad, f"{f} imports {bad}"


def test_passes_and_custom_ops_are_independent():
    for f in _files("passes"):
        assert not [m for m in _imports(f) if "custom_ops" in m], f
    for f in _files("custom_ops"):
        assert not [m for m in _imports(f) if "passes" in m], f


def test_code_folders_imported_only_through_onnx_lowbit():
    """custom_ops/ and passes/ install as onnx_lowbit.custom_ops / onnx_lowbit.passes. Importing them as top-level
    modules (``from custom_ops import ...`` with the checkout on sys.path) loads a second copy whose Numba cache
    entries (cache=True, stored next to the source) name the module ``custom_ops.*``: every later process then
    fails loading them with ModuleNotFoundError (seen: benchmarks/ffn_cpu.py broke CPU FusedFFN sessions)."""
    bad = []
    for folder in ("onnx_lowbit", "passes", "custom_ops", "benchmarks", "tests", "samples"):
        for f in _files(folder):
            bad += [(os.path.relpath(f, ROOT), m) for m in _imports(f)
                    if m.split(".")[0] in ("custom_ops", "passes")]
    assert not bad, bad
