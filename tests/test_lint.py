"""ruff (the rules in pyproject.toml) and mypy (its `files`: server, engine, kernels, mlxd) are
clean: part of the suite, so CI runs them with the README's test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUFF_PATHS = ["server", "engine", "kernels", "mlxd", "bench", "reliability", "tests"]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_ruff_clean() -> None:
    out = _run("ruff", "check", "--no-cache", *RUFF_PATHS, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_clean() -> None:
    out = _run("mypy", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success" in out.stdout
