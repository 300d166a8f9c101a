"""Exact memory meters: bytes of tensor storage alive now and the peak since a reset.

On CPU, remat's counting allocator (the C++ library's meter, ``libremat_meter``) wraps torch's CPU allocator
and counts every storage's bytes. It must be built against the torch it runs in, so this module compiles its
sources (shipped in the package, c10 only) with the system's C++ compiler the first time a CPU meter is asked
for, and caches the library per torch build in ``$REMAT_CACHE_DIR`` (default ``~/.cache/remat``); a compiler
(``$CXX``, else ``c++``) is needed once. ``$REMAT_METER_LIBRARY`` names a prebuilt library instead (the C++
build's ``libremat_meter.so`` against the same torch).

The meter counts storages allocated after it is installed, which happens at the first ``cpu_meter()`` call:
peaks are read above a base taken after that, as everything in remat does.

On CUDA the caching allocator's own statistics (``torch.cuda.memory_allocated`` and
``max_memory_allocated``) are exact in the same sense (up to the allocator's rounding of blocks).

remat's own measuring (the profiler, in-place planning) resets no statistic a user reads: it opens peak windows
(``Meter.window()``) on a running count of the device's tensor bytes (``Meter.count()``). On the CPU that is
the meter's own count; on CUDA it is the bytes tensors request from the caching allocator, followed through
the allocator's trace by the same library built with the CUDA allocator's headers (those of the CUDA toolkit
at ``$CUDA_HOME``, or of the ``nvidia`` packages beside torch). So ``torch.cuda.max_memory_allocated()`` after
a step that remat measured is what it would have been without remat. Where that library cannot be built,
remat falls back to resetting the CUDA peak statistic, and warns once saying so.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["Meter", "CpuMeter", "CudaMeter", "PeakWindow", "cpu_meter", "meter_for", "MeterUnavailable"]

_SOURCES = ("cpu_meter.cpp", "meter_c.cpp", "peak_window.cpp", "cuda_meter.cpp", "memory/cpu_meter.h",
            "detail/compat_c10.h", "memory/peak_window.h", "memory/cuda_meter.h")


class MeterUnavailable(RuntimeError):
    """The CPU meter could not be built or loaded (the message says why and what to do)."""


class PeakWindow:
    """The highest count() of a meter from the window's opening (or its last restart()) to now, read with
    peak(); no statistic anyone else reads is reset. Close it (or use it as a context manager) when done."""

    def __init__(self, lib, device: int):
        self._lib, self._device = lib, device
        self._slot = lib.remat_meter_window_open(device)
        if self._slot < 0:
            raise MeterUnavailable(f"remat.meter: no peak window free on device {device} (64 are open)")

    def peak(self) -> int:
        return int(self._lib.remat_meter_window_peak(self._device, self._slot))

    def restart(self) -> None:
        """Starts the peak again from the count now."""
        self._lib.remat_meter_window_close(self._device, self._slot)
        self._slot = self._lib.remat_meter_window_open(self._device)

    def close(self) -> None:
        if self._slot >= 0:
            self._lib.remat_meter_window_close(self._device, self._slot)
            self._slot = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _ResettingWindow:
    """A PeakWindow's stand-in where no window can be opened (CUDA without the meter library): resets the
    allocator's peak statistic."""

    def __init__(self, device):
        self._device = device
        torch.cuda.reset_peak_memory_stats(device)

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self._device))

    def restart(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class Meter:
    """Bytes of tensor storage on one device: active() now, peak() since the last reset_peak(). remat's own
    measuring uses count() and window() instead, which reset nothing."""

    def active(self) -> int:
        raise NotImplementedError

    def peak(self) -> int:
        raise NotImplementedError

    def reset_peak(self) -> None:
        """Sets the peak to the active bytes."""
        raise NotImplementedError

    def raise_peak(self, nbytes: int) -> None:
        """Raises the peak to nbytes if it is below (puts back a peak that a measurement reset)."""
        raise NotImplementedError

    def count(self) -> int:
        """The running count of tensor bytes that window() follows: its differences are exact bytes; its
        value has an arbitrary origin on CUDA."""
        raise NotImplementedError

    def window(self):
        """A PeakWindow over count(), opened now."""
        raise NotImplementedError


class CpuMeter(Meter):
    """remat's counting CPU allocator, through its C interface."""

    def __init__(self, path: str):
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise MeterUnavailable(f"remat.meter: cannot load the CPU meter {path}: {e}") from e
        for name in ("remat_meter_active_bytes", "remat_meter_peak_bytes", "remat_meter_allocations"):
            getattr(self._lib, name).restype = ctypes.c_int64
        self._lib.remat_meter_raise_peak.argtypes = [ctypes.c_int64]
        for name in ("remat_meter_window_active", "remat_meter_window_peak"):
            getattr(self._lib, name).restype = ctypes.c_int64
        if self._lib.remat_meter_install() != 0:
            raise MeterUnavailable(
                "remat.meter: the CPU meter could not install its allocator (another CPU allocator of higher "
                "priority is installed)")
        self.path = path

    def active(self) -> int:
        return int(self._lib.remat_meter_active_bytes())

    def peak(self) -> int:
        return int(self._lib.remat_meter_peak_bytes())

    def reset_peak(self) -> None:
        self._lib.remat_meter_reset_peak()

    def raise_peak(self, nbytes: int) -> None:
        self._lib.remat_meter_raise_peak(int(nbytes))

    def allocations(self) -> int:
        """Storage allocations counted so far."""
        return int(self._lib.remat_meter_allocations())

    def count(self) -> int:
        return self.active()

    def window(self) -> PeakWindow:
        return PeakWindow(self._lib, -1)

    def has_cuda(self) -> bool:
        """Whether this library follows CUDA devices too."""
        return bool(self._lib.remat_meter_has_cuda())


class CudaMeter(Meter):
    """The CUDA caching allocator's statistics for one device (active, peak, reset_peak), and remat's count
    of the bytes tensors request from it, followed through its trace (count, window)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._lib = _cuda_library()

    def active(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def raise_peak(self, nbytes: int) -> None:
        # The allocator's peak cannot be set; it stays at what it saw since remat's last reset.
        pass

    def count(self) -> int:
        if self._lib is None:
            return self.active()
        return int(self._lib.remat_meter_window_active(self.device.index))

    def window(self):
        if self._lib is None:
            return _ResettingWindow(self.device)
        return PeakWindow(self._lib, self.device.index)


_lock = threading.Lock()
_cpu: CpuMeter | None = None


def _cache_dir() -> Path:
    base = os.environ.get("REMAT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "remat")
    return Path(base) / "meter"


def _source_dir() -> Path:
    return Path(__file__).resolve().parent / "_meter"


def _build(src: Path, out: Path) -> None:
    torch_dir = Path(torch.__file__).resolve().parent
    include = torch_dir / "include"
    lib = torch_dir / "lib"
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise MeterUnavailable(
            "remat.meter: building the CPU meter needs a C++ compiler (set $CXX, or install g++), or set "
            "$REMAT_METER_LIBRARY to a libremat_meter.so built against this torch")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, "-O2", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           "-DREMAT_METER_C_LIBRARY=1", f"-I{src}", f"-I{include}", f"-I{include / 'torch/csrc/api/include'}",
           str(src / "cpu_meter.cpp"), str(src / "peak_window.cpp"), str(src / "meter_c.cpp")]
    cuda_include = _cuda_include_dir() if torch.version.cuda else None
    if cuda_include is not None:
        # The CUDA count too: the caching allocator's trace, through c10_cuda.
        cmd += ["-DREMAT_WITH_CUDA=1", f"-I{cuda_include}", str(src / "cuda_meter.cpp"), "-lc10_cuda"]
    cmd += [f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o", tmp]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise MeterUnavailable("remat.meter: compiling the CPU meter failed:\n" + " ".join(cmd) + "\n" +
                                   run.stderr[-4000:])
        os.replace(tmp, out)  # atomic: a concurrent build leaves one complete library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cuda_include_dir() -> Path | None:
    """Where cuda_runtime_api.h is: the CUDA toolkit's ($CUDA_HOME, /usr/local/cuda) or the nvidia packages'
    beside torch; None when neither has it."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    site = Path(torch.__file__).resolve().parent.parent / "nvidia"
    if site.is_dir():
        candidates += sorted(site.glob("*/include")) + sorted(site.glob("cuda_runtime/include"))
    for c in candidates:
        if (c / "cuda_runtime_api.h").exists():
            return c
    return None


_warned_no_cuda_window = False


def _cuda_library():
    """The meter library, when it follows CUDA devices; else None, with a warning once (remat's CUDA measuring
    then resets the allocator's peak statistic)."""
    global _warned_no_cuda_window
    reason = None
    try:
        lib = _load_cuda_library()
        if lib.remat_meter_has_cuda():
            return lib
        reason = ("it was built without the CUDA allocator's headers (no cuda_runtime_api.h under $CUDA_HOME, "
                  "/usr/local/cuda or the nvidia packages beside torch)")
    except MeterUnavailable as e:
        reason = str(e)
    if not _warned_no_cuda_window:
        _warned_no_cuda_window = True
        warnings.warn(f"remat.meter: remat cannot follow CUDA allocations without resetting the allocator's peak "
                      f"statistic, because the meter library cannot: {reason}. remat's measurements reset "
                      "torch.cuda's peak statistic (max_memory_allocated) while they run.", RuntimeWarning,
                      stacklevel=3)
    return None


def _library_path() -> str:
    """The meter library's path: $REMAT_METER_LIBRARY, or the one built for this torch (building it once)."""
    given = os.environ.get("REMAT_METER_LIBRARY")
    if given:
        return given
    src = _source_dir()
    missing = [s for s in _SOURCES if not (src / s).exists()]
    if missing:
        raise MeterUnavailable(f"remat.meter: the meter's sources are missing from {src} ({missing}); "
                               "reinstall remat with `pip install ./python`")
    h = hashlib.sha256()
    for s in _SOURCES:
        h.update((src / s).read_bytes())
    h.update(f"{torch.__version__} {Path(torch.__file__).resolve()} {sys.platform}".encode())
    out = _cache_dir() / f"libremat_meter-{h.hexdigest()[:16]}.so"
    if not out.exists():
        _build(src, out)
    return str(out)


def cpu_meter() -> CpuMeter:
    """The process's CPU meter, installed on first use (building it once per torch build; see the module's
    documentation). Raises MeterUnavailable when it cannot be built or loaded."""
    global _cpu
    with _lock:
        if _cpu is None:
            _cpu = CpuMeter(_library_path())
        return _cpu


_cuda_lib = None


def _load_cuda_library():
    """The meter library loaded without installing the CPU meter, when it follows CUDA devices; else the
    reason it does not."""
    global _cuda_lib
    with _lock:
        if _cuda_lib is None:
            path = _library_path()
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise MeterUnavailable(f"remat.meter: cannot load the meter {path}: {e}") from e
            for name in ("remat_meter_window_active", "remat_meter_window_peak"):
                getattr(lib, name).restype = ctypes.c_int64
            _cuda_lib = lib
        return _cuda_lib


def meter_for(device: torch.device | str) -> Meter:
    """The meter of a device: cpu_meter() for the CPU, the allocator's statistics for a CUDA device. Raises
    ValueError for other devices."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_meter()
    if device.type == "cuda":
        return CudaMeter(device)
    raise ValueError(f"remat.meter: no meter for device '{device}' (cpu and cuda have one)")
