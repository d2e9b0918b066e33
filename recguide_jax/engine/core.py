"""The host-side engine: admits requests, runs chunked prefill, asks the decoding strategy for each decoding
request's round, groups the plans into batches, calls each batch's round, commits pages, emits tokens and finishes
requests. It knows no strategy by name (see `recguide_jax.decoding.strategy`).

Each `step()`:
1. admits waiting requests (FIFO) while a batch slot and their worst-case KV pages are free;
2. runs one prefill chunk for requests whose prompt is not fully cached (chunked prefill interleaves with decode;
   `prefill`: prompt scoring, and the samples of one prompt sharing its prefill);
3. asks the strategy for each decoding request's plan (a round and a block size) given a `StepView`, groups
   requests by plan (`scheduler.group_plans`) and runs one round per group (padded to its batch bucket);
4. rounds emit tokens through `verified`/`emit` (stop conditions, pages committed or cropped); finished requests
   leave the batch.

Requests join and leave between rounds. Only small arrays cross between host and device.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Sequence

import jax
import numpy as np

from recguide_jax.decoding.strategy import Group, RoundPlan, StepView, Strategy
from recguide_jax.engine import output, prefill
from recguide_jax.engine.scheduler import Scheduler, group_plans
from recguide_jax.cache.kv_cache import PageAllocator
from recguide_jax.engine.requests import QueueFull, Request, RequestError, SamplingParams, fold_seed, sampling_row
from recguide_jax.runtime.runner import Runner
from recguide_jax.runtime.steps import SamplingArrays

log = logging.getLogger("recguide_jax.engine")


class Engine:
  """Continuous-batching engine. Not thread-safe by itself: `EngineThread` serialises access for servers.

  It is also the `RoundContext` its strategy's rounds run with (`batch_arrays`, `reserve`, `verified`, ...)."""

  def __init__(self, runner: Runner, strategy: Strategy, *, tokenizer=None, max_queue: int = 1024,
               bucketing: bool | str = "auto"):
    self.runner = runner
    self.cfg = runner.cfg
    self.rc = runner.config
    self.strategy = strategy
    self.tokenizer = tokenizer
    self.max_queue = max_queue
    self.allocator = PageAllocator(self.rc.num_pages, self.rc.page_size, self.rc.pages_per_seq)
    self.scheduler = Scheduler(self.allocator, self.rc.max_batch, self.rc.max_block)
    self._eos = frozenset(self.cfg.eos_token_ids)
    self._ids = itertools.count()
    self.totals = collections.Counter()  # engine-wide counters for /metrics
    self.accepted_per_position = collections.Counter()  # block index -> accepted draft tokens there
    self.block_size_choices = collections.Counter()
    # True: one batch per planned block size; False: mixed planned block sizes share one batch padded to the
    # largest; "auto": per step, whichever grouping the strategy's cost model (round_cost) prices cheaper
    self.bucketing = bucketing
    self.forward_log: list[tuple[str, int, int]] | None = None  # set to [] to record every forward
    self.signal_log: list[dict] | None = None  # set to [] to record per-round draft signals (analysis)
    self.step_count = 0

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
    if len(self.waiting) >= self.max_queue:
      raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
    rid = request_id or f"req-{next(self._ids)}"
    seed = params.seed if params.seed is not None else int(np.random.randint(0, 2**31 - 1))
    req = Request(rid, list(prompt_ids), params, on_update=on_update, rng_seed=fold_seed(seed))
    req.sampling = sampling_row(params, req.rng_seed)  # before it can join a batch: a bad value fails it alone
    if arrival is not None:
      req.arrival = arrival
    if prefill_source is not None:
      req.prefill_source = next((r for r in itertools.chain(self.running, self.waiting)
                                 if r.request_id == prefill_source and r.prompt_ids == req.prompt_ids), None)
    self.waiting.append(req)
    self.totals["requests_added"] += 1
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

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def kv_pages(self) -> tuple[int, int]:
    """(KV pages owned by requests, usable KV pages: all but the null page)."""
    return self.allocator.num_used, self.allocator.num_pages - 1

  def run_until_done(self) -> None:
    while self.has_work():
      self.step()

  # ---- one engine iteration ------------------------------------------------------------------------------------------
  def step(self) -> list[Request]:
    """Runs one iteration; returns the requests that finished in it."""
    self.step_count += 1
    for req in self.scheduler.admit():
      try:
        self.allocator.add(req.request_id)
        self.strategy.on_admit(req)
      except Exception as e:  # this request only: its pages are freed, the others are admitted as usual
        self.fail_request(req, "admitting it", e)
    prefill.share_prefills(self)
    prefilling = [r for r in self.running if r.prefilled < len(r.prompt_ids) and not r.finished
                  and r.prefill_source is None and self._sampling_ready(r)]
    if prefilling:
      batch = prefilling[:self.rc.max_batch]
      # a chunk whose prompt logprobs are wanted runs the SCORE variant; the others keep the plain prefill
      scored = [r for r in batch if prefill.scores_prompt(r)]
      plain = [r for r in batch if not prefill.scores_prompt(r)]
      for reqs, score in ((plain, False), (scored, True)):
        if reqs:
          self._isolated(reqs, "prefill", prefill.run_prefill, self, reqs, score)
    decoding = [r for r in self.running if r.seed_token is not None and not r.finished and self._sampling_ready(r)]
    view = StepView(self.step_count, len(decoding), self.rc.max_batch, self.rc.max_model_len, self.rc.max_block,
                    self._eos, tuple(decoding), len(self.running),
                    ragged_steps=self.bucketing == "ragged" and isinstance(self.bucketing, str))
    planned: list[tuple[Request, RoundPlan]] = []
    for req in decoding:
      try:
        planned.append((req, self.strategy.plan(req, view)))
      except Exception as e:
        self.fail_request(req, "planning its round", e)
    try:
      groups = group_plans(planned, self.bucketing, self.strategy.round_cost)
    except Exception:  # a cost-model bug: run the planned groups as they are
      log.exception("merging the planned groups failed; running them unmerged")
      groups = group_plans(planned, True, self.strategy.round_cost)
    for group in groups:
      for i in range(0, len(group.reqs), self.rc.max_batch):
        rows = [(r, p) for r, p in zip(group.reqs[i:i + self.rc.max_batch], group.planned[i:i + self.rc.max_batch])
                if not r.finished]
        if not rows:
          continue
        chunk = Group(group.round, group.block, [r for r, _ in rows], [p for _, p in rows])
        t0 = time.perf_counter()
        ok, ran = self._isolated(chunk.reqs, f"{group.round.kind} round (block {group.block})", group.round.run,
                                 self, chunk)
        if not ok:
          continue
        label, rounds = ran if isinstance(ran, tuple) else (ran, 1)
        # the whole round on the wall clock (batch assembly, forwards, acceptance, emission): what a strategy that
        # calibrates its cost model online compares regimes by (a multi-step AR call: each step at its share)
        try:
          self.strategy.observe_round(label or group.round.kind, group.block, len(chunk.reqs),
                                      (time.perf_counter() - t0) / rounds)
        except Exception:
          log.exception("the strategy's observe_round failed")
    return self.scheduler.take_finished()

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
        r.sampling = sampling_row(r.params, fold_seed(r.rng_seed))
      except Exception as e:
        self.fail_request(r, "converting its sampling parameters", e)
        return False
    return True

  def fail_request(self, r: Request, what: str, e: Exception) -> None:
    """Fails one request (logged with what it was doing) and no other."""
    log.error("request %s failed while %s; failing it alone", r.request_id, what, exc_info=e)
    self.finish(r, "error", f"engine error: {type(e).__name__}: {e}")

  # ---- the RoundContext: what rounds call ----------------------------------------------------------------------------
  def count_forward(self, kind: str, blk: int, rows: int) -> None:
    """Every device forward: engine totals, and the ledger a profile can price (kind, block, live rows)."""
    self.totals[f"forwards_{kind}"] += 1
    if self.forward_log is not None:
      self.forward_log.append((str(kind), blk, rows))

  def batch_arrays(self, reqs: Sequence[Request], rounds: int = 1):
    n = len(reqs)
    b = self.runner.bucket_for(n)
    width = self.rc.pages_per_seq
    page_table = np.zeros((b, width), np.int32)
    prefix_len = np.zeros((b,), np.int32)
    for i, r in enumerate(reqs):
      page_table[i] = self.allocator.page_table_row(r.request_id, width)
      prefix_len[i] = self.allocator.length(r.request_id)
    samp = SamplingArrays.greedy(b)
    for i, r in enumerate(reqs):
      row = r.sampling  # converted when the request was added (or by step, before it joined a batch)
      samp.temperature[i] = row.temperature
      samp.top_k[i] = row.top_k
      samp.top_p[i] = row.top_p
      samp.keys[i] = (row.seed, r.round_counter & 0xFFFFFFFF)
      samp.top_logprobs[i] = r.params.logprobs or 0
      r.round_counter += rounds
    return b, page_table, prefix_len, samp

  def decode_steps(self, reqs: Sequence[Request]) -> int:
    """AR steps the next decode call of `reqs` runs: the runner's `decode_steps` when no request waits to be
    admitted or prefilled (a multi-step call would hold either back for its length) and some request of `reqs` has
    that many tokens left to generate, else 1."""
    n = self.rc.decode_steps
    if n <= 1 or self.waiting or any(r.prefilled < len(r.prompt_ids) and not r.finished for r in self.running):
      return 1
    return n if max(r.params.max_tokens - len(r.output_ids) for r in reqs) >= n else 1

  def seeds(self, reqs: Sequence[Request], b: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row seed tokens and the live-row flag of a padded batch."""
    seed = np.zeros((b,), np.int32)
    live = np.zeros((b,), bool)
    for i, r in enumerate(reqs):
      seed[i] = r.seed_token
      live[i] = True
    return seed, live

  def reserve(self, reqs: Sequence[Request], blk: int) -> None:
    for r in reqs:
      self.allocator.reserve(r.request_id, self.allocator.length(r.request_id) + blk)

  def committed(self, req: Request) -> int:
    return self.allocator.length(req.request_id)

  def commit(self, req: Request, length: int) -> None:
    self.allocator.commit(req.request_id, length)

  def count_block(self, r: Request, blk: int, accepted: int) -> None:
    r.stats.rounds += 1
    r.stats.accepted_lengths.append(accepted)
    r.stats.block_sizes.append(blk)
    self.block_size_choices[blk] += 1

  def verified(self, r: Request, blk: int, accepted: int, res, i: int) -> None:
    c = self.allocator.length(r.request_id)
    toks = [int(t) for t in res.tokens[i, :accepted]]
    self.count_block(r, blk, accepted)
    if blk > 1:
      self.totals["drafts"] += 1  # one verified draft (vLLM's spec_decode_num_drafts)
      r.stats.draft_tokens += blk - 1
      r.stats.accepted_draft_tokens += accepted - 1
      self.totals["draft_tokens"] += blk - 1
      self.totals["accepted_draft_tokens"] += accepted - 1
      for pos in range(1, accepted):
        self.accepted_per_position[pos] += 1
    # the cache now holds [seed, accepted drafts]; everything the verify wrote past them is dropped
    self.allocator.commit(r.request_id, c + accepted)
    self.allocator.trim(r.request_id)
    self.strategy.observe(r, blk, accepted, res, i)
    if self.signal_log is not None and res.draft_signals is not None:
      self.signal_log.append({"block_size": blk, "accepted": accepted,
                              "draft": res.draft_tokens[i].tolist(), "out": res.tokens[i, :accepted].tolist(),
                              "conf": res.draft_signals[i, 0].tolist(), "margin": res.draft_signals[i, 1].tolist(),
                              "alt": res.draft_signals[i, 2].astype(int).tolist()})
    self.emit(r, toks, list(res.logprobs[i, :accepted]), res.top_logprobs[i, :accepted], res.top_ids[i, :accepted])

  def decoded(self, r: Request, steps: int, res, i: int) -> None:
    """After an AR decode call of `steps` steps (`res` [b, steps]): each step is one round of one token in the
    stats and for `strategy.observe`; the K/V of all steps are committed and the tokens emitted up to the request's
    stop condition (a request that stops inside the call frees its pages, what later steps wrote with them)."""
    c = self.allocator.length(r.request_id)
    for _ in range(steps):
      self.count_block(r, 1, 1)
      self.strategy.observe(r, 1, 1, res, i)
    self.allocator.commit(r.request_id, c + steps)
    self.emit(r, [int(t) for t in res.tokens[i, :steps]], list(res.logprobs[i, :steps]), res.top_logprobs[i, :steps],
              res.top_ids[i, :steps])

  # ---- emission and finishing ----------------------------------------------------------------------------------------
  def emit(self, r: Request, toks: list[int], lps, top_lp, top_ids) -> None:
    """Appends a round's tokens to one request (stop conditions, logprobs, its update callback); an error here
    fails this request alone."""
    if r.finished:
      return
    try:
      new, reason = output.append_tokens(r, toks, lps, top_lp, top_ids, self._eos, self.tokenizer)
      if r.seed_token is None or new:
        r.seed_token = r.output_ids[-1] if r.output_ids else None
      self.totals["generated_tokens"] += len(new)
      if not self._notify(r, new):
        self.finish(r, "error", "engine error: the request's update callback failed")
        return
      if reason is not None:
        self.finish(r, reason)
    except Exception as e:
      self.fail_request(r, "emitting its tokens", e)

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
        self.allocator.free(r.request_id)
      except Exception:
        log.exception("freeing the KV pages of request %s failed", r.request_id)
    try:
      self.strategy.on_finish(r)
    except Exception:
      log.exception("the strategy's on_finish failed for request %s", r.request_id)
    self.totals[f"requests_{reason}"] += 1
    self._notify(r, [])

  _finish = finish  # the earlier private name (EngineThread and tests call it)
  _fail_request = fail_request

  def fail_all(self, message: str) -> None:
    """Finishes every request with an error (after a device failure) so no caller waits forever."""
    victims = list(self.waiting) + list(self.running)
    if victims:
      log.error("failing all %d requests (%d running, %d waiting): %s", len(victims), len(self.running),
                len(self.waiting), message)
    for r in victims:
      self.finish(r, "error", message)
    self.waiting.clear()
    self.running.clear()
