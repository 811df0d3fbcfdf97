"""Several models by name over HTTP (`mlxd serve --model NAME=DIR ...`, engine.pool): routing by
`model`, /v1/models with loaded flags, /health while a model loads, 404 for names not configured
(no file looked at), a broken model's error next to a serving one, Ollama's keep_alive, the
response's `model` for an adapter, and the CLI flags.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd import DEFAULT_MODEL_DIR, cli
from server.app import create_app
from server.config import ServerConfig
from tests.fake_engine import FakeEngine, ServerThread
from tests.model_dirs import bad_config_dir, no_weights_dir, tiny_model_dir
from tests.test_pool import file_access

REPO = Path(__file__).resolve().parent.parent
BODY = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool-http")
    return {
        "tiny": tiny_model_dir(root / "models" / "tiny", seed=4),
        "other": tiny_model_dir(root / "other", seed=5),
        "noweights": no_weights_dir(root / "noweights"),
        "badconfig": bad_config_dir(root / "badconfig"),
    }


@contextmanager
def pool_server(dirs: dict[str, Path], **opts: Any) -> Iterator[tuple[Any, str]]:
    from mlxd.runtime import build_client

    models = [("coder", ""), ("tiny", str(dirs["tiny"])), ("noweights", str(dirs["noweights"])),
              ("badconfig", str(dirs["badconfig"]))]
    client = build_client(models=models, dtype="float32", warmup=False, **opts)
    client.start()
    try:
        with ServerThread(create_app(client, ServerConfig())) as srv:
            yield client, srv.url
    finally:
        client.stop()


@pytest.fixture(scope="module")
def served(dirs):
    with pool_server(dirs) as pair:
        yield pair


def _cards(url: str) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in httpx.get(f"{url}/v1/models").json()["data"]}


def _completion(url: str, model: str | None, **extra: Any) -> httpx.Response:
    body = dict(BODY, **extra)
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_models_by_name_equal_each_alone_and_list_their_load_state(served, dirs):
    from mlxd.runtime import build_client

    client, url = served
    cards = _cards(url)
    assert list(cards) == ["coder", "tiny", "noweights", "badconfig"]
    assert cards["coder"]["loaded"] is True and cards["tiny"]["loaded"] is False
    assert all(c["object"] == "model" and c["owned_by"] == "mlxd" for c in cards.values())
    got = {}
    for name in ("coder", "tiny"):
        r = _completion(url, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        got[name] = r.json()["choices"][0]["text"]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "tiny"
    emb = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny", "input": ["hi", "def f():"]})
    assert emb.status_code == 200 and emb.json()["model"] == "tiny"
    assert [len(d["embedding"]) for d in emb.json()["data"]] == [64, 64]  # tiny's hidden size
    cards = _cards(url)
    assert cards["tiny"]["loaded"] is True and cards["tiny"]["max_model_len"] == 2048
    assert httpx.get(f"{url}/v1/models/tiny").json()["loaded"] is True
    assert _completion(url, None).json()["choices"][0]["text"] == got["coder"]
    for name, path in (("coder", str(DEFAULT_MODEL_DIR)), ("tiny", str(dirs["tiny"]))):
        alone = build_client(model=path, dtype="float32", warmup=False)
        alone.start()
        try:
            with ServerThread(create_app(alone, ServerConfig())) as srv:
                assert _completion(srv.url, None).json()["choices"][0]["text"] == got[name]
        finally:
            alone.stop()
    assert got["coder"] != got["tiny"]


def test_a_name_not_configured_is_404_and_reads_no_file(served, dirs):
    _, url = served
    other = str(dirs["other"])  # a real model directory the server was not given
    for name in (other, "owner/repo", "gpt-4"):
        with file_access() as seen:
            rs = [
                _completion(url, name),
                httpx.post(f"{url}/v1/chat/completions", json={
                    "model": name, "messages": [{"role": "user", "content": "hi"}]}),
                httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": "hi"}),
                httpx.post(f"{url}/v1/messages", json={
                    "model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
                httpx.get(f"{url}/v1/models/{name}"),
            ]
        assert [r.status_code for r in rs] == [404] * 5, [r.text for r in rs]
        assert rs[0].json()["error"]["code"] == "model_not_found"
        assert not [p for p in seen if name in p or other in p], seen


def test_a_broken_model_is_a_clear_error_and_the_others_serve(served, dirs):
    _, url = served
    for name, words in (("noweights", "weights"), ("badconfig", "config.json")):
        r = _completion(url, name)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and name in err["message"] and words in err["message"]
        assert str(dirs[name]) not in r.text and "Traceback" not in r.text
        assert _completion(url, "coder").status_code == 200
    health = httpx.get(f"{url}/health").json()
    assert health["models"]["noweights"]["state"] == "unloaded"
    assert "weights" in health["models"]["noweights"]["error"]
    assert health["models"]["coder"]["state"] == "loaded"


def test_health_shows_a_model_loading_with_its_progress(dirs):
    with pool_server(dirs, load_slice_bytes=64 << 10) as (client, url):
        pool = client.pool

        def slow(what: str) -> None:  # each load unit takes a while, so /health can see it
            if what.startswith("load:"):
                time.sleep(0.2)

        pool.on_turn = slow
        done: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: done.append(_completion(url, "tiny")))
        thread.start()
        seen = []
        while thread.is_alive():
            seen.append(httpx.get(f"{url}/health").json()["models"]["tiny"])
            time.sleep(0.02)
        thread.join()
        pool.on_turn = None
        assert done[0].status_code == 200, done[0].text
        loading = [m for m in seen if m["state"] == "loading"]
        assert loading and all(0.0 <= m["progress"] <= 1.0 for m in loading), seen
        assert any(0.0 < m["progress"] < 1.0 for m in loading), " ".join(str(m.get("progress")) for m in seen)
        after = httpx.get(f"{url}/health").json()["models"]["tiny"]
        assert after["state"] == "loaded" and "progress" not in after and after["load_seconds"] > 0


def test_request_keep_alive(dirs):
    with pool_server(dirs) as (_, url):
        def tiny_state() -> dict[str, Any]:
            return httpx.get(f"{url}/health").json()["models"]["tiny"]

        assert _completion(url, "tiny", keep_alive="10m").status_code == 200
        assert tiny_state()["keep_alive"] == 600.0 and tiny_state()["state"] == "loaded"
        assert _completion(url, "tiny", keep_alive=0).status_code == 200
        deadline = time.monotonic() + 2
        while tiny_state()["state"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tiny_state()["state"] == "unloaded"
        r = _completion(url, "tiny", keep_alive="5 minutes")
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
        assert _completion(url, "tiny", keep_alive=-1).status_code == 200
        assert tiny_state()["keep_alive"] is None


def test_the_response_model_is_the_adapter_the_client_asked_for():
    fake = FakeEngine()
    fake.model.extra["adapters"] = ["coder-lora"]
    with ServerThread(create_app(fake, ServerConfig())) as srv:
        for model, want in (("coder-lora", "coder-lora"), ("tinycoder-16m", "tinycoder-16m"),
                            (None, "tinycoder-16m")):
            body: dict[str, Any] = {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
            if model is not None:
                body["model"] = model
            chat = httpx.post(f"{srv.url}/v1/chat/completions", json=body)
            assert chat.status_code == 200 and chat.json()["model"] == want
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions",
                              json=dict(body, stream=True)) as r:
                heads = [line for line in r.iter_lines() if line.startswith("data: {")]
            assert heads and all(f'"model":"{want}"' in h.replace(" ", "") for h in heads)
            comp = dict(body, prompt="x")
            del comp["messages"]
            assert httpx.post(f"{srv.url}/v1/completions", json=comp).json()["model"] == want
            msg = httpx.post(f"{srv.url}/v1/messages", json=dict(body, max_tokens=3))
            assert msg.status_code == 200 and msg.json()["model"] == want
        submitted = [r.adapter for r in fake.submits]
        assert "coder-lora" in submitted and None in submitted
        card = httpx.get(f"{srv.url}/v1/models/coder-lora").json()
        assert card["id"] == "coder-lora" and card["parent"] == "tinycoder-16m"


def test_an_adapter_on_the_default_model_with_other_models(dirs, tmp_path):
    """--adapter applies to the default model: its name is a model of its own next to the other
    configured models, and responses report it."""
    from engine.loader import load_model
    from mlxd.runtime import build_client
    from tests.test_lora import write_adapter

    probe = load_model(str(DEFAULT_MODEL_DIR), dtype="float32").model
    path = write_adapter(tmp_path / "lora", probe, rank=4, scale=2.0, num_layers=-1, keys=None,
                         seed=3, std=0.2)
    client = build_client(models=[("coder", ""), ("tiny", str(dirs["tiny"]))], dtype="float32",
                          warmup=False, adapters=[("coder-lora", str(path))])
    client.start()
    try:
        with ServerThread(create_app(client, ServerConfig())) as srv:
            cards = _cards(srv.url)
            assert list(cards) == ["coder", "coder-lora", "tiny"]
            assert cards["coder-lora"]["parent"] == "coder" and cards["coder-lora"]["loaded"]
            texts = {}
            for name in ("coder", "coder-lora", "tiny"):
                r = _completion(srv.url, name)
                assert r.status_code == 200 and r.json()["model"] == name, r.text
                texts[name] = r.json()["choices"][0]["text"]
            assert texts["coder-lora"] != texts["coder"]
    finally:
        client.stop()


# -- the command line ---------------------------------------------------------------------------


def test_model_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("MLXD_API_KEY", raising=False)
    plain = cli.parse_serve_args(["--model", "/m/coder"])
    assert plain.model == "/m/coder" and plain.models == []
    bundled = cli.parse_serve_args([])
    assert bundled.model is None and bundled.models == []
    two = cli.parse_serve_args(["--model", "a=/m/x", "--model", "b=owner/repo", "--keep-alive", "5m"])
    assert two.models == [("a", "/m/x"), ("b", "owner/repo")] and two.keep_alive == 300.0
    assert two.model == "/m/x"
    named = cli.parse_serve_args(["--model", "coder=/m/x"])
    assert named.models == [("coder", "/m/x")]
    for sub in ("b", "a", "notes"):
        (tmp_path / sub).mkdir()
        if sub != "notes":
            (tmp_path / sub / "config.json").write_text("{}")
    scanned = cli.parse_serve_args(["--model", "first=/m/x", "--models-dir", str(tmp_path)])
    assert scanned.models == [("first", "/m/x"), ("a", str(tmp_path / "a")),
                              ("b", str(tmp_path / "b"))]
    assert cli.parse_serve_args(["--model", "/x/y=z"]).models == []  # a path, not NAME=


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--model", "a=/x", "--model", "a=/y"], "given to two models"),
    (["--model", "a=/x", "--served-model-name", "n"], "--served-model-name"),
    (["--model", "a=/x", "--model", "b=/y", "--draft-model", "/d"], "--draft-model"),
    (["--keep-alive", "soon"], "--keep-alive"),
    (["--models-dir", "/nonexistent"], "--models-dir"),
    (["--model", "a="], "NAME=DIR"),
])
def test_bad_model_flags_are_one_line(capsys, argv, fragment):
    with pytest.raises(SystemExit) as ei:
        cli.parse_serve_args(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1 and fragment in err, err


def test_empty_models_dir_is_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.parse_serve_args(["--models-dir", str(tmp_path)])
    assert "no subfolder" in capsys.readouterr().err


def test_live_server_with_a_models_dir(dirs, tmp_path):
    """`mlxd serve --models-dir`: every model listed, the first loaded at start-up, another
    loaded by its first request, one log line each for loading and loaded."""
    models = dirs["tiny"].parent
    (models / "second").symlink_to(dirs["other"], target_is_directory=True)
    log = tmp_path / "stderr.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLXD_API_KEY", None)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mlxd", "serve", "--port", "0",
                                 "--models-dir", str(models), "--no-warmup"],
                                stdout=err, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            for line in log.read_text().splitlines():
                if "serving on http://" in line:
                    url = line.split("serving on ")[1].split()[0]
            time.sleep(0.1)
        cards = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(c["id"], c["loaded"]) for c in cards] == [("second", True), ("tiny", False)]
        r = _completion(url, "tiny")
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        text = log.read_text()
        assert text.count("loading model tiny from") == 1 and text.count("loaded model tiny in") == 1
        assert "loaded model second in" in text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
