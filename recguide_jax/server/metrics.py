"""Prometheus metrics of one server app, in a registry of its own (not the process-global one) so that several
apps (tests) can live in one process.

Two sources:
- per-request metrics (requests by status, tokens, latency histograms, acceptance length) are recorded when a
  request finishes, from the engine thread's callback, so they agree with the responses served: a response is
  only sent after its request was recorded;
- engine-wide metrics (forwards, draft/accepted tokens, block sizes, queue, pages, compilations) are read from
  the engine at scrape time. The engine thread mutates those counters between our reads, so each is copied once
  per scrape rather than read field by field.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATUSES = ("stop", "length", "abort", "error")
FORWARD_KINDS = ("prefill", "decode", "draft", "verify", "denoise", "commit")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _copy(counter) -> dict:
  # dict() of a dict is one C call under the GIL; retry in case an implementation iterates in Python
  for _ in range(5):
    try:
      return dict(counter)
    except RuntimeError:  # changed size during iteration
      continue
  return dict(counter)


# RecGuide overlap outcomes (orchestrator/overlap.py OUTCOMES) split into hits and misses
OVERLAP_HITS = ("correction_hit", "continuation_hit")
OVERLAP_MISSES = ("correction_miss", "continuation_miss", "continuation_absent", "no_hit")


class ServerMetrics:

  def __init__(self, engine_thread, prefix: str = "recguide"):
    self.registry = CollectorRegistry()
    r, p = self.registry, prefix
    self.requests = Counter(f"{p}_requests", "Finished requests by finish reason.", ["status"], registry=r)
    for s in STATUSES:
      self.requests.labels(s)  # export zeros so dashboards see every status from the start
    self.http_errors = Counter(f"{p}_http_errors", "Error answers (bodies and stream error events) by HTTP status.",
                               ["code"], registry=r)
    self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
    self.generation_tokens = Counter(f"{p}_generation_tokens", "Output tokens of finished requests.", registry=r)
    self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS,
                          registry=r)
    self.tpot = Histogram(f"{p}_time_per_output_token_seconds", "Mean time per output token after the first.",
                          buckets=TPOT_BUCKETS, registry=r)
    self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "End-to-end request latency in the engine.",
                         buckets=E2E_BUCKETS, registry=r)
    self.mean_acceptance = Gauge(f"{p}_mean_acceptance_length",
                                 "Tokens emitted per decode round, over all finished requests.", registry=r)
    self._lock = threading.Lock()
    self._rounds = 0
    self._round_tokens = 0
    r.register(_EngineCollector(engine_thread, p))

  def record_finished(self, prompt_len: int, output_len: int, finish_reason: str, stats: dict) -> None:
    """Called once per finished request (on the engine thread)."""
    self.requests.labels(finish_reason).inc()
    self.prompt_tokens.inc(prompt_len)
    self.generation_tokens.inc(output_len)
    if stats.get("ttft_s") is not None:
      self.ttft.observe(stats["ttft_s"])
      if stats.get("latency_s") is not None and output_len > 1:
        self.tpot.observe(max(stats["latency_s"] - stats["ttft_s"], 0.0) / (output_len - 1))
    if stats.get("latency_s") is not None:
      self.e2e.observe(stats["latency_s"])
    lengths = stats.get("accepted_lengths") or []
    if lengths:
      with self._lock:
        self._rounds += len(lengths)
        self._round_tokens += sum(lengths)
        self.mean_acceptance.set(self._round_tokens / self._rounds)

  def record_error(self, status: int) -> None:
    self.http_errors.labels(str(status)).inc()

  def render(self) -> bytes:
    return generate_latest(self.registry)


class _EngineCollector:
  """Reads engine-wide state at scrape time."""

  def __init__(self, engine_thread, prefix: str):
    self.engine_thread = engine_thread
    self.p = prefix

  def collect(self):
    et = self.engine_thread
    eng = et.engine
    p = self.p
    totals = _copy(eng.totals)
    per_position = _copy(eng.accepted_per_position)
    block_sizes = _copy(eng.block_size_choices)

    def gauge(name, doc, value):
      g = GaugeMetricFamily(f"{p}_{name}", doc)
      g.add_metric([], value)
      return g

    def counter(name, doc, value):
      c = CounterMetricFamily(f"{p}_{name}", doc)
      c.add_metric([], value)
      return c

    yield gauge("queue_depth", "Requests waiting for a batch slot (including ones not yet handed to the engine).",
                et.queue_depth)
    yield gauge("running_requests", "Requests in the running batch.", len(eng.running))
    yield gauge("kv_pages_in_use", "KV cache pages owned by requests.", eng.allocator.num_used)
    yield gauge("kv_pages_total", "Usable KV cache pages.", eng.allocator.num_pages - 1)
    yield gauge("compilations_after_warmup", "Backend compilations since warm-up ended (should stay 0).",
                eng.runner.compiles_after_warmup)
    forwards = CounterMetricFamily(f"{p}_forwards", "Batched device forwards by kind.", labels=["kind"])
    kinds = list(FORWARD_KINDS) + sorted(k[len("forwards_"):] for k in totals
                                         if k.startswith("forwards_") and k[len("forwards_"):] not in FORWARD_KINDS)
    for kind in kinds:
      forwards.add_metric([kind], totals.get(f"forwards_{kind}", 0))
    yield forwards
    yield counter("draft_tokens", "Draft tokens offered to the verifier.", totals.get("draft_tokens", 0))
    yield counter("accepted_draft_tokens", "Draft tokens the verifier accepted.",
                  totals.get("accepted_draft_tokens", 0))
    pos = CounterMetricFamily(f"{p}_accepted_tokens_per_position", "Accepted draft tokens by position in the block.",
                              labels=["position"])
    for k in sorted(per_position):
      pos.add_metric([str(k)], per_position[k])
    yield pos
    blocks = CounterMetricFamily(f"{p}_block_size_choices", "Decode rounds by block size.", labels=["block_size"])
    for k in sorted(block_sizes):
      blocks.add_metric([str(k)], block_sizes[k])
    yield blocks
    hits = sum(totals.get(f"overlap_{k}", 0) for k in OVERLAP_HITS)
    misses = sum(totals.get(f"overlap_{k}", 0) for k in OVERLAP_MISSES)
    yield counter("overlap_hits", "Fused rounds whose branch became the next draft (RecGuide).", hits)
    yield counter("overlap_misses", "Fused rounds whose branches were all discarded (RecGuide).", misses)
