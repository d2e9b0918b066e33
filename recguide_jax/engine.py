"""The host-side engine: request queue, admission by KV pages, continuous batching, per-round grouping into compiled
variants, acceptance bookkeeping, stop conditions and per-request stats.

Each `step()`:
1. admits waiting requests (FIFO) while a batch slot and their worst-case KV pages are free;
2. runs one prefill chunk for requests whose prompt is not fully cached (chunked prefill interleaves with decode);
3. asks the policy for each decoding request's plan this round (kind and block size), groups requests by plan and
   runs one compiled variant per group (padded to its batch bucket);
4. emits tokens, checks stop conditions, commits/crops pages and frees finished requests.

Requests join and leave between rounds. Only small arrays cross between host and device.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from recguide_jax import policies as policies_lib
from recguide_jax.kv_cache import PageAllocator
from recguide_jax.runner import Runner, SamplingArrays, fused_kind

MAX_TOP_LOGPROBS = 5
# Bounds of the request fields that are not bounded by the model (vocabulary, max_model_len). Each one keeps a value
# inside the host array type it is written to, or a per-token cost (stop strings are searched in the decoded text of
# every step) small.
SEED_RANGE = (-2**63, 2**63 - 1)  # vLLM's: a signed 64-bit integer; folded to the 32-bit key word (`fold_seed`)
MAX_TEMPERATURE = 100.0
# vLLM's clamp: 0 < temperature < 0.01 samples at 0.01, so logits / temperature cannot overflow float32 (a denormal
# temperature would turn the softmax into NaN)
MIN_TEMPERATURE = 1e-2
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: held-back stream tails are checked against every prefix of every stop
MAX_STOP_TOKEN_IDS = 256

log = logging.getLogger("recguide_jax.engine")


def describe(value, limit: int = 40) -> str:
  """A short, always-encodable rendering of a client-supplied value for an error message: ASCII escapes instead of
  lone surrogates or other odd characters, no int-to-str conversion of huge integers, capped length."""
  if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
    return f"an integer of {value.bit_length()} bits"
  if isinstance(value, (str, int, float, bool)) or value is None:
    text = ascii(value)
  else:
    text = f"a value of type {type(value).__name__}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def fold_seed(seed: int) -> int:
  """A request seed (any integer in SEED_RANGE) -> the 32-bit word of its sampling keys. Seeds in [0, 2^32) are
  used as they are (their sampled streams do not change); a larger or negative seed goes through the splitmix64
  finaliser of its 64-bit two's complement, so every one of its bits counts and neighbours do not collide in a
  pattern (a plain xor of the halves maps -1 and 2^32 + 1 onto 0)."""
  s = int(seed)
  if 0 <= s < 2**32:
    return s
  mask = 0xFFFFFFFFFFFFFFFF
  u = s & mask
  u = ((u ^ (u >> 30)) * 0xBF58476D1CE4E5B9) & mask
  u = ((u ^ (u >> 27)) * 0x94D049BB133111EB) & mask
  return (u ^ (u >> 31)) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class SamplingRow:
  """One request's row of the batch's sampling arrays, converted to their dtypes once, when the request is added,
  so a value that does not fit fails that request alone instead of the batch it would join."""
  temperature: np.float32
  top_k: np.int32
  top_p: np.float32
  seed: np.uint32


def sampling_row(params: "SamplingParams", rng_seed: int) -> SamplingRow:
  """Raises RequestError (naming the field) if a value does not fit its array type; silent float overflow counts."""
  temperature = float(params.temperature)
  if 0 < temperature < MIN_TEMPERATURE:
    temperature = MIN_TEMPERATURE
  fields = {"temperature": (temperature, np.float32), "top_k": (max(int(params.top_k), 0), np.int32),
            "top_p": (float(params.top_p), np.float32), "seed": (int(rng_seed), np.uint32)}
  out = {}
  for name, (value, dtype) in fields.items():
    info = np.finfo(dtype) if np.issubdtype(dtype, np.floating) else np.iinfo(dtype)
    if not (info.min <= value <= info.max) or (isinstance(value, float) and not np.isfinite(value)):
      raise RequestError(f"{name} {describe(value)} does not fit the engine's {np.dtype(dtype).name} array", name)
    out[name] = dtype(value)
  return SamplingRow(**out)


class RequestError(ValueError):
  """A request that can never be served (bad parameters, prompt too long); `param` names the offending field."""

  def __init__(self, message: str, param: str | None = None, code: int = 400):
    super().__init__(message)
    self.param = param
    self.code = code


class QueueFull(RequestError):

  def __init__(self, message: str):
    super().__init__(message, None, 429)


@dataclasses.dataclass
class SamplingParams:
  """Per-request sampling parameters (vLLM-shaped names and defaults)."""
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0 or -1: off
  seed: int | None = None
  stop: str | Sequence[str] | None = None
  stop_token_ids: Sequence[int] | None = None
  logprobs: int | None = None  # number of top logprobs per token (0: only the chosen token's)
  ignore_eos: bool = False

  def validate(self, vocab_size: int | None = None) -> "SamplingParams":
    """Checks every field's type and range (the ranges its host array type and the model allow); raises
    RequestError naming the field. Booleans are not integers here (`True` is no max_tokens)."""
    def bad(field, msg):
      raise RequestError(f"{field} {msg}", field)

    def is_int(v):
      return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    def is_number(v):
      return is_int(v) or (isinstance(v, (float, np.floating)) and not isinstance(v, bool))

    if not is_int(self.max_tokens) or self.max_tokens <= 0:
      bad("max_tokens", f"must be a positive integer, got {describe(self.max_tokens)}")
    if not is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
      bad("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}], got {describe(self.temperature)}")
    if not is_number(self.top_p) or not 0 < self.top_p <= 1:
      bad("top_p", f"must be in (0, 1], got {describe(self.top_p)}")
    top_k_max = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
    if not is_int(self.top_k) or not -1 <= self.top_k <= top_k_max:
      bad("top_k", f"must be -1 or 0 (off) or an integer in [1, {top_k_max}] (the vocabulary size), got "
          f"{describe(self.top_k)}")
    if self.seed is not None and (not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
      bad("seed", f"must be an integer in [-2^63, 2^63 - 1], got {describe(self.seed)}")
    if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
      bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {describe(self.logprobs)}")
    if not isinstance(self.ignore_eos, (bool, np.bool_)):
      bad("ignore_eos", f"must be a boolean, got {describe(self.ignore_eos)}")
    if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
      bad("stop", f"must be a string or a list of strings, got {describe(self.stop)}")
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
      bad("stop", f"holds {len(stops)} stop strings, at most {MAX_STOP_STRINGS} are allowed")
    for s in stops:
      if not isinstance(s, str) or not s:
        bad("stop", f"must be a non-empty string or a list of non-empty strings, got {describe(s)}")
      if len(s) > MAX_STOP_CHARS:
        bad("stop", f"strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
    if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
      bad("stop_token_ids", f"must be a list of token ids, got {describe(self.stop_token_ids)}")
    ids = list(self.stop_token_ids or [])
    if len(ids) > MAX_STOP_TOKEN_IDS:
      bad("stop_token_ids", f"holds {len(ids)} ids, at most {MAX_STOP_TOKEN_IDS} are allowed")
    for t in ids:
      if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
        bad("stop_token_ids", f"holds an invalid token id {describe(t)}"
            + (f" (the vocabulary is [0, {vocab_size}))" if vocab_size is not None else ""))
    return self

  @property
  def stop_strings(self) -> list[str]:
    return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


@dataclasses.dataclass
class RequestStats:
  rounds: int = 0
  accepted_lengths: list[int] = dataclasses.field(default_factory=list)
  block_sizes: list[int] = dataclasses.field(default_factory=list)
  forwards: dict[str, int] = dataclasses.field(
      default_factory=lambda: {"prefill": 0, "draft": 0, "verify": 0, "decode": 0, "denoise": 0, "commit": 0})
  overlap: dict[str, int] = dataclasses.field(default_factory=dict)  # RecGuide branch outcomes
  draft_tokens: int = 0  # draft tokens offered to the verifier
  accepted_draft_tokens: int = 0
  ttft_s: float | None = None
  latency_s: float | None = None
  queue_s: float | None = None  # arrival -> admitted to the running batch (vLLM's queue time)

  @property
  def decode_forwards(self) -> int:
    return sum(v for k, v in self.forwards.items() if k != "prefill")

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["decode_forwards"] = self.decode_forwards
    d["mean_accepted_length"] = (float(np.mean(self.accepted_lengths)) if self.accepted_lengths else 0.0)
    return d


@dataclasses.dataclass
class Request:
  request_id: str
  prompt_ids: list[int]
  params: SamplingParams
  arrival: float = dataclasses.field(default_factory=time.perf_counter)
  output_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[dict] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
  error: str | None = None
  stats: RequestStats = dataclasses.field(default_factory=RequestStats)
  on_update: Callable[["Request", list[int]], None] | None = None
  # engine state
  prefilled: int = 0  # prompt tokens whose K/V are in the cache
  seed_token: int | None = None  # emitted, not yet cached
  rng_seed: int = 0  # the 32-bit key word (fold_seed of the request's seed)
  round_counter: int = 0
  sampling: SamplingRow | None = None  # this request's sampling-array row, converted when it was added
  text: str | None = None  # set when finished (cut before a stop string if one matched)
  error_code: int | None = None
  policy_state: dict = dataclasses.field(default_factory=dict)

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None


class Engine:
  """Continuous-batching engine. Not thread-safe by itself: `EngineThread` serialises access for servers."""

  def __init__(self, runner: Runner, policy: policies_lib.Policy, *, tokenizer=None, max_queue: int = 1024):
    self.runner = runner
    self.cfg = runner.cfg
    self.rc = runner.config
    self.policy = policy
    self.tokenizer = tokenizer
    self.max_queue = max_queue
    self.allocator = PageAllocator(self.rc.num_pages, self.rc.page_size, self.rc.pages_per_seq)
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self._pledged: dict[str, int] = {}  # worst-case pages promised to each running request
    self._ids = itertools.count()
    self.totals = collections.Counter()  # engine-wide counters for /metrics
    self.accepted_per_position = collections.Counter()  # block index -> accepted draft tokens there
    self.block_size_choices = collections.Counter()
    # True: one batch per planned block size; False: mixed planned block sizes share one batch padded to the
    # largest; "auto": per step, whichever grouping the policy's cost model (round_cost) prices cheaper
    self.bucketing: bool | str = "auto"
    self.forward_log: list[tuple[str, int, int]] | None = None  # set to [] to record every forward
    self.overlap_log: list | None = None  # set to [] to record every overlap round (overlap.OverlapRound)
    self.step_count = 0
    self.decoding_count = 0  # requests decoding in the current step (the load the policy sees)
    self.signal_log: list[dict] | None = None  # set to [] to record per-round draft signals (analysis)

  # ---- requests --------------------------------------------------------------------------------------------------
  def max_block(self) -> int:
    return self.rc.max_block

  def validate_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """Checks a request without touching engine state (safe from any thread); returns the prompt as ints."""
    params.validate(self.cfg.vocab_size)
    if params.logprobs is not None and not self.policy.supports_logprobs:
      raise RequestError(f"logprobs are not available with the {self.policy.name} policy (denoised tokens have "
                         "no AR distribution)", "logprobs")
    if isinstance(prompt_ids, (str, bytes)) or any(
        isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) for t in prompt_ids):
      raise RequestError("prompt must be a list of token ids (integers)", "prompt")
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
      raise RequestError("prompt must not be empty", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
    if bad:
      raise RequestError(f"prompt holds token id {describe(bad[0])} outside the vocabulary "
                         f"[0, {self.cfg.vocab_size})", "prompt")
    if len(prompt_ids) >= self.rc.max_model_len:
      raise RequestError(f"prompt has {len(prompt_ids)} tokens, max_model_len is {self.rc.max_model_len}", "prompt",
                         413)
    if len(prompt_ids) + params.max_tokens > self.rc.max_model_len:
      raise RequestError(
          f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
          f"{self.rc.max_model_len}", "max_tokens")
    if self._pages_needed(len(prompt_ids), params) > self.allocator.num_pages - 1:
      raise RequestError("request needs more KV pages than the cache has", "max_tokens")
    return prompt_ids

  def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                  on_update=None, validated: bool = False, arrival: float | None = None) -> Request:
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
    self.waiting.append(req)
    self.totals["requests_added"] += 1
    return req

  def abort(self, request_id: str) -> bool:
    for req in list(self.waiting):
      if req.request_id == request_id:
        self.waiting.remove(req)
        self._finish(req, "abort")
        return True
    for req in self.running:
      if req.request_id == request_id:
        self._finish(req, "abort")
        self.running.remove(req)
        return True
    return False

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  # ---- admission ---------------------------------------------------------------------------------------------------
  def _pages_needed(self, prompt_len: int, params: SamplingParams) -> int:
    # worst case: the whole generation plus one block written past it by a verify
    return self.allocator.pages_for(prompt_len + params.max_tokens + self.max_block())

  def _admit(self) -> None:
    free_budget = self.allocator.num_pages - 1 - sum(self._pledged.values())
    while self.waiting and len(self.running) < self.rc.max_batch:
      req = self.waiting[0]
      need = self._pages_needed(len(req.prompt_ids), req.params)
      if need > free_budget:
        break  # FIFO: nothing overtakes the oldest request
      self.waiting.popleft()
      free_budget -= need
      self._pledged[req.request_id] = need
      self.running.append(req)
      req.stats.queue_s = time.perf_counter() - req.arrival
      try:
        self.allocator.add(req.request_id)
        self.policy.on_admit(req)
      except Exception as e:  # this request only: its pages are freed, the others are admitted as usual
        self._fail_request(req, "admitting it", e)

  # ---- one engine iteration ------------------------------------------------------------------------------------------
  def step(self) -> list[Request]:
    """Runs one iteration; returns the requests that finished in it."""
    self.step_count += 1
    self._admit()
    finished: list[Request] = []
    prefilling = [r for r in self.running
                  if r.prefilled < len(r.prompt_ids) and not r.finished and self._sampling_ready(r)]
    if prefilling:
      batch = prefilling[:self.rc.max_batch]
      self._isolated(batch, "prefill", self._prefill, batch)
    decoding = [r for r in self.running if r.seed_token is not None and not r.finished and self._sampling_ready(r)]
    self.decoding_count = len(decoding)
    groups: dict[tuple, list[Request]] = {}
    for req in decoding:
      try:
        plan = self.policy.plan(req, self)
      except Exception as e:
        self._fail_request(req, "planning its round", e)
        continue
      groups.setdefault((plan.kind, plan.block_size), []).append(req)
    if self.bucketing is not True:
      try:
        groups = self._merge_linear_groups(groups, None if self.bucketing is False else self.policy.round_cost)
      except Exception:  # a cost-model bug: run the planned groups as they are
        log.exception("merging the planned LinearSS groups failed; running them unmerged")
    for (kind, blk), reqs in groups.items():
      for i in range(0, len(reqs), self.rc.max_batch):
        chunk = [r for r in reqs[i:i + self.rc.max_batch] if not r.finished]
        if not chunk:
          continue
        t0 = time.perf_counter()
        ok, label = self._isolated(chunk, f"{kind} round (block {blk})", self._round, kind, blk, chunk)
        if not ok:
          continue
        # the whole round on the wall clock (batch assembly, forwards, acceptance, emission): what a policy that
        # calibrates its cost model online compares regimes by
        try:
          self.policy.observe_round(label or kind, blk, len(chunk), time.perf_counter() - t0)
        except Exception:
          log.exception("the policy's observe_round failed")
    for req in list(self.running):
      if req.finished:
        self.running.remove(req)
        finished.append(req)
    return finished

  def _round(self, kind: str, blk: int, chunk: list[Request]):
    if kind == "ar":
      return self._round_ar(chunk)
    if kind == "linear":
      return self._round_linear(chunk, blk)
    if kind == "diffusion":
      return self._round_diffusion(chunk, blk)
    if kind == "overlap":
      return self._round_overlap(chunk, blk)
    if kind == "shadow":
      return self._round_shadow(chunk, blk)
    raise ValueError(f"unknown plan kind {kind!r}")

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
        self._finish(r, "error", f"engine error: {type(e).__name__}: {e}")
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
        self._fail_request(r, "converting its sampling parameters", e)
        return False
    return True

  def _fail_request(self, r: Request, what: str, e: Exception) -> None:
    log.error("request %s failed while %s; failing it alone", r.request_id, what, exc_info=e)
    self._finish(r, "error", f"engine error: {type(e).__name__}: {e}")

  @staticmethod
  def _merge_linear_groups(groups: dict, round_cost: Callable[[int, int], float | None] | None) -> dict:
    """Merges LinearSS groups of different planned B into batches padded to their largest B; each request keeps
    at most its own planned B of the verified tokens. `round_cost=None` merges all of them (bucketing off, the
    paper's "+s_t"/"+z_t" rows). Otherwise every split of the B-sorted groups into consecutive runs is priced
    with round_cost(batch, B) (one round per run, at the run's largest B) and the cheapest wins, ties to separate
    buckets; without a known cost the groups stay separate."""
    linear = sorted((k[1], v) for k, v in groups.items() if k[0] == "linear")
    if len(linear) <= 1:
      return groups
    n = len(linear)
    best_runs = [[i] for i in range(n)]
    if round_cost is None:
      best_runs = [list(range(n))]
    else:
      best = None
      for cuts in itertools.product((False, True), repeat=n - 1):  # cuts[i - 1]: a new run starts at group i
        runs = [[0]]
        for i in range(1, n):
          if cuts[i - 1]:
            runs.append([i])
          else:
            runs[-1].append(i)
        costs = [round_cost(sum(len(linear[i][1]) for i in run), linear[run[-1]][0]) for run in runs]
        if any(c is None for c in costs):
          return groups
        total = sum(costs)
        if best is None or total < best - 1e-12 or (abs(total - best) <= 1e-12 and len(runs) > len(best_runs)):
          best, best_runs = total, runs
    out = {k: v for k, v in groups.items() if k[0] != "linear"}
    for run in best_runs:
      blk = linear[run[-1]][0]
      merged = []
      for i in run:
        planned, reqs = linear[i]
        for r in reqs:
          if planned != blk:
            r.policy_state["cap"] = planned
          merged.append(r)
      out[("linear", blk)] = merged
    return out

  def run_until_done(self) -> None:
    while self.has_work():
      self.step()

  def _count_forward(self, kind: str, blk: int, rows: int) -> None:
    """Every device forward: engine totals, and the ledger a profile can price (kind, block, live rows)."""
    self.totals[f"forwards_{kind}"] += 1
    if self.forward_log is not None:
      self.forward_log.append((kind, blk, rows))

  # ---- batch assembly ------------------------------------------------------------------------------------------------
  def _batch_arrays(self, reqs: list[Request]):
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
      r.round_counter += 1
    return b, page_table, prefix_len, samp

  # ---- prefill -------------------------------------------------------------------------------------------------------
  def _prefill(self, reqs: list[Request]) -> None:
    chunk = self.rc.prefill_chunk
    for r in reqs:
      start = r.prefilled
      self.allocator.reserve(r.request_id, min(start + chunk, len(r.prompt_ids)))
    b, page_table, prefix_len, samp = self._batch_arrays(reqs)
    tokens = np.zeros((b, chunk), np.int32)
    valid = np.zeros((b, chunk), bool)
    last_idx = np.zeros((b,), np.int32)
    for i, r in enumerate(reqs):
      piece = r.prompt_ids[r.prefilled:r.prefilled + chunk]
      tokens[i, :len(piece)] = piece
      valid[i, :len(piece)] = True
      last_idx[i] = len(piece) - 1
    tok, lp, top_lp, top_ids = self.runner.prefill(tokens, valid, prefix_len, page_table, last_idx, samp)
    self._count_forward("prefill", chunk, len(reqs))
    for i, r in enumerate(reqs):
      n = int(valid[i].sum())
      r.prefilled += n
      self.totals["prompt_tokens"] += n  # live, for /metrics and the periodic stats line
      self.allocator.commit(r.request_id, r.prefilled)
      r.stats.forwards["prefill"] += 1
      if r.prefilled == len(r.prompt_ids):
        r.stats.ttft_s = time.perf_counter() - r.arrival
        self._emit(r, [int(tok[i])], [float(lp[i])], top_lp[i:i + 1], top_ids[i:i + 1])

  # ---- decode rounds -------------------------------------------------------------------------------------------------
  def _reserve_block(self, reqs: list[Request], blk: int) -> None:
    for r in reqs:
      self.allocator.reserve(r.request_id, self.allocator.length(r.request_id) + blk)

  def _round_ar(self, reqs: list[Request]) -> None:
    self._reserve_block(reqs, 1)
    b, page_table, prefix_len, samp = self._batch_arrays(reqs)
    seed, write = self._seeds(reqs, b)
    tokens = seed[:, None]
    res = self.runner.verify(tokens, None, write, prefix_len, page_table, samp)
    self._count_forward("decode", 1, len(reqs))
    for i, r in enumerate(reqs):
      r.stats.forwards["decode"] += 1
      self._after_verify(r, 1, 1, res, i)

  def _seeds(self, reqs: list[Request], b: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row seed tokens and the live-row flag of a padded batch."""
    seed = np.zeros((b,), np.int32)
    live = np.zeros((b,), bool)
    for i, r in enumerate(reqs):
      seed[i] = r.seed_token
      live[i] = True
    return seed, live

  def _draft_verify(self, blk: int, seed, write, prefix_len, page_table, samp):
    """One LinearSS round on the device: draft forward, then verify forward (which commits K/V)."""
    drafted, q, signals = self.runner.draft(seed, prefix_len, page_table, blk, samp)
    res = self.runner.verify(drafted, q, write, prefix_len, page_table, samp)
    if self.signal_log is not None:  # only analysis reads the draft back: no extra device->host copy per round
      res.draft_tokens = np.asarray(drafted)
      res.draft_signals = np.asarray(signals)
    return res

  def _round_linear(self, reqs: list[Request], blk: int) -> None:
    self._reserve_block(reqs, blk)
    b, page_table, prefix_len, samp = self._batch_arrays(reqs)
    seed, write = self._seeds(reqs, b)
    res = self._draft_verify(blk, seed, write, prefix_len, page_table, samp)
    self._count_forward("draft", blk, len(reqs))
    self._count_forward("verify", blk, len(reqs))
    for i, r in enumerate(reqs):
      r.stats.forwards["draft"] += 1
      r.stats.forwards["verify"] += 1
      cap = r.policy_state.pop("cap", blk)
      self._after_verify(r, cap, min(int(res.accepted[i]), cap), res, i)

  def _round_shadow(self, reqs: list[Request], chosen: int) -> None:
    """Shadow trace (RecGuide calibration): from the same committed state run draft + verify at every block size,
    log the counterfactual accepted lengths, and commit the chosen one, which runs last so that its K/V are the
    canonical ones (the others only wrote slots past the committed length or slots the chosen verify rewrites)."""
    sizes = self.policy.block_sizes()
    self._reserve_block(reqs, max(sizes))
    b, page_table, prefix_len, samp = self._batch_arrays(reqs)
    seed, write = self._seeds(reqs, b)
    counterfactual = [{} for _ in reqs]
    for blk in [x for x in sizes if x != chosen] + [chosen]:
      res = self._draft_verify(blk, seed, write, prefix_len, page_table, samp)
      self._count_forward("draft", blk, len(reqs))  # every executed forward is in the ledger, not only the chosen
      self._count_forward("verify", blk, len(reqs))
      for i in range(len(reqs)):
        counterfactual[i][blk] = int(res.accepted[i])
    for i, r in enumerate(reqs):
      r.stats.forwards["draft"] += len(sizes)
      r.stats.forwards["verify"] += len(sizes)
      self.policy.record_shadow(r, counterfactual[i])
      self._after_verify(r, chosen, int(res.accepted[i]), res, i)

  def _after_verify(self, r: Request, blk: int, accepted: int, res, i: int) -> None:
    # a prefetched overlap branch is a draft for the round right after the one that made it: any verification,
    # of whatever kind, moves the committed state past it (the overlap round stores its new one after this call)
    r.policy_state.pop("prefetched", None)
    c = self.allocator.length(r.request_id)
    toks = [int(t) for t in res.tokens[i, :accepted]]
    r.stats.rounds += 1
    r.stats.accepted_lengths.append(accepted)
    r.stats.block_sizes.append(blk)
    self.block_size_choices[blk] += 1
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
    self.policy.observe(r, blk, accepted, res, i)
    if self.signal_log is not None and res.draft_signals is not None:
      self.signal_log.append({"block_size": blk, "accepted": accepted,
                              "draft": res.draft_tokens[i].tolist(), "out": res.tokens[i, :accepted].tolist(),
                              "conf": res.draft_signals[i, 0].tolist(), "margin": res.draft_signals[i, 1].tolist(),
                              "alt": res.draft_signals[i, 2].astype(int).tolist()})
    self._emit(r, toks, list(res.logprobs[i, :accepted]), res.top_logprobs[i, :accepted], res.top_ids[i, :accepted])

  def _round_overlap(self, reqs: list[Request], blk: int) -> str:
    """RecGuide's verification-overlapped drafting for greedy requests: a draft forward only for requests without
    a prefetched block, then one fused forward that verifies and drafts the planned branches."""
    from recguide_jax.orchestrator import overlap as ov
    self._reserve_block(reqs, blk)
    b, page_table, prefix_len, samp = self._batch_arrays(reqs)
    drafts = np.zeros((b, blk), np.int32)
    signals = np.zeros((b, 3, blk), np.float32)
    prefs = [r.policy_state.get("prefetched") for r in reqs]
    prefs = [p if p is not None and len(p.tokens) == blk else None for p in prefs]
    need = [i for i, p in enumerate(prefs) if p is None]
    if need:
      sub = [reqs[i] for i in need]
      b2, pt2, pl2, samp2 = self._batch_arrays(sub)
      seed, _ = self._seeds(sub, b2)
      tok, _, sig = self.runner.draft(seed, pl2, pt2, blk, samp2)
      tok, sig = jax.device_get((tok, sig))  # one device->host transfer
      self._count_forward("draft", blk, len(sub))
      for j, i in enumerate(need):
        drafts[i], signals[i] = tok[j], sig[j]
        reqs[i].stats.forwards["draft"] += 1
    for i, pref in enumerate(prefs):
      if pref is not None:
        drafts[i], signals[i] = pref.tokens, pref.signals
        self.totals["overlap_saved_drafts"] += 1
    bounds = [self._branch_bounds(r) for r in reqs]
    plans = [self.policy.plan_branches(signals[i], blk, bounds[i]) for i in range(len(reqs))]
    any_branch = any(plans)
    slots = getattr(self.policy, "overlap_slots", ov.MAX_BRANCHES)
    qn = (1 + slots) * blk if any_branch else blk
    tokens = np.full((b, qn), self.cfg.mask_token_id, np.int32)
    positions = np.zeros((b, qn), np.int32)
    mask = np.zeros((b, qn, qn), bool)
    mask[:, np.arange(qn), np.arange(qn)] = True  # padding rows: inert
    lora = np.zeros((b, qn), bool)
    write = np.zeros((b, qn), bool)
    for i, r in enumerate(reqs):
      t, pos, m, lo, w = ov.tree_layout(blk, drafts[i], plans[i], int(prefix_len[i]), self.cfg.mask_token_id,
                                        slots)
      tokens[i], positions[i], mask[i], lora[i], write[i] = t[:qn], pos[:qn], m[:qn, :qn], lo[:qn], w[:qn]
    res, br_tok, br_sig = self.runner.fused(tokens, positions, mask, lora, write, prefix_len, page_table, samp, blk)
    res.draft_tokens, res.draft_signals = drafts, signals
    res.kind = "overlap"
    self._count_forward(fused_kind(slots) if any_branch else "verify", blk, len(reqs))
    for i, r in enumerate(reqs):
      r.stats.forwards["verify"] += 1
      accepted = int(res.accepted[i])
      if plans[i]:
        outcome = ov.select_reuse(accepted, res.tokens[i], plans[i], br_tok[i], blk)
        self.totals[f"overlap_{outcome.label}"] += 1
        r.stats.overlap[outcome.label] = r.stats.overlap.get(outcome.label, 0) + 1
        if hasattr(self.policy, "observe_overlap"):
          self.policy.observe_overlap(r, accepted, outcome.branch is not None)
      else:
        outcome = None
        self.totals["overlap_no_branch"] += 1
      if self.overlap_log is not None:
        self.overlap_log.append(ov.OverlapRound(signals[i].copy(), accepted, int(res.tokens[i, accepted - 1]),
                                                **bounds[i]))
      self._after_verify(r, blk, accepted, res, i)
      if outcome is not None and outcome.branch is not None and not r.finished:
        tok = br_tok[i, outcome.branch].copy()
        tok[0] = res.tokens[i, accepted - 1]  # the committed next token (== the new seed)
        r.policy_state["prefetched"] = ov.Prefetched(tok, br_sig[i, outcome.branch], plans[i][outcome.branch].kind)
    # rounds that also ran a draft forward cost more: the policy times the two kinds apart
    return "overlap_draft" if need else "overlap"

  def _branch_bounds(self, r: Request) -> dict:
    """What limits a request's overlap branches this round (token budget, cache length), as the planners take them."""
    return dict(generated=len(r.output_ids), committed=self.allocator.length(r.request_id),
                max_new=r.params.max_tokens, max_len=self.rc.max_model_len + self.rc.max_block)

  def _round_diffusion(self, reqs: list[Request], blk: int) -> None:
    self._reserve_block(reqs, blk)
    b, page_table, prefix_len, samp = self._batch_arrays(reqs)
    seed, active = self._seeds(reqs, b)
    threshold = np.full((b,), self.policy.threshold, np.float32)
    block, steps = self.runner.denoise(seed, prefix_len, page_table, threshold, blk, samp, active)
    self._count_forward("denoise", blk, len(reqs))
    eos = set(self.cfg.eos_token_ids)
    commit_rows = []
    for i, r in enumerate(reqs):
      r.stats.forwards["denoise"] += int(steps[i])
      r.stats.rounds += 1
      r.stats.block_sizes.append(blk)
      self.block_size_choices[blk] += 1
      body = [int(t) for t in block[i, 1:]]
      ends = [j for j, t in enumerate(body) if t in eos] if not r.params.ignore_eos else []
      if ends:  # the block ends the generation: emit through the first EOS, no commit forward needed
        body = body[:ends[0] + 1]
        r.stats.accepted_lengths.append(len(body))
        self._emit(r, body, [0.0] * len(body), None, None)
        if not r.finished:
          self._finish(r, "stop")
      else:
        commit_rows.append(i)
    live = [(i, reqs[i]) for i in commit_rows]
    if not live:
      return
    # one causal forward commits the block's K/V and gives the next seed
    sub = [r for _, r in live]
    b2, page_table2, prefix_len2, samp2 = self._batch_arrays(sub)
    tokens = np.zeros((b2, blk), np.int32)
    valid = np.zeros((b2, blk), bool)
    for j, (i, r) in enumerate(live):
      tokens[j] = block[i]
      valid[j] = True
    last_idx = np.full((b2,), blk - 1, np.int32)
    tok, lp, top_lp, top_ids = self.runner.prefill(tokens, valid, prefix_len2, page_table2, last_idx, samp2)
    self._count_forward("commit", blk, len(live))
    for j, (i, r) in enumerate(live):
      r.stats.forwards["commit"] += 1
      c = self.allocator.length(r.request_id)
      self.allocator.commit(r.request_id, c + blk)
      body = [int(t) for t in block[i, 1:]] + [int(tok[j])]
      r.stats.accepted_lengths.append(len(body))
      lps = [0.0] * (blk - 1) + [float(lp[j])]
      self._emit(r, body, lps, None, None)

  # ---- emission and stop conditions -------------------------------------------------------------------------------
  def _emit(self, r: Request, toks: list[int], lps, top_lp, top_ids) -> None:
    """Appends a round's tokens to one request (stop conditions, logprobs, its update callback); an error here
    fails this request alone."""
    try:
      self._emit_tokens(r, toks, lps, top_lp, top_ids)
    except Exception as e:
      self._fail_request(r, "emitting its tokens", e)

  def _emit_tokens(self, r: Request, toks: list[int], lps, top_lp, top_ids) -> None:
    if r.finished:
      return
    eos = set() if r.params.ignore_eos else set(self.cfg.eos_token_ids)
    stop_ids = set(r.params.stop_token_ids or [])
    new: list[int] = []
    reason = None
    for k, t in enumerate(toks):
      new.append(t)
      if r.params.logprobs is not None:
        entry = {"token_id": t, "logprob": float(lps[k])}
        if r.params.logprobs and top_lp is not None:
          entry["top_logprobs"] = {int(top_ids[k][j]): float(top_lp[k][j]) for j in range(r.params.logprobs)}
        r.logprobs.append(entry)
      if t in eos or t in stop_ids:
        reason = "stop"
        break
      if len(r.output_ids) + len(new) >= r.params.max_tokens:
        reason = "length"
        break
    r.output_ids.extend(new)
    if r.params.stop_strings and self.tokenizer is not None:
      text = self.tokenizer.decode(r.output_ids)
      hit = [(text.find(s), s) for s in r.params.stop_strings if s in text]
      if hit:
        pos, _ = min(hit)
        # keep the shortest token prefix whose text reaches the stop string, and cut the text before it
        for n in range(1, len(r.output_ids) + 1):
          if len(self.tokenizer.decode(r.output_ids[:n])) > pos:
            break
        cut = len(r.output_ids) - n
        del r.output_ids[n:]
        del r.logprobs[n:]
        if cut:
          new = new[:max(len(new) - cut, 0)]
        r.text = text[:pos]
        reason = "stop"
    if r.seed_token is None or new:
      r.seed_token = r.output_ids[-1] if r.output_ids else None
    self.totals["generated_tokens"] += len(new)
    if not self._notify(r, new):
      self._finish(r, "error", "engine error: the request's update callback failed")
      return
    if reason is not None:
      self._finish(r, reason)

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

  def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
    """Ends a request once (later calls are no-ops): frees its KV pages and tells its caller. Never raises: it
    is how a failing request is taken out, so each part that could fail is logged and the rest still runs."""
    if r.finished:
      return
    r.finish_reason = reason
    r.error = error
    r.stats.latency_s = time.perf_counter() - r.arrival
    if r.text is None:
      try:
        r.text = self.tokenizer.decode(r.output_ids) if self.tokenizer is not None else ""
      except Exception:
        log.exception("decoding the output of request %s failed", r.request_id)
        r.text = ""
    if r.request_id in self._pledged:
      del self._pledged[r.request_id]
      try:
        self.allocator.free(r.request_id)
      except Exception:
        log.exception("freeing the KV pages of request %s failed", r.request_id)
    try:
      self.policy.on_finish(r)
    except Exception:
      log.exception("the policy's on_finish failed for request %s", r.request_id)
    self.totals[f"requests_{reason}"] += 1
    self._notify(r, [])

  def fail_all(self, message: str) -> None:
    """Finishes every request with an error (after a device failure) so no caller waits forever."""
    victims = list(self.waiting) + list(self.running)
    if victims:
      log.error("failing all %d requests (%d running, %d waiting): %s", len(victims), len(self.running),
                len(self.waiting), message)
    for r in victims:
      self._finish(r, "error", message)
    self.waiting.clear()
    self.running.clear()


class EngineThread:
  """Runs an Engine on its own thread. Other threads (an asyncio event loop) only validate requests and drop them
  into an inbox, so they never wait for a device step; the engine thread moves the inbox into the engine between
  steps."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._cond = threading.Condition()
    self._inbox: collections.deque = collections.deque()
    self._stop = False
    self._drain = True
    self._thread = threading.Thread(target=self._loop, name="recguide-engine", daemon=True)
    self.error: BaseException | None = None
    self.steps = 0

  def start(self) -> "EngineThread":
    self._thread.start()
    return self

  def is_alive(self) -> bool:
    return self._thread.is_alive()

  def submit(self, prompt_ids, params: SamplingParams, request_id: str, on_update=None) -> None:
    arrival = time.perf_counter()
    prompt_ids = self.engine.validate_request(prompt_ids, params)
    with self._cond:
      if self._stop:
        raise RequestError("the server is shutting down", None, 503)
      queued = sum(1 for kind, *_ in self._inbox if kind == "add") + len(self.engine.waiting)
      if queued >= self.engine.max_queue:
        raise QueueFull(f"the request queue is full ({self.engine.max_queue} waiting)")
      self._inbox.append(("add", prompt_ids, params, request_id, on_update, arrival))
      self._cond.notify()

  def abort(self, request_id: str) -> None:
    with self._cond:
      self._inbox.append(("abort", request_id))
      self._cond.notify()

  @property
  def queue_depth(self) -> int:
    return len(self.engine.waiting) + sum(1 for kind, *_ in list(self._inbox) if kind == "add")

  def _drain_inbox(self) -> None:
    while self._inbox:
      item = self._inbox.popleft()
      if item[0] == "add":
        _, prompt_ids, params, rid, on_update, arrival = item
        try:
          self.engine.add_request(prompt_ids, params, rid, on_update, validated=True, arrival=arrival)
        except Exception as e:  # this request only (a RequestError keeps its HTTP status)
          if not isinstance(e, RequestError):
            log.exception("adding request %s failed", rid)
          req = Request(rid, prompt_ids, params, on_update=on_update)
          req.error_code = e.code if isinstance(e, RequestError) else 500
          self.engine._finish(req, "error", str(e) if isinstance(e, RequestError)
                              else f"engine error: {type(e).__name__}: {e}")
      else:
        # an abort may arrive before its add was moved in: handled because adds come first in FIFO order
        try:
          self.engine.abort(item[1])
        except Exception:
          log.exception("aborting request %s failed", item[1])

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._inbox and not self.engine.has_work() and not self._stop:
          self._cond.wait(timeout=0.5)
        self._drain_inbox()
        if self._stop and (not self._drain or not self.engine.has_work()):
          if not self._drain:
            self.engine.fail_all("server shutting down")
          return
      try:
        self.engine.step()
        self.steps += 1
      except Exception as e:  # a device failure (step isolates everything else): fail all, keep the process
        self.error = e
        log.exception("engine step failed on the device")
        self.engine.fail_all(f"engine error: {type(e).__name__}: {e}")

  def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
    with self._cond:
      self._stop = True
      self._drain = drain
      self._cond.notify()
    self._thread.join(timeout)
