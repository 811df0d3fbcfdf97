"""`python -m bench tp`: one process vs `mlxd serve --tensor-parallel N`, same model, same load.

    python -m bench tp                          # a ~1B float32 random llama (written once)
    python -m bench tp --shape tiny --max-tokens 16 --step-steps 5   # a quick run

Two parts, each written to tp.json (and tp.png):

* served: `mlxd serve` alone and with `--tensor-parallel N` (ring backend on this host unless
  `--backend`), each driven with `c` concurrent greedy requests of `--max-tokens` tokens
  (ignore_eos); decode tok/s = completion tokens / wall time, at each concurrency.
* step: one decode step (one token per row over a 128-token KV) under mlx.launch, timed as
  served and with the all-reduces replaced by the identity (bench/tp_rank.py): the
  communication share of a step is 1 - (time without) / (time with).

The model is a random-weight float32 llama of `--shape` (bench/modelprep.py: llama-3.2-1b is
Llama-3.2-1B's dimensions, ~1.2B parameters with our 8192-token vocabulary), big enough that a
decode step is bound by memory bandwidth on a CPU, or `--model DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.modelprep import CACHE, SHAPES, random_model
from bench.servers import ServerProcess, free_port, mlxd_spec


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("tp", help="one process vs --tensor-parallel N (decode tok/s, the "
                       "communication share of a step)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="a model directory (default: a random float32 model of --shape)")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="ring")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="request rounds per concurrency")
    p.add_argument("--step-steps", type=int, default=20, help="timed decode steps per shape")
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--skip-step", action="store_true")
    common.add_out_arg(p)
    p.set_defaults(func=cmd_tp)


def _model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    out = CACHE / f"random-{args.shape}-f32"
    if not (out / "config.json").exists():
        random_model(args.shape, out, bits=None)
    return out


def _drive(url: str, model_id: str, concurrency: int, max_tokens: int, rounds: int) -> dict:
    """`concurrency` streams of `rounds` greedy requests each: completion tokens per second."""

    def stream(i: int) -> int:
        done = 0
        with httpx.Client(timeout=600) as client:
            for r in range(rounds):
                body = {"model": model_id, "prompt": f"def f{i}_{r}(x):", "temperature": 0,
                        "max_tokens": max_tokens, "ignore_eos": True}
                resp = client.post(f"{url}/v1/completions", json=body)
                resp.raise_for_status()
                done += int(resp.json()["usage"]["completion_tokens"])
        return done

    _ = stream(-1)  # one request first: the shapes of a lone row are built outside the timing
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(stream, range(concurrency)))
    seconds = time.perf_counter() - t0
    return {"concurrency": concurrency, "tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 2)}


def _served(args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: dict[str, Any] = {}
    setups = {"one process": ["--dtype", "float32"],
              f"tensor-parallel {args.ranks}": [
                  "--dtype", "float32", "--tensor-parallel", str(args.ranks), "--backend",
                  args.backend, "--ring-port", str(free_port())]}
    for label, flags in setups.items():
        spec = mlxd_spec(flags, name=label.replace(" ", "-"))
        with ServerProcess(spec, str(model), out) as server:
            assert server.model_id is not None
            rows[label] = [_drive(server.url, server.model_id, c, args.max_tokens, args.rounds)
                           for c in levels]
    return rows


def _step(args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    script = [sys.executable, "-m", "bench.tp_rank", str(model)]
    steps = ["--steps", str(args.step_steps), "--rows", args.concurrency]
    env = dict(os.environ, PYTHONPATH=str(common.REPO))
    one, many = out / "step-1.json", out / f"step-{args.ranks}.json"
    subprocess.run([*script, str(one), *steps], check=True, env=env)
    launch = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import "
              "main; sys.exit(main())", "-n", str(args.ranks), "--backend", args.backend,
              "--starting-port", str(free_port())]
    per_rank = max(1, (os.cpu_count() or 1) // args.ranks)
    env.setdefault("OPENBLAS_NUM_THREADS", str(per_rank))
    subprocess.run([*launch, "--", *script, str(many), *steps], check=True, env=env,
                   stdin=subprocess.DEVNULL)
    return {"one process": json.loads(one.read_text()),
            f"tensor-parallel {args.ranks}": json.loads(many.read_text())}


def cmd_tp(args: argparse.Namespace) -> int:
    out = common.out_dir(args, "tp")
    model = _model(args)
    result: dict[str, Any] = {"machine": common.machine_info(), "model": str(model),
                              "max_tokens": args.max_tokens}
    if not args.skip_served:
        result["served"] = _served(args, model, out)
    if not args.skip_step:
        result["step"] = _step(args, model, out)
    path = common.write_json(out / "tp.json", "tp", result, args)
    _plot(result, out / "tp.png")
    print(_summary(result))
    print(f"wrote {path}")
    return 0


def _summary(result: dict[str, Any]) -> str:
    lines = []
    for label, levels in result.get("served", {}).items():
        lines.append(f"served {label}: " + ", ".join(f"c={r['concurrency']} {r['tok_s']} tok/s"
                                                     for r in levels))
    for label, step in result.get("step", {}).items():
        parts = []
        for rows, entry in step["rows"].items():
            share = entry.get("comm_share")
            parts.append(f"{rows} rows {entry['step_ms']} ms"
                         + (f" (communication {share:.0%})" if share is not None else ""))
        lines.append(f"step {label}: " + ", ".join(parts))
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, levels in result.get("served", {}).items():
        ax.plot([r["concurrency"] for r in levels], [r["tok_s"] for r in levels], "o-",
                label=label)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tok/s")
    ax.set_xscale("log", base=2)
    ax.set_title(Path(result["model"]).name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
