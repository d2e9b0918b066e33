"""Prometheus metrics of one server app, named and typed like vLLM's, and the periodic engine stats log line.

Series are `recguide:<vLLM's name>` with a `model_name` label (a dashboard built on `vllm:...` works after
replacing the prefix), RecGuide's own series beside them under the same prefix (docs/metrics.md lists every
series). What the server records itself is held in prometheus_client's `Histogram` and `Counter` (as vLLM's are),
but for the inter-token latency (`BatchedHistogram`: the same samples, counted in batches); what the engine counts
is read at scrape time by the collector (`metric_series`), which exports both. No series has a `_created` twin: the
collector drops those samples, so nothing depends on prometheus_client's process-wide `_created` switch; the
metrics are not in the process-global registry but in the app's own, so several apps can live in one process
(tests).

Three sources:
- per-request metrics (requests by finish reason, latency histograms, token-count histograms) are recorded when a
  request finishes, from the engine thread's callback, so they agree with the responses served: a response is only
  sent after its request was recorded;
- inter-token latencies are recorded as tokens are emitted (one observation per engine update that carries tokens,
  i.e. per verify round: a round's accepted tokens arrive together, as vLLM counts a speculative step);
- engine-wide metrics (token counters, drafts and acceptance, block sizes, the strategy's own series,
  queue, KV use, compilations) are read from the engine at scrape time. The engine thread mutates those counters
  between our reads, so each is copied once per scrape rather than read field by field.

This module records; `metric_series` builds the exported series (vLLM's and RecGuide's own),
`metric_types` holds the names and buckets they share, `stats_log` the periodic log line.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from recguide_jax.server.metric_series import Collector
from recguide_jax.server.metric_types import (DEFAULT_LOG_STATS_INTERVAL_S, FINISH_REASONS, ITL_BUCKETS, PREFIX,
                                              REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, token_buckets)
from recguide_jax.server.stats_log import StatsLogger


class BatchedHistogram:
  """A one-label-set histogram whose observations are counted in batches: `observe` appends to a list and the
  buckets are counted with numpy when it is read (`collect`, prometheus_client's collector interface: the same
  samples as its `Histogram`, no `_created`) or when the list is long. For the inter-token latency: it is observed
  once per request and engine step on the engine thread, where prometheus_client's `observe` (two locks and a bucket
  search in Python each) was a visible part of a step's host work."""

  FOLD_AT = 4096

  def __init__(self, name: str, doc: str, buckets, labels: list[str], values: list[str]):
    self.name, self.doc, self.labels, self.values = name, doc, labels, values
    self.bounds = np.asarray(buckets, np.float64)
    self._counts = np.zeros(len(self.bounds) + 1, np.int64)  # per bucket, not cumulative; the last: above all
    self._sum = 0.0
    self._pending: list[float] = []
    self._lock = threading.Lock()

  def observe(self, value: float) -> None:
    with self._lock:
      self._pending.append(value)
      if len(self._pending) >= self.FOLD_AT:
        self._fold()

  def _fold(self) -> None:
    if self._pending:
      values, self._pending = np.asarray(self._pending, np.float64), []
      # a value lands in the first bucket whose bound it does not exceed (Prometheus' "le")
      self._counts += np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self._counts))
      self._sum += float(values.sum())

  def collect(self) -> list[HistogramMetricFamily]:
    with self._lock:
      self._fold()
      counts, total = np.cumsum(self._counts).tolist(), self._sum
    family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
    les = [floatToGoString(b) for b in self.bounds.tolist()] + ["+Inf"]
    family.add_metric(self.values, list(zip(les, counts)), total)
    return [family]


class ServerMetrics:
  """The app's metrics: call `record_*` from the engine thread's callbacks, `render()` on a scrape."""

  def __init__(self, engine_thread, model_name: str = ""):
    self.engine_thread = engine_thread
    self.model_name = model_name
    self._lock = threading.Lock()
    max_len = engine_thread.engine.rc.max_model_len
    labels = ["model_name"]
    self.histograms: list = []  # vLLM's, in export order (prometheus_client Histograms and a BatchedHistogram)

    def hist(name, doc, buckets):
      h = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=None)
      self.histograms.append(h)
      return h.labels(model_name)

    # per-request histograms (recorded at finish)
    self.prompt_len = hist("request_prompt_tokens", "Number of prefill tokens per finished request.",
                           token_buckets(max_len))
    self.generation_len = hist("request_generation_tokens", "Number of generation tokens per finished request.",
                               token_buckets(max_len))
    self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
    self.itl = BatchedHistogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds "
                                "(one observation per engine update that emits tokens).", ITL_BUCKETS, labels,
                                [model_name])
    self.histograms.append(self.itl)
    self.tpot = hist("request_time_per_output_token_seconds", "Histogram of time per output token per request in "
                     "seconds (decode time / (output tokens - 1)).", ITL_BUCKETS)
    self.e2e = hist("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                    REQUEST_LATENCY_BUCKETS)
    self.queue = hist("request_queue_time_seconds", "Histogram of time spent waiting for a batch slot in seconds.",
                      REQUEST_LATENCY_BUCKETS)
    self.inference = hist("request_inference_time_seconds", "Histogram of time spent in the running batch in "
                          "seconds.", REQUEST_LATENCY_BUCKETS)
    self.prefill = hist("request_prefill_time_seconds", "Histogram of time from admission to the first token in "
                        "seconds.", REQUEST_LATENCY_BUCKETS)
    self.decode = hist("request_decode_time_seconds", "Histogram of time from the first token to the last in "
                       "seconds.", REQUEST_LATENCY_BUCKETS)
    self.request_success = Counter(PREFIX + "request_success", "Count of finished requests by finish reason.",
                                   labels + ["finished_reason"], registry=None)
    for reason in FINISH_REASONS:  # exported from the start, so dashboards see every reason
      self.request_success.labels(model_name, reason)
    self.http_errors = Counter(PREFIX + "http_errors", "Error answers (bodies and stream error events) by HTTP "
                               "status.", labels + ["code"], registry=None)
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
    self.request_success.labels(self.model_name, finish_reason).inc()
    with self._lock:
      lengths = stats.get("accepted_lengths") or []
      self._rounds += len(lengths)
      self._round_tokens += sum(lengths)
    self.prompt_len.observe(prompt_len)
    self.generation_len.observe(output_len)
    ttft, latency, queue = stats.get("ttft_s"), stats.get("latency_s"), stats.get("queue_s")
    if ttft is not None:
      self.ttft.observe(ttft)
      if latency is not None and output_len > 1:
        tpot = max(latency - ttft, 0.0) / (output_len - 1)
        self.tpot.observe(tpot)
    if latency is not None:
      self.e2e.observe(latency)
    if queue is not None:
      self.queue.observe(queue)
      if latency is not None:
        self.inference.observe(max(latency - queue, 0.0))
      if ttft is not None:
        self.prefill.observe(max(ttft - queue, 0.0))
    if ttft is not None and latency is not None:
      self.decode.observe(max(latency - ttft, 0.0))

  def record_error(self, status: int) -> None:
    self.http_errors.labels(self.model_name, str(status)).inc()

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
