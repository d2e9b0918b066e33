"""Incremental detokenization for streamed responses.

The streamed text must concatenate to exactly the non-streamed text. The emitted tokens are decoded incrementally
(`tokenizer.IncrementalDetokenizer`: a short window per token, an incomplete UTF-8 character held back until the
token that completes it), and stop strings are checked by the engine's own `stop_strings.StopChecker`, so a tail
is held back while it could still change or be cut: text that is, or could grow into, a stop string is dropped by
the engine when the stop string completes, so it is not sent before the request finishes. Each update costs the
new tokens and the longest stop string, not the whole output.
"""

from __future__ import annotations

from typing import Sequence

from recguide_jax.text.stop_strings import StopChecker
from recguide_jax.text.tokenizer import IncrementalDetokenizer, Tokenizer


def stop_position(text: str, stop_strings: Sequence[str]) -> int | None:
  """Index where the earliest stop string starts in `text`, or None."""
  return StopChecker(stop_strings).find(text)


class TextDeltas:
  """Turns the growing list of emitted token ids into text deltas that never need to be taken back."""

  def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = (), include_stop_str: bool = False,
               skip_special_tokens: bool = True):
    self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    self.stops = StopChecker(stop_strings)
    self.include_stop_str = include_stop_str
    self.sent = ""
    self._stop_end: int | None = None  # where the text ends, once a stop string has completed

  @classmethod
  def for_params(cls, tokenizer: Tokenizer, params) -> "TextDeltas":
    """The deltas of a request with `SamplingParams` `params` (its stop strings and output text options)."""
    return cls(tokenizer, params.stop_strings, params.include_stop_str_in_output, params.skip_special_tokens)

  def update(self, emitted_ids: Sequence[int]) -> str:
    """New text that is safe to send while the request is still running (`emitted_ids`: every token emitted so
    far; only those past the previous call are decoded)."""
    self.detokenizer.add(emitted_ids[len(self.detokenizer.ids):])
    text = self.detokenizer.text
    if self._stop_end is None:
      pos = self.stops.find(text)
      if pos is not None:
        self._stop_end = self.stops.end_of_stop(text, pos, self.include_stop_str)
    end = len(text) - self.stops.held_back(text) if self._stop_end is None else self._stop_end
    if end <= len(self.sent):
      return ""
    delta = text[len(self.sent):end]
    self.sent += delta
    return delta

  def finish(self, text: str) -> str:
    """The rest of the final text. Raises if an earlier delta is not a prefix of it (a bug, not a client error)."""
    if not text.startswith(self.sent):
      raise RuntimeError(f"streamed text {self.sent!r} is not a prefix of the final text {text!r}")
    delta = text[len(self.sent):]
    self.sent = text
    return delta
