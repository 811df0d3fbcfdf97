"""`wide-twin`: a wider, deeper llama checkpoint that computes the same logits as its source.

    python -m bench wide-twin SRC DST --hidden 4608 --layers 32 --intermediate 14336 \\
        --heads 48 --kv-heads 16 --bits 4

A benchmark target of a big model's cost whose function is a small trained model's, so that
speculation's acceptance rates, EOS behaviour and n-gram hit rates are those of a trained model
while every step reads as many weight bytes as the big one. From SRC (a llama-architecture
checkpoint, e.g. the bundled tinycoder-16m: hidden 384, 8 layers, 6 q / 2 kv heads of 64,
intermediate 1,024, tied embeddings, sliding and full layers):

- the residual stream's new dimensions stay exactly zero: the embedding (and the tied head) gets
  zero columns, every weight that writes into the residual (o_proj, down_proj) zero rows;
- each RMSNorm over H dimensions sees the old vector padded with zeros, so its weight is scaled
  by sqrt(h/H) and its epsilon by h/H (h: the source's hidden size): it returns what it did;
- attention keeps head_dim (RoPE depends on it) and adds heads; source q head i of kv group g
  sits at g * (Q/K) + i, source kv head g at g, so every source q head still reads its own kv
  head. New kv heads' v_proj is zero; new q heads that share a source kv head get zero o_proj
  columns (they would read its values); every other new weight is random;
- new MLP units' down_proj columns are zero (gate and up rows random);
- new layers (L above the source's) come after the source's, `--new-layer-type` (full attention
  by default), with zero o_proj and down_proj: the residual passes through them unchanged, their
  KV cache is real;
- `--bits 4|8` quantizes the result (affine, group 64, as mlx-lm does); every block of new
  dimensions is a whole number of groups, so a zero stays exactly zero and only the source's
  own weights change by quantization. `--bits 16` keeps `--dtype` (bfloat16 or float32).

Tokenizer files and generation config are copied from SRC. `--check` then scores the twin
against its source on windows of the dev set's code (both in float32, a quantized twin
dequantized, through mlxd's own KV layouts): perplexity of each, top-1 agreement and the largest
log-probability difference, printed and written to `--out DIR`/wide_twin.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import common

if TYPE_CHECKING:
    import mlx.core as mx

GROUP = 64  # affine quantization group (and the alignment new blocks keep)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(slots=True, frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> Shape:
        heads = int(cfg["num_attention_heads"])
        return cls(int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                   int(cfg["intermediate_size"]), heads,
                   int(cfg.get("num_key_value_heads") or heads),
                   int(cfg.get("head_dim") or cfg["hidden_size"] // heads))

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def check_shapes(src: Shape, dst: Shape) -> None:
    """Refuse a target the construction cannot keep exact (with the reason)."""
    problems = []
    for name in ("hidden", "layers", "intermediate", "heads", "kv_heads"):
        if getattr(dst, name) < getattr(src, name):
            problems.append(f"--{name.replace('_', '-')} {getattr(dst, name)} is below the "
                            f"source's {getattr(src, name)}")
    if dst.heads % dst.kv_heads:
        problems.append(f"--heads {dst.heads} is not a multiple of --kv-heads {dst.kv_heads}")
    elif dst.group < src.group:
        problems.append(f"q heads per kv head {dst.group} < the source's {src.group}: the "
                        "source's GQA grouping cannot be kept")
    for name in ("hidden", "intermediate"):
        if getattr(dst, name) % GROUP or getattr(src, name) % GROUP:
            problems.append(f"--{name} must be a multiple of {GROUP} (as the source's is)")
    if problems:
        raise SystemExit("wide-twin: " + "; ".join(problems))


def q_positions(src: Shape, dst: Shape) -> list[int]:
    """New index of each source q head: same kv group, same place within it."""
    return [(h // src.group) * dst.group + h % src.group for h in range(src.heads)]


class Builder:
    """Writes the wide weights one tensor at a time (random fill from one seeded key)."""

    def __init__(self, src: Shape, dst: Shape, dtype: mx.Dtype, std: float, seed: int):
        import mlx.core as mx

        self.src, self.dst, self.dtype, self.std = src, dst, dtype, std
        self.key = mx.random.key(seed)
        self.norm_scale = math.sqrt(src.hidden / dst.hidden)

    def random(self, shape: tuple[int, ...]) -> mx.array:
        import mlx.core as mx

        self.key, sub = mx.random.split(self.key)
        return (mx.random.normal(shape, key=sub) * self.std).astype(self.dtype)

    def padded(self, w: mx.array | None, shape: tuple[int, int], rows: list[int] | None = None,
               zero_rows: list[int] | None = None, zero_cols: list[int] | None = None,
               zero_new_rows: bool = False, zero_new_cols: bool = False) -> mx.array:
        """A random [out, in] matrix with the source's `w` in its top-left corner (its rows at
        `rows` when given), and the named rows/columns zero. `zero_new_rows` / `_cols`: every
        row / column past the source's."""
        import numpy as np

        out = np.array(self.random(shape).astype(_f32()))
        if w is not None:
            src = np.array(w.astype(_f32()))
            idx = rows if rows is not None else list(range(src.shape[0]))
            out[idx, : src.shape[1]] = src
            if zero_new_rows:
                keep = np.zeros(shape[0], bool)
                keep[idx] = True
                out[~keep] = 0.0
            if zero_new_cols:
                out[:, src.shape[1]:] = 0.0
        for r in zero_rows or []:
            out[r] = 0.0
        for c in zero_cols or []:
            out[:, c] = 0.0
        return _array(out, self.dtype)

    def norm(self, w: mx.array | None) -> mx.array:
        import mlx.core as mx

        full = mx.full((self.dst.hidden,), self.norm_scale, dtype=mx.float32)
        if w is not None:
            full[: self.src.hidden] = w.astype(mx.float32) * self.norm_scale
        return full.astype(self.dtype)

    def layer(self, src_w: dict[str, mx.array] | None) -> dict[str, mx.array]:
        """One decoder layer's weights (`src_w`: the source layer's, by short name; None: a new
        layer, which passes the residual through)."""
        if src_w is None:
            return self._new_layer()
        s, d, hd = self.src, self.dst, self.dst.head_dim
        q_rows = _head_rows(q_positions(s, d), hd)
        kv_rows = _head_rows(list(range(s.kv_heads)), hd)
        new_v = _head_rows(list(range(s.kv_heads, d.kv_heads)), hd)
        return {
            "input_layernorm.weight": self.norm(src_w["input_layernorm.weight"]),
            "post_attention_layernorm.weight": self.norm(src_w["post_attention_layernorm.weight"]),
            "self_attn.q_proj.weight": self.padded(src_w["self_attn.q_proj.weight"],
                                                   (d.heads * hd, d.hidden), q_rows),
            "self_attn.k_proj.weight": self.padded(src_w["self_attn.k_proj.weight"],
                                                   (d.kv_heads * hd, d.hidden), kv_rows),
            "self_attn.v_proj.weight": self.padded(src_w["self_attn.v_proj.weight"],
                                                   (d.kv_heads * hd, d.hidden), kv_rows,
                                                   zero_rows=new_v),
            "self_attn.o_proj.weight": self._o_proj(src_w["self_attn.o_proj.weight"], q_rows),
            "mlp.gate_proj.weight": self.padded(src_w["mlp.gate_proj.weight"],
                                                (d.intermediate, d.hidden)),
            "mlp.up_proj.weight": self.padded(src_w["mlp.up_proj.weight"],
                                              (d.intermediate, d.hidden)),
            "mlp.down_proj.weight": self.padded(src_w["mlp.down_proj.weight"],
                                                (d.hidden, d.intermediate),
                                                zero_new_rows=True, zero_new_cols=True),
        }

    def _new_layer(self) -> dict[str, mx.array]:
        import mlx.core as mx

        d, hd = self.dst, self.dst.head_dim
        return {
            "input_layernorm.weight": self.norm(None),
            "post_attention_layernorm.weight": self.norm(None),
            "self_attn.q_proj.weight": self.random((d.heads * hd, d.hidden)),
            "self_attn.k_proj.weight": self.random((d.kv_heads * hd, d.hidden)),
            "self_attn.v_proj.weight": self.random((d.kv_heads * hd, d.hidden)),
            "self_attn.o_proj.weight": mx.zeros((d.hidden, d.heads * hd), self.dtype),
            "mlp.gate_proj.weight": self.random((d.intermediate, d.hidden)),
            "mlp.up_proj.weight": self.random((d.intermediate, d.hidden)),
            "mlp.down_proj.weight": mx.zeros((d.hidden, d.intermediate), self.dtype),
        }

    def _o_proj(self, o_src: mx.array, q_cols: list[int]) -> mx.array:
        """o_proj [hidden, heads*hd]: the source's columns at its heads' new places, zero rows
        for the new residual dimensions, zero columns for new q heads that share a source kv
        head (they read its values); new heads of new kv groups read zero values: random."""
        import numpy as np

        s, d = self.src, self.dst
        out = np.array(self.random((d.hidden, d.heads * d.head_dim)).astype(_f32()))
        out[s.hidden:] = 0.0
        out[: s.hidden, q_cols] = np.array(o_src.astype(_f32()))
        src_q = set(q_positions(s, d))
        shared = [p for p in range(d.heads) if p // d.group < s.kv_heads and p not in src_q]
        out[:, _head_rows(shared, d.head_dim)] = 0.0
        return _array(out, self.dtype)


def _f32() -> Any:
    import mlx.core as mx

    return mx.float32


def _array(a: Any, dtype: mx.Dtype) -> mx.array:
    import mlx.core as mx

    return mx.array(a).astype(dtype)


def _head_rows(heads: list[int], head_dim: int) -> list[int]:
    return [h * head_dim + j for h in heads for j in range(head_dim)]


def load_weights(src: Path) -> dict[str, mx.array]:
    import mlx.core as mx

    weights: dict[str, mx.array] = {}
    for f in sorted(src.glob("*.safetensors")):
        loaded = mx.load(str(f))
        assert isinstance(loaded, dict)
        weights.update(loaded)
    if not weights:
        raise SystemExit(f"wide-twin: no *.safetensors in {src}")
    if any(k.endswith(".scales") for k in weights):
        raise SystemExit(f"wide-twin: {src} is quantized; start from a float checkpoint")
    if any(k.endswith(".bias") for k in weights):
        raise SystemExit(f"wide-twin: {src} has bias terms (attention_bias / mlp_bias), which "
                         "this construction does not carry over")
    return weights


def twin_config(cfg: dict[str, Any], dst: Shape, new_layer_type: str, dtype: str,
                bits: int) -> dict[str, Any]:
    src = Shape.of(cfg)
    out = dict(cfg, hidden_size=dst.hidden, num_hidden_layers=dst.layers,
               intermediate_size=dst.intermediate, num_attention_heads=dst.heads,
               num_key_value_heads=dst.kv_heads, head_dim=dst.head_dim,
               rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)) * src.hidden / dst.hidden,
               torch_dtype=dtype)
    types = cfg.get("layer_types")
    if types is not None or new_layer_type != "full_attention":
        types = list(types or ["full_attention"] * src.layers)
        out["layer_types"] = types + [new_layer_type] * (dst.layers - src.layers)
    if bits < 16:
        out["quantization"] = {"group_size": GROUP, "bits": bits}
    return out


def build(src_dir: Path, dst_dir: Path, dst: Shape, *, bits: int = 16, dtype: str = "bfloat16",
          new_layer_type: str = "full_attention", seed: int = 0) -> Path:
    """Write the twin of `src_dir` in `dst_dir` (see the module docstring); returns dst_dir."""
    import engine  # noqa: F401  (BLAS before mlx)

    # isort: split
    import mlx.core as mx

    cfg = json.loads((src_dir / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"wide-twin: {src_dir} is {cfg.get('model_type')!r}, not llama")
    src = Shape.of(cfg)
    dst = Shape(dst.hidden, dst.layers, dst.intermediate, dst.heads, dst.kv_heads, src.head_dim)
    check_shapes(src, dst)
    if dst.hidden % dst.heads:
        print(f"wide-twin: note: hidden {dst.hidden} is not a multiple of {dst.heads} heads "
              "(mlx-lm loads it; transformers' config check would not)", file=sys.stderr)
    mx_dtype = {"bfloat16": mx.bfloat16, "float32": mx.float32, "float16": mx.float16}[dtype]
    weights = load_weights(src_dir)
    b = Builder(src, dst, mx_dtype, float(cfg.get("initializer_range", 0.02)), seed)
    out: dict[str, mx.array] = {
        "model.embed_tokens.weight": b.padded(weights["model.embed_tokens.weight"],
                                              (int(cfg["vocab_size"]), dst.hidden),
                                              zero_new_cols=True),
        "model.norm.weight": b.norm(weights["model.norm.weight"]),
    }
    if "lm_head.weight" in weights:
        out["lm_head.weight"] = b.padded(weights["lm_head.weight"],
                                         (int(cfg["vocab_size"]), dst.hidden), zero_new_cols=True)
    for i in range(dst.layers):
        prefix = f"model.layers.{i}."
        src_w = ({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
                 if i < src.layers else None)
        layer = b.layer(src_w)
        mx.eval(list(layer.values()))
        out.update({prefix + k: v for k, v in layer.items()})
    return _write(src_dir, dst_dir, out, twin_config(cfg, dst, new_layer_type, dtype, bits), bits)


def _write(src_dir: Path, dst_dir: Path, weights: dict[str, mx.array], cfg: dict[str, Any],
           bits: int) -> Path:
    import mlx.core as mx

    if bits < 16:
        weights = quantize(weights, bits)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for old in dst_dir.glob("*.safetensors"):
        old.unlink()
    mx.save_safetensors(str(dst_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src_dir / name).exists():
            shutil.copy(src_dir / name, dst_dir / name)
    return dst_dir


def quantize(weights: dict[str, mx.array], bits: int) -> dict[str, mx.array]:
    """Affine quantization (group 64) of every 2-D weight, with mlx-lm's tensor names."""
    import mlx.core as mx

    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        if w.ndim != 2:
            out[name] = w
            continue
        q, scales, biases = mx.quantize(w, GROUP, bits)
        stem = name.removesuffix(".weight")
        out[name], out[f"{stem}.scales"], out[f"{stem}.biases"] = q, scales, biases
    return out


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("wide-twin", help="a wider, deeper llama checkpoint with the same logits",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="source model directory (llama, float weights)")
    p.add_argument("dst", type=Path, help="where to write the twin")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--heads", type=int, required=True, help="query heads")
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--bits", type=int, choices=[4, 8, 16], default=16,
                   help="4 or 8: affine quantization, group 64; 16: --dtype")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                   help="the weights' dtype (of the scales when quantized)")
    p.add_argument("--new-layer-type", choices=["full_attention", "sliding_attention"],
                   default="full_attention", help="attention of the layers past the source's")
    p.add_argument("--seed", type=int, default=0, help="of the random new weights")
    p.add_argument("--check", action="store_true",
                   help="score the twin against SRC on the dev set (float32; see above)")
    p.add_argument("--data", type=Path, default=common.DEV_DATA, help="with --check")
    p.add_argument("--check-windows", type=int, default=8, help="with --check")
    p.add_argument("--check-window", type=int, default=1024, help="tokens a window")
    common.add_out_arg(p)
    p.set_defaults(func=cmd_wide_twin)


def cmd_wide_twin(args: argparse.Namespace) -> int:
    shape = Shape(args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads, 0)
    path = build(args.src, args.dst, shape, bits=args.bits, dtype=args.dtype,
                 new_layer_type=args.new_layer_type, seed=args.seed)
    cfg = json.loads((path / "config.json").read_text())
    print(f"wrote {path} ({parameters(cfg) / 1e9:.2f} B parameters)")
    if args.check:
        result = {"source": str(args.src), "twin": str(path), "config": cfg,
                  "parameters": parameters(cfg),
                  **check(args.src, path, args.data, args.check_windows, args.check_window)}
        out = common.write_json(common.out_dir(args, "wide-twin") / "wide_twin.json",
                                "wide-twin", result, args)
        print(f"perplexity: source {result['source_perplexity']:.4f}, twin "
              f"{result['twin_perplexity']:.4f}; top-1 agreement {result['top1_agreement']:.4f}, "
              f"max |log-prob difference| {result['max_logprob_diff']:.2e}; wrote {out}")
    return 0


def float_model(path: Path) -> Any:
    """The llama model of `path` in float32 (quantized weights dequantized)."""
    import mlx.core as mx
    from mlx_lm.models import llama

    cfg = json.loads((path / "config.json").read_text())
    q = cfg.pop("quantization", None)
    weights: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        loaded = mx.load(str(f))
        assert isinstance(loaded, dict)
        weights.update(loaded)
    for name in [k for k in weights if k.endswith(".scales")]:
        stem = name.removesuffix(".scales")
        weights[f"{stem}.weight"] = mx.dequantize(
            weights[f"{stem}.weight"], weights.pop(name), weights.pop(f"{stem}.biases"),
            group_size=q["group_size"], bits=q["bits"])
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()])
    mx.eval(model.parameters())
    return model


def check(src: Path, twin: Path, data: Path, windows: int, window: int) -> dict[str, Any]:
    """Perplexity of source and twin on `windows` windows of the dev set's code, the twin's
    top-1 agreement with the source and the largest log-probability difference."""
    import mlx.core as mx

    from bench.kv_quality import load_windows, window_logprobs
    from bench.workload import load_tokenizer

    tok = load_tokenizer(src)
    texts = load_windows(data, tok, window, windows)
    models = {"source": float_model(src), "twin": float_model(twin)}
    nll = {k: 0.0 for k in models}
    agree, count, diff = 0.0, 0, 0.0
    for tokens in texts:
        lp = {k: window_logprobs(m, tokens, 256) for k, m in models.items()}
        targets = mx.array(tokens[1:])[:, None]
        for k, v in lp.items():
            nll[k] -= float(mx.sum(mx.take_along_axis(v[:-1], targets, axis=-1)))
        agree += float(mx.sum(mx.argmax(lp["twin"], -1) == mx.argmax(lp["source"], -1)))
        diff = max(diff, float(mx.max(mx.abs(lp["twin"] - lp["source"]))))
        count += len(tokens)
    n = count - len(texts)
    return {"windows": windows, "window": window, "data": data.name,
            "source_perplexity": math.exp(nll["source"] / n),
            "twin_perplexity": math.exp(nll["twin"] / n),
            "top1_agreement": agree / count, "max_logprob_diff": diff}


def parameters(cfg: dict[str, Any]) -> int:
    """Weights of a llama config (before any quantization)."""
    s = Shape.of(cfg)
    attn = 2 * s.hidden * s.heads * s.head_dim + 2 * s.hidden * s.kv_heads * s.head_dim
    layer = attn + 3 * s.hidden * s.intermediate + 2 * s.hidden
    embed = int(cfg["vocab_size"]) * s.hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return embed + s.layers * layer + s.hidden
