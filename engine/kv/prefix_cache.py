"""Prefix cache: a trie of token blocks holding one-row KV, LRU-evicted under a byte budget.

    pc = PrefixCache(template=make_batch_layouts(model, 0, ...), block_size=64, max_bytes=...)
    hit = pc.lookup(prompt_ids, max_tokens=len(prompt_ids) - 1)   # None or a PrefixHit
    row = pc.restore(hit) if hit else make_batch_layouts(model, 1, ...)
    for end in chunk_ends(hit.num_tokens if hit else 0, len(prompt_ids), chunk, pc.block_size):
        model(prompt[start:end], cache=row); pc.insert(prompt_ids[:end], row)
    ... merge `row` into the running batch ...

Each trie node is one block of `block_size` tokens (the path from the root spells the prefix)
and holds, per layer, what restoring a row at or after that block needs:

* full-attention layers: the block's K/V columns (encoded: quantized layouts store codes);
* ring layers: the block's K/V columns too, but only while the row's ring still held them
  when it was inserted: a restore at boundary b needs the sinks and the last window - keep
  positions before b, so deep in a long prompt only the recent blocks carry ring data; a
  block whose oldest positions had already left the ring is kept from its first held position
  (`starts`), which is all a restore just past it needs;
* recurrent layers: a state snapshot, only on the node whose boundary equals the row's length
  at insertion time (these are the "checkpoints at block boundaries": call `insert` after
  every block-aligned prefill chunk, `chunk_ends` makes the chunks line up).

Whole blocks that an insert finds in consecutive columns of a layer (every block of a prefill
chunk, of a full-attention layer) are copied once per layer as one segment, which the nodes
share; a restore reads consecutive blocks of a segment as one slice. On a GPU every copy is a
kernel launch, so a 32k-token prompt costs a few copies per layer, not 500. The cache counts a
segment's bytes until its last block is evicted (then its memory is freed); once half of a
segment's blocks are evicted, the rest is copied into a smaller one, so a run whose first blocks
stay (a prefix other requests share) does not keep the memory of its evicted tail.

`lookup` returns the deepest node whose boundary every layer can be restored at. Eviction drops
the least recently used leaf until the bytes fit; a lookup or insert touches the whole path,
so parents always outlive their children.

The scheduler's side is `PrefixIndex` (`NoPrefix` when the cache is off):

    prefix.lookup(row)                        # at admission: sets row.num_cached_tokens
    kv = prefix.group_caches(rows)            # restored rows + empty rows, one batch
    ... prefill prompt[cached:] in chunks of at most prefix.chunk tokens ...
    prefix.store(rows, kv)                    # after every chunk: insert each row's blocks
    prefix.advance(running.rows, running.caches)  # decoding rows passing a block boundary
    prefix.finish(row, running.caches, i, tail)   # a row that ended: prompt + answer + stop
    prefix.make_room(free, rows)              # admission: evict LRU blocks, keep rows' hits
    prefix.set_room(free)                     # what the memory budget leaves the cache now

Under the memory budget the cache holds at most `min(max_bytes, room)`: the scheduler sets
`room` to what the weights, the admitted rows' KV and a step's activations leave, and evicts
least recently used blocks to admit a request (engine.scheduler). A waiting row is looked up
again before it starts when its hit was evicted meanwhile or the cache stored blocks since its
last lookup (a burst of requests sharing a system prompt: the first one's prefill stores it,
the others hit it); the hit counters count each started row once, with the hit it starts with.

Across turns: a finished row's whole sequence goes in (`finish`), so a next turn that re-sends
the answer restores through it. Ring and recurrent layers cannot give back boundaries the row
has moved past, so while decoding, rows of such models insert each block boundary they pass
(`advance`: rings within 1 + slack tokens of it, recurrent layers exactly at it). Those
inserts view the batch's buffers (no row copy) and queue their block copies (`wait=False`), so
they never wait for the step in flight.

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

import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from engine.api import PrefixCacheStats
from engine.kv import batch as kvb
from engine.kv.attention import KVLayout
from engine.kv.convert import RowKV, adopt, place
from engine.kv.recurrent import RecurrentLayout

if TYPE_CHECKING:
    from engine.batch import RowMeta

MakeCaches = Callable[[int], list[Any]]


@dataclass(eq=False, slots=True)
class _Segment:
    """One copy of a run of consecutive whole blocks of one layer (one array per buffer), which
    the run's nodes share (each knows its block's first column in it): an insert copies each
    layer once per run, not once per block (on a GPU every copy is a launch: a 32k-token prompt
    of 64-token blocks would be 500 per layer and buffer). Its memory goes when the last node
    holding it is evicted; `PrefixCache._compact` shrinks it once half of them are."""

    arrays: list[mx.array]
    nbytes: int
    refs: int = 0  # the (node, layer) pairs holding it


@dataclass(eq=False, slots=True, weakref_slot=True)
class _Node:
    tokens: tuple[int, ...]
    parent: _Node | None
    depth: int  # blocks from the root; boundary = depth * block_size
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    # per layer: None, the block's own arrays, or (with `segs`) its segment's arrays
    data: list[Any] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # per layer: first position `data` holds
    # per layer: the segment holding the block and the block's first column in it (None: own)
    segs: list[tuple[_Segment, int] | None] = field(default_factory=list)
    # a scoring pass's values for the block's tokens (`BlockScores`), None if none stored them
    scores: Any = None


@dataclass(frozen=True, slots=True)
class BlockScores:
    """Prompt logprobs of one block's tokens (engine.score): per token its logprob, rank and
    best alternatives (at most `k` of them); the first token of the first block has none."""

    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[list[tuple[int, float]]]
    k: int

    @property
    def nbytes(self) -> int:
        """About what the Python objects take (a float and an int per token, a tuple of two per
        alternative): counted against the cache's limit like its arrays."""
        return 64 * len(self.logprobs) + 120 * sum(len(t) for t in self.top)


# a scoring job's values so far, indexed by token - 1: (logprobs, ranks, top, k)
JobScores = tuple[list[float], list[int], list[list[tuple[int, float]]], int]


@dataclass(frozen=True, slots=True)
class PrefixHit:
    num_tokens: int
    node: _Node


@dataclass(slots=True)
class PrefixCounters:
    queries: int = 0
    hits: int = 0
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0


UNBOUNDED_CHUNK = 1 << 30  # `max_chunk` of a model whose layouts set no limit


def chunk_ends(start: int, total: int, chunk: int, block_size: int) -> Iterator[int]:
    """Prefill chunk ends from `start` to `total` such that the last block boundary before
    `total` is a chunk end (so recurrent snapshots exist there). `chunk` should be a multiple
    of `block_size`, and `start` block-aligned (a restored prefix is)."""
    last_boundary = total // block_size * block_size
    pos = start
    while pos < total:
        end = min(pos + chunk, total)
        if pos < last_boundary < end:
            end = last_boundary
        yield end
        pos = end


def _arrays_nbytes(arrays: Sequence[mx.array | None]) -> int:
    return sum(int(a.nbytes) for a in arrays if a is not None)


class PrefixCache:
    def __init__(
        self, template: Sequence[Any], *, block_size: int = 64, max_bytes: int = 1 << 30
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.template = [layer.empty_like(0) for layer in template]
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.room: int | None = None  # what the memory budget leaves the cache now (None: no limit)
        self._roots: dict[int, _Node] = {}  # one trie per key (the row's adapter: KV differs)
        self._lru: OrderedDict[int, _Node] = OrderedDict()
        self.last_node: _Node | None = None  # the deepest node of the last insert's path
        self._nbytes = 0
        self.stats = PrefixCounters()
        self.version = 0  # grows with every insert that stores something (see `PrefixIndex.lookup`)

    # ---------------------------------------------------------------- queries

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    def _blocks(self, token_ids: Sequence[int], limit: int,
                first: int = 0) -> Iterator[tuple[int, ...]]:
        """The complete blocks of token_ids[:limit] from block `first` on, as trie keys."""
        bs = self.block_size
        ids = token_ids if isinstance(token_ids, list) else [int(t) for t in token_ids]
        for j in range(first, min(len(ids), limit) // bs):
            yield tuple(ids[j * bs : (j + 1) * bs])

    def attached(self, node: _Node | None) -> bool:
        """Whether `node` (from `last_node`) is still in the trie (not evicted since)."""
        return node is not None and self._lru.get(id(node)) is node

    def _path(self, node: _Node) -> list[_Node]:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _touch(self, node: _Node) -> None:
        for n in self._path(node):
            self._lru.move_to_end(id(n))

    def _root(self, key: int) -> _Node:
        return self._roots.setdefault(key, _Node((), None, 0))

    def lookup(
        self, token_ids: Sequence[int], max_tokens: int | None = None, key: int = 0
    ) -> PrefixHit | None:
        """The longest cached, restorable, block-aligned prefix of `token_ids` (<= max_tokens)
        among the blocks inserted under `key` (rows whose KV differs, such as rows with
        different adapters, use different keys). Counted by `count_hit`, not here."""
        return self.find(token_ids, max_tokens, key)[0]

    def find(
        self, token_ids: Sequence[int], max_tokens: int | None = None, key: int = 0,
        multiple: int = 1,
    ) -> tuple[PrefixHit | None, _Node]:
        """`lookup` (a hit of a multiple of `multiple` blocks), and the node where its walk
        down the trie stopped (for `walks_past`)."""
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        path = self._walk(token_ids, limit, key)
        node = path[-1] if path else self._root(key)
        for cand in reversed(path):
            if cand.depth % multiple == 0 and self._restorable(path[: cand.depth]):
                self._touch(cand)
                return PrefixHit(cand.depth * self.block_size, cand), node
        return None, node

    def _walk(self, token_ids: Sequence[int], limit: int, key: int,
              take: Callable[[_Node], bool] | None = None) -> list[_Node]:
        """The trie's nodes under `key` along the whole blocks of `token_ids[:limit]`, down to
        the first block it lacks (or, with `take`, the first node `take` refuses)."""
        node, path = self._root(key), []
        for block in self._blocks(token_ids, limit):
            child = node.children.get(block)
            if child is None or take is not None and not take(child):
                break
            path.append(child)
            node = child
        return path

    def find_scored(self, token_ids: Sequence[int], k: int) -> tuple[PrefixHit | None, JobScores]:
        """The longest restorable prefix of `token_ids` (key 0: the base model) whose tokens'
        scores were stored with at least `k` alternatives, and the scores of its tokens 1 .. n
        (indexed by token - 1). It stops one block short of the scored path: the score of the
        token after it needs the logits of its last token, which the pass computes again, and
        that token is the next block's first (so that block's scores are needed)."""
        path = self._walk(token_ids, len(token_ids), 0,
                          lambda nd: nd.scores is not None and nd.scores.k >= k)
        bs = self.block_size
        for depth in range(min(len(path) - 1, (len(token_ids) - 1) // bs), 0, -1):
            if self._restorable(path[:depth]):
                self._touch(path[depth])
                n = depth * bs
                logprobs: list[Any] = []
                ranks: list[Any] = []
                top: list[list[tuple[int, float]]] = []
                for nd in path[: depth + 1]:
                    logprobs += nd.scores.logprobs
                    ranks += nd.scores.ranks
                    top += [t[:k] for t in nd.scores.top]
                return PrefixHit(n, path[depth - 1]), (logprobs[1 : n + 1], ranks[1 : n + 1],
                                                       top[1 : n + 1], k)
        return None, ([], [], [], k)

    def walks_past(self, token_ids: Sequence[int], max_tokens: int, node: _Node | None) -> bool:
        """Whether a lookup of `token_ids` that stopped at `node` (`find`'s; None: it was
        evicted since) would now walk further: the node is gone or has gained a child
        for the next block."""
        if node is None or node.parent is not None and not self.attached(node):
            return True
        bs, d = self.block_size, node.depth
        if (d + 1) * bs > min(max_tokens, len(token_ids)):
            return False
        return tuple(token_ids[d * bs : (d + 1) * bs]) in node.children

    def count_hit(self, hit: PrefixHit | None) -> None:
        """Count a query that started a row, and its hit (None: it missed)."""
        self.stats.queries += 1
        if hit is not None:
            self.stats.hits += 1
            self.stats.hit_tokens += hit.num_tokens

    def _restorable(self, path: list[_Node]) -> bool:
        boundary = len(path) * self.block_size
        for li, layer in enumerate(self.template):
            if isinstance(layer, RecurrentLayout):
                if path[-1].data[li] is None:
                    return False
            elif any(
                path[j].data[li] is None or path[j].starts[li] > self._need_from(layer, boundary, j)
                for j in self._blocks_needed(layer, boundary)
            ):
                return False
        return True

    def _need_from(self, layer: KVLayout, boundary: int, j: int) -> int:
        """The first position of block `j` a restore at `boundary` needs: the whole block, except
        the oldest recent block of a ring layer, whose positions before the window are unused."""
        lo = j * self.block_size
        if layer.window is None or lo < layer.keep:
            return lo
        return max(lo, boundary - (layer.window - layer.keep) + 1)

    def _blocks_needed(self, layer: KVLayout, boundary: int) -> list[int]:
        bs = self.block_size
        if layer.window is None:
            return list(range(boundary // bs))
        recent_from = max(layer.keep, boundary - (layer.window - layer.keep) + 1)
        sink_blocks = set(range((min(layer.keep, boundary) + bs - 1) // bs))
        return sorted(sink_blocks | set(range(recent_from // bs, boundary // bs)))

    # ---------------------------------------------------------------- restore

    def restore(self, hit: PrefixHit) -> list[Any]:
        """One-row layouts (the template's kinds) holding the hit's `num_tokens` tokens."""
        path = self._path(hit.node)
        boundary = hit.num_tokens
        out: list[Any] = []
        for li, layer in enumerate(self.template):
            if isinstance(layer, RecurrentLayout):
                row = layer.empty_like(1)
                row.cache = list(path[-1].data[li])
                row._n = np.array([boundary], dtype=np.int64)
                out.append(row)
                continue
            blocks = self._blocks_needed(layer, boundary)
            bufs = [
                mx.concatenate(self._pieces(path, blocks, li, b), axis=2)
                for b in range(len(path[blocks[0]].data[li]))
            ]
            positions = np.concatenate(
                [np.arange(path[j].starts[li], (j + 1) * self.block_size) for j in blocks]
            )
            out.append(place(layer, RowKV(boundary, positions, bufs, layer.codec)))
        return out

    def _pieces(self, path: list[_Node], blocks: list[int], li: int, b: int) -> list[mx.array]:
        """Buffer `b` of layer `li` over `blocks` of `path`: consecutive blocks of one segment
        as one slice of it, other blocks as they are stored."""
        pieces: list[mx.array] = []
        run: tuple[_Segment, int, int] | None = None  # segment, first column, end column
        for j in blocks:
            node = path[j]
            seg = node.segs[li]
            if seg is not None and run is not None and seg[0] is run[0] and seg[1] == run[2]:
                run = (run[0], run[1], seg[1] + self.block_size)
                continue
            if run is not None:
                pieces.append(run[0].arrays[b][:, :, run[1] : run[2]])
                run = None
            if seg is not None:
                run = (seg[0], seg[1], seg[1] + self.block_size)
            else:
                pieces.append(node.data[li][b])
        if run is not None:
            pieces.append(run[0].arrays[b][:, :, run[1] : run[2]])
        return pieces

    # ---------------------------------------------------------------- insert

    def insert(
        self, token_ids: Sequence[int], row: Sequence[Any], key: int = 0, *,
        limit: int | None = None, wait: bool = True, after: _Node | None = None,
    ) -> int:
        """Store the complete blocks of a one-row cache that has seen `token_ids` (the row's
        token count of them, or only the first `limit`) under `key` (see `lookup`). Returns the
        number of new trie nodes; `last_node` is then the deepest node of the row's path.

        `wait=False` queues the block copies (`mx.async_eval`) instead of waiting for them:
        for a row whose last column is still being computed by a step in flight. `after`: a
        `last_node` of an earlier insert of the same row (same ids, same key) that is still
        `attached`: the walk starts below it, so a long prompt stored chunk by chunk costs
        its new blocks only, not its whole path again at every chunk."""
        rows = [
            r if isinstance(r, RecurrentLayout) else adopt(t, r)
            for t, r in zip(self.template, row, strict=True)
        ]
        n = rows[0].num_tokens[0]
        upto = n if limit is None else min(n, limit)
        if upto > len(token_ids):
            raise ValueError(f"row has {upto} tokens but only {len(token_ids)} ids were given")
        # layers of one kind, geometry and width hold the row's positions alike: worked out once
        memo: dict[tuple[Any, ...], tuple[tuple[np.ndarray, np.ndarray], bool]] = {}
        positions: list[tuple[np.ndarray, np.ndarray] | None] = []
        # layers holding positions 0..n-1 in consecutive columns (full attention): each block is
        # whole at a known column, no search per block and layer
        flat: dict[int, int] = {}
        for li, r in enumerate(rows):
            if isinstance(r, RecurrentLayout):
                positions.append(None)
                continue
            shape = (type(r), r.geometry, r.capacity, int(r._n[0]))
            if shape not in memo:
                p = r.row_positions(0)
                memo[shape] = (p, _consecutive(p, n))
            p, consecutive = memo[shape]
            positions.append(p)
            if consecutive and r._bufs is not None:
                flat[li] = int(p[1][0])
        node, created = self._root(key), 0
        if after is not None and self.attached(after) and after.depth * self.block_size <= upto:
            node = after
        filled: list[mx.array] = []
        runs: dict[int, list[tuple[_Node, int]]] = {}  # layer -> whole blocks: (node, column)
        walked: list[_Node] = []
        for block in self._blocks(token_ids, upto, node.depth):
            child = node.children.get(block)
            if child is None:
                child = _Node(
                    block, node, node.depth + 1, data=[None] * len(rows),
                    starts=[node.depth * self.block_size] * len(rows), segs=[None] * len(rows),
                )
                node.children[block] = child
                self._lru[id(child)] = child
                created += 1
            filled += self._fill(child, rows, positions, n, runs, flat)
            walked.append(child)
            node = child
        bs = self.block_size
        for li, first in flat.items():
            runs[li] = [(nd, first + (nd.depth - 1) * bs) for nd in walked if nd.data[li] is None]
        filled += self._copy_runs(rows, runs)
        # Evaluate the stored blocks now (or queue them): an unevaluated slice would keep its
        # whole source buffer (the batch's KV) alive while the LRU counts only the block's bytes.
        if filled:
            (mx.eval if wait else mx.async_eval)(filled)
        self.last_node = node if node.parent is not None else None
        if node.parent is not None:
            self._touch(node)
        self.stats.inserted_blocks += created
        if created or filled:
            self.version += 1
        self._evict()
        return created

    def _fill(self, node: _Node, rows: list[Any], positions: list[Any], n: int,
              runs: dict[int, list[tuple[_Node, int]]], skip: Container[int] = ()) -> list[mx.array]:
        """Store what `node`'s block needs from each layer but those in `skip`; returns the new
        (lazy) arrays. A whole block held in consecutive columns is not copied here but added
        to `runs`, for `_copy_runs`."""
        bs = self.block_size
        new: list[mx.array] = []
        lo, hi = (node.depth - 1) * bs, node.depth * bs
        for li, r in enumerate(rows):
            if li in skip or node.data[li] is not None and node.starts[li] == lo:
                continue  # a whole block is stored already
            data: tuple[list[Any], int] | None = None
            if isinstance(r, RecurrentLayout):
                if hi == n and not r.empty():
                    data = [mx.contiguous(c) if c is not None else None for c in r.cache], lo
            else:
                found = self._block_columns(r, positions[li], lo, hi)
                if isinstance(found, int):  # the whole block, from this column on
                    if node.data[li] is None:
                        runs.setdefault(li, []).append((node, found))
                        continue
                    found = [mx.contiguous(b[:, :, found : found + bs]) for b in r._bufs], lo
                data = found
            if data is not None and (node.data[li] is None or data[1] < node.starts[li]):
                self._store(node, li, *data)
                new += [a for a in data[0] if a is not None]
        return new

    def _block_columns(
        self, r: KVLayout, positions: tuple[np.ndarray, np.ndarray], lo: int, hi: int
    ) -> tuple[list[mx.array], int] | int | None:
        """What `r` holds of positions [lo, hi): the first column of the whole block when it
        sits in consecutive columns (nothing copied yet), else (buffers, first position) of the
        whole block or, for a ring layer whose ring has moved past `lo`, of the block's newest
        positions (the restore of a boundary just past the block needs only those)."""
        pos, cols = positions  # sorted by position
        a, b = int(np.searchsorted(pos, lo)), int(np.searchsorted(pos, hi))
        count = b - a
        if r._bufs is None or count == 0 or (count != hi - lo and r.window is None):
            return None
        start = int(pos[a])
        if int(pos[b - 1]) != hi - 1 or count != hi - start:
            return None
        idx = cols[a:b]
        if int(idx[-1] - idx[0]) == count - 1:
            first = int(idx[0])
            if start == lo:
                return first
            return [mx.contiguous(b[:, :, first : first + count]) for b in r._bufs], start
        idx_mx = mx.array(idx, dtype=mx.int32)
        return [mx.contiguous(b[:, :, idx_mx]) for b in r._bufs], start

    def _copy_runs(self, rows: list[Any], runs: dict[int, list[tuple[_Node, int]]]) -> list[mx.array]:
        """Copy each layer's runs of consecutive whole blocks (consecutive in the trie and in the
        row's columns) once, as a `_Segment` its nodes view; returns the new (lazy) arrays."""
        bs = self.block_size
        new: list[mx.array] = []
        for li, blocks in runs.items():
            start = 0
            for k in range(1, len(blocks) + 1):
                if k < len(blocks):
                    (prev, col), (node, c) = blocks[k - 1], blocks[k]
                    if node.depth == prev.depth + 1 and c == col + bs:
                        continue
                run, start = blocks[start:k], k
                c0, width = run[0][1], len(run) * bs
                arrays = [mx.contiguous(b[:, :, c0 : c0 + width]) for b in rows[li]._bufs]
                seg = _Segment(arrays, _arrays_nbytes(arrays), refs=len(run))
                self._nbytes += seg.nbytes
                new += arrays
                for i, (node, _) in enumerate(run):
                    node.data[li], node.starts[li] = arrays, (node.depth - 1) * bs
                    node.segs[li] = (seg, i * bs)
        return new

    def _store(self, node: _Node, li: int, arrays: list[Any], start: int) -> None:
        self._release(node, li)
        node.data[li], node.starts[li] = arrays, start
        self._nbytes += _arrays_nbytes(arrays)

    def _release(self, node: _Node, li: int) -> None:
        """Let layer `li`'s data of `node` go: its own arrays' bytes at once, a segment's when
        no other node holds it, and half of a segment or more at once by copying what its
        other nodes still hold (`_compact`)."""
        if node.data[li] is None:
            return
        seg = node.segs[li]
        if seg is None:
            self._nbytes -= _arrays_nbytes(node.data[li])
        else:
            s = seg[0]
            s.refs -= 1
            if s.refs == 0:
                self._nbytes -= s.nbytes
            elif 2 * s.refs * self.block_size <= s.arrays[0].shape[2]:
                self._compact(s)
            node.segs[li] = None
        node.data[li] = None

    def _compact(self, seg: _Segment) -> None:
        """Copy the blocks `seg`'s nodes still hold into a smaller segment, in place (the nodes
        share its list of arrays). They are its first blocks: a run is a path of the trie and
        eviction takes leaves, so the deepest blocks of a run go first. Without this a run
        whose tail was evicted while its first blocks stay (a prefix other requests share)
        would keep the whole run's memory."""
        keep = seg.refs * self.block_size
        arrays = [mx.contiguous(a[:, :, :keep]) for a in seg.arrays]
        mx.eval(arrays)
        nbytes = _arrays_nbytes(arrays)
        self._nbytes += nbytes - seg.nbytes
        seg.arrays[:], seg.nbytes = arrays, nbytes

    @property
    def limit(self) -> int:
        """The bytes the cache may hold now: `max_bytes`, or less when the memory budget leaves
        it less (`room`)."""
        return self.max_bytes if self.room is None else min(self.max_bytes, self.room)

    def set_room(self, room: int) -> None:
        """What the memory budget leaves the cache; least recently used blocks go at once."""
        self.room = max(0, room)
        self._evict()

    def holds(self, hit: PrefixHit) -> bool:
        """Whether `hit`'s blocks are still cached (none of its path was evicted)."""
        return self._lru.get(id(hit.node)) is hit.node

    def pinned_bytes(self, pins: Sequence[PrefixHit]) -> int:
        """Bytes the blocks on the paths of `pins` keep (eviction keeps them): their own
        arrays and the whole of every segment they view."""
        seen: dict[int, _Node] = {}
        for hit in pins:
            for node in self._path(hit.node):
                seen[id(node)] = node
        return held_bytes(seen.values())

    def evict_to(self, nbytes: int, pins: Sequence[PrefixHit] = ()) -> bool:
        """Evict least recently used blocks, never those on the paths of `pins`, until the
        cache holds at most `nbytes`. Evicts nothing when that cannot be reached; returns
        whether it was."""
        if self._nbytes <= nbytes:
            return True
        if self.pinned_bytes(pins) > nbytes:
            return False
        keep = {id(h.node) for h in pins}
        self._evict(nbytes, keep)
        return self._nbytes <= nbytes

    def _evict(self, nbytes: int | None = None, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Drop least recently used leaves (a pinned one stays, and so does its path: its
        parents are not leaves while it is there) until at most `nbytes` (default `limit`)."""
        target = self.limit if nbytes is None else nbytes
        while self._nbytes > target and self._lru:
            victim = next(
                (n for k, n in self._lru.items() if not n.children and k not in keep), None
            )
            if victim is None:
                break
            self._remove(victim)

    def _remove(self, node: _Node) -> None:
        """Unlink a leaf and let its arrays go (a hit still pointing at it is no longer held)."""
        assert node.parent is not None
        del node.parent.children[node.tokens]
        del self._lru[id(node)]
        for li in range(len(node.data)):
            self._release(node, li)
        if node.scores is not None:
            self._nbytes -= node.scores.nbytes
        self.stats.evicted_blocks += 1

    def attach_scores(self, node: _Node, scores: BlockScores) -> None:
        """A scoring pass's values for `node`'s tokens (counted in the cache's bytes)."""
        node.scores = scores
        self._nbytes += scores.nbytes

    def clear(self) -> None:
        self._roots.clear()
        self._lru.clear()
        self._nbytes = 0


def _consecutive(positions: tuple[np.ndarray, np.ndarray], n: int) -> bool:
    """Whether a layer's row holds positions 0..n-1 (sorted, so the ends tell) in consecutive
    columns."""
    pos, cols = positions
    return (len(pos) == n > 0 and int(pos[0]) == 0 and int(pos[-1]) == n - 1
            and bool((np.diff(cols) == 1).all()))


def held_bytes(nodes: Iterable[_Node]) -> int:
    """The bytes `nodes` keep alive: their own arrays, and each segment they view once, whole."""
    total, segs = 0, {}
    for node in nodes:
        for data, seg in zip(node.data, node.segs, strict=True):
            if seg is not None:
                segs[id(seg[0])] = seg[0].nbytes
            elif data is not None:
                total += _arrays_nbytes(data)
    return total + sum(segs.values())


def _row_view(layer: KVLayout | RecurrentLayout, i: int) -> KVLayout | RecurrentLayout:
    """Row `i` of a batch layout as a one-row layout over views of the batch's buffers (no
    copy: the prefix cache copies only the blocks it stores; a recurrent state is small)."""
    if isinstance(layer, RecurrentLayout):
        return layer.extract(i)
    out = layer.empty_like(1)
    out._n = layer._n[i : i + 1].copy()
    if layer._bufs is not None:
        out._bufs = [b[i : i + 1] for b in layer._bufs]
    return out


@dataclass(slots=True)
class _Looked:
    """A waiting row's last lookup: its hit (None: missed, or dropped), the cache's
    `version` then, and where the walk stopped (weakly: eviction is not held up by it)."""

    hit: PrefixHit | None
    version: int
    end: weakref.ref[_Node]


class PrefixIndex:
    """The scheduler's prefix-cache policy over a `PrefixCache` (see the module docstring)."""

    def __init__(
        self, make_caches: MakeCaches, max_bytes: int, block_size: int = 16,
        prefill_chunk: int = 512,
    ) -> None:
        template = make_caches(0)
        self.cache = PrefixCache(template, block_size=block_size, max_bytes=max_bytes)
        self.block_size = block_size
        rings = [layer.ring_size for layer in template if getattr(layer, "ring_size", None)]
        # a chunk ends on a block boundary and, with ring layers, leaves every block in the ring
        limit = min([r - block_size for r in rings], default=UNBOUNDED_CHUNK)
        self.max_chunk = max(block_size, limit // block_size * block_size)
        self.chunk = min(self.max_chunk, max(block_size, prefill_chunk // block_size * block_size))
        self._make_caches = make_caches
        self._looked: dict[str, _Looked] = {}  # req_id -> its last lookup
        # Ring and recurrent layers cannot give a finished row's earlier boundaries back (the
        # ring moved on, the state is at the row's length), so rows capture each boundary while
        # decoding, at most `_reach` tokens past it (ring: window - keep positions before the
        # boundary must still be held; recurrent: the state must be exactly at it).
        recurrent = any(isinstance(t, RecurrentLayout) for t in template)
        if recurrent:  # its states are snapshotted at chunk ends only: keep them frequent
            self.max_chunk = self.chunk
        ring_slack = [layer.slack for layer in template if getattr(layer, "ring_size", None)]
        self._capture = recurrent or bool(ring_slack)
        self._reach = 0 if recurrent else 1 + min(ring_slack, default=0)
        self._store_finished = not recurrent  # the recurrent state is past the last boundary
        # hits are used in multiples of this many blocks, and long prompts' chunks are too
        # (engine.runner.buckets_prefill_shapes: bucketed prefill shapes on MLX-CUDA)
        self.hit_blocks = 1

    def lookup(self, row: RowMeta) -> None:
        """Find the row's longest cached prefix (at most prompt - 1 tokens), again while it
        waits whenever the cache has stored blocks since (requests that share a system prompt
        and arrive together hit it once the first one's prefill stored it) or its hit was
        evicted."""
        version, ids = self.cache.version, row.request.prompt_ids
        looked = self._looked.get(row.req_id)
        if looked is not None and (looked.hit is None or self.cache.holds(looked.hit)):
            if looked.version == version:
                return
            # nothing new on its path (the common case: a cheap check, not a walk); the hit is
            # the walk's end, or its last multiple of `hit_blocks` blocks
            end = looked.end()
            m = self.hit_blocks
            hit_depth = looked.hit.node.depth if looked.hit else 0
            whole = end is not None and end.depth // m * m == hit_depth
            if whole and not self.cache.walks_past(ids, len(ids) - 1, end):
                looked.version = version
                return
        hit, end = self.cache.find(ids, max_tokens=len(ids) - 1, key=row.adapter,
                                   multiple=self.hit_blocks)
        self._looked[row.req_id] = _Looked(hit, version, weakref.ref(end))
        row.num_cached_tokens = hit.num_tokens if hit is not None else 0

    def forget(self, row: RowMeta) -> None:
        self._looked.pop(row.req_id, None)

    def _hit(self, row: RowMeta) -> PrefixHit | None:
        looked = self._looked.get(row.req_id)
        return looked.hit if looked is not None else None

    def _insert(self, row: RowMeta, ids: Sequence[int], layers: Sequence[Any], *,
                limit: int | None = None, wait: bool = True) -> None:
        """Insert for `row`, resuming below where its previous insert ended."""
        row.prefix_node = self._insert_after(row.prefix_node, ids, layers, row.adapter,
                                             limit=limit, wait=wait)

    def _insert_after(self, after: Any, ids: Sequence[int], layers: Sequence[Any], key: int, *,
                      limit: int | None = None, wait: bool = True) -> Any:
        """`cache.insert`, its walk resuming below `after` (a weak reference to the deepest node
        of an earlier insert of the same sequence, or None: an evicted node is not kept alive by
        it); returns the weak reference for the next insert."""
        node = after() if after is not None else None
        self.cache.insert(ids, layers, key, limit=limit, wait=wait, after=node)
        last = self.cache.last_node
        return weakref.ref(last) if last is not None else None

    def drop_hit(self, row: RowMeta) -> None:
        """Prefill the row from scratch: its hit's blocks may be evicted."""
        looked = self._looked.get(row.req_id)
        if looked is not None:
            looked.hit = None
        row.num_cached_tokens = 0

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def make_room(self, nbytes: int, rows: Sequence[RowMeta] = ()) -> bool:
        """Evict least recently used blocks until the cache holds at most `nbytes`, keeping
        the blocks the hits of `rows` will restore; nothing is evicted when that cannot be
        reached. Returns whether it was."""
        pins = [h for h in map(self._hit, rows) if h is not None]
        return nbytes >= 0 and self.cache.evict_to(nbytes, pins)

    def set_room(self, nbytes: int) -> None:
        """What the memory budget leaves the cache until the next call (engine.scheduler)."""
        self.cache.set_room(nbytes)

    def group_caches(self, rows: list[RowMeta]) -> list[Any]:
        hits = [self._hit(r) for r in rows]
        for r, h in zip(rows, hits, strict=True):
            self.forget(r)
            self.cache.count_hit(h)
        assert all(h is None or self.cache.holds(h) for h in hits), "a picked row's hit was evicted"
        if not any(hits):
            return self._make_caches(len(rows))
        # rows with the same hit (an agent's sessions on its system prompt) share one restore:
        # the merge copies it into each row, so nothing of it is written twice
        restored: dict[tuple[int, int], list[Any]] = {}
        parts = []
        for h in hits:
            if h is None:
                parts.append(self._make_caches(1))
                continue
            key = (id(h.node), h.num_tokens)
            if key not in restored:
                restored[key] = self.cache.restore(h)
            parts.append(restored[key])
        return kvb.merge_rows(None, parts)

    def store(self, rows: list[RowMeta], caches: list[Any], wait: bool = True) -> None:
        """Insert the complete blocks each row now holds; `wait=False` queues the copies behind
        the chunk that wrote the blocks, which may still be computing."""
        counts = kvb.num_tokens(caches)
        for i, row in enumerate(rows):
            n = int(counts[i])
            if n >= self.block_size:
                # views of the row, not a copy: only the new blocks are copied (a row restored
                # from a long cached prefix would otherwise copy its whole history first)
                views = [_row_view(layer, i) for layer in caches]
                self._insert(row, row.request.prompt_ids[:n], views, wait=wait)

    def store_scored(self, ids: Sequence[int], caches: list[Any], after: Any = None,
                     scores: JobScores | None = None) -> Any:
        """Insert the complete blocks of a scoring pass's one-row `caches`, which hold `ids`
        (the base model's KV: no adapter), so that a generation from the same prompt restores
        them, with the pass's `scores` of their tokens, so that a later pass over the same
        prefix reads them (`scored_prefix`). `after` is what the previous call for the same
        prompt returned (the walk resumes below it); returns the next one. The copies are
        queued, not waited for."""
        ref = self._insert_after(after, ids, [_row_view(layer, 0) for layer in caches], 0,
                                 wait=False)
        if scores is None or ref is None:
            return ref
        logprobs, ranks, top, k = scores
        node, bs = ref(), self.block_size
        while node is not None and node.parent is not None and node.scores is None:
            lo = (node.depth - 1) * bs
            span = range(lo, lo + bs)  # token t's values are at t - 1
            self.cache.attach_scores(node, BlockScores(
                [logprobs[t - 1] if t else None for t in span],
                [ranks[t - 1] if t else None for t in span],
                [top[t - 1] if t else [] for t in span], k))
            node = node.parent
        return ref

    def scored_prefix(self, ids: Sequence[int], k: int) -> tuple[list[Any] | None, JobScores]:
        """For a scoring pass over `ids` with `k` alternatives: one-row layouts holding the
        longest cached prefix whose tokens' scores earlier passes stored (`find_scored`), and
        those scores (indexed by token - 1); (None, empty) when there is none."""
        hit, scores = self.cache.find_scored(ids, k)
        return (self.cache.restore(hit) if hit is not None else None), scores

    def advance(self, rows: Sequence[RowMeta], caches: list[Any] | None) -> None:
        """While decoding (ring or recurrent layers only): a row whose length has just passed
        a block boundary stores its blocks up to it, as prompt chunks do ("ring-safe
        chunking"), so a next turn that diverges inside this answer can restore up to there.
        The copies are queued, not waited for."""
        if not self._capture or caches is None:
            return
        bs = self.block_size
        counts = kvb.num_tokens(caches)
        for i, row in enumerate(rows):
            n = int(counts[i])
            boundary = n // bs * bs
            if row.finished or boundary <= row.prefix_boundary or n - boundary > self._reach:
                continue
            row.prefix_boundary = boundary
            prompt = row.request.prompt_ids
            if boundary <= len(prompt) // bs * bs:
                continue  # the prefill stored these
            ids = [*prompt, *row.output_ids]
            if len(ids) < n:
                continue  # the row has seen tokens it has not emitted (cannot happen mid-answer)
            views = [_row_view(layer, i) for layer in caches]
            self._insert(row, ids, views, limit=n, wait=False)

    def finish(self, row: RowMeta, caches: list[Any], i: int, tail: Sequence[int] = ()) -> None:
        """Insert the whole sequence of row `i` of the running batch, which has just finished:
        its prompt, its output and `tail` (the stop token it ended on, which the next turn's
        template usually renders). Only positions whose KV the row holds are stored: not the
        last sampled token (never fed back), not a ring layer's positions that left its ring.
        The copies are queued, not waited for: the row's newest column may belong to the step
        still in flight."""
        if not self._store_finished:
            return
        prompt = row.request.prompt_ids
        ids = [*prompt, *row.output_ids, *tail]
        n = min(int(kvb.num_tokens(caches)[i]), len(ids))
        if n // self.block_size <= len(prompt) // self.block_size:
            return  # no complete block beyond those the prefill stored
        self._insert(row, ids, [_row_view(layer, i) for layer in caches], limit=n, wait=False)

    def stats(self) -> PrefixCacheStats:
        s, c = self.cache.stats, self.cache
        return PrefixCacheStats(
            bytes=c.nbytes, max_bytes=c.max_bytes, queries=s.queries, hits=s.hits,
            hit_tokens=s.hit_tokens, blocks=c.num_blocks, evicted_blocks=s.evicted_blocks,
        )


class NoPrefix:
    """`PrefixIndex` with the cache off: nothing is looked up or kept. Chunks grow past
    `prefill_chunk` only for models without ring layers (a ring holds a whole chunk while it
    is written)."""

    block_size = 16
    hit_blocks = 1

    def __init__(self, make_caches: MakeCaches, prefill_chunk: int = 512) -> None:
        self._make_caches = make_caches
        self.chunk = prefill_chunk
        rings = any(getattr(layer, "ring_size", None) for layer in make_caches(0))
        self.max_chunk = prefill_chunk if rings else UNBOUNDED_CHUNK

    def lookup(self, row: RowMeta) -> None:
        del row

    def forget(self, row: RowMeta) -> None:
        del row

    def drop_hit(self, row: RowMeta) -> None:
        del row

    nbytes = 0

    def make_room(self, nbytes: int, rows: Sequence[RowMeta] = ()) -> bool:
        del rows
        return nbytes >= 0

    def set_room(self, nbytes: int) -> None:
        del nbytes

    def group_caches(self, rows: list[RowMeta]) -> list[Any]:
        return self._make_caches(len(rows))

    def store(self, rows: list[RowMeta], caches: list[Any], wait: bool = True) -> None:
        del rows, caches, wait

    def store_scored(self, ids: Sequence[int], caches: list[Any], after: Any = None,
                     scores: JobScores | None = None) -> Any:
        del ids, caches, after, scores
        return None

    def scored_prefix(self, ids: Sequence[int], k: int) -> tuple[list[Any] | None, JobScores]:
        del ids
        return None, ([], [], [], k)

    def advance(self, rows: Sequence[RowMeta], caches: list[Any] | None) -> None:
        del rows, caches

    def finish(self, row: RowMeta, caches: list[Any], i: int, tail: Sequence[int] = ()) -> None:
        del row, caches, i, tail

    def stats(self) -> None:
        return None
