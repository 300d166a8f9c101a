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
``max_memory_allocated``) are exact in the same sense; remat resets the device's peak statistic when it
measures.
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
from pathlib import Path

import torch

__all__ = ["Meter", "CpuMeter", "CudaMeter", "cpu_meter", "meter_for", "MeterUnavailable"]

_SOURCES = ("cpu_meter.cpp", "meter_c.cpp", "detail/cpu_meter.h", "detail/compat_c10.h")


class MeterUnavailable(RuntimeError):
    """The CPU meter could not be built or loaded (the message says why and what to do)."""


class Meter:
    """Bytes of tensor storage on one device: active() now, peak() since the last reset_peak()."""

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


class CudaMeter(Meter):
    """The CUDA caching allocator's statistics for one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def active(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def raise_peak(self, nbytes: int) -> None:
        # The allocator's peak cannot be set; it stays at what it saw since remat's last reset.
        pass


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
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           "-DREMAT_METER_C_LIBRARY=1", f"-I{src}", f"-I{include}", f"-I{include / 'torch/csrc/api/include'}", str(src / "cpu_meter.cpp"),
           str(src / "meter_c.cpp"), f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o", tmp]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise MeterUnavailable("remat.meter: compiling the CPU meter failed:\n" + " ".join(cmd) + "\n" +
                                   run.stderr[-4000:])
        os.replace(tmp, out)  # atomic: a concurrent build leaves one complete library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cpu_meter() -> CpuMeter:
    """The process's CPU meter, installed on first use (building it once per torch build; see the module's
    documentation). Raises MeterUnavailable when it cannot be built or loaded."""
    global _cpu
    with _lock:
        if _cpu is not None:
            return _cpu
        given = os.environ.get("REMAT_METER_LIBRARY")
        if given:
            _cpu = CpuMeter(given)
            return _cpu
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
        _cpu = CpuMeter(str(out))
        return _cpu


def meter_for(device: torch.device | str) -> Meter:
    """The meter of a device: cpu_meter() for the CPU, the allocator's statistics for a CUDA device. Raises
    ValueError for other devices."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_meter()
    if device.type == "cuda":
        return CudaMeter(device)
    raise ValueError(f"remat.meter: no meter for device '{device}' (cpu and cuda have one)")
