# Sourced by scripts/build and ./test: compile through ccache when it is installed and REMAT_CCACHE is not 0
# (scripts/build explains the settings). Prints nothing; sets and exports the variables ccache and CMake read.
if [ "${REMAT_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  export CCACHE_DIR="${CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/remat/ccache}"
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
  export CCACHE_NOHASHDIR=true
  # The precompiled header (REMAT_USE_PCH) is compiled and used through ccache too.
  export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
  export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-20G}"
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache
else
  unset CMAKE_CXX_COMPILER_LAUNCHER
fi
