"""The shipped FPLUT tables (``fplut_tables.json``, generated offline by ``python -m onnx_lowbit.fplut_search
--write``).

    >>> from onnx_lowbit import fplut_tables
    >>> t = fplut_tables.get_table("silu")          # an onnx_lowbit.fplut.Table
    >>> y = t(x)                                     # FPLUT SiLU of a float32 / float16 array

Each entry holds the 11 fp16 cut points, the 259 fp16 values and the exhaustive error figures of
:func:`onnx_lowbit.fplut.error_stats`.  ``silu_seed`` is the seed design's SiLU table, kept for comparison.
"""
from __future__ import annotations

import copy
import functools
import json
import os

import numpy as np

from . import fplut, halfbits
from .unary import evaluate

TABLES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fplut_tables.json")
STAT_KEYS = ("max_abs", "max_rel", "exact_pct", "within_1ulp_pct")


@functools.lru_cache(maxsize=None)
def _load() -> dict:
    """Read and validate the JSON once: name -> (Table, entry dict)."""
    with open(TABLES_PATH) as f:
        raw = json.load(f)
    out = {}
    for name, entry in raw.items():
        try:
            table = fplut.Table(entry["function"], tuple(float(c) for c in entry["cut_points"]),
                                np.asarray(entry["values"], dtype=np.float64).astype(np.float16))
            # the values must survive the fp16 round trip unchanged (fplut.validate checks representability)
            fplut.validate(entry["cut_points"], entry["values"])
            missing = [k for k in STAT_KEYS if k not in entry.get("stats", {})]
            if missing:
                raise fplut.TableError(f"stats lack {missing}")
        except (KeyError, TypeError, ValueError) as e:
            raise fplut.TableError(f"{TABLES_PATH}: table {name!r} is malformed: {e}") from e
        out[name] = (table, entry)
    return out


def available() -> list[str]:
    """Names of the shipped tables."""
    return list(_load())


def _entry(name: str):
    tables = _load()
    try:
        return tables[name]
    except KeyError:
        raise KeyError(f"no FPLUT table named {name!r}; known: {', '.join(tables)}") from None


def get_table(name: str) -> fplut.Table:
    """The shipped table ``name`` as an :class:`onnx_lowbit.fplut.Table` (loaded once, cached)."""
    return _entry(name)[0]


def stats(name: str) -> dict:
    """The shipped exhaustive figures of ``name``: max_abs, max_rel, exact_pct, within_1ulp_pct."""
    return {k: _entry(name)[1]["stats"][k] for k in STAT_KEYS}


def info(name: str) -> dict:
    """The whole JSON entry of ``name`` (function, objective, cut points, values, stats, ...), as a copy."""
    return copy.deepcopy(_entry(name)[1])


@functools.lru_cache(maxsize=None)
def clipped_stats(name: str) -> dict:
    """max_abs and max_rel of table ``name`` over all finite fp16 inputs against f clipped to +-65504, the largest
    fp16 value: what a table can reach at all. They differ from :func:`stats` only where f overflows fp16 (exp
    past x = 11.09, where every fp16 output stops at 65504 while exp(x) grows to 1e308); max_rel here is the
    search objective (the JSON's ``max_rel_representable``)."""
    table = get_table(name)
    x = halfbits.finite_fp16()
    y = fplut.evaluate_fp16(x, table.cut_points, table.values).astype(np.float64)
    ref = evaluate(table.function, x)
    finite = np.isfinite(ref)
    ref = np.clip(np.where(finite, ref, 0.0), -halfbits.FP16_MAX, halfbits.FP16_MAX)
    ae = np.where(finite, np.abs(y - ref), 0.0)
    re = ae / np.maximum(np.abs(ref), 2.0 ** -14)
    return {"max_abs": float(ae.max()), "max_rel": float(re.max())}
