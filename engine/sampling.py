"""Sampling for the whole batch at once: pure functions over [B, V] arrays, no loop over rows.

Processing order (`process_logits`), every step a [B, V] array op:

1. penalties — repetition (HF-style, over prompt + generated tokens: a positive logit is divided
   by the penalty, a negative one multiplied), then frequency and presence (OpenAI-style, over
   generated tokens only: ``logit -= frequency * count + presence * (count > 0)``);
2. logit_bias — a dense [B, V] bias is added; `allowed_token_ids` is -inf on every other token;
3. temperature — logits are divided by it; temperature 0 means greedy: those rows are left
   unscaled and skip the filters below (none of them can move the argmax);
4. top-k — keep the k largest (k = 0 or k >= V: off);
5. top-p — keep the smallest set of most likely tokens whose probability (after top-k,
   renormalised) sums to >= top_p; always at least one token;
6. min-p — keep tokens with prob >= min_p * max_prob, i.e. ``logit >= max_logit + log(min_p)``;
   the ratio does not depend on renormalisation, so it reads the same before or after 4-5;
7. draw — greedy rows take the argmax; the others take ``argmax(processed + gumbel)``.

Filters 4-6 are all "keep ``logit >= threshold``" with one threshold per row, so they end in a
single mask; tokens tied with a threshold are kept (top-k may keep more than k when the k-th
largest is tied; vLLM's top-k does the same). Masked entries are -inf.
Rows with neutral settings come out bit-for-bit equal to their input logits.

Work is skipped by Python-level flags computed once per batch composition (`from_params`,
`take`, `concat`), never per step: no sort unless some row samples with top-p or top-k, and then
only those rows: rows with top-k take a partition and sort just their max_top_k candidates (top-p
within the top k needs nothing else); rows with top-p alone sort all V, except on the CPU, where
the largest `TOP_P_CANDIDATES` are sorted first and all V only when top-p reaches past them. No noise when
every row is greedy, no [B, V] penalty arrays (`counts`, `seen`) unless some row needs them.

Random numbers: a counter-based hash, so a row's noise depends only on (seed, step, token index)
and never on its batch mates. With murmur3's 32-bit finaliser ``fmix32`` (uint32 arithmetic,
multiplication wraps mod 2**32)::

    k1 = fmix32(fmix32(seed ^ 0x5BD1E995) + step * 0x9E3779B9)  # [B]
    k2 = fmix32(k1 + 0x9E3779B9)                                 # [B]
    j  = fmix32(index * 0xCC9E2D51 + 0x1B873593)                 # [V], cached per V
    h  = fmix32(fmix32(k1 ^ j) + k2)                             # [B, V]
    u  = min((h + 0.5) / 2**32, 1 - 2**-24)                      # float32, in (0, 1)
    gumbel = -log(-log1p(-u))          # small u <-> large gumbel: float32 is finest where it wins

For a fixed seed, k1 is a bijection of step (and for a fixed step, of seed), and within a row h
is a bijection of index, so no two tokens of a row share a number. Gumbel-max
(``argmax(logits + gumbel)``) is an exact draw from softmax(logits) and needs no normalisation.

Worked example, seed 42, step 0 (`tests/test_sampling.py` checks these numbers)::

    k1 = 0x6EAB091A, k2 = 0x82EC89F3
    index 0: h = 0xA6A3BFB2, u = 0.6509361
    index 1: h = 0x7C9EA198, u = 0.4867955
    index 2: h = 0x3512CC8F, u = 0.2073181

The same (seed, step) gives the same row of noise whatever the batch; the runner gives unseeded
requests a random seed at admission and `record` advances `steps` after every draw.

Logprobs are the model's: log-softmax of the raw logits (before penalties, bias, temperature and
filters), as vLLM and OpenAI report them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.api import SamplingParams
from kernels.common import gpu_backend

_NEG_INF = float("-inf")
_MIN_TEMPERATURE = 1e-5  # below this a row is greedy (dividing would overflow)
_ONE_BELOW = 1.0 - 2.0**-24  # largest float32 below 1
_U32 = 0xFFFFFFFF


def _fmix32(h: mx.array) -> mx.array:
    """murmur3's finaliser: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


def _row_keys(seeds: mx.array, steps: mx.array) -> tuple[mx.array, mx.array]:
    k1 = _fmix32(
        _fmix32(seeds.astype(mx.uint32) ^ 0x5BD1E995) + steps.astype(mx.uint32) * 0x9E3779B9
    )
    return k1, _fmix32(k1 + 0x9E3779B9)


@lru_cache(maxsize=8)
def _index_hash(vocab_size: int) -> mx.array:
    j = _fmix32(mx.arange(vocab_size, dtype=mx.uint32) * 0xCC9E2D51 + 0x1B873593)
    mx.eval(j)
    return j


def uniform_noise(seeds: mx.array, steps: mx.array, vocab_size: int) -> mx.array:
    """[B, V] float32 in (0, 1); entry (b, i) depends only on (seeds[b], steps[b], i)."""
    k1, k2 = _row_keys(seeds, steps)
    h = _fmix32(_fmix32(k1[:, None] ^ _index_hash(vocab_size)[None, :]) + k2[:, None])
    u = (h.astype(mx.float32) + 0.5) * 2.0**-32
    return mx.minimum(u, _ONE_BELOW)


def gumbel_noise(seeds: mx.array, steps: mx.array, vocab_size: int) -> mx.array:
    """[B, V] standard Gumbel noise from `uniform_noise` (finite everywhere)."""
    u = uniform_noise(seeds, steps, vocab_size)
    # exponential = -log1p(-u); below 2**-8 a 3-term series (error < u**4 / 4), where 1 - u
    # would round; mx.log1p is ~4x slower than mx.log on the CPU
    exponential = mx.where(u < 2.0**-8, u * (1.0 + u * (0.5 + u / 3.0)), -mx.log(1.0 - u))
    return -mx.log(exponential)


def _fold_seed(seed: int) -> int:
    """Any Python int (OpenAI seeds are int64) to uint32."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & _U32


def _row_indices(mask: np.ndarray) -> mx.array | None:
    return mx.array(np.flatnonzero(mask).astype(np.int32)) if mask.any() else None


@dataclass(slots=True)
class SamplerState:
    """Struct-of-arrays for B rows (all mx.arrays, leading dim B).

    Build it with `from_params`; change the rows only with `take`, `concat` and `record`.
    `vocab_size`, `has_bias` and `row_top_logprobs` are per-batch / per-row data beyond the
    engine's contract (filled in when a state is constructed directly). The fields after them are
    host-side flags that `__post_init__` derives from a host mirror of the [B] settings, so
    `process_logits` knows which work to skip without waiting on the device; it also drops
    [B, V] arrays that no row needs.
    """

    temperature: mx.array  # [B] float32 (0 = greedy)
    top_p: mx.array  # [B] float32
    top_k: mx.array  # [B] int32 (0 = off)
    min_p: mx.array  # [B] float32
    repetition_penalty: mx.array  # [B] float32
    presence_penalty: mx.array  # [B] float32
    frequency_penalty: mx.array  # [B] float32
    seeds: mx.array  # [B] uint32
    steps: mx.array  # [B] uint32, draws made so far (the RNG counter)
    counts: mx.array | None  # [B, V] int32 generated-token counts (None: no presence/frequency)
    seen: mx.array | None  # [B, V] bool prompt+generated tokens (None: no repetition penalty)
    bias: mx.array | None  # [B, V] float32 logit bias, -inf outside allowed_token_ids
    num_top_logprobs: int  # max top_logprobs across rows (0 = none)
    want_logprobs: bool
    vocab_size: int = 0
    has_bias: mx.array | None = None  # [B] bool: the row has a logit_bias / allowed_token_ids
    row_top_logprobs: mx.array | None = None  # [B] int32: -1 no logprobs, else top_logprobs
    _host: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # [B] settings
    # derived flags (set by __post_init__)
    all_greedy: bool = field(init=False, default=False)
    any_greedy: bool = field(init=False, default=False)
    needs_temperature: bool = field(init=False, default=False)  # a sampled row has t != 1
    needs_min_p: bool = field(init=False, default=False)
    # sampled rows with top-k (maybe top-p too): a partition to max_top_k candidates
    top_k_rows: mx.array | None = field(init=False, default=None)
    max_top_k: int = field(init=False, default=0)
    # sampled rows with top-p and no top-k: a full sort
    top_p_only_rows: mx.array | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        _fill_missing(self)
        _derive_flags(self)

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def needs_sort(self) -> bool:
        return self.top_k_rows is not None or self.top_p_only_rows is not None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        vocab_size: int,
        seeds: Sequence[int],
    ) -> SamplerState:
        """One row per request. Raises ValueError for token ids outside [0, vocab_size)."""
        num_rows, V = len(params), vocab_size
        if not (len(prompt_ids) == len(seeds) == num_rows):
            raise ValueError("params, prompt_ids and seeds must have one entry per row")
        temperature = np.array([p.temperature for p in params], np.float32)
        temperature[temperature < _MIN_TEMPERATURE] = 0.0
        top_k = np.array([p.top_k for p in params], np.int64)
        top_k = np.where((top_k <= 0) | (top_k >= V), 0, top_k).astype(np.int32)
        rep = np.array([p.repetition_penalty for p in params], np.float32)
        presence = np.array([p.presence_penalty for p in params], np.float32)
        frequency = np.array([p.frequency_penalty for p in params], np.float32)
        row_top = np.array(
            [max(p.top_logprobs, 0) if (p.logprobs or p.top_logprobs > 0) else -1 for p in params],
            np.int32,
        )
        seen = None
        if (rep != 1.0).any():
            seen = np.zeros((num_rows, V), np.bool_)
            for row, ids in enumerate(prompt_ids):  # admission only, not the step loop
                seen[row, _check_ids(ids, V, "prompt")] = True
        bias, has_bias = _dense_bias(params, V)
        return cls(
            temperature=mx.array(temperature),
            top_p=mx.array(np.clip([p.top_p for p in params], 0.0, 1.0).astype(np.float32)),
            top_k=mx.array(top_k),
            min_p=mx.array(np.clip([p.min_p for p in params], 0.0, 1.0).astype(np.float32)),
            repetition_penalty=mx.array(rep),
            presence_penalty=mx.array(presence),
            frequency_penalty=mx.array(frequency),
            seeds=mx.array(np.array([_fold_seed(s) for s in seeds], np.uint32)),
            steps=mx.zeros((num_rows,), mx.uint32),
            counts=(
                mx.zeros((num_rows, V), mx.int32)
                if ((presence != 0) | (frequency != 0)).any()
                else None
            ),
            seen=None if seen is None else mx.array(seen),
            bias=None if bias is None else mx.array(bias),
            num_top_logprobs=0,
            want_logprobs=False,
            vocab_size=V,
            has_bias=mx.array(has_bias),
            row_top_logprobs=mx.array(row_top),
        )

    @classmethod
    def concat(cls, states: Sequence[SamplerState]) -> SamplerState:
        """Rows of `states` in order; a [B, V] field missing in some is materialised as neutral."""
        if not states:
            raise ValueError("concat needs at least one state")
        V = max(s.vocab_size for s in states)
        if any(s.vocab_size not in (0, V) for s in states):
            raise ValueError("concat of states with different vocab sizes")
        return cls(
            **{name: mx.concatenate([getattr(s, name) for s in states]) for name in _ROW_FIELDS},
            counts=_concat_optional([(s.counts, s.batch_size) for s in states], V, mx.int32, 0),
            seen=_concat_optional([(s.seen, s.batch_size) for s in states], V, mx.bool_, False),
            bias=_concat_optional([(s.bias, s.batch_size) for s in states], V, mx.float32, 0.0),
            num_top_logprobs=0,
            want_logprobs=False,
            vocab_size=V,
            _host={n: np.concatenate([s._host[n] for s in states]) for n in _HOST_FIELDS},
        )

    def take(self, indices: mx.array | Sequence[int]) -> SamplerState:
        """Keep these rows, in this order; [B, V] fields no kept row needs are dropped."""
        host_idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        idx = mx.array(host_idx.astype(np.int32))
        return SamplerState(
            **{name: getattr(self, name)[idx] for name in _ROW_FIELDS},
            counts=None if self.counts is None else self.counts[idx],
            seen=None if self.seen is None else self.seen[idx],
            bias=None if self.bias is None else self.bias[idx],
            num_top_logprobs=0,
            want_logprobs=False,
            vocab_size=self.vocab_size,
            _host={name: self._host[name][host_idx] for name in _HOST_FIELDS},
        )

    def record(self, tokens: mx.array) -> SamplerState:
        """After a draw: steps += 1 and the chosen tokens ([B] int) enter counts and seen.

        [B, T] tokens (several accepted tokens per row) advance steps by T.
        """
        tokens = tokens.astype(mx.int32)
        if tokens.ndim == 1:
            tokens = tokens[:, None]
        counts, seen = self.counts, self.seen
        if counts is not None:
            rows = mx.arange(tokens.shape[0], dtype=mx.int32)[:, None]
            counts = counts.at[rows, tokens].add(1)  # .at adds a repeated id twice
        if seen is not None:
            seen = mx.put_along_axis(seen, tokens, mx.array(True), axis=1)
        # A copy, not `replace`: the host mirror and the flags derived from it do not change,
        # and re-deriving them every decode step is host time the GPU waits for.
        out = copy.copy(self)
        out.steps, out.counts, out.seen = self.steps + tokens.shape[1], counts, seen
        return out

    def replace_last(self, rows: mx.array, old: mx.array, new: mx.array, before: SamplerState,
                     before_rows: Sequence[int]) -> SamplerState:
        """The last draw of `rows` ([N] int32) is `new` instead of the `old` it recorded: their
        counts and seen tokens as if `record` had taken `new`. `before` is the state that draw
        was made from (`before_rows`: the same rows there), for what the rows had seen before
        it. The RNG counter (`steps`) is unchanged: one draw either way."""
        out = copy.copy(self)
        if self.counts is not None and before.counts is not None:
            out.counts = self.counts.at[rows, old].add(-1).at[rows, new].add(1)
        if self.seen is not None and before.seen is not None:
            was = before.seen[mx.array(np.asarray(before_rows, np.int32)), old]
            out.seen = self.seen.at[rows, old].minimum(was).at[rows, new].maximum(mx.array(True))
        return out


_ROW_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seeds",
    "steps",
    "has_bias",
    "row_top_logprobs",
)
# [B] fields mirrored on the host, so that flags never wait on the device
_HOST_FIELDS = tuple(f for f in _ROW_FIELDS if f not in ("seeds", "steps"))


def _fill_missing(state: SamplerState) -> None:
    """Complete a state built directly from the contract's fields (no-op after from_params)."""
    B = state.batch_size
    for big in (state.counts, state.seen, state.bias):
        if state.vocab_size == 0 and big is not None:
            state.vocab_size = int(big.shape[-1])
    if state.has_bias is None:
        state.has_bias = mx.full((B,), state.bias is not None, mx.bool_)
    if state.row_top_logprobs is None:
        k = state.num_top_logprobs if state.want_logprobs else -1
        state.row_top_logprobs = mx.full((B,), k, mx.int32)
    if not state._host:
        state._host = {name: np.array(getattr(state, name)) for name in _HOST_FIELDS}


def _derive_flags(state: SamplerState) -> None:
    """Host-side flags from the host mirror; drop [B, V] fields that no row needs."""
    h = state._host
    greedy = h["temperature"] == 0
    sampled = ~greedy
    top_k_rows = sampled & (h["top_k"] > 0)
    top_p_only_rows = sampled & (h["top_p"] < 1) & ~top_k_rows
    state.all_greedy = bool(greedy.all())
    state.any_greedy = bool(greedy.any())
    state.needs_temperature = bool((sampled & (h["temperature"] != 1)).any())
    state.needs_min_p = bool((sampled & (h["min_p"] > 0)).any())
    state.top_k_rows = _row_indices(top_k_rows)
    state.max_top_k = int(h["top_k"][top_k_rows].max()) if top_k_rows.any() else 0
    state.top_p_only_rows = _row_indices(top_p_only_rows)
    state.num_top_logprobs = int(max(h["row_top_logprobs"].max(initial=-1), 0))
    state.want_logprobs = bool((h["row_top_logprobs"] >= 0).any())
    if not ((h["presence_penalty"] != 0) | (h["frequency_penalty"] != 0)).any():
        state.counts = None
    if not (h["repetition_penalty"] != 1).any():
        state.seen = None
    if not h["has_bias"].any():
        state.bias = None


def _check_ids(ids: Sequence[int], vocab_size: int, what: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"{what} token id out of range [0, {vocab_size})")
    return arr


def _dense_bias(params: Sequence[SamplingParams], V: int) -> tuple[np.ndarray | None, np.ndarray]:
    has_bias = np.array([bool(p.logit_bias) or p.allowed_token_ids is not None for p in params])
    if not has_bias.any():
        return None, has_bias
    bias = np.zeros((len(params), V), np.float32)
    for row, p in enumerate(params):  # admission only, not the step loop
        if p.allowed_token_ids is not None:
            allowed = _check_ids(p.allowed_token_ids, V, "allowed_token_ids")
            if allowed.size == 0:
                raise ValueError("allowed_token_ids must not be empty")
            bias[row] = _NEG_INF
            bias[row, allowed] = 0.0
        if p.logit_bias:
            ids = _check_ids([int(t) for t in p.logit_bias], V, "logit_bias")
            bias[row, ids] += np.array(list(p.logit_bias.values()), np.float32)
    return bias, has_bias


def _concat_optional(
    parts: list[tuple[mx.array | None, int]], V: int, dtype: mx.Dtype, neutral: float | bool
) -> mx.array | None:
    if all(a is None for a, _ in parts):
        return None
    return mx.concatenate(
        [a if a is not None else mx.full((n, V), neutral, dtype) for a, n in parts]
    )


# ---------------------------------------------------------------------------------------------
# the hot path


def _apply_penalties(x: mx.array, state: SamplerState) -> mx.array:
    if state.seen is not None:
        rep = state.repetition_penalty[:, None]
        x = mx.where(state.seen, mx.where(x > 0, x / rep, x * rep), x)
    if state.counts is not None:
        counts = state.counts.astype(mx.float32)
        x = x - (
            state.frequency_penalty[:, None] * counts
            + state.presence_penalty[:, None] * (counts > 0).astype(mx.float32)
        )
    return x


def _nucleus(desc: mx.array, probs: mx.array, top_p: mx.array) -> tuple[mx.array, mx.array]:
    """The top-p threshold [n] over sorted logits `desc` [n, m] with probabilities `probs`
    (the smallest value of the fewest most likely tokens whose mass reaches top_p, at least
    one), and the mass before each position [n, m]."""
    mass_before = mx.cumsum(probs, axis=-1) - probs
    num_kept = mx.maximum((mass_before < top_p[:, None]).sum(axis=-1).astype(mx.int32), 1)
    return mx.take_along_axis(desc, (num_kept - 1)[:, None], axis=-1)[:, 0], mass_before


def _top_k_top_p_threshold(x: mx.array, top_k: mx.array, top_p: mx.array, num: int) -> mx.array:
    """[n] the smallest logit that top-k then top-p keep, for rows `x` [n, V].

    Only each row's `num` largest logits are sorted (num >= every top_k; num = V where top_k
    is 0): a partition is O(V). Top-p renormalises over the top-k survivors, which are those
    candidates plus any tokens tied with the k-th largest that the partition left out; their
    mass enters the normaliser, and if top-p reaches them the threshold is the tie value.
    """
    V = x.shape[-1]
    if num < V:
        desc = -mx.sort(mx.partition(-x, num - 1, axis=-1)[:, :num], axis=-1)
    else:
        desc = -mx.sort(-x, axis=-1)
    k = mx.where(top_k > 0, top_k, num)
    t_k = mx.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [n, 1]
    kept = desc >= t_k
    top = desc[:, :1]
    weights = mx.where(kept, mx.exp(desc - top), 0.0)
    norm = weights.sum(axis=-1)
    if num < V:  # ties with t_k outside the candidates
        num_left_out = (x >= t_k).sum(axis=-1) - kept.sum(axis=-1)
        norm = norm + num_left_out.astype(mx.float32) * mx.exp(t_k - top)[:, 0]
    t_p, _ = _nucleus(desc, weights / norm[:, None], top_p)
    # top_p == 1 is off exactly (a float32 cumsum can reach 1 before the last token);
    # a t_p below t_k means top-p reached past the candidates, into the ties
    return mx.where(top_p < 1, mx.maximum(t_k[:, 0], t_p), t_k[:, 0])


TOP_P_CANDIDATES = 1024  # top-p alone on the CPU: the candidates sorted first (module docstring)


def _top_p_threshold(x: mx.array, top_p: mx.array) -> mx.array:
    """[n] the top-p threshold of rows `x` [n, V] without top-k; on the CPU, where MLX's sort
    costs ~60 ns an element, by the `TOP_P_CANDIDATES` largest logits first.

    Their share of the whole softmax (normalised over all V) says whether top-p ends inside
    them: if it does for every row, the threshold found among the sorted candidates is the one
    a sort of all V gives (the first candidates of a full descending sort are these, in the
    same order, with the same normaliser), else every row is sorted in full. The check reads
    the rows' shares on the host: the CPU's step is synchronous at this point anyway (its
    attention and SwiGLU evaluate as they go, kernels/cpu.py); on a GPU, where that read would
    stall the pipelined step, every row is sorted."""
    V = x.shape[-1]
    if gpu_backend() is None and V > 4 * TOP_P_CANDIDATES:
        cand = mx.partition(-x, TOP_P_CANDIDATES - 1, axis=-1)[:, :TOP_P_CANDIDATES]
        desc = -mx.sort(cand, axis=-1)
        top = desc[:, :1]
        probs = mx.exp(desc - top) / mx.exp(x - top).sum(axis=-1, keepdims=True)
        t_p, mass_before = _nucleus(desc, probs, top_p)
        covered = mass_before[:, -1] + probs[:, -1] >= top_p  # top-p stops within the candidates
        if bool(mx.all(covered | (top_p >= 1)).item()):
            return mx.where(top_p < 1, t_p, _NEG_INF)
    return _top_k_top_p_threshold(x, mx.zeros(top_p.shape, mx.int32), top_p, V)


def _filter_threshold(x: mx.array, state: SamplerState) -> mx.array | None:
    """[B] keep-threshold combining top-k, top-p and min-p (None: nothing to filter)."""
    if not (state.needs_sort or state.needs_min_p):
        return None
    thresh = mx.full((x.shape[0],), _NEG_INF, mx.float32)
    if state.top_k_rows is not None:
        rows = state.top_k_rows
        t = _top_k_top_p_threshold(x[rows], state.top_k[rows], state.top_p[rows], state.max_top_k)
        thresh = thresh.at[rows].maximum(t)
    if state.top_p_only_rows is not None:
        rows = state.top_p_only_rows
        thresh = thresh.at[rows].maximum(_top_p_threshold(x[rows], state.top_p[rows]))
    if state.needs_min_p:
        sampled = state.temperature > 0
        t_min = x.max(axis=-1) + mx.log(state.min_p)  # log(0) = -inf: off
        thresh = mx.maximum(thresh, mx.where(sampled, t_min, _NEG_INF))
    return thresh


def process_logits(logits: mx.array, state: SamplerState) -> mx.array:
    """[B, V] raw logits -> [B, V] float32 log-weights (see the module docstring for the order).

    Greedy rows come out as penalised + biased logits, so their argmax is the greedy token.
    """
    x = logits.astype(mx.float32)
    x = _apply_penalties(x, state)
    if state.bias is not None:
        x = x + state.bias
    if state.needs_temperature:
        x = x / mx.where(state.temperature > 0, state.temperature, 1.0)[:, None]
    thresh = _filter_threshold(x, state)
    if thresh is not None:
        x = mx.where(x >= thresh[:, None], x, _NEG_INF)
    return x


def draw(processed: mx.array, state: SamplerState) -> mx.array:
    """[B] int32: argmax for greedy rows, Gumbel-max with counter-based noise for the rest."""
    if state.all_greedy:
        return mx.argmax(processed, axis=-1).astype(mx.int32)
    scores = processed + gumbel_noise(state.seeds, state.steps, processed.shape[-1])
    if state.any_greedy:
        scores = mx.where((state.temperature > 0)[:, None], scores, processed)
    return mx.argmax(scores, axis=-1).astype(mx.int32)


@dataclass(slots=True)
class SampleOutput:
    tokens: mx.array  # [B] int32
    logprobs: mx.array | None  # [B] float32, log-softmax of the raw logits at the chosen token
    top_ids: mx.array | None  # [B, K] int32, best first (K = state.num_top_logprobs)
    top_logprobs: mx.array | None  # [B, K] float32


def sample(logits: mx.array, state: SamplerState) -> SampleOutput:
    """process_logits + draw + logprobs of the model's distribution. Does not call `record`."""
    tokens = draw(process_logits(logits, state), state)
    if not state.want_logprobs:
        return SampleOutput(tokens, None, None, None)
    return SampleOutput(tokens, *token_logprobs(logits, tokens, state.num_top_logprobs))


def token_logprobs(
    logits: mx.array, tokens: mx.array, top: int
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """[N] log-softmax of the raw logits [N, V] at `tokens` [N], and the `top` best as
    ([N, top] ids, [N, top] logprobs), best first (None, None when top == 0)."""
    raw = logits.astype(mx.float32)
    log_norm = mx.logsumexp(raw, axis=-1, keepdims=True)  # [N, 1]
    chosen = (mx.take_along_axis(raw, tokens[:, None], axis=-1) - log_norm)[:, 0]
    if top == 0:
        return chosen, None, None
    cand = mx.argpartition(-raw, top - 1, axis=-1)[:, :top]  # the best, unordered
    cand_lp = mx.take_along_axis(raw, cand, axis=-1) - log_norm
    order = mx.argsort(-cand_lp, axis=-1)
    top_ids = mx.take_along_axis(cand, order, axis=-1).astype(mx.int32)
    return chosen, top_ids, mx.take_along_axis(cand_lp, order, axis=-1)
