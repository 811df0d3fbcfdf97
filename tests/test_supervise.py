"""mlxd/supervise.py: a child that dies by a signal is started again, a child that exits is not,
signals to the supervisor stop the child without a restart, and the restart budget ends. The
last test runs `mlxd serve --supervise` on the bundled model and kills the real server with
SIGABRT (what MLX's `std::terminate` does) and checks that it serves again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from mlxd.supervise import child_argv, supervise

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


@pytest.mark.parametrize("flag", ["--supervise", "--superv", "--su"])
def test_child_argv_drops_supervise(flag):
    """The child is the same server without supervision, as the serve parser reads it."""
    import argparse

    from mlxd.cli import _serve_parser

    argv = ["serve", flag, "--port", "9", "--max-restarts", "3"]
    child = child_argv(argv)
    assert child[:3] == [sys.executable, "-m", "mlxd"]
    assert child[3:] == ["serve", "--port", "9", "--max-restarts", "3"]
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(argv).supervise and not parser.parse_args(child[3:]).supervise


def test_crash_is_restarted_then_clean_exit_returns(tmp_path):
    runs = tmp_path / "runs"
    cmd = _script(tmp_path, f"""
        import os, sys
        from pathlib import Path
        runs = Path({str(runs)!r})
        n = int(runs.read_text()) if runs.exists() else 0
        runs.write_text(str(n + 1))
        assert not any(k.startswith("MLXD_SUPER") for k in os.environ)
        if n < 2:
            os.abort()          # what std::terminate ends in: SIGABRT
        sys.exit(0)
    """)
    assert supervise(cmd, max_restarts=5, backoff=0.01) == 0
    assert runs.read_text() == "3"  # two crashes, two restarts, then a clean exit


def test_exit_code_is_passed_through_without_restart(tmp_path):
    runs = tmp_path / "runs"
    cmd = _script(tmp_path, f"""
        from pathlib import Path
        p = Path({str(runs)!r}); p.write_text(p.read_text() + "x" if p.exists() else "x")
        raise SystemExit(2)     # e.g. a --kv-bits the device cannot run
    """)
    assert supervise(cmd, backoff=0.01) == 2
    assert runs.read_text() == "x"


def test_restart_budget_ends(tmp_path):
    runs = tmp_path / "runs"
    cmd = _script(tmp_path, f"""
        import os, signal
        from pathlib import Path
        p = Path({str(runs)!r}); p.write_text(p.read_text() + "x" if p.exists() else "x")
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    assert supervise(cmd, max_restarts=2, backoff=0.01) == 1
    assert runs.read_text() == "xxx"  # the first run and two restarts


def test_sigterm_to_supervisor_stops_child_without_restart(tmp_path):
    ready, runs = tmp_path / "ready", tmp_path / "runs"
    child = _script(tmp_path, f"""
        import signal, sys, time
        from pathlib import Path
        p = Path({str(runs)!r}); p.write_text(p.read_text() + "x" if p.exists() else "x")
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        Path({str(ready)!r}).write_text("1")
        time.sleep(60)
    """)
    sup = tmp_path / "sup.py"
    sup.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from mlxd.supervise import supervise
        raise SystemExit(supervise({child!r}, backoff=0.01))
    """))
    proc = subprocess.Popen([sys.executable, str(sup)])
    try:
        for _ in range(200):
            if ready.exists():
                break
            time.sleep(0.05)
        assert ready.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert runs.read_text() == "x"  # stopped, not restarted


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _wait_ready(url: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the child")
def test_supervised_server_serves_again_after_sigabrt(tmp_path, tinycoder_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", "--supervise", "--model", str(tinycoder_path),
         "--port", str(port), "--max-restarts", "2"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
    )
    try:
        assert _wait_ready(url, 120), (tmp_path / "serve.log").read_text()[-2000:]
        first = _children(proc.pid)
        assert len(first) == 1
        os.kill(first[0], signal.SIGABRT)
        assert _wait_ready(url, 120), (tmp_path / "serve.log").read_text()[-2000:]
        second = _children(proc.pid)
        assert len(second) == 1 and second != first
        r = httpx.post(url + "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "died with SIGABRT; restarting" in text
