"""Emission: a round's tokens appended to a request, with its stop conditions (EOS, stop token ids, max_tokens,
stop strings) and logprobs.

Stop strings are checked incrementally (`stop_strings.StopChecker` over an `IncrementalDetokenizer`): a round's
new tokens are decoded in a short window and only the new tail is searched, so the check is linear in the output's
length. On a hit the output keeps the shortest token prefix whose text reaches the stop string, and the text is cut
before it, or, with `include_stop_str_in_output`, the prefix whose text holds it and the text cut after it (the
streaming layer applies the same checker to what it sends).
"""

from __future__ import annotations

import dataclasses

from recguide_jax.engine.requests import Request
from recguide_jax.text.stop_strings import StopChecker
from recguide_jax.text.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class StopText:
  """A request's output text so far and its stop-string checker (only for requests with stop strings)."""
  detokenizer: IncrementalDetokenizer
  checker: StopChecker


def append_tokens(r: Request, toks: list[int], lps, top_lp, top_ids, eos: frozenset[int],
                  tokenizer) -> tuple[list[int], str | None]:
  """Appends a round's tokens to `r` up to its first stop condition; returns (the tokens kept of this round, the
  finish reason or None). May cut tokens of earlier rounds' output too when a stop string completes late (the
  returned list then is what is left of this round's)."""
  eos = frozenset() if r.params.ignore_eos else eos
  stop_ids = set(r.params.stop_token_ids or ())
  # vLLM's min_tokens: no stop condition but max_tokens ends the output before it holds min_tokens tokens (the
  # sampler holds EOS and the stop ids back until then; this guards the host's side)
  min_tokens = r.params.min_tokens or 0
  new: list[int] = []
  reason = None
  for k, t in enumerate(toks):
    new.append(t)
    r.token_logprobs.append(float(lps[k]))
    if r.params.logprobs is not None:
      entry = {"token_id": t, "logprob": float(lps[k])}
      if r.params.logprobs and top_lp is not None:
        entry["top_logprobs"] = {int(top_ids[k][j]): float(top_lp[k][j]) for j in range(r.params.logprobs)}
      r.logprobs.append(entry)
    if (t in eos or t in stop_ids) and len(r.output_ids) + len(new) >= min_tokens:
      reason = "stop"
      r.stop_reason = None if t in eos else t  # vLLM's: an EOS token is no stop reason
      break
    if len(r.output_ids) + len(new) >= r.params.max_tokens:
      reason = "length"
      break
  r.output_ids.extend(new)
  if r.params.stop_strings and tokenizer is not None:
    if r.stop_text is None:
      r.stop_text = StopText(IncrementalDetokenizer(tokenizer, r.params.skip_special_tokens),
                             StopChecker(r.params.stop_strings))
    st = r.stop_text
    early = max(0, min(len(new), min_tokens - (len(r.output_ids) - len(new))))
    if early:  # text of the first min_tokens tokens is searched (so never again) but cannot stop, as in vLLM
      st.detokenizer.add(new[:early])
      st.checker.find(st.detokenizer.text)
    st.detokenizer.add(new[early:])
    pos = st.checker.find(st.detokenizer.text) if early < len(new) else None
    if pos is not None:
      text = st.detokenizer.text
      end = st.checker.end_of_stop(text, pos, r.params.include_stop_str_in_output)
      n = st.detokenizer.tokens_reaching(end - 1 if r.params.include_stop_str_in_output else pos)
      cut = len(r.output_ids) - n
      del r.output_ids[n:]
      del r.logprobs[n:]
      del r.token_logprobs[n:]
      if cut:
        new = new[:max(len(new) - cut, 0)]
      r.text = text[:end]
      reason = "stop"
      r.stop_reason = st.checker.stop_at(text, pos)
  return new, reason


def plain(r: Request, tokenizer) -> bool:
  """Whether `r`'s emission needs no per-token work beyond its EOS and budget (the engine checks those over the
  batch): no logprobs entries, no stop token ids of its own, no stop strings to search."""
  p = r.params
  return p.logprobs is None and not p.stop_token_ids and not (p.stop and tokenizer is not None)


def append_prompt_logprobs(r: Request, lps, top_lp, top_ids, num_valid: int, start: int) -> None:
  """Appends a scored prompt chunk's entries to `r.prompt_logprobs` (vLLM's layout: None for the first prompt
  token, then one entry per prompt token with its logprob given the ones before it and the top
  `params.prompt_logprobs` entries). `lps[t]` scores the prompt token after chunk position t (prompt position
  `start` + t)."""
  if r.prompt_logprobs is None:
    r.prompt_logprobs = [None]
  top = r.params.prompt_logprobs
  for t in range(num_valid):
    pos = start + t + 1
    if pos >= len(r.prompt_ids):
      break
    entry = {"token_id": int(r.prompt_ids[pos]), "logprob": float(lps[t])}
    if top:
      entry["top_logprobs"] = {int(top_ids[t][j]): float(top_lp[t][j]) for j in range(top)}
    r.prompt_logprobs.append(entry)


def final_text(r: Request, tokenizer) -> str:
  """The text of a finished request (already set when a stop string cut it)."""
  if r.text is not None:
    return r.text
  return tokenizer.decode(r.output_ids, r.params.skip_special_tokens) if tokenizer is not None else ""
