"""One request's life on the server side: the bridge from the engine thread to the event loop (`Tracker`), what a
finished request leaves behind (`Final`), and the SSE response that aborts its requests however it ends.

The engine thread reports each request's progress through its `on_update` callback, which copies what it needs
(the engine keeps mutating the request) and hands it to the loop through the loop's `LoopOutbox`, into one asyncio
queue per request. A client that goes away aborts its request so its batch slot and KV pages are freed at the
next engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

from fastapi import Request
from fastapi.responses import StreamingResponse

from recguide_jax.engine.thread import EngineThread
from recguide_jax.server import protocol
from recguide_jax.server.metrics import ServerMetrics

log = logging.getLogger("recguide_jax.server")


class LoopOutbox:
  """Hands calls from the engine thread to one event loop: a burst of them (a step's updates of every running
  request) costs one `call_soon_threadsafe`, which writes to the loop's wake-up socket, not one per request. The first
  call of a burst schedules the delivery at once, so no update waits for the rest of the step; the ones posted before
  the loop runs it are delivered with it."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop
    self._lock = threading.Lock()
    self._calls: list = []

  def post(self, fn, *args) -> None:
    """Runs `fn(*args)` on the loop, after the calls posted before it (any thread)."""
    with self._lock:
      self._calls.append((fn, args))
      if len(self._calls) > 1:
        return  # a delivery is scheduled and has not taken the calls yet
    try:
      self.loop.call_soon_threadsafe(self._deliver)
    except RuntimeError:  # the loop is closed: nobody is waiting for these
      with self._lock:
        self._calls.clear()

  def _deliver(self) -> None:
    with self._lock:
      calls, self._calls = self._calls, []
    for fn, args in calls:
      try:
        fn(*args)
      except Exception:  # one request's delivery failing must not drop the others'
        log.exception("delivering an engine update failed")


@dataclasses.dataclass
class Final:
  output_ids: list[int]
  finish_reason: str
  error: str | None
  logprobs: list[dict] | None
  stats: dict
  text: str
  error_code: int | None = None  # HTTP status of an error the engine attributed to the request (e.g. 429)
  prompt_logprobs: list[dict | None] | None = None  # params.prompt_logprobs: the scored prompt (echo)
  cumulative_logprob: float = 0.0  # the sum of the output tokens' raw logprobs (best_of ranks by it)
  stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (None: EOS, length)


class Tracker:
  """One request's bridge from the engine thread to the event loop."""

  def __init__(self, outbox: LoopOutbox, engine_thread: EngineThread, rid: str, gen: protocol.GenerationRequest,
               metrics: ServerMetrics, live_ids: set | None = None):
    self.outbox = outbox
    self._live_ids = live_ids
    self.engine_thread = engine_thread
    self.rid = rid
    self.gen = gen
    self.metrics = metrics
    self.queue: asyncio.Queue = asyncio.Queue()
    # engine-thread side: logprob entries already handed over. With stop strings the engine may later cut
    # tokens that were already emitted, so their logprobs are only handed over with the final state.
    self._lp_seen = 0
    self._stream_logprobs = gen.params.logprobs is not None and not gen.params.stop_strings
    # loop side
    self.emitted: list[int] = []  # every token emitted, including any the engine cut at a stop string
    self.final: Final | None = None
    self.prompt_logprobs: list[dict | None] | None = None  # loop side, once the prompt is cached (echo)
    self._prompt_sent = gen.params.prompt_logprobs is None  # engine-thread side
    self._closed = False

  def on_update(self, req, new_ids) -> None:
    """Engine thread: called with the new tokens of a step, and with [] once the request has finished."""
    lps = None
    prompt_lps = None
    if not self._prompt_sent and (req.prompt_logprobs is not None or req.finished):
      prompt_lps, self._prompt_sent = list(req.prompt_logprobs or ()), True
    if self._stream_logprobs:
      lps = req.logprobs[self._lp_seen:]
      self._lp_seen = len(req.logprobs)
    final = None
    try:
      self.metrics.record_progress(self.rid, len(new_ids), req.finished)  # inter-token latency
    except Exception:
      log.exception("recording the progress of %s failed", self.rid)
    if req.finished:
      if self._live_ids is not None:
        self._live_ids.discard(self.rid)  # set ops are atomic under the GIL
      final = Final(list(req.output_ids), req.finish_reason, req.error,
                     list(req.logprobs) if req.params.logprobs is not None else None, req.stats.as_dict(),
                     req.text or "", req.error_code,
                     list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                     req.cumulative_logprob, req.stop_reason)
      try:
        # recorded before the response can be sent, so /metrics never lags the answers a client has seen
        self.metrics.record_finished(len(req.prompt_ids), len(final.output_ids), final.finish_reason, final.stats)
      except Exception:  # an exception here would fail the whole engine step, i.e. every running request
        log.exception("recording metrics of %s failed", self.rid)
    self.outbox.post(self.queue.put_nowait, (list(new_ids), lps, final, prompt_lps))

  async def next(self) -> tuple[list[int], list[dict], Final | None]:
    """Waits for progress; returns everything queued since the last call (new tokens, logprob entries, final)."""
    events = [await self.queue.get()]
    while not self.queue.empty():
      events.append(self.queue.get_nowait())
    new, lps, final = [], [], None
    for ids, entries, fin, prompt_lps in events:
      new.extend(ids)
      lps.extend(entries or ())
      final = fin or final
      if prompt_lps is not None:
        self.prompt_logprobs = prompt_lps
    self.emitted.extend(new)
    self.final = final or self.final
    return new, lps, final

  async def wait_finished(self) -> Final:
    while self.final is None:
      await self.next()
    return self.final

  def close(self) -> None:
    """Aborts the request unless it finished; safe to call more than once."""
    if self.final is None and not self._closed:
      self.engine_thread.abort(self.rid)
    self._closed = True


class EventStream(StreamingResponse):
  """An SSE response that aborts its requests (one per choice) however the response ends (client gone, cancelled,
  error)."""

  def __init__(self, content, trackers: list[Tracker]):
    super().__init__(content, media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    self._trackers = trackers

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      for tracker in self._trackers:
        tracker.close()


async def disconnected(request: Request) -> None:
  """Returns when the client closes the connection (the body has been read, so only disconnects arrive)."""
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      return
