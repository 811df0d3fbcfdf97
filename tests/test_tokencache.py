"""server.tokencache: a chat prompt's ids reuse the previous turn's, and are always exactly the
tokenizer's own ids of the whole text (byte-level BPE with ChatML, a SentencePiece-style
tokenizer whose first piece alone gets a prefix space, special tokens that take whitespace)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.tokenization_utils_base import AddedToken

from server import tokencache
from server.tokencache import PromptTokenCache

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _corpus() -> str:
    return "".join(p.read_text() for p in sorted((ROOT / "engine").glob("*.py")))


def _bundled():
    return AutoTokenizer.from_pretrained(str(ROOT / "mlxd" / "models" / "tinycoder-16m"))


def _sentencepiece_like(rstrip: bool = False):
    """A trained BPE over Metaspace pieces whose prefix space goes on the first piece only."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tk.decoder = decoders.Metaspace(prepend_scheme="first")
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    tk.train_from_iterator(_corpus().splitlines(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, special=True, normalized=False, rstrip=rstrip) for t in specials[1:]]})
    tok.chat_template = CHATML
    return tok


def _conversation(tok, turns: int, seed: int = 0) -> list[str]:
    """The rendered prompts of a growing conversation: every answer re-sent, tool output
    appended, some turns starting with whitespace or non-ASCII text."""
    rng = random.Random(seed)
    text = _corpus()
    msgs = [{"role": "system", "content": text[:1500]}]
    out = []
    for i in range(turns):
        start = rng.randrange(0, len(text) - 4000)
        body = text[start : start + rng.randrange(300, 3000)]
        body = rng.choice(["", " ", "\n", "\n\n  ", "héllo ✓ "]) + body
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": body})
        out.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return out


def _full(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("kind", ["bundled", "sentencepiece", "sentencepiece-rstrip"])
def test_growing_conversations_get_the_tokenizer_s_own_ids(kind):
    tok = _bundled() if kind == "bundled" else _sentencepiece_like(kind.endswith("rstrip"))
    cache = PromptTokenCache(tok)
    assert cache.enabled
    for seed in range(2):  # two conversations through one cache
        for text in _conversation(tok, 8, seed):
            assert cache.encode(text) == _full(tok, text)
    assert cache.reused_tokens > 0
    assert cache._verify == 0  # checked against full tokenizations, then trusted
    for text in _conversation(tok, 8, seed=5):  # trusted: still exact
        assert cache.encode(text) == _full(tok, text)


def test_an_edited_history_reuses_up_to_the_edit():
    tok = _bundled()
    cache = PromptTokenCache(tok)
    texts = _conversation(tok, 6)
    for text in texts:
        cache.encode(text)
    last = texts[-1]
    cut = last.index("<|im_end|>", len(texts[1]) // 2)  # inside the second turn's text
    edited = last[:cut] + " edited" + last[cut:]
    before = cache.reused_tokens
    assert cache.encode(edited) == _full(tok, edited)
    reused = cache.reused_tokens - before
    assert 0 < reused < len(_full(tok, last[:cut]))


def test_texts_without_a_cached_prefix_or_short_ones_are_tokenized_whole():
    tok = _bundled()
    cache = PromptTokenCache(tok)
    short = "<|im_start|>user\nhi<|im_end|>\n"
    assert cache.encode(short) == _full(tok, short)
    assert not cache._entries  # not kept
    plain = _corpus()[:5000]  # no special token: nothing to cut at
    assert cache.encode(plain) == _full(tok, plain)
    assert cache.reused_tokens == 0


def test_a_mismatch_turns_the_cache_off(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(tokencache.log, "warning", lambda msg, *a: warnings.append(msg % a))
    tok = _bundled()
    cache = PromptTokenCache(tok)
    texts = _conversation(tok, 3)
    cache.encode(texts[0])
    real = cache._anchored
    monkeypatch.setattr(cache, "_anchored", lambda sid, rest: (
        lambda got: None if got is None else ([7] + got[0], got[1]))(real(sid, rest)))
    assert cache.encode(texts[1]) == _full(tok, texts[1])
    assert not cache.enabled and any("prompt token cache off" in w for w in warnings)
    assert cache.encode(texts[2]) == _full(tok, texts[2])


def test_a_tokenizer_without_special_tokens_or_a_slow_one_is_not_cached():
    tok = _bundled()

    class Slow:
        is_fast = False
        added_tokens_decoder = tok.added_tokens_decoder

        def encode(self, text, add_special_tokens=False, verbose=False):
            return tok.encode(text, add_special_tokens=add_special_tokens)

    cache = PromptTokenCache(Slow())
    text = _conversation(tok, 2)[-1]
    assert not cache.enabled and cache.encode(text) == _full(tok, text)


def test_threads_share_one_cache():
    tok = _bundled()
    cache = PromptTokenCache(tok, entries=4)
    convs = [_conversation(tok, 5, seed) for seed in range(6)]
    errors: list[str] = []

    def run(texts: list[str]) -> None:
        for text in texts:
            if cache.encode(text) != _full(tok, text):
                errors.append(text[:40])

    threads = [threading.Thread(target=run, args=(c,)) for c in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache._entries) <= 4 and cache.reused_tokens > 0
