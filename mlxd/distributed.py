"""`mlxd serve --tensor-parallel N` / `--pipeline-parallel N`: one model served by N ranks.

The `mlxd serve` process is the launcher: it starts the ranks through `mlx.launch` (on this
host, or on the hosts of `--hostfile`, mlx.launch's own format), each one `python -m mlxd serve`
with the same arguments, waits for them and exits with the group's status. Rank 0 listens on
`--host`/`--port` and runs the server and the engine (engine/distributed.py); the others run
the engine only. SIGINT/SIGTERM/SIGHUP to the launcher stop rank 0, which stops the others.

Exit status: rank 0's; `GROUP_FAILED` (75) when the group broke (a rank died or hung, or the
ranks diverged), which `--supervise` restarts like a crash (mlxd/supervise.py).

Nothing here imports mlx at module level: the launcher never does, and a rank loads its BLAS
(kernels.device) before the first import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("mlxd.distributed")

RANK_DIR_ENV = "MLXD_RANK_DIR"  # where ranks write rank<N>.pid and rank<N>.exit
STOPPING = "stopping"  # written there by the launcher before it signals rank 0 to stop
PER_HOST_ENV = "MLXD_RANKS_PER_HOST"  # ranks sharing a host: each gets that share of memory
GROUP_FAILED = 75  # the value of engine.distributed.GROUP_FAILED (not imported: it loads mlx)
BACKENDS = ("ring", "jaccl", "jaccl-ring", "mpi", "nccl")
STOP_GRACE_S = 30.0  # after a stop signal, the ranks get this long before they are killed
RANKS_EXIT_GRACE_S = 3.0  # after rank 0 exits, the other local ranks get this long


def add_arguments(p: argparse.ArgumentParser, int_in: Any, float_in: Any) -> None:
    g = p.add_argument_group("distributed (docs/distributed.md)")
    g.add_argument("--tensor-parallel", type=int_in(1), default=1, metavar="N",
                   help="split every layer across N ranks (mlx-lm's Model.shard)")
    g.add_argument("--pipeline-parallel", type=int_in(1), default=1, metavar="N",
                   help="split the layers into N stages, one per rank (models with mlx-lm's "
                        "pipeline support)")
    g.add_argument("--hostfile", default=None,
                   help="mlx.launch's hostfile (JSON) to run the ranks on several hosts "
                        "(default: all ranks on this host)")
    g.add_argument("--backend", default="ring", choices=BACKENDS,
                   help="mx.distributed backend: ring (TCP), jaccl (RDMA over Thunderbolt 5), "
                        "mpi, nccl (NVIDIA)")
    g.add_argument("--ring-port", type=int_in(1, 65535), default=32323,
                   help="first TCP port of the ring backend (one per rank and IP)")
    g.add_argument("--rank-timeout", type=float_in(1.0, 3600.0), default=20.0,
                   help="seconds a step may wait on another rank before the group is failed "
                        "(requests get 503, the server exits with status 75)")


def world_size(args: argparse.Namespace) -> int:
    return int(args.tensor_parallel) * int(args.pipeline_parallel)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The distributed flags' one-line errors (exit 2), before anything starts."""
    size = world_size(args)
    if args.tensor_parallel > 1 and args.pipeline_parallel > 1:
        parser.error("argument --pipeline-parallel: not with --tensor-parallel (choose one)")
    if size == 1:
        if args.hostfile:
            parser.error("argument --hostfile: needs --tensor-parallel or --pipeline-parallel")
        return
    if args.adapters:
        parser.error("argument --adapter: LoRA adapters are not served by a tensor- or "
                     "pipeline-parallel group")
    if args.spec == "draft" or args.draft_model:
        parser.error("argument --draft-model: a draft model is not served by a tensor- or "
                     "pipeline-parallel group (--spec ngram is)")
    if args.hostfile:
        try:
            hosts = _hostfile_hosts(args.hostfile)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"argument --hostfile: cannot read {args.hostfile}: {exc}")
        if len(hosts) != size:
            parser.error(f"argument --hostfile: {len(hosts)} hosts for {size} ranks")


def _hostfile_hosts(path: str) -> list[str]:
    data = json.loads(Path(path).read_text())
    hosts = data["hosts"] if isinstance(data, dict) else data
    return [str(h.get("ssh", "")) for h in hosts]


def main(args: argparse.Namespace, serve_argv: list[str]) -> int:
    """A rank (started by mlx.launch) serves; otherwise this process launches the ranks."""
    if os.environ.get(RANK_DIR_ENV) and os.environ.get("MLX_RANK") is not None:
        return serve_rank(args)
    return launch(args, serve_argv)


# -- the launcher ----------------------------------------------------------------------------


def launch_command(args: argparse.Namespace, serve_argv: list[str], rank_dir: str) -> list[str]:
    """mlx.launch's command line that starts every rank as `python -m mlxd serve ...`."""
    script = Path(sys.executable).with_name("mlx.launch")
    launcher = ([str(script)] if script.is_file() else
                [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import "
                 "main; sys.argv[0] = 'mlx.launch'; sys.exit(main())"])
    cmd = [*launcher, "--backend", args.backend, "--starting-port", str(args.ring_port)]
    if args.hostfile:
        hosts = _hostfile_hosts(args.hostfile)
        per_host = max(hosts.count(h) for h in hosts)
        cmd += ["--hostfile", args.hostfile]
    else:
        per_host = world_size(args)
        cmd += ["-n", str(per_host)]
    cmd += ["--env", f"{RANK_DIR_ENV}={rank_dir}", "--env", f"{PER_HOST_ENV}={per_host}"]
    if "OPENBLAS_NUM_THREADS" not in os.environ:  # ranks sharing a host share its cores
        threads = max(1, (os.cpu_count() or 1) // per_host)
        cmd += ["--env", f"OPENBLAS_NUM_THREADS={threads}"]
    return [*cmd, "--", sys.executable, "-m", "mlxd", "serve", *serve_argv]


def launch(args: argparse.Namespace, serve_argv: list[str]) -> int:
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    given = os.environ.get(RANK_DIR_ENV)
    rank_dir = given or tempfile.mkdtemp(prefix="mlxd-ranks-")
    _clear_rank_dir(Path(rank_dir))  # a restarted group must not read the last one's files
    try:
        return _launch_in(args, serve_argv, rank_dir)
    finally:
        if not given:
            shutil.rmtree(rank_dir, ignore_errors=True)


def _clear_rank_dir(rank_dir: Path) -> None:
    rank_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*rank_dir.glob("rank*.pid"), *rank_dir.glob("rank*.exit"), rank_dir / STOPPING]:
        stale.unlink(missing_ok=True)


def _launch_in(args: argparse.Namespace, serve_argv: list[str], rank_dir: str) -> int:
    cmd = launch_command(args, serve_argv, rank_dir)
    log.info("starting %d ranks (%s backend): %s", world_size(args), args.backend,
             " ".join(cmd[: cmd.index("--")]))
    # its own session: a Ctrl-C on the terminal reaches this process only, which stops rank 0
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    stop_at: list[float] = []

    def forward(signum: int, _frame: object) -> None:
        if not stop_at:
            stop_at.append(time.monotonic() + STOP_GRACE_S)
        (Path(rank_dir) / STOPPING).touch()  # rank 0: this SIGTERM asks for a clean stop
        if not _signal_rank0(rank_dir, signal.SIGTERM):
            _kill_group(proc, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM,
                                                       signal.SIGHUP)}
    rank0_exit = Path(rank_dir) / "rank0.exit"
    try:
        while proc.poll() is None:
            if not stop_at and rank0_exit.exists():  # the others get the grace to follow
                stop_at.append(time.monotonic() + RANKS_EXIT_GRACE_S)
            if stop_at and time.monotonic() > stop_at[0]:
                _kill_group(proc, signal.SIGKILL)  # e.g. a stopped rank mlx.launch waits on
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return group_status(rank_dir, world_size(args))


def group_status(rank_dir: str, size: int) -> int:
    """Rank 0's exit status, or GROUP_FAILED when rank 0 left none (it was killed) or another
    rank failed while rank 0 exited cleanly."""
    codes = [_read_int(Path(rank_dir) / f"rank{r}.exit") for r in range(size)]
    first = codes[0]
    if first is None:
        return GROUP_FAILED
    # a rank on another host leaves no file here (None): rank 0 notices its failures itself
    if first == 0 and any(c not in (0, None) for c in codes[1:]):
        return GROUP_FAILED
    return first


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _signal_rank0(rank_dir: str, signum: int) -> bool:
    pid = _read_int(Path(rank_dir) / "rank0.pid")
    if pid is None:
        return False
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def _kill_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


# -- a rank ----------------------------------------------------------------------------------


def serve_rank(args: argparse.Namespace) -> int:
    rank = int(os.environ["MLX_RANK"])
    rank_dir = Path(os.environ[RANK_DIR_ENV])
    _note(rank_dir, f"rank{rank}.pid", os.getpid())

    def finish(code: int) -> None:
        _note(rank_dir, f"rank{rank}.exit", code)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    try:
        code = _rank_main(args, rank, finish)
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # noqa: BLE001 - a broken group or a divergence: say it, exit 75
        log.error("rank %d: %s: %s", rank, type(exc).__name__, exc)
        log.debug("rank %d failed", rank, exc_info=True)
        code = GROUP_FAILED
    finish(code)
    return code


def _note(rank_dir: Path, name: str, value: int) -> None:
    """For the launcher (on another host the folder is this host's own, and nobody reads it)."""
    try:
        rank_dir.mkdir(parents=True, exist_ok=True)
        (rank_dir / name).write_text(str(value))
    except OSError:
        pass


def _rank_main(args: argparse.Namespace, rank: int, finish: Any) -> int:
    if args.blas:
        os.environ["MLXD_BLAS"] = args.blas
    from mlxd.cli import _fail, _log_model, _run_server

    if rank == 0:
        from server.metrics import install_log_request_ids

        install_log_request_ids()  # every record gets request_id ("-" outside a request)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s"
               f"{' [%(request_id)s]' if rank == 0 else ''}: %(message)s",
    )
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    sock = None
    if rank == 0:
        from server.serving import listen_socket

        try:
            sock = listen_socket(args.host, args.port)
        except OSError as exc:
            return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
                         "choose another --port (or --host)", 1)
    from kernels import device

    device.load()  # before mlx is imported
    try:
        client, channel = _build(args, rank, finish)
    except Exception as exc:  # noqa: BLE001 - one line per failure, as `mlxd serve` does
        return _startup_failure(exc, args, rank)
    if rank != 0:
        from engine.distributed import Follower

        return Follower(client.engine, channel, args.rank_timeout, finish).run()
    _log_model(client)
    # uvicorn raises the signal that stopped it again once it is done; with a handler here
    # that lands nowhere, and rank 0 goes on to tell the other ranks to stop
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    _run_server(client, args, sock, _rank0_server(client.engine, Path(os.environ[RANK_DIR_ENV])))
    return GROUP_FAILED if client.engine.failed is not None else 0


def _rank0_server(engine: Any, rank_dir: Path) -> type:
    """uvicorn's server for rank 0. A SIGTERM the launcher did not announce (no `stopping`
    file) comes from mlx.launch because another rank exited: the group has failed, so the
    requests end with 503 at once, instead of a graceful shutdown that waits on a collective
    with a rank that is gone."""
    import threading

    from server.serving import Server

    class RankServer(Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGTERM and not (rank_dir / STOPPING).exists():
                threading.Thread(target=engine.fail_group, daemon=True, args=(
                    "the distributed group failed: another rank exited",)).start()
                return
            super().handle_exit(sig, frame)

    return RankServer


def _build(args: argparse.Namespace, rank: int, finish: Any) -> tuple[Any, Any]:
    import mlx.core as mx

    from engine.core import AsyncEngine, Engine
    from engine.distributed import (
        Channel,
        DistributedAsyncEngine,
        DistributedEngine,
        agree_on_budget,
        agree_on_memory,
        check_same_model,
        shard_model,
    )
    from engine.kv.memory import device_memory_bytes
    from engine.loader import resolve_model_path
    from mlxd import model_source
    from mlxd.runtime import StartupError, build_client

    size = world_size(args)
    backend = "jaccl" if args.backend.startswith("jaccl") else args.backend
    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() != size:
        raise StartupError(f"the group has {group.size()} ranks, {size} were asked for")
    stream = mx.default_stream(mx.default_device()) if backend == "nccl" else None
    channel = Channel(group, stream)
    path, _ = resolve_model_path(model_source(args.model), args.revision)
    check_same_model(channel, path)
    how = "tensor" if args.tensor_parallel > 1 else "pipeline"

    def shard(model: Any) -> None:
        from mlx_lm.utils import load_config

        shard_model(model, load_config(path), group, how)

    def make_engine(loaded: Any, config: Any) -> Any:
        if config.spec is not None:  # measured per rank: the ranks' verify widths would differ
            config.spec.warmup = False
        config.warm_chunks = False  # the widths follow rank 0's budget: agree_on_budget
        engine: Any
        if rank == 0:
            engine = DistributedEngine(loaded, config, channel, args.rank_timeout, finish)
            client: Any = DistributedAsyncEngine(engine)
        else:
            engine = Engine(loaded, config)
            client = AsyncEngine(engine)
        agree_on_memory(channel, engine)
        agree_on_budget(channel, engine)
        return client

    budget = args.memory_budget
    if budget is None:  # ranks on one host share its memory
        per_host = max(1, int(os.environ.get(PER_HOST_ENV, "1")))
        budget = int(device_memory_bytes() * 0.75) // per_host
    client = build_client(args, model=str(path), shard=shard, make_engine=make_engine,
                          memory_budget=budget)
    client.model.extra["distributed"] = {"parallelism": how, "ranks": size,
                                         "backend": args.backend}
    return client, channel


def _startup_failure(exc: BaseException, args: argparse.Namespace, rank: int) -> int:
    """One line, as `mlxd serve` prints; a failure every rank sees alike (a group check) is
    printed by rank 0 only."""
    from engine.distributed import GroupError, ShardError
    from engine.kv.batch import UnsupportedKV
    from engine.models.registry import UnsupportedArchitecture
    from mlxd.cli import _fail
    from mlxd.runtime import StartupError, describe_load_error

    log.debug("start-up failed", exc_info=True)
    alike = isinstance(exc, (GroupError, ShardError, StartupError, UnsupportedKV,
                             UnsupportedArchitecture))
    if alike:
        message, code = str(exc), 2
    else:
        message, code = describe_load_error(exc, args.model), 1
    if rank == 0 or not alike:
        _fail(message if rank == 0 else f"rank {rank}: {message}", code)
    return code
