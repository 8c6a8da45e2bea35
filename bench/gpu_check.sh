#!/usr/bin/env bash
# The KV pull on a real GPU, in one command on a bare GPU machine (issue 28):
#
#   bash bench/gpu_check.sh --prepare     # here, once: fill the carry folder (.gpu/)
#   bash bench/gpu_check.sh [OUT]         # there: install, build, check, measure
#
# Run mode:
#   1. installs the wheels carried in $PDSERVE_GPU_CARRY (default .gpu/: libucx-cu12) into a
#      private folder ($PDSERVE_GPU_SITE, default /tmp/pdserve-gpu-site) put on PYTHONPATH;
#   2. builds the native extension against that UCX into $PDSERVE_GPU_BUILD (default
#      /tmp/pdserve-gpu-native), with the carried Python headers when the interpreter has none
#      (or those in $PDSERVE_GPU_PY_INCLUDE);
#   3. runs `python -m bench.gpu_check` (bench/gpu_check.py says what it measures).
# OUT defaults to $OUT, else bench-out/gpu-check. Everything printed also goes to
# OUT/gpu_check.log; the results go to OUT/gpu_check.json. Exit status: 0 all passed on a GPU,
# 3 no GPU (the host part ran and passed), anything else a failure (the log says which step).
# The interpreter is $PYTHON, default python3 (the GPU image's, which holds torch and numpy).
#
# Prepare mode downloads libucx-cu12 (Python 3.12, manylinux x86-64, 43 MB) into .gpu/, copies
# Python 3.12's headers there when this machine has them (.gitignore keeps .gpu/ out of git;
# it travels to the GPU machine as a carried path: `run(carry=[".gpu"])`).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
CARRY=${PDSERVE_GPU_CARRY:-.gpu}
UCX_WHEEL=${PDSERVE_GPU_UCX_WHEEL:-libucx-cu12==1.22.0}

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$CARRY"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY" "$UCX_WHEEL" \
    || { echo "FAILED: pip download $UCX_WHEEL"; exit 1; }
  inc=$(PYENV_VERSION=$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | tail -1) \
        python3.12 -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null)
  if [ -n "$inc" ] && [ -f "$inc/Python.h" ]; then
    rm -rf "$CARRY/python3.12-include" && cp -r "$inc" "$CARRY/python3.12-include"
  else
    echo "note: no Python 3.12 headers here; the GPU machine must have its own"
  fi
  du -sh "$CARRY"; ls "$CARRY"
  exit 0
fi

OUT=${1:-${OUT:-bench-out/gpu-check}}
SITE=${PDSERVE_GPU_SITE:-/tmp/pdserve-gpu-site}
BUILD=${PDSERVE_GPU_BUILD:-/tmp/pdserve-gpu-native}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
: > "$OUT/gpu_check.log"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
echo "== gpu_check $(date -u +%FT%TZ) on $(hostname): $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
nvidia-smi -L 2>&1 || echo "== nvidia-smi: not available"

step() { echo "== $1 ($(date -u +%T))"; }
step "install carried wheels"
if compgen -G "$CARRY/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$CARRY"/*.whl || { echo "FAILED: installing $CARRY/*.whl"; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import libucx" 2>/dev/null \
  || { echo "FAILED: libucx-cu12 is neither installed nor carried in $CARRY/ (run: bash bench/gpu_check.sh --prepare)"; exit 1; }

info="$SITE/libucx/bin/ucx_info"
if [ -x "$info" ]; then
  step "UCX as the wheel sees this machine"
  LD_LIBRARY_PATH="$SITE/libucx/lib" "$info" -v 2>&1 | head -3
  LD_LIBRARY_PATH="$SITE/libucx/lib" "$info" -d 2>&1 | grep -E "Memory domain|Transport|memory types" | head -80
fi

step "build the native extension"
cflags=""
inc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if [ -n "${PDSERVE_GPU_PY_INCLUDE:-}" ] || [ ! -f "$inc/Python.h" ]; then
  ver=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")
  inc=${PDSERVE_GPU_PY_INCLUDE:-$CARRY/python$ver-include}
  [ -f "$inc/Python.h" ] || { echo "FAILED: no Python.h for Python $ver here or in $inc"; exit 1; }
  cflags="-I$(cd "$inc" && pwd)"
  echo "Python headers: $inc"
fi
"$PY" -m kernels.native.build --out "$BUILD" --force --cflags="$cflags" || { echo "FAILED: native build"; exit 1; }

step "check and measure"
PYTHONUNBUFFERED=1 "$PY" -m bench.gpu_check --out "$OUT" --native-build "$BUILD" "${@:2}"
rc=$?
step "done: exit $rc"
exit $rc
