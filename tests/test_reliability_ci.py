"""CI-sized reliability suite against a real `mlxd serve` subprocess on the bundled model.

The long runs (200-stream disconnect storm, 1,000-request overload at concurrency 256, 10-minute
soak) are `python -m reliability --start`; see docs/reliability.md. Here: every bad-input case,
a 20-stream disconnect storm, cut-then-new request pairs at a full queue, and a 60-request
overload against --max-queue 4.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from bench.servers import ServerProcess, mlxd_spec
from reliability import bad_input, disconnect, overload
from reliability.common import Target, still_serving, wait_idle

pytestmark = pytest.mark.timeout(300)

MAX_QUEUE = 4
MAX_NUM_SEQS = 4

# Server bugs found by this suite and reported; xfail (not strict) until they are fixed, so that
# a fix shows up as XPASS. Keep the reason precise: request, response, expected.
KNOWN_SERVER_BUGS: dict[str, str] = {}  # all found so far are fixed (see docs/reliability.md)


@pytest.fixture(scope="module")
def server(tinycoder_path: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("mlxd-reliability")
    spec = mlxd_spec(["--max-queue", str(MAX_QUEUE), "--max-num-seqs", str(MAX_NUM_SEQS)])
    srv = ServerProcess(spec, str(tinycoder_path), log_dir, ready_timeout=120).start()
    try:
        yield srv
    finally:
        alive = srv.alive()
        rc = srv.stop()
        assert alive, f"mlxd died during the reliability tests (exit {rc}):\n{srv.log_tail(40)}"
        assert rc == 0, f"mlxd did not exit cleanly on SIGINT (exit {rc}):\n{srv.log_tail(10)}"


@pytest.fixture(scope="module")
def target(server: ServerProcess) -> Target:
    return Target(server.url, server.model_id or "default", pid=server.pid,
                  max_queue=MAX_QUEUE, max_num_seqs=MAX_NUM_SEQS)


def _case_params() -> list:
    params = []
    for case in bad_input.cases("MODEL"):
        marks = []
        if case.name in KNOWN_SERVER_BUGS:
            marks.append(pytest.mark.xfail(reason=KNOWN_SERVER_BUGS[case.name], strict=False))
        params.append(pytest.param(case.name, id=case.name, marks=marks))
    return params


@pytest.fixture(scope="module")
def case_map(target: Target) -> dict[str, bad_input.Case]:
    return {c.name: c for c in bad_input.cases(target.model)}


@pytest.mark.parametrize("case_name", _case_params())
def test_bad_input_case(target: Target, server: ServerProcess, case_map, case_name: str):
    case = case_map[case_name]

    async def go() -> str | None:
        # a known bug may be a request that runs on: do not let it hold CI for long
        timeout = 5.0 if case_name in KNOWN_SERVER_BUGS else 15.0
        async with httpx.AsyncClient(timeout=timeout) as client:
            try:
                r = await client.request(case.method, target.url + case.path,
                                         content=case.payload() or None, headers=case.headers)
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            return bad_input.judge(case, r)

    wrong = asyncio.run(go())
    assert server.alive(), f"the server died on {case_name!r}:\n{server.log_tail(30)}"
    assert wrong is None, f"{case_name}: {wrong}"


def test_still_serving_after_bad_input(target: Target):
    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            return await still_serving(client, target)

    assert asyncio.run(go()) == []


@pytest.fixture(scope="module")
def storm(target: Target):
    # at most MAX_QUEUE streams in flight, so a 429 means cut requests still hold queue slots
    return asyncio.run(disconnect.run(target, num_requests=20, concurrency=MAX_QUEUE,
                                      idle_within_s=2.0, seed=1, time_limit_s=120))


def test_disconnect_storm_frees_rows(storm):
    problems = [p for p in storm.problems if "turned away" not in p]
    assert not problems, "\n".join([storm.summary, *problems])


def test_disconnect_storm_no_spurious_429(storm):
    # cut requests must give their queue places back at once (52360ad, and the races that still
    # failed this about one CI run in three: test_cut_request_never_holds_a_full_queue below and
    # tests/test_reliability_queue.py catch those every time)
    problems = [p for p in storm.problems if "turned away" in p]
    assert not problems, "\n".join([storm.summary, *problems])


def _post_stream(target: Target, i: int) -> socket.socket:
    """A long streaming completion on a raw socket (no client library between us and the cut)."""
    body = json.dumps({"model": target.model, "prompt": f"def f{i}(x):", "max_tokens": 2000,
                       "stream": True, "ignore_eos": True}).encode()
    host, port = target.url.split("//")[1].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def _status(s: socket.socket) -> int | None:
    buf = b""
    while b"\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            return None
        buf += chunk
    return int(buf.split(b" ")[1])


def _num_running(target: Target) -> int:
    return int(httpx.get(target.url + "/health", timeout=10).json()["engine"]["num_running"])


@pytest.mark.parametrize("cut", ["on_arrival", "after_headers"])
def test_cut_request_never_holds_a_full_queue(target: Target, cut: str):
    # The storm's race, made frequent: every seat taken and the queue one short of full by live
    # streams; then, 30 times, a request is cut (its body sent and the socket closed at once, or
    # closed right after its 200) and the next one is sent at once. A 429 for the next one means
    # the cut request still held a queue place (before the fix: 1-2 of 30, in 10 runs of 10).
    live = []
    statuses: dict[int | None, int] = {}
    try:
        for i in range(MAX_NUM_SEQS + MAX_QUEUE - 1):
            live.append(_post_stream(target, i))
            assert _status(live[-1]) == 200
            deadline = time.monotonic() + 30
            while i < MAX_NUM_SEQS and _num_running(target) <= i:  # seats first, then queue
                assert time.monotonic() < deadline, "a live stream did not start"
                time.sleep(0.02)
        for i in range(30):
            with _post_stream(target, 100 + i) as first:
                if cut == "after_headers":
                    assert _status(first) == 200
            with _post_stream(target, 200 + i) as second:
                st = _status(second)
                statuses[st] = statuses.get(st, 0) + 1
    finally:
        for s in live:
            s.close()

    async def idle() -> bool:
        async with httpx.AsyncClient() as client:
            return (await wait_idle(client, target, within_s=10.0))[0]

    assert asyncio.run(idle()), "the engine did not go idle after the test's streams were cut"
    assert statuses == {200: 30}, f"status of the request sent right after a cut: {statuses}"


def test_overload_bounded_queue(target: Target):
    res = asyncio.run(overload.run(target, num_requests=60, concurrency=60, max_tokens=8,
                                   time_limit_s=120))
    assert res.ok, "\n".join([res.summary, *res.problems])
    assert res.details["rejected"] > 0 and res.details["admitted"] > 0


def test_runner_writes_its_results_into_the_ignored_folder(target: Target, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    from reliability.__main__ import main, parse

    monkeypatch.chdir(tmp_path)
    assert parse(["--url", target.url]).out is None  # default: .bench/reliability-<time>/
    assert main(["--url", target.url, "--model-id", target.model, "--suites", "bad_input"]) == 0
    (run,) = (tmp_path / ".bench").iterdir()
    assert run.name.startswith("reliability-")
    (result,) = json.loads((run / "reliability.json").read_text())
    assert result["name"] == "bad input" and result["ok"], result["summary"]
