"""Ratios said in words, one direction everywhere (demo, bench, --tune): "1.80x faster" / "1.30x slower" for
times, "3.57x smaller" / "1.20x larger" for sizes; the figure is always >= 1, the word says which way."""
from __future__ import annotations


def _words(before, after, less: str, more: str, same: str) -> str:
    if before is None or after is None or before <= 0 or after <= 0:
        return ""
    if after < before:
        return f"{before / after:.2f}x {less}"
    if after > before:
        return f"{after / before:.2f}x {more}"
    return same


def speed(before_ms, after_ms) -> str:
    """``before_ms`` (e.g. the original's time) against ``after_ms`` (the rewritten one's): "1.80x faster"."""
    return _words(before_ms, after_ms, "faster", "slower", "as fast (1.00x)")


def size(before, after) -> str:
    """Bytes before against after: "3.57x smaller" / "1.20x larger"."""
    return _words(before, after, "smaller", "larger", "the same size (1.00x)")
