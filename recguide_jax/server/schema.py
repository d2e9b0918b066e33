"""The request bodies as pydantic models (vLLM's and OpenAI's field names), and a pydantic `ValidationError` turned
into one OpenAI-shaped 400 that names the field.

Models are strict (`true` is no `n`, `"5"` no `max_tokens`; an integer is a number) and keep unknown fields as
extras (`protocol` ignores them with a warning, or refuses them in strict mode). Types only: value ranges stay with
the engine (`SamplingParams.validate`, `Engine.validate_request`), the single source of truth for what a request may
ask. The body reaching these models already passed `body.parse_json` (size, depth, number literals, UTF-8).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from recguide_jax.server.errors import APIError, _cap, show

_STRICT = ConfigDict(strict=True, extra="allow")

Stop = Optional[Union[str, list[str]]]


class StreamOptions(BaseModel):
  model_config = ConfigDict(strict=True, extra="forbid")
  include_usage: Optional[bool] = None
  continuous_usage_stats: Optional[bool] = None  # vLLM's: usage so far in every chunk


class _Sampling(BaseModel):
  """The fields completions and chat share."""
  model_config = _STRICT
  model: Optional[str] = None
  max_tokens: Optional[int] = None
  temperature: Optional[float] = None
  top_p: Optional[float] = None
  top_k: Optional[int] = None
  min_p: Optional[float] = None
  seed: Optional[int] = None
  stop: Stop = None
  stop_token_ids: Optional[list[int]] = None
  ignore_eos: Optional[bool] = None
  n: Optional[int] = None
  stream: Optional[bool] = None
  stream_options: Optional[StreamOptions] = None
  presence_penalty: Optional[float] = None
  frequency_penalty: Optional[float] = None
  repetition_penalty: Optional[float] = None
  min_tokens: Optional[int] = None
  logit_bias: Optional[dict[str, float]] = None  # JSON keys are strings: token ids as text
  response_format: Optional[dict[str, Any]] = None
  include_stop_str_in_output: Optional[bool] = None  # vLLM's output text options
  skip_special_tokens: Optional[bool] = None
  spaces_between_special_tokens: Optional[bool] = None
  return_tokens_as_token_ids: Optional[bool] = None
  truncate_prompt_tokens: Optional[int] = None
  bad_words: Optional[list[str]] = None  # (SamplingParams refuses them unless neutral)
  allowed_token_ids: Optional[list[int]] = None
  # vLLM's fields that would change the answer and that this engine does not have: refused unless neutral
  # (`protocol._NEUTRAL`), never silently ignored
  guided_json: Any = None
  guided_regex: Any = None
  guided_choice: Any = None
  guided_grammar: Any = None
  structured_outputs: Any = None
  use_beam_search: Any = None
  priority: Any = None
  # accepted and ignored, as vLLM does
  user: Any = None
  metadata: Any = None
  store: Any = None
  service_tier: Any = None
  parallel_tool_calls: Any = None


class CompletionRequest(_Sampling):
  # one prompt (text or token ids) or a batch of them (vLLM and OpenAI: one choice per prompt and sample)
  prompt: Optional[Union[str, list[int], list[str], list[list[int]]]] = None
  logprobs: Optional[int] = None
  echo: Optional[bool] = None
  best_of: Optional[int] = None
  suffix: Optional[str] = None


class TextPart(BaseModel):
  model_config = _STRICT
  type: Literal["text"]  # a text chat template renders text only
  text: str


class Message(BaseModel):
  model_config = _STRICT  # tool_calls and friends are kept as extras, unrendered
  role: str
  content: Union[str, list[TextPart]]
  name: Optional[str] = None


class ChatCompletionRequest(_Sampling):
  messages: Optional[list[Message]] = None
  logprobs: Optional[bool] = None
  top_logprobs: Optional[int] = None
  max_completion_tokens: Optional[int] = None
  add_generation_prompt: Optional[bool] = None
  chat_template_kwargs: Optional[dict[str, Any]] = None
  tools: Optional[list[Any]] = None
  tool_choice: Optional[Union[str, dict[str, Any]]] = None
  continue_final_message: Any = None
  chat_template: Any = None


class TokenizeRequest(BaseModel):
  model_config = _STRICT
  model: Optional[str] = None
  prompt: Optional[str] = None
  messages: Optional[list[Message]] = None
  add_special_tokens: Optional[bool] = None
  add_generation_prompt: Optional[bool] = None
  chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(BaseModel):
  model_config = _STRICT
  model: Optional[str] = None
  tokens: Optional[list[int]] = None


_FIELD_NAMES = frozenset().union(*(m.model_fields for m in (CompletionRequest, ChatCompletionRequest, Message,
                                                            TextPart, StreamOptions, TokenizeRequest,
                                                            DetokenizeRequest)))
# what a field holds, for a value that fits none of a union's members
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "logit_bias": "an object mapping token ids to numbers",
    "tool_choice": "a string or an object",
}
_TYPE_WORDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
               "string_type": "a string", "list_type": "a list", "dict_type": "an object", "model_type": "an object",
               "model_attributes_type": "an object"}


def _path(parts) -> str:
  out = ""
  for p in parts:
    out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
  return out


def _param(parts) -> str:
  """OpenAI's `param`: the path without a trailing list index (`tokens` for `tokens[3]`, `messages[0].name`)."""
  parts = list(parts)
  while parts and isinstance(parts[-1], int):
    parts.pop()
  return _path(parts)


def _value_at(body, parts):
  for p in parts:
    try:
      body = body[p]
    except (KeyError, IndexError, TypeError):
      return None
  return body


def _kept(loc) -> tuple[list, bool]:
  """The loc without pydantic's union-member tags (`'list[int]'`, `'str'`, a dict key); whether any was dropped."""
  kept, dropped = [], False
  for p in loc:
    if isinstance(p, int) or p in _FIELD_NAMES:
      kept.append(p)
    else:
      dropped = True
  return kept, dropped


def api_error(e: ValidationError, body: dict) -> APIError:
  """The first field's error as a 400: its path (`messages[0].content`), what it must be, the value (escaped and
  capped). Of a union's member errors the deepest one is reported (`messages[0].content[1].type`), else what the
  field as a whole must be."""
  errors = e.errors(include_url=False)
  if not errors:
    return APIError(400, "invalid request", None, "invalid_type")
  first = errors[0]
  if first["type"] == "extra_forbidden":  # the client's key: escaped and capped
    path = _path(first["loc"][:-1]) + "." + _cap(json.dumps(str(first["loc"][-1]))[1:-1])
    return APIError(400, f"unrecognized request argument supplied: {path}", path, "unknown_parameter")
  base, _ = _kept(first["loc"])
  candidates = [(err, *_kept(err["loc"])) for err in errors]
  candidates = [c for c in candidates if c[1][:len(base)] == base]
  # the deepest error; of equally deep ones, the union member that got furthest into the value
  err, kept, dropped = max(candidates, key=lambda c: (len(c[1]), [p if isinstance(p, int) else -1 for p in c[1]]))
  path, param = _path(kept), _param(kept)
  if err["type"] == "missing":
    return APIError(400, f"{path} is required", param, "missing_required_parameter")
  value = _value_at(body, kept)
  if dropped and len(kept) == len(base):  # no union member got deeper than the field itself
    name = next((p for p in reversed(kept) if isinstance(p, str)), path)
    expected = _EXPECTED.get(name, "of another type")
    return APIError(400, f"{path} must be {expected}, got {show(value)}", param, "invalid_type")
  words = _TYPE_WORDS.get(err["type"])
  if words is not None:
    return APIError(400, f"{path} must be {words}, got {show(value)}", param, "invalid_type")
  return APIError(400, f"{path}: {err['msg']}, got {show(value)}", param, "invalid_value")
