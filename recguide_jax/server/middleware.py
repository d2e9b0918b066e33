"""ASGI middleware of the app: the request id (`X-Request-Id` honoured when sane, else a fresh one, echoed on every
response) and Bearer auth on /v1/* (vLLM's rule)."""

from __future__ import annotations

import hmac
import uuid

from fastapi.responses import JSONResponse

from recguide_jax.server.body import sane_request_id
from recguide_jax.server.errors import APIError


REQUEST_ID_HEADER = "X-Request-Id"


class RequestIdMiddleware:
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
        given = sane_request_id(value.decode("latin-1"))
        break
    rid = given or uuid.uuid4().hex
    scope.setdefault("state", {})["request_id"] = rid

    async def send_with_id(message):
      if message["type"] == "http.response.start":
        message = dict(message)
        message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode("latin-1"))]
      await send(message)

    await self.app(scope, receive, send_with_id)


class APIKeyMiddleware:
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
    err = APIError(401, message, None, "invalid_api_key")
    await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
