"""A client that leaves cancels its engine rows at once, while the generation is still going."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

MODEL = "tinycoder-16m"
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(autouse=True)
def _fresh(fake):
    fake.reset(step_delay=0.01)  # 2000 tokens would take 20 s


def read_some_then_leave(url, body, n_lines):
    with httpx.Client(timeout=10) as c, c.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) >= n_lines:
                break
        left_at = time.monotonic()
    return lines, left_at


def assert_aborted_promptly(fake, left_at, n_rows=1, within=1.0):
    assert fake.wait_until(
        lambda: len(fake.submits) == n_rows and all(fake.aborted(s.req_id) for s in fake.submits),
        within + 1,
    )
    for s in fake.submits:
        t = min(t for r, t in fake.aborts + fake.closes if r == s.req_id)
        assert t - left_at < within, f"abort came {t - left_at:.2f}s after the client left"
        assert s.req_id not in fake.finished
        assert fake.tokens_sent.get(s.req_id, 0) < 500  # the stream was cut mid-generation
    assert fake.wait_until(lambda: fake.stats().num_running == 0)


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": HI, "max_tokens": 2000, "stream": True},
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True}),
        (  # tools on: the tool-call parsing path
            "/v1/chat/completions",
            {"model": MODEL, "messages": HI, "max_tokens": 2000, "stream": True, "tools": TOOLS},
        ),
        ("/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 2000, "stream": True}),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2000, "stream": True}),
    ],
    ids=["chat", "completions", "chat-tools", "messages", "responses"],
)
def test_stream_disconnect_aborts(server, fake, path, body):
    lines, left_at = read_some_then_leave(server.url + path, body, 5)
    assert len(lines) == 5
    assert_aborted_promptly(fake, left_at)


def test_stream_disconnect_aborts_every_choice(server, fake):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2000, "stream": True, "n": 3}
    _, left_at = read_some_then_leave(server.url + "/v1/chat/completions", body, 6)
    assert_aborted_promptly(fake, left_at, n_rows=3)


def test_disconnect_before_first_token(server, fake):
    # nothing is being written, so only listening for the disconnect can notice it
    fake.reset(step_delay=30.0)
    body = {"model": MODEL, "messages": HI, "max_tokens": 10, "stream": True}
    _, left_at = read_some_then_leave(
        server.url + "/v1/chat/completions", body, 1
    )  # the role chunk
    assert_aborted_promptly(fake, left_at)


def test_non_streaming_disconnect_aborts(server, fake):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2000, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
    left_at = time.monotonic()
    assert_aborted_promptly(fake, left_at, n_rows=2)


def test_half_sent_request_does_not_hurt(server, fake):
    # a client that dies mid-body: nothing is submitted and the server goes on
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "ab'
        )
    time.sleep(0.1)
    assert not fake.submits
    fake.reset()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 200


def test_many_concurrent_streams_some_leaving(server, fake):
    fake.reset(step_delay=0.002)
    results: dict[int, str] = {}

    def full(i):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 20, "stream": True, "seed": i},
            timeout=10,
        )
        results[i] = r.text

    def leaver(i):
        read_some_then_leave(
            server.url + "/v1/completions",
            {"prompt": "x", "max_tokens": 2000, "stream": True, "seed": 100 + i},
            3,
        )

    threads = [threading.Thread(target=full if i % 2 else leaver, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 6 and all(v.rstrip().endswith("data: [DONE]") for v in results.values())
    assert fake.wait_until(lambda: fake.stats().num_running == 0, 3)
    leavers = [s.req_id for s in fake.submits if s.params.seed >= 100]
    assert len(leavers) == 6 and all(fake.aborted(r) for r in leavers)


def test_a_gathered_work_cut_by_a_disconnect_returns_none():
    """`run_until_disconnect` around a gather of several awaits (prompt logprobs of several
    prompts): a client that leaves gets None (a 499), not the CancelledError the cancelled
    gather carries as its exception (which reached the client as a 500)."""
    import asyncio

    from server.sse import run_until_disconnect

    class Leaving:
        async def receive(self):
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

    async def main():
        left = []

        async def slow(i):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                left.append(i)
                raise

        got = await run_until_disconnect(Leaving(), lambda: asyncio.gather(slow(0), slow(1)))
        return got, sorted(left)

    assert asyncio.run(main()) == (None, [0, 1])
