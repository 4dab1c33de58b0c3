"""Compiling one Python function as several Numba variants (serial and ``parallel=True``) with the disk cache kept
apart per variant: ``variant(fn, tag)``.

Numba's cache keys compiled code by the signature, the bytecode and the target machine, not by the options it was
compiled with (numba/numba#6845, open): a function jitted twice with ``cache=True``, once serial and once parallel,
shares one cache entry per signature, and a later process loads whichever variant compiled first for both. Measured
here (2026-11-29, this 2-core Zen 4): QuantGRU's serial recurrence, called for a one-row batch, ran the parallel
variant's code loaded from the cache, ~20 us more per call (a streaming int16 frame at H = 256 took 37 us instead
of 7); the other way round a parallel call gets serial code. ``variant`` gives each variant a copy of the function
under its own name (``<name>__<tag>``), so each has its own cache files; ``njit_variant(fn, parallel, **options)``
compiles such a copy, tagged "serial" or "parallel".
"""
from __future__ import annotations

import types

from numba import njit


def variant(fn, tag: str):
    """A copy of the plain Python function ``fn`` named ``fn.__name__ + "__" + tag`` (and qualname alike): same code,
    globals, defaults and closure; Numba's cache files are named after the qualname, so the copy's compiled code
    never meets ``fn``'s or another tag's."""
    name = f"{fn.__name__}__{tag}"
    qual = f"{fn.__qualname__}__{tag}"
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):        # Python >= 3.11
        code = code.replace(co_qualname=qual)
    out = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__qualname__ = qual
    out.__module__ = fn.__module__
    out.__doc__ = fn.__doc__
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def njit_variant(fn, parallel: bool, **options):
    """``njit(parallel=parallel, **options)`` of ``variant(fn, "parallel" | "serial")``: how QuantGRU's, KVAttention's,
    Rotary's, RotaryKV's and RMSNorm's CPU kernels compile both ways (the dequant native entries' serial copies still
    spell out ``njit(...)(variant(fn, "serial"))``)."""
    return njit(parallel=parallel, **options)(variant(fn, "parallel" if parallel else "serial"))
