"""Device-side sampling and speculative acceptance (pure jnp, used inside the jitted steps).

Distributions are processed per request: temperature, top-k and top-p, with the mask token always excluded. A
temperature of 0 makes the processed distribution one-hot at the argmax, so greedy decoding is the temperature-0
case of the same code: every acceptance rule below then reduces to "accept while the verifier's argmax equals the
draft".

Speculative acceptance (lossless for any draft distribution q the draft tokens were sampled from):
- `leviathan`: accept draft x_j with probability min(1, p_{j-1}(x_j) / q_j(x_j)); at the first rejection sample
  from norm(max(0, p - q)); after a fully accepted block the bonus token comes from p.
- `reference` (NLD's public rule): draw an independent verifier sample y_{j-1} ~ p_{j-1} and accept while it equals
  the draft; the emitted tokens are the verifier's samples.
Here p_{j-1} is the verifier distribution at block index j-1, which predicts the token at index j.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf
RULES = ("leviathan", "reference")
NUM_TOP_LOGPROBS = 20  # vLLM's cap on top logprobs per token


def argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` as int32, the same index (the first maximum; the first NaN if any). XLA:CPU runs an
  argmax as a two-operand (value, index) reduction that it does not vectorize: each of a step's argmaxes over the
  vocabulary took ~145 us at 8 rows of 8192, together ~1 ms of a 10.8 ms batch-8 decode step of the peer model. On
  a CPU it is two plain reductions here (the maximum, then the smallest index that holds it), which vectorize;
  other platforms keep XLA's argmax, one pass over the logits."""
  return jax.lax.platform_dependent(x, cpu=_argmax_two_pass,
                                    default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def _argmax_two_pass(x: jax.Array) -> jax.Array:
  nan = jnp.isnan(x)  # argmax names a row's first NaN; XLA:CPU's max may skip NaNs, so they are looked for apart
  hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == jnp.max(x, axis=-1, keepdims=True))
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)


def exclude_token(logits: jax.Array, token_id: int) -> jax.Array:
  return logits.at[..., token_id].set(NEG_INF)


# The filters search thresholds over the ordered bit patterns of float32: 2^32 keys, so 32 halvings isolate one
BISECTION_STEPS = 32
_SIGN = 0x80000000


def _ordered_bits(x: jax.Array) -> jax.Array:
  """float32 (NaN-free) -> uint32 keys whose unsigned order is the float order; -0.0 is folded onto +0.0 so that
  equal floats, and only they, get equal keys."""
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
  sign = jnp.uint32(_SIGN)
  return jnp.where(bits >= sign, ~bits, bits | sign)


def _largest_passing(lo: jax.Array, hi: jax.Array, tests: list[Callable]) -> list[jax.Array]:
  """For each test (key threshold [b, T, 1] -> bool [b, T, 1], true at `lo`, non-increasing): the largest threshold
  in [lo, hi) where it holds, by bisection. The tests share each iteration so that their passes over the
  vocabulary fuse into one."""

  def halve(_, bounds):
    out = []
    for (low, high), passes in zip(bounds, tests):
      mid = low + ((high - low) >> 1)
      ok = passes(mid)
      out.append((jnp.where(ok, mid, low), jnp.where(ok, high, mid)))
    return tuple(out)

  bounds = jax.lax.fori_loop(0, BISECTION_STEPS, halve, tuple((lo, hi) for _ in tests))
  return [low for low, _ in bounds]


def _filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """logits [b, T, V] float32, NaN-free; top_k [b] (0 or >= V: off); top_p [b] (1: off). Keeps the logits at or
  above both cuts, the rest become -inf:
  - top-k: the k-th largest logit, the largest t with count(logits >= t) >= k;
  - top-p: the largest t with mass(logits >= t) >= top_p, the mass taken over the whole (unfiltered) distribution.
  So ties at a cut are kept whole: a token stays iff fewer than k logits and less than top_p of the mass lie
  strictly above its logit. No sort of the vocabulary (issue 40: every verify step compiled for a GPU sorted its
  [b, B, V] logits): each cut is an exact bisection over the ordered bit patterns of the logits, one fused pass over
  the vocabulary per halving, and a batch runs only the searches some row asks for."""
  vocab = logits.shape[-1]
  use_k = (top_k > 0) & (top_k < vocab)
  use_p = top_p < 1
  k = jnp.where(use_k, top_k, vocab)[:, None, None]

  def filtered(search_k: bool, search_p: bool):
    def fn(logits):
      key = _ordered_bits(logits)
      lo = jnp.min(key, axis=-1, keepdims=True)  # every test holds at a row's smallest logit
      hi = jnp.max(key, axis=-1, keepdims=True) + 1
      tests = []
      if search_k:
        tests.append(lambda t: jnp.sum(key >= t, axis=-1, keepdims=True, dtype=jnp.int32) >= k)
      if search_p:
        e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        mass = top_p[:, None, None] * jnp.sum(e, axis=-1, keepdims=True)
        tests.append(lambda t: jnp.sum(jnp.where(key >= t, e, 0.0), axis=-1, keepdims=True) >= mass)
      cuts = _largest_passing(lo, hi, tests)
      cut = cuts[0] if search_k else lo
      if search_p:  # a row with top_p = 1 keeps everything, whatever the rounding of its total mass
        cut = jnp.maximum(cut, jnp.where(use_p[:, None, None], cuts[-1], lo))
      return jnp.where(key >= cut, logits, NEG_INF)
    return fn

  branches = [lambda x: x, filtered(True, False), filtered(False, True), filtered(True, True)]
  return jax.lax.switch(jnp.any(use_k).astype(jnp.int32) + 2 * jnp.any(use_p).astype(jnp.int32), branches, logits)


class Controls(NamedTuple):
  """vLLM's sampling controls of a padded batch (a pytree of device arrays). The token-keyed parts are one sparse
  list per row, L entries (padding ids = V, dropped by the scatters), so a step holds no per-request [V] state
  between steps: it scatters them into [b, V] rows of the step's own logits size. Entries may repeat a token: the
  counts and biases add, the flags OR."""
  presence: jax.Array  # [b] float32
  frequency: jax.Array  # [b] float32
  repetition: jax.Array  # [b] float32 (1: off)
  min_p: jax.Array  # [b] float32 (0: off)
  min_tokens_left: jax.Array  # [b] int32: stop ids are held back at positions t with t + offset < this
  ids: jax.Array  # [b, L] int32
  counts: jax.Array  # [b, L] float32: occurrences in the output so far
  in_prompt: jax.Array  # [b, L] bool
  bias: jax.Array  # [b, L] float32
  stop: jax.Array  # [b, L] bool


def apply_controls(logits: jax.Array, c: Controls, extra: jax.Array | None = None, offset=0) -> jax.Array:
  """vLLM's order and definitions on logits [b, T, V] float32: min_tokens (stop ids -> -inf) and logit_bias (added),
  then the penalties: repetition over prompt + output tokens (positive logits divided, the rest multiplied),
  frequency (times the output count) and presence (once per output token) subtracted.

  Position t sees the output so far plus `extra` [b, E] tokens e < t + offset: a verify's draft tokens before it
  (extra = block[1:], offset 0), or the tokens earlier steps of a multi-step decode sampled (offset = the step).
  So each verify position is processed exactly as AR decoding would process it once the draft prefix before it is
  accepted, which keeps speculative output lossless under the controls."""
  b, t, v = logits.shape
  rows = jnp.arange(b)[:, None]
  scatter = lambda x, dtype: jnp.zeros((b, v), dtype).at[rows, c.ids].max(x, mode="drop")
  counts = jnp.zeros((b, v), jnp.float32).at[rows, c.ids].add(c.counts, mode="drop")
  bias = jnp.zeros((b, v), jnp.float32).at[rows, c.ids].add(c.bias, mode="drop")
  in_prompt, stop = scatter(c.in_prompt, bool), scatter(c.stop, bool)
  counts = jnp.broadcast_to(counts[:, None, :], (b, t, v))
  seen = jnp.arange(t)[:, None] + offset  # [T, 1] extra tokens each position sees
  if extra is not None:
    e = extra.shape[1]
    visible = (jnp.arange(e)[None, :] < seen).astype(jnp.float32)  # [T, E]
    pos = jnp.broadcast_to(jnp.arange(t)[None, :, None], (b, t, e))
    tok = jnp.broadcast_to(extra[:, None, :], (b, t, e))
    counts = counts.at[rows[:, :, None], pos, tok].add(jnp.broadcast_to(visible, (b, t, e)), mode="drop")
  held = stop[:, None, :] & (seen[None, :, :] < c.min_tokens_left[:, None, None])
  logits = jnp.where(held, NEG_INF, logits) + bias[:, None, :]
  out_mask = counts > 0
  rep = jnp.where(in_prompt[:, None, :] | out_mask, c.repetition[:, None, None], 1.0)
  logits = jnp.where(logits > 0, logits / rep, logits * rep)
  return logits - c.frequency[:, None, None] * counts - c.presence[:, None, None] * out_mask


def filter_min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
  """vLLM's min-p on tempered logits [b, T, V]: keeps tokens whose probability is at least min_p [b] times the
  most likely token's (exp(l - max) >= min_p, the softmax's ratio without its normalisation)."""
  rel = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
  return jnp.where(rel >= min_p[:, None, None], scaled, NEG_INF)


def processed_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                    mask_token_id: int, controls: Controls | None = None, extra: jax.Array | None = None,
                    offset=0) -> jax.Array:
  """The distribution each request samples from: [b, T, V] float32 (one-hot at the argmax for temperature 0).
  With `controls`, the logits are processed first (`apply_controls`; `extra` and `offset` place each position's
  output), and min-p filters the tempered logits before top-k / top-p, as in vLLM."""
  logits = exclude_token(logits.astype(jnp.float32), mask_token_id)
  if controls is not None:
    logits = apply_controls(logits, controls, extra, offset)
  greedy = temperature <= 0
  onehot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)

  def tempered(onehot):
    safe_t = jnp.where(greedy, 1.0, temperature)[:, None, None]
    scaled = logits / safe_t
    if controls is not None:
      scaled = filter_min_p(scaled, jnp.where(greedy, 0.0, controls.min_p))
    # greedy rows ignore their filters: a batch whose sampled rows filter nothing runs no threshold search
    scaled = _filter_top_k_top_p(scaled, jnp.where(greedy, 0, top_k), jnp.where(greedy, 1.0, top_p))
    return jnp.where(greedy[:, None, None], onehot, jax.nn.softmax(scaled, axis=-1))

  # an all-greedy batch (the common serving case) skips the softmax over the vocabulary
  return jax.lax.cond(jnp.all(greedy), lambda x: x, tempered, onehot)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """One sample per row of probs [..., V] (exactly the argmax for one-hot rows)."""
  return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def top_n(x: jax.Array, n: int | jax.Array, size: int | None = None) -> tuple[jax.Array, jax.Array]:
  """The n largest entries of the last axis (ties: smaller id first), by n passes of a loop: on CPU `lax.top_k`
  sorts every row, which dominated the cost of a draft step; n linear passes are far cheaper for small n. A pass
  finds the largest entry after the previous one in (value descending, id ascending) order, so it writes no masked
  copy of `x` (XLA:TPU kept every copy live; issue 33), and the loop compiles one pass: XLA:CPU maps each kernel's
  code into memory mappings of its own, which unrolled passes multiplied in every step variant. `n` may be traced
  (at most `size`, the output width; default n); entries past n are zeros."""
  size = n if size is None else size
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  lead = x.shape[:-1]

  def one_pass(j, carry):
    last_v, last_i, values, ids = carry
    after = (x < last_v[..., None]) | ((x == last_v[..., None]) & (iota > last_i[..., None]))
    i = argmax(jnp.where(after, x, -jnp.inf))
    # no entry left above -inf: i may name one already taken (as a plain argmax pass would); it counts as -inf
    fresh = jnp.take_along_axis(after, i[..., None], axis=-1)[..., 0]
    v = jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0]
    values = jax.lax.dynamic_update_index_in_dim(values, jnp.where(fresh, v, -jnp.inf), j, axis=-1)
    ids = jax.lax.dynamic_update_index_in_dim(ids, i, j, axis=-1)
    return jnp.where(fresh, v, last_v), jnp.where(fresh, i, last_i), values, ids

  init = (jnp.full(lead, jnp.inf, x.dtype), jnp.full(lead, -1, jnp.int32), jnp.zeros(lead + (size,), x.dtype),
          jnp.zeros(lead + (size,), jnp.int32))
  _, _, values, ids = jax.lax.fori_loop(0, n, one_pass, init)
  return values, ids


def draw(keys: jax.Array, probs: jax.Array, greedy: jax.Array) -> jax.Array:
  """One sample per row of probs [b, ..., V] with per-request typed keys [b]. When every request is greedy the
  rows are one-hot and the argmax is the sample: skip generating Gumbel noise for the whole vocabulary (the
  dominant cost of a CPU step)."""
  return jax.lax.cond(jnp.all(greedy), lambda: argmax(probs),
                      lambda: jax.vmap(sample)(keys, probs))


def draw_per_position(keys: jax.Array, probs: jax.Array, pos: jax.Array, greedy: jax.Array) -> jax.Array:
  """One sample per position of probs [b, w, V] at block positions pos [b, w], each with its row's typed key [b]
  folded with the position: the same token whatever slices a block is processed in."""
  per_row = lambda k, js, ps: jax.vmap(lambda j, pj: sample(jax.random.fold_in(k, j), pj))(js, ps)
  return jax.lax.cond(jnp.all(greedy), lambda: argmax(probs), lambda: jax.vmap(per_row)(keys, pos, probs))


def raw_logprobs(logits: jax.Array, tokens: jax.Array, mask_token_id: int, top_logprobs: jax.Array | None = None):
  """Log-probabilities of `tokens` ([...] one per position, or [..., n]) under the model's raw distribution (mask
  excluded), plus the top `NUM_TOP_LOGPROBS` entries. `top_logprobs` [b] (the entries each row asks for): when no
  row asks, the top entries are not computed (zeros): their passes over the vocabulary were ~0.45 ms of a 10 ms
  batch-8 CPU decode step. None: always computed."""
  lp = jax.nn.log_softmax(exclude_token(logits.astype(jnp.float32), mask_token_id), axis=-1)
  several = tokens.ndim == lp.ndim  # [..., n]: n tokens per position
  chosen = jnp.take_along_axis(lp, tokens if several else tokens[..., None], axis=-1)
  chosen = chosen if several else chosen[..., 0]
  # the passes the batch needs: as many as its rows ask for at most (vLLM's cap: NUM_TOP_LOGPROBS)
  most = NUM_TOP_LOGPROBS if top_logprobs is None else jnp.clip(jnp.max(top_logprobs), 0, NUM_TOP_LOGPROBS)
  top_lp, top_ids = top_n(lp, most, NUM_TOP_LOGPROBS)
  return chosen, top_lp, top_ids


# The random streams of one round's key: each use folds in its own, so no two draws of a round share noise (the draft
# and leviathan's uniforms drew from one key before). fold_in(key, i) is split(key, n)[i]: the streams AR sampling
# reads (a prefill's token, the bonus token of either rule) keep the indices they had, and so seeded AR output.
PREFILL_STREAM, RESIDUAL_STREAM, VERIFIER_STREAM, DRAFT_STREAM, UNIFORM_STREAM = 0, 1, 2, 3, 4


def stream_keys(keys: jax.Array, stream: int) -> jax.Array:
  """keys: [b, 2] uint32 raw key data, one per request -> [b] typed keys of `stream`."""
  return jax.vmap(lambda k: jax.random.fold_in(k, stream))(jax.random.wrap_key_data(keys))


class Verdicts(NamedTuple):
  """What verification decides at block positions from those positions alone, so that a block's positions may be
  processed in slices with the same result (`settle` then reads only these [b, w] arrays)."""
  ok: jax.Array  # [b, w] bool: the position is inside its row's block and its test accepts the draft token there
  cand: jax.Array  # [b, w] int32: the token emitted at the position if the accepted run ends there (see below)


def draft_tests(rule: str, key_data: jax.Array, q: jax.Array | None, draft: jax.Array):
  """The per-position inputs of a block's tests that are not [V]-sized: x [b, B] (the draft token position j
  verifies, block index j + 1; 0 at the last position), and for leviathan q_x [b, B] (q_{j+1}(x_j)) and u [b, B]
  (its uniforms; ones where unused)."""
  b, blk = draft.shape
  pad = lambda a, v: jnp.concatenate([a, jnp.full((b, 1), v, a.dtype)], axis=1)
  x = pad(draft[:, 1:], 0)
  if rule != "leviathan" or q is None:
    return x, jnp.ones((b, blk), jnp.float32), jnp.ones((b, blk), jnp.float32)
  q_x = pad(jnp.take_along_axis(q, draft[..., None], axis=-1)[:, 1:, 0], 1.0)
  k_u = stream_keys(key_data, UNIFORM_STREAM)
  u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (blk - 1,)))(k_u)  # (0, 1]: u*q <= 0 never accepts p=0
  return x, q_x, pad(u, 1.0)


def position_verdicts(rule: str, key_data: jax.Array, p: jax.Array, x: jax.Array, pos: jax.Array, greedy: jax.Array,
                      last: jax.Array, q: jax.Array | None = None, q_x: jax.Array | None = None,
                      u: jax.Array | None = None) -> Verdicts:
  """The verdicts of block positions pos [b, w] (a contiguous run of each row's block indices) with verifier
  distributions p [b, w, V] and the draft tokens x [b, w] they verify; q [b, B, V] is the whole block's draft
  distributions (leviathan; None for an AR step), q_x and u the matching slices of `draft_tests`; last [b] each
  row's last block index.
  - reference: an independent verifier sample y_j ~ p_j (its own noise per position) accepts while it equals x_j
    and is the candidate at every position;
  - leviathan: accept x_j with probability min(1, p_j(x_j) / q_{j+1}(x_j)). The accepted run of the block can end
    only at the first position of these that does not accept (where the run has reached it), so only there is a
    candidate drawn, as at the block's first rejection: from norm(max(0, p_j - q_{j+1})) (p_j at the last index or
    when that is empty) with the row's residual key; cand is 0 elsewhere."""
  in_block = pos < last[:, None]
  if rule == "reference":
    y = draw_per_position(stream_keys(key_data, VERIFIER_STREAM), p, pos, greedy)
    return Verdicts((y == x) & in_block, y)
  ok = in_block
  if q is not None:
    ok = ok & (u * q_x <= jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0])
  stop = jnp.argmin(ok, axis=1)  # [b]: the first position that does not accept (0 when all do: then unused)
  p_stop = jnp.take_along_axis(p, stop[:, None, None], axis=1)[:, 0]  # [b, V]
  j = jnp.take_along_axis(pos, stop[:, None], axis=1)[:, 0]
  dist = p_stop
  if q is not None:
    residual = jnp.maximum(p_stop - jnp.take_along_axis(q, jnp.minimum(j + 1, last)[:, None, None], axis=1)[:, 0], 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_stop)
    dist = jnp.where((j < last)[:, None], residual, p_stop)
  token = draw(stream_keys(key_data, RESIDUAL_STREAM), dist, greedy)
  cand = jnp.where(jnp.arange(x.shape[1])[None, :] == stop[:, None], token[:, None], 0)
  return Verdicts(ok, cand.astype(jnp.int32))


def settle(rule: str, verdicts: Verdicts, x: jax.Array):
  """accepted [b] (1..B) and out [b, B] from a whole block's verdicts: the accepted run m is the leading accepts
  inside each row's block; out[:m] are its draft tokens and out[m] the candidate there."""
  blk = x.shape[1]
  idx = jnp.arange(blk)[None, :]
  m = jnp.sum(jnp.cumprod(verdicts.ok.astype(jnp.int32), axis=1), axis=1)
  # reference: the candidates are the verifier's samples, equal to the draft tokens before m
  out = verdicts.cand if rule == "reference" else jnp.where(idx == m[:, None], verdicts.cand, x)
  return m + 1, out.astype(jnp.int32)


def accept(rule: str, key_data: jax.Array, p: jax.Array, q: jax.Array | None, draft: jax.Array,
           greedy: jax.Array | None = None):
  """Speculative acceptance for a batch of blocks, all positions at once (`position_verdicts`, then `settle`; the
  steps decide a position slice at a time, `steps.verified_block`, with the same verdicts).

  p: [b, B, V] verifier distributions (index j predicts block index j+1); q: [b, B, V] the draft distributions
  (index j is the distribution draft[j] was drawn from; index 0, the seed, is unused; None: an AR step, B = 1);
  draft: [b, B] (draft[0] is the seed); greedy: [b] bool, rows whose p and q are one-hot (enables the no-noise fast
  path when all are). Returns (accepted [b] in 1..B, out [b, B]) where out[:accepted] are the tokens to emit.
  """
  if rule not in RULES:
    raise ValueError(f"unknown acceptance rule {rule!r}; expected one of {RULES}")
  b, blk, _ = p.shape
  greedy = jnp.zeros((b,), bool) if greedy is None else greedy
  last = jnp.full((b,), blk - 1, jnp.int32)
  x, q_x, u = draft_tests(rule, key_data, q, draft)
  pos = jnp.broadcast_to(jnp.arange(blk, dtype=jnp.int32)[None, :], (b, blk))
  return settle(rule, position_verdicts(rule, key_data, p, x, pos, greedy, last, q, q_x, u), x)
