"""The shipped FPLUT tables (onnx_lowbit/fplut_tables.json) against the reference semantics of onnx_lowbit.fplut."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_lowbit import fplut, fplut_interval_errors, fplut_plot, fplut_search, fplut_tables, halfbits

NAMES = fplut_tables.available()


def test_every_function_and_the_seed_are_shipped():
    assert set(fplut_search.FUNCTION_NAMES) | {"silu_seed"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_values_are_build_values_of_the_cut_points(name):
    t = fplut_tables.get_table(name)
    assert len(t.cut_points) == fplut.N_CUTS and t.values.shape == (fplut.N_VALUES,)
    built = fplut.build_values(t.function, t.cut_points)
    assert np.array_equal(t.values.view(np.uint16), built.view(np.uint16))


@pytest.mark.parametrize("name", NAMES)
def test_shipped_stats_are_error_stats(name):
    t = fplut_tables.get_table(name)
    got = fplut.error_stats(t.function, t.cut_points, t.values)
    shipped = fplut_tables.stats(name)
    assert set(shipped) == {"max_abs", "max_rel", "exact_pct", "within_1ulp_pct"}
    for k, v in shipped.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=0), k


def test_silu_meets_the_goal_and_beats_the_seed():
    s, seed = fplut_tables.stats("silu"), fplut_tables.stats("silu_seed")
    assert s["max_rel"] <= 4e-3
    assert s["max_rel"] < seed["max_rel"] / 2


def test_seed_table_reproduces_the_seed_figures():
    t = fplut_tables.get_table("silu_seed")
    assert t.function == "silu"
    assert list(t.cut_points) == fplut_search.SEED_TABLES["silu_seed"][1]
    st = fplut.error_stats("silu", t.cut_points, t.values)
    assert st["max_abs"] == pytest.approx(5.8e-3, abs=0.05e-3)
    assert st["max_rel"] == pytest.approx(8.1e-3, abs=0.05e-3)
    assert st["exact_pct"] == pytest.approx(80.4, abs=0.05)
    assert st["within_1ulp_pct"] == pytest.approx(96.4, abs=0.05)


def test_search_objective_is_error_stats_max_rel():
    # the piece decomposition the search optimises reports error_stats' max_rel (f stays in the fp16 range)
    for name in ("silu", "silu_seed", "tanh"):
        t = fplut_tables.get_table(name)
        assert fplut_search.representable_max_rel(t.function, t.cut_points) == \
            fplut.error_stats(t.function, t.cut_points, t.values)["max_rel"]


def test_numba_and_numpy_interval_errors_agree():
    prob = fplut_search._Problem("silu")
    rng = np.random.default_rng(0)
    ia = rng.integers(0, prob.n - 3000, 200)
    pairs = [(int(a), int(a + d)) for a, d in zip(ia, rng.integers(1, 3000, 200))]
    for nseg, closed in ((1, False), (32, False), (1, True)):
        a = fplut_search._Problem("silu")
        a.intervals(pairs, nseg, closed)
        b = fplut_search._Problem("silu")
        b.errors = fplut_interval_errors.errors_numpy
        b.intervals(pairs, nseg, closed)
        assert all(a.interval(p, q, nseg, closed) == b.interval(p, q, nseg, closed) for p, q in pairs)


def test_table_object_applies_the_reference():
    t = fplut_tables.get_table("gelu")
    x = halfbits.finite_fp16()[::97]
    assert np.array_equal(t(x).view(np.uint16), fplut.evaluate_fp16(x, t.cut_points, t.values).view(np.uint16))
    assert fplut_tables.get_table("gelu") is t            # loaded once, cached


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError) as e:
        fplut_tables.get_table("no_such_fn")
    assert "silu" in str(e.value) and "silu_seed" in str(e.value)
    with pytest.raises(KeyError):
        fplut_tables.stats("no_such_fn")


def test_plot_error_writes_a_png(tmp_path):
    path = tmp_path / "silu.png"
    fplut_plot.plot_error("silu", path)
    data = path.read_bytes()
    assert len(data) > 10_000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_reproduces_the_shipped_hardswish_table():
    # deterministic search (a few seconds); hardswish needs no transcendental, so no libm differences either
    assert fplut_search.search("hardswish") == list(fplut_tables.get_table("hardswish").cut_points)
