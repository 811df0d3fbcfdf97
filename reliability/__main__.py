"""`python -m reliability`: bad input, disconnect storm, overload and soak against a live server.

    python -m reliability --start                        # starts mlxd itself (small --max-queue)
    python -m reliability --url http://127.0.0.1:8080    # a server you started (loopback only)
    python -m reliability --start --disconnects 20 --overload-requests 60 --soak-minutes 1

Prints a summary table and exits non-zero when any check fails; writes every result (with
details) to DIR/reliability.json, and with --start the server's log to DIR/logs/ (`--out DIR`,
default `.bench/reliability-<date>-<time>/`, ignored by git). Every loop is bounded in count and
time; traffic goes to loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from bench.common import add_out_arg, out_dir
from reliability import bad_input, disconnect, overload, soak
from reliability.common import CheckResult, Target, check_loopback

SUITES = ("bad_input", "disconnect", "overload", "soak")
DEFAULT_MAX_NUM_SEQS = 128  # mlxd serve's default


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m reliability", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--url", help="base URL of a running server (loopback only)")
    g.add_argument("--start", action="store_true", help="start mlxd as a subprocess")
    p.add_argument("--model", default=None, help="with --start: model dir (default: bundled)")
    p.add_argument("--model-id", default=None, help="the request's model field "
                   "(default: the first of /v1/models)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    p.add_argument("--max-queue", type=int, default=16, help="with --start: mlxd --max-queue")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="with --start: mlxd --max-num-seqs (default: mlxd's)")
    p.add_argument("--server-args", default="", help="with --start: more `mlxd serve` arguments")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma list of {', '.join(SUITES)}")
    p.add_argument("--disconnects", type=int, default=200)
    p.add_argument("--disconnect-concurrency", type=int, default=16,
                   help="streams in flight at once (keep it <= --max-queue to avoid 429s)")
    p.add_argument("--idle-within", type=float, default=2.0,
                   help="seconds within which the engine must be idle after the storm")
    p.add_argument("--overload-requests", type=int, default=1000)
    p.add_argument("--overload-concurrency", type=int, default=256)
    p.add_argument("--overload-max-tokens", type=int, default=16)
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--soak-concurrency", type=int, default=8)
    p.add_argument("--soak-warmup", type=float, default=0.3, help="fraction of the soak")
    p.add_argument("--soak-no-fill", action="store_true",
                   help="do not fill the server's prefix cache to its budget before the soak")
    p.add_argument("--soak-fill-max-s", type=float, default=600.0,
                   help="at most this long filling the prefix cache (seconds)")
    p.add_argument("--seed", type=int, default=0)
    add_out_arg(p)
    return p.parse_args(argv)


def table(results: list[CheckResult]) -> str:
    w = max(len(r.name) for r in results) if results else 10
    lines = [f"{'check':<{w}}  result  time     summary", f"{'-' * w}  ------  -------  -------"]
    for r in results:
        lines.append(f"{r.name:<{w}}  {'PASS' if r.ok else 'FAIL':<6}  {r.seconds:6.1f}s  {r.summary}")
        for prob in r.problems[:25]:
            lines.append(f"{'':<{w}}          ! {prob}")
        if len(r.problems) > 25:
            lines.append(f"{'':<{w}}          ! ... and {len(r.problems) - 25} more")
    return "\n".join(lines)


async def run_suites(target: Target, args: argparse.Namespace, log=print) -> list[CheckResult]:
    wanted = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = set(wanted) - set(SUITES)
    if unknown:
        raise SystemExit(f"unknown suites: {sorted(unknown)}")
    results: list[CheckResult] = []
    for name in SUITES:
        if name not in wanted:
            continue
        log(f"running {name} ...")
        if name == "bad_input":
            async with httpx.AsyncClient(timeout=60.0) as client:
                res = await bad_input.run(client, target)
        elif name == "disconnect":
            res = await disconnect.run(target, num_requests=args.disconnects,
                                       concurrency=args.disconnect_concurrency,
                                       idle_within_s=args.idle_within, seed=args.seed)
        elif name == "overload":
            res = await overload.run(target, num_requests=args.overload_requests,
                                     concurrency=args.overload_concurrency,
                                     max_tokens=args.overload_max_tokens)
        else:
            res = await soak.run(target, minutes=args.soak_minutes,
                                 concurrency=args.soak_concurrency,
                                 warmup_frac=args.soak_warmup, seed=args.seed,
                                 fill_prefix_cache=not args.soak_no_fill,
                                 fill_max_s=args.soak_fill_max_s)
        log(f"  {name}: {'PASS' if res.ok else 'FAIL'} — {res.summary}")
        results.append(res)
    return results


def _model_id(url: str) -> str:
    data = httpx.get(url + "/v1/models", timeout=10.0).json().get("data") or []
    return data[0]["id"] if data else "default"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args, "reliability")
    server = None
    t0 = time.monotonic()
    results: list[CheckResult] = []
    try:
        if args.start:
            from bench.servers import ServerProcess, mlxd_spec

            extra = ["--max-queue", str(args.max_queue), *args.server_args.split()]
            if args.max_num_seqs:
                extra += ["--max-num-seqs", str(args.max_num_seqs)]
            if args.model:
                model = str(Path(args.model).resolve())
            else:
                from mlxd import DEFAULT_MODEL_DIR

                model = str(DEFAULT_MODEL_DIR)
            server = ServerProcess(mlxd_spec(extra), model, out / "logs").start()
            print(f"started mlxd on {server.url} (pid {server.pid}, log {server.log_path})")
            target = Target(server.url, args.model_id or server.model_id or "default",
                            pid=server.pid, max_queue=args.max_queue,
                            max_num_seqs=args.max_num_seqs or DEFAULT_MAX_NUM_SEQS)
        else:
            url = args.url.rstrip("/")
            check_loopback(url)
            target = Target(url, args.model_id or _model_id(url), pid=args.pid)
        results = asyncio.run(run_suites(target, args))
    finally:
        if server is not None:
            alive = server.alive()
            rc = server.stop()
            crashed = CheckResult("server process", alive and rc == 0,
                                  f"alive to the end; exit code {rc} after SIGINT" if alive
                                  else f"DIED during the run (exit {rc}); log {server.log_path}")
            if not alive or rc != 0:
                crashed.problems.append(server.log_tail(30))
            results.append(crashed)
    print()
    print(table(results))
    print(f"\ntotal {time.monotonic() - t0:.0f}s")
    path = out / "reliability.json"
    path.write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
    print(f"wrote {path}")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
