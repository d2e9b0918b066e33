"""OpenAI-shaped errors: `APIError` (an HTTP status and `{"error": {"message", "type", "param", "code"}}`) and
how a client value is quoted in a message (`show`: escaped, capped, never echoed verbatim)."""

from __future__ import annotations

import json
import math

from recguide_jax.engine.requests import RequestError

_MAX_ECHO = 60  # characters of a client value quoted in an error message

_ERROR_CODES = {413: "context_length_exceeded", 429: "rate_limit_exceeded", 503: "service_unavailable"}


class APIError(Exception):
  """An error answered with an OpenAI-shaped body; `status` is the HTTP status."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None):
    message = encodable(message)
    super().__init__(message)
    self.status = status
    self.message = message
    self.param = None if param is None else _cap(encodable(param), 120)
    self.code = code or _ERROR_CODES.get(status) or ("invalid_value" if status < 500 else "internal_error")
    self.type = type_ or error_type(status)

  def body(self) -> dict:
    return error_body(self.message, self.type, self.param, self.code)

  @classmethod
  def from_request_error(cls, e: RequestError) -> "APIError":
    return cls(e.code, str(e), e.param)


def encodable(text: str) -> str:
  """`text` with anything UTF-8 cannot encode (lone surrogates) replaced by its backslash escape."""
  return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _cap(text: str, limit: int = _MAX_ECHO) -> str:
  return text if len(text) <= limit else text[:limit - 3] + "..."


def error_type(status: int) -> str:
  if status == 429:
    return "rate_limit_error"
  return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
  return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def show(value) -> str:
  """A client value as an error message may quote it: JSON with ASCII escapes (a lone surrogate shows as
  \\udcff), capped."""
  if isinstance(value, float) and not math.isfinite(value):
    return repr(value)
  if isinstance(value, (list, dict)) and len(value) > 16:  # do not serialise a huge value to show 60 characters
    return f"a{'n' if isinstance(value, dict) else ''} {'object' if isinstance(value, dict) else 'list'} of " \
           f"{len(value)} items"
  try:
    text = json.dumps(value, ensure_ascii=True)
  except (TypeError, ValueError):
    text = ascii(value)
  return _cap(text)


def bad_type(name: str, expected: str, value) -> APIError:
  return APIError(400, f"{name} must be {expected}, got {show(value)}", name, "invalid_type")

