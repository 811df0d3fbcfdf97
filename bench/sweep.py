"""serve-sweep: start each server, drive all of them with the same load, level by level.

All servers are started once (one after another, each on its own free loopback port) and kept up
for the whole sweep; at each concurrency level they run back to back (mlxd first, then each
peer), so that slow drift in the machine's load affects all of them alike. Each server's CPU
seconds are read from /proc during every run, its own and the others' (an idle server must not
steal CPU from the one being measured).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.loadgen import LoadSpec, run_level
from bench.metrics import level_ratios, record_dict, summarize
from bench.servers import ServerProcess, ServerSpec, cpu_seconds, rss_bytes


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    for pkg in ("mlx", "mlx-lm", "mlx-metal", "mlx-cpu", "mlx-cuda", "vllm-mlx"):
        try:
            info[f"{pkg}_version"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        import subprocess

        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if gpu.returncode == 0 and gpu.stdout.strip():
            info["gpus"] = gpu.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    info["loadavg_start"] = list(os.getloadavg())
    gpus = f", {len(info['gpus'])}x {info['gpus'][0]}" if info.get("gpus") else ", no GPU"
    info["summary"] = (f"{platform.system()} {info['machine']}, {info['cpus']} cores"
                       f"{gpus}, load {info['loadavg_start'][0]:.1f} at start")
    return info


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
    log=print,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
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
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
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

