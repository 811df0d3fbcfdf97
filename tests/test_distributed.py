"""Tensor- and pipeline-parallel serving (`mlxd serve --tensor-parallel 2` /
`--pipeline-parallel 2`): two ranks on the ring backend over loopback, against a single process.

Each group is one `mlxd serve` process that starts its ranks through mlx.launch, shared by the
tests of its model (module-scoped). The reference is the same model served by one process
(in-process, the same app). Greedy float32: the texts must be equal row for row, with 8
requests joining and leaving the batch at different steps. Skipped, with the reason, where the
ring backend cannot start two processes here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0


# -- helpers ---------------------------------------------------------------------------------


def _free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports, below the kernel's ephemeral range:
    a port the OS hands out (bind to 0) is free now, but the other test process's outgoing
    connections draw from that same range and may take it before a rank binds it ("Couldn't
    bind socket", error 98, seen in CI)."""
    import random

    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(10000, max(10001, low - count))
        socks: list[socket.socket] = []
        try:
            for p in range(first, first + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free consecutive ports")


@pytest.fixture(scope="session")
def ring() -> None:
    """Skip (with the reason) where two ring ranks cannot start and all_sum on loopback."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        pytest.skip("mx.distributed is not available in this MLX build")
    probe = ("import mlx.core as mx; g = mx.distributed.init(backend='ring', strict=True); "
             "print('sum', mx.distributed.all_sum(mx.ones(1), stream=mx.cpu).item())")
    cmd = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; "
           "sys.exit(main())", "-n", "2", "--backend", "ring", "--starting-port",
           str(_free_ports(2)), "--", sys.executable, "-c", probe]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.skip("two ring-backend ranks on loopback did not start within 60 s")
    if out.stdout.count("sum 2.0") != 2:
        pytest.skip(f"the ring backend cannot run two ranks here: {out.stderr.strip()[-300:]}")


class Group:
    """`mlxd serve` with the given flags (it starts its ranks); `url` once rank 0 serves."""

    def __init__(self, model: Path, flags: list[str], workdir: Path) -> None:
        self.rank_dir = workdir / "ranks"
        self.rank_dir.mkdir(parents=True)
        self.log_path = workdir / "serve.log"
        env = dict(os.environ, MLXD_RANK_DIR=str(self.rank_dir), PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "mlxd", "serve", "--model", str(model), "--port", "0",
               "--ring-port", str(_free_ports(2)), "--no-warmup", "--dtype", "float32", *flags]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO, stdin=subprocess.DEVNULL)
        self.url = self._wait_serving()

    def _wait_serving(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = re.search(r"serving on (http://\S+)", self.log())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.close()
        raise AssertionError(f"the group did not start:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid(self, rank: int) -> int:
        return int((self.rank_dir / f"rank{rank}.pid").read_text())

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Whatever is left of the group goes (a stopped rank is continued, then killed)."""
        try:
            self.stop(20)
        except subprocess.TimeoutExpired:
            pass
        for pid_file in self.rank_dir.glob("rank*.pid"):
            pid = int(pid_file.read_text())
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _write_tiny(name: str, dst: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random-weight model directory of architecture `name` with the bundled model's
    tokenizer (its vocabulary, 8192 tokens)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tests import tiny_archs, tiny_models

    vocab = 8192
    if name in tiny_archs.TINY_CONFIGS:
        base = tiny_archs.TINY_CONFIGS[name]
        model = tiny_archs.tiny_model(name, seed, vocab_size=vocab, **overrides)
    else:  # qwen3
        base = tiny_models.TINY_CONFIGS[name]
        model, _ = tiny_models.tiny_model(name, seed, vocab_size=vocab, **overrides)
    config = {**base, "vocab_size": vocab, "eos_token_id": [2, 0], **overrides}
    dst.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}))
    (dst / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / f, dst / f)
    return dst


class Reference:
    """The same model served by one process (the real app on uvicorn, in this process)."""

    def __init__(self, model: Path, **opts: Any) -> None:
        from mlxd.runtime import build_client
        from server.app import create_app
        from server.config import ServerConfig
        from tests.fake_engine import ServerThread

        self.client = build_client(model=str(model), dtype="float32", **opts)
        self.client.start()
        self._thread = ServerThread(create_app(self.client, ServerConfig()))
        self.url = self._thread.__enter__().url

    def close(self) -> None:
        self._thread.__exit__(None, None, None)
        self.client.stop()


PROMPTS = [
    "def fib(n):", "import os", "class Stack:", "for i in range(10):", "# parse the file",
    "def main():\n    args = parse()", "x = [1, 2, 3]", "while True:",
]


def _complete(url: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _concurrent(url: str, n: int = 8) -> list[tuple[str, int]]:
    """`n` greedy requests of different lengths, started a little apart: rows join the batch
    while others decode, and leave at different steps."""

    def one(i: int) -> tuple[str, int]:
        time.sleep(0.05 * i)
        out = _complete(url, PROMPTS[i % len(PROMPTS)], 4 + 3 * i)
        return out["choices"][0]["text"], out["usage"]["completion_tokens"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _pair(model: Path, flags: list[str], workdir: Path,
          **ref_opts: Any) -> Iterator[tuple[Group, Reference]]:
    group = Group(model, flags, workdir)
    ref = None
    try:
        ref = Reference(model, served_model_name="m", **ref_opts)
        yield group, ref
    finally:
        if ref is not None:
            ref.close()
        group.close()


# -- the groups ------------------------------------------------------------------------------


# the bundled model's group also runs n-gram speculation over 8-bit KV (the reference too)
BUNDLED_FLAGS = ["--spec", "ngram", "--kv-bits", "8"]


@pytest.fixture(scope="module")
def bundled_tp(ring: None, tmp_path_factory: pytest.TempPathFactory):
    flags = ["--tensor-parallel", "2", "--served-model-name", "m", *BUNDLED_FLAGS]
    yield from _pair(DEFAULT_MODEL_DIR, flags, tmp_path_factory.mktemp("bundled"),
                     spec="ngram", kv_bits=8)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def tiny_tp(request: pytest.FixtureRequest, ring: None,
            tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp(request.param)
    model = _write_tiny(request.param, base / "model")
    # a hang is caught after 10 s: well inside the 30 s the failure test allows, and well past a
    # step's first-use compile on a loaded 2-core machine (3 s tripped there)
    flags = ["--tensor-parallel", "2", "--served-model-name", "m", "--rank-timeout", "10"]
    for group, ref in _pair(model, flags, base):
        yield request.param, group, ref


@pytest.fixture(scope="module")
def moe_pp(ring: None, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("moe-pp")
    model = _write_tiny("qwen3_moe", base / "model", seed=1, num_hidden_layers=4)
    yield from _pair(model, ["--pipeline-parallel", "2", "--served-model-name", "m"], base)


# -- tests -----------------------------------------------------------------------------------


# the least margin (nats) between the reference's best and second-best token for which the two
# must agree: the ranks' partial sums of a row-parallel product add up in another order than one
# process's matmul, and 8-bit KV can round those last-bit differences to another level, which
# flips a near tie (0.03 nats between two continuations of a repeated block flipped on one CPU)
NEAR_TIE = 0.1


def test_tensor_parallel_bundled_equals_one_process(bundled_tp) -> None:
    """With n-gram speculation over 8-bit KV: the verify steps run on every rank alike. The
    repeated block gets n-gram drafts; its continuation has no near tie, so one process and the
    ranks must choose the same tokens."""
    group, ref = bundled_tp
    assert _concurrent(group.url) == _concurrent(ref.url)
    repetitive = "x = [1, 2, 3]\ny = [4, 5, 6]\n" * 3 + "x = [1, 2, 3]\n"
    want = _complete(ref.url, repetitive, 24, logprobs=2)["choices"][0]
    margins = [max(top.values()) - min(top.values()) for top in want["logprobs"]["top_logprobs"]]
    assert len(margins) == 24 and min(margins) >= NEAR_TIE, margins  # else pick another prompt
    assert _complete(group.url, repetitive, 24)["choices"][0]["text"] == want["text"]
    spec = httpx.get(f"{group.url}/health", timeout=10).json()["engine"]["spec"]
    assert spec["spec_steps"] > 0 and spec["accepted_tokens"] > 0, spec


def test_tensor_parallel_tiny_equals_one_process(tiny_tp) -> None:
    _, group, ref = tiny_tp
    try:
        got = _concurrent(group.url)
    except (httpx.HTTPError, AssertionError) as exc:  # the group's log says why it stopped
        raise AssertionError(f"{exc}\n{group.log()[-3000:]}") from exc
    assert got == _concurrent(ref.url)


def test_pipeline_parallel_equals_one_process(moe_pp) -> None:
    """Then the group stops cleanly: SIGTERM to `mlxd serve` stops rank 0, which stops the
    other rank; every rank and the launcher exit 0."""
    group, ref = moe_pp
    assert _concurrent(group.url) == _concurrent(ref.url)
    assert group.stop() == 0, group.log()[-2000:]
    exits = sorted(p.read_text() for p in group.rank_dir.glob("rank*.exit"))
    assert exits == ["0", "0"], group.log()[-2000:]


def test_tensor_parallel_prefix_cache(bundled_tp) -> None:
    """A repeated long prompt is served from every rank's prefix cache, with the same text."""
    group, ref = bundled_tp
    prompt = "def parse(path):\n    with open(path) as f:\n        lines = f.readlines()\n" * 3
    first = _complete(group.url, prompt, 8)
    second = _complete(group.url, prompt, 8)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16, second["usage"]
    want = _complete(ref.url, prompt, 8)["choices"][0]["text"]
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == want


def test_tensor_parallel_abort_on_disconnect(bundled_tp) -> None:
    """A client that leaves mid-stream frees its row on every rank; the group goes on serving
    the same tokens as one process."""
    group, ref = bundled_tp
    body = {"model": "m", "prompt": "def long():", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{group.url}/v1/completions", json=body, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines >= 3:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        engine = httpx.get(f"{group.url}/health", timeout=10).json().get("engine", {})
        if engine.get("num_running") == 0 and engine.get("active_requests") == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the row was not freed: {engine}")
    assert _concurrent(group.url, 4) == _concurrent(ref.url, 4)


# the group of each tiny model ends with one of these (after its other tests)
FAILURES = {"llama": "kill", "qwen3": "hang", "qwen3_moe": "kill"}


def test_failed_rank_gives_503_and_exit(tiny_tp) -> None:
    """A rank that dies (SIGKILL) or hangs (SIGSTOP, past --rank-timeout 10): the request in
    flight ends with a 503 JSON error and the group exits non-zero within 30 s."""
    arch, group, _ = tiny_tp
    how = FAILURES[arch]
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"model": "m", "prompt": "def f():", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{group.url}/v1/completions", json=body, timeout=60)
        result["status"], result["body"] = r.status_code, r.json()

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    os.kill(group.pid(1), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    thread.join(30)
    assert result.get("status") == 503, (how, result, group.log()[-2000:])
    assert result["body"]["error"]["code"] == "distributed_group_failed"
    code = group.proc.wait(max(1.0, 30 - (time.monotonic() - t0)))
    assert code == 75, group.log()[-2000:]
    assert time.monotonic() - t0 < 30


# -- no processes ----------------------------------------------------------------------------


class _FakeChannel:
    def __init__(self, digests: list[bytes]) -> None:
        self.digests = digests

    def gather_bytes(self, data: bytes, width: int) -> list[bytes]:
        return [data, *self.digests]


def test_model_fingerprint_catches_a_changed_file(tmp_path: Path) -> None:
    from engine.distributed import GroupError, check_same_model, model_fingerprint

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(DEFAULT_MODEL_DIR, a)
    shutil.copytree(DEFAULT_MODEL_DIR, b)
    assert model_fingerprint(a) == model_fingerprint(b)
    weights = sorted(b.glob("*.safetensors"))[-1]
    data = bytearray(weights.read_bytes())
    data[-5] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    assert model_fingerprint(a) != model_fingerprint(b)
    check_same_model(_FakeChannel([model_fingerprint(a)]), a)  # type: ignore[arg-type]
    with pytest.raises(GroupError, match=r"rank\(s\) 1 differ"):
        check_same_model(_FakeChannel([model_fingerprint(b)]), a)  # type: ignore[arg-type]


def test_shard_refuses_indivisible_heads() -> None:
    from engine.distributed import ShardError, shard_model

    class FakeGroup:
        def size(self) -> int:
            return 4

    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())

    class Model:
        def shard(self, group: Any) -> None:
            raise AssertionError("must not shard")

    with pytest.raises(ShardError, match="num_attention_heads = 6 is not divisible by 4"):
        shard_model(Model(), config, FakeGroup(), "tensor")
    with pytest.raises(ShardError, match="no pipeline splitting"):
        shard_model(Model(), config, FakeGroup(), "pipeline")


@pytest.mark.parametrize("flags, fragment", [
    (["--tensor-parallel", "2", "--pipeline-parallel", "2"], "not with --tensor-parallel"),
    (["--tensor-parallel", "2", "--adapter", "a=/tmp"], "LoRA adapters are not served"),
    (["--hostfile", "/nonexistent.json"], "needs --tensor-parallel"),
    (["--tensor-parallel", "2", "--hostfile", "/nonexistent.json"], "cannot read"),
])
def test_distributed_flag_errors(flags: list[str], fragment: str) -> None:
    r = subprocess.run([sys.executable, "-m", "mlxd", "serve", *flags], capture_output=True,
                       text=True, timeout=60, cwd=REPO, env=dict(os.environ,
                                                                 PYTHONPATH=str(REPO)))
    assert r.returncode == 2
    assert fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_supervise_restarts_a_failed_group(tmp_path: Path) -> None:
    """Exit status 75 (a rank of the group failed) is restarted like a crash."""
    from mlxd.supervise import supervise

    marker = tmp_path / "ran"
    script = (f"import pathlib, sys; p = pathlib.Path({str(marker)!r}); "
              "first = not p.exists(); p.write_text('x'); sys.exit(75 if first else 0)")
    assert supervise([sys.executable, "-c", script], backoff=0.01) == 0
    assert marker.exists()


def test_channel_round_trip_on_one_rank() -> None:
    """Short messages take one collective, long ones two; the bytes come back whole."""
    import mlx.core as mx

    from engine.distributed import HEAD_WORDS, Channel

    channel = Channel(mx.distributed.init())  # a group of one: all_sum is the identity
    for size in (1, 7, 4 * (HEAD_WORDS - 1), 4 * HEAD_WORDS + 3, 100_000):
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        before = channel.num_messages
        assert channel.broadcast(payload) == payload
        assert channel.num_messages == before + 1


def test_follower_stops_on_diverged_tokens() -> None:
    """A rank whose last step's tokens differ from rank 0's stops instead of serving on."""
    from engine.distributed import Follower, GroupError, StepMessage

    follower = Follower.__new__(Follower)
    follower._last = [("a", [5]), ("b", [7])]
    follower.num_steps = 3
    follower.channel = type("C", (), {"rank": 1})()  # type: ignore[assignment]
    follower._apply(StepMessage("beat", check=[("a", [5]), ("b", [7])]))  # the same: goes on
    with pytest.raises(GroupError, match="rank 1 diverged from rank 0 at step 3"):
        follower._apply(StepMessage("beat", check=[("a", [5]), ("b", [8])]))


def test_launch_command_for_a_hostfile(tmp_path: Path) -> None:
    """With --hostfile the ranks go where mlx.launch's file says (two hosts: one rank each,
    so each gets the whole of its host's memory and cores); without, N ranks on this host."""
    from mlxd.cli import parse_serve_args
    from mlxd.distributed import PER_HOST_ENV, launch_command

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "mac1", "ips": ["10.0.0.1"]},
                                 {"ssh": "mac2", "ips": ["10.0.0.2"]}]))
    args = parse_serve_args(["--tensor-parallel", "2", "--hostfile", str(hosts),
                             "--backend", "jaccl"])
    cmd = launch_command(args, ["--tensor-parallel", "2"], "/tmp/ranks")
    head, tail = cmd[: cmd.index("--")], cmd[cmd.index("--") + 1 :]
    assert ["--hostfile", str(hosts)] == head[head.index("--hostfile"):][:2]
    assert "-n" not in head and f"{PER_HOST_ENV}=1" in head
    assert head[head.index("--backend") + 1] == "jaccl"
    assert tail == [sys.executable, "-m", "mlxd", "serve", "--tensor-parallel", "2"]
    local = launch_command(parse_serve_args(["--tensor-parallel", "2"]), [], "/tmp/ranks")
    assert local[local.index("-n") + 1] == "2" and f"{PER_HOST_ENV}=2" in local
