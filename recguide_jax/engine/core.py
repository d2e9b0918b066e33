"""The host-side engine: admits requests, runs chunked prefill, asks the decoding strategy for the step's plan,
groups the plans into batches, runs each batch's round and applies its output (pages, counters, emission). It keeps
the books; it knows no strategy by name (see `recguide_jax.decoding.strategy`).

Each `step()`:
1. admits waiting requests (FIFO) while a batch slot and their worst-case KV pages are free;
2. runs one prefill chunk for requests whose prompt is not fully cached (chunked prefill interleaves with decode;
   `prefill`: prompt scoring, and the samples of one prompt sharing its prefill);
3. asks the strategy for a `StepPlan` of the decoding requests (`plan_step`), groups requests by plan
   (`scheduler.group_plans`) and per group reserves pages, builds the `Batch` and runs its round;
4. applies each `RoundOutput` (`apply`: pages committed or cropped, stats, emission and stop conditions), then tells
   the strategy (`observe`); finished requests leave the batch.

Requests join and leave between rounds. Only small arrays cross between host and device.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Sequence

import jax
import numpy as np

from recguide_jax.decoding.strategy import Batch, RoundOutcome, RoundOutput, RoundPlan, StepView, Strategy
from recguide_jax.engine import output, prefill
from recguide_jax.engine.batch_rows import BatchRows, RowCache, gather_rows
from recguide_jax.engine.books import DecodeBooks, RoundTally
from recguide_jax.cache.kv_cache import PageAllocator
from recguide_jax.engine.requests import (NEUTRAL_CONTROLS, Request, RequestError, SamplingParams, output_lengths,
                                          fold_seed, sampling_row)
from recguide_jax.engine.scheduler import Scheduler, check_queue, group_plans
from recguide_jax.runtime.runner import Runner, VariantNotReady
from recguide_jax.runtime.steps import SamplingArrays, empty_controls

MIN_CONTROL_LEN = 64  # control lists are padded to a power of two from here (one compiled variant per length)

log = logging.getLogger("recguide_jax.engine")


class Engine:
  """Continuous-batching engine. Not thread-safe by itself: `EngineThread` serialises access for servers."""

  def __init__(self, runner: Runner, strategy: Strategy, *, tokenizer=None, max_queue: int = 1024,
               bucketing: bool | str = "auto", enable_prefix_caching: bool = True):
    self.runner = runner
    self.cfg = runner.cfg
    self.rc = runner.config
    self.strategy = strategy
    self.tokenizer = tokenizer
    self.max_queue = max_queue
    self.allocator = PageAllocator(self.rc.num_pages, self.rc.page_size, self.rc.pages_per_seq,
                                   enable_prefix_caching=enable_prefix_caching)
    self.scheduler = Scheduler(self.allocator, self.rc.max_batch, self.rc.max_block)
    self._eos = frozenset(self.cfg.eos_token_ids)
    self._eos_array = np.array(sorted(self._eos), np.int64)
    self._ids = itertools.count()
    self._totals = collections.Counter()  # engine-wide counters for /metrics
    self._tally = RoundTally(self._totals)  # the draft counters among them, folded when read
    # True: one batch per planned block size; False: mixed planned block sizes share one batch padded to the
    # largest; "auto": per step, whichever grouping the strategy's cost model (round_cost) prices cheaper
    self.bucketing = bucketing
    self.forward_log: list[tuple[str, int, int]] | None = None  # set to [] to record every forward
    self.round_log: list[RoundOutcome] | None = None  # set to [] to record every round's outcome (analysis)
    # a pipelined round dispatched ahead and not yet applied: (batch, device handle, dispatch time)
    self._pending: tuple[Batch, object, float] | None = None
    # True: pipelined rounds run ahead (`_chain_and_finish`): the next call starts from the inputs the previous step
    # function returned on the device, so running ahead compiles and dispatches nothing a synchronous engine does not
    self.pipeline = True
    self.step_count = 0
    # requests finished so far, and as of the last `_take_finished`: a steady step with none finished scans no
    # request for it
    self._finishes = self._finishes_taken = 0
    self._waited_on_compile = self._ran_this_step = False  # this step: some rows waited on a background compile
    self._rows = RowCache()
    self.books = DecodeBooks()  # running requests' decode stats (written to Request.stats when each finishes)

  @property
  def totals(self) -> collections.Counter:
    """Engine-wide counters (tokens, forwards per kind, drafts, requests by finish reason) for /metrics."""
    self._tally.fold()
    return self._totals

  @property
  def accepted_per_position(self) -> collections.Counter:
    """Block position k -> verified drafts that accepted at least k draft tokens."""
    self._tally.fold()
    return self._tally.per_position

  @property
  def block_size_choices(self) -> collections.Counter:
    """Block size -> request rounds run at it (an AR step is a round of block 1)."""
    self._tally.fold()
    return self._tally.block_sizes

  @property
  def strategy(self) -> Strategy:
    return self._strategy

  @strategy.setter
  def strategy(self, strategy: Strategy) -> None:
    self.drain()  # a call dispatched ahead was planned by the strategy before
    self._strategy = strategy

  def drain(self) -> None:
    """Reads back and applies a call dispatched ahead (before the strategy changes, or to settle the books)."""
    if getattr(self, "_pending", None) is not None:
      batch, handle, t0 = self._pending
      self._pending = None
      self._finish_round(batch, lambda: batch.round.collect(self.runner, batch, handle), t0)

  @property
  def waiting(self):
    return self.scheduler.waiting

  @property
  def running(self) -> list[Request]:
    return self.scheduler.running

  # ---- requests --------------------------------------------------------------------------------------------------
  def max_block(self) -> int:
    return self.rc.max_block

  def validate_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """Checks a request without touching engine state (safe from any thread); returns the prompt as ints."""
    for field in ("logprobs", "best_of"):  # best_of ranks samples by their tokens' logprobs
      if getattr(params, field) is not None and not self.strategy.supports_logprobs:
        params.validate(self.cfg.vocab_size)
        raise RequestError(f"{field} is not available with the {self.strategy.name} policy (denoised tokens have "
                           "no AR distribution)", field)
    if params.has_controls and not self.strategy.supports_logprobs:
      # a denoised block is sampled all at once: there is no per-position output history to penalize against
      params.validate(self.cfg.vocab_size)
      field = next(f for f, v in NEUTRAL_CONTROLS.items() if getattr(params, f) not in (None, v))
      raise RequestError(f"{field} is not available with the {self.strategy.name} policy (denoised tokens have no "
                         "AR distribution to apply sampling controls to)", field)
    return self.scheduler.validate(prompt_ids, params, self.cfg.vocab_size, self.rc.max_model_len)

  def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                  on_update=None, validated: bool = False, arrival: float | None = None,
                  prefill_source: str | None = None) -> Request:
    """Queues one sequence. `prefill_source`: the id of an earlier sample of the same prompt (n > 1): this one then
    shares that one's prefill (its full prompt pages, reference-counted) and computes only the prompt's last
    partial page; if that request is gone or fails before its prompt is cached, this one prefills on its own."""
    if params.num_samples != 1:
      raise RequestError("the engine takes one sample per request: add each of the n (or best_of) samples "
                         "(params.sample(i)) with prefill_source naming the first", "n")
    if not validated:
      prompt_ids = self.validate_request(prompt_ids, params)
    check_queue(len(self.waiting), self.max_queue)
    rid = request_id or f"req-{next(self._ids)}"
    seed = params.seed if params.seed is not None else int(np.random.randint(0, 2**31 - 1))
    req = Request(rid, list(prompt_ids), params, on_update=on_update, rng_seed=fold_seed(seed))
    # before it can join a batch: a bad value fails it alone
    req.sampling = sampling_row(params, req.rng_seed, req.prompt_ids, self.cfg.eos_token_ids)
    if arrival is not None:
      req.arrival = arrival
    if prefill_source is not None:
      req.prefill_source = next((r for r in itertools.chain(self.running, self.waiting)
                                 if r.request_id == prefill_source and r.prompt_ids == req.prompt_ids), None)
    self.waiting.append(req)
    self._totals["requests_added"] += 1
    return req

  def abort(self, request_id: str) -> bool:
    for req in list(self.waiting):
      if req.request_id == request_id:
        self.waiting.remove(req)
        self.finish(req, "abort")
        return True
    for req in self.running:
      if req.request_id == request_id:
        self.finish(req, "abort")
        self.running.remove(req)
        return True
    return False

  def _match_prefix(self, req: Request) -> None:
    """Automatic prefix caching: an admitted request takes the cached pages of its prompt's longest cached page
    prefix and prefills only the rest. Not a sample that shares another's prefill (it forks that one's pages) nor
    one that scores its prompt (every position's logprobs are computed); both still register their pages."""
    if not self.allocator.enable_prefix_caching:
      return
    match = req.prefill_source is None and req.params.prompt_logprobs is None
    hit = self.allocator.match_prefix(req.request_id, req.prompt_ids, match)
    if not match:
      return
    self._totals["prefix_cache_queries"] += len(req.prompt_ids)
    self._totals["prefix_cache_hits"] += hit
    self._totals["prompt_tokens"] += hit  # vLLM counts every prompt token, cached or computed
    if hit:
      req.num_cached_tokens = hit
      # each forward's sampling key is (seed, round): skip the rounds of the chunks not run, so the first token is
      # drawn with the key it would have had without the cache (seeded output is the same either way)
      chunk = self.rc.prefill_chunk
      n = len(req.prompt_ids)
      req.round_counter += -(-n // chunk) - -(-(n - hit) // chunk)

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached prompt prefix (vLLM's `reset_prefix_cache`); pages owned by running requests stay
    theirs."""
    self.allocator.reset_prefix_cache()
    return True

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def kv_pages(self) -> tuple[int, int]:
    """(KV pages owned by requests, usable KV pages: all but the null page)."""
    return self.allocator.num_used, self.allocator.num_pages - 1

  def run_until_done(self) -> None:
    while self.has_work():
      self.step()
      if self.stalled_on_compile:
        self.wait_for_compile(0.05)

  # ---- one engine iteration ------------------------------------------------------------------------------------------
  def step(self) -> list[Request]:
    """Runs one iteration; returns the requests that finished in it."""
    self.step_count += 1
    self._waited_on_compile = self._ran_this_step = False
    if self._pending is not None and self._advance_pipeline():
      return self._take_finished()
    for req in self.scheduler.admit():
      try:
        self.allocator.add(req.request_id)
        self._match_prefix(req)
        self.strategy.on_admit(req)
      except Exception as e:  # this request only: its pages are freed, the others are admitted as usual
        self.fail_request(req, "admitting it", e)
    prefill.share_prefills(self)
    prefilling = [r for r in self.running if self._prefilling(r) and r.prefill_source is None
                  and self._sampling_ready(r)]
    if prefilling:
      batch = prefilling[:self.rc.max_batch]
      # a chunk whose prompt logprobs are wanted runs the SCORE variant; the others keep the plain prefill
      scored = [r for r in batch if prefill.scores_prompt(r)]
      plain = [r for r in batch if not prefill.scores_prompt(r)]
      for reqs, score in ((plain, False), (scored, True)):
        if reqs:
          self._run_or_wait(reqs, lambda rs, score=score: self._isolated(rs, "prefill", prefill.run_prefill, self,
                                                                          rs, score))
    decoding = [r for r in self.running if r.seed_token is not None and not r.finished and self._sampling_ready(r)]
    if decoding:
      planned = self._plan(decoding)
      try:
        groups = group_plans(planned, self.bucketing, self.strategy.round_cost)
      except Exception:  # a cost-model bug: run the planned groups as they are
        log.exception("merging the planned groups failed; running them unmerged")
        groups = group_plans(planned, True, self.strategy.round_cost)
      for group in groups:
        for i in range(0, len(group.reqs), self.rc.max_batch):
          part = slice(i, i + self.rc.max_batch)
          rows = [row for row in zip(group.reqs[part], group.planned[part], group.verify_price[part])
                  if not row[0].finished]
          if rows:
            self._run_or_wait(rows, lambda rows, group=group: self.run_round(self._group_batch(group, rows)),
                              request=lambda row: row[0])
    return self._take_finished()

  def _take_finished(self) -> list[Request]:
    """The running requests that finished since the last call, taken out of the running set."""
    if self._finishes == self._finishes_taken:
      return []
    self._finishes_taken = self._finishes
    return self.scheduler.take_finished()

  def _group_batch(self, group, rows: list) -> Batch:
    """The batch of a group's `rows` ((request, planned block, verify price) each; their requests running)."""
    prices = np.array([p for _, _, p in rows], np.float64)
    return Batch(group.round, group.block, [r for r, _, _ in rows], np.array([b for _, b, _ in rows], np.int64),
                 verify_price=prices if prices.any() else None, running_as_of=self._finishes)

  @property
  def stalled_on_compile(self) -> bool:
    """The last step ran nothing: every request that could run waits for a background compile."""
    return self._waited_on_compile and not self._ran_this_step

  def wait_for_compile(self, timeout: float) -> None:
    """Lets a background compile run instead of stepping in a spin (call when `stalled_on_compile`)."""
    self.runner.wait_background(timeout)

  def _run_or_wait(self, rows: list, run, request=lambda row: row) -> None:
    """`run(rows)` (each row a request, or what `request` takes it from); if a variant it needs is compiling in the
    background (VariantNotReady, raised before anything ran), the requests with sampling controls (their variants
    are compiled on first use) wait this step and the others run without them; if they need it too, they all
    wait."""
    try:
      run(rows)
      self._ran_this_step = True
      return
    except VariantNotReady:
      self._waited_on_compile = True
    others = [row for row in rows if request(row).sampling.controls is None]
    if others and len(others) < len(rows):
      self._run_or_wait(others, run, request)

  def _view(self, reqs: Sequence[Request]) -> StepView:
    return StepView(self.step_count, tuple(reqs), self.rc.max_batch, self.rc.max_model_len, self.rc.max_block,
                    self._eos, len(self.running),
                    ragged_steps=self.bucketing == "ragged")

  def _plan(self, decoding: list[Request]) -> list[tuple[Request, RoundPlan]]:
    """The strategy's plan of the step, row by row; a planning error fails only the request it was planning (the
    step is then planned one request at a time to find it)."""
    try:
      return list(zip(decoding, self._checked_plan(decoding)))
    except Exception:
      return self._plan_alone(decoding)

  def _plan_alone(self, decoding: list[Request]) -> list[tuple[Request, RoundPlan]]:
    planned = []
    for req in decoding:
      try:
        planned.append((req, self._checked_plan([req])[0]))
      except Exception as e:
        self.fail_request(req, "planning its round", e)
    return planned

  def _checked_plan(self, reqs: list[Request]) -> tuple[RoundPlan, ...]:
    plans = self.strategy.plan_step(self._view(reqs)).plans
    if len(plans) != len(reqs):
      raise ValueError(f"{self.strategy.name} planned {len(plans)} rounds for {len(reqs)} requests")
    return plans

  def run_round(self, batch: Batch) -> None:
    """Builds `batch`'s arrays, runs its round, applies the output and tells the strategy. A pipelined round whose
    batch is the whole decoding set also gets its next call dispatched before this one is read back."""
    t0 = time.perf_counter()
    what = f"{batch.round.kind} round (block {batch.block})"
    if batch.round.pipelined:
      ok, handle = self._isolated(batch.reqs, what, self._dispatch, batch)
      if not ok:
        return
      self._chain_and_finish(batch, handle, t0)
      return
    self._finish_round(batch, lambda: self._run(batch), t0)

  def _finish_round(self, batch: Batch, output, t0: float, rows: tuple | None = None) -> None:
    """Collects a round's output (`output()`), applies it and tells the strategy. `rows`: the batch's `_row_state`
    where the caller read it after the round's requests last changed."""
    what = f"{batch.round.kind} round (block {batch.block})"
    # a pipelined call's rows of requests that stopped before it was applied are not part of its output
    live, generated = rows or self._row_state(batch)
    ok, out = self._isolated(batch.reqs, what, output)
    if not ok:
      return
    ok, _ = self._isolated(batch.reqs, what, self.apply, batch, out, generated, live)
    if not ok:
      return
    outcome = RoundOutcome(batch, out, generated, time.perf_counter() - t0)
    if self.round_log is not None:
      self.round_log.append(outcome)
    if live.any():  # (a failure fails the batch's requests that are still running: `finish` skips the others)
      self._isolated(batch.reqs, f"observing a {what}", self.strategy.observe, outcome)

  def _row_state(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `batch`: whether its request is still running, and its output tokens so far."""
    reqs, n = batch.reqs, batch.n
    # every row ran when the batch was made: while no request has finished since, every row still does
    live = (np.ones((n,), bool) if batch.running_as_of == self._finishes
            else np.fromiter((r.finish_reason is None for r in reqs), bool, n))
    return live, output_lengths(reqs)

  def batch_rows(self, reqs: Sequence[Request]) -> BatchRows:
    """The per-request rows of a batch of `reqs` (cached per composition: `batch_rows.RowCache`)."""
    return self._rows.get(reqs, lambda: gather_rows(reqs, self.allocator.table_rows([r.request_id for r in reqs]),
                                                    self.tokenizer))

  def _reserve(self, batch: Batch, ahead: int = 0) -> None:
    alloc = self.allocator
    rows = batch.request_rows = self.batch_rows(batch.reqs)
    alloc.reserve_rows(rows.table_rows, alloc.lengths(rows.table_rows) + ahead
                       + batch.round.reserve(batch.block, batch.steps))

  def _run(self, batch: Batch) -> RoundOutput:
    batch.steps = self.decode_steps(batch.reqs) if batch.round.multi_step else 1
    self._reserve(batch)
    self._fill(batch)
    return batch.round.run(self.runner, batch)

  def _dispatch(self, batch: Batch):
    batch.steps = self.decode_steps(batch.reqs) if batch.round.multi_step else 1
    self._reserve(batch)
    self._fill(batch)
    return batch.round.dispatch(self.runner, batch)

  # ---- the pipeline: the next call dispatched before the previous one is read back -----------------------------
  # While the device runs call k+1 the host reads call k back, emits its tokens and checks stop conditions. Call k+1
  # starts from call k's last tokens on the device and at the lengths call k commits (an AR call commits every step
  # it runs), so nothing of k has to reach the host first. A request that stops in call k wastes its row of k+1:
  # that row is never applied (its pages are freed with the request; later users of the pages run after k+1 on the
  # device, which takes every call's cache from the call before it). Only when the plan of k+1 cannot depend on
  # k's outcome: nothing waiting or prefilling, the batch the whole decoding set, and the strategy's say
  # (`Strategy.plans_ahead`, asked last: a strategy may decide the next step there).
  def _chain_and_finish(self, batch: Batch, handle, t0: float) -> None:
    """Dispatches the call after `batch`'s where it may run ahead (`_next_ahead`), then reads `batch`'s back and
    applies it."""
    rows = self._row_state(batch)
    nxt = self._next_ahead(batch, *rows)
    if nxt is not None:
      t1 = time.perf_counter()
      ok, handle2 = self._isolated(batch.reqs, f"{batch.round.kind} round (ahead)", self._dispatch_ahead, nxt,
                                   batch, handle)
      self._pending = (nxt, handle2, t1) if ok else None
      if not ok:
        rows = None  # (the failed dispatch stopped its requests: read them again)
    self._finish_round(batch, lambda: batch.round.collect(self.runner, batch, handle), t0, rows)
    if self._pending is not None:
      # the call in flight ran on the device while this one was read and applied: its round's wall time is what it
      # adds after this one's (timed from its dispatch, a strategy's calibration counted their shared time twice)
      self._pending = (*self._pending[:2], time.perf_counter())
    self._drain_if_idle()

  def _next_ahead(self, batch: Batch, live: np.ndarray, generated: np.ndarray) -> Batch | None:
    """The call after `batch`'s (dispatched, not applied yet), if it may run ahead; `live`, `generated`: the batch's
    `_row_state`. Its requests are then the whole running set: so none prefills."""
    if not (self.pipeline and not self.waiting and len(self.running) == batch.n and live.all()
            and self.runner.mesh is None  # a device array between calls keeps the single device's placement
            and batch.samp.controls is None  # penalties and min_tokens read the tokens the pending call commits
            # a row padded to a larger block commits less than its verify accepted on the device (a ragged row's
            # acceptance is capped at its own block there)
            and not (batch.round.pads_to_largest and (batch.planned < batch.block).any())):
      return None
    left = self._most_tokens_left(batch.request_rows, generated) - batch.round.ahead(batch)[1]
    plan = None if left < 1 else self.strategy.plans_ahead(batch)
    if plan is None:
      return None  # every request ends within `batch`'s call, or the strategy plans the next step itself
    planned, block = plan.planned, batch.block
    if planned is not batch.planned and not np.array_equal(planned, batch.planned):
      if not (batch.round.replans_rows and len(planned) == batch.n):
        return None  # other blocks where the round cannot give them: planned after `batch`'s outcome
      planned, block = np.asarray(planned, np.int64), int(np.max(planned))
    n = self.rc.decode_steps if batch.round.multi_step else 1
    return Batch(batch.round, block, batch.reqs, planned, steps=n if 1 < n <= left else 1,
                 verify_price=plan.verify_price, running_as_of=self._finishes)

  def _dispatch_ahead(self, batch: Batch, prev: Batch, handle):
    """Dispatches `batch`, the same requests' call after `prev`'s (dispatched as `handle`, not applied yet)."""
    most, _, keys = prev.round.ahead(prev)
    self._reserve(batch, most)
    # committed lengths: the round takes its own from `handle` where they vary; the bucket stays `prev`'s, whose
    # device seeds it starts from (a background compile may have made a smaller bucket routable meanwhile)
    self._fill(batch, most, keys, prev=prev)
    return batch.round.dispatch(self.runner, batch, seed=handle)

  def _advance_pipeline(self) -> bool:
    """At the start of a step with a call in flight: dispatches the one after it where it may run ahead, then reads
    the pending one back and applies it. True: the step is done (the pipeline goes on); False: it drained, the step
    goes on as usual."""
    batch, handle, t0 = self._pending
    self._pending = None
    self._chain_and_finish(batch, handle, t0)
    return self._pending is not None

  def _drain_if_idle(self) -> None:
    """A call in flight all of whose requests stopped is read back now (its forwards count in this run's ledger)."""
    if self._pending is not None and all(r.finished for r in self._pending[0].reqs):
      self.drain()

  def _fill(self, batch: Batch, ahead: int = 0, keys_ahead: int = 0, prev: Batch | None = None) -> None:
    """The batch's padded arrays: page table, committed lengths, sampling rows and keys, seed tokens (each a copy of
    rows kept per request, not rebuilt element by element). `ahead` tokens and `keys_ahead` sampling-key rounds: what
    `prev`, the same requests' call in flight before this one, will have committed and used. Such a call's batch
    bucket and sampling rows are `prev`'s (its keys `keys_ahead` rounds on) and its seed tokens are on the device
    (the host's are left zero)."""
    reqs, n = batch.reqs, len(batch.reqs)
    alloc = self.allocator
    b = batch.b = prev.b if prev is not None else self.runner.bucket_for(n)
    batch.bucket_for = self.runner.bucket_for
    batch.page_table = np.zeros((b, self.rc.pages_per_seq), np.int32)  # zeros: TRASH_PAGE
    rows = batch.request_rows
    alloc.write_page_rows(rows.table_rows, batch.page_table)
    batch.prefix_len = np.zeros((b,), np.int32)
    batch.prefix_len[:n] = alloc.lengths(rows.table_rows) + ahead
    batch.seed = np.zeros((b,), np.int32)
    batch.live = np.zeros((b,), bool)
    batch.live[:n] = True
    if prev is None:
      batch.seed[:n] = [r.seed_token for r in reqs]
      batch.samp = self.sampling_arrays(reqs, rows, b, keys_ahead)
      return
    # (the requests' seed tokens and round counters are a call behind; `prev`'s keys are this call's, less
    # `keys_ahead` rounds: its own and the one before it applied since)
    keys = prev.samp.keys.copy()
    keys[:n, 1] += np.uint32(keys_ahead)
    batch.samp = dataclasses.replace(prev.samp, keys=keys)

  def apply(self, batch: Batch, out: RoundOutput, generated: np.ndarray, live: np.ndarray) -> None:
    """Commits a round's output: pages (each row's committed tokens, what the round wrote past them dropped), the
    forward ledger and counters, the requests' stats, the sampling keys, then emission and stop conditions.
    `generated`: each row's output tokens before this round; `live`: the rows whose requests had not stopped."""
    reqs, rounds, req_rows = batch.reqs, out.rounds, batch.request_rows
    totals = self._totals
    for kind, blk, n in out.forwards:
      totals[f"forwards_{kind}"] += 1
      if self.forward_log is not None:
        self.forward_log.append((str(kind), blk, n))
    rows = np.flatnonzero(live)
    block, accepted, commit = np.asarray(out.block), np.asarray(out.accepted), np.asarray(out.commit)
    verified = None if out.verified is None else np.asarray(out.verified, np.int64)  # truncated: the drafts offered + 1
    table_rows, row_forwards = req_rows.table_rows, {kind: np.asarray(c) for kind, c in out.row_forwards.items()}
    if out.drafting is not None:  # rows that only drafted: their forwards, nothing else
      drafted = rows[out.drafting[rows]]
      self.books.count_forwards(table_rows[drafted], {kind: c[drafted] for kind, c in row_forwards.items()})
      rows = rows[~out.drafting[rows]]
    if len(rows) < len(reqs):  # (every row is live in a steady step: no gathers then)
      block, accepted, commit, table_rows = block[rows], accepted[rows], commit[rows], table_rows[rows]
      verified = None if verified is None else verified[rows]
      row_forwards = {kind: c[rows] for kind, c in row_forwards.items()}
    alloc = self.allocator
    alloc.commit_rows(table_rows, alloc.lengths(table_rows) + commit)
    if out.trim:
      # the pages of the call dispatched after this one (pipelined: it writes past what this one commits) stay, and
      # so do those of the call the pipeline dispatches after that one (it reserves them again at the next step:
      # trimming them would take and free a page per row every step); they go at the first trim without a call ahead
      pending = self._pending[0] if self._pending is not None and self._pending[0].reqs is reqs else None
      keep = 0
      if pending is not None:
        keep = pending.round.reserve(pending.block, pending.steps) + pending.round.ahead(pending)[0]
      alloc.trim_rows(table_rows, keep)
    spec = block > 1 if out.speculative else None
    self._tally.add(block, accepted, rounds, spec, verified)  # engine-wide counters
    # each request's own books, by its page-table row
    self.books.record(table_rows, block, accepted, rounds, row_forwards, spec, verified)
    self._emit_batch(reqs, out, rows, req_rows.max_tokens - generated, req_rows)

  def _emit_batch(self, reqs: Sequence[Request], out: RoundOutput, rows: np.ndarray, left: np.ndarray,
                  req_rows: BatchRows) -> None:
    """Advances the sampling keys of `rows` (the live ones) and emits their tokens. Each row's stop (its first EOS,
    or its max_tokens) is found over the batch's arrays at once; a `plain` request then needs no per-token work."""
    emit = np.asarray(out.emit)
    # only the columns some row emits (a verify's rows emit their accepted tokens, usually far fewer than its block)
    width = max(int(emit.max(initial=0)), 1)
    tokens, logprobs = out.tokens[:, :width], out.logprobs[:, :width]
    # a few EOS ids: compared directly (np.isin sorts, ~10x slower on a step's small array)
    eos = (tokens[:, :, None] == self._eos_array).any(axis=2)
    eos &= np.arange(width)[None, :] < emit[:, None]
    eos[req_rows.ignore_eos] = False
    first = np.where(eos.any(axis=1), eos.argmax(axis=1), width)
    # a plain row keeps its tokens up to its first EOS ("stop") or to its budget ("length"), whichever comes first
    stop = (first < emit) & (first < left)
    keep = np.where(stop, first + 1, np.minimum(emit, np.maximum(left, 0)))
    ends = np.where(stop, 1, np.where(left <= emit, 2, 0))
    if len(rows) < len(reqs):  # (every row is live in a steady step: nothing to pick then)
      reqs = [reqs[i] for i in rows.tolist()]
      emit, keep, ends, tokens, logprobs = emit[rows], keep[rows], ends[rows], tokens[rows], logprobs[rows]
    if out.key_rounds:
      for r in reqs:
        r.round_counter += out.key_rounds
    # a plain row's tokens are appended in one loop over the rows (in steady decoding that is all a row needs);
    # then its update callback and its end, where it has them
    plain = req_rows.plain[rows]
    take = np.flatnonzero(plain & (keep > 0))
    n = keep[take]
    toks, lps = tokens[take].tolist(), logprobs[take].tolist()
    if (n < width).any():  # (an AR call's rows keep every column)
      cut = n.tolist()
      toks, lps = [t[:k] for t, k in zip(toks, cut)], [lp[:k] for lp, k in zip(lps, cut)]
    generated = int(n.sum())
    for r, new, lp in zip([reqs[i] for i in take.tolist()], toks, lps):
      r.output_ids += new
      r.token_logprobs += lp
      r.seed_token = new[-1]
    for i in np.flatnonzero(plain & (req_rows.notify[rows] | (ends > 0)) & (emit > 0)).tolist():
      r = reqs[i]
      if r.finish_reason is not None:  # (an update callback may end another request)
        continue
      if r.on_update is not None and not self._notify(r, tokens[i, :keep[i]].tolist()):
        self.finish(r, "error", "engine error: the request's update callback failed")
      elif ends[i]:
        self.finish(r, "stop" if ends[i] == 1 else "length")
    # the others emit token by token (logprobs entries, stop token ids and strings)
    top_lp, top_ids = out.top_logprobs, out.top_ids
    for i in np.flatnonzero(~plain & (emit > 0)).tolist():
      row, k = int(rows[i]), int(emit[i])
      self.emit(reqs[i], tokens[i, :k].tolist(), logprobs[i, :k].tolist(),
                None if top_lp is None else top_lp[row, :k], None if top_ids is None else top_ids[row, :k])
    self._totals["generated_tokens"] += generated

  def sampling_arrays(self, reqs: Sequence[Request], rows: BatchRows, b: int, ahead: int = 0) -> SamplingArrays:
    """The padded batch's sampling rows, from the requests' `rows`; each row's key is (seed, its round counter +
    `ahead`)."""
    samp = SamplingArrays.greedy(b)
    n = len(reqs)
    if n:
      samp.temperature[:n] = rows.temperature
      samp.top_k[:n] = rows.top_k
      samp.top_p[:n] = rows.top_p
      samp.keys[:n, 0] = rows.seed
      samp.keys[:n, 1] = np.fromiter((r.round_counter + ahead for r in reqs), np.int64, n) & 0xFFFFFFFF
      samp.top_logprobs[:n] = rows.top_logprobs
      if rows.has_controls:
        samp.controls = control_arrays(reqs, b, self.cfg.vocab_size)
    return samp

  def prefilled(self, r: Request) -> int:
    """Prompt tokens of `r` whose K/V are in the cache (its committed length, while it prefills)."""
    if r.request_id not in self.allocator.owners():
      return 0
    return min(self.allocator.length(r.request_id), len(r.prompt_ids))

  def decode_steps(self, reqs: Sequence[Request]) -> int:
    """AR steps the next decode call of `reqs` runs: the runner's `decode_steps` when no request waits to be
    admitted or prefilled (a multi-step call would hold either back for its length) and some request of `reqs` has
    that many tokens left to generate, else 1."""
    n = self.rc.decode_steps
    if n <= 1 or self.waiting or self._any_prefilling():
      return 1
    generated = output_lengths(reqs)
    return n if self._most_tokens_left(self.batch_rows(reqs), generated) >= n else 1

  def _prefilling(self, r: Request) -> bool:
    """Whether `r`'s prompt is not fully cached yet. One with a seed token has it all: checked first, it spares the
    allocator lookups of every decoding request."""
    return r.seed_token is None and not r.finished and self.prefilled(r) < len(r.prompt_ids)

  def _any_prefilling(self) -> bool:
    return any(map(self._prefilling, self.running))

  @staticmethod
  def _most_tokens_left(rows: BatchRows, generated: np.ndarray) -> int:
    """The most tokens any request of `rows` may still generate, with `generated` output tokens each."""
    return int((rows.max_tokens - generated).max())

  # ---- request isolation -----------------------------------------------------------------------------------------
  # Per-request values are converted to their host array types when a request is added (`sampling_row`), so a bad
  # value fails only its own request. What can still raise inside a batched step is attributed as narrowly as the
  # step allows: an error while emitting one request's tokens fails that request; an error anywhere else in a
  # prefill or a round fails the requests of that batch (their pages are freed) and the engine goes on with the
  # others. Only a device failure (a runtime error from XLA, or a KV cache that a failed call left deleted) is
  # raised to the caller, which fails everything with `fail_all`.
  def _isolated(self, reqs: list[Request], what: str, fn, *args):
    """(True, fn's result), or (False, None) after failing `reqs` because fn raised."""
    try:
      return True, fn(*args)
    except VariantNotReady:
      raise  # nothing ran for these requests: `_run_or_wait` decides who waits
    except Exception as e:
      if self._device_failed(e):
        raise
      log.exception("%s of %d request(s) [%s] failed; failing those requests only", what, len(reqs),
                    ", ".join(r.request_id for r in reqs[:8]))
      for r in reqs:
        self.finish(r, "error", f"engine error: {type(e).__name__}: {e}")
      return False, None

  def _device_failed(self, e: Exception) -> bool:
    if isinstance(e, jax.errors.JaxRuntimeError):
      return True
    try:  # a donated cache consumed by a call that then failed: nobody's K/V is left
      return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.runner.cache))
    except Exception:
      return False

  def _sampling_ready(self, r: Request) -> bool:
    """Converts a request's sampling row before it joins a batch (add_request already did, unless the request was
    built or changed elsewhere); a value that does not fit fails this request alone."""
    if r.sampling is None:
      try:
        r.sampling = sampling_row(r.params, fold_seed(r.rng_seed), r.prompt_ids, self.cfg.eos_token_ids)
      except Exception as e:
        self.fail_request(r, "converting its sampling parameters", e)
        return False
    return True

  def fail_request(self, r: Request, what: str, e: Exception) -> None:
    """Fails one request (logged with what it was doing) and no other."""
    log.error("request %s failed while %s; failing it alone", r.request_id, what, exc_info=e)
    self.finish(r, "error", f"engine error: {type(e).__name__}: {e}")

  # ---- emission and finishing ----------------------------------------------------------------------------------------
  def emit(self, r: Request, toks: list[int], lps, top_lp, top_ids) -> None:
    """Appends a round's tokens to one request (stop conditions, logprobs, its update callback); an error here
    fails this request alone."""
    if r.finished:
      return
    try:
      self._deliver(r, *output.append_tokens(r, toks, lps, top_lp, top_ids, self._eos, self.tokenizer))
    except Exception as e:
      self.fail_request(r, "emitting its tokens", e)

  def _deliver(self, r: Request, new: list[int], reason: str | None) -> None:
    """After a request's tokens were appended: its next seed, the counters, its update callback, its end."""
    if r.seed_token is None or new:
      r.seed_token = r.output_ids[-1] if r.output_ids else None
    self._totals["generated_tokens"] += len(new)
    if not self._notify(r, new):
      self.finish(r, "error", "engine error: the request's update callback failed")
      return
    if reason is not None:
      self.finish(r, reason)

  @staticmethod
  def _notify(r: Request, new: list[int]) -> bool:
    """Calls the request's update callback; False (logged) if it raised."""
    if r.on_update is None:
      return True
    try:
      r.on_update(r, new)
      return True
    except Exception:
      log.exception("the update callback of request %s failed", r.request_id)
      return False

  def finish(self, r: Request, reason: str, error: str | None = None) -> None:
    """Ends a request once (later calls are no-ops): frees its KV pages and tells its caller. Never raises: it
    is how a failing request is taken out, so each part that could fail is logged and the rest still runs."""
    if r.finished:
      return
    r.finish_reason = reason
    self._finishes += 1
    r.error = error
    r.stats.latency_s = time.perf_counter() - r.arrival
    try:
      r.text = output.final_text(r, self.tokenizer)
    except Exception:
      log.exception("decoding the output of request %s failed", r.request_id)
      r.text = ""
    r.stop_text = None
    if self.scheduler.release(r):
      try:
        if r.request_id in self.allocator.owners():
          self.books.close(int(self.allocator.table_rows((r.request_id,))[0]), r.stats)
        self.allocator.free(r.request_id)
      except Exception:
        log.exception("freeing the KV pages of request %s failed", r.request_id)
    try:
      self.strategy.on_finish(r)
    except Exception:
      log.exception("the strategy's on_finish failed for request %s", r.request_id)
    self._totals[f"requests_{reason}"] += 1
    self._notify(r, [])

  def fail_all(self, message: str) -> None:
    """Finishes every request with an error (after a device failure) so no caller waits forever."""
    victims = list(self.waiting) + list(self.running)
    if victims:
      log.error("failing all %d requests (%d running, %d waiting): %s", len(victims), len(self.running),
                len(self.waiting), message)
    self._pending = None
    for r in victims:
      self.finish(r, "error", message)
    self.waiting.clear()
    self.running.clear()


def control_arrays(reqs: Sequence[Request], b: int, vocab_size: int):
  """The sampling controls of a padded batch (sampling.Controls of numpy arrays): each row's sparse list holds its
  prompt's distinct tokens (repetition_penalty), its output's distinct tokens with their counts (any penalty), its
  logit_bias entries and, while fewer than min_tokens tokens are out, its stop ids; padded to the longest row's
  capacity rounded up to a power of two (>= MIN_CONTROL_LEN), so a batch reuses a few compiled lengths. A row's
  capacity is its list at its longest (every output token distinct), so a request's length is fixed from its first
  step: its variants are compiled once, before it starts, never while it streams."""
  parts, longest = [], 0
  for r in reqs:
    c = r.sampling.controls
    if c is None:
      parts.append(None)
      continue
    longest = max(longest, len(c.prompt_ids) + (min(r.params.max_tokens, vocab_size) if c.penalizes_output else 0)
                  + len(c.bias_ids) + len(c.stop_ids))
    if c.penalizes_output and r.output_ids:
      out_ids, out_counts = np.unique(np.asarray(r.output_ids, np.int32), return_counts=True)
    else:
      out_ids, out_counts = np.zeros(0, np.int32), np.zeros(0, np.int64)
    left = max(0, c.min_tokens - len(r.output_ids))
    stop_ids = c.stop_ids if left else np.zeros(0, np.int32)
    parts.append((c, left, out_ids, out_counts, stop_ids))
  length = max(MIN_CONTROL_LEN, 1 << max(0, longest - 1).bit_length())
  ctl = empty_controls(b, length, vocab_size)
  for i, p in enumerate(parts):
    if p is None:
      continue
    c, left, out_ids, out_counts, stop_ids = p
    ctl.presence[i], ctl.frequency[i], ctl.repetition[i], ctl.min_p[i] = (
        c.presence_penalty, c.frequency_penalty, c.repetition_penalty, c.min_p)
    ctl.min_tokens_left[i] = left
    spans = {}
    k = 0
    for name, ids in (("prompt", c.prompt_ids), ("output", out_ids), ("bias", c.bias_ids), ("stop", stop_ids)):
      spans[name] = slice(k, k + len(ids))
      ctl.ids[i, spans[name]] = ids
      k += len(ids)
    ctl.in_prompt[i, spans["prompt"]] = True
    ctl.counts[i, spans["output"]] = out_counts
    ctl.bias[i, spans["bias"]] = c.bias
    ctl.stop[i, spans["stop"]] = True
  return ctl
