"""Perplexity of tinycoder-16m under weight quantization: bf16, MLX affine 4/3-bit g64, trellis.

    python -m bench trellis quality [--L 12] [--bits 4 3 2] [--modes seq ldlq plain]
                                    [--finetune-steps 300] [--out DIR]

Data split (documented in docs/trellis.md): records of tinycoder-dev.jsonl at odd positions form
the evaluation stream; ``--windows`` windows of ``--length`` tokens at evenly spaced starts are
scored for every variant (the same windows). The calibration data are the records at even
positions minus any that shares a 128-character substring with an evaluation record (the file
repeats some records and licence headers). Modes: "seq" is sequential BlockLDLQ (each layer's
Hessian from the already-quantized earlier layers), "ldlq" BlockLDLQ with Hessians from the float
model, "plain" no calibration; "seq" also tunes inside each block while it quantizes it
(``--block-tune-steps``, default 16, kernels/trellis/blocktune.py; "+bt16" in the row names;
``--block-tune-target``, default "float": towards the float model's hidden states, "+bt16-float";
"own": towards each block's own float output, "+bt16").
With ``--finetune-steps`` > 0 each trellis variant is scored before and after fine-tuning (kernels/trellis/finetune.py: row gains, real-valued signs and norms,
distilled from the float model on the calibration text). Affine and trellis quantize the same
layers (every Linear; tinycoder ties its embedding, which stays bf16 in both). The affine
baselines are MLX's own quantize + dequantize at group 64 (the same numbers as its
quantized_matmul, run as a dense float32 matmul, which is fast on a CPU). Activations are float32
for every variant, so only the weights differ. Writes JSON (after every variant) and a PNG.

Comparing fine-tuning settings: ``--cache DIR`` saves each quantized model (before fine-tuning)
and reuses it in later runs with the same bits, L, mode and calibration; ``--append --skip-affine
--skip-unfinetuned --label TEXT`` then adds only the fine-tuned rows. ``--finetune-holdout N``
keeps N windows at the end of the calibration text out of the fine-tuning windows and logs their
KL to the float model (overfitting); ``--eval-kl`` adds the KL on the evaluation windows.
"""

from __future__ import annotations

import engine  # noqa: F401  (BLAS before mlx)

# isort: split

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model, load_tokenizer

from bench import common
from kernels import trellis as tr
from kernels.trellis.blocktune import BlockTune
from kernels.trellis.calibration import (
    collect_hessians,
    disjoint_records,
    even_windows,
    read_records,
    token_stream,
)
from kernels.trellis.finetune import finetune, teacher_for, teacher_logprobs
from kernels.trellis.linear import quantizable_linears


def perplexity(model: nn.Module, windows: mx.array) -> float:
    total, count = 0.0, 0
    for i in range(windows.shape[0]):
        w = windows[i : i + 1]
        logits = model(w[:, :-1]).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, w[:, 1:], reduction="sum")
        total += float(nll)
        count += w.shape[1] - 1
    return math.exp(total / count)


def perplexity_kl(model: nn.Module, windows: mx.array, teacher_lp: list[mx.array]) -> tuple[float, float]:
    """Perplexity and the mean KL(float model || model) per token over the same windows."""
    total, count, kl = 0.0, 0, 0.0
    for i in range(windows.shape[0]):
        w = windows[i : i + 1]
        logits = model(w[:, :-1]).astype(mx.float32)
        total += float(nn.losses.cross_entropy(logits, w[:, 1:], reduction="sum"))
        count += w.shape[1] - 1
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p = teacher_lp[i].astype(mx.float32)
        kl += float(mx.sum(mx.exp(p) * (p - logq)))
    return math.exp(total / count), kl / count


def float32_model(path: Path) -> nn.Module:
    model, _ = load_model(path)
    model.set_dtype(mx.float32)  # bf16 weight values, float32 activations
    return model


def affine_model(path: Path, bits: int, group: int = 64) -> nn.Module:
    """Every Linear's weight replaced by MLX's affine quantize -> dequantize of it (float32)."""
    model = float32_model(path)
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear):
            w, scales, biases = mx.quantize(m.weight, group_size=group, bits=bits)
            m.weight = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
    mx.eval(model.parameters())
    return model


def affine_bits_per_weight(bits: int, group: int) -> float:
    return bits + 32 / group  # fp16 scale + fp16 bias per group


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        args.model = common.default_model()
    out_json = common.out_dir(args, "trellis-quality") / "trellis_quality.json"

    tokenizer = load_tokenizer(args.model)
    records = read_records(args.data)
    eval_windows = even_windows(token_stream(tokenizer, records[1::2]), args.windows, args.length + 1)
    eval_records = records[1::2]
    calib_records = disjoint_records(records[0::2], eval_records)
    calib_stream = token_stream(tokenizer, calib_records)
    calib_windows = even_windows(calib_stream, args.calib_windows, args.calib_length)
    held_tokens = args.finetune_holdout * args.finetune_length
    ft_stream = calib_stream[: len(calib_stream) - held_tokens]
    ft_windows = even_windows(ft_stream, args.finetune_windows, args.finetune_length)
    held_windows = None
    if args.finetune_holdout > 0:
        held_windows = even_windows(calib_stream[len(ft_stream) :], args.finetune_holdout, args.finetune_length)

    result = {
        "model": args.model.name,
        "data": args.data.name,
        "eval": {"records": "odd positions", "windows": args.windows, "tokens_per_window": args.length},
        "calibration": {
            "records": "even positions sharing no 128-char substring with an eval record",
            "num_records": len(calib_records),
            "tokens": len(calib_stream),
            "windows": args.calib_windows,
            "length": args.calib_length,
        },
        "finetune": {
            "steps": args.finetune_steps,
            "windows": args.finetune_windows,
            "length": args.finetune_length,
            "batch": args.finetune_batch,
            "lr": args.finetune_lr,
            "holdout_windows": args.finetune_holdout,
            "trains": "row gains, real-valued signs, norm weights; KL to the float model",
        },
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "activations": "float32",
        "variants": [],
    }
    if args.append and out_json.exists():
        result["variants"] = json.loads(out_json.read_text())["variants"]

    def record(name: str, kind: str, bpw: float, ppl: float, **extra) -> None:
        row = {"name": name, "kind": kind, "bits_per_weight": round(bpw, 3), "perplexity": round(ppl, 4), **extra}
        result["variants"].append(row)
        print(json.dumps(row), flush=True)
        common.write_json(out_json, "trellis-quality", result, args)
        plot(result, out_json.with_suffix(".png"))  # after every row too: a cut-short run keeps both

    t0 = time.perf_counter()
    base = float32_model(args.model)
    if not args.append:
        record("bf16", "float", 16.0, perplexity(base, eval_windows), seconds=round(time.perf_counter() - t0, 1))

    for bits in () if args.skip_affine else (4, 3):
        t0 = time.perf_counter()
        model = affine_model(args.model, bits)
        record(
            f"affine {bits}-bit g64",
            "affine",
            affine_bits_per_weight(bits, 64),
            perplexity(model, eval_windows),
            seconds=round(time.perf_counter() - t0, 1),
        )

    eval_lp = None
    if args.eval_kl:
        eval_lp = [teacher_logprobs(base, eval_windows[i : i + 1, :-1], dtype=mx.float16) for i in range(args.windows)]

    def score(model: nn.Module) -> tuple[float, dict]:
        if eval_lp is None:
            return perplexity(model, eval_windows), {}
        ppl, kl = perplexity_kl(model, eval_windows, eval_lp)
        return ppl, {"eval_kl": round(kl, 5)}

    teacher = holdout = None
    if args.finetune_steps > 0 and args.bits:
        # float16 log-probs if they fit in 1 GiB and are reused, else the float model on each batch
        teacher = teacher_for(base, ft_windows, args.finetune_steps, args.finetune_batch)
        if held_windows is not None:
            holdout = (held_windows, teacher_logprobs(base, held_windows, dtype=mx.float16))
    hessians = None
    if "ldlq" in args.modes:
        t0 = time.perf_counter()
        spec = tr.TrellisSpec(bits=4, L=args.L[0])
        paths = [p for p, _ in quantizable_linears(base, spec)]
        hessians = collect_hessians(base, calib_windows, paths)
        mx.eval(hessians)
        result["calibration"]["seconds"] = round(time.perf_counter() - t0, 1)
    if teacher is not base:
        del base

    for mode in args.modes:
        for L in args.L:
            for bits in args.bits:
                # the stored bf16 weight values, in float32 (MLX's CPU matmuls are fast there)
                bt = None
                if mode == "seq" and args.block_tune_steps > 0:
                    bt = BlockTune(args.block_tune_steps, args.block_tune_lr, target=args.block_tune_target)
                bt_tag = "" if bt is None or bt.target == "own" else f"-{bt.target}"  # "own" keys as before
                bt_key = f"-bt{bt.steps}x{bt.lr:g}{bt_tag}" if bt is not None else ""
                key = f"k{bits}-L{L}-{mode}{bt_key}-c{args.calib_windows}x{args.calib_length}-{args.data.stem}"
                cached = args.cache / key if args.cache is not None else None
                if cached is not None and (cached / "config.json").exists():
                    model, qconfig = tr.load_model(cached)
                    model.set_dtype(mx.float32)  # as float32_model; the row scales stay float16, as quantized
                    for _, layer in tr.trellis_layers(model):
                        layer.scales = layer.scales.astype(mx.float16)
                        if layer.signs.dtype != mx.int8:  # tuned in-block: stored float16
                            layer.signs = layer.signs.astype(mx.float16)
                    seconds = qconfig["quantization"]["quantize_seconds"]
                    print(f"reusing {cached}", flush=True)
                else:
                    model, config = load_model(args.model)
                    model.set_dtype(mx.float32)
                    t0 = time.perf_counter()
                    qconfig = tr.quantize_model(
                        model,
                        bits,
                        L,
                        hessians=hessians if mode == "ldlq" else None,
                        calibration=calib_windows if mode == "seq" else None,
                        block_tune=bt,
                        on_tune=lambda b, g, st: print(
                            f"  tune {g[-1]}: rel err {st['err_before']:.5f} -> {st['err_after']:.5f} ({st['seconds']:.1f} s)",
                            flush=True,
                        ),
                    )
                    mx.eval(model.parameters())
                    seconds = time.perf_counter() - t0
                    if cached is not None:
                        tr.save_model(model, {**config, "quantization": {**qconfig, "quantize_seconds": round(seconds, 1)}}, cached, args.model)
                num = sum(m.input_dims * m.output_dims for _, m in tr.trellis_layers(model))
                name = f"trellis {bits}-bit L={L} {mode}" + (f" +bt{bt.steps}{bt_tag}" if bt is not None else "")
                bt_extra = {"block_tune_target": bt.target} if bt is not None else {}
                if not args.skip_unfinetuned:
                    ppl, extra = score(model)
                    record(
                        name,
                        "trellis",
                        tr.bits_per_weight(model),
                        ppl,
                        **extra,
                        bits=bits,
                        L=L,
                        mode=mode,
                        **bt_extra,
                        quantize_seconds=round(seconds, 1),
                        weights_per_second=round(num / seconds),
                    )
                if teacher is None:
                    continue
                ft = finetune(
                    model,
                    teacher,
                    ft_windows,
                    steps=args.finetune_steps,
                    batch=args.finetune_batch,
                    lr=args.finetune_lr,
                    holdout=holdout,
                    holdout_every=args.holdout_every,
                    progress=lambda i, loss: print(f"  step {i} kl {loss:.4f}", flush=True) if i % 25 == 0 else None,
                )
                ppl, extra = score(model)
                record(
                    name + " +ft" + (f" {args.label}" if args.label else ""),
                    "trellis",
                    tr.bits_per_weight(model),
                    ppl,
                    **extra,
                    bits=bits,
                    L=L,
                    mode=mode + "+ft",
                    **bt_extra,
                    quantize_seconds=round(seconds, 1),
                    finetune_seconds=round(ft.seconds, 1),
                    finetune_kl_first=round(ft.loss_first, 5),
                    finetune_kl_last=round(ft.loss_last, 5),
                    finetune_trainable=ft.trainable,
                    finetune_steps=args.finetune_steps,
                    finetune_windows=args.finetune_windows,
                    finetune_length=args.finetune_length,
                    finetune_batch=args.finetune_batch,
                    finetune_lr=args.finetune_lr,
                    finetune_holdout_kl=[[i, round(k, 5)] for i, k in ft.holdout_kl],
                )
    for d in args.dirs:
        model, config = tr.load_model(d)
        q = config["quantization"]
        mode = ("seq" if q.get("sequential") else "ldlq") if q.get("ldlq") else "plain"
        if q.get("finetune"):
            mode += "+ft"
        bpw = tr.bits_per_weight(model)  # before the cast: scales are stored as float16
        model.set_dtype(mx.float32)
        record(
            f"trellis {q['bits']}-bit L={q['L']} {mode} ({d.name})",
            "trellis",
            bpw,
            perplexity(model, eval_windows),
            bits=q["bits"],
            L=q["L"],
            mode=mode,
            quantize_seconds=q.get("seconds"),
        )
    plot(result, out_json.with_suffix(".png"))
    print(f"wrote {out_json}")
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()

    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = {"float": ("k", "*"), "affine": ("#1f77b4", "s"), "trellis": ("#d62728", "o")}
    for row in result["variants"]:
        color, marker = styles[row["kind"]]
        if row["kind"] == "trellis" and not str(row.get("mode", "")).endswith("+ft"):
            color = "#ff9896"  # before fine-tuning (or none)
        ax.scatter(row["bits_per_weight"], row["perplexity"], c=color, marker=marker, s=50)
        ax.annotate(row["name"], (row["bits_per_weight"], row["perplexity"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("stored bits per quantized weight (scales included)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(f"{result['model']}: perplexity on {result['eval']['windows']} x {result['eval']['tokens_per_window']} dev tokens ({result['device']})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
