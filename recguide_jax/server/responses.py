"""OpenAI-shaped response bodies and stream chunks.

Every body carries the OpenAI fields; `speculation` (the request's RequestStats) sits next to `usage` as an
extension that OpenAI clients keep as an extra attribute.
"""

from __future__ import annotations

import json
import math
from typing import Sequence

from recguide_jax.text.tokenizer import Tokenizer

# JSON has no -inf; vLLM clamps the same way
_MIN_LOGPROB = -9999.0


def sse(obj) -> str:
  return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def _lp(x: float) -> float:
  return float(x) if math.isfinite(x) else _MIN_LOGPROB


def _id_name(token_id: int) -> str:
  """vLLM's name of a token by its id, exact whatever its text."""
  return f"token_id:{token_id}"


def _token(tokenizer: Tokenizer, token_id: int, as_ids: bool = False) -> str:
  """A token's name in logprobs: its text, or with `as_ids` (vLLM's return_tokens_as_token_ids) `_id_name`."""
  return _id_name(token_id) if as_ids else tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[dict], offset: int, as_ids: bool = False
                        ) -> tuple[dict, int]:
  """Legacy completions format; returns it and the text offset after these tokens (`as_ids`: `_token`)."""
  tokens, token_lps, tops, offsets = [], [], [], []
  for e in entries:
    tok = _token(tokenizer, e["token_id"], as_ids)
    tokens.append(tok)
    token_lps.append(_lp(e["logprob"]))
    offsets.append(offset)
    offset += len(tok)
    top = e.get("top_logprobs")
    tops.append((_top_by_id(top) if as_ids else _top_by_text(tokenizer, top)) if top else None)
  return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def echoed_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: Sequence[int], entries: Sequence[dict | None],
                           as_ids: bool = False) -> tuple[dict, int]:
  """The prompt's part of an echoed completion's logprobs (legacy format, as OpenAI and vLLM send it): every prompt
  token with its logprob given the ones before it, the first one's logprob and top entries null. Returns it and
  the text offset after the prompt."""
  first, offset = completion_logprobs(tokenizer, [{"token_id": prompt_ids[0], "logprob": 0.0}], 0, as_ids)
  first["token_logprobs"], first["top_logprobs"] = [None], [None]
  rest, offset = completion_logprobs(tokenizer, [e for e in entries[1:] if e is not None], offset, as_ids)
  return join_logprobs(first, rest), offset


def join_logprobs(a: dict | None, b: dict | None) -> dict | None:
  """Two runs of legacy-format logprobs, one after the other."""
  if a is None or b is None:
    return a if b is None else b
  return {k: list(a[k]) + list(b[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _top_by_text(tokenizer: Tokenizer, top: dict) -> dict:
  """The legacy format keys the top logprobs by token text, but two ids can decode to the same text (byte tokens
  of an incomplete UTF-8 character both decode to U+FFFD): a later one is keyed by its vocabulary piece, else by
  `token_id:<id>` (vLLM's spelling), so no entry is lost. Entries come in rank order, so the top one keeps its
  text."""
  out = {}
  for t, v in top.items():
    key = _token(tokenizer, t)
    if key in out:
      key = tokenizer.id_to_token(t) or ""
      if not key or key in out:
        key = _id_name(t)
    out[key] = _lp(v)
  return out


def _top_by_id(top: dict) -> dict:
  return {_id_name(t): _lp(v) for t, v in top.items()}


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[dict], as_ids: bool = False) -> dict:

  def item(token_id, logprob):
    tok = _token(tokenizer, token_id, as_ids)
    return {"token": tok, "logprob": _lp(logprob), "bytes": list(tok.encode("utf-8"))}

  content = []
  for e in entries:
    entry = item(e["token_id"], e["logprob"])
    entry["top_logprobs"] = [item(t, v) for t, v in (e.get("top_logprobs") or {}).items()]
    content.append(entry)
  return {"content": content}


def completion(rid: str, created: int, model: str, text: str, finish_reason: str, logprobs, use: dict,
               speculation: dict, stop_reason: int | str | None = None) -> dict:
  return {"id": rid, "object": "text_completion", "created": created, "model": model,
          "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                       "stop_reason": stop_reason}],
          "usage": use, "speculation": speculation}


def chat(rid: str, created: int, model: str, text: str, finish_reason: str, logprobs, use: dict,
         speculation: dict, stop_reason: int | str | None = None) -> dict:
  return {"id": rid, "object": "chat.completion", "created": created, "model": model,
          "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                       "finish_reason": finish_reason, "stop_reason": stop_reason}],
          "usage": use, "speculation": speculation}


def chunk(chat_kind: bool, rid: str, created: int, model: str, text: str | None, *, role: bool = False,
          finish_reason: str | None = None, logprobs=None, include_usage: bool = False,
          usage_so_far: dict | None = None, index: int = 0, stop_reason: int | str | None = None) -> dict:
  """One stream chunk of choice `index`. `role` marks the first chat chunk; with include_usage every chunk has `usage: null`,
  as OpenAI does, and a last chunk with empty choices carries the usage. `usage_so_far` (vLLM's
  stream_options.continuous_usage_stats) puts the usage up to this chunk in it instead."""
  if chat_kind:
    delta = {"role": "assistant"} if role else {}
    if text is not None:
      delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    obj = "chat.completion.chunk"
  else:
    choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    obj = "text_completion"
  out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
  if usage_so_far is not None:
    out["usage"] = usage_so_far
  elif include_usage:
    out["usage"] = None
  return out


def usage_chunk(chat_kind: bool, rid: str, created: int, model: str, use: dict, speculation: dict) -> dict:
  return {"id": rid, "object": "chat.completion.chunk" if chat_kind else "text_completion", "created": created,
          "model": model, "choices": [], "usage": use, "speculation": speculation}
