"""sweep: start each server, drive all of them with the same load, level by level.

All servers are started once (one after another, each on its own free loopback port) and kept up
for the whole sweep; at each concurrency level they run back to back (mlxd first, then each
peer), so that slow drift in the machine's load affects all of them alike. Each server's CPU
seconds are read from /proc during every run, its own and the others' (an idle server must not
steal CPU from the one being measured).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import common
from bench.common import machine_info
from bench.loadgen import LoadSpec, run_level
from bench.metrics import level_ratios, record_dict, summarize
from bench.servers import OPENBLAS, ServerProcess, ServerSpec, cpu_seconds, rss_bytes


def requests_for(concurrency: int, per_level: str | None, levels: list[int]) -> int:
    """Requests at one level: an explicit count (or a list matching the levels), else 2c, min 8."""
    if per_level:
        parts = [int(x) for x in str(per_level).split(",")]
        if len(parts) == 1:
            return parts[0]
        return parts[levels.index(concurrency)]
    return max(8, 2 * concurrency)


def warm_up(server: ServerProcess, prompts: list[str], max_tokens: int) -> None:
    spec = LoadSpec(server.url, server.model_id or "default", prompts[:4], 4, min(16, max_tokens),
                    ignore_eos=server.spec.supports_ignore_eos, deadline_s=300)
    asyncio.run(run_level(spec))


def run_sweep(
    specs: list[ServerSpec],
    models: dict[str, str],
    prompts: list[str],
    warmup_prompts: list[str],
    levels: list[int],
    out_dir: Path,
    *,
    name: str,
    output_tokens: int,
    prompt_tokens: int,
    per_level: str | None,
    level_deadline_s: float,
    request_timeout_s: float,
    eos_bias: dict[str, float] | None,
    config_extra: dict[str, Any],
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "bench": "sweep",
        "command": config_extra.pop("command", ""),
        "name": name,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "concurrency": levels,
            "endpoint": "/v1/completions (text prompt), stream=true, include_usage, temperature 0",
            "level_deadline_s": level_deadline_s,
            **config_extra,
        },
        "baseline": specs[0].name,
        "servers": {},
        "levels": [],
    }
    raw: dict[str, Any] = {}
    servers: dict[str, ServerProcess] = {}
    try:
        for spec in specs:
            log(f"starting {spec.name} ...")
            srv = ServerProcess(spec, models[spec.name], out_dir / "logs").start()
            servers[spec.name] = srv
            warm_up(srv, warmup_prompts, output_tokens)
            result["servers"][spec.name] = {
                "label": spec.label,
                "note": spec.note,
                "argv": spec.build(models[spec.name], srv.port),
                "startup_s": round(srv.startup_s or 0, 2),
                "model_id": srv.model_id,
                "ignore_eos": spec.supports_ignore_eos,
                "rss_after_warmup_bytes": rss_bytes(srv.pid),
            }
            log(f"  {spec.name} ready on {srv.url} in {srv.startup_s:.1f}s (pid {srv.pid})")
        offset = 0
        for c in levels:
            n = requests_for(c, per_level, levels)
            level_prompts = [prompts[(offset + i) % len(prompts)] for i in range(n)]
            offset += n
            entry: dict[str, Any] = {"concurrency": c, "num_requests": n, "results": {},
                                     "loadavg": {}}
            for spec in specs:
                srv = servers[spec.name]
                if not srv.alive():
                    log(f"  {spec.name} died; restarting")
                    srv.stop()
                    srv = ServerProcess(spec, models[spec.name], out_dir / "logs").start()
                    servers[spec.name] = srv
                load = LoadSpec(
                    srv.url, srv.model_id or "default", level_prompts, c, output_tokens,
                    ignore_eos=spec.supports_ignore_eos,
                    eos_bias=None if spec.supports_ignore_eos else eos_bias,
                    request_timeout_s=request_timeout_s, deadline_s=level_deadline_s,
                )
                cpu0 = {k: cpu_seconds(s.pid) for k, s in servers.items()}
                entry["loadavg"][spec.name] = [round(x, 2) for x in os.getloadavg()]
                records, wall = asyncio.run(run_level(load))
                cpu1 = {k: cpu_seconds(s.pid) for k, s in servers.items()}
                summary = summarize(records, wall)
                summary["server_cpu_s"] = _delta(cpu0.get(spec.name), cpu1.get(spec.name))
                summary["bystander_cpu_s"] = {
                    k: _delta(cpu0.get(k), cpu1.get(k)) for k in servers if k != spec.name}
                summary["rss_bytes"] = rss_bytes(srv.pid)
                summary["server_alive"] = srv.alive()
                entry["results"][spec.name] = summary
                raw[f"{spec.name}@{c}"] = [record_dict(r) for r in records]
                log(f"  c={c:<3} {spec.name:<12} {summary['output_tok_s']:8.1f} tok/s  "
                    f"TTFT p50 {_fmt(summary['ttft_s']['p50'])} p99 {_fmt(summary['ttft_s']['p99'])}"
                    f"  ITL p50 {_fmt(summary['itl_s']['p50'], 1000)}ms  "
                    f"failed {summary['num_failed']}/{n} {summary['failures'] or ''}")
            base = entry["results"][specs[0].name]
            entry["ratios"] = {s.name: level_ratios(base, entry["results"][s.name])
                               for s in specs[1:]}
            result["levels"].append(entry)
            enrich(result)
            _write(out_dir, result, raw)
    finally:
        for srv in servers.values():
            rc = srv.stop()
            if srv.spec.name in result["servers"]:
                result["servers"][srv.spec.name]["exit_code"] = rc
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    _write(out_dir, result, raw)
    return result


def enrich(result: dict[str, Any]) -> dict[str, Any]:
    """Add CPU efficiency: output tokens per CPU-second of the server, and its mlxd/peer ratio.

    On a shared machine wall-clock throughput moves with other tenants' load; the CPU seconds a
    server spends per token move much less, so this is the steadier engine-against-engine number.
    """
    base = result.get("baseline") or next(iter(result["servers"]))
    for lvl in result["levels"]:
        for s in lvl["results"].values():
            cpu = s.get("server_cpu_s")
            s["output_tok_per_cpu_s"] = (s["output_tokens"] / cpu) if cpu else None
        mine = lvl["results"].get(base, {}).get("output_tok_per_cpu_s")
        for peer, rat in lvl.get("ratios", {}).items():
            theirs = lvl["results"].get(peer, {}).get("output_tok_per_cpu_s")
            rat["output_tok_per_cpu_s"] = (mine / theirs) if mine and theirs else None
    return result


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)


def _fmt(v: float | None, scale: float = 1.0) -> str:
    return "   -  " if v is None else f"{v * scale:6.3f}" if scale == 1 else f"{v * scale:6.1f}"


def _write(out_dir: Path, result: dict[str, Any], raw: dict[str, Any]) -> None:
    common.write_json(out_dir / "sweep.json", "sweep", result)
    (out_dir / "records.json").write_text(json.dumps(raw, separators=(",", ":")))


def table(result: dict[str, Any]) -> str:
    """A Markdown table of the sweep (one row per level and server)."""
    rows = ["| concurrency | server | output tok/s | req/s | TTFT p50 (s) | TTFT p99 (s) | "
            "ITL p50 (ms) | ITL p99 (ms) | out tok/req | failed | tok/CPU-s | mlxd/peer tok/s | "
            "mlxd/peer TTFT p99 | mlxd/peer tok/CPU-s |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v: float | None, nd: int = 2, scale: float = 1.0) -> str:
        return "–" if v is None else f"{v * scale:.{nd}f}"

    for lvl in result["levels"]:
        for name, s in lvl["results"].items():
            rat = lvl.get("ratios", {}).get(name, {})
            label = result["servers"][name]["label"]
            fails = f"{s['num_failed']}/{s['num_requests']}"
            if s["failures"]:
                fails += " " + ", ".join(f"{k}:{v}" for k, v in s["failures"].items())
            tok = s["output_tokens_per_request"]
            rows.append(
                f"| {lvl['concurrency']} | {label} | {f(s['output_tok_s'], 1)} | "
                f"{f(s['request_per_s'], 3)} | {f(s['ttft_s']['p50'])} | {f(s['ttft_s']['p99'])} | "
                f"{f(s['itl_s']['p50'], 1, 1000)} | {f(s['itl_s']['p99'], 1, 1000)} | "
                f"{f(tok['mean'], 1)} | {fails} | {f(s.get('output_tok_per_cpu_s'), 1)} | "
                f"{f(rat.get('output_tok_s'), 2) + 'x' if rat.get('output_tok_s') else ''} | "
                f"{f(rat.get('ttft_p99'), 2) + 'x' if rat.get('ttft_p99') else ''} | "
                f"{f(rat.get('output_tok_per_cpu_s'), 2) + 'x' if rat.get('output_tok_per_cpu_s') else ''} |")
    return "\n".join(rows)



# -- the `sweep` and `load` subcommands ---------------------------------------------------------
def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the bundled tinycoder-16m)")
    p.add_argument("--concurrency", type=_levels, default=[1, 4, 16, 64])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--requests-per-level", default=None,
                   help="requests at each level: N, or a list matching --concurrency "
                        "(default: 2 x concurrency, at least 8)")
    p.add_argument("--level-deadline", type=float, default=900.0,
                   help="seconds after which a level sends no new request (bounded runs)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    common.add_out_arg(p)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("sweep", help="start mlxd and peer servers, run the concurrency sweep",
                       description=__doc__)
    _add_workload_args(p)
    p.add_argument("--peers", default="mlx_lm",
                   help="comma list of mlx_lm, mlx_lm_blas, vllm_mlx (vllm_mlx is skipped when "
                        "not installed); empty: mlxd alone")
    p.add_argument("--blas-path", default=OPENBLAS, help="the BLAS mlx_lm_blas preloads")
    p.add_argument("--peer-blas-dtype", choices=["float32", "checkpoint"], default="float32",
                   help="weights for mlx_lm_blas: a float32 copy (as mlxd computes on a CPU; "
                        "bfloat16 matmuls do not use BLAS) or the checkpoint as is")
    p.add_argument("--mlxd-args", default="", help="extra arguments for `mlxd serve`, quoted")
    p.add_argument("--eos-bias", action="store_true",
                   help="for servers without ignore_eos, send logit_bias -100 on the EOS ids "
                        "(fixes output length but costs mlx_lm.server a per-row Python loop)")
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("load", help="drive an already running server (no start/stop)")
    _add_workload_args(p)
    p.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8080 (loopback only)")
    p.add_argument("--model-id", default=None, help="the request's model field")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.set_defaults(func=cmd_load)


def _model_dir(args: argparse.Namespace) -> str:
    return str((args.model or common.default_model()).resolve())


def _prompts(args: argparse.Namespace, model: str) -> tuple[list[str], list[str]]:
    """(warm-up prompts, measured prompts): the first 4 warm the servers up and are never
    measured (a prefix cache would hit them)."""
    from bench.workload import make_prompts

    total = sum(requests_for(c, args.requests_per_level, args.concurrency)
                for c in args.concurrency)
    texts = [p.text for p in make_prompts(model, total + 4, args.prompt_tokens, seed=args.seed)]
    return texts[:4], texts[4:]


def peer_specs(args: argparse.Namespace, model: str) -> tuple[list[ServerSpec], dict[str, str]]:
    """mlxd first, then each peer of --peers, with the model directory each one serves."""
    from bench import servers as S

    specs = [S.mlxd_spec(args.mlxd_args.split())]
    models = {"mlxd": model}
    for peer in [p for p in args.peers.split(",") if p]:
        if peer == "mlx_lm":
            specs.append(S.mlx_lm_spec())
            models["mlx_lm"] = model
        elif peer == "mlx_lm_blas":
            spec = S.mlx_lm_spec(preload_blas=args.blas_path, name="mlx_lm_blas")
            models["mlx_lm_blas"] = model
            spec.label = "mlx_lm+OpenBLAS"
            if args.peer_blas_dtype == "float32":
                from bench.modelprep import float32_copy

                models["mlx_lm_blas"] = str(float32_copy(model))
                spec.note += ", float32 copy of the weights (the dtype mlxd computes in on a CPU)"
                spec.label = "mlx_lm+OpenBLAS f32"
            specs.append(spec)
        elif peer == "vllm_mlx":
            if not S.vllm_mlx_available():
                print("vllm-mlx is not installed: skipping it", file=sys.stderr)
                continue
            specs.append(S.vllm_mlx_spec())
            models["vllm_mlx"] = model
        else:
            raise SystemExit(f"unknown peer {peer!r} (known: mlx_lm, mlx_lm_blas, vllm_mlx)")
    return specs, models


def cmd_sweep(args: argparse.Namespace) -> int:
    from bench.plot import plot_sweep
    from bench.workload import eos_token_ids

    model = _model_dir(args)
    out = common.out_dir(args, "sweep")
    specs, models = peer_specs(args, model)
    print(f"preparing {args.prompt_tokens}-token prompts from {model} ...")
    warmup, prompts = _prompts(args, model)
    eos = {str(i): -100.0 for i in eos_token_ids(model)} if args.eos_bias else None
    result = run_sweep(
        specs, models, prompts, warmup, args.concurrency, out, name=out.name,
        output_tokens=args.output_tokens, prompt_tokens=args.prompt_tokens,
        per_level=args.requests_per_level, level_deadline_s=args.level_deadline,
        request_timeout_s=args.request_timeout, eos_bias=eos,
        config_extra={"model": model, "model_name": Path(model).name, "seed": args.seed,
                      "requests_per_level": args.requests_per_level or "2 x concurrency, min 8",
                      "eos_bias": bool(eos), "command": common.command_line(args)},
    )
    md = table(result)
    (out / "table.md").write_text(md + "\n")
    png = plot_sweep(result, out / "sweep.png")
    print(md)
    print(f"\nwrote {out / 'sweep.json'}, {png}")
    failed = sum(lvl["results"][specs[0].name]["num_failed"] for lvl in result["levels"])
    return 1 if failed else 0


def cmd_load(args: argparse.Namespace) -> int:
    """Drive one running server and print a summary per level (load.json with --out)."""
    import httpx

    model = _model_dir(args)
    _, prompts = _prompts(args, model)
    url = args.url.rstrip("/")
    model_id = args.model_id
    if model_id is None:
        data = httpx.get(url + "/v1/models", timeout=10).json().get("data") or []
        model_id = data[0]["id"] if data else "default"
    offset, report = 0, []
    for c in args.concurrency:
        n = requests_for(c, args.requests_per_level, args.concurrency)
        spec = LoadSpec(url, model_id, prompts[offset:offset + n], c, args.output_tokens,
                        endpoint=args.endpoint, ignore_eos=True,
                        request_timeout_s=args.request_timeout, deadline_s=args.level_deadline)
        offset += n
        records, wall = asyncio.run(run_level(spec))
        s = summarize(records, wall)
        report.append({"concurrency": c, **s})
        print(f"c={c:<3} {s['output_tok_s']:8.1f} tok/s  TTFT p50 {s['ttft_s']['p50']}  "
              f"p99 {s['ttft_s']['p99']}  ITL p50 {s['itl_s']['p50']}  failed {s['num_failed']}")
    if args.out:
        out = common.out_dir(args, "load")
        common.write_json(out / "load.json", "load", {"url": url, "levels": report}, args)
    return 1 if any(r["num_failed"] for r in report) else 0
