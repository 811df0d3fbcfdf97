"""Verification: which drafts each row accepts, and the token that follows them.

Column c of the verify forward (input `[next, d_1, ..., d_{W-1}]`) predicts output token
`s + c` of the row, where `s` is the row's draw counter (`SamplerState.steps`). Its logits are
processed with the row's sampler state *after* recording `d_1..d_c` (penalties see the drafts
before it; the RNG counter is `s + c`): `column_states(state, drafts)[c]`. A draft model draws
`d_{c+1}` from the same processed state (`process_logits` with identical settings), so top-k,
top-p, min-p, bias and penalties shape the target distribution p and the draft distribution q
alike.

Two rules, both keeping the target distribution exactly:

* point mass (greedy rows; any row under a deterministic drafter such as n-gram): draw the
  target's token at each column exactly as plain decoding would (same noise, counter `s + c`)
  and accept `d_{c+1}` iff it equals that draw. The output is the plain sampler's output, token
  for token (seeded rows reproduce plain decoding exactly).
* rejection sampling (Leviathan et al. 2023; Chen et al. 2023), sampled rows with a draft
  model: accept `d` with probability `min(1, p(d) / q(d))` (uniform `u` from its own counter
  stream: accept iff `u * q(d) < p(d)`); at the first rejection draw from
  `norm(max(0, p - q))` (another stream); if every draft is accepted draw the bonus token from
  p at the next column (the plain stream).

Streams: the counter RNG of engine.sampling keyed by `(seed ^ STREAM, s + c)`; different
streams give independent numbers for the same (row, counter).

Worked example (one row, k = 3, greedy): drafts [7 9 4], target argmax per column [7 9 5 2]:
d_1 = 7 and d_2 = 9 match, d_3 = 4 != 5, so 2 drafts are accepted and the row emits [7 9 5];
the cache keeps 3 columns (next, 7, 9) and 5 becomes the next input.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from engine.sampling import SamplerState, draw, gumbel_noise, uniform_noise

STREAM_DRAFT = 0x2545F491  # a draft model's own draws
STREAM_ACCEPT = 0x68E31DA4  # acceptance uniforms
STREAM_RESIDUAL = 0x1B56C4E9  # draws from norm(max(0, p - q))


def plain_greedy(state: SamplerState) -> bool:
    """Every row greedy with nothing that shapes its logits (no penalties, no bias): a draw is
    the argmax of the raw logits, and no per-column sampler state is needed (the fast path of
    a speculative round: no column states, no stacked state, no draft distributions)."""
    return state.all_greedy and state.counts is None and state.seen is None and state.bias is None


def column_states(state: SamplerState, drafts: mx.array, num_columns: int) -> list[SamplerState]:
    """States for columns 0..num_columns-1: column c has recorded drafts[:, :c]."""
    out = [state]
    for c in range(1, num_columns):
        out.append(out[-1].record(drafts[:, c - 1]))
    return out


def stacked(states: list[SamplerState]) -> SamplerState:
    """One state with W*B rows, column-major (row c*B + b is column c of row b)."""
    return states[0] if len(states) == 1 else SamplerState.concat(states)


def to_columns(x: mx.array) -> mx.array:
    """[B, W, ...] -> [W*B, ...], column-major (matches `stacked`)."""
    return mx.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def from_columns(x: mx.array, batch: int) -> mx.array:
    """[W*B, ...] -> [B, W, ...]."""
    return mx.swapaxes(x.reshape(-1, batch, *x.shape[1:]), 0, 1)


def with_stream(state: SamplerState, stream: int) -> SamplerState:
    return replace(state, seeds=state.seeds ^ mx.array(stream, dtype=mx.uint32))


def draw_stream(processed: mx.array, state: SamplerState, stream: int) -> mx.array:
    """`engine.sampling.draw` with the noise of another counter stream."""
    return draw(processed, with_stream(state, stream) if not state.all_greedy else state)


def _uniforms(states: list[SamplerState], stream: int) -> mx.array:
    """[B, len(states)] uniforms in (0, 1) keyed by (seed ^ stream, steps) of each state."""
    cols = [
        uniform_noise(s.seeds ^ mx.array(stream, dtype=mx.uint32), s.steps, 1)[:, 0] for s in states
    ]
    return mx.stack(cols, axis=1)


def _leading_true(x: mx.array) -> mx.array:
    """[B] int32: the number of leading True entries of each row of a [B, K] bool array."""
    if x.shape[1] == 0:
        return mx.zeros((x.shape[0],), mx.int32)
    return mx.cumprod(x.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)


@dataclass(slots=True)
class Verdict:
    num_accepted: mx.array  # [B] int32 drafts accepted (0..num_drafts[b])
    tokens: mx.array  # [B, W] int32: accepted drafts, then the new token at column num_accepted
    last: mx.array  # [B] int32: the new token (the row's next input)


def verify(
    target_logits: mx.array,
    states: list[SamplerState],
    drafts: mx.array,
    num_drafts: mx.array,
    draft_logits: mx.array | None = None,
) -> Verdict:
    """Accept drafts for every row at once.

    target_logits: [B, W, V] raw logits of the verify forward; states: `column_states` (W of
    them); drafts: [B, W-1]; num_drafts: [B] (columns past it are padding); draft_logits:
    [B, W-1, V] processed draft log-weights, or None when every proposal is a point mass.
    With `plain_greedy(states[0])` only states[0] is read (argmax of the raw logits).
    """
    B, W, V = target_logits.shape
    if plain_greedy(states[0]):
        plain = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # [B, W]
        match = (plain[:, :-1] == drafts) & (mx.arange(W - 1)[None, :] < num_drafts[:, None])
        num_acc = _leading_true(match)
        last = mx.take_along_axis(plain, num_acc[:, None], axis=1)[:, 0]
        return Verdict(num_acc, plain, last)
    big = stacked(states)
    processed = process_columns(target_logits, big)  # [W*B, V]
    plain = from_columns(draw(processed, big), B)  # [B, W]: plain decoding's draws
    cols = mx.arange(W - 1)[None, :]
    valid = cols < num_drafts[:, None]
    match = (plain[:, :-1] == drafts) & valid
    if draft_logits is None or big.all_greedy:
        num_acc = _leading_true(match)
        last = mx.take_along_axis(plain, num_acc[:, None], axis=1)[:, 0]
        return Verdict(num_acc, plain, last)
    return _rejection(
        from_columns(processed, B), plain, states, drafts, num_drafts, valid, match, draft_logits
    )


def process_columns(target_logits: mx.array, big: SamplerState) -> mx.array:
    from engine.sampling import process_logits

    return process_logits(to_columns(target_logits).astype(mx.float32), big)


def _rejection(
    processed: mx.array,
    plain: mx.array,
    states: list[SamplerState],
    drafts: mx.array,
    num_drafts: mx.array,
    valid: mx.array,
    match: mx.array,
    draft_logits: mx.array,
) -> Verdict:
    B, W, V = processed.shape
    p = mx.softmax(processed, axis=-1)  # [B, W, V] (-inf -> 0)
    q = mx.softmax(draft_logits.astype(mx.float32), axis=-1)  # [B, W-1, V]
    idx = drafts[:, :, None].astype(mx.int32)
    p_d = mx.take_along_axis(p[:, :-1], idx, axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[..., 0]
    u = _uniforms(states[:-1], STREAM_ACCEPT)  # [B, W-1]
    greedy = (states[0].temperature == 0)[:, None]
    accept = mx.where(greedy, match, (u * q_d < p_d) & valid)
    num_acc = _leading_true(accept)
    at = num_acc[:, None, None]
    p_a = mx.take_along_axis(p, at, axis=1)[:, 0]  # [B, V] target dist at the stop column
    q_pad = mx.concatenate([q, mx.zeros((B, 1, V), q.dtype)], axis=1)
    q_a = mx.take_along_axis(q_pad, at, axis=1)[:, 0]
    resid = mx.maximum(p_a - q_a, 0.0)
    resid = mx.where(resid.sum(axis=-1, keepdims=True) > 0, resid, p_a)  # p == q: never rejected
    state_a = _state_at(states, num_acc)
    noise = gumbel_noise(
        state_a.seeds ^ mx.array(STREAM_RESIDUAL, dtype=mx.uint32), state_a.steps, V
    )
    resid_tok = mx.argmax(mx.log(resid) + noise, axis=-1).astype(mx.int32)
    plain_a = mx.take_along_axis(plain, num_acc[:, None], axis=1)[:, 0]
    rejected = (num_acc < num_drafts) & ~greedy[:, 0]
    last = mx.where(rejected, resid_tok, plain_a)
    cols = mx.arange(W)[None, :]
    drafts_pad = mx.concatenate([drafts, mx.zeros((B, 1), drafts.dtype)], axis=1)
    tokens = mx.where(cols < num_acc[:, None], drafts_pad, last[:, None]).astype(mx.int32)
    return Verdict(num_acc, tokens, last)


def _state_at(states: list[SamplerState], col: mx.array) -> SamplerState:
    """Seeds and counters of each row at its own column (only those fields are used)."""
    steps = mx.take_along_axis(mx.stack([s.steps for s in states], axis=1), col[:, None], axis=1)
    return replace(states[0], steps=steps[:, 0])


def record_ragged(state: SamplerState, tokens: mx.array, num: mx.array) -> SamplerState:
    """`SamplerState.record` of the first `num[b]` tokens of each row ([B, T] tokens)."""
    counts, seen = state.counts, state.seen
    if counts is not None or seen is not None:  # (nothing else reads the tokens)
        tokens = tokens.astype(mx.int32)
        T = tokens.shape[1]
        keep = mx.arange(T)[None, :] < num[:, None]  # [B, T]
        rows = mx.arange(tokens.shape[0], dtype=mx.int32)[:, None]
        added = mx.zeros(counts.shape if counts is not None else seen.shape, mx.int32)  # type: ignore[union-attr]
        added = added.at[rows, tokens].add(keep.astype(mx.int32))
        if counts is not None:
            counts = counts + added
        if seen is not None:
            seen = seen | (added > 0)
    # a copy, not `replace`: the host mirror and its flags do not change (as SamplerState.record)
    out = copy.copy(state)
    out.steps, out.counts, out.seen = state.steps + num.astype(mx.uint32), counts, seen
    return out


def greedy_verdict_host(
    plain: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`verify`'s greedy fast path on the host: (accepted [B], the new token [B]) from the
    argmax of each verify column `plain` [B, W] and the drafts [B, W-1] (columns past
    `num_drafts[b]` are padding). A handful of numpy calls on a [B, W] array instead of a dozen
    device ops: on a GPU every op is a launch and host work of its own."""
    B, W = plain.shape
    K = W - 1
    match = (plain[:, :K] == drafts[:, :K]) & (np.arange(K)[None, :] < num_drafts[:, None])
    accepted = np.cumprod(match, axis=1).sum(axis=1) if K else np.zeros(B, np.int64)
    accepted = accepted.astype(np.int64)
    return accepted, plain[np.arange(B), accepted]
