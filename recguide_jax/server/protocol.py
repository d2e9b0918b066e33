"""OpenAI request validation and error bodies.

Requests are read as plain JSON objects and checked field by field here (rather than by pydantic models) so that
every rejection names its field in an OpenAI-shaped body `{"error": {"message", "type", "param", "code"}}` with
status 400, and the engine's own checks (`SamplingParams.validate`, `Engine.validate_request`) stay the single
source of truth for value ranges. Unknown fields are ignored and returned in `GenerationRequest.ignored_fields`
(the app logs them), as vLLM does: clients send vendor fields routinely. With `strict=True` they are rejected like
OpenAI does (400 naming the field), so a typo such as `max_token` is not silently ignored.

Hostile bodies are answered with 4xx, never 5xx (`parse_json`): the body must be UTF-8 JSON with at most
MAX_JSON_DEPTH levels of nesting and number literals of at most MAX_NUMBER_CHARS characters (no NaN / Infinity,
no float that overflows); every string in it, field names included, must be valid Unicode text (no lone surrogate
from a `\\udXXX` escape, no invalid UTF-8 byte), else 400 naming the field. Error messages never echo a value
verbatim: `_show` escapes and caps it, and APIError makes its message and param encodable.
"""

from __future__ import annotations

import dataclasses
import email.message
import json
import math
import re

from recguide_jax.requests import MAX_TOP_LOGPROBS, RequestError, SamplingParams
from recguide_jax.tokenizer import Tokenizer, TokenizerError

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Body limits. Real requests nest a few levels (messages -> content parts -> text; tool schemas a few more) and
# carry numbers of at most ~20 digits (a 64-bit seed); json.loads recurses per level (RecursionError near 1,000)
# and refuses integers over 4,300 digits with a bare ValueError, so both are bounded before it runs.
MAX_JSON_DEPTH = 64
MAX_NUMBER_CHARS = 64
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 413 beyond; a max_model_len prompt of text or token ids fits easily
_MAX_ECHO = 60  # characters of a client value quoted in an error message
MAX_CHOICES = 16  # most samples (`n`) per request: each is a request of its own in the engine

# Fields accepted only at their neutral value: clients often send them explicitly.
_NEUTRAL = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "min_p": (None, 0, 0.0),  # the sampler has no min-p filter; 0 (off) is what clients send by default
}
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs",
             "ignore_eos", "stream", "stream_options", "min_p", "response_format")
COMPLETION_FIELDS = frozenset(_SAMPLING + ("prompt", "n", "best_of", "echo", "suffix", "presence_penalty",
                                           "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias")
                              + _IGNORED)
CHAT_FIELDS = frozenset(_SAMPLING + ("messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                                     "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                     "min_tokens", "logit_bias", "tools", "tool_choice", "chat_template_kwargs")
                        + _IGNORED)
# names a chat_template_kwargs entry may not override: the template's own inputs
_TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})

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


@dataclasses.dataclass
class GenerationRequest:
  """A validated request: what the engine needs plus how to shape the answer."""
  prompt_ids: list[int]
  params: SamplingParams
  stream: bool = False
  include_usage: bool = False
  chat: bool = False
  continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk
  n: int = 1  # independent samples of the same prompt (non-streamed only)
  ignored_fields: tuple[str, ...] = ()  # unknown fields dropped (non-strict mode), escaped and capped for logging


# ---- field readers ----------------------------------------------------------------------------------------------
def _show(value) -> str:
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


def _bad_type(name: str, expected: str, value) -> APIError:
  return APIError(400, f"{name} must be {expected}, got {_show(value)}", name, "invalid_type")


def _int(body: dict, name: str, default=None):
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int):
    raise _bad_type(name, "an integer", value)
  return value


def _number(body: dict, name: str, default=None):
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise _bad_type(name, "a number", value)
  return float(value)


def _bool(body: dict, name: str, default=None):
  value = body.get(name)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise _bad_type(name, "a boolean", value)
  return value


def _check_fields(body: dict, allowed: frozenset, strict: bool) -> tuple[str, ...]:
  """Checks neutral-only fields; returns the unknown field names (escaped, capped), or raises for the first one
  when `strict`."""
  ignored = []
  for name in body:
    if name not in allowed:
      shown = _cap(json.dumps(name)[1:-1])  # the name, escaped (ensure_ascii), without quotes
      if strict:
        raise APIError(400, f"unrecognized request argument supplied: {shown}", shown, "unknown_parameter")
      ignored.append(shown)
  for name, neutral in _NEUTRAL.items():
    value = body.get(name)
    if value is None:
      continue
    # compare types too: `n: true` must not pass as `n: 1`
    if not any(value == v and type(value) is type(v) for v in neutral if v is not None):
      allowed = " or ".join(_show(v) for v in neutral if v is not None)
      raise APIError(400, f"{name}={_show(value)} is not supported by this server (only {allowed})", name,
                     "unsupported_parameter")
  return tuple(ignored[:32])  # a body with thousands of junk fields must not make a huge log line


def check_model(body: dict, served: str) -> None:
  """`model` may be omitted (one model is served); a wrong name is a 404 like OpenAI's."""
  model = body.get("model")
  if model is None:
    return
  if not isinstance(model, str):
    raise _bad_type("model", "a string", model)
  if model != served:
    raise APIError(404, f"The model {_show(model)} does not exist; this server serves `{served}`", "model",
                   "model_not_found")


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
  """(include_usage, continuous_usage_stats)."""
  opts = body.get("stream_options")
  if opts is None:
    return False, False
  if not isinstance(stream, bool) or not stream:
    raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
  if not isinstance(opts, dict):
    raise _bad_type("stream_options", "an object", opts)
  unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
  if unknown:
    raise APIError(400, f"unrecognized stream option {_show(sorted(unknown)[0])}", "stream_options",
                   "unknown_parameter")
  include = opts.get("include_usage")
  if include is not None and not isinstance(include, bool):
    raise _bad_type("stream_options.include_usage", "a boolean", include)
  continuous = opts.get("continuous_usage_stats")
  if continuous is not None and not isinstance(continuous, bool):
    raise _bad_type("stream_options.continuous_usage_stats", "a boolean", continuous)
  return bool(include), bool(continuous)


def _n(body: dict, stream: bool) -> int:
  n = _int(body, "n", 1)
  if not 1 <= n <= MAX_CHOICES:
    raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
  if n > 1 and stream:
    raise APIError(400, "n > 1 is not supported with stream=true", "n", "unsupported_parameter")
  return n


def seed_of_choice(seed: int | None, index: int) -> int | None:
  """Choice `index`'s seed: a given seed is shifted per choice (wrapped into the signed 64-bit range), so the
  samples stay independent and reproducible; without a seed each choice draws its own."""
  if seed is None or index == 0:
    return seed
  return (seed + index + 2**63) % 2**64 - 2**63


def _stop(body: dict):
  stop = body.get("stop")
  if stop is None or isinstance(stop, str):
    return stop
  if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
    raise _bad_type("stop", "a string or a list of strings", stop)
  return list(stop)


def _stop_token_ids(body: dict):
  ids = body.get("stop_token_ids")
  if ids is None:
    return None
  if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
    raise _bad_type("stop_token_ids", "a list of token ids", ids)
  return list(ids)


def _sampling(body: dict, max_tokens, logprobs) -> SamplingParams:
  return SamplingParams(
      max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
      top_k=_int(body, "top_k", 0), seed=_int(body, "seed"), stop=_stop(body), stop_token_ids=_stop_token_ids(body),
      logprobs=logprobs, ignore_eos=_bool(body, "ignore_eos", False))


def _validate(params: SamplingParams, vocab_size: int, renames: dict[str, str] | None = None) -> SamplingParams:
  try:
    return params.validate(vocab_size)
  except RequestError as e:
    param = (renames or {}).get(e.param, e.param)
    message = str(e)
    if param != e.param and message.startswith(e.param):
      message = param + message[len(e.param):]
    raise APIError(e.code, message, param) from None


# ---- /v1/completions ----------------------------------------------------------------------------------------------
def _prompt_ids(prompt, tokenizer: Tokenizer) -> list[int]:
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str):
    try:
      return tokenizer.encode(prompt)
    except Exception as e:  # the text was checked to be valid Unicode; anything else the tokenizer refuses
      raise APIError(400, f"prompt cannot be tokenized: {type(e).__name__}", "prompt") from None
  if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
    return list(prompt)
  if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    raise APIError(400, f"only one prompt per request is supported, got {len(prompt)}", "prompt",
                   "unsupported_parameter")
  raise _bad_type("prompt", "a string, a list of token ids, or a list holding one of those", prompt)


def parse_completion(body, tokenizer: Tokenizer, served: str, vocab_size: int, *,
                     strict: bool = False) -> GenerationRequest:
  body = _object(body)
  ignored = _check_fields(body, COMPLETION_FIELDS, strict)
  check_model(body, served)
  if "prompt" not in body or body["prompt"] is None:
    raise APIError(400, "prompt is required", "prompt", "missing_required_parameter")
  prompt_ids = _prompt_ids(body["prompt"], tokenizer)
  if not prompt_ids:
    raise APIError(400, "prompt must not be empty", "prompt")
  logprobs = _int(body, "logprobs")
  if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
    raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs")
  params = _sampling(body, _int(body, "max_tokens", COMPLETION_MAX_TOKENS), logprobs)
  stream = _bool(body, "stream", False)
  include, continuous = _stream_options(body, stream)
  return GenerationRequest(prompt_ids, _validate(params, vocab_size), stream, include,
                           continuous_usage=continuous, n=_n(body, stream), ignored_fields=ignored)


# ---- /v1/chat/completions -----------------------------------------------------------------------------------------
def _message_text(i: int, content) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # content parts: only text can be rendered by a text chat template
    texts = []
    for part in content:
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise APIError(400, f"messages[{i}].content: only text content parts are supported", "messages")
      texts.append(part["text"])
    return "".join(texts)
  raise _bad_type(f"messages[{i}].content", "a string or a list of text parts", content)


def _messages(body: dict) -> list[dict]:
  messages = body.get("messages")
  if messages is None:
    raise APIError(400, "messages is required", "messages", "missing_required_parameter")
  if not isinstance(messages, list):
    raise _bad_type("messages", "a list of messages", messages)
  if not messages:
    raise APIError(400, "messages must not be empty", "messages")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise _bad_type(f"messages[{i}]", "an object", m)
    if not isinstance(m.get("role"), str):
      raise APIError(400, f"messages[{i}].role must be a string", "messages",
                     "missing_required_parameter" if "role" not in m else "invalid_type")
    if m.get("content") is None:
      raise APIError(400, f"messages[{i}].content is required", "messages", "missing_required_parameter")
    if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
      raise _bad_type(f"messages[{i}].name", "a string", m["name"])
    out.append({"role": m["role"], "content": _message_text(i, m["content"])})
  return out


def _template_kwargs(body: dict) -> dict:
  kwargs = body.get("chat_template_kwargs")
  if kwargs is None:
    return {}
  if not isinstance(kwargs, dict):
    raise _bad_type("chat_template_kwargs", "an object", kwargs)
  for key in kwargs:
    if key in _TEMPLATE_RESERVED:
      raise APIError(400, f"chat_template_kwargs may not set {key} (pass it as a request field)",
                     f"chat_template_kwargs.{key}")
  return dict(kwargs)


def render_chat(body: dict, tokenizer: Tokenizer) -> list[int]:
  """The prompt ids of a chat body (`messages`, `add_generation_prompt`, `chat_template_kwargs`); also /tokenize's."""
  messages = _messages(body)
  add_generation_prompt = _bool(body, "add_generation_prompt", True)
  template_kwargs = _template_kwargs(body)
  try:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt, **template_kwargs))
  except TokenizerError as e:
    raise APIError(400, str(e), "messages") from None
  except Exception as e:  # a template that fails on odd but valid input is still the request's problem
    raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}", "messages") from None


def parse_chat(body, tokenizer: Tokenizer, served: str, vocab_size: int, max_model_len: int, *,
               strict: bool = False) -> GenerationRequest:
  body = _object(body)
  ignored = _check_fields(body, CHAT_FIELDS, strict)
  check_model(body, served)
  prompt_ids = render_chat(body, tokenizer)
  if not prompt_ids:
    raise APIError(400, "the chat template rendered an empty prompt", "messages")
  want_logprobs = _bool(body, "logprobs", False)
  top = _int(body, "top_logprobs")
  if top is not None and not want_logprobs:
    raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
  if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
    raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
  renames = {"logprobs": "top_logprobs"}
  max_tokens = _int(body, "max_completion_tokens")
  if max_tokens is not None:
    renames["max_tokens"] = "max_completion_tokens"
  else:
    max_tokens = _int(body, "max_tokens")
  if max_tokens is None:  # like vLLM: the rest of the context
    max_tokens = max(max_model_len - len(prompt_ids), 1)
  params = _sampling(body, max_tokens, (top or 0) if want_logprobs else None)
  stream = _bool(body, "stream", False)
  include, continuous = _stream_options(body, stream)
  return GenerationRequest(prompt_ids, _validate(params, vocab_size, renames), stream, include, chat=True,
                           continuous_usage=continuous, n=_n(body, stream), ignored_fields=ignored)


# ---- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------------------------------
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "chat_template_kwargs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def parse_tokenize(body, tokenizer: Tokenizer, served: str, *, strict: bool = False) -> list[int]:
  """`{"prompt": text}` or `{"messages": [...]}` (rendered by the chat template) -> the prompt's token ids."""
  body = _object(body)
  _check_fields(body, TOKENIZE_FIELDS, strict)
  check_model(body, served)
  has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
  if not has_prompt and not has_messages:
    raise APIError(400, "prompt or messages is required", "prompt", "missing_required_parameter")
  if has_prompt and has_messages:
    raise APIError(400, "pass one of prompt or messages, not both", "messages")
  if has_messages:
    return render_chat(body, tokenizer)
  prompt = body["prompt"]
  if not isinstance(prompt, str):
    raise _bad_type("prompt", "a string", prompt)
  special = _bool(body, "add_special_tokens", False)
  try:
    return tokenizer.encode(prompt, add_special_tokens=special)
  except Exception as e:
    raise APIError(400, f"prompt cannot be tokenized: {type(e).__name__}", "prompt") from None


def parse_detokenize(body, served: str, vocab_size: int, *, strict: bool = False) -> list[int]:
  """`{"tokens": [ids]}` -> the ids, each in [0, vocab_size)."""
  body = _object(body)
  _check_fields(body, DETOKENIZE_FIELDS, strict)
  check_model(body, served)
  tokens = body.get("tokens")
  if tokens is None:
    raise APIError(400, "tokens is required", "tokens", "missing_required_parameter")
  if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
    raise _bad_type("tokens", "a list of token ids", tokens)
  for i, t in enumerate(tokens):
    if not 0 <= t < vocab_size:
      raise APIError(400, f"tokens[{i}]={_show(t)} is not a token id of this model (vocabulary of {vocab_size})",
                     "tokens")
  return tokens


# ---- X-Request-Id -----------------------------------------------------------------------------------------------
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}")


def sane_request_id(value: str | None) -> str | None:
  """A client's X-Request-Id if it is a short printable token (it ends up in logs, ids and headers), else None."""
  if value and _REQUEST_ID.fullmatch(value):
    return value
  return None


def _object(body) -> dict:
  if not isinstance(body, dict):
    raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_type")
  return body


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
