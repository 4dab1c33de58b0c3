import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402

# Tests that compile the same Numba CPU kernels (cold in CI: QuantGRU's take ~4 minutes of compiling in the first
# test of a process that uses them, the attention ops' and FPLUT's tens of seconds) run on one pytest-xdist worker per
# group (tests/run.sh: --dist loadgroup), so that only one worker compiles them; the rest spread over the workers test
# by test as before. The QuantGRU group goes first, so that its worker starts on it.
_GRU_CPU_FILES = {"test_gru_accuracy.py", "test_gru_denoiser.py", "test_gru_kernels.py", "test_pass_gru.py"}
_CPU_GROUP_FILES = {"test_rotary_kernels.py", "test_rotarykv_kernels.py", "test_kvattention_kernels.py",
                    "test_rmsnorm_kernels.py", "test_ffn_kernels.py", "test_fplut_cpu_kernels.py", "test_nf4_int8.py"}


def _group(item):
    name = os.path.basename(str(item.fspath))
    if name in _GRU_CPU_FILES or (name == "test_native_cpu.py" and "quantgru" in item.name):
        return "gru-cpu"
    if name in _CPU_GROUP_FILES and ("cpu" in item.name or name in ("test_fplut_cpu_kernels.py", "test_nf4_int8.py")):
        return name[:-3]
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    groups = [_group(item) for item in items]
    for item, group in zip(items, groups):
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            _group_nodeid(config, item, group)
    items[:] = ([i for i, g in zip(items, groups) if g == "gru-cpu"]
                + [i for i, g in zip(items, groups) if g != "gru-cpu"])


def _group_nodeid(config, item, group):
    """pytest-xdist 3.8 tells its loadgroup scheduler an item's group by appending "@group" to ``item._nodeid`` in its
    own pytest_collection_modifyitems, which pytest 9 no longer reads (``nodeid`` comes from ``item._id``): the
    groups were ignored and every worker compiled QuantGRU's kernels (CI, 2026-12-01: test_gru_accuracy's first two
    models 428 s and 457 s, on both workers). The suffix is set here where pytest 9 reads it (this hook runs last);
    with an older pytest, xdist's hook has already set it and this does nothing."""
    if getattr(config.option, "loadgroup", False) and hasattr(item, "_id") and "@" not in item.nodeid:
        from _pytest.nodeid import NodeId
        item._id = NodeId.parse(f"{item.nodeid}@{group}")
