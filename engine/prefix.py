"""The scheduler's prefix-cache policy on top of `engine.kv.prefix_cache.PrefixCache`.

    hit  = prefix.lookup(row)                 # sets row.num_cached_tokens (block-aligned)
    kv   = prefix.group_caches(rows)          # restored rows + empty rows, one batch
    ...  prefill prompt[cached:-1] in chunks of at most prefix.chunk tokens ...
    prefix.store(group)                       # after every chunk: insert each row's blocks

Sliding-window (ring) layers only hold the last `window` positions, so a block can be stored
only while it is still in the ring. Chunks are therefore at most `ring - block_size` tokens and
end on block boundaries: every block of a long prompt is captured by some chunk, and any
block-aligned prefix can later be restored for every layer kind.

Worked example (tinycoder: ring 256, block 16 → chunk 240): a 1,100-token prompt is prefilled
in chunks ending at 240, 480, …, 960, 1,099; after each, the blocks that are complete are
inserted. A later prompt sharing its first 1,008 tokens restores 1,008 tokens (63 blocks) and
prefills only the rest.
"""

from __future__ import annotations

from typing import Any

from engine import kvcache
from engine.batch import RowMeta
from engine.kv import batch as kvb
from engine.kv.prefix_cache import PrefixCache, PrefixHit


class PrefixIndex:
    def __init__(self, make_caches, max_bytes: int, block_size: int = 16, prefill_chunk: int = 512):
        template = make_caches(0)
        self.cache = PrefixCache(template, block_size=block_size, max_bytes=max_bytes)
        self.block_size = block_size
        rings = [layer.ring_size for layer in template if getattr(layer, "ring_size", None)]
        chunk = min([prefill_chunk, *[r - block_size for r in rings]])
        self.chunk = max(block_size, chunk // block_size * block_size)
        self._make_caches = make_caches
        self._hits: dict[str, PrefixHit | None] = {}  # req_id -> hit (None: looked up, missed)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def lookup(self, row: RowMeta) -> None:
        """Find the row's longest cached prefix (at most prompt - 1 tokens); once per row."""
        if row.req_id in self._hits:
            return
        ids = row.request.prompt_ids
        hit = self.cache.lookup(ids, max_tokens=len(ids) - 1)
        self._hits[row.req_id] = hit
        if hit is not None:
            row.num_cached_tokens = hit.num_tokens

    def forget(self, row: RowMeta) -> None:
        self._hits.pop(row.req_id, None)

    def group_caches(self, rows: list[RowMeta]) -> kvcache.Caches:
        hits = [self._hits.pop(r.req_id, None) for r in rows]
        if not any(hits):
            return self._make_caches(len(rows))
        parts = [self.cache.restore(h) if h is not None else self._make_caches(1) for h in hits]
        return kvb.merge_rows(None, parts)

    def store(self, rows: list[RowMeta], caches: kvcache.Caches) -> None:
        """Insert the complete blocks each row now holds."""
        counts = kvb.num_tokens(caches)
        for i, row in enumerate(rows):
            n = int(counts[i])
            if n < self.block_size:
                continue
            self.cache.insert(row.request.prompt_ids[:n], kvcache.extract_row(caches, i))

    def stats(self) -> dict[str, Any]:
        s = self.cache.stats
        return {"queries": s.queries, "hits": s.hits, "hit_tokens": s.hit_tokens,
                "blocks": self.cache.num_blocks, "evicted_blocks": s.evicted_blocks}
