"""Bad input: malformed and hostile requests, each must get a 4xx OpenAI-shaped JSON error.

A case passes when the status is 4xx and the body is `{"error": {"message": ...}}`. A handful of
cases marked `no5xx` are inputs a server may reasonably accept (e.g. a lone UTF-16 surrogate
escape); for them anything but a 5xx, a hang or a dropped connection passes. The server is
checked every 10 cases and at the end: /health answers and a good request completes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from reliability.common import CheckResult, Target, still_serving

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MB10 = 10 * 1024 * 1024


@dataclass(slots=True)
class Case:
    name: str
    path: str
    body: bytes | Callable[[], bytes]
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    expect: str = "4xx"  # or "no5xx"

    def payload(self) -> bytes:
        return self.body() if callable(self.body) else self.body


def _j(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def _chat(model: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hi"}]}
    body.update(over)
    return body


def _comp(model: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": 4, "prompt": "def f(x):"}
    body.update(over)
    return body


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _nested(depth: int) -> bytes:
    return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def cases(model: str) -> list[Case]:
    c: list[Case] = []
    add = c.append
    # --- broken JSON and wrong top-level shapes (both endpoints)
    for path, tag in ((CHAT, "chat"), (COMP, "completions")):
        add(Case(f"{tag}: empty body", path, b""))
        add(Case(f"{tag}: truncated JSON", path, b'{"model": "m", "messages": [{"role": "us'))
        add(Case(f"{tag}: not JSON", path, b"hello there"))
        add(Case(f"{tag}: trailing comma", path, b'{"model": "m",}'))
        add(Case(f"{tag}: top-level array", path, b"[]"))
        add(Case(f"{tag}: top-level string", path, b'"hello"'))
        add(Case(f"{tag}: top-level null", path, b"null"))
        add(Case(f"{tag}: invalid UTF-8 body", path, b'{"model": "m", "prompt": "\xff\xfe\xfa"}'))
        add(Case(f"{tag}: 10 MB of garbage", path, lambda: b"\x00\x01garbage" * (MB10 // 9)))
        add(Case(f"{tag}: deeply nested JSON (100k)", path, lambda: _nested(100_000)))
    add(Case("chat: unclosed nesting (200k)", CHAT, lambda: b'{"a":' * 200_000))
    # --- missing, empty and mistyped fields (chat)
    base = _chat(model)
    add(Case("chat: {}", CHAT, b"{}"))
    add(Case("chat: missing messages", CHAT, _j(_without(base, "messages"))))
    add(Case("chat: messages empty", CHAT, _j(_chat(model, messages=[]))))
    add(Case("chat: messages null", CHAT, _j(_chat(model, messages=None))))
    add(Case("chat: messages a string", CHAT, _j(_chat(model, messages="hi"))))
    add(Case("chat: message {}", CHAT, _j(_chat(model, messages=[{}]))))
    add(Case("chat: message without role", CHAT, _j(_chat(model, messages=[{"content": "hi"}]))))
    add(Case("chat: unknown role", CHAT,
             _j(_chat(model, messages=[{"role": "wizard", "content": "hi"}]))))
    add(Case("chat: role a number", CHAT, _j(_chat(model, messages=[{"role": 7, "content": "hi"}]))))
    add(Case("chat: content a number", CHAT,
             _j(_chat(model, messages=[{"role": "user", "content": 42}]))))
    add(Case("chat: content an object", CHAT,
             _j(_chat(model, messages=[{"role": "user", "content": {"a": 1}}]))))
    add(Case("chat: content part of unknown type", CHAT,
             _j(_chat(model, messages=[{"role": "user", "content": [{"type": "hologram"}]}]))))
    add(Case("chat: model a number", CHAT, _j(_chat(model) | {"model": 123})))
    add(Case("chat: unknown model", CHAT, _j(_chat("no-such-model-xyz"))))
    add(Case("chat: 10 MB message", CHAT,
             lambda: _j(_chat(model, messages=[{"role": "user", "content": "x" * MB10}]))))
    add(Case("chat: messages nested 50k deep", CHAT,
             lambda: (b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", '
                      b'"content": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]}")))
    add(Case("chat: stream not a bool", CHAT, _j(_chat(model, stream=[1]))))
    add(Case("chat: stream_options a string", CHAT,
             _j(_chat(model, stream=True, stream_options="yes"))))
    # --- numbers: negative, huge, NaN, wrong types (both endpoints)
    for path, mk, tag in ((CHAT, _chat, "chat"), (COMP, _comp, "completions")):
        bad_numbers: list[tuple[str, dict[str, Any]]] = [
            ("max_tokens -1", {"max_tokens": -1}),
            ("max_tokens 0", {"max_tokens": 0}),
            ("max_tokens 10^12", {"max_tokens": 10**12}),
            ("max_tokens a string", {"max_tokens": "ten"}),
            ("max_tokens 1.5", {"max_tokens": 1.5}),
            ("temperature -1", {"temperature": -1}),
            ("temperature 1e9", {"temperature": 1e9}),
            ("temperature NaN", {"temperature": float("nan")}),
            ("temperature Infinity", {"temperature": float("inf")}),
            ("top_p 1.5", {"top_p": 1.5}),
            ("top_p NaN", {"top_p": float("nan")}),
            ("top_k a string", {"top_k": "abc"}),
            ("presence_penalty 5", {"presence_penalty": 5}),
            ("frequency_penalty -5", {"frequency_penalty": -5}),
            ("n 0", {"n": 0}),
            ("n 10^6", {"n": 1_000_000}),
            ("seed a string", {"seed": "abc"}),
            ("seed 2^70", {"seed": 2**70}),
            ("logprobs a list", {"logprobs": [1]}),
            ("stop a number", {"stop": 123}),
            ("stop list of ints", {"stop": [1, 2]}),
            ("stop list with null", {"stop": [None]}),
            ("stop nested list", {"stop": [["a"]]}),
            ("stop 10k strings", {"stop": [f"s{i}" for i in range(10_000)]}),
            ("logit_bias key not an int", {"logit_bias": {"abc": 1}}),
            ("logit_bias value 1000", {"logit_bias": {"5": 1000}}),
            ("logit_bias token out of vocab", {"logit_bias": {"99999999": 1}}),
            ("logit_bias a list", {"logit_bias": [1, 2]}),
        ]
        for label, over in bad_numbers:
            add(Case(f"{tag}: {label}", path, _j(mk(model, **over))))
    add(Case("chat: top_logprobs 1000", CHAT, _j(_chat(model, logprobs=True, top_logprobs=1000))))
    add(Case("chat: top_logprobs -1", CHAT, _j(_chat(model, logprobs=True, top_logprobs=-1))))
    add(Case("completions: logprobs 1000", COMP, _j(_comp(model, logprobs=1000))))
    # --- tools and response_format shapes (chat)
    fn = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    add(Case("chat: tools a string", CHAT, _j(_chat(model, tools="weather"))))
    add(Case("chat: tool without function", CHAT, _j(_chat(model, tools=[{"type": "function"}]))))
    add(Case("chat: tool function without name", CHAT,
             _j(_chat(model, tools=[{"type": "function", "function": {}}]))))
    add(Case("chat: tool of unknown type", CHAT,
             _j(_chat(model, tools=[{"type": "teleport", "function": {"name": "f"}}]))))
    add(Case("chat: tool parameters a string", CHAT,
             _j(_chat(model, tools=[{"type": "function",
                                     "function": {"name": "f", "parameters": "none"}}]))))
    add(Case("chat: tool_choice unknown word", CHAT, _j(_chat(model, tools=[fn],
                                                              tool_choice="sometimes"))))
    add(Case("chat: tool_choice names a missing tool", CHAT,
             _j(_chat(model, tools=[fn],
                      tool_choice={"type": "function", "function": {"name": "nope"}}))))
    add(Case("chat: response_format a string", CHAT, _j(_chat(model, response_format="json"))))
    add(Case("chat: response_format unknown type", CHAT,
             _j(_chat(model, response_format={"type": "yaml"}))))
    add(Case("chat: json_schema without schema", CHAT,
             _j(_chat(model, response_format={"type": "json_schema"}))))
    add(Case("chat: json_schema schema a string", CHAT,
             _j(_chat(model, response_format={"type": "json_schema",
                                              "json_schema": {"name": "x", "schema": "object"}}))))
    # --- completions prompts
    cbase = _comp(model)
    add(Case("completions: missing prompt", COMP, _j(_without(cbase, "prompt"))))
    add(Case("completions: prompt a number", COMP, _j(_comp(model, prompt=123))))
    add(Case("completions: prompt an object", COMP, _j(_comp(model, prompt={"a": 1}))))
    add(Case("completions: prompt empty list", COMP, _j(_comp(model, prompt=[]))))
    add(Case("completions: negative token ids", COMP, _j(_comp(model, prompt=[-1, 5]))))
    add(Case("completions: token id out of vocab", COMP, _j(_comp(model, prompt=[99_999_999]))))
    add(Case("completions: prompt longer than the context", COMP,
             _j(_comp(model, prompt=[5] * 20_000))))
    add(Case("completions: 10 MB prompt", COMP, lambda: _j(_comp(model, prompt="y" * MB10))))
    add(Case("completions: unknown model", COMP, _j(_comp("no-such-model-xyz"))))
    add(Case("completions: best_of 0", COMP, _j(_comp(model, best_of=0))))
    add(Case("completions: echo not a bool", COMP, _j(_comp(model, echo={"a": 1}))))
    # --- HTTP-level
    add(Case("GET on a POST route", CHAT, b"", method="GET", headers={}))
    add(Case("unknown route", "/v1/no-such-route", _j(_chat(model))))
    add(Case("form-encoded body", CHAT, b"model=m&messages=hi",
             headers={"content-type": "application/x-www-form-urlencoded"}))
    # inputs a server may accept; they must not produce a 5xx or kill it
    add(Case("chat: lone surrogate escape", CHAT,
             b'{"model": "' + model.encode() + b'", "max_tokens": 2, "messages": '
             b'[{"role": "user", "content": "\\ud800 hi"}]}', expect="no5xx"))
    add(Case("completions: NUL and control chars", COMP,
             _j(_comp(model, prompt="a\x00b\x01c\x1b[31m", max_tokens=2)), expect="no5xx"))
    add(Case("chat: unknown extra fields", CHAT,
             _j(_chat(model, max_tokens=2, frobnicate={"x": [1, 2]})), expect="no5xx"))
    return c


def _is_openai_error(resp: httpx.Response) -> bool:
    try:
        body = resp.json()
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str)


def judge(case: Case, resp: httpx.Response) -> str | None:
    """What is wrong with `resp` as the answer to `case`, or None when it is right."""
    st = resp.status_code
    if case.expect == "4xx" and not 400 <= st < 500:
        return f"HTTP {st}, expected 4xx ({resp.text[:160]!r})"
    if st >= 500:
        return f"HTTP {st} ({resp.text[:160]!r})"
    if st >= 400 and not _is_openai_error(resp):
        return f"HTTP {st} without an OpenAI error body ({resp.text[:160]!r})"
    return None


async def run(client: httpx.AsyncClient, target: Target, *, check_every: int = 10,
              timeout_s: float = 60.0) -> CheckResult:
    t0 = time.monotonic()
    all_cases = cases(target.model)
    problems: list[str] = []
    rows: list[dict[str, Any]] = []
    statuses: dict[str, int] = {}
    for i, case in enumerate(all_cases):
        row: dict[str, Any] = {"case": case.name, "path": case.path, "expect": case.expect}
        try:
            body = case.payload()
            row["bytes"] = len(body)
            r = await client.request(case.method, target.url + case.path, content=body or None,
                                     headers=case.headers, timeout=timeout_s)
            row["status"] = r.status_code
            wrong = judge(case, r)
        except httpx.HTTPError as exc:
            row["status"] = type(exc).__name__
            wrong = f"{type(exc).__name__}: {exc}"
        statuses[str(row["status"])] = statuses.get(str(row["status"]), 0) + 1
        row["ok"] = wrong is None
        if wrong:
            problems.append(f"{case.name}: {wrong}")
        rows.append(row)
        if (i + 1) % check_every == 0 or i + 1 == len(all_cases):
            dead = await still_serving(client, target)
            if dead:
                problems.extend(f"after case {i + 1} ({case.name}): {d}" for d in dead)
                if i + 1 < len(all_cases):
                    problems.append(f"stopped after {i + 1}/{len(all_cases)} cases: "
                                    "the server no longer serves")
                    break
    passed = sum(1 for r in rows if r["ok"])
    return CheckResult(
        name="bad input",
        ok=not problems,
        summary=f"{passed}/{len(all_cases)} cases answered right; statuses "
                f"{dict(sorted(statuses.items()))}",
        problems=problems,
        details={"cases": rows, "num_cases": len(all_cases), "num_passed": passed},
        seconds=time.monotonic() - t0,
    )
