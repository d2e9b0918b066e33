"""OpenAI request validation: each endpoint's body parsed into what the engine needs (`GenerationRequest`, token
ids for /tokenize and /detokenize).

Requests are read as plain JSON objects and checked field by field (rather than by pydantic models) so that every
rejection names its field in an OpenAI-shaped body `{"error": {"message", "type", "param", "code"}}` with status
400, and the engine's own checks (`SamplingParams.validate`, `Engine.validate_request`) stay the single source of
truth for value ranges. Unknown fields are ignored and returned in `GenerationRequest.ignored_fields` (the app logs
them), as vLLM does: clients send vendor fields routinely. With `strict=True` they are rejected like OpenAI does
(400 naming the field), so a typo such as `max_token` is not silently ignored.

The concerns below this one live in their own modules, re-exported here (the names servers and tests import):
`errors` (APIError and how a client value is quoted), `body` (Content-Type, the hostile-input checks of the JSON
body, X-Request-Id) and `fields` (typed field readers, known and neutral-only fields, sampling fields).
"""

from __future__ import annotations

import dataclasses

from recguide_jax.engine.requests import MAX_SAMPLES, MAX_TOP_LOGPROBS, SamplingParams, seed_of_sample
from recguide_jax.server.body import (DEFAULT_MAX_BODY_BYTES, MAX_JSON_DEPTH, MAX_NUMBER_CHARS,  # noqa: F401
                                      check_content_type, parse_json, sane_request_id)
from recguide_jax.server.errors import APIError, encodable, error_body, error_type  # noqa: F401
from recguide_jax.server.errors import bad_type as _bad_type, show as _show  # noqa: F401
from recguide_jax.server.fields import (CHAT_FIELDS, COMPLETION_FIELDS, _bool, _check_fields, _int,  # noqa: F401
                                        _n, _object, _sampling, _stream_options, _validate, check_model)
from recguide_jax.text.tokenizer import Tokenizer, TokenizerError

# names a chat_template_kwargs entry may not override: the template's own inputs
_TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass
class GenerationRequest:
  """A validated request: what the engine needs plus how to shape the answer."""
  prompt_ids: list[int]
  params: SamplingParams
  stream: bool = False
  include_usage: bool = False
  chat: bool = False
  continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk
  n: int = 1  # independent samples of the same prompt (they share its prefill; streamed chunks carry `index`)
  echo: bool = False  # /v1/completions: the prompt (and with logprobs its logprobs) before each choice's text
  prompt_text: str | None = None  # the prompt as the client sent it, when it was text (what echo prepends)
  ignored_fields: tuple[str, ...] = ()  # unknown fields dropped (non-strict mode), escaped and capped for logging



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
  prompt = body["prompt"][0] if isinstance(body["prompt"], list) and len(body["prompt"]) == 1 else body["prompt"]
  logprobs = _int(body, "logprobs")
  if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
    raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs")
  echo = _bool(body, "echo", False)
  max_tokens = _int(body, "max_tokens", COMPLETION_MAX_TOKENS)
  if max_tokens == 0 and not echo:
    raise APIError(400, "max_tokens must be a positive integer (0 only with echo=true), got 0", "max_tokens")
  params = _sampling(body, max_tokens, logprobs)
  if echo and (logprobs is not None or max_tokens == 0):
    # lm-eval's loglikelihood: the prompt's logprobs, scored while it is prefilled (max_tokens 0: only them)
    params.prompt_logprobs = logprobs or 0
  stream = _bool(body, "stream", False)
  include, continuous = _stream_options(body, stream)
  params.n, params.best_of = _n(body, stream), _int(body, "best_of")
  if stream and params.best_of is not None and params.best_of != params.n:
    raise APIError(400, "best_of must equal n with stream=true (the best samples are known only at the end)",
                   "best_of", "unsupported_parameter")
  return GenerationRequest(prompt_ids, _validate(params, vocab_size), stream, include,
                           continuous_usage=continuous, n=params.n, ignored_fields=ignored, echo=echo,
                           prompt_text=prompt if isinstance(prompt, str) else None)


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
  params.n = _n(body, stream)
  return GenerationRequest(prompt_ids, _validate(params, vocab_size, renames), stream, include, chat=True,
                           continuous_usage=continuous, n=params.n, ignored_fields=ignored)


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


