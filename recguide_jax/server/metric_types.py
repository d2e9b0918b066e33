"""What the metrics modules share: series names and bucket boundaries, how a prometheus_client metric is exported
without its `_created` samples, and the one-copy snapshot of the engine's counters both a scrape and the stats line
read."""

from __future__ import annotations

import logging

log = logging.getLogger("recguide_jax.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "recguide:"
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


def without_created(metric):
  """The families of a prometheus_client metric without their `_created` samples."""
  for family in metric.collect():
    family.samples = [s for s in family.samples if not s.name.endswith("_created")]
    yield family


def samples_by_label(metric, label: str) -> dict[str, float]:
  """A labelled counter's `_total` values by one label."""
  return {s.labels[label]: s.value for family in metric.collect() for s in family.samples
          if s.name.endswith("_total")}


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
