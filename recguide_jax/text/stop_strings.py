"""Stop strings, checked incrementally: the one rule the engine (which cuts a request's output at the earliest stop
string) and the streaming layer (which must not send text a stop string may still cut) share.

Text only grows, and the text before the last check held no stop string, so a new match must end in the new tail:
each check searches only the new text plus the `longest - 1` characters before it. The work per check is
O((new + longest) * stops), so a whole output costs O(length * stops), not O(length^2).
"""

from __future__ import annotations

from typing import Sequence


class StopChecker:
  """Finds the earliest stop string in a growing text. `scanned` counts the characters searched (per stop string),
  the work a test can bound."""

  def __init__(self, stop_strings: Sequence[str]):
    self.stops = tuple(s for s in stop_strings if s)
    self.longest = max((len(s) for s in self.stops), default=0)
    self.checked = 0  # text[:checked] has been searched (holds no stop string)
    self.scanned = 0

  def __bool__(self) -> bool:
    return bool(self.stops)

  def find(self, text: str) -> int | None:
    """Index where the earliest stop string starts in `text` (which extends the text of the previous call), or
    None. After a hit the checker has done its job: later calls search from where this one stopped."""
    if not self.stops:
      return None
    lo = max(0, self.checked - self.longest + 1)
    window = text[lo:]
    self.scanned += len(window) * len(self.stops)
    hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
    self.checked = len(text)
    return lo + min(hits) if hits else None

  def stop_at(self, text: str, pos: int) -> str:
    """The stop string `find` found at `pos` (the first listed, if several start there)."""
    return next(s for s in self.stops if text.startswith(s, pos))

  def end_of_stop(self, text: str, pos: int, include: bool) -> int:
    """Where a text that a stop string at `pos` ends is cut: before it, or after it with `include`
    (`SamplingParams.include_stop_str_in_output`)."""
    return pos + len(self.stop_at(text, pos)) if include else pos

  def held_back(self, text: str) -> int:
    """Characters at the end of `text` that are a proper prefix of a stop string: they may still become one, so a
    stream must not send them yet. O(longest^2 * stops), independent of the text's length."""
    held = 0
    for s in self.stops:
      for k in range(min(len(s) - 1, len(text)), held, -1):
        if text.endswith(s[:k]):
          held = k
          break
    return held
