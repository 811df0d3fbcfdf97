"""KV-quantization quality: mean per-token KL divergence of 8- and 4-bit KV vs full-precision KV.

    python -m bench kv quality                      # bundled tinycoder-16m, dev set, 8 windows
    python -m bench kv quality --windows 24 --window 1024 --group-size 32

Protocol: the code samples of ../shared/data/tinycoder-dev.jsonl are tokenized and joined (EOS
between files); `--windows` evenly spaced windows of `--window` tokens are each prefilled in
chunks of `--chunk` through our one-row layouts (sliding layers: rings; quantized configs
quantize the rings too), once with full-precision KV (the reference) and once per KV
configuration. Every position's next-token distribution is compared:
KL(p_ref || p_quant), averaged over all positions of all windows. Also reported: top-1
agreement and perplexity. Writes DIR/kv_quality.json and DIR/kv_quality.png.
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

# isort: split

import argparse
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench import common
from engine.models import make_batch_layouts

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def load_model(path: Path, dtype: str) -> tuple[Any, Any]:
    from mlx_lm.utils import load

    model, tokenizer = load(str(path))[:2]
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    return model, tokenizer


def load_windows(path: Path, tokenizer: Any, window: int, count: int) -> list[list[int]]:
    """`count` evenly spaced windows of `window` tokens over the joined code samples."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: list[int] = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "code" and row.get("text"):
            stream.extend(tokenizer.encode(row["text"]))
            stream.append(eos)
    if len(stream) < window:
        raise ValueError(f"only {len(stream)} tokens in {path}")
    starts = np.linspace(0, len(stream) - window, count).astype(int)
    return [stream[s : s + window] for s in starts]


def window_logprobs(model: Any, tokens: list[int], chunk: int, **layout_kw: Any) -> mx.array:
    """Log-probabilities [T, V] (float32) for every position of `tokens`, prefilled in chunks."""
    cache = make_batch_layouts(model, 1, **layout_kw)
    outs = []
    for s in range(0, len(tokens), chunk):
        logits = model(mx.array([tokens[s : s + chunk]]), cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        outs.append(lp)
    return mx.concatenate(outs, axis=0)


def compare(ref: mx.array, other: mx.array, tokens: list[int]) -> dict[str, float]:
    kl = mx.sum(mx.exp(ref) * (ref - other), axis=-1)  # [T]
    agree = mx.argmax(ref, axis=-1) == mx.argmax(other, axis=-1)
    targets = mx.array(tokens[1:])
    nll = -mx.take_along_axis(other[:-1], targets[:, None], axis=-1)
    return {
        "kl_sum": float(mx.sum(kl)),
        "kl_max": float(mx.max(kl)),
        "agree": float(mx.sum(agree)),
        "nll_sum": float(mx.sum(nll)),
        "num": float(kl.shape[0]),
        "num_nll": float(nll.shape[0]),
    }


def measure(
    model: Any,
    windows: list[list[int]],
    configs: list[tuple[int, int]],
    chunk: int = 256,
) -> dict[str, dict[str, float]]:
    """Per KV config `(bits, group_size)`: mean KL vs full precision, top-1 agreement, ppl."""
    totals: dict[str, dict[str, float]] = {}
    for tokens in windows:
        ref = window_logprobs(model, tokens, chunk)
        runs = {"16": ref}
        for bits, group in configs:
            runs[f"{bits}/g{group}"] = window_logprobs(
                model, tokens, chunk, kv_bits=bits, kv_group_size=group
            )
        for name, lp in runs.items():
            acc = totals.setdefault(name, {})
            for k, v in compare(ref, lp, tokens).items():
                acc[k] = acc.get(k, 0.0) + v
    out = {}
    for name, acc in totals.items():
        out[name] = {
            "mean_kl_nats": acc["kl_sum"] / acc["num"],
            "max_kl_nats": acc["kl_max"],
            "top1_agreement": acc["agree"] / acc["num"],
            "perplexity": float(np.exp(acc["nll_sum"] / acc["num_nll"])),
        }
    return out


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model_dir = args.model or common.default_model()
    out = common.out_dir(args, "kv-quality")
    model, tokenizer = load_model(model_dir, args.dtype)
    windows = load_windows(args.data, tokenizer, args.window, args.windows)
    configs = [(b, g) for b in args.bits for g in args.group_size]
    results = measure(model, windows, configs, chunk=args.chunk)
    report = {
        "model": model_dir.name,
        "dtype": args.dtype,
        "data": args.data.name,
        "windows": args.windows,
        "window": args.window,
        "chunk": args.chunk,
        "reference": "full-precision KV in the compute dtype",
        "results": results,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    for name, r in results.items():
        print(
            f"KV {name:>7}: mean KL {r['mean_kl_nats']:.5f} nats  max {r['max_kl_nats']:.3f}  "
            f"top-1 agree {r['top1_agreement']:.4f}  ppl {r['perplexity']:.3f}"
        )
    path = common.write_json(out / "kv_quality.json", "kv-quality", report, args)
    plot(report, path.with_suffix(".png"))
    print(f"wrote {path} ({report['seconds']} s)")
    return 0


def plot(report: dict[str, Any], path: Path) -> None:
    """Mean KL to full-precision KV and top-1 agreement, per KV config."""
    plt = common.pyplot()
    names = [n for n in report["results"] if n != "16"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.bar(names, [report["results"][n]["mean_kl_nats"] for n in names])
    ax1.set_yscale("log")
    ax1.set_ylabel("mean KL to 16-bit KV (nats/token)")
    ax2.bar(names, [report["results"][n]["top1_agreement"] for n in names])
    ax2.set_ylim(0.9, 1.0)
    ax2.set_ylabel("top-1 agreement with 16-bit KV")
    fig.suptitle(f"{report['model']} {report['dtype']}: quantized KV over {report['windows']} x "
                 f"{report['window']} dev tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
