"""The engine on its own thread, for servers: other threads (an asyncio event loop) only validate requests and drop
them into an inbox, so they never wait for a device step; the engine thread moves the inbox into the engine between
steps, and a device failure fails every request instead of the process."""

from __future__ import annotations

import collections
import logging
import threading
import time

from recguide_jax.engine.protocol import ServingEngine
from recguide_jax.engine.requests import Request, RequestError, SamplingParams
from recguide_jax.engine.scheduler import check_queue

log = logging.getLogger("recguide_jax.engine")


class EngineThread:
  """Runs a `ServingEngine` (one group or data-parallel groups) on its own thread. Other threads (an asyncio event
  loop) only validate requests and drop them into an inbox, so they never wait for a device step; the engine thread
  moves the inbox into the engine between steps."""

  def __init__(self, engine: ServingEngine):
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

  def submit(self, prompt_ids, params: SamplingParams, request_id: str, on_update=None,
             prefill_source: str | None = None) -> None:
    """Validates and queues one sequence (see `Engine.add_request`, also for `prefill_source`)."""
    arrival = time.perf_counter()
    prompt_ids = self.engine.validate_request(prompt_ids, params)
    with self._cond:
      if self._stop:
        raise RequestError("the server is shutting down", None, 503)
      queued = sum(1 for kind, *_ in self._inbox if kind == "add") + len(self.engine.waiting)
      check_queue(queued, self.engine.max_queue)
      self._inbox.append(("add", prompt_ids, params, request_id, on_update, arrival, prefill_source))
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
        _, prompt_ids, params, rid, on_update, arrival, prefill_source = item
        try:
          self.engine.add_request(prompt_ids, params, rid, on_update, validated=True, arrival=arrival,
                                  prefill_source=prefill_source)
        except Exception as e:  # this request only (a RequestError keeps its HTTP status)
          if not isinstance(e, RequestError):
            log.exception("adding request %s failed", rid)
          req = Request(rid, prompt_ids, params, on_update=on_update)
          req.error_code = e.code if isinstance(e, RequestError) else 500
          self.engine.finish(req, "error", str(e) if isinstance(e, RequestError)
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
        if self.engine.stalled_on_compile:  # not a spin: the compile it waits for needs the CPU
          self.engine.wait_for_compile(0.05)
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
