"""Prometheus metrics of one server app, named and typed like vLLM's, and the periodic engine stats log line.

Series are `recguide:<vLLM's name>` with a `model_name` label (a dashboard built on `vllm:...` works after
replacing the prefix), RecGuide's own series beside them under the same prefix, and the pre-vLLM `recguide_*` names
kept as deprecated aliases (docs/metrics.md lists every series). No series has a `_created` twin: every family is
built by this module's collector from its own accumulators, so nothing depends on prometheus_client's process-wide
`_created` switch; the registry is the app's own (not the process-global one) so several apps can live in one
process (tests).

Three sources:
- per-request metrics (requests by finish reason, latency histograms, token-count histograms) are recorded when a
  request finishes, from the engine thread's callback, so they agree with the responses served: a response is only
  sent after its request was recorded;
- inter-token latencies are recorded as tokens are emitted (one observation per engine update that carries tokens,
  i.e. per verify round: a round's accepted tokens arrive together, as vLLM counts a speculative step);
- engine-wide metrics (token counters, drafts and acceptance, block sizes, overlap outcomes, regime decisions,
  queue, KV use, compilations) are read from the engine at scrape time. The engine thread mutates those counters
  between our reads, so each is copied once per scrape rather than read field by field.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "recguide:"
LEGACY_PREFIX = "recguide_"  # the names before the vLLM-style ones; deprecated, kept for existing dashboards/tests
FINISH_REASONS = ("stop", "length", "abort", "error")
FORWARD_KINDS = ("prefill", "decode", "draft", "verify", "denoise", "commit")
REGIMES = ("overlap", "adaptive", "linear", "ar")  # RecGuideStrategy.regime's answers
DEFAULT_LOG_STATS_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL

# vLLM's bucket boundaries, with finer sub-10 ms buckets in front: a small model on a fast device has millisecond
# inter-token latencies
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# the legacy histograms keep their old buckets
LEGACY_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LEGACY_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LEGACY_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# RecGuide overlap outcomes (orchestrator/overlap.py OUTCOMES) split into hits and misses
OVERLAP_HITS = ("correction_hit", "continuation_hit")
OVERLAP_MISSES = ("correction_miss", "continuation_miss", "continuation_absent", "no_hit")

log = logging.getLogger("recguide_jax.server")


def token_buckets(max_len: int) -> tuple[float, ...]:
  """vLLM's 1-2-5 series of token-count buckets up to max_len."""
  out, scale = [], 1
  while True:
    for m in (1, 2, 5):
      if m * scale > max_len:
        return tuple(out)
      out.append(float(m * scale))
    scale *= 10


def _copy(counter) -> dict:
  # dict() of a dict is one C call under the GIL; retry in case an implementation iterates in Python
  for _ in range(5):
    try:
      return dict(counter)
    except RuntimeError:  # changed size during iteration
      continue
  return dict(counter)


class _Histogram:
  """Cumulative-bucket histogram without a `_created` sample; observe() and snapshot() may run on different
  threads."""

  def __init__(self, buckets):
    self.bounds = tuple(float(b) for b in buckets)
    self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
    self._sum = 0.0
    self._lock = threading.Lock()

  def observe(self, value: float) -> None:
    i = bisect.bisect_left(self.bounds, value)  # le semantics: value == bound falls in that bucket
    with self._lock:
      self._counts[i] += 1
      self._sum += value

  def snapshot(self) -> tuple[list[tuple[str, float]], float]:
    with self._lock:
      counts, total = list(self._counts), self._sum
    cum, acc = [], 0
    for bound, c in zip(self.bounds + (math.inf,), counts):
      acc += c
      cum.append(("+Inf" if bound == math.inf else repr(bound), acc))
    return cum, total

  @property
  def count(self) -> int:
    with self._lock:
      return sum(self._counts)


class ServerMetrics:
  """The app's metrics: call `record_*` from the engine thread's callbacks, `render()` on a scrape."""

  def __init__(self, engine_thread, model_name: str = "", legacy_names: bool = True):
    self.engine_thread = engine_thread
    self.model_name = model_name
    self.legacy_names = legacy_names
    self._lock = threading.Lock()
    max_len = engine_thread.engine.rc.max_model_len
    # per-request histograms (recorded at finish)
    self.ttft = _Histogram(TTFT_BUCKETS)
    self.itl = _Histogram(ITL_BUCKETS)
    self.tpot = _Histogram(ITL_BUCKETS)
    self.e2e = _Histogram(REQUEST_LATENCY_BUCKETS)
    self.queue = _Histogram(REQUEST_LATENCY_BUCKETS)
    self.inference = _Histogram(REQUEST_LATENCY_BUCKETS)
    self.prefill = _Histogram(REQUEST_LATENCY_BUCKETS)
    self.decode = _Histogram(REQUEST_LATENCY_BUCKETS)
    self.prompt_len = _Histogram(token_buckets(max_len))
    self.generation_len = _Histogram(token_buckets(max_len))
    self.legacy_ttft = _Histogram(LEGACY_TTFT_BUCKETS)
    self.legacy_tpot = _Histogram(LEGACY_TPOT_BUCKETS)
    self.legacy_e2e = _Histogram(LEGACY_E2E_BUCKETS)
    self.finished = {r: 0 for r in FINISH_REASONS}  # exported from the start, so dashboards see every reason
    self.http_errors: dict[str, int] = {}
    self.finished_prompt_tokens = 0
    self.finished_generation_tokens = 0
    self._rounds = 0
    self._round_tokens = 0
    self._last_token_t: dict[str, float] = {}  # request id -> when its latest tokens were emitted
    self.registry = CollectorRegistry()
    self.registry.register(_Collector(self))

  # ---- recording (engine thread) -----------------------------------------------------------------------------------
  def record_progress(self, request_id: str, num_new: int, finished: bool) -> None:
    """Called on every engine update of a request: the gap since its previous tokens is one inter-token latency
    (the first update, the prefill's token, only starts the clock)."""
    now = time.perf_counter()
    if num_new > 0:
      last = self._last_token_t.get(request_id)
      if last is not None:
        self.itl.observe(now - last)
      self._last_token_t[request_id] = now
    if finished:
      self._last_token_t.pop(request_id, None)

  def record_finished(self, prompt_len: int, output_len: int, finish_reason: str, stats: dict) -> None:
    """Called once per finished request (on the engine thread), before its response can be sent."""
    with self._lock:
      self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
      self.finished_prompt_tokens += prompt_len
      self.finished_generation_tokens += output_len
      lengths = stats.get("accepted_lengths") or []
      self._rounds += len(lengths)
      self._round_tokens += sum(lengths)
    self.prompt_len.observe(prompt_len)
    self.generation_len.observe(output_len)
    ttft, latency, queue = stats.get("ttft_s"), stats.get("latency_s"), stats.get("queue_s")
    if ttft is not None:
      self.ttft.observe(ttft)
      self.legacy_ttft.observe(ttft)
      if latency is not None and output_len > 1:
        tpot = max(latency - ttft, 0.0) / (output_len - 1)
        self.tpot.observe(tpot)
        self.legacy_tpot.observe(tpot)
    if latency is not None:
      self.e2e.observe(latency)
      self.legacy_e2e.observe(latency)
    if queue is not None:
      self.queue.observe(queue)
      if latency is not None:
        self.inference.observe(max(latency - queue, 0.0))
      if ttft is not None:
        self.prefill.observe(max(ttft - queue, 0.0))
    if ttft is not None and latency is not None:
      self.decode.observe(max(latency - ttft, 0.0))

  def record_error(self, status: int) -> None:
    with self._lock:
      key = str(status)
      self.http_errors[key] = self.http_errors.get(key, 0) + 1

  def render(self) -> bytes:
    return generate_latest(self.registry)

  @property
  def mean_acceptance_length(self) -> float | None:
    """Tokens per decode round over all finished requests (None before the first)."""
    with self._lock:
      return self._round_tokens / self._rounds if self._rounds else None

  # ---- periodic stats line -----------------------------------------------------------------------------------------
  def stats_logger(self, interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S) -> "StatsLogger":
    return StatsLogger(self.engine_thread, interval_s)


def engine_snapshot(engine_thread) -> dict:
  """The engine-wide figures both the collector and the stats line read, copied once."""
  eng = engine_thread.engine
  totals = _copy(eng.totals)
  usable = max(eng.allocator.num_pages - 1, 1)
  return {
      "totals": totals,
      "per_position": _copy(eng.accepted_per_position),
      "block_sizes": _copy(eng.block_size_choices),
      "running": len(eng.running),
      "waiting": engine_thread.queue_depth,
      "pages_used": eng.allocator.num_used,
      "pages_total": eng.allocator.num_pages - 1,
      "kv_usage": eng.allocator.num_used / usable,
  }


class _Collector:
  """Builds every family at scrape time from ServerMetrics' accumulators and the engine's counters."""

  def __init__(self, metrics: ServerMetrics):
    self.m = metrics

  def collect(self):
    m = self.m
    et = m.engine_thread
    eng = et.engine
    snap = engine_snapshot(et)
    totals = snap["totals"]
    labels, values = ["model_name"], [m.model_name]
    with m._lock:
      finished = dict(m.finished)
      http_errors = dict(m.http_errors)
      fin_prompt, fin_gen = m.finished_prompt_tokens, m.finished_generation_tokens
      rounds, round_tokens = m._rounds, m._round_tokens

    def gauge(name, doc, value, extra=None):
      g = GaugeMetricFamily(PREFIX + name, doc, labels=labels + list(extra or {}))
      g.add_metric(values + list((extra or {}).values()), value)
      return g

    def counter(name, doc, value):
      c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
      c.add_metric(values, value)
      return c

    def labeled_counter(name, doc, label, items):
      c = CounterMetricFamily(PREFIX + name, doc, labels=labels + [label])
      for key, value in items:
        c.add_metric(values + [str(key)], value)
      return c

    def histogram(name, doc, hist: _Histogram, prefix=PREFIX, with_labels=True):
      buckets, total = hist.snapshot()
      h = HistogramMetricFamily(prefix + name, doc, labels=labels if with_labels else None)
      h.add_metric(values if with_labels else [], buckets, total)
      return h

    # ---- vLLM's series ------------------------------------------------------------------------------------------
    yield gauge("num_requests_running", "Number of requests in the running batch.", snap["running"])
    yield gauge("num_requests_waiting", "Number of requests waiting for a batch slot.", snap["waiting"])
    yield gauge("kv_cache_usage_perc", "KV-cache usage: the fraction of KV pages owned by requests (1 = 100%).",
                snap["kv_usage"])
    yield counter("prompt_tokens", "Number of prefill tokens processed.", totals.get("prompt_tokens", 0))
    yield counter("generation_tokens", "Number of generation tokens processed.", totals.get("generated_tokens", 0))
    yield labeled_counter("request_success", "Count of finished requests by finish reason.", "finished_reason",
                          [(r, finished.get(r, 0)) for r in sorted(set(FINISH_REASONS) | set(finished))])
    yield histogram("request_prompt_tokens", "Number of prefill tokens per finished request.", m.prompt_len)
    yield histogram("request_generation_tokens", "Number of generation tokens per finished request.",
                    m.generation_len)
    yield histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft)
    yield histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds (one observation "
                    "per engine update that emits tokens).", m.itl)
    yield histogram("request_time_per_output_token_seconds", "Histogram of time per output token per request in "
                    "seconds (decode time / (output tokens - 1)).", m.tpot)
    yield histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", m.e2e)
    yield histogram("request_queue_time_seconds", "Histogram of time spent waiting for a batch slot in seconds.",
                    m.queue)
    yield histogram("request_inference_time_seconds", "Histogram of time spent in the running batch in seconds.",
                    m.inference)
    yield histogram("request_prefill_time_seconds", "Histogram of time from admission to the first token in "
                    "seconds.", m.prefill)
    yield histogram("request_decode_time_seconds", "Histogram of time from the first token to the last in seconds.",
                    m.decode)
    # speculative decoding: a draft is one verified block of B tokens (the seed and B - 1 draft tokens); accepted
    # tokens are the draft tokens the verifier kept, the bonus/correction token not included (vLLM's convention)
    yield counter("spec_decode_num_drafts", "Number of spec decoding drafts (verified blocks).",
                  totals.get("drafts", 0))
    yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", totals.get("draft_tokens", 0))
    yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                  totals.get("accepted_draft_tokens", 0))
    per_position = snap["per_position"]  # engine positions count from 1 (the first draft token after the seed)
    positions = max([eng.rc.max_block - 1] + list(per_position))
    yield labeled_counter("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position (0: the "
                          "first draft token).", "position",
                          [(p, per_position.get(p + 1, 0)) for p in range(positions)])
    # ---- RecGuide's own series ----------------------------------------------------------------------------------
    blocks = dict(snap["block_sizes"])
    try:  # zeros for every block size the policy may plan (and AR rounds for RecGuide), so shares exist from start
      planned = tuple(eng.policy.block_sizes()) + ((1,) if hasattr(eng.policy, "regime_counts") else ())
    except Exception:
      planned = ()
    for b in planned:
      blocks.setdefault(int(b), 0)
    yield labeled_counter("block_size_rounds", "Decode rounds by block size (1: plain AR rounds).", "block_size",
                          sorted(blocks.items()))
    outcomes = {k[len("overlap_"):]: v for k, v in totals.items() if k.startswith("overlap_")}
    saved = outcomes.pop("saved_drafts", 0)
    known = list(OVERLAP_HITS) + list(OVERLAP_MISSES) + ["no_branch"]
    yield labeled_counter("overlap_rounds", "RecGuide overlap rounds by branch outcome (hits: a branch became the "
                          "next draft).", "outcome", [(k, outcomes.get(k, 0)) for k in known]
                          + sorted((k, v) for k, v in outcomes.items() if k not in known))
    hits = sum(outcomes.get(k, 0) for k in OVERLAP_HITS)
    misses = sum(outcomes.get(k, 0) for k in OVERLAP_MISSES)
    yield counter("overlap_hits", "Fused rounds whose branch became the next draft (RecGuide).", hits)
    yield counter("overlap_misses", "Fused rounds whose branches were all discarded (RecGuide).", misses)
    yield counter("overlap_saved_drafts", "Draft forwards skipped because a reused branch was the draft.", saved)
    policy = eng.policy
    regime_counts = getattr(policy, "regime_counts", None)
    if regime_counts is not None:  # the RecGuide policy
      counts = _copy(regime_counts)
      yield labeled_counter("regime_decisions", "RecGuide switch decisions: request rounds planned by regime.",
                            "regime", [(r, counts.get(r, 0)) for r in REGIMES]
                            + sorted((k, v) for k, v in counts.items() if k not in REGIMES))
      yield counter("regime_probes", "RecGuide re-measurements of a close runner-up regime.",
                    getattr(policy, "probes", 0))
      memo = getattr(policy, "_regime_memo", (None, None))
      current = memo[1] if isinstance(memo, tuple) and len(memo) == 2 else None
      g = GaugeMetricFamily(PREFIX + "regime", "1 for the regime the switch chose at the latest step.",
                            labels=labels + ["regime"])
      for r in REGIMES:
        g.add_metric(values + [r], 1.0 if current == r else 0.0)
      yield g
    kinds = list(FORWARD_KINDS) + sorted(k[len("forwards_"):] for k in totals
                                         if k.startswith("forwards_") and k[len("forwards_"):] not in FORWARD_KINDS)
    yield labeled_counter("forwards", "Batched device forwards by kind.", "kind",
                          [(k, totals.get(f"forwards_{k}", 0)) for k in kinds])
    yield gauge("kv_cache_pages_used", "KV cache pages owned by requests.", snap["pages_used"])
    yield gauge("kv_cache_pages_total", "Usable KV cache pages.", snap["pages_total"])
    yield gauge("compilations_after_warmup", "Backend compilations since warm-up ended (should stay 0).",
                eng.runner.compiles_after_warmup)
    yield labeled_counter("http_errors", "Error answers (bodies and stream error events) by HTTP status.", "code",
                          sorted(http_errors.items()))
    info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache and policy.",
                             labels=labels + ["page_size", "num_pages", "max_model_len", "max_num_seqs", "policy"])
    info.add_metric(values + [str(eng.rc.page_size), str(snap["pages_total"]), str(eng.rc.max_model_len),
                              str(eng.rc.max_batch), str(getattr(policy, "name", ""))], 1.0)
    yield info
    if not m.legacy_names:
      return
    # ---- deprecated names (no labels), as before the vLLM-style series ------------------------------------------
    L = LEGACY_PREFIX

    def legacy(kind, name, doc, value, label=None, items=None):
      fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
          L + name, doc + " Deprecated: see docs/metrics.md.", labels=[label] if label else None)
      if label:
        for k, v in items:
          fam.add_metric([str(k)], v)
      else:
        fam.add_metric([], value)
      return fam

    yield legacy("counter", "requests", "Finished requests by finish reason.", None, "status",
                 [(r, finished.get(r, 0)) for r in sorted(set(FINISH_REASONS) | set(finished))])
    yield legacy("counter", "http_errors", "Error answers by HTTP status.", None, "code", sorted(http_errors.items()))
    yield legacy("counter", "prompt_tokens", "Prompt tokens of finished requests.", fin_prompt)
    yield legacy("counter", "generation_tokens", "Output tokens of finished requests.", fin_gen)
    yield histogram("time_to_first_token_seconds", "Time to first token. Deprecated.", m.legacy_ttft, L, False)
    yield histogram("time_per_output_token_seconds", "Mean time per output token after the first. Deprecated.",
                    m.legacy_tpot, L, False)
    yield histogram("e2e_request_latency_seconds", "End-to-end request latency in the engine. Deprecated.",
                    m.legacy_e2e, L, False)
    if rounds:
      yield legacy("gauge", "mean_acceptance_length", "Tokens emitted per decode round, over all finished requests.",
                   round_tokens / rounds)
    yield legacy("gauge", "queue_depth", "Requests waiting for a batch slot.", snap["waiting"])
    yield legacy("gauge", "running_requests", "Requests in the running batch.", snap["running"])
    yield legacy("gauge", "kv_pages_in_use", "KV cache pages owned by requests.", snap["pages_used"])
    yield legacy("gauge", "kv_pages_total", "Usable KV cache pages.", snap["pages_total"])
    yield legacy("gauge", "compilations_after_warmup", "Backend compilations since warm-up ended.",
                 eng.runner.compiles_after_warmup)
    yield legacy("counter", "forwards", "Batched device forwards by kind.", None, "kind",
                 [(k, totals.get(f"forwards_{k}", 0)) for k in kinds])
    yield legacy("counter", "draft_tokens", "Draft tokens offered to the verifier.", totals.get("draft_tokens", 0))
    yield legacy("counter", "accepted_draft_tokens", "Draft tokens the verifier accepted.",
                 totals.get("accepted_draft_tokens", 0))
    yield legacy("counter", "accepted_tokens_per_position", "Accepted draft tokens by position (from 1).", None,
                 "position", sorted(per_position.items()))
    yield legacy("counter", "block_size_choices", "Decode rounds by block size.", None, "block_size",
                 sorted(snap["block_sizes"].items()))
    yield legacy("counter", "overlap_hits", "Fused rounds whose branch became the next draft.", hits)
    yield legacy("counter", "overlap_misses", "Fused rounds whose branches were all discarded.", misses)


class StatsLogger:
  """vLLM's periodic engine stats line, one INFO line every `interval_s` seconds while there is activity:

    Avg prompt throughput: 52.1 tokens/s, Avg generation throughput: 410.3 tokens/s, Running: 4 reqs, Waiting: 0
    reqs, KV cache usage: 12.5%, Mean acceptance length: 4.31, Draft acceptance rate: 22.1%

  Throughputs are over the interval (engine counters, so tokens of requests still running count); the acceptance
  figures are over the interval's drafts (mean acceptance length = 1 + accepted / drafts, vLLM's convention) and
  are left out when no draft was verified in it. An idle interval logs nothing, except one line right after the
  activity ends so the log shows the drop to zero. interval_s <= 0 disables the thread."""

  def __init__(self, engine_thread, interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S, logger=None):
    self.engine_thread = engine_thread
    self.interval_s = float(interval_s)
    self.log = logger or log
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._last = self._counts()
    self._last_t = time.monotonic()
    self._was_active = False

  def _counts(self) -> dict:
    snap = engine_snapshot(self.engine_thread)
    t = snap["totals"]
    return {"prompt": t.get("prompt_tokens", 0), "generation": t.get("generated_tokens", 0),
            "drafts": t.get("drafts", 0), "draft_tokens": t.get("draft_tokens", 0),
            "accepted": t.get("accepted_draft_tokens", 0), "running": snap["running"], "waiting": snap["waiting"],
            "kv_usage": snap["kv_usage"]}

  def line(self) -> str | None:
    """The line for the interval since the previous call (None when it and the one before were idle); advances
    the interval."""
    now, cur = time.monotonic(), self._counts()
    dt = max(now - self._last_t, 1e-9)
    d = {k: cur[k] - self._last[k] for k in ("prompt", "generation", "drafts", "draft_tokens", "accepted")}
    self._last, self._last_t = cur, now
    active = bool(d["prompt"] or d["generation"] or cur["running"] or cur["waiting"])
    if not active and not self._was_active:
      return None
    self._was_active = active
    text = (f"Avg prompt throughput: {d['prompt'] / dt:.1f} tokens/s, "
            f"Avg generation throughput: {d['generation'] / dt:.1f} tokens/s, "
            f"Running: {cur['running']} reqs, Waiting: {cur['waiting']} reqs, "
            f"KV cache usage: {100 * cur['kv_usage']:.1f}%")
    if d["drafts"]:
      text += f", Mean acceptance length: {1 + d['accepted'] / d['drafts']:.2f}"
      if d["draft_tokens"]:
        text += f", Draft acceptance rate: {100 * d['accepted'] / d['draft_tokens']:.1f}%"
    return text

  def log_once(self) -> str | None:
    text = self.line()
    if text is not None:
      self.log.info("%s", text)
    return text

  def _run(self) -> None:
    while not self._stop.wait(self.interval_s):
      try:
        self.log_once()
      except Exception:  # a stats bug must never take the server down
        self.log.exception("engine stats logging failed")

  def start(self) -> "StatsLogger":
    if self.interval_s > 0 and self._thread is None:
      self._last, self._last_t = self._counts(), time.monotonic()
      self._thread = threading.Thread(target=self._run, name="recguide-stats", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
      self._thread = None
