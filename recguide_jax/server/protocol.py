"""OpenAI request validation: each endpoint's body parsed into what the engine needs (`GenerationRequest`, token
ids for /tokenize and /detokenize).

Bodies are validated by the pydantic models of `schema` (types, each rejection a 400 naming its field in OpenAI's
body `{"error": {"message", "type", "param", "code"}}`); the engine's own checks (`SamplingParams.validate`,
`Engine.validate_request`) stay the single source of truth for value ranges. Unknown fields are ignored and returned
in `GenerationRequest.ignored_fields` (the app logs them), as vLLM does: clients send vendor fields routinely. With
`strict=True` they are rejected like OpenAI does (400 naming the field), so a typo such as `max_token` is not
silently ignored.

Below this module: `errors` (APIError and how a client value is quoted), `body` (Content-Type, the hostile-input
checks of the JSON body before any field is read, X-Request-Id) and `schema` (the models).
"""

from __future__ import annotations

import dataclasses
import json

from pydantic import BaseModel, ValidationError

from recguide_jax.engine import requests as _requests
from recguide_jax.engine.requests import RequestError, SamplingParams
from recguide_jax.server import schema
from recguide_jax.server.errors import APIError, _cap, show as _show
from recguide_jax.text.tokenizer import Tokenizer, TokenizerError

# names a chat_template_kwargs entry may not override: the template's own inputs
_TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (each times n is an engine request)
# Fields this server accepts only at their neutral value (clients often send them explicitly); the sampling
# fields vLLM has (penalties, min_p, min_tokens, logit_bias) go to SamplingParams, which decides.
_NEUTRAL = {
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
    # vLLM's: structured output, beam search, priority scheduling, chat continuation and a request's own chat
    # template
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "chat_template"), ()),
    "use_beam_search": (False,),
    "priority": (0,),
    "continue_final_message": (False,),
}


@dataclasses.dataclass(frozen=True)
class Prompt:
  ids: list[int]
  text: str | None = None  # the prompt as the client sent it, when it was text (what echo prepends)


@dataclasses.dataclass
class GenerationRequest:
  """A validated request: what the engine needs plus how to shape the answer."""
  prompts: list[Prompt]  # one per prompt of a batch (/v1/completions); choice i * n + j is sample j of prompt i
  params: SamplingParams
  stream: bool = False
  include_usage: bool = False
  chat: bool = False
  continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk
  n: int = 1  # independent samples of each prompt (they share its prefill; streamed chunks carry `index`)
  echo: bool = False  # /v1/completions: the prompt (and with logprobs its logprobs) before each choice's text
  tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens `token_id:<id>`
  ignored_fields: tuple[str, ...] = ()  # unknown fields dropped (non-strict mode), escaped and capped for logging

  @property
  def prompt_ids(self) -> list[int]:
    """The first (for a single-prompt request: the) prompt's ids."""
    return self.prompts[0].ids

  @property
  def prompt_text(self) -> str | None:
    return self.prompts[0].text

  def for_prompt(self, i: int) -> "GenerationRequest":
    """This request restricted to its prompt i."""
    return dataclasses.replace(self, prompts=[self.prompts[i]])


# ---- the shared fields --------------------------------------------------------------------------------------------
def _object(body) -> dict:
  if not isinstance(body, dict):
    raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_type")
  return body


def _model(cls: type[BaseModel], body, strict: bool):
  """(the validated model, unknown field names escaped and capped for the log); in strict mode an unknown field is
  a 400, as OpenAI answers."""
  body = _object(body)
  known = cls.model_fields
  ignored = []
  for name in body:
    if name not in known:
      shown = _cap(json.dumps(name)[1:-1])  # the name, escaped (ensure_ascii), without quotes
      if strict:
        raise APIError(400, f"unrecognized request argument supplied: {shown}", shown, "unknown_parameter")
      ignored.append(shown)
  try:
    model = cls.model_validate(body)
  except ValidationError as e:
    raise schema.api_error(e, body) from None
  for name, neutral in _NEUTRAL.items():
    value = getattr(model, name, None)
    if value is not None and value not in neutral:
      allowed = " or ".join(_show(v) for v in (None, *neutral))
      raise APIError(400, f"{name}={_show(value)} is not supported by this server (only {allowed})", name,
                     "unsupported_parameter")
  return model, tuple(ignored[:32])  # a body with thousands of junk fields must not make a huge log line


def check_model(model: str | None, served: str) -> None:
  """`model` may be omitted (one model is served); a wrong name is a 404 like OpenAI's."""
  if model is not None and model != served:
    raise APIError(404, f"The model {_show(model)} does not exist; this server serves `{served}`", "model",
                   "model_not_found")


def _stream_options(req) -> tuple[bool, bool]:
  """(include_usage, continuous_usage_stats)."""
  opts = req.stream_options
  if opts is None:
    return False, False
  if not req.stream:
    raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
  return bool(opts.include_usage), bool(opts.continuous_usage_stats)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
  if bias is None:
    return None
  out = {}
  for key, value in bias.items():
    try:
      out[int(key)] = value
    except ValueError:
      raise APIError(400, f"logit_bias keys must be token ids, got {_show(key)}", "logit_bias",
                     "invalid_type") from None
  return out


def _sampling(req, max_tokens, logprobs, renames: dict[str, str] | None = None) -> SamplingParams:
  """The request's SamplingParams; a field SamplingParams refuses (a feature this engine lacks) is a 400 naming it."""
  kw = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
            stop=req.stop, stop_token_ids=req.stop_token_ids, logprobs=logprobs, ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_p=req.min_p, min_tokens=req.min_tokens,
            logit_bias=_logit_bias(req.logit_bias), include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens, bad_words=req.bad_words,
            allowed_token_ids=req.allowed_token_ids)
  kw = {k: v for k, v in kw.items() if v is not None}  # None: SamplingParams' default
  try:
    return SamplingParams(**kw)
  except RequestError as e:
    raise _api_error(e, renames) from None


def _api_error(e: RequestError, renames: dict[str, str] | None = None) -> APIError:
  param = (renames or {}).get(e.param, e.param)
  message = str(e).removeprefix("SamplingParams.")
  if param != e.param and message.startswith(e.param):
    message = param + message[len(e.param):]
  # a vLLM field whose feature this engine does not have (yet): SamplingParams keeps the list
  unsupported = e.param in getattr(_requests, "UNIMPLEMENTED_FIELDS", {})
  return APIError(e.code, message, param, "unsupported_parameter" if unsupported else None)


def _validate(params: SamplingParams, vocab_size: int, renames: dict[str, str] | None = None) -> SamplingParams:
  try:
    return params.validate(vocab_size)
  except RequestError as e:
    raise _api_error(e, renames) from None


def _truncated(prompt: Prompt, params: SamplingParams) -> Prompt:
  """The part of `prompt` the request uses (`truncate_prompt_tokens`): usage counts it and echo shows it (a cut
  prompt's text is its kept tokens')."""
  ids = params.truncate(prompt.ids)
  return prompt if len(ids) == len(prompt.ids) else Prompt(list(ids))


# ---- /v1/completions ----------------------------------------------------------------------------------------------
def _encode(text: str, tokenizer: Tokenizer, name: str) -> list[int]:
  try:
    return tokenizer.encode(text)
  except Exception as e:  # the text was checked to be valid Unicode; anything else the tokenizer refuses
    raise APIError(400, f"{name} cannot be tokenized: {type(e).__name__}", "prompt") from None


def _prompts(prompt, tokenizer: Tokenizer) -> list[Prompt]:
  """A prompt (text or token ids) or a batch of them (texts, or token-id lists), as vLLM and OpenAI take it."""
  if prompt is None:
    raise APIError(400, "prompt is required", "prompt", "missing_required_parameter")
  if isinstance(prompt, str):
    prompts = [Prompt(_encode(prompt, tokenizer, "prompt"), prompt)]
  elif not prompt or isinstance(prompt[0], int):
    prompts = [Prompt(list(prompt))]
  else:
    if len(prompt) > MAX_PROMPTS:
      raise APIError(400, f"prompt holds {len(prompt)} prompts, at most {MAX_PROMPTS} are allowed", "prompt")
    prompts = [Prompt(_encode(p, tokenizer, f"prompt[{i}]"), p) if isinstance(p, str) else Prompt(list(p))
               for i, p in enumerate(prompt)]
  for i, p in enumerate(prompts):
    if not p.ids:
      raise APIError(400, "prompt must not be empty" if len(prompts) == 1 else f"prompt[{i}] must not be empty",
                     "prompt")
  return prompts


def parse_completion(body, tokenizer: Tokenizer, served: str, vocab_size: int, *,
                     strict: bool = False) -> GenerationRequest:
  req, ignored = _model(schema.CompletionRequest, body, strict)
  check_model(req.model, served)
  prompts = _prompts(req.prompt, tokenizer)
  echo = bool(req.echo)
  max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_MAX_TOKENS
  if max_tokens == 0 and not echo:
    raise APIError(400, "max_tokens must be a positive integer (0 only with echo=true), got 0", "max_tokens")
  params = _sampling(req, max_tokens, req.logprobs)
  if echo and (req.logprobs is not None or max_tokens == 0):
    # lm-eval's loglikelihood: the prompt's logprobs, scored while it is prefilled (max_tokens 0: only them)
    params.prompt_logprobs = req.logprobs or 0
  include, continuous = _stream_options(req)
  params.n = req.n if req.n is not None else 1
  params.best_of = req.best_of
  stream = bool(req.stream)
  params = _validate(params, vocab_size)
  if stream and params.best_of is not None and params.best_of != params.n:
    raise APIError(400, "best_of must equal n with stream=true (the best samples are known only at the end)",
                   "best_of", "unsupported_parameter")
  return GenerationRequest([_truncated(p, params) for p in prompts], params, stream, include,
                           continuous_usage=continuous, n=params.n, ignored_fields=ignored, echo=echo,
                           tokens_as_ids=bool(req.return_tokens_as_token_ids))


# ---- /v1/chat/completions -----------------------------------------------------------------------------------------
def _messages(req) -> list[dict]:
  if req.messages is None:
    raise APIError(400, "messages is required", "messages", "missing_required_parameter")
  if not req.messages:
    raise APIError(400, "messages must not be empty", "messages")
  # content parts: only text can be rendered by a text chat template (schema.TextPart)
  return [{"role": m.role, "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
          for m in req.messages]


def _template_kwargs(req) -> dict:
  kwargs = req.chat_template_kwargs or {}
  for key in kwargs:
    if key in _TEMPLATE_RESERVED:
      raise APIError(400, f"chat_template_kwargs may not set {key} (pass it as a request field)",
                     f"chat_template_kwargs.{key}")
  return dict(kwargs)


def render_chat(req, tokenizer: Tokenizer) -> list[int]:
  """The prompt ids of a chat request (`messages`, `add_generation_prompt`, `chat_template_kwargs`; a validated
  model, or a body dict); also /tokenize's."""
  if isinstance(req, dict) or not isinstance(req, BaseModel):
    req, _ = _model(schema.ChatCompletionRequest, req, False)
  messages = _messages(req)
  add_generation_prompt = req.add_generation_prompt if req.add_generation_prompt is not None else True
  template_kwargs = _template_kwargs(req)
  try:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt, **template_kwargs))
  except TokenizerError as e:
    raise APIError(400, str(e), "messages") from None
  except Exception as e:  # a template that fails on odd but valid input is still the request's problem
    raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}", "messages") from None


def parse_chat(body, tokenizer: Tokenizer, served: str, vocab_size: int, max_model_len: int, *,
               strict: bool = False) -> GenerationRequest:
  req, ignored = _model(schema.ChatCompletionRequest, body, strict)
  check_model(req.model, served)
  prompt_ids = render_chat(req, tokenizer)
  if not prompt_ids:
    raise APIError(400, "the chat template rendered an empty prompt", "messages")
  want_logprobs, top = bool(req.logprobs), req.top_logprobs
  if top is not None and not want_logprobs:
    raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
  renames = {"logprobs": "top_logprobs"}
  max_tokens = req.max_completion_tokens
  if max_tokens is not None:
    renames["max_tokens"] = "max_completion_tokens"
  else:
    max_tokens = req.max_tokens

  def rest_of_context(ids):  # like vLLM, max_tokens by default
    return max(max_model_len - len(ids), 1)

  params = _sampling(req, rest_of_context(prompt_ids) if max_tokens is None else max_tokens,
                     (top or 0) if want_logprobs else None, renames)
  include, continuous = _stream_options(req)
  params.n = req.n if req.n is not None else 1
  params = _validate(params, vocab_size, renames)
  prompt = _truncated(Prompt(prompt_ids), params)
  if max_tokens is None:  # (a truncated prompt leaves more of it)
    params.max_tokens = rest_of_context(prompt.ids)
  return GenerationRequest([prompt], params, bool(req.stream), include, chat=True, continuous_usage=continuous,
                           n=params.n, ignored_fields=ignored, tokens_as_ids=bool(req.return_tokens_as_token_ids))


# ---- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------------------------------
def parse_tokenize(body, tokenizer: Tokenizer, served: str, *, strict: bool = False) -> list[int]:
  """`{"prompt": text}` or `{"messages": [...]}` (rendered by the chat template) -> the prompt's token ids."""
  req, _ = _model(schema.TokenizeRequest, body, strict)
  check_model(req.model, served)
  if req.prompt is None and req.messages is None:
    raise APIError(400, "prompt or messages is required", "prompt", "missing_required_parameter")
  if req.prompt is not None and req.messages is not None:
    raise APIError(400, "pass one of prompt or messages, not both", "messages")
  if req.messages is not None:
    return render_chat(req, tokenizer)
  try:
    return tokenizer.encode(req.prompt, add_special_tokens=bool(req.add_special_tokens))
  except Exception as e:
    raise APIError(400, f"prompt cannot be tokenized: {type(e).__name__}", "prompt") from None


def parse_detokenize(body, served: str, vocab_size: int, *, strict: bool = False) -> list[int]:
  """`{"tokens": [ids]}` -> the ids, each in [0, vocab_size)."""
  req, _ = _model(schema.DetokenizeRequest, body, strict)
  check_model(req.model, served)
  if req.tokens is None:
    raise APIError(400, "tokens is required", "tokens", "missing_required_parameter")
  for i, t in enumerate(req.tokens):
    if not 0 <= t < vocab_size:
      raise APIError(400, f"tokens[{i}]={_show(t)} is not a token id of this model (vocabulary of {vocab_size})",
                     "tokens")
  return req.tokens
