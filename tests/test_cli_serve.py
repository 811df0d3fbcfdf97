"""The `mlxd` command line: every `serve` flag checked before the model loads (one line, exit 2),
start-up failures in a line or two (traceback only at DEBUG), help that shows defaults, bare
`mlxd` printing help, and a real `mlxd serve` process: header limit, one access line per request,
/health without the key.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxd import cli

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("MLXD_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "mlxd", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)


# -- flag checks (in-process: the parser alone) --------------------------------------------------

BAD_FLAGS = [
    (["--max-num-seqs", "0"], "--max-num-seqs", ">= 1"),
    (["--max-tokens", "-5"], "--max-tokens", ">= 1"),
    (["--temp", "-1"], "--temp", "from 0 to 2"),
    (["--temp", "nan"], "--temp", "from 0 to 2"),
    (["--top-p", "2"], "--top-p", "from 0 to 1"),
    (["--port", "70000"], "--port", "from 0 to 65535"),
    (["--port", "http"], "--port", "from 0 to 65535"),
    (["--prefill-chunk", "0"], "--prefill-chunk", ">= 1"),
    (["--prefill-budget", "-1"], "--prefill-budget", ">= 1"),
    (["--max-queue", "0"], "--max-queue", ">= 1"),
    (["--max-kv-size", "0"], "--max-kv-size", ">= 1"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens", "from 1 to 32"),
    (["--num-draft-tokens", "33"], "--num-draft-tokens", "from 1 to 32"),
    (["--max-restarts", "-1"], "--max-restarts", ">= 0"),
    (["--blas", "/nonexistent"], "--blas", "auto, none, or the path"),
    (["--prefix-cache-bytes", "lots"], "--prefix-cache-bytes", "512MiB"),
    (["--prefix-cache-bytes=-1GiB"], "--prefix-cache-bytes", "at least 0"),
    (["--memory-budget", "0"], "--memory-budget", "more than 0"),
    (["--memory-budget", "much"], "--memory-budget", "512MiB"),
    (["--mlx-cache-limit", "x"], "--mlx-cache-limit", "512MiB"),
    (["--kv-bits", "3"], "--kv-bits", "choose from 16, 8, 4"),
    (["--kv-group-size", "48"], "--kv-group-size", "choose from 32, 64"),
    (["--dtype", "int8"], "--dtype", "choose from"),
    (["--api-key", ""], "--api-key", "non-empty"),
    (["--served-model-name", " "], "--served-model-name", "empty"),
    (["--spec", "draft"], "--spec", "--draft-model"),
    (["--spec", "ngram", "--draft-model", "/m"], "--draft-model", "--spec ngram"),
    (["--no-such-flag"], "--no-such-flag", "unrecognized"),
]


def test_draft_ceiling_limit_is_the_engines():
    """The CLI's --num-draft-tokens limit is the engine's (the CLI cannot import it before --blas
    has chosen the BLAS)."""
    from engine.api import MAX_DRAFT_TOKENS

    assert cli.MAX_DRAFT_TOKENS == MAX_DRAFT_TOKENS


@pytest.mark.parametrize(("argv", "flag", "allowed"), BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_exit_2(capsys, argv, flag, allowed):
    with pytest.raises(SystemExit) as ei:
        cli.parse_serve_args(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage block
    assert err.startswith("mlxd serve: error: ") and flag in err and allowed in err, err


def test_good_flags_parse(monkeypatch):
    monkeypatch.delenv("MLXD_API_KEY", raising=False)
    args = cli.parse_serve_args(["--port", "9000", "--temp", "0", "--top-p", "1",
                                 "--prefix-cache-bytes", "512MiB", "--memory-budget", "2GiB",
                                 "--mlx-cache-limit", "0", "--blas", "none"])
    assert (args.port, args.temp, args.top_p) == (9000, 0.0, 1.0)
    assert args.prefix_cache_bytes == 512 << 20 and args.memory_budget == 2 << 30
    assert args.mlx_cache_limit == 0 and args.api_key is None
    defaults = cli.parse_serve_args([])
    assert defaults.max_tokens is None  # the room left in the context (the server decides)
    assert defaults.prefix_cache_bytes == "auto"  # a quarter of the memory budget (engine)
    assert cli.parse_serve_args(["--prefix-cache-bytes", "AUTO"]).prefix_cache_bytes == "auto"
    from mlxd.runtime import _engine_config
    assert _engine_config({"prefix_cache_bytes": "auto"}).prefix_cache_bytes is None
    assert _engine_config({"prefix_cache_bytes": "2GiB"}).prefix_cache_bytes == 2 << 30
    assert _engine_config({"prefix_cache_bytes": 0}).prefix_cache_bytes == 0


def test_serving_starts_with_the_start_up_objects_frozen(monkeypatch):
    """What start-up built is frozen out of the cyclic collector's walks before the engine
    serves (a full collection otherwise lands inside an engine step), and the client is
    started and stopped around the server."""
    import gc

    from tests.fake_engine import FakeEngine

    monkeypatch.delenv("MLXD_API_KEY", raising=False)
    seen: dict[str, int] = {}
    client = FakeEngine()

    def start() -> None:
        seen["frozen_at_start"] = gc.get_freeze_count()

    def stop() -> None:
        seen["stopped"] = 1

    monkeypatch.setattr(client, "start", start, raising=False)
    monkeypatch.setattr(client, "stop", stop, raising=False)

    class Served:
        def __init__(self, config):
            self.config = config

        def run(self, sockets):
            seen["ran"] = 1

    gc.unfreeze()
    try:
        cli._run_server(client, cli.parse_serve_args([]), sock=None, server_cls=Served)
        assert seen["frozen_at_start"] > 1000 and seen["ran"] == seen["stopped"] == 1
    finally:
        gc.unfreeze()


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("MLXD_API_KEY", "sk-env")
    assert cli.parse_serve_args([]).api_key == "sk-env"
    assert cli.parse_serve_args(["--api-key", "sk-flag"]).api_key == "sk-flag"
    monkeypatch.setenv("MLXD_API_KEY", "")
    assert cli.parse_serve_args([]).api_key is None


@pytest.mark.parametrize(("text", "n"), [("1GiB", 1 << 30), ("512MiB", 512 << 20), ("64M", 64 << 20),
                                         ("2e9", 2 * 10**9), ("1000", 1000), ("1.5 KiB", 1536)])
def test_parse_size(text, n):
    assert cli.parse_size(text) == n


def test_bad_flag_in_a_real_process():
    r = _run("serve", "--max-num-seqs", "0")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "mlxd serve: error: argument --max-num-seqs: expected an integer >= 1, got 0 "
        "(see `mlxd serve --help`)"
    ]


# -- help, bare mlxd ------------------------------------------------------------------------------


def test_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--help"])
    assert ei.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("--host HOST address to listen on (default: 127.0.0.1)",
                  "(default: 8080)", "(default: 128)", "(default: auto)", "(default: INFO)",
                  "(default: the room left in the context, bounded by memory admission)"):
        assert shown in out, shown
    assert "MLXD_API_KEY" in out


def test_help_never_shows_the_api_key(capsys, monkeypatch):
    monkeypatch.setenv("MLXD_API_KEY", "sk-secret-in-env")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "sk-secret-in-env" not in capsys.readouterr().out


def test_bare_mlxd_prints_help_and_starts_nothing(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "usage: mlxd" in err and "serve" in err and "mlxd serve" in err


def test_flags_without_a_command_say_mlxd_serve(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["--port", "9000"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mlxd serve --port 9000" in err


def test_bench_is_not_a_command_of_the_installed_cli():
    """The benchmark harness is a development tool (not in the wheel): `mlxd bench` says where
    it is instead of importing it."""
    r = _run("bench", "--help", timeout=60)
    assert r.returncode == 2 and "python -m bench" in r.stderr, r.stderr[:200]


def _assert_short_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, r.stderr
    assert lines[0].startswith("mlxd: error: ") and "Traceback" not in r.stderr
    for fragment in fragments:
        assert fragment in r.stderr, (fragment, r.stderr)


def test_missing_model_directory(tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = _run("serve", "--port", "0", "--model", missing)
    _assert_short_error(r, f"--model {missing}: no such directory", "Hugging Face repo id")


def test_directory_that_is_not_a_model(tmp_path):
    r = _run("serve", "--port", "0", "--model", str(tmp_path))
    _assert_short_error(r, "not a model directory", "config.json")


def test_repo_id_offline(tmp_path):
    r = _run("serve", "--port", "0", "--model", "nobody-here/no-such-model-xyz",
             env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    _assert_short_error(r, "--model nobody-here/no-such-model-xyz", "not in the local Hugging Face "
                        "cache", "HF_HUB_OFFLINE")


def test_traceback_at_debug(tmp_path):
    r = _run("serve", "--port", "0", "--model", str(tmp_path / "nope"), "--log-level", "DEBUG")
    assert r.returncode != 0 and "Traceback" in r.stderr
    assert "mlxd: error: --model" in r.stderr


def test_blas_that_does_not_load(tmp_path):
    fake = tmp_path / "libnotblas.so"
    fake.write_text("not a library")
    r = _run("serve", "--port", "0", "--blas", str(fake))
    assert r.returncode == 2
    _assert_short_error(r, f"--blas {fake}")


def test_trace_file_that_cannot_be_written_is_the_flags_error(tmp_path):
    """Before, a --trace-steps file in a missing directory failed the engine's start and was
    reported as a missing model."""
    bad = tmp_path / "no-such-dir" / "steps.jsonl"
    r = _run("serve", "--port", "0", "--trace-steps", str(bad))
    assert r.returncode == 2
    _assert_short_error(r, f"--trace-steps {bad}: cannot write it")
    assert "--model" not in r.stderr


def test_port_in_use_is_one_line_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = _run("serve", "--port", str(port), "--model", "/no/such/model")
    _assert_short_error(r, f"cannot listen on 127.0.0.1:{port}", "--port")
    assert time.monotonic() - t0 < 60


# -- a real `mlxd serve` --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """`mlxd serve --api-key` on the bundled model; yields (url, stderr file)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLXD_API_KEY", None)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mlxd", "serve", "--port", str(port),
                                 "--api-key", "sk-live", "--max-num-seqs", "2"],
                                stdout=err, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url, port, log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_live_server_limits_the_request_head(live):
    url, port, _ = live
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(10)
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        except OSError:
            pass
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 431 "), head[:100]
    assert httpx.get(url + "/health").json() == {"status": "ok"}  # no key: no details


def test_live_server_logs_each_request_once(live):
    url, _, log = live
    key = {"Authorization": "Bearer sk-live"}
    r = httpx.post(url + "/v1/completions", json={"prompt": "def", "max_tokens": 2},
                   headers={**key, "X-Request-ID": "live-req-1"}, timeout=60)
    assert r.status_code == 200
    assert httpx.get(url + "/metrics", headers=key).status_code == 200
    assert "engine" in httpx.get(url + "/health", headers=key).json()
    time.sleep(0.3)
    text = log.read_text()
    lines = [line for line in text.splitlines() if "/v1/completions" in line]
    assert len(lines) == 1, lines
    assert "live-req-1" in lines[0] and "mlxd.access" in lines[0] and " 200 " in lines[0]
    assert "/metrics" not in text and '"GET /health' not in text  # scrapes: DEBUG only


def test_unsupported_architecture_is_one_line(tmp_path):
    """A model whose architecture mlxd refuses (registry: gemma2's mask shape) ends `mlxd serve`
    with one line naming the architecture, exit 2, no traceback."""
    import json
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from bench import models as sweep
    from mlxd import DEFAULT_MODEL_DIR

    model, cfg = sweep.build_model("gemma2")
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    r = _run("serve", "--port", "0", "--model", str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    _assert_short_error(r, "gemma2")


def test_speculation_that_cannot_roll_back_is_one_line(tmp_path):
    """`--spec ngram` on an architecture whose recurrent mixers cannot be rolled back (jamba)
    ends `mlxd serve` at start-up with one line saying to serve it without --spec, exit 2."""
    import json
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from bench import models as sweep
    from mlxd import DEFAULT_MODEL_DIR

    model, cfg = sweep.build_model("jamba")
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    r = _run("serve", "--port", "0", "--model", str(tmp_path), "--spec", "ngram")
    assert r.returncode == 2, r.stderr[-2000:]
    _assert_short_error(r, "jamba")
    assert "without --spec" in r.stderr
