"""custom_ops.runtime.routing: a table picks its first matching row, a table whose last row does not hold for every
case fails for some case, all_tables() finds every op's table, and every op with a CUDA face has one (the op
modules' own tables are tested with their kernels: test_fplut_cuda, test_gru_cuda, test_rotary_kernels, ...)."""
import importlib
import os
import importlib.util

import pytest

from onnx_lowbit.custom_ops.runtime import routing
from onnx_lowbit.custom_ops.runtime.kernels import FAMILIES

PKG = "onnx_lowbit.custom_ops"
MINE = {"FPLUT", "QuantGRU", "Rotary", "RMSNorm", "RotaryKV", "KVAttention"}   # tables of this change


def _table():
    return (routing.Route("small", "M <= 4", lambda c: c.m <= 4),
            routing.Route("fp16", "fp16 X", lambda c: c.dtype == "float16"),
            routing.Route("any", "every other case", routing.always))


def test_route_takes_the_first_matching_row():
    t = _table()
    assert routing.route(t, routing.Case("float16", 2)).kernel == "small"       # rows 1 and 2 hold: the first
    assert routing.route(t, routing.Case("float16", 9)).kernel == "fp16"
    assert routing.route(t, routing.Case("float32", 9)).kernel == "any"
    assert routing.kernels(t) == ["small", "fp16", "any"]
    assert routing.table(t).splitlines()[2] == "| 1 | `small` | M <= 4 |  |"


def test_a_table_without_an_always_true_last_row_fails_for_some_case():
    t = _table()[:2]
    assert routing.route(t, routing.Case("float16", 9)).kernel == "fp16"
    with pytest.raises(LookupError, match="no route"):
        routing.route(t, routing.Case("float32", 9))


def test_case_options():
    c = routing.Case("float16", 1, opts=routing.options(stage="rec", barrier=True))
    assert c.opts == (("barrier", True), ("stage", "rec")) and (c.k, c.n) == (0, 0)
    assert c.opt("stage") == "rec" and c.opt("missing", 7) == 7


def _cuda_modules():
    """{op: its CUDA face module} for every op whose CUDA module exists (imported: numba-cuda, simulator here)."""
    out = {}
    for op, path in FAMILIES.items():
        name = f"{PKG}.{path}_cuda"
        if importlib.util.find_spec(name) is not None:
            out[op] = importlib.import_module(name)
    return out


def test_all_tables_lists_every_op_that_defines_routes():
    pytest.importorskip("numba.cuda")
    mods = _cuda_modules()
    tables = routing.all_tables()
    assert set(tables) == {op for op, m in mods.items() if getattr(m, "ROUTES", None)}
    assert MINE <= set(tables)
    for op, routes in tables.items():
        assert routes is mods[op].ROUTES and routes[-1].test is routing.always, op   # the last row: every case


def test_every_cuda_op_defines_routes():
    missing = [op for op, m in _cuda_modules().items() if not getattr(m, "ROUTES", None)]
    assert not missing, f"CUDA op modules without ROUTES: {missing}"


def test_routing_doc_names_every_table_and_kernel():
    """docs/routing.md (the printed tables, regenerated with `python -m onnx_lowbit.custom_ops.runtime.routing`
    outside the simulator) has a section per op and names every kernel its table routes to."""
    pytest.importorskip("numba.cuda")
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "routing.md")).read()
    for op, routes in routing.all_tables().items():
        assert f"## {op}\n" in doc, op
        section = doc.split(f"## {op}\n", 1)[1].split("\n## ", 1)[0]
        for name in routing.kernels(routes):
            if op != "QuantGRU" or not name.startswith("xproj"):     # the simulator's tiles are smaller
                assert f"`{name}`" in section, (op, name)
