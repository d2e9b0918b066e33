"""FastAPI app over an `EngineThread`: OpenAI completions and chat completions (plain and streamed), models,
health and Prometheus metrics.

The event loop only parses, tokenizes and drops requests into the engine thread's inbox; the engine thread
reports each request's progress through its `on_update` callback, which copies what it needs (the engine keeps
mutating the request) and hands it to the loop with `call_soon_threadsafe`, into one asyncio queue per request.
A client that goes away aborts its request so its batch slot and KV pages are freed at the next engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from recguide_jax.engine import EngineThread, RequestError
from recguide_jax.server import protocol, responses
from recguide_jax.server.metrics import CONTENT_TYPE, ServerMetrics
from recguide_jax.server.streaming import TextDeltas
from recguide_jax.tokenizer import Tokenizer

log = logging.getLogger("recguide_jax.server")


@dataclasses.dataclass
class _Final:
  output_ids: list[int]
  finish_reason: str
  error: str | None
  logprobs: list[dict] | None
  stats: dict
  text: str


class _Tracker:
  """One request's bridge from the engine thread to the event loop."""

  def __init__(self, loop: asyncio.AbstractEventLoop, engine_thread: EngineThread, rid: str,
               gen: protocol.GenerationRequest, metrics: ServerMetrics):
    self.loop = loop
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
    self.final: _Final | None = None
    self._closed = False

  def on_update(self, req, new_ids) -> None:
    """Engine thread: called with the new tokens of a step, and with [] once the request has finished."""
    lps = None
    if self._stream_logprobs:
      lps = req.logprobs[self._lp_seen:]
      self._lp_seen = len(req.logprobs)
    final = None
    if req.finished:
      final = _Final(list(req.output_ids), req.finish_reason, req.error,
                     list(req.logprobs) if req.params.logprobs is not None else None, req.stats.as_dict(),
                     req.text or "")
      try:
        # recorded before the response can be sent, so /metrics never lags the answers a client has seen
        self.metrics.record_finished(len(req.prompt_ids), len(final.output_ids), final.finish_reason, final.stats)
      except Exception:  # an exception here would fail the whole engine step, i.e. every running request
        log.exception("recording metrics of %s failed", self.rid)
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, (list(new_ids), lps, final))
    except RuntimeError:  # the loop is closed: nobody is waiting for this request any more
      pass

  async def next(self) -> tuple[list[int], list[dict], _Final | None]:
    """Waits for progress; returns everything queued since the last call (new tokens, logprob entries, final)."""
    events = [await self.queue.get()]
    while not self.queue.empty():
      events.append(self.queue.get_nowait())
    new, lps, final = [], [], None
    for ids, entries, fin in events:
      new.extend(ids)
      lps.extend(entries or ())
      final = fin or final
    self.emitted.extend(new)
    self.final = final or self.final
    return new, lps, final

  async def wait_finished(self) -> _Final:
    while self.final is None:
      await self.next()
    return self.final

  def close(self) -> None:
    """Aborts the request unless it finished; safe to call more than once."""
    if self.final is None and not self._closed:
      self.engine_thread.abort(self.rid)
    self._closed = True


class _EventStream(StreamingResponse):
  """An SSE response that aborts its request however the response ends (client gone, cancelled, error)."""

  def __init__(self, content, tracker: _Tracker):
    super().__init__(content, media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    self._tracker = tracker

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self._tracker.close()


async def _disconnected(request: Request) -> None:
  """Returns when the client closes the connection (the body has been read, so only disconnects arrive)."""
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      return


def _engine_alive(engine_thread: EngineThread) -> bool:
  return engine_thread.is_alive()


def create_app(engine_thread: EngineThread, tokenizer: Tokenizer, model_name: str, *, profile: str | None = None,
               shutdown_engine: bool = True) -> FastAPI:
  """The OpenAI-compatible app over a started `engine_thread`.

  shutdown_engine: on app shutdown (after uvicorn's graceful shutdown let in-flight requests finish), stop the
  engine thread, draining whatever it still holds.
  """
  if tokenizer is None:
    raise ValueError("the server needs a tokenizer (a checkpoint with tokenizer.json)")
  engine = engine_thread.engine
  vocab_size = engine.cfg.vocab_size
  max_model_len = engine.rc.max_model_len
  metrics = ServerMetrics(engine_thread)
  started = int(time.time())

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    if shutdown_engine:
      log.info("stopping the engine (draining %d running, %d queued)", len(engine.running),
               engine_thread.queue_depth)
      await asyncio.to_thread(engine_thread.shutdown, True)

  app = FastAPI(title="recguide_jax", lifespan=lifespan)
  app.state.engine_thread = engine_thread
  app.state.metrics = metrics
  app.state.model_name = model_name
  app.state.profile = profile  # hardware profile for RecGuide; stored when the policy does not take it

  # ---- errors: every error answer has the OpenAI shape --------------------------------------------------------
  def error_response(status: int, message: str, param=None, code=None) -> JSONResponse:
    e = protocol.APIError(status, message, param, code)
    metrics.record_error(status)
    return JSONResponse(e.body(), status_code=status)

  @app.exception_handler(protocol.APIError)
  async def api_error(request, e: protocol.APIError):
    metrics.record_error(e.status)
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(RequestValidationError)
  async def validation_error(request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    return error_response(400, f"invalid request: {first.get('msg', e)}", param, "invalid_type")

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request, e: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(e.status_code, str(e.detail), None, code)

  @app.exception_handler(Exception)
  async def internal_error(request, e: Exception):
    log.exception("unhandled error in %s", request.url.path)
    return error_response(500, f"internal server error: {type(e).__name__}: {e}", None, "internal_error")

  # ---- generation ----------------------------------------------------------------------------------------------
  def submit(gen: protocol.GenerationRequest, prefix: str) -> _Tracker:
    rid = f"{prefix}-{uuid.uuid4().hex}"
    tracker = _Tracker(asyncio.get_running_loop(), engine_thread, rid, gen, metrics)
    try:
      engine_thread.submit(gen.prompt_ids, gen.params, rid, tracker.on_update)
    except RequestError as e:  # includes QueueFull (429) and prompt too long (413)
      err = protocol.APIError.from_request_error(e)
      if gen.chat and err.param == "prompt":
        err.param = "messages"  # a chat request's prompt is its rendered messages
      raise err from None
    return tracker

  def logprobs_payload(gen, entries, offset):
    """(payload or None, new text offset) for a run of logprob entries."""
    if gen.params.logprobs is None:
      return None, offset
    if gen.chat:
      return responses.chat_logprobs(tokenizer, entries), offset
    return responses.completion_logprobs(tokenizer, entries, offset)

  def failure(final: _Final) -> protocol.APIError | None:
    if final.finish_reason == "error":
      return protocol.APIError(500, final.error or "engine error", None, "engine_error")
    if final.finish_reason == "abort":
      return protocol.APIError(503, "the request was aborted", None, "request_aborted")
    return None

  async def complete(request: Request, gen: protocol.GenerationRequest, tracker: _Tracker, created: int):
    waiter = asyncio.ensure_future(tracker.wait_finished())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
      if not waiter.done():
        waiter.cancel()
      tracker.close()  # the client left (or we were cancelled) before the end: free the request's pages
    if waiter.cancelled() or not waiter.done():
      return Response(status_code=499)  # nobody is listening; uvicorn drops it
    final = waiter.result()
    err = failure(final)
    if err is not None:
      raise err
    text = final.text
    use = responses.usage(len(gen.prompt_ids), len(final.output_ids))
    lps, _ = logprobs_payload(gen, final.logprobs or [], 0)
    build = responses.chat if gen.chat else responses.completion
    return JSONResponse(build(tracker.rid, created, model_name, text, final.finish_reason, lps, use, final.stats))

  async def stream(gen: protocol.GenerationRequest, tracker: _Tracker, created: int):
    chat, rid = gen.chat, tracker.rid
    deltas = TextDeltas(tokenizer, gen.params.stop_strings)
    lp_sent, offset = 0, 0

    def chunk(text, **kw):
      return responses.chunk(chat, rid, created, model_name, text, include_usage=gen.include_usage, **kw)

    try:
      if chat:
        yield responses.sse(chunk("", role=True))
      while True:
        _, lps, final = await tracker.next()
        if final is None:
          text = deltas.update(tracker.emitted)
          payload, offset = logprobs_payload(gen, lps, offset) if lps else (None, offset)
          lp_sent += len(lps)
          if text or lps:
            yield responses.sse(chunk(text, logprobs=payload))
          continue
        err = failure(final)
        if err is not None:
          metrics.record_error(err.status)
          yield responses.sse(err.body())
          break
        text = deltas.finish(final.text)
        payload, offset = logprobs_payload(gen, (final.logprobs or [])[lp_sent:], offset)
        last = chunk(text, finish_reason=final.finish_reason, logprobs=payload)
        last["speculation"] = final.stats
        yield responses.sse(last)
        if gen.include_usage:
          use = responses.usage(len(gen.prompt_ids), len(final.output_ids))
          yield responses.sse(responses.usage_chunk(chat, rid, created, model_name, use, final.stats))
        break
      yield responses.SSE_DONE
    except Exception as e:  # a bug here must still end the stream in a way clients understand
      log.exception("stream %s failed", rid)
      metrics.record_error(500)
      yield responses.sse(protocol.APIError(500, f"internal server error: {type(e).__name__}: {e}").body())
      yield responses.SSE_DONE
    finally:
      tracker.close()

  async def serve(request: Request, gen: protocol.GenerationRequest, prefix: str):
    tracker = submit(gen, prefix)
    created = int(time.time())
    if gen.stream:
      return _EventStream(stream(gen, tracker, created), tracker)
    return await complete(request, gen, tracker, created)

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = protocol.parse_json(await request.body())
    gen = protocol.parse_completion(body, tokenizer, model_name, vocab_size)
    return await serve(request, gen, "cmpl")

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = protocol.parse_json(await request.body())
    gen = protocol.parse_chat(body, tokenizer, model_name, vocab_size, max_model_len)
    return await serve(request, gen, "chatcmpl")

  # ---- info ------------------------------------------------------------------------------------------------------
  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                        "owned_by": "recguide_jax", "max_model_len": max_model_len}]}

  @app.get("/health")
  async def health():
    if _engine_alive(engine_thread):
      return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "the engine thread is not running"}, status_code=503)

  @app.get("/metrics")
  async def prometheus_metrics():
    return Response(metrics.render(), media_type=CONTENT_TYPE)

  return app
