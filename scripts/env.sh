# Sourced by ./run and ./test: the environment remat's programs and benchmarks run in.
#
# Debian's libtorch calls the system BLAS. These VMs report a generic CPU name, so OpenBLAS would pick a slow
# generic kernel; choose it from the CPU flags instead. A value already set in the environment wins.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    export OPENBLAS_CORETYPE=SkylakeX
  elif grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    export OPENBLAS_CORETYPE=Haswell
  fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
# glibc's malloc gives large freed blocks back to the kernel and takes fresh, zero-filled pages on the next
# allocation: a training step that frees and reallocates its activations pays page faults for them, and a
# stage-by-stage backward (the plan executor's) most: single runs here took a 16-block MLP's plan-all step from
# 128 to 112 ms and a plain BERT-base step from 2872 to 2598 ms (docs/cpu-tuning.md). Keep
# freed memory in the process, as a caching allocator does (PyTorch's CPU tuning guide uses jemalloc or
# tcmalloc for this). Both libraries of every benchmark run under it; the memory meter counts tensor bytes, not
# the process's size. A value already set wins.
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-4294967296}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-68719476736}"
# Debian's python3-torch (for the side-by-side benchmark) lives in the system Python, not in a pyenv one.
export REMAT_PYTHON="${REMAT_PYTHON:-/usr/bin/python3}"
# The virtual environment of PyPI's torch 2.15 (scripts/setup --torch pypi, ./test --torch pypi): outside the
# source tree, shared by every checkout.
export REMAT_PYPI_VENV="${REMAT_PYPI_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/remat/torch-2.15}"
