"""Start and stop the servers under test as subprocesses on free loopback ports.

Each server is described by a `ServerSpec` (how to build its command line); `ServerProcess`
owns one running instance: free port, readiness wait, CPU and memory readings from /proc, and a
clean stop (SIGINT → SIGTERM → SIGKILL, each with a bounded wait). Every wait is bounded.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HOST = "127.0.0.1"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class ServerSpec:
    """A server under test. `build(model_dir, port)` returns its argv."""

    name: str
    label: str  # for plots and tables
    build: Callable[[str, int], list[str]]
    env: dict[str, str] = field(default_factory=dict)
    request_model: str | None = None  # value of the "model" field; None: ask /v1/models
    supports_ignore_eos: bool = False
    note: str = ""


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def mlxd_spec(extra: list[str] | None = None, name: str = "mlxd", blas: str | None = None) -> ServerSpec:
    extra = list(extra or [])

    def build(model: str, port: int) -> list[str]:
        argv = _py("-m", "mlxd", "serve", "--model", model, "--host", HOST, "--port", str(port),
                   "--log-level", "WARNING")
        if blas:
            argv += ["--blas", blas]
        return argv + extra

    return ServerSpec(name, name, build, supports_ignore_eos=True,
                      note="mlxd as a user runs it (optimised BLAS auto-detected, float32 on CPU)")


def mlx_lm_spec(preload_blas: str | None = None, name: str = "mlx_lm",
                extra: list[str] | None = None) -> ServerSpec:
    """mlx_lm.server; with `preload_blas`, the library is ctypes-loaded RTLD_GLOBAL first."""
    extra = list(extra or [])

    def build(model: str, port: int) -> list[str]:
        server_args = ["--model", model, "--host", HOST, "--port", str(port),
                       "--log-level", "WARNING", *extra]
        if preload_blas:
            return _py("-m", "bench.preload", preload_blas, "mlx_lm", "server", *server_args)
        return _py("-m", "mlx_lm", "server", *server_args)

    note = "mlx_lm.server 0.32.2 as a user runs it (MLX's bundled reference BLAS)"
    if preload_blas:
        note = f"mlx_lm.server with {preload_blas} loaded RTLD_GLOBAL before mlx"
    return ServerSpec(name, name, build, request_model="default_model", note=note)


def vllm_mlx_spec() -> ServerSpec:
    def build(model: str, port: int) -> list[str]:
        return _py("-c", "import sys; from vllm_mlx.cli import main; sys.exit(main())", "serve",
                   model, "--host", HOST, "--port", str(port), "--continuous-batching")

    return ServerSpec("vllm_mlx", "vllm-mlx", build, note="vllm-mlx serve --continuous-batching")


def vllm_mlx_available() -> bool:
    return importlib.util.find_spec("vllm_mlx") is not None


def _read_proc(pid: int, name: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_text()
    except OSError:
        return None


def rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid` from /proc/<pid>/status (Linux), None where unavailable."""
    text = _read_proc(pid, "status")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def cpu_seconds(pid: int) -> float | None:
    """user+system CPU seconds of `pid` (Linux /proc/<pid>/stat)."""
    text = _read_proc(pid, "stat")
    if text is None:
        return None
    fields = text.rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class ServerProcess:
    """One running server. Use as a context manager, or call start()/stop()."""

    def __init__(self, spec: ServerSpec, model: str, log_dir: Path, ready_timeout: float = 180.0):
        self.spec = spec
        self.model = model
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_dir / f"{spec.name}.log"
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.model_id: str | None = spec.request_model
        self.startup_s: float | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ServerProcess:
        argv = self.spec.build(self.model, self.port)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        env.update(self.spec.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 (closed with the process)
        log.write((" ".join(argv) + "\n").encode())
        log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(REPO), stdin=subprocess.DEVNULL)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last = ""
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} "
                                       f"before it was ready; log: {self.log_path}\n{self.log_tail()}")
                try:
                    r = client.get(f"{self.url}/v1/models")
                    if r.status_code == 200:
                        if self.model_id is None:
                            data = r.json().get("data") or []
                            self.model_id = data[0]["id"] if data else "default"
                        return
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as exc:
                    last = type(exc).__name__
                time.sleep(0.25)
        raise TimeoutError(f"{self.spec.name} not ready after {self.ready_timeout:.0f}s ({last}); "
                           f"log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL, waiting up to `grace_s` after each."""
        if self.proc is None:
            return None
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace_s if sig != signal.SIGKILL else 5.0)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
