#!/bin/sh
# Install mlxd into ./.venv (Python 3.11+). `sh scripts/install.sh test` adds the test extras.
# On Linux it also installs an optimised BLAS (Debian/Ubuntu: libopenblas0-pthread) when it can:
# mlxd loads it before MLX, which makes float32 matmuls on the CPU ~30x faster.
set -eu
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
PY=${PYTHON:-python3}

if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo -n"
    if $SUDO true 2>/dev/null; then
      echo "installing OpenBLAS (libopenblas0-pthread)"
      $SUDO apt-get update -qq >/dev/null && \
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null || \
        echo "warning: could not install libopenblas0-pthread; MLX's reference BLAS will be used"
    else
      echo "note: run 'sudo apt-get install libopenblas0-pthread' for a ~30x faster CPU matmul"
    fi
  else
    echo "note: install OpenBLAS (libopenblas.so.0) for a ~30x faster CPU matmul"
  fi
fi

# The test suite drives the chat page in a real headless browser (Debian's chromium).
if [ -n "$extras" ] && [ "$(uname -s)" = "Linux" ] && ! command -v chromium >/dev/null 2>&1 \
   && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo -n"
  if $SUDO true 2>/dev/null; then
    echo "installing chromium + chromium-driver for the browser test"
    $SUDO apt-get update -qq >/dev/null && \
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null || \
      echo "warning: could not install chromium; the browser test will be skipped"
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e ".$extras"
echo "mlxd installed in .venv"
