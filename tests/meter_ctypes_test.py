"""The remat CPU meter measures PyTorch in Python exactly as it measures LibTorch in C++ (loaded by ctypes)."""
import ctypes
import sys

import torch

lib = ctypes.CDLL(sys.argv[1])
for name in ("remat_meter_active_bytes", "remat_meter_peak_bytes", "remat_meter_allocations"):
    getattr(lib, name).restype = ctypes.c_int64
assert lib.remat_meter_install() == 0, "install failed"

before = lib.remat_meter_active_bytes()
lib.remat_meter_reset_peak()
t = torch.empty(1000, dtype=torch.float32)
assert lib.remat_meter_active_bytes() - before == 4000, lib.remat_meter_active_bytes() - before
del t
assert lib.remat_meter_active_bytes() == before
assert lib.remat_meter_peak_bytes() - before == 4000

# A training step: activations counted, and freed again after backward.
lin = torch.nn.Linear(64, 64)
x = torch.randn(32, 64)
base = lib.remat_meter_active_bytes()
y = torch.nn.functional.gelu(lin(x))
kept = lib.remat_meter_active_bytes() - base
assert kept == 2 * 32 * 64 * 4, kept  # linear output (saved by gelu) and gelu output
y.sum().backward()
del y
print("meter_ctypes_python: ok")
