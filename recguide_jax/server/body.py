"""What a request is before any field is read: its declared Content-Type (415 unless JSON), its JSON body (UTF-8,
bounded in nesting depth and number size, every string valid Unicode text: else 400 naming the field) and a
client's X-Request-Id (kept only when it is a short printable token)."""

from __future__ import annotations

import email.message
import json
import math
import re

from recguide_jax.server.errors import APIError, _cap, show as _show

# Body limits. Real requests nest a few levels (messages -> content parts -> text; tool schemas a few more) and
# carry numbers of at most ~20 digits (a 64-bit seed); json.loads recurses per level (RecursionError near 1,000)
# and refuses integers over 4,300 digits with a bare ValueError, so both are bounded before it runs.
MAX_JSON_DEPTH = 64
MAX_NUMBER_CHARS = 64
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 413 beyond; a max_model_len prompt of text or token ids fits easily

# ---- X-Request-Id -----------------------------------------------------------------------------------------------
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}")


def sane_request_id(value: str | None) -> str | None:
  """A client's X-Request-Id if it is a short printable token (it ends up in logs, ids and headers), else None."""
  if value and _REQUEST_ID.fullmatch(value):
    return value
  return None


# ---- the body ------------------------------------------------------------------------------------------------
def check_content_type(header: str | None) -> None:
  """415 unless the body is declared JSON. Like FastAPI (which vLLM's routes use): a missing Content-Type is read as
  JSON, and `application/json` or any `application/*+json` is JSON; a charset other than UTF-8 is refused. Anything
  else explicitly declared (`curl -d` sends application/x-www-form-urlencoded) is not JSON: 415 with a hint."""
  if header is None or not header.strip():
    return
  msg = email.message.Message()
  msg["content-type"] = header
  subtype = msg.get_content_subtype()
  if msg.get_content_maintype() != "application" or not (subtype == "json" or subtype.endswith("+json")):
    raise APIError(415, f"Content-Type {_show(header)} is not supported: send the JSON body with "
                   "'Content-Type: application/json'", None, "unsupported_media_type")
  charset = (msg.get_content_charset() or "utf-8").lower().replace("_", "-")
  if charset not in ("utf-8", "utf8", "us-ascii", "ascii"):
    raise APIError(415, f"charset {_show(charset)} is not supported: the JSON body must be UTF-8", None,
                   "unsupported_media_type")


class _Limit(Exception):
  """Raised from json.loads hooks; becomes a 400."""


def _parse_int(literal: str) -> int:
  if len(literal) > MAX_NUMBER_CHARS:
    raise _Limit(f"an integer literal of {len(literal)} characters (at most {MAX_NUMBER_CHARS} are allowed)")
  return int(literal)


def _parse_float(literal: str) -> float:
  if len(literal) > MAX_NUMBER_CHARS:
    raise _Limit(f"a number literal of {len(literal)} characters (at most {MAX_NUMBER_CHARS} are allowed)")
  value = float(literal)
  if not math.isfinite(value):
    raise _Limit(f"the number {_cap(literal)} overflows a 64-bit float")
  return value


def _parse_constant(name: str):
  raise _Limit(f"{name} is not valid JSON (numbers must be finite)")


# strings (kept whole, so brackets inside them do not count) and brackets
_DEPTH_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]", re.IGNORECASE)


def _check_depth(text: str) -> None:
  if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
    return  # cannot nest deeper than it has brackets
  depth = 0
  for m in _DEPTH_TOKENS.finditer(text):
    c = m.group()
    if c in "[{":
      depth += 1
      if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json")
    elif c in "]}":
      depth -= 1


def _path(parent: str, key) -> str:
  if isinstance(key, int):
    return f"{parent}[{key}]"
  shown = _show(key)[1:-1]
  return f"{parent}.{shown}" if parent else shown


def _check_text(body) -> None:
  """400 naming the first string (value or field name) that is not valid Unicode text: a lone surrogate, from a
  `\\udXXX` escape or from an invalid UTF-8 byte (decoded with surrogateescape)."""
  stack = [("", body)]
  while stack:
    path, value = stack.pop()
    if isinstance(value, str):
      hit = _SURROGATE.search(value)
      if hit:
        raise APIError(400, f"{path or 'the request body'} is not valid UTF-8 text: it holds a lone surrogate or "
                       f"an invalid byte ({_show(hit.group())}) at character {hit.start()}", path or None,
                       "invalid_encoding")
    elif isinstance(value, dict):
      for key, item in reversed(list(value.items())):
        hit = _SURROGATE.search(key)
        if hit:
          field = _path(path, key)
          raise APIError(400, f"the field name {field} is not valid UTF-8 text: it holds a lone surrogate or an "
                         f"invalid byte ({_show(hit.group())})", field, "invalid_encoding")
        stack.append((_path(path, key), item))
    elif isinstance(value, list):
      for i in range(len(value) - 1, -1, -1):
        if isinstance(value[i], (str, list, dict)):
          stack.append((_path(path, i), value[i]))


def parse_json(raw: bytes):
  """The JSON value of a request body, or APIError(400) with OpenAI's error body; see the module docstring."""
  if raw.startswith(b"\xef\xbb\xbf"):
    raw = raw[3:]  # a UTF-8 byte order mark, as json.loads(bytes) accepts
  # invalid bytes become lone surrogates (surrogateescape) so that one inside a string is reported with its field
  # by _check_text, like a \\udXXX escape; outside a string the JSON is invalid anyway
  text = raw.decode("utf-8", "surrogateescape")
  _check_depth(text)
  try:
    value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
  except _Limit as e:
    raise APIError(400, f"the request body is not accepted: {e}", None, "invalid_json") from None
  except json.JSONDecodeError as e:
    detail = f"{e.msg}: line {e.lineno} column {e.colno} (char {e.pos})"
    raise APIError(400, f"the request body is not valid JSON: {detail}", None, "invalid_json") from None
  except (ValueError, RecursionError) as e:  # belt and braces: the checks above should have caught it
    raise APIError(400, f"the request body is not accepted: {type(e).__name__}", None, "invalid_json") from None
  if _SURROGATE.search(text) or _SURROGATE_ESCAPE.search(text):
    _check_text(value)
  return value
