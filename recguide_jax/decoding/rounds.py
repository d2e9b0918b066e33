"""The generic rounds: AR decode, LinearSS (diffusion draft + causal verify) and NLD block diffusion. Each runs its
forwards through the runner and hands the results to the engine's `RoundContext`; none knows which strategy
planned it."""

from __future__ import annotations

import numpy as np

from recguide_jax.decoding.strategy import Group, Round, RoundContext, RoundKind
from recguide_jax.engine.requests import Forward


def draft_verify(ctx: RoundContext, blk: int, seed, write, prefix_len, page_table, samp):
  """One LinearSS round on the device: draft forward, then verify forward (which commits K/V)."""
  drafted, q, signals = ctx.runner.draft(seed, prefix_len, page_table, blk, samp)
  res = ctx.runner.verify(drafted, q, write, prefix_len, page_table, samp)
  if ctx.signal_log is not None:  # only analysis reads the draft back: no extra device->host copy per round
    res.draft_tokens = np.asarray(drafted)
    res.draft_signals = np.asarray(signals)
  return res


class ARRound(Round):
  """One token per request and step: decode forwards from the seed token, `ctx.decode_steps` of them in one device
  call (each step's token is the next step's input on the device)."""
  kind = RoundKind.AR

  def run(self, ctx: RoundContext, group: Group) -> tuple[str, int]:
    reqs = group.reqs
    steps = ctx.decode_steps(reqs)
    ctx.reserve(reqs, steps)
    b, page_table, prefix_len, samp = ctx.batch_arrays(reqs, steps)
    seed, write = ctx.seeds(reqs, b)
    res = ctx.runner.verify(seed[:, None], None, write, prefix_len, page_table, samp, steps=steps)
    for _ in range(steps):
      ctx.count_forward(Forward.DECODE, 1, len(reqs))
    for i, r in enumerate(reqs):
      r.stats.forwards[Forward.DECODE] += steps
      ctx.decoded(r, steps, res, i)
    return self.kind, steps


class LinearRound(Round):
  """LinearSS: a draft of `block` tokens and one verify forward. Requests planned at a smaller block (padded into
  this batch) keep at most their planned block of the verified tokens."""
  kind = RoundKind.LINEAR
  pads_to_largest = True

  def run(self, ctx: RoundContext, group: Group) -> None:
    reqs, blk = group.reqs, group.block
    ctx.reserve(reqs, blk)
    b, page_table, prefix_len, samp = ctx.batch_arrays(reqs)
    seed, write = ctx.seeds(reqs, b)
    res = draft_verify(ctx, blk, seed, write, prefix_len, page_table, samp)
    ctx.count_forward(Forward.DRAFT, blk, len(reqs))
    ctx.count_forward(Forward.VERIFY, blk, len(reqs))
    for i, r in enumerate(reqs):
      r.stats.forwards[Forward.DRAFT] += 1
      r.stats.forwards[Forward.VERIFY] += 1
      cap = group.planned[i]
      ctx.verified(r, cap, min(int(res.accepted[i]), cap), res, i)


class RaggedRound(Round):
  """LinearSS rows, each at its own planned block, and AR rows (planned block 1) in two forwards whatever the mix:
  one ragged draft of the LinearSS rows, one ragged verify of every row (an AR row's verify decodes its seed).
  Nothing is padded to another row's block and no block size gets a batch of its own: the forwards compute
  sum(B_i) and sum(B_i) + #AR query tokens (in the runner's packed-token buckets). Each row's tokens, sampling key
  and acceptance are those of a LinearSS round at its own block (or an AR step), so the output is the same."""
  kind = RoundKind.RAGGED

  def run(self, ctx: RoundContext, group: Group) -> str:
    reqs, blocks = group.reqs, [int(b) for b in group.planned]
    for r, blk in zip(reqs, blocks):
      ctx.reserve([r], blk)
    rows = ctx.rc.max_batch  # a ragged step's rows: one shape for every mix (its cost follows the tokens)
    _, page_table, prefix_len, samp = pad_rows(ctx.batch_arrays(reqs), rows)
    seed, write = ctx.seeds(reqs, rows)
    row_len = np.zeros((rows,), np.int32)
    row_len[:len(reqs)] = blocks
    draft_len = np.where(row_len > 1, row_len, 0).astype(np.int32)
    n_draft = int(np.count_nonzero(draft_len))
    drafted, q, signals = ctx.runner.ragged_draft(seed, draft_len, prefix_len, page_table, samp)
    res = ctx.runner.ragged_verify(drafted, q, seed, row_len, write, prefix_len, page_table, samp)
    ctx.count_forward(Forward.RAGGED_DRAFT, int(draft_len.sum()), n_draft)
    ctx.count_forward(Forward.RAGGED_VERIFY, int(row_len.sum()), len(reqs))
    if ctx.signal_log is not None:
      res.draft_tokens = np.asarray(drafted)
      res.draft_signals = np.asarray(signals)
    for i, (r, blk) in enumerate(zip(reqs, blocks)):
      if blk == 1:
        r.stats.forwards[Forward.DECODE] += 1
        ctx.decoded(r, 1, res, i)
      else:
        r.stats.forwards[Forward.DRAFT] += 1
        r.stats.forwards[Forward.VERIFY] += 1
        ctx.verified(r, blk, int(res.accepted[i]), res, i)
    return self.kind


def pad_rows(arrays: tuple, rows: int) -> tuple:
  """`RoundContext.batch_arrays`' (b, page_table, prefix_len, samp) padded with empty rows to `rows` (a ragged
  step's fixed row count): padding rows read and write nothing (page 0 is the trash page, prefix 0)."""
  b, page_table, prefix_len, samp = arrays
  if b >= rows:
    return arrays
  grow = lambda x: np.concatenate([x, np.zeros((rows - b,) + x.shape[1:], x.dtype)])
  samp = type(samp)(*(grow(x) for x in samp.args()))
  return rows, grow(page_table), grow(prefix_len), samp


class DiffusionRound(Round):
  """NLD's block diffusion: denoise a block by confidence threshold, then one causal forward commits its K/V and
  gives the next seed (not needed when the block ends the generation with an EOS)."""
  kind = RoundKind.DIFFUSION

  def run(self, ctx: RoundContext, group: Group) -> None:
    reqs, blk = group.reqs, group.block
    ctx.reserve(reqs, blk)
    b, page_table, prefix_len, samp = ctx.batch_arrays(reqs)
    seed, active = ctx.seeds(reqs, b)
    threshold = np.full((b,), ctx.strategy.threshold, np.float32)
    block, steps = ctx.runner.denoise(seed, prefix_len, page_table, threshold, blk, samp, active)
    ctx.count_forward(Forward.DENOISE, blk, len(reqs))
    eos = set(ctx.cfg.eos_token_ids)
    live = []
    for i, r in enumerate(reqs):
      r.stats.forwards[Forward.DENOISE] += int(steps[i])
      body = [int(t) for t in block[i, 1:]]
      ends = [j for j, t in enumerate(body) if t in eos] if not r.params.ignore_eos else []
      if ends:  # the block ends the generation: emit through the first EOS, no commit forward needed
        body = body[:ends[0] + 1]
        ctx.count_block(r, blk, len(body))
        ctx.emit(r, body, [0.0] * len(body), None, None)
        if not r.finished:
          ctx.finish(r, "stop")
      else:
        live.append((i, r))
    if not live:
      return
    sub = [r for _, r in live]
    b2, page_table2, prefix_len2, samp2 = ctx.batch_arrays(sub)
    tokens = np.zeros((b2, blk), np.int32)
    valid = np.zeros((b2, blk), bool)
    for j, (i, _) in enumerate(live):
      tokens[j] = block[i]
      valid[j] = True
    last_idx = np.full((b2,), blk - 1, np.int32)
    tok, lp, _, _ = ctx.runner.prefill(tokens, valid, prefix_len2, page_table2, last_idx, samp2)
    ctx.count_forward(Forward.COMMIT, blk, len(live))
    for j, (i, r) in enumerate(live):
      r.stats.forwards[Forward.COMMIT] += 1
      ctx.commit(r, ctx.committed(r) + blk)
      body = [int(t) for t in block[i, 1:]] + [int(tok[j])]
      ctx.count_block(r, blk, len(body))
      ctx.emit(r, body, [0.0] * (blk - 1) + [float(lp[j])], None, None)


AR = ARRound()
LINEAR = LinearRound()
RAGGED = RaggedRound()
ARRound.ragged_round = LinearRound.ragged_round = RAGGED
DIFFUSION = DiffusionRound()
