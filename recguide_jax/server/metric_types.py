"""What the metrics modules share: series names and bucket boundaries, the `_created`-free histogram the app records
into, and the one-copy snapshot of the engine's counters both a scrape and the stats line read."""

from __future__ import annotations

import bisect
import logging
import math
import threading

log = logging.getLogger("recguide_jax.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "recguide:"
LEGACY_PREFIX = "recguide_"  # the names before the vLLM-style ones; deprecated, kept for existing dashboards/tests
FINISH_REASONS = ("stop", "length", "abort", "error")
FORWARD_KINDS = ("prefill", "decode", "draft", "verify", "denoise", "commit")
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


class Histogram:
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


def engine_snapshot(engine_thread) -> dict:
  """The engine-wide figures both the collector and the stats line read, copied once."""
  eng = engine_thread.engine
  totals = _copy(eng.totals)
  used, total = eng.kv_pages()
  return {
      "totals": totals,
      "per_position": _copy(eng.accepted_per_position),
      "block_sizes": _copy(eng.block_size_choices),
      "running": len(eng.running),
      "waiting": engine_thread.queue_depth,
      "pages_used": used,
      "pages_total": total,
      "kv_usage": used / max(total, 1),
      "strategy_metrics": _strategy_metrics(eng),
  }


def _strategy_metrics(eng) -> list:
  """The strategy's own series (`Strategy.metrics`), read on the scraping thread: a failure costs its series only."""
  for _ in range(5):
    try:
      return list(eng.strategy.metrics())
    except RuntimeError:  # a counter changed size while it was copied
      continue
    except Exception:
      log.exception("the decoding strategy's metrics failed")
      return []
  return []
