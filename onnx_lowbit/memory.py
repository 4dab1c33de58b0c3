"""Peak memory of a block of work, for ``onnx-lowbit bench`` (see onnx_lowbit/bench.py for how the figures are
used).

    HostMemory().measure()     peak RSS delta: VmHWM reset through /proc/self/clear_refs where Linux allows it,
                               else RSS sampled every millisecond
    DeviceMemory().measure()   device memory in use after minus before (NVML via pynvml, else cudaMemGetInfo via
                               cupy, else nvidia-smi): device-wide

    with HostMemory().measure() as m:
        ...
    m.peak   # bytes
"""
from __future__ import annotations

import gc
import threading

MIB = 1024.0 * 1024.0


class _Sampler:
    """Calls ``fn`` every ``interval`` s in a thread and keeps the largest value."""

    def __init__(self, fn, interval):
        self.fn, self.interval, self.peak = fn, interval, fn()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.fn())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.fn())


def _status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(key)


def release_host_memory():
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class HostMemory:
    """Peak RSS delta of a block (see the module doc)."""

    def __init__(self):
        self.method = "peak RSS delta (VmHWM reset via /proc/self/clear_refs)"
        try:
            _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            _status_kib("VmHWM")
            self._reset = True
        except OSError:
            self._reset = False
            self.method = "peak RSS delta (RSS sampled every 1 ms)"

    def measure(self):
        return _Measure(self)


class _Measure:
    def __init__(self, mem):
        self.mem, self.peak = mem, None

    def __enter__(self):
        release_host_memory()
        if self.mem._reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.before = _status_kib("VmRSS")
        else:
            self.before = _rss()
            self._s = _Sampler(_rss, 0.001).__enter__()
        return self

    def __exit__(self, *exc):
        if self.mem._reset:
            self.peak = _status_kib("VmHWM") - self.before
        else:
            self._s.__exit__()
            self.peak = self._s.peak - self.before


def _rss():
    try:
        return _status_kib("VmRSS")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class DeviceMemory:
    """Device memory in use on ``device_id`` (see the module doc)."""

    def __init__(self, device_id=0):
        self.device_id = device_id
        self._fn = None
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(device_id)
            self._fn = lambda: int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
            self.method = "device memory used (NVML) after runs minus before session"
        except Exception:  # noqa: BLE001 - pynvml absent or no driver
            pass
        if self._fn is None:
            try:
                import cupy
                cupy.cuda.runtime.setDevice(device_id)

                def used():
                    free, total = cupy.cuda.runtime.memGetInfo()
                    return int(total - free)
                used()
                self._fn = used
                self.method = "device memory used (cudaMemGetInfo via cupy) after runs minus before session"
            except Exception:  # noqa: BLE001
                pass
        if self._fn is None:
            import shutil
            if shutil.which("nvidia-smi") is None:
                self.method = "unavailable (no pynvml, cupy or nvidia-smi)"
                self._fn = lambda: 0
            else:
                self._fn = self._smi
                self.method = "device memory used (nvidia-smi --query-gpu=memory.used) after runs minus before session"

    def _smi(self):
        import subprocess
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", str(self.device_id)], capture_output=True, text=True, timeout=30).stdout
            return int(float(out.strip().splitlines()[0]) * MIB)
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return 0

    def measure(self):
        return _DeviceMeasure(self)


class _DeviceMeasure:
    def __init__(self, mem):
        self.mem, self.peak = mem, None

    def __enter__(self):
        release_host_memory()
        self.before = self.mem._fn()
        return self

    def __exit__(self, *exc):
        self.peak = self.mem._fn() - self.before
