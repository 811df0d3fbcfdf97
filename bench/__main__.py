"""`python -m bench` (also `mlxd bench`): benchmark mlxd against the servers users would pick.

    python -m bench serve-sweep [--peers mlx_lm,mlx_lm_blas] [--concurrency 1,4,16,64] ...
    python -m bench load --url http://127.0.0.1:8080 [--concurrency 1,4] ...   # a running server
    python -m bench plot bench/results/NAME/results.json

Results go to bench/results/<name>/: results.json (summaries, ratios, machine, config),
records.json (every request's timings), sweep.png, and table.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: bundled tinycoder-16m)")
    p.add_argument("--concurrency", type=_levels, default=[1, 4, 16, 64])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--requests-per-level", default=None,
                   help="requests at each level: N, or a list matching --concurrency "
                        "(default: 2 x concurrency, at least 8)")
    p.add_argument("--level-deadline", type=float, default=900.0,
                   help="seconds after which a level sends no new request (bounded runs)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--eos-bias", action="store_true",
                   help="for servers without ignore_eos, send logit_bias -100 on the EOS ids "
                        "(fixes output length but costs mlx_lm.server a per-row Python loop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="results folder name under bench/results/")
    p.add_argument("--out", default=None, help="results folder (overrides --name)")


def _out_dir(args: argparse.Namespace, default: str) -> tuple[str, Path]:
    if args.out:
        out = Path(args.out)
        return out.name, out
    name = args.name or f"{default}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    return name, RESULTS / name


def _model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return str(Path(args.model).resolve())
    from mlxd import DEFAULT_MODEL_DIR

    return str(DEFAULT_MODEL_DIR)


def _prompts(args: argparse.Namespace, model: str) -> list[str]:
    from bench.sweep import requests_for
    from bench.workload import make_prompts

    total = sum(requests_for(c, args.requests_per_level, args.concurrency)
                for c in args.concurrency)
    # the first 4 warm the servers up; they are never measured (a prefix cache would hit them)
    return [p.text for p in make_prompts(model, total + 4, args.prompt_tokens, seed=args.seed)]


def _split(prompts: list[str]) -> tuple[list[str], list[str]]:
    return prompts[:4], prompts[4:]


def cmd_serve_sweep(args: argparse.Namespace) -> int:
    from bench import servers as S
    from bench.plot import plot_sweep
    from bench.sweep import run_sweep, table
    from bench.workload import eos_token_ids

    model = _model_dir(args)
    name, out = _out_dir(args, "serve-sweep")
    mlxd_extra = args.mlxd_args.split() if args.mlxd_args else []
    specs = [S.mlxd_spec(mlxd_extra)]
    models = {"mlxd": model}
    for peer in [p for p in args.peers.split(",") if p]:
        if peer == "mlx_lm":
            specs.append(S.mlx_lm_spec())
            models["mlx_lm"] = model
        elif peer == "mlx_lm_blas":
            spec = S.mlx_lm_spec(preload_blas=args.blas_path, name="mlx_lm_blas")
            if args.peer_blas_dtype == "float32":
                from bench.modelprep import float32_copy

                models["mlx_lm_blas"] = str(float32_copy(model))
                spec.note += ", float32 copy of the weights (the dtype mlxd computes in on a CPU)"
                spec.label = "mlx_lm+OpenBLAS f32"
            else:
                models["mlx_lm_blas"] = model
                spec.label = "mlx_lm+OpenBLAS"
            specs.append(spec)
        elif peer == "vllm_mlx":
            if not S.vllm_mlx_available():
                print("vllm-mlx is not installed: skipping it", file=sys.stderr)
                continue
            specs.append(S.vllm_mlx_spec())
            models["vllm_mlx"] = model
        else:
            print(f"unknown peer {peer!r} (known: mlx_lm, mlx_lm_blas, vllm_mlx)", file=sys.stderr)
            return 2
    if args.peer_blas and not any(s.name == "mlx_lm_blas" for s in specs):
        args.peers += ",mlx_lm_blas"
        return cmd_serve_sweep(args)
    print(f"preparing {args.prompt_tokens}-token prompts from {model} ...")
    warmup, prompts = _split(_prompts(args, model))
    eos = {str(i): -100.0 for i in eos_token_ids(model)} if args.eos_bias else None
    result = run_sweep(
        specs, models, prompts, warmup, args.concurrency, out, name=name,
        output_tokens=args.output_tokens, prompt_tokens=args.prompt_tokens,
        per_level=args.requests_per_level, level_deadline_s=args.level_deadline,
        request_timeout_s=args.request_timeout, eos_bias=eos,
        config_extra={"model": model, "model_name": Path(model).name, "seed": args.seed,
                      "requests_per_level": args.requests_per_level or "2 x concurrency, min 8",
                      "eos_bias": bool(eos),
                      "command": "python -m bench " + " ".join(sys.argv[1:] if args.argv is None
                                                               else args.argv)},
    )
    md = table(result)
    (out / "table.md").write_text(md + "\n")
    png = plot_sweep(result, out / "sweep.png")
    print(md)
    print(f"\nwrote {out / 'results.json'}, {png}")
    failed = sum(lvl["results"][specs[0].name]["num_failed"] for lvl in result["levels"])
    return 1 if failed else 0


def cmd_load(args: argparse.Namespace) -> int:
    """Drive one running server (no start/stop) and print a summary per level."""
    import httpx

    from bench.loadgen import LoadSpec, run_level
    from bench.metrics import summarize

    model = _model_dir(args)
    _, prompts = _split(_prompts(args, model))
    model_id = args.model_id
    if model_id is None:
        data = httpx.get(args.url.rstrip("/") + "/v1/models", timeout=10).json().get("data") or []
        model_id = data[0]["id"] if data else "default"
    offset, report = 0, []
    from bench.sweep import requests_for

    for c in args.concurrency:
        n = requests_for(c, args.requests_per_level, args.concurrency)
        spec = LoadSpec(args.url.rstrip("/"), model_id, prompts[offset:offset + n], c,
                        args.output_tokens, endpoint=args.endpoint, ignore_eos=True,
                        request_timeout_s=args.request_timeout, deadline_s=args.level_deadline)
        offset += n
        records, wall = asyncio.run(run_level(spec))
        s = summarize(records, wall)
        report.append({"concurrency": c, **s})
        print(f"c={c:<3} {s['output_tok_s']:8.1f} tok/s  TTFT p50 {s['ttft_s']['p50']}  "
              f"p99 {s['ttft_s']['p99']}  ITL p50 {s['itl_s']['p50']}  failed {s['num_failed']}")
    if args.out or args.name:
        _, out = _out_dir(args, "load")
        out.mkdir(parents=True, exist_ok=True)
        (out / "load.json").write_text(json.dumps(report, indent=1))
    return 1 if any(r["num_failed"] for r in report) else 0


def cmd_plot(args: argparse.Namespace) -> int:
    from bench.plot import plot_sweep
    from bench.sweep import enrich, table

    path = Path(args.results)
    result = enrich(json.loads(path.read_text()))
    path.write_text(json.dumps(result, indent=1))
    png = plot_sweep(result, path.with_name("sweep.png"))
    (path.with_name("table.md")).write_text(table(result) + "\n")
    print(table(result))
    print(f"wrote {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve-sweep", help="start mlxd and peers, run the concurrency sweep")
    _add_workload_args(p)
    p.add_argument("--peers", default="mlx_lm",
                   help="comma list of mlx_lm, mlx_lm_blas, vllm_mlx (skipped when not installed)")
    p.add_argument("--peer-blas", action="store_true",
                   help="also run mlx_lm.server with OpenBLAS loaded first (peer mlx_lm_blas)")
    p.add_argument("--blas-path", default="/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
    p.add_argument("--peer-blas-dtype", choices=["float32", "checkpoint"], default="float32",
                   help="weights for mlx_lm_blas: a float32 copy (as mlxd computes on a CPU; "
                        "bfloat16 matmuls do not use BLAS) or the checkpoint as is")
    p.add_argument("--mlxd-args", default="", help="extra arguments for `mlxd serve`, quoted")
    p.set_defaults(func=cmd_serve_sweep)
    p = sub.add_parser("load", help="drive an already running server")
    _add_workload_args(p)
    p.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8080 (loopback only)")
    p.add_argument("--model-id", default=None, help="the request's model field")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.set_defaults(func=cmd_load)
    from bench import models

    models.add_parser(sub)
    p = sub.add_parser("plot", help="redraw sweep.png and table.md from a results.json")
    p.add_argument("results")
    p.set_defaults(func=cmd_plot)
    args = parser.parse_args(argv)
    args.argv = argv
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
