"""Incremental detokenization for streamed responses.

The streamed text must concatenate to exactly the non-streamed text, so deltas are cut from a decode of the whole
output so far (decoding token by token breaks multi-byte characters and merges), and a tail is held back while it
could still change or be cut:
- a decode ending in U+FFFD may be an incomplete UTF-8 sequence that the next token completes;
- text that is, or could grow into, a stop string is dropped by the engine when the stop string completes, so it
  is not sent before the request finishes.
"""

from __future__ import annotations

from typing import Sequence

from recguide_jax.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


def stop_position(text: str, stop_strings: Sequence[str]) -> int | None:
  """Index where the earliest stop string starts in `text`, or None."""
  hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
  return min(hits) if hits else None


def final_text(tokenizer: Tokenizer, emitted_ids: Sequence[int], stop_strings: Sequence[str]) -> str:
  """The text of a finished request, from every token the engine emitted (before it cut the ids at a stop string).

  Same rule as the engine's stop check (decode, cut before the earliest stop string), recomputed from all emitted
  ids so the streamed and the non-streamed answers come from one definition.
  """
  text = tokenizer.decode(emitted_ids)
  pos = stop_position(text, stop_strings)
  return text if pos is None else text[:pos]


class TextDeltas:
  """Turns the growing list of emitted token ids into text deltas that never need to be taken back."""

  def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = ()):
    self.tokenizer = tokenizer
    self.stop_strings = [s for s in stop_strings if s]
    self.sent = ""

  def _safe_end(self, text: str) -> int:
    # the pending bytes behind a trailing U+FFFD may complete a character that continues a stop string, so the
    # stop-string checks look at the text without it
    text = text.rstrip(REPLACEMENT_CHAR)
    end = len(text)
    pos = stop_position(text, self.stop_strings)
    if pos is not None:
      end = pos
    for s in self.stop_strings:  # a tail that is a proper prefix of a stop string may still become one
      for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
          end = min(end, len(text) - k)
          break
    return end

  def update(self, emitted_ids: Sequence[int]) -> str:
    """New text that is safe to send while the request is still running."""
    text = self.tokenizer.decode(emitted_ids)
    if not text.startswith(self.sent):
      return ""  # the decoder rewrote earlier text (never for byte-level BPE): wait for the final text
    end = self._safe_end(text)
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
