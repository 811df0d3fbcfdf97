"""`embed`: /v1/embeddings throughput, one request of B inputs at a time.

    python -m bench embed [--model DIR] [--batches 1,64] [--tokens 128] [--repeats 3]

mlxd is started once (`--mlxd-args` passed on) and warmed up with one request of each batch
size; then, for each batch size B, `--repeats` requests of B fresh inputs of `--tokens` tokens
each (exact counts, bench/workload.py; never sent twice, so no prefix-cache help) are sent one
after another. Per batch size the JSON has each request's latency, the fastest, and inputs/s and
tokens/s of the fastest. Embeddings run on the engine thread between decode steps, so this
measures an idle server: under decode load they share its steps.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.servers import ServerProcess, mlxd_spec


def batch_prompts(model: str, batches: list[int], tokens: int, repeats: int,
                  seed: int) -> dict[int, list[list[str]]]:
    """Per batch size, `repeats` lists of that many fresh texts of `tokens` tokens, plus one
    more list first for the warm-up (a pure function of the seed)."""
    from bench.workload import prompts_of_lengths

    total = sum(b * (repeats + 1) for b in batches)
    texts = iter(p.text for p in prompts_of_lengths(model, [tokens] * total, seed))
    return {b: [[next(texts) for _ in range(b)] for _ in range(repeats + 1)] for b in batches}


def post(client: httpx.Client, url: str, model_id: str, texts: list[str]) -> tuple[float, int]:
    """(seconds, prompt tokens) of one request; raises on an error response."""
    t = time.perf_counter()
    r = client.post(f"{url}/v1/embeddings", json={"model": model_id, "input": texts})
    seconds = time.perf_counter() - t
    r.raise_for_status()
    body = r.json()
    assert len(body["data"]) == len(texts), "one vector per input"
    return seconds, int(body["usage"]["prompt_tokens"])


def run(srv: ServerProcess, model: str, batches: list[int], tokens: int, repeats: int,
        seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prompts = batch_prompts(model, batches, tokens, repeats, seed)
    with httpx.Client(timeout=600.0) as client:
        model_id = srv.model_id or "default"
        for b in batches:  # warm-up: each batch shape once, never measured
            post(client, srv.url, model_id, prompts[b][0])
        for b in batches:
            runs = [post(client, srv.url, model_id, texts) for texts in prompts[b][1:]]
            best, ntok = min(runs)
            out[str(b)] = {"seconds": [s for s, _ in runs], "prompt_tokens": ntok,
                           "best_s": best, "inputs_per_s": b / best, "tokens_per_s": ntok / best}
            print(f"  batch {b:4d}: {b / best:8.1f} inputs/s, {ntok / best:9.0f} tokens/s "
                  f"(fastest of {repeats}: {best * 1e3:.0f} ms)", flush=True)
    return out


def plot(result: dict[str, Any], png: Path) -> Path:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    sizes = list(result["batches"])
    ax.bar(sizes, [result["batches"][b]["inputs_per_s"] for b in sizes])
    ax.set_xlabel("inputs per request")
    ax.set_ylabel("inputs / s")
    ax.set_title(f"/v1/embeddings, {result['tokens']}-token inputs")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("embed", help="/v1/embeddings throughput at each batch size",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the bundled tinycoder-16m)")
    p.add_argument("--batches", default="1,64", help="inputs per request, comma list")
    p.add_argument("--tokens", type=int, default=128, help="tokens per input")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlxd-args", default="", help="extra arguments for `mlxd serve`, quoted")
    common.add_out_arg(p)
    p.set_defaults(func=cmd_embed)


def cmd_embed(args: argparse.Namespace) -> int:
    out = common.out_dir(args, "embed")
    model = str((args.model or common.default_model()).resolve())
    batches = [int(b) for b in args.batches.split(",") if b]
    print("starting mlxd ...", flush=True)
    with ServerProcess(mlxd_spec(args.mlxd_args.split()), model, out / "logs") as srv:
        result: dict[str, Any] = {"model": model, "tokens": args.tokens,
                                  "machine": common.machine_info(),
                                  "batches": run(srv, model, batches, args.tokens, args.repeats,
                                                 args.seed)}
    path = common.write_json(out / "embed.json", "embed", result, args)
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}, {path.with_suffix('.png')}")
    return 0
