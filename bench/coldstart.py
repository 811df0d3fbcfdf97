"""`coldstart`: how long the first requests wait on a freshly started server.

    python -m bench coldstart [--model DIR] [--peers mlx_lm] [--prompt-tokens 1024] [--burst 16]

A GPU backend compiles kernels (and builds attention and GEMM plans) for every new shape on first
use, so a server that is "ready" may still make its first users wait for compilation. Each server
in turn (mlxd first, then each of `--peers`) is started, and as soon as it answers `/v1/models`:

1. `first`: one streaming completion of `--prompt-tokens` tokens, `--output-tokens` out;
2. `first_burst`: `--burst` concurrent completions, prompt lengths spread evenly from a quarter
   of `--prompt-tokens` to all of it (shapes the first request did not use);
3. `warm` and `warm_burst`: the same two again on fresh prompts of the same lengths.

Every prompt is sent once (no prefix-cache hits). The JSON has each server's start-up seconds
and the TTFT of every request; `first / warm` is what the compilation still costs after
"ready". Run it on a machine whose kernel caches are cold (a fresh GPU machine) for the number
users see on their first start.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.loadgen import LoadSpec, one_request
from bench.servers import ServerProcess, ServerSpec

PHASES = ("first", "first_burst", "warm", "warm_burst")


def burst_lengths(prompt_tokens: int, burst: int) -> list[int]:
    """`burst` prompt lengths spread evenly from prompt_tokens // 4 to prompt_tokens."""
    lo = max(1, prompt_tokens // 4)
    if burst == 1:
        return [prompt_tokens]
    return [lo + (prompt_tokens - lo) * i // (burst - 1) for i in range(burst)]


def phase_prompts(model: str, prompt_tokens: int, burst: int, seed: int) -> dict[str, list[str]]:
    """Fresh prompts for every phase (a pure function of the seed)."""
    from bench.workload import prompts_of_lengths

    lengths = {"first": [prompt_tokens], "first_burst": burst_lengths(prompt_tokens, burst)}
    lengths["warm"], lengths["warm_burst"] = lengths["first"], lengths["first_burst"]
    texts = iter(p.text for p in prompts_of_lengths(
        model, [n for phase in PHASES for n in lengths[phase]], seed))
    return {phase: [next(texts) for _ in lengths[phase]] for phase in PHASES}


async def _phase(srv: ServerProcess, prompts: list[str], max_tokens: int,
                 timeout_s: float) -> list[dict[str, Any]]:
    spec = LoadSpec(url=srv.url, model=srv.model_id or "default", prompts=prompts,
                    concurrency=len(prompts), max_tokens=max_tokens, request_timeout_s=timeout_s)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        recs = await asyncio.gather(*(one_request(client, spec, p) for p in prompts))
    return [{"ok": r.ok, "error": r.error, "ttft_s": r.ttft, "prompt_tokens": r.prompt_tokens,
             "latency_s": r.end - r.start} for r in recs]


def run_server(spec: ServerSpec, model: str, prompts: dict[str, list[str]], out: Path,
               max_tokens: int, timeout_s: float, log: Any = print) -> dict[str, Any]:
    log(f"starting {spec.name} ...")
    with ServerProcess(spec, model, out / "logs", ready_timeout=600.0) as srv:
        log(f"  ready in {srv.startup_s:.1f}s")
        entry: dict[str, Any] = {"label": spec.label, "startup_s": srv.startup_s, "phases": {}}
        for phase in PHASES:
            recs = asyncio.run(_phase(srv, prompts[phase], max_tokens, timeout_s))
            ttfts = [r["ttft_s"] for r in recs if r["ttft_s"] is not None]
            worst = max(ttfts) if len(ttfts) == len(recs) else None
            entry["phases"][phase] = {"requests": recs, "worst_ttft_s": worst,
                                      "failed": sum(not r["ok"] for r in recs)}
            log(f"  {phase:12s} worst TTFT {_f(worst)} s over {len(recs)} request(s)")
        ph = entry["phases"]
        entry["first_over_warm"] = _ratio(ph["first"]["worst_ttft_s"], ph["warm"]["worst_ttft_s"])
        entry["burst_over_warm"] = _ratio(ph["first_burst"]["worst_ttft_s"],
                                          ph["warm_burst"]["worst_ttft_s"])
    return entry


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(result: dict[str, Any]) -> str:
    lines = ["| server | start-up s | first TTFT s | first burst worst s | warm TTFT s | "
             "warm burst worst s | failed |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in result["servers"].items():
        ph = e["phases"]
        failed = sum(p["failed"] for p in ph.values())
        lines.append(f"| {name} | {_f(e['startup_s'])} | " + " | ".join(
            _f(ph[p]["worst_ttft_s"]) for p in PHASES) + f" | {failed} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: Path) -> Path:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(result["servers"])
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ph = result["servers"][name]["phases"]
        ys = [ph[p]["worst_ttft_s"] or 0.0 for p in PHASES]
        ax.bar([x + i * width for x in range(len(PHASES))], ys, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(PHASES))], list(PHASES))
    ax.set_ylabel("worst TTFT (s)")
    ax.set_title(f"first requests after ready ({result['prompt_tokens']}-token prompts, "
                 f"burst of {result['burst']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("coldstart", help="TTFT of the first requests on a freshly started server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the bundled tinycoder-16m)")
    p.add_argument("--peers", default="", help="comma list of mlx_lm, mlx_lm_blas, vllm_mlx")
    p.add_argument("--blas-path", default=None)
    p.add_argument("--peer-blas-dtype", choices=["float32", "checkpoint"], default="float32")
    p.add_argument("--mlxd-args", default="", help="extra arguments for `mlxd serve`, quoted")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    common.add_out_arg(p)
    p.set_defaults(func=cmd_coldstart)


def cmd_coldstart(args: argparse.Namespace) -> int:
    from bench.sweep import peer_specs

    out = common.out_dir(args, "coldstart")
    model = str((args.model or common.default_model()).resolve())
    specs, models = peer_specs(args, model)
    prompts = phase_prompts(model, args.prompt_tokens, args.burst, args.seed)
    result: dict[str, Any] = {"model": model, "prompt_tokens": args.prompt_tokens,
                              "burst": args.burst, "machine": common.machine_info(),
                              "servers": {}}
    for spec in specs:
        result["servers"][spec.name] = run_server(spec, models[spec.name], prompts, out,
                                                  args.output_tokens, args.request_timeout)
    path = common.write_json(out / "coldstart.json", "coldstart", result, args)
    plot(result, path.with_suffix(".png"))
    md = table(result)
    (out / "table.md").write_text(md + "\n")
    print(md)
    print(f"\nwrote {path}, {path.with_suffix('.png')}")
    failed = sum(p["failed"] for e in result["servers"].values() for p in e["phases"].values())
    return 1 if failed else 0
