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


def pytest_collection_modifyitems(config, items):
    groups = [_group(item) for item in items]
    for item, group in zip(items, groups):
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items[:] = ([i for i, g in zip(items, groups) if g == "gru-cpu"]
                + [i for i, g in zip(items, groups) if g != "gru-cpu"])
