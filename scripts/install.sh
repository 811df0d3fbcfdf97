#!/bin/sh
# Install mlxd into ./.venv (Python 3.11+). `sh scripts/install.sh test` adds the test extras.
# On Linux with apt, run as root or with passwordless sudo, it also installs an optimised BLAS
# (libopenblas0-pthread): mlxd loads it before MLX, which makes float32 matmuls on the CPU ~30x
# faster. With `test` it installs chromium + chromium-driver there too, for the chat-page browser
# test. apt-get waits up to APT_LOCK_WAIT seconds for another apt/dpkg (unattended upgrades on a
# fresh machine) to let go of its lock. PYTHON picks the interpreter that makes the venv.
set -eu
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
PY=${PYTHON:-python3}
APT_LOCK_WAIT=120
SUDO=""
apt_updated=""

say() { echo "mlxd install: $*"; }

# True when packages can be installed with apt-get here; sets SUDO to what runs it as root.
can_apt() {
  [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1 || return 1
  if [ "$(id -u)" = "0" ]; then SUDO=""; return 0; fi
  sudo -n true >/dev/null 2>&1 || return 1
  SUDO="sudo -n"
}

# apt-get with a bounded wait for the apt/dpkg lock; its own output only when it fails.
apt_get() {
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=$APT_LOCK_WAIT -qq "$@" >/dev/null
}

# apt_install WHAT PACKAGE...: the package lists are refreshed once, then the packages installed.
apt_install() {
  what=$1; shift
  say "installing $what ($*) with apt-get; waits up to ${APT_LOCK_WAIT} s for the apt lock"
  if [ -z "$apt_updated" ]; then
    apt_get update || say "warning: apt-get update failed; trying the install with the lists there are"
    apt_updated=1
  fi
  if apt_get install -y "$@"; then say "installed $what"; return 0; fi
  return 1
}

have_openblas() { ls /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1; }

if [ "$(uname -s)" = "Linux" ] && ! have_openblas; then
  if can_apt; then
    apt_install OpenBLAS libopenblas0-pthread || \
      say "warning: could not install libopenblas0-pthread; MLX's reference BLAS (~30x slower) will be used"
  elif command -v apt-get >/dev/null 2>&1; then
    say "note: run 'sudo apt-get install libopenblas0-pthread' for a ~30x faster CPU matmul"
  else
    say "note: install OpenBLAS (libopenblas.so.0) for a ~30x faster CPU matmul"
  fi
fi

if [ -n "$extras" ] && [ "$(uname -s)" = "Linux" ] && ! command -v chromium >/dev/null 2>&1 && can_apt; then
  apt_install "chromium for the browser test" chromium chromium-driver || \
    say "warning: could not install chromium; the browser test will be skipped"
fi

if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv ($PY -m venv)"
  "$PY" -m venv .venv
fi
say "upgrading pip in .venv"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || say "warning: could not upgrade pip; going on with $(.venv/bin/python -m pip --version 2>/dev/null || echo 'the one there')"
say "installing the Python packages (mlxd$extras and its dependencies: MLX, FastAPI, ...); about a minute on a fresh machine"
start=$(date +%s)
.venv/bin/python -m pip install -q -e ".$extras"
say "installed the Python packages in $(( $(date +%s) - start )) s"
say "done: mlxd is in .venv (.venv/bin/mlxd serve starts it)"
