"""Arrows point one way: cli/api -> passes, custom_ops -> core. The core never imports the layers above it,
and passes and custom_ops never import each other. Inside custom_ops: families -> device/ -> runtime/ (runtime/ finds
kernels only through its op table), only ffn/ imports other families (nf4/, awq/), and no module import cycles."""
import ast
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = {"api.py", "cli.py", "cli_options.py", "demo.py", "verify.py", "evalppl.py", "tune.py", "genai_config.py", "__init__.py"}  # the application layer inside onnx_lowbit/


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
    """The .py files of ``folder`` and its subfolders."""
    out = []
    for d, _, names in os.walk(os.path.join(ROOT, folder)):
        out += [os.path.join(d, f) for f in names if f.endswith(".py")]
    return out


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


# ------------------------------------------------------------------------------------------ inside custom_ops
OPS_DIR = os.path.join(ROOT, "custom_ops")
FAMILIES = ("fplut", "nf4", "awq", "ffn", "gru", "attention")
LAYERS = ("runtime", "device") + FAMILIES


def _module(path):
    """custom_ops-relative dotted name of a module file ('nf4.common'; a package: 'nf4'; the top: '')."""
    rel = os.path.relpath(path, OPS_DIR)[:-3].replace(os.sep, ".")
    return rel[: -len("__init__")].rstrip(".") if rel.endswith("__init__") else rel


def _ops_modules():
    """{module: file} of every module of custom_ops."""
    return {_module(f): f for f in _files("custom_ops")}


def _ops_imports(path, modules):
    """The custom_ops modules a file imports (module-level and inside functions), as custom_ops-relative names:
    relative imports resolved against the file's package, ``from pkg import mod`` counted as an import of mod."""
    me = _module(path)
    pkg = me if os.path.basename(path) == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".") if pkg else []
                if node.level > 1:
                    parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("onnx_lowbit.custom_ops"):
                base = node.module[len("onnx_lowbit.custom_ops"):].lstrip(".")
            else:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                out.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("onnx_lowbit.custom_ops."):
                    out.add(a.name[len("onnx_lowbit.custom_ops."):])
    out.discard(me)
    return out


def _layer(mod):
    return mod.split(".")[0] if mod else ""


def test_custom_ops_is_laid_out_in_layers():
    """Every module lives in runtime/, device/ or a family folder (the package's own __init__.py aside), and every
    folder is a package with a docstring."""
    mods = _ops_modules()
    assert sorted({_layer(m) for m in mods} - {""}) == sorted(LAYERS), sorted({_layer(m) for m in mods})
    assert [m for m in mods if m and "." not in m and m not in LAYERS] == []
    for layer in LAYERS:
        init = os.path.join(OPS_DIR, layer, "__init__.py")
        assert os.path.isfile(init), init
        assert ast.get_docstring(ast.parse(open(init).read())), f"{init} has no docstring"


def test_custom_ops_arrows():
    """runtime/ imports no device/ and no family (kernels are found through runtime/kernels.py's table); device/
    imports only runtime/; families import runtime/ and device/, and of the other families only ffn/ imports nf4/
    and awq/ (the fused 4-bit FFN ops reuse their formats and kernels)."""
    mods = _ops_modules()
    allowed = {"": {"runtime"}, "runtime": {"runtime"}, "device": {"device", "runtime"}}
    for fam in FAMILIES:
        allowed[fam] = {fam, "device", "runtime"} | ({"nf4", "awq"} if fam == "ffn" else set())
    bad = []
    for mod, f in mods.items():
        for dep in _ops_imports(f, mods):
            if _layer(dep) not in allowed[_layer(mod)]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, bad


def test_custom_ops_has_no_import_cycles():
    """The module import graph of custom_ops (imports inside functions included) has no cycle."""
    mods = _ops_modules()
    graph = {m: {d for d in _ops_imports(f, mods) if d in mods} for m, f in mods.items()}
    state, stack, cycles = {}, [], []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, cycles


def test_cycle_check_sees_cycles():
    """The graph the cycle test walks has the edges it should: relative imports inside functions and ``from pkg
    import mod`` resolve to modules (one known edge of each kind)."""
    mods = _ops_modules()
    assert "nf4.decode_cuda" in _ops_imports(mods["nf4.matmulnf4_cuda"], mods)     # from .decode_cuda import ...
    assert "nf4.nf4tc_cuda" in _ops_imports(mods["nf4.matmulnf4_cuda"], mods)      # from . import ..., nf4tc_cuda
    assert "device.launch" in _ops_imports(mods["device.cublas"], mods)            # from . import launch


@pytest.mark.parametrize("face", ["cpu", "cuda"])
def test_every_op_face_is_in_the_kernel_table(face):
    """runtime/kernels.py names a family module for every op of the domain, and that module file exists."""
    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.runtime import kernels
    assert sorted(kernels.FAMILIES) == sorted(domain.OPS)
    for op in domain.OPS:
        mod = kernels.kernel_module(op, face)
        assert mod.split(".")[0] in FAMILIES, mod
        assert importlib.util.find_spec(f"onnx_lowbit.custom_ops.{mod}") is not None, mod
