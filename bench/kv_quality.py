"""KV-quantization quality: mean per-token KL divergence of 8- and 4-bit KV vs full-precision KV.

    python -m bench.kv_quality                      # bundled tinycoder-16m, dev set, 8 windows
    python -m bench.kv_quality --windows 24 --window 1024 --group-size 32

Protocol: the code samples of ../shared/data/tinycoder-dev.jsonl are tokenized and joined (EOS
between files); `--windows` evenly spaced windows of `--window` tokens are each prefilled in
chunks of `--chunk` through our one-row layouts (sliding layers: rings; quantized configs
quantize the rings too), once with full-precision KV (the reference) and once per KV
configuration. Every position's next-token distribution is compared:
KL(p_ref || p_quant), averaged over all positions of all windows. Also reported: top-1
agreement and perplexity. Results: JSON (and the console), bench/results/kv_quality.json.
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

from engine.models import make_batch_layouts
from mlxd import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
DEV_DATA = REPO.parent / "shared" / "data" / "tinycoder-dev.jsonl"
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def load_model(path: Path, dtype: str) -> tuple[Any, Any]:
    from mlx_lm.utils import load

    model, tokenizer = load(str(path))
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--data", type=Path, default=DEV_DATA)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--group-size", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kv_quality.json")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.dtype)
    windows = load_windows(args.data, tokenizer, args.window, args.windows)
    configs = [(b, g) for b in args.bits for g in args.group_size]
    results = measure(model, windows, configs, chunk=args.chunk)
    report = {
        "model": str(args.model.name),
        "dtype": args.dtype,
        "data": str(args.data.name),
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['seconds']} s)")
    return report


if __name__ == "__main__":
    main()
