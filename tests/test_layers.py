"""The layer boundaries of docs/architecture.md, checked on every import statement of the tree.

    mlxd/ (CLI, top) → server/ → engine.api ← engine/ → kernels/ (floor; kernels.device first)

- `server/` imports `engine.api` and nothing else of the engine, never mlx, mlx-lm or kernels;
- `engine/` never imports the server, the web stack or the CLI package `mlxd`;
- `kernels/` imports neither the engine, the server nor `mlxd`;
- no product package imports the development tools `bench` or `reliability`.

Imports inside functions count the same as top-level ones (the scan walks the whole syntax tree).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WEB = ("fastapi", "starlette", "pydantic", "sse_starlette", "uvicorn")
DEV_TOOLS = ("bench", "reliability")

# package -> the top-level modules (or dotted prefixes) it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "server": ("mlx", "mlx_lm", "kernels", "mlxd", *DEV_TOOLS),
    "engine": ("server", "mlxd", *WEB, *DEV_TOOLS),
    "kernels": ("engine", "server", "mlxd", *WEB, *DEV_TOOLS),
    "mlxd": DEV_TOOLS,
}
# what `server/` may take from the engine package
SERVER_ENGINE_ALLOWED = ("engine.api",)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement in `path` names, as (line, dotted name); relative
    imports resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.append((node.lineno, base))
            # `from engine import scheduler` names the module engine.scheduler
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(package: str) -> list[str]:
    bad: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT)
        for line, name in imported_modules(path):
            if any(_matches(name, f) for f in FORBIDDEN[package]):
                bad.append(f"{rel}:{line} imports {name}")
            elif package == "server" and _matches(name, "engine"):
                if name != "engine" and not any(_matches(name, a) for a in SERVER_ENGINE_ALLOWED):
                    bad.append(f"{rel}:{line} imports {name} (the server sees only engine.api)")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_boundaries(package: str) -> None:
    assert (ROOT / package).is_dir()
    assert violations(package) == []


def test_scanner_catches_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan itself works: a fake tree with each kind of crossing is reported."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "x.py").write_text(
        "import mlx.core as mx\nfrom engine.core import Engine\nfrom engine.api import Request\n"
    )
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "y.py").write_text("def f():\n    from ..engine import core\n")
    assert violations("server") == [
        "server/x.py:1 imports mlx.core",
        "server/x.py:2 imports engine.core (the server sees only engine.api)",
        "server/x.py:2 imports engine.core.Engine (the server sees only engine.api)",
    ]
    assert violations("kernels") == ["kernels/y.py:2 imports engine", "kernels/y.py:2 imports engine.core"]


def test_server_runs_without_mlx() -> None:
    """Importing the whole server (every API module) loads no mlx, no engine module but the seam
    and no kernel (the seam's package loads only `kernels.device`, the BLAS): checked in a fresh
    interpreter."""
    code = (
        "import sys, pkgutil, importlib, server\n"
        "for m in pkgutil.iter_modules(server.__path__):\n"
        "    importlib.import_module('server.' + m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')\n"
        "             or (m.startswith('engine.') and m != 'engine.api')\n"
        "             or (m.startswith('kernels.') and m != 'kernels.device'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
