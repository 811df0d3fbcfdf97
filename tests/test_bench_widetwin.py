"""`python -m bench wide-twin`: a wider, deeper twin of tinycoder-16m computes the same function.

The exact tier (float32): the twin's logits over a held-out prompt and 320 greedy tokens (past
the 256-token sliding window, prefilled in chunks so that the rings wrap) equal the source's to
float tolerance, and at every position the twin's argmax is the source's next greedy token —
so by induction the twin's own greedy decode emits the same 320 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from bench.__main__ import main
from bench.widetwin import Shape, check_shapes, parameters, q_positions

PROMPT = ('def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n')
CHUNK = 64
GREEDY = 320


def _load(path: Path):
    from mlx_lm.utils import load

    model, tok = load(str(path))[:2]
    model.set_dtype(mx.float32)  # the source is stored bfloat16: compare in float32
    return model, tok


def _greedy(model, ids: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(ids), model, max_tokens=n)
    return [int(t) for t, _ in steps]


def _logits(model, ids: list[int]) -> mx.array:
    """Logits at every position, prefilled in CHUNK-token pieces through mlx-lm's caches."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = []
    for s in range(0, len(ids), CHUNK):
        logits = model(mx.array([ids[s:s + CHUNK]]), cache=cache)[0].astype(mx.float32)
        mx.eval(logits)
        out.append(logits)
    return mx.concatenate(out, axis=0)


@pytest.fixture(scope="module")
def twin(tinycoder_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("twin") / "tinycoder-wide"
    assert main(["wide-twin", str(tinycoder_path), str(out), "--hidden", "768", "--layers", "12",
                 "--intermediate", "2048", "--heads", "12", "--kv-heads", "4",
                 "--dtype", "float32"]) == 0
    return out


def test_twin_config(twin: Path, tinycoder_path: Path):
    src = json.loads((tinycoder_path / "config.json").read_text())
    cfg = json.loads((twin / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        768, 12, 2048, 12, 4, 64)
    assert cfg["rms_norm_eps"] == pytest.approx(src["rms_norm_eps"] * 384 / 768)
    assert cfg["layer_types"] == src["layer_types"] + ["full_attention"] * 4
    assert "quantization" not in cfg
    assert (twin / "tokenizer.json").exists()
    weights = mx.load(str(twin / "model.safetensors"))
    assert parameters(cfg) == sum(v.size for v in weights.values())


def test_twin_computes_the_source_function_past_the_window(twin: Path, tinycoder_path: Path):
    src, tok = _load(tinycoder_path)
    prompt = tok.encode(PROMPT)
    greedy = _greedy(src, prompt, GREEDY)
    seq = prompt + greedy
    assert len(seq) > 256 + CHUNK  # the sliding layers' rings wrap
    ref = _logits(src, seq)
    wide, _ = _load(twin)
    got = _logits(wide, seq)
    assert float(mx.max(mx.abs(got - ref))) < 1e-4 * max(1.0, float(mx.max(mx.abs(ref))))
    nxt = mx.argmax(got, axis=-1).tolist()
    assert nxt[len(prompt) - 1:-1] == greedy
    # the residual's new dimensions stay exactly zero through every layer and the final norm
    hidden = wide.model(mx.array([seq[:CHUNK]]))
    assert float(mx.max(mx.abs(hidden[..., 384:]))) == 0.0


def test_quantized_twin_keeps_new_dimensions_zero(tinycoder_path: Path, tmp_path: Path):
    """8-bit (group 64): every new block is whole groups, so its zeros stay exactly zero; only
    the source's own weights move by quantization (`--check` says by how much)."""
    out = tmp_path / "q8"
    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps({"kind": "code", "text": PROMPT * 12}) + "\n")
    assert main(["wide-twin", str(tinycoder_path), str(out), "--hidden", "512", "--layers", "9",
                 "--intermediate", "1152", "--heads", "8", "--kv-heads", "2", "--bits", "8",
                 "--new-layer-type", "sliding_attention", "--check", "--data", str(data),
                 "--check-windows", "1", "--check-window", "160",
                 "--out", str(tmp_path / "check")]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 8}
    assert cfg["layer_types"][-1] == "sliding_attention"
    wide, tok = _load(out)
    hidden = wide.model(mx.array([tok.encode(PROMPT) * 3]))
    assert float(mx.max(mx.abs(hidden[..., 384:]))) == 0.0
    result = json.loads((tmp_path / "check" / "wide_twin.json").read_text())
    assert result["bench"] == "wide-twin" and result["top1_agreement"] > 0.9
    assert 0 < result["max_logprob_diff"] < 1.0
    ratio = result["twin_perplexity"] / result["source_perplexity"]
    assert 0.95 < ratio < 1.05


def test_shapes_the_construction_cannot_keep_are_refused():
    src = Shape(384, 8, 1024, 6, 2, 64)
    check_shapes(src, Shape(4608, 32, 14336, 48, 16, 64))
    for bad, why in [
        (Shape(256, 8, 1024, 6, 2, 64), "below the source"),
        (Shape(768, 12, 2048, 8, 4, 64), "GQA grouping"),  # 2 q heads a kv head < 3
        (Shape(768, 12, 2048, 12, 5, 64), "not a multiple"),
        (Shape(800, 12, 2048, 12, 4, 64), "multiple of 64"),
    ]:
        with pytest.raises(SystemExit, match=why):
            check_shapes(src, bad)


def test_source_heads_keep_their_kv_group():
    src, dst = Shape(384, 8, 1024, 6, 2, 64), Shape(768, 12, 2048, 16, 4, 64)  # 3 -> 4 a group
    pos = q_positions(src, dst)
    assert pos == [0, 1, 2, 4, 5, 6]
    assert [p // dst.group for p in pos] == [h // src.group for h in range(src.heads)]
