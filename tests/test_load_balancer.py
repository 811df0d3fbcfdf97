"""docs/examples/nginx-replicas.conf: two mlxd replicas behind nginx on loopback, as shipped
(only the ports are changed). Requests through nginx reach both replicas, streams come through
token by token, and with one replica stopped every request is served by the other. Skipped
where nginx is not installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.test_distributed import _free_ports

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "docs" / "examples" / "nginx-replicas.conf"


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not start:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def balanced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    nginx = shutil.which("nginx")
    if nginx is None:
        pytest.skip("nginx is not installed")
    work = tmp_path_factory.mktemp("nginx")
    first = _free_ports(3)
    front, a, b = first, first + 1, first + 2
    config = (CONFIG.read_text().replace("127.0.0.1:8080", f"127.0.0.1:{front}")
              .replace("127.0.0.1:8081", f"127.0.0.1:{a}").replace("127.0.0.1:8082",
                                                                  f"127.0.0.1:{b}"))
    (work / "nginx.conf").write_text(config)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, port in (("a", a), ("b", b)):
            log = work / f"{name}.log"
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "mlxd", "serve", "--port", str(port), "--no-warmup",
                 "--served-model-name", "m"], stdout=log.open("w"), stderr=subprocess.STDOUT,
                cwd=REPO, stdin=subprocess.DEVNULL)
        for name, port in (("a", a), ("b", b)):
            _wait(f"http://127.0.0.1:{port}", procs[name], work / f"{name}.log")
        log = work / "nginx.out"
        procs["nginx"] = subprocess.Popen([nginx, "-p", str(work), "-c", str(work / "nginx.conf")],
                                          stdout=log.open("w"), stderr=subprocess.STDOUT)
        _wait(f"http://127.0.0.1:{front}", procs["nginx"], log)
        yield {"url": f"http://127.0.0.1:{front}", "a": f"http://127.0.0.1:{a}",
               "b": f"http://127.0.0.1:{b}", "procs": procs}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _generated(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=5).json()["engine"]["num_generated_tokens"])


def _complete(url: str, i: int) -> dict:
    body = {"model": "m", "prompt": f"def f{i}(x):", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_reach_both_replicas(balanced: dict) -> None:
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda i: _complete(balanced["url"], i), range(6)))
    assert all(o["usage"]["completion_tokens"] > 0 for o in outs)
    assert _generated(balanced["a"]) > 0 and _generated(balanced["b"]) > 0


def test_stream_through_the_balancer(balanced: dict) -> None:
    body = {"model": "m", "prompt": "def g():", "max_tokens": 12, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{balanced['url']}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_a_stopped_replica_is_passed_over(balanced: dict) -> None:
    """Runs last in this module: replica a is stopped; every request is served by b."""
    procs = balanced["procs"]
    procs["a"].terminate()
    procs["a"].wait(20)
    before = _generated(balanced["b"])
    for i in range(4):
        _complete(balanced["url"], 100 + i)
    assert _generated(balanced["b"]) > before
