"""Prometheus metrics of one server app, named and typed like vLLM's, and the periodic engine stats log line.

Series are `recguide:<vLLM's name>` with a `model_name` label (a dashboard built on `vllm:...` works after
replacing the prefix), RecGuide's own series beside them under the same prefix, and the pre-vLLM `recguide_*` names
kept as deprecated aliases (docs/metrics.md lists every series). No series has a `_created` twin: every family is
built by the collector (`metric_series`) from its own accumulators, so nothing depends on prometheus_client's process-wide
`_created` switch; the registry is the app's own (not the process-global one) so several apps can live in one
process (tests).

Three sources:
- per-request metrics (requests by finish reason, latency histograms, token-count histograms) are recorded when a
  request finishes, from the engine thread's callback, so they agree with the responses served: a response is only
  sent after its request was recorded;
- inter-token latencies are recorded as tokens are emitted (one observation per engine update that carries tokens,
  i.e. per verify round: a round's accepted tokens arrive together, as vLLM counts a speculative step);
- engine-wide metrics (token counters, drafts and acceptance, block sizes, the strategy's own series,
  queue, KV use, compilations) are read from the engine at scrape time. The engine thread mutates those counters
  between our reads, so each is copied once per scrape rather than read field by field.

This module records; `metric_series` builds the exported series (vLLM's, RecGuide's own, the deprecated names),
`metric_types` holds the names, buckets and histogram they share, `stats_log` the periodic log line.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, generate_latest

from recguide_jax.server.metric_series import Collector
from recguide_jax.server.metric_types import (CONTENT_TYPE, DEFAULT_LOG_STATS_INTERVAL_S, FINISH_REASONS,  # noqa: F401
                                              FORWARD_KINDS, ITL_BUCKETS, LEGACY_E2E_BUCKETS, LEGACY_PREFIX,
                                              LEGACY_TPOT_BUCKETS, LEGACY_TTFT_BUCKETS, PREFIX,
                                              REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, Histogram,
                                              engine_snapshot, token_buckets)
from recguide_jax.server.stats_log import StatsLogger

_Histogram = Histogram  # the earlier private name


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
    self.registry.register(Collector(self))

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
  def stats_logger(self, interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S) -> StatsLogger:
    return StatsLogger(self.engine_thread, interval_s)
