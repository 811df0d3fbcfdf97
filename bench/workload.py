"""Fixed random prompts of an exact token length, built with the model's own tokenizer.

mlx_lm.server takes text prompts only (no token-id prompts), so every server gets the same text:
random token ids are decoded to text and re-encoded, trimming or extending, until the text
encodes to exactly the target number of tokens. The servers report the count they saw in
`usage.prompt_tokens`; the benchmark records it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_ROUNDS = 64  # bounded search per prompt


@dataclass(slots=True)
class Prompt:
    text: str
    num_tokens: int  # as this tokenizer encodes `text` (no special tokens added)


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _usable_ids(tok: Any) -> list[int]:
    """Token ids that decode on their own to clean text (no specials, no broken UTF-8)."""
    special = set(getattr(tok, "all_special_ids", []) or [])
    ids = []
    for i in range(len(tok)):
        if i in special:
            continue
        s = tok.decode([i])
        if s and "\ufffd" not in s and s.isprintable():
            ids.append(i)
    return ids


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def exact_prompt(tok: Any, num_tokens: int, rng: random.Random, pool: list[int]) -> Prompt:
    """A random text that encodes to `num_tokens` tokens (or the closest found in bounded rounds)."""
    ids = rng.choices(pool, k=num_tokens)
    best: Prompt | None = None
    for _ in range(MAX_ROUNDS):
        text = tok.decode(ids)
        enc = _encode(tok, text)
        cand = Prompt(text, len(enc))
        if best is None or abs(cand.num_tokens - num_tokens) < abs(best.num_tokens - num_tokens):
            best = cand
        if len(enc) == num_tokens:
            return cand
        if len(enc) > num_tokens:
            ids = enc[:num_tokens]
        else:
            ids = enc + rng.choices(pool, k=num_tokens - len(enc))
    assert best is not None
    return best


def prompts_of_lengths(model_dir: str | Path, lengths: Sequence[int], seed: int = 0) -> list[Prompt]:
    """One prompt per entry of `lengths`, from one tokenizer load and one scan of its
    vocabulary (`_usable_ids` decodes every id: seconds for a 128k vocabulary)."""
    tok = load_tokenizer(model_dir)
    pool = _usable_ids(tok)
    rng = random.Random(seed)
    return [exact_prompt(tok, n, rng, pool) for n in lengths]


def make_prompts(model_dir: str | Path, count: int, num_tokens: int, seed: int = 0) -> list[Prompt]:
    return prompts_of_lengths(model_dir, [num_tokens] * count, seed)


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids from config.json / generation_config.json (for an optional EOS logit bias)."""
    import json

    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = Path(model_dir) / name
        if p.exists():
            v = json.loads(p.read_text()).get("eos_token_id")
            if isinstance(v, int):
                ids.append(v)
            elif isinstance(v, list):
                ids.extend(int(x) for x in v)
    return sorted(set(ids))
