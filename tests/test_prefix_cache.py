"""Prefix cache and memory accounting on tiny random models (exact tier: same greedy tokens)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import batch as kvb
from engine.kv.memory import measure_footprint
from engine.kv.prefix_cache import PrefixCache, chunk_ends, held_bytes
from engine.models import layer_templates, make_batch_layouts, prepare_model
from tests.tiny_archs import tiny_model


@pytest.fixture(scope="module", autouse=True)
def _no_compile():
    mx.disable_compile()
    yield
    mx.enable_compile()


_MODELS: dict[str, object] = {}


def model_for(arch: str, **overrides):
    key = arch + repr(sorted(overrides.items()))
    if key not in _MODELS:
        model = tiny_model(arch, seed=2, **overrides)
        prepare_model(model)
        _MODELS[key] = model
    return _MODELS[key]


def greedy_from(model, cache, rest: list[int], steps: int = 8) -> list[int]:
    logits = model(mx.array([rest]), cache=cache)[:, -1]
    out = []
    for _ in range(steps):
        out.append(int(mx.argmax(logits, -1).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out


def serve(model, pc: PrefixCache, prompt: list[int], layout_kw: dict, chunk: int = 16):
    """What the scheduler does: look up, restore, prefill the rest in aligned chunks (inserting
    after each), then decode. Returns (cached_tokens, greedy tokens)."""
    hit = pc.lookup(prompt, max_tokens=len(prompt) - 1)
    row = pc.restore(hit) if hit else make_batch_layouts(model, 1, **layout_kw)
    start = hit.num_tokens if hit else 0
    assert kvb.num_tokens(row) == [start]
    ends = list(chunk_ends(start, len(prompt) - 1, chunk, pc.block_size))
    for end in ends:
        model(mx.array([prompt[start:end]]), cache=row)
        pc.insert(prompt[:end], row)
        start = end
    return (hit.num_tokens if hit else 0), greedy_from(model, row, prompt[start:])


CASES = [
    ("llama", {}),  # sliding window 8 + full attention
    ("llama", {"kv_bits": 8, "kv_group_size": 32}),  # quantized rings + quantized full
    ("qwen3_next", {}),  # recurrent + full attention
    ("gpt_oss", {"max_draft": 2}),  # sinks attention, ring with slack
]


@pytest.mark.parametrize("arch,layout_kw", CASES)
def test_shared_prefix_is_reused_with_identical_output(arch, layout_kw):
    model = model_for(arch)
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 256, 1000).tolist()
    a = shared + rng.integers(1, 256, 7).tolist()
    b = shared + rng.integers(1, 256, 5).tolist()
    pc = PrefixCache(make_batch_layouts(model, 0, **layout_kw), block_size=8, max_bytes=1 << 30)
    cached_a, _ = serve(model, pc, a, layout_kw, chunk=256)
    assert cached_a == 0
    cached_b, got = serve(model, pc, b, layout_kw, chunk=256)
    assert cached_b >= 1000
    want = greedy_from(model, make_batch_layouts(model, 1, **layout_kw), b)
    assert got == want
    if not layout_kw:
        assert got == greedy_from(model, layer_templates(model), b)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_divergent_prefixes_restore_only_where_every_layer_can(arch):
    """One insert at the end of a long prompt: rings keep only recent blocks and recurrent
    state exists only at the end, so an early divergence must not restore from the cache
    (llama's full layers alone would allow it; the ring layers must veto)."""
    model = model_for(arch)
    rng = np.random.default_rng(1)
    a = rng.integers(1, 256, 64).tolist()
    pc = PrefixCache(make_batch_layouts(model, 0), block_size=8)
    row = make_batch_layouts(model, 1)
    model(mx.array([a]), cache=row)
    pc.insert(a, row)
    assert pc.lookup(a[:24] + [0] * 10) is None  # diverges at 24: the window data is gone
    hit = pc.lookup(a + [1, 2, 3])
    assert hit is not None and hit.num_tokens == 64
    restored = pc.restore(hit)
    rest = [1, 2, 3]
    want = greedy_from(model, layer_templates(model), a + rest)
    assert greedy_from(model, restored, rest) == want


def test_byte_budget_holds_under_a_stream_of_distinct_prefixes():
    model = model_for("llama")
    template = make_batch_layouts(model, 0)
    rng = np.random.default_rng(2)
    budget = 200_000
    pc = PrefixCache(template, block_size=8, max_bytes=budget)
    for _ in range(12):
        prompt = rng.integers(1, 256, 40).tolist()
        row = make_batch_layouts(model, 1)
        model(mx.array([prompt]), cache=row)
        pc.insert(prompt, row)
        assert pc.nbytes <= budget
        assert pc.lookup(prompt) is not None or pc.nbytes == 0  # the newest one survives
    assert pc.stats.evicted_blocks > 0
    assert held_bytes(pc._lru.values()) == pc.nbytes  # the bytes the live blocks keep


def test_lru_evicts_the_least_recently_used_prefix():
    model = model_for("llama")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, 16).tolist() for _ in range(3)]
    rows = []
    for p in prompts:
        row = make_batch_layouts(model, 1)
        model(mx.array([p]), cache=row)
        rows.append(row)
    pc = PrefixCache(make_batch_layouts(model, 0), block_size=8)
    pc.insert(prompts[0], rows[0])
    one = pc.nbytes
    pc.max_bytes = 2 * one
    pc.insert(prompts[1], rows[1])
    assert pc.lookup(prompts[0]) is not None  # touch 0: now 1 is the oldest
    pc.insert(prompts[2], rows[2])
    assert pc.nbytes <= 2 * one
    assert pc.lookup(prompts[1]) is None
    assert pc.lookup(prompts[0]) is not None and pc.lookup(prompts[2]) is not None


def test_chunk_ends_hit_the_last_block_boundary():
    assert list(chunk_ends(0, 400, 256, 64)) == [256, 384, 400]
    assert list(chunk_ends(64, 300, 128, 64)) == [192, 256, 300]
    assert list(chunk_ends(0, 64, 256, 64)) == [64]


@pytest.mark.parametrize(
    "arch,layout_kw",
    [
        ("llama", {}),
        ("llama", {"kv_bits": 8, "kv_group_size": 32}),
        ("llama", {"kv_bits": 4, "kv_group_size": 32}),
        ("qwen3_next", {}),
    ],
)
def test_footprint_matches_allocated_bytes(arch, layout_kw):
    model = model_for(arch)
    fp = measure_footprint(model, **layout_kw)
    for n in (3, 8, 21):
        row = make_batch_layouts(model, 1, **layout_kw)
        model(mx.array([list(range(1, n + 1))]), cache=row)
        exact = sum(layer.extract(0).nbytes for layer in row)
        assert fp.row_bytes(n) == exact
    fp16 = measure_footprint(model)
    if layout_kw:
        # float32 tiny model: 8 bits with group 32 stores 40 bytes per 32 floats (128 bytes)
        ratio = fp16.bytes_per_token() / fp.bytes_per_token()
        assert ratio == pytest.approx(128 / (32 * layout_kw["kv_bits"] / 8 + 8))
    batch = kvb.merge_rows(None, [make_batch_layouts(model, 1, **layout_kw) for _ in range(3)])
    model(mx.array([[1, 2, 3]] * 3), cache=batch)
    assert kvb.nbytes(batch) == fp.batch_bytes(3, 3)


@pytest.mark.parametrize("arch,layout_kw", CASES)
def test_resumed_inserts_store_what_whole_path_inserts_store(arch, layout_kw, monkeypatch):
    """A prompt stored chunk by chunk with `after` (the previous insert's `last_node`) walks
    only its new blocks, and leaves the trie a whole-path insert after every chunk leaves: the
    same blocks, bytes, hits and restored tokens."""
    model = model_for(arch)
    prompt = np.random.default_rng(5).integers(1, 256, 120).tolist()

    def fill(resume: bool) -> tuple[PrefixCache, int]:
        pc = PrefixCache(make_batch_layouts(model, 0, **layout_kw), block_size=8)
        row = make_batch_layouts(model, 1, **layout_kw)
        walked = 0
        blocks = pc._blocks

        def counting(ids, limit, first=0):
            nonlocal walked
            for b in blocks(ids, limit, first):
                walked += 1
                yield b

        monkeypatch.setattr(pc, "_blocks", counting)
        start, last = 0, None
        for end in chunk_ends(0, len(prompt) - 1, 16, pc.block_size):
            model(mx.array([prompt[start:end]]), cache=row)
            pc.insert(prompt[:end], row, after=last if resume else None)
            last, start = pc.last_node, end
        return pc, walked

    whole, walked_whole = fill(False)
    resumed, walked_resumed = fill(True)
    assert walked_resumed == (len(prompt) - 1) // 8  # each block once
    assert walked_whole > walked_resumed
    assert (resumed.num_blocks, resumed.nbytes) == (whole.num_blocks, whole.nbytes)
    query = prompt + [7, 8, 9]
    a, b = whole.lookup(query), resumed.lookup(query)
    assert (a and a.num_tokens) == (b and b.num_tokens)
    if b is not None:
        want = greedy_from(model, whole.restore(a), query[a.num_tokens:])
        assert greedy_from(model, resumed.restore(b), query[b.num_tokens:]) == want


def test_insert_after_an_evicted_node_walks_from_the_root():
    """`after` that was evicted since is not attached: the insert starts at the root."""
    model = model_for("llama")
    prompt = np.random.default_rng(6).integers(1, 256, 40).tolist()
    pc = PrefixCache(make_batch_layouts(model, 0), block_size=8)
    row = make_batch_layouts(model, 1)
    model(mx.array([prompt[:32]]), cache=row)
    pc.insert(prompt[:32], row)
    stale = pc.last_node
    assert pc.attached(stale)
    pc.clear()
    assert not pc.attached(stale)
    assert pc.insert(prompt[:32], row, after=stale) == 4  # every block again, from the root
    assert pc.lookup(prompt[:33]).num_tokens == 32


def _full_model():
    """Tiny llama with full attention only (every layer's blocks are whole)."""
    return model_for("llama", layer_types=["full_attention"] * 3)


def _segments(pc: PrefixCache, li: int) -> set[int]:
    return {id(n.segs[li][0]) for n in pc._lru.values() if n.segs[li] is not None}


def test_a_chunk_is_copied_once_per_layer_and_restored_through_its_segment():
    """A whole-attention layer's blocks of one chunk are one copy (one segment), a chunk
    inserted later is another; restoring across both gives the tokens a fresh prefill does."""
    model = _full_model()
    prompt = np.random.default_rng(7).integers(1, 256, 70).tolist()
    pc = PrefixCache(make_batch_layouts(model, 0), block_size=8)
    row = make_batch_layouts(model, 1)
    for start, end in ((0, 40), (40, 64)):
        model(mx.array([prompt[start:end]]), cache=row)
        pc.insert(prompt[:end], row)
    assert pc.num_blocks == 8
    for li in range(len(pc.template)):
        assert len(_segments(pc, li)) == 2  # blocks 0-4 and 5-7
    assert held_bytes(pc._lru.values()) == pc.nbytes
    hit = pc.lookup(prompt, max_tokens=len(prompt) - 1)
    assert hit is not None and hit.num_tokens == 64
    fresh = make_batch_layouts(model, 1)
    model(mx.array([prompt[:64]]), cache=fresh)
    assert greedy_from(model, pc.restore(hit), prompt[64:]) == greedy_from(model, fresh, prompt[64:])


def _one_chunk(seed: int) -> tuple[PrefixCache, list[int]]:
    """A 33-token prompt prefilled in one chunk and inserted: four 8-token blocks, one segment
    per layer."""
    model = _full_model()
    prompt = np.random.default_rng(seed).integers(1, 256, 33).tolist()
    pc = PrefixCache(make_batch_layouts(model, 0), block_size=8)
    row = make_batch_layouts(model, 1)
    model(mx.array([prompt]), cache=row)
    pc.insert(prompt, row)
    return pc, prompt


def test_a_segment_is_compacted_and_freed_as_its_blocks_go():
    """A segment's blocks share one buffer: evicting its last block frees nothing until half of
    them are gone, when the rest is copied into a smaller segment (the cache's count follows the
    memory held, and the blocks left restore as before); the last block frees it all."""
    pc, prompt = _one_chunk(8)
    model = _full_model()
    mx.clear_cache()
    whole = pc.nbytes
    active = mx.get_active_memory()
    assert pc.num_blocks == 4 and whole > 0

    def evict_one() -> None:
        pc._remove(next(n for n in reversed(pc._lru.values()) if not n.children))

    evict_one()  # 3 of 4 blocks left: still the whole segment
    assert pc.nbytes == whole == held_bytes(pc._lru.values())
    evict_one()  # 2 of 4: compacted to 2 blocks
    assert pc.num_blocks == 2 and pc.nbytes == whole // 2 == held_bytes(pc._lru.values())
    mx.clear_cache()
    assert active - mx.get_active_memory() >= whole // 2
    hit = pc.lookup(prompt, max_tokens=len(prompt) - 1)
    assert hit is not None and hit.num_tokens == 16
    fresh = make_batch_layouts(model, 1)
    model(mx.array([prompt[:16]]), cache=fresh)
    assert greedy_from(model, pc.restore(hit), prompt[16:]) == greedy_from(model, fresh, prompt[16:])
    mx.clear_cache()
    before = mx.get_active_memory()
    assert pc.evict_to(0)
    assert pc.num_blocks == 0 and pc.nbytes == 0
    mx.clear_cache()
    assert before - mx.get_active_memory() >= whole // 2


def test_evict_to_keeps_a_pinned_hit_and_says_when_it_cannot_fit():
    pc, prompt = _one_chunk(9)
    hit = pc.lookup(prompt[:17])  # two blocks, in the same segment as the other two
    assert hit is not None and hit.num_tokens == 16
    assert pc.pinned_bytes([hit]) == pc.nbytes  # the pin keeps the whole segment
    assert not pc.evict_to(pc.nbytes - 1, [hit]) and pc.num_blocks == 4
    assert pc.holds(hit)
