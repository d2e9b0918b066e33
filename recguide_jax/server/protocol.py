"""OpenAI request validation and error bodies.

Requests are read as plain JSON objects and checked field by field here (rather than by pydantic models) so that
every rejection names its field in an OpenAI-shaped body `{"error": {"message", "type", "param", "code"}}` with
status 400, and the engine's own checks (`SamplingParams.validate`, `Engine.validate_request`) stay the single
source of truth for value ranges. Unknown fields are rejected like OpenAI does, so a typo such as `max_token`
is not silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math

from recguide_jax.engine import MAX_TOP_LOGPROBS, RequestError, SamplingParams
from recguide_jax.tokenizer import Tokenizer, TokenizerError

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Fields accepted only at their neutral value: clients often send them explicitly.
_NEUTRAL = {
    "n": (None, 1),
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
}
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs",
             "ignore_eos", "stream", "stream_options")
COMPLETION_FIELDS = frozenset(_SAMPLING + ("prompt", "n", "best_of", "echo", "suffix", "presence_penalty",
                                           "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias")
                              + _IGNORED)
CHAT_FIELDS = frozenset(_SAMPLING + ("messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                                     "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                     "min_tokens", "logit_bias", "tools", "tool_choice", "response_format")
                        + _IGNORED)

_ERROR_CODES = {413: "context_length_exceeded", 429: "rate_limit_exceeded", 503: "service_unavailable"}


class APIError(Exception):
  """An error answered with an OpenAI-shaped body; `status` is the HTTP status."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.param = param
    self.code = code or _ERROR_CODES.get(status) or ("invalid_value" if status < 500 else "internal_error")
    self.type = type_ or error_type(status)

  def body(self) -> dict:
    return error_body(self.message, self.type, self.param, self.code)

  @classmethod
  def from_request_error(cls, e: RequestError) -> "APIError":
    return cls(e.code, str(e), e.param)


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


# ---- field readers ----------------------------------------------------------------------------------------------
def _show(value) -> str:
  text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


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


def _check_fields(body: dict, allowed: frozenset) -> None:
  for name in body:
    if name not in allowed:
      raise APIError(400, f"unrecognized request argument supplied: {name}", name, "unknown_parameter")
  for name, neutral in _NEUTRAL.items():
    value = body.get(name)
    if value is None:
      continue
    # compare types too: `n: true` must not pass as `n: 1`
    if not any(value == v and type(value) is type(v) for v in neutral if v is not None):
      allowed = " or ".join(_show(v) for v in neutral if v is not None)
      raise APIError(400, f"{name}={_show(value)} is not supported by this server (only {allowed})", name,
                     "unsupported_parameter")


def check_model(body: dict, served: str) -> None:
  """`model` may be omitted (one model is served); a wrong name is a 404 like OpenAI's."""
  model = body.get("model")
  if model is None:
    return
  if not isinstance(model, str):
    raise _bad_type("model", "a string", model)
  if model != served:
    raise APIError(404, f"The model `{model}` does not exist; this server serves `{served}`", "model",
                   "model_not_found")


def _stream_options(body: dict, stream: bool) -> bool:
  opts = body.get("stream_options")
  if opts is None:
    return False
  if not stream:
    raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
  if not isinstance(opts, dict):
    raise _bad_type("stream_options", "an object", opts)
  unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
  if unknown:
    raise APIError(400, f"unrecognized stream option {sorted(unknown)[0]}", "stream_options", "unknown_parameter")
  include = opts.get("include_usage")
  if include is not None and not isinstance(include, bool):
    raise _bad_type("stream_options.include_usage", "a boolean", include)
  return bool(include)


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
    return tokenizer.encode(prompt)
  if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
    return list(prompt)
  if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    raise APIError(400, f"only one prompt per request is supported, got {len(prompt)}", "prompt",
                   "unsupported_parameter")
  raise _bad_type("prompt", "a string, a list of token ids, or a list holding one of those", prompt)


def parse_completion(body, tokenizer: Tokenizer, served: str, vocab_size: int) -> GenerationRequest:
  body = _object(body)
  _check_fields(body, COMPLETION_FIELDS)
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
  return GenerationRequest(prompt_ids, _validate(params, vocab_size), stream, _stream_options(body, stream))


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
    out.append({"role": m["role"], "content": _message_text(i, m["content"])})
  return out


def parse_chat(body, tokenizer: Tokenizer, served: str, vocab_size: int, max_model_len: int) -> GenerationRequest:
  body = _object(body)
  _check_fields(body, CHAT_FIELDS)
  check_model(body, served)
  messages = _messages(body)
  add_generation_prompt = _bool(body, "add_generation_prompt", True)
  try:
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt))
  except TokenizerError as e:
    raise APIError(400, str(e), "messages") from None
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
  return GenerationRequest(prompt_ids, _validate(params, vocab_size, renames), stream,
                           _stream_options(body, stream), chat=True)


def _object(body) -> dict:
  if not isinstance(body, dict):
    raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_type")
  return body


def parse_json(raw: bytes):
  try:
    return json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise APIError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
