"""FastAPI app over an `EngineThread`: OpenAI completions and chat completions (plain and streamed), models,
health and Prometheus metrics.

The event loop only parses, tokenizes and drops requests into the engine thread's inbox; the engine thread
reports each request's progress through its `on_update` callback, which copies what it needs (the engine keeps
mutating the request) and hands it to the loop with `call_soon_threadsafe`, into one asyncio queue per request.
A client that goes away aborts its request so its batch slot and KV pages are freed at the next engine step.

Hostile input is answered with 4xx: a declared non-JSON Content-Type gets 415 (a missing one is read as JSON, as
FastAPI does), a body over `max_body_bytes` gets 413 (checked from Content-Length before reading, and while
reading), and `protocol` turns everything else into 400s. Any unexpected exception in a route still answers 500
with OpenAI's error body and is logged.

Like vLLM: unknown request fields are ignored with a logged warning (`strict_request_fields` answers them with
400); `api_key` requires `Authorization: Bearer <key>` on /v1/* (401 in OpenAI's error shape; /health, /metrics,
/version, /tokenize and /detokenize stay open, as in vLLM); `allowed_origins` enables CORS; a sane `X-Request-Id`
header becomes the request's id, and every response carries `X-Request-Id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import recguide_jax
from recguide_jax.engine import EngineThread
from recguide_jax.requests import RequestError
from recguide_jax.server import protocol, responses
from recguide_jax.server.metrics import CONTENT_TYPE, DEFAULT_LOG_STATS_INTERVAL_S, ServerMetrics
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
  error_code: int | None = None  # HTTP status of an error the engine attributed to the request (e.g. 429)


class _Tracker:
  """One request's bridge from the engine thread to the event loop."""

  def __init__(self, loop: asyncio.AbstractEventLoop, engine_thread: EngineThread, rid: str,
               gen: protocol.GenerationRequest, metrics: ServerMetrics, live_ids: set | None = None):
    self.loop = loop
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
    self.final: _Final | None = None
    self._closed = False

  def on_update(self, req, new_ids) -> None:
    """Engine thread: called with the new tokens of a step, and with [] once the request has finished."""
    lps = None
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
      final = _Final(list(req.output_ids), req.finish_reason, req.error,
                     list(req.logprobs) if req.params.logprobs is not None else None, req.stats.as_dict(),
                     req.text or "", req.error_code)
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


REQUEST_ID_HEADER = "X-Request-Id"


class _RequestIdMiddleware:
  """Puts the request's id in `scope["state"]["request_id"]` (the client's X-Request-Id when sane, else a fresh one)
  and echoes it in the response headers. Pure ASGI (not BaseHTTPMiddleware) so streams and disconnects pass
  through untouched."""

  def __init__(self, app):
    self.app = app

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    given = None
    for name, value in scope.get("headers", ()):
      if name == b"x-request-id":
        given = protocol.sane_request_id(value.decode("latin-1"))
        break
    rid = given or uuid.uuid4().hex
    scope.setdefault("state", {})["request_id"] = rid

    async def send_with_id(message):
      if message["type"] == "http.response.start":
        message = dict(message)
        message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode("latin-1"))]
      await send(message)

    await self.app(scope, receive, send_with_id)


class _APIKeyMiddleware:
  """Bearer auth on /v1/* (vLLM's rule: other routes and CORS preflights stay open). The key is compared in
  constant time."""

  def __init__(self, app, api_key: str, on_reject):
    self.app = app
    self.expected = f"Bearer {api_key}".encode("utf-8")
    self.on_reject = on_reject

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http" or scope["method"] == "OPTIONS" or not scope["path"].startswith("/v1"):
      return await self.app(scope, receive, send)
    given = b""
    for name, value in scope.get("headers", ()):
      if name == b"authorization":
        given = value
        break
    if hmac.compare_digest(given, self.expected):
      return await self.app(scope, receive, send)
    self.on_reject()
    message = ("Incorrect API key provided" if given else
               "Missing API key: pass it as 'Authorization: Bearer <key>'")
    err = protocol.APIError(401, message, None, "invalid_api_key")
    await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def create_app(engine_thread: EngineThread, tokenizer: Tokenizer, model_name: str, *, profile: str | None = None,
               shutdown_engine: bool = True, max_body_bytes: int = protocol.DEFAULT_MAX_BODY_BYTES,
               log_stats_interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S, strict_request_fields: bool = False,
               api_key: str | None = None, allowed_origins=()) -> FastAPI:
  """The OpenAI-compatible app over a started `engine_thread`.

  shutdown_engine: on app shutdown (after uvicorn's graceful shutdown let in-flight requests finish), stop the
  engine thread, draining whatever it still holds.
  max_body_bytes: larger request bodies get 413.
  log_stats_interval_s: seconds between the engine stats lines in the log while there is activity; 0 disables.
  strict_request_fields: unknown request fields get 400 (default: ignored with a logged warning, as vLLM).
  api_key: when set, /v1/* requires `Authorization: Bearer <api_key>` (else 401).
  allowed_origins: CORS origins allowed to call the API from a browser (["*"] for any); empty: no CORS headers.
  """
  if api_key is not None and not api_key:
    raise ValueError("api_key must not be empty (pass None for no authentication)")
  allowed_origins = [o.strip() for o in allowed_origins if o.strip()]
  if max_body_bytes < 1:
    raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
  if tokenizer is None:
    raise ValueError("the server needs a tokenizer (a checkpoint with tokenizer.json)")
  engine = engine_thread.engine
  vocab_size = engine.cfg.vocab_size
  max_model_len = engine.rc.max_model_len
  metrics = ServerMetrics(engine_thread, model_name)
  stats_logger = metrics.stats_logger(log_stats_interval_s)
  started = int(time.time())

  @contextlib.asynccontextmanager
  async def lifespan(app):
    stats_logger.start()  # the periodic engine stats line (vLLM's); interval <= 0: off
    yield
    stats_logger.stop()
    if shutdown_engine:
      log.info("stopping the engine (draining %d running, %d queued)", len(engine.running),
               engine_thread.queue_depth)
      await asyncio.to_thread(engine_thread.shutdown, True)

  app = FastAPI(title="recguide_jax", lifespan=lifespan)
  app.state.engine_thread = engine_thread
  app.state.metrics = metrics
  app.state.model_name = model_name
  app.state.profile = profile  # hardware profile for RecGuide; stored when the policy does not take it
  # added innermost first: CORS outermost (a preflight is answered before auth), then the request id (echoed on
  # 401s too), then auth
  if api_key is not None:
    app.add_middleware(_APIKeyMiddleware, api_key=api_key, on_reject=lambda: metrics.record_error(401))
  app.add_middleware(_RequestIdMiddleware)
  if allowed_origins:
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                       allow_credentials="*" not in allowed_origins, expose_headers=[REQUEST_ID_HEADER])
  live_ids: set[str] = set()  # engine ids in flight: a client's X-Request-Id reused while running gets a suffix

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
  def submit(request: Request, gen: protocol.GenerationRequest, prefix: str, index: int | None = None) -> _Tracker:
    rid = f"{prefix}-{request.state.request_id}" + (f"-{index}" if index is not None else "")
    if rid in live_ids:  # the engine keys pages by id: two running requests must not share one
      rid = f"{rid}-{uuid.uuid4().hex[:8]}"
    tracker = _Tracker(asyncio.get_running_loop(), engine_thread, rid, gen, metrics, live_ids)
    live_ids.add(rid)
    try:
      engine_thread.submit(gen.prompt_ids, gen.params, rid, tracker.on_update)
    except RequestError as e:  # includes QueueFull (429) and prompt too long (413)
      live_ids.discard(rid)
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
      status = final.error_code or 500
      return protocol.APIError(status, final.error or "engine error", None, "engine_error" if status >= 500 else None)
    if final.finish_reason == "abort":
      return protocol.APIError(503, "the request was aborted", None, "request_aborted")
    return None

  async def complete(request: Request, gen: protocol.GenerationRequest, trackers: list[_Tracker], created: int,
                     rid: str):
    """The non-streamed answer: one choice per tracker (n > 1: independent samples of the same prompt)."""
    waiter = asyncio.ensure_future(asyncio.gather(*(t.wait_finished() for t in trackers)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
      if not waiter.done():
        waiter.cancel()
      for tracker in trackers:
        tracker.close()  # the client left (or we were cancelled) before the end: free the request's pages
    if waiter.cancelled() or not waiter.done():
      return Response(status_code=499)  # nobody is listening; uvicorn drops it
    finals = waiter.result()
    for final in finals:
      err = failure(final)
      if err is not None:
        raise err
    use = responses.usage(len(gen.prompt_ids), sum(len(f.output_ids) for f in finals))
    build = responses.chat if gen.chat else responses.completion
    bodies = []
    for final in finals:
      lps, _ = logprobs_payload(gen, final.logprobs or [], 0)
      bodies.append(build(rid, created, model_name, final.text, final.finish_reason, lps, use, final.stats))
    body = bodies[0]
    if len(bodies) > 1:  # each choice keeps its own speculation stats; the top level has the first's
      body["choices"] = [{**b["choices"][0], "index": i, "speculation": f.stats}
                         for i, (b, f) in enumerate(zip(bodies, finals))]
    return JSONResponse(body)

  async def stream(gen: protocol.GenerationRequest, tracker: _Tracker, created: int):
    chat, rid = gen.chat, tracker.rid
    deltas = TextDeltas(tokenizer, gen.params.stop_strings)
    lp_sent, offset = 0, 0

    def chunk(text, completion_tokens=None, **kw):
      so_far = None
      if gen.continuous_usage:
        n = len(tracker.emitted) if completion_tokens is None else completion_tokens
        so_far = responses.usage(len(gen.prompt_ids), n)
      return responses.chunk(chat, rid, created, model_name, text, include_usage=gen.include_usage,
                             usage_so_far=so_far, **kw)

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
        last = chunk(text, len(final.output_ids), finish_reason=final.finish_reason, logprobs=payload)
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
    created = int(time.time())
    if gen.ignored_fields:
      log.warning("%s-%s: the following fields were present in the request but ignored: %s", prefix,
                  request.state.request_id, ", ".join(gen.ignored_fields))
    if gen.n == 1:
      tracker = submit(request, gen, prefix)
      if gen.stream:
        return _EventStream(stream(gen, tracker, created), tracker)
      return await complete(request, gen, [tracker], created, tracker.rid)
    # n > 1 (never streamed): n engine requests, the i-th with the i-th choice's seed
    trackers = []
    try:
      for i in range(gen.n):
        params = dataclasses.replace(gen.params, seed=protocol.seed_of_choice(gen.params.seed, i))
        trackers.append(submit(request, dataclasses.replace(gen, params=params), prefix, index=i))
    except BaseException:
      for tracker in trackers:
        tracker.close()
      raise
    return await complete(request, gen, trackers, created, f"{prefix}-{request.state.request_id}")

  def too_large() -> protocol.APIError:
    return protocol.APIError(413, f"the request body is larger than {max_body_bytes} bytes", None,
                             "request_too_large")

  # A body up to this size is read to its end (and dropped) before the 413: closing a connection with unread
  # data makes the kernel reset it, and the client may lose the answer; past it, answer at once and close.
  drain_limit = 4 * max_body_bytes

  async def read_json(request: Request):
    """The request's JSON body: 415 for a non-JSON Content-Type, 413 past max_body_bytes, 400 for the rest."""
    protocol.check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > drain_limit:
      raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > drain_limit:
        raise too_large()
      if size <= max_body_bytes:
        chunks.append(chunk)
    if size > max_body_bytes:
      raise too_large()
    return protocol.parse_json(b"".join(chunks))

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = await read_json(request)
    gen = protocol.parse_completion(body, tokenizer, model_name, vocab_size, strict=strict_request_fields)
    return await serve(request, gen, "cmpl")

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = await read_json(request)
    gen = protocol.parse_chat(body, tokenizer, model_name, vocab_size, max_model_len, strict=strict_request_fields)
    return await serve(request, gen, "chatcmpl")

  # ---- info ------------------------------------------------------------------------------------------------------
  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                        "owned_by": "recguide_jax", "max_model_len": max_model_len}]}

  @app.get("/version")
  async def version():
    return {"version": recguide_jax.__version__}

  # the vocabulary both the model and the tokenizer know (a model may pad its embedding past the tokenizer's)
  detok_vocab = min(vocab_size, tokenizer.vocab_size)

  @app.post("/tokenize")
  async def tokenize(request: Request):
    body = await read_json(request)
    ids = protocol.parse_tokenize(body, tokenizer, model_name, strict=strict_request_fields)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

  @app.post("/detokenize")
  async def detokenize(request: Request):
    body = await read_json(request)
    ids = protocol.parse_detokenize(body, model_name, detok_vocab, strict=strict_request_fields)
    return {"prompt": tokenizer.decode(ids)}

  @app.get("/health")
  async def health():
    if _engine_alive(engine_thread):
      return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "the engine thread is not running"}, status_code=503)

  @app.get("/metrics")
  async def prometheus_metrics():
    return Response(metrics.render(), media_type=CONTENT_TYPE)

  return app
