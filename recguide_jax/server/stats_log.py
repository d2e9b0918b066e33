"""vLLM's periodic engine stats line in the server log."""

from __future__ import annotations

import logging
import threading
import time

from recguide_jax.server.metric_types import DEFAULT_LOG_STATS_INTERVAL_S, engine_snapshot

log = logging.getLogger("recguide_jax.server")


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
