"""The generic rounds: AR decode, LinearSS (diffusion draft + causal verify) and NLD block diffusion. Each runs its
forwards through the runner on the engine's `Batch` and returns a `RoundOutput`; none knows which strategy planned
it, and none touches engine state."""

from __future__ import annotations

import jax
import numpy as np

from recguide_jax.decoding.strategy import Batch, Round, RoundKind, RoundOutput
from recguide_jax.runtime.step_key import StepKind


def draft_verify(runner, blk: int, batch: Batch):
  """One LinearSS round on the device: draft forward, then verify forward (which commits K/V). The draft tokens and
  signals stay device arrays on the result: only analysis reads them back."""
  drafted, q, signals = runner.draft(batch.seed, batch.prefix_len, batch.page_table, blk, batch.samp)
  res = runner.verify(drafted, q, batch.live, batch.prefix_len, batch.page_table, batch.samp)
  res.draft_tokens, res.draft_signals = drafted, signals
  return res


def verified_output(label: str, res, batch: Batch, accepted: np.ndarray, forwards, row_forwards, **kw) -> RoundOutput:
  """The output of a verification: each row emits and commits its accepted tokens."""
  n = batch.n
  return RoundOutput(label, res.tokens[:n], accepted, res.logprobs[:n], accepted, batch.planned.copy(), accepted,
                     forwards, row_forwards, res.top_logprobs[:n], res.top_ids[:n], verify=res, **kw)


class ARRound(Round):
  """One token per request and step: decode forwards from the seed token, `batch.steps` of them in one device call
  (each step's token is the next step's input on the device). Pipelined: the engine may dispatch the next call from
  this one's tokens on the device before it reads this one's back."""
  kind = RoundKind.AR
  multi_step = True
  pipelined = True

  def ahead(self, batch: Batch) -> tuple[int, int, int]:
    return batch.steps, batch.steps, batch.steps  # commits every step it runs; a key round per step

  def dispatch(self, runner, batch: Batch, seed=None):
    """Dispatches the call without waiting; `seed`: the previous call's handle (its last tokens seed this one)."""
    tokens = batch.seed[:, None] if seed is None else runner.next_inputs(seed)[0]
    return runner.dispatch_decode(tokens, batch.live, batch.prefix_len, batch.page_table, batch.samp, batch.steps)

  def collect(self, runner, batch: Batch, handle) -> RoundOutput:
    """Reads a dispatched call back (waits for it)."""
    res = runner.read_verify(handle)
    n, steps = batch.n, batch.steps
    full = np.full((n,), steps, np.int64)
    ones = np.ones((n,), np.int64)
    # AR writes exactly what it commits: nothing to trim (a pipelined next call's pages are past it)
    return RoundOutput(self.kind, res.tokens[:n], full, res.logprobs[:n], full, ones, ones,
                       [(StepKind.DECODE, 1, n)] * steps, {StepKind.DECODE: full}, res.top_logprobs[:n],
                       res.top_ids[:n], rounds=steps, speculative=False, key_rounds=steps, verify=res, trim=False)

  def run(self, runner, batch: Batch) -> RoundOutput:
    return self.collect(runner, batch, self.dispatch(runner, batch))


class LinearRound(Round):
  """LinearSS: a draft of `block` tokens and one verify forward. Requests planned at a smaller block (padded into
  this batch) keep at most their planned block of the verified tokens. Pipelined: the next round's seed (the last
  accepted token) and committed length are taken from this round's verification on the device."""
  kind = RoundKind.LINEAR
  pads_to_largest = True
  pipelined = True

  def ahead(self, batch: Batch) -> tuple[int, int, int]:
    return batch.block, 1, 1  # at most a block committed (at least one token), one sampling-key round

  def dispatch(self, runner, batch: Batch, seed=None):
    if seed is None:
      tokens, prefix = batch.seed, batch.prefix_len
    else:  # the previous round's verification, still on the device
      tokens, prefix = runner.next_inputs(seed[0])
    drafted, q, signals = runner.draft(tokens, prefix, batch.page_table, batch.block, batch.samp)
    outs = runner.dispatch_verify(drafted, q, batch.live, prefix, batch.page_table, batch.samp)
    return outs, drafted, signals

  def collect(self, runner, batch: Batch, handle) -> RoundOutput:
    outs, drafted, signals = handle
    res = runner.read_verify(outs)
    res.draft_tokens, res.draft_signals = drafted, signals  # device arrays: only analysis reads them back
    n, blk = batch.n, batch.block
    accepted = np.minimum(res.accepted[:n].astype(np.int64), batch.planned)
    ones = np.ones((n,), np.int64)
    return verified_output(self.kind, res, batch, accepted, [(StepKind.DRAFT, blk, n), (StepKind.VERIFY, blk, n)],
                           {StepKind.DRAFT: ones, StepKind.VERIFY: ones})

  def run(self, runner, batch: Batch) -> RoundOutput:
    return self.collect(runner, batch, self.dispatch(runner, batch))


class RaggedRound(Round):
  """LinearSS rows, each at its own planned block, and AR rows (planned block 1) in two forwards whatever the mix:
  one ragged draft of the LinearSS rows, one ragged verify of every row (an AR row's verify decodes its seed).
  Nothing is padded to another row's block and no block size gets a batch of its own: the forwards compute
  sum(B_i) and sum(B_i) + #AR query tokens (in the runner's packed-token buckets). Each row's tokens, sampling key
  and acceptance are those of a LinearSS round at its own block (or an AR step), so the output is the same.
  Pipelined: the next step's seeds and committed lengths are this verify's, on the device (acceptance is capped at
  each row's own block there).

  Rows with a `Batch.verify_price` verify only the head of their draft that pays at it (`truncated_lengths`): the
  draft's signals are read back between the two forwards, and the verify runs (and is priced by) fewer tokens."""
  kind = RoundKind.RAGGED
  pipelined = True
  replans_rows = True

  def ahead(self, batch: Batch) -> tuple[int, int, int]:
    return batch.block, 1, 1  # at most the largest planned block committed, at least one token; one key round

  def dispatch(self, runner, batch: Batch, seed=None):
    """Dispatches the draft and the verify (waiting between them only to truncate verifies); `seed`: the previous
    step's handle (its verify's next inputs seed this step)."""
    n, rows = batch.n, runner.config.max_batch  # a ragged step's rows: one shape for every mix
    page_table, prefix_len, tokens, live, samp = pad_rows(batch, rows)
    if seed is not None:  # the previous step's verification, still on the device (its rows are these rows)
      tokens, prefix_len = runner.next_inputs(seed[0])
    planned = batch.planned.astype(np.int64)
    row_len = np.zeros((rows,), np.int32)
    row_len[:n] = planned
    draft_len = np.where(row_len > 1, row_len, 0).astype(np.int32)
    drafted, q, signals = runner.ragged_draft(tokens, draft_len, prefix_len, page_table, samp)
    verify_len, verified = row_len, None
    price = batch.verify_price
    if price is not None and (planned > 1).any() and (price > 0).any():
      # [n, W]: the draft's top probability per slot (the whole [R, 3, W] read back: a slice on the device would
      # compile a program of its own)
      confidence = np.asarray(jax.device_get(signals))[:n, 0]
      verified = truncated_lengths(confidence, planned, np.asarray(price, np.float64))
      verify_len = row_len.copy()
      verify_len[:n] = verified
    outs = runner.dispatch_ragged_verify(drafted, q, tokens, verify_len, live, prefix_len, page_table, samp)
    return outs, drafted, signals, draft_len, verify_len, verified

  def collect(self, runner, batch: Batch, handle) -> RoundOutput:
    outs, drafted, signals, draft_len, verify_len, verified = handle
    res = runner.read_verify(outs)
    res.draft_tokens, res.draft_signals = drafted, signals  # device arrays: only analysis reads them back
    n = batch.n
    linear = (batch.planned > 1).astype(np.int64)
    accepted = res.accepted[:n].astype(np.int64)
    forwards = [(StepKind.RAGGED_DRAFT, int(draft_len.sum()), int(linear.sum())),
                (StepKind.RAGGED_VERIFY, int(verify_len.sum()), n)]
    return verified_output(self.kind, res, batch, accepted, forwards,
                           {StepKind.DRAFT: linear, StepKind.VERIFY: linear, StepKind.DECODE: 1 - linear},
                           verified=verified)

  def run(self, runner, batch: Batch) -> RoundOutput:
    return self.collect(runner, batch, self.dispatch(runner, batch))


def truncated_lengths(confidence: np.ndarray, blocks: np.ndarray, price: np.ndarray) -> np.ndarray:
  """Verify lengths [n] of rows planned at `blocks` [n] (1: AR) whose drafts put top probability `confidence`
  [n, W] on slots 0..W-1 (slot 0 the seed): a drafting row verifies its seed and the drafted tokens 1..k whose
  running product of confidences is at least its `price` [n] (the running product only falls, so they are a
  head of the block), at least its seed, at most its block. Lossless under sampling too: k is a function of the
  draft's distributions alone, not of the tokens drawn from them, so each verified token is still a draw from q
  where the acceptance test meets it, and a token past k is drawn from the verifier as the bonus."""
  blocks = np.asarray(blocks, np.int64)
  width = confidence.shape[1]
  running = np.cumprod(np.asarray(confidence[:, 1:], np.float64), axis=1)  # [n, W - 1]: through drafted token j
  keep = (running >= np.asarray(price, np.float64)[:, None]) & (np.arange(1, width)[None, :] < blocks[:, None])
  return np.where(blocks > 1, 1 + keep.sum(axis=1), blocks).astype(np.int32)


def pad_rows(batch: Batch, rows: int) -> tuple:
  """The batch's (page_table, prefix_len, seed, live, samp) padded with empty rows to `rows` (a ragged step's fixed
  row count): padding rows read and write nothing (page 0 is the trash page, prefix 0, not live)."""
  b = batch.b
  grow = (lambda x: x) if b >= rows else (lambda x: np.concatenate([x, np.zeros((rows - b,) + x.shape[1:], x.dtype)]))
  samp = batch.samp if b >= rows else jax.tree.map(grow, batch.samp)
  return grow(batch.page_table), grow(batch.prefix_len), grow(batch.seed), grow(batch.live), samp


class DiffusionRound(Round):
  """NLD's block diffusion: denoise a block by confidence threshold, then one causal forward commits its K/V and
  gives the next seed (not needed when the block ends the generation with an EOS)."""
  kind = RoundKind.DIFFUSION

  def __init__(self, threshold: float = 0.9):
    self.threshold = threshold

  def run(self, runner, batch: Batch) -> RoundOutput:
    n, blk, b = batch.n, batch.block, batch.b
    threshold = np.full((b,), self.threshold, np.float32)
    block, steps = runner.denoise(batch.seed, batch.prefix_len, batch.page_table, threshold, blk, batch.samp,
                                  batch.live)
    eos = np.asarray(sorted(runner.cfg.eos_token_ids), np.int64)
    tokens = np.zeros((n, blk), np.int32)
    emit = np.zeros((n,), np.int64)
    logprobs = np.zeros((n, blk), np.float32)
    commit = np.zeros((n,), np.int64)
    body = np.asarray(block[:n, 1:])
    ends = np.isin(body, eos) & ~np.array([r.params.ignore_eos for r in batch.reqs])[:, None]
    live = []
    for i in range(n):
      hit = np.flatnonzero(ends[i])
      if hit.size:  # the block ends the generation: emit through the first EOS, no commit forward needed
        tokens[i, :hit[0] + 1] = body[i, :hit[0] + 1]
        emit[i] = hit[0] + 1
      else:
        live.append(i)
    forwards = [(StepKind.DENOISE, blk, n)]
    if live:
      sub = batch.sub(live, key_offset=1)
      valid = np.zeros((sub.b, blk), bool)
      valid[:len(live)] = True
      commit_tokens = np.zeros((sub.b, blk), np.int32)
      commit_tokens[:len(live)] = np.asarray(block)[live]
      last_idx = np.full((sub.b,), blk - 1, np.int32)
      tok, lp, _, _ = runner.prefill(commit_tokens, valid, sub.prefix_len, sub.page_table, last_idx, sub.samp)
      forwards.append((StepKind.COMMIT, blk, len(live)))
      tokens[live, :blk - 1] = body[live]
      tokens[live, blk - 1] = np.asarray(tok)[:len(live)]
      logprobs[live, blk - 1] = np.asarray(lp)[:len(live)]
      emit[live] = blk
      commit[live] = blk
    committed = np.zeros((n,), np.int64)
    committed[live] = 1
    return RoundOutput(self.kind, tokens, emit, logprobs, commit, np.full((n,), blk, np.int64), emit.copy(),
                       forwards, {StepKind.DENOISE: np.asarray(steps[:n], np.int64), StepKind.COMMIT: committed},
                       speculative=False, key_rounds=2)


AR = ARRound()
LINEAR = LinearRound()
RAGGED = RaggedRound()
ARRound.ragged_round = LinearRound.ragged_round = RAGGED


def draft_signal_rows(round_log) -> list[dict]:
  """Per verified row of the rounds an engine recorded (`Engine.round_log`) that kept their drafts: its block, accepted
  length, draft and verified tokens and draft signals (confidence, margin, runner-up token per position). Analysis
  only: reads the drafts back from the device."""
  rows = []
  for outcome in round_log:
    out = outcome.output
    res = out.verify
    if res is None or res.draft_signals is None or not out.speculative:
      continue
    drafts, sig = np.asarray(res.draft_tokens), np.asarray(res.draft_signals)
    for i in range(outcome.batch.n):
      if out.drafting is not None and out.drafting[i]:  # it drafted for a later round: nothing verified
        continue
      blk, acc = int(out.block[i]), int(out.accepted[i])
      rows.append({"block_size": blk, "accepted": acc, "draft": drafts[i].tolist(),
                   "out": np.asarray(res.tokens[i, :acc]).tolist(), "conf": sig[i, 0].tolist(),
                   "margin": sig[i, 1].tolist(), "alt": sig[i, 2].astype(int).tolist()})
  return rows
