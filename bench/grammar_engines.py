"""Which grammar engine: per-token mask cost and compile time of llguidance vs outlines-core.

Walks a valid JSON answer token by token on the bundled tinycoder tokenizer (vocab 8192) and
times, per token, "compute the allowed-token mask + consume the sampled token", at batch 1 and
16 (llguidance fills the 16 masks in one parallel call; outlines-core has no batched call, so
its 16 rows are filled one after another). Also times grammar compilation from the schema.
xgrammar is not measured: its Linux wheel requires torch and triton (several GB) at install.

    python bench/grammar_engines.py            # writes bench/results/grammar_engines.{json,png}
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

import engine  # noqa: F401  (BLAS before mlx)
from mlxd import DEFAULT_MODEL_DIR

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "active", "score"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
          "tags": ["math", "engines", "poetry"], "active": True, "score": 98.5}


def _bytes_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def bench_llguidance(tok, ids: list[int], batch: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    t_tok = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    t_compile = (time.perf_counter() - t0) / batch
    assert not matchers[0].is_error(), matchers[0].get_error()
    executor = llguidance.LLExecutor()
    mask = lln.allocate_token_bitmask(batch, lltok.vocab_size)
    per_tok = []
    for t in ids:
        t0 = time.perf_counter()
        if batch == 1:
            lln.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            lln.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        for m in matchers:
            assert (mask[0, t // 32] >> (t % 32)) & 1, "the walk left the grammar"
            m.consume_token(t)
        per_tok.append(time.perf_counter() - t0)
    return {"tokenizer_s": t_tok, "compile_s": t_compile, "per_token_s": per_tok}


def bench_outlines(tok, ids: list[int], batch: int) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    table = _bytes_table()
    t0 = time.perf_counter()
    vocab_map: dict[bytes, list[int]] = {}
    special = set(tok.all_special_ids)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    for s, i in tok.get_vocab().items():
        if i in special:
            continue
        vocab_map.setdefault(bytes(table[c] for c in s), []).append(i)
    vocab = Vocabulary(eos, vocab_map)
    t_tok = time.perf_counter() - t0
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"")
    t0 = time.perf_counter()
    index = Index(regex, vocab)
    t_compile = time.perf_counter() - t0
    guides = [Guide(index) for _ in range(batch)]
    V = len(tok)
    mask = np.zeros((batch, (V + 31) // 32), np.int32)
    per_tok = []
    for t in ids:
        t0 = time.perf_counter()
        for i, g in enumerate(guides):
            row = mask[i]
            g.write_mask_into(row.ctypes.data, row.size, 4)
        for g in guides:
            assert (mask[0, t // 32] >> (t % 32)) & 1, "the walk left the grammar"
            g.advance(t)
        per_tok.append(time.perf_counter() - t0)
    return {"tokenizer_s": t_tok, "compile_s": t_compile, "per_token_s": per_tok}


def main() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    text = json.dumps(ANSWER, separators=(",", ":"))
    ids = tok.encode(text, add_special_tokens=False)
    results: dict = {"schema": SCHEMA, "answer_tokens": len(ids), "vocab": len(tok), "engines": {}}
    for name, fn in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines)):
        for batch in (1, 16):
            r = fn(tok, ids, batch)
            per = r.pop("per_token_s")
            r["median_per_token_ms"] = statistics.median(per) * 1e3
            r["mean_per_token_ms"] = statistics.fmean(per) * 1e3
            r["max_per_token_ms"] = max(per) * 1e3
            results["engines"][f"{name}@{batch}"] = r
            print(f"{name:14s} batch {batch:2d}: mask+consume median {r['median_per_token_ms']:.3f} ms, "
                  f"mean {r['mean_per_token_ms']:.3f} ms, max {r['max_per_token_ms']:.3f} ms; "
                  f"compile {r['compile_s'] * 1e3:.1f} ms, tokenizer {r['tokenizer_s'] * 1e3:.0f} ms")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "grammar_engines.json").write_text(json.dumps(results, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results["engines"])
    ax.bar(names, [results["engines"][n]["mean_per_token_ms"] for n in names], color=["C0", "C0", "C1", "C1"])
    ax.set_ylabel("mask + consume per token step (ms, mean)")
    ax.set_title(f"grammar engines on tinycoder (vocab {len(tok)}), JSON schema walk")
    fig.tight_layout()
    fig.savefig(out / "grammar_engines.png", dpi=120)


if __name__ == "__main__":
    main()
