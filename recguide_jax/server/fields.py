"""Reading a request body's fields: typed readers that name the field in a 400, the fields each endpoint knows
(unknown ones ignored and returned for the log, or refused in strict mode; some accepted only at their neutral
value), and the sampling fields shared by completions and chat."""

from __future__ import annotations

import json

from recguide_jax.engine.requests import MAX_SAMPLES, RequestError, SamplingParams
from recguide_jax.server.errors import APIError, _cap, bad_type as _bad_type, show as _show

# Fields accepted only at their neutral value: clients often send them explicitly.
_NEUTRAL = {
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
  del stream  # n > 1 streams too: each chunk carries its choice's index
  n = _int(body, "n", 1)
  if not 1 <= n <= MAX_SAMPLES:
    raise APIError(400, f"n must be in [1, {MAX_SAMPLES}], got {n}", "n")
  return n


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


def _object(body) -> dict:
  if not isinstance(body, dict):
    raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_type")
  return body

