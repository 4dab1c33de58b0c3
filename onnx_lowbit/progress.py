"""The CLI's status line for long steps: which step runs (e.g. "pass 7/7 gru"), what it is doing now (a pass's own
notes through its ``progress`` option, e.g. the GRU node it calibrates and the range-search trial) and how long
the step has taken so far.

On a terminal the line is redrawn in place every half second, so a long step visibly moves even while one numpy
or onnxruntime call runs, and erased when the command is done. Elsewhere (a pipe, a log file) notes are written as
lines of their own: a step's first note, then at most one every ``every`` seconds, and a "still running" line
when ``heartbeat`` seconds pass without one; steps that make no notes and end quickly print nothing there.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time


def _clock(seconds: float) -> str:
    s = int(seconds)
    # under 10 s tenths, truncated as the whole seconds are (rounded, 9.96 s read "10.0s")
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{int(seconds * 10) / 10:.1f}s" if seconds < 10 else f"{s}s"


class Status:
    def __init__(self, stream=None, live: bool | None = None, interval: float = 0.5, every: float = 5.0,
                 heartbeat: float = 30.0):
        self.stream = stream if stream is not None else sys.stderr
        self.live = self._isatty() if live is None else live
        self.interval, self.every, self.heartbeat = interval, every, heartbeat
        self._noted = False         # the current step has written a note line (not live)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._step = self._note = ""
        self._t0 = self._last_print = time.monotonic()
        self._width = 0
        self._thread = None

    def _isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def __enter__(self):
        self._thread = threading.Thread(target=self._tick, name="onnx-lowbit-status", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.live and self._width:
            self._write("\r" + " " * self._width + "\r")
        return False

    def step(self, name: str) -> None:
        """A new step begins (its clock starts at zero)."""
        with self._lock:
            self._step, self._note, self._noted = name, "", False
            self._t0 = self._last_print = time.monotonic()
        self._draw()

    def note(self, message: str) -> None:
        """What the current step is doing now."""
        with self._lock:
            self._note = message
            now = time.monotonic()
            if not self.live and (not self._noted or now - self._last_print >= self.every):
                self._noted, self._last_print = True, now
                self._write(f"onnx-lowbit: {self._line()}\n")
        self._draw()

    def _line(self) -> str:
        elapsed = _clock(time.monotonic() - self._t0)
        return f"[{elapsed}] {self._step}: {self._note or 'running'}" if self._step else ""

    def _draw(self) -> None:
        if not self.live:
            return
        with self._lock:
            line = self._line()
            line = line[:self._columns() - 1]  # a line that wrapped could not be redrawn in place
            pad = max(0, self._width - len(line))
            self._width = len(line)
            self._write("\r" + line + " " * pad)

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or 100
        except (AttributeError, ValueError, OSError):
            return shutil.get_terminal_size((100, 24)).columns

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            if self.live:
                self._draw()
                continue
            with self._lock:
                now = time.monotonic()
                if self._step and now - self._last_print >= self.heartbeat:
                    self._last_print = now
                    self._write(f"onnx-lowbit: {self._line()} (still running)\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream must not break the command
            pass
