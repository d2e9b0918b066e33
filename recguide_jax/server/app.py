"""FastAPI app over an `EngineThread`: the routes (OpenAI completions and chat completions, plain and streamed;
models, tokenize, detokenize, version, health and Prometheus metrics), the middleware and the error handlers.

The event loop only parses, tokenizes and drops requests into the engine thread's inbox (`generation`: a request's
n samples, its JSON answer or SSE stream); `tracker` bridges each request's progress back to the loop, and a
client that goes away aborts its requests so their batch slots and KV pages are freed at the next engine step.

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
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import recguide_jax
from recguide_jax.engine.thread import EngineThread
from recguide_jax.server import protocol
from recguide_jax.server.body import DEFAULT_MAX_BODY_BYTES, check_content_type, parse_json
from recguide_jax.server.generation import Generation
from recguide_jax.server.metric_types import CONTENT_TYPE, DEFAULT_LOG_STATS_INTERVAL_S
from recguide_jax.server.metrics import ServerMetrics
from recguide_jax.server.middleware import REQUEST_ID_HEADER, APIKeyMiddleware, RequestIdMiddleware
from recguide_jax.text.tokenizer import Tokenizer

log = logging.getLogger("recguide_jax.server")


def _engine_alive(engine_thread: EngineThread) -> bool:
  return engine_thread.is_alive()


def create_app(engine_thread: EngineThread, tokenizer: Tokenizer, model_name: str, *, profile: str | None = None,
               shutdown_engine: bool = True, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
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
    app.add_middleware(APIKeyMiddleware, api_key=api_key, on_reject=lambda: metrics.record_error(401))
  app.add_middleware(RequestIdMiddleware)
  if allowed_origins:
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                       allow_credentials="*" not in allowed_origins, expose_headers=[REQUEST_ID_HEADER])
  generation = Generation(engine_thread, tokenizer, model_name, metrics)

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
  def too_large() -> protocol.APIError:
    return protocol.APIError(413, f"the request body is larger than {max_body_bytes} bytes", None,
                             "request_too_large")

  # A body up to this size is read to its end (and dropped) before the 413: closing a connection with unread
  # data makes the kernel reset it, and the client may lose the answer; past it, answer at once and close.
  drain_limit = 4 * max_body_bytes

  async def read_json(request: Request):
    """The request's JSON body: 415 for a non-JSON Content-Type, 413 past max_body_bytes, 400 for the rest."""
    check_content_type(request.headers.get("content-type"))
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
    return parse_json(b"".join(chunks))

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = await read_json(request)
    gen = protocol.parse_completion(body, tokenizer, model_name, vocab_size, strict=strict_request_fields)
    return await generation.serve(request, gen, "cmpl")

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = await read_json(request)
    gen = protocol.parse_chat(body, tokenizer, model_name, vocab_size, max_model_len, strict=strict_request_fields)
    return await generation.serve(request, gen, "chatcmpl")

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
