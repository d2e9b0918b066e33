"""Each running request's decode books, kept as arrays by its page-table row and written to its `RequestStats` when
it finishes.

A decode round adds to every row of its batch: rounds, forwards per kind, drafted and accepted tokens, and one entry
per round to the accepted-length and block-size histories. Kept in `Request.stats` that is a dozen Python objects
touched per request per step (a 4-step AR call extends two lists by four entries each); here it is a few array
updates per batch, and a request's lists are built once, at its end.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from recguide_jax.engine.requests import RequestStats


class DecodeBooks:
  """Decode-round counters and histories by page-table row (`PageAllocator.table_rows`). A row's books are empty
  while no request holds it: `close` writes them to the finishing request's stats and clears them."""

  def __init__(self):
    self.draft_tokens = np.zeros((0,), np.int64)
    self.accepted_draft_tokens = np.zeros((0,), np.int64)
    self.forwards: dict[str, np.ndarray] = {}  # kind -> [rows]
    self.history_len = np.zeros((0,), np.int64)  # entries of each row's histories: its rounds
    self.accepted = np.zeros((0, 0), np.int32)  # [rows, H] each round's accepted tokens
    self.blocks = np.zeros((0, 0), np.int32)  # [rows, H] each round's block size

  def _grow_rows(self, rows: int) -> None:
    new = max(rows, 2 * len(self.history_len), 8)
    pad = lambda a: np.concatenate([a, np.zeros((new - len(a),) + a.shape[1:], a.dtype)])
    self.draft_tokens, self.accepted_draft_tokens, self.history_len = map(
        pad, (self.draft_tokens, self.accepted_draft_tokens, self.history_len))
    self.accepted, self.blocks = pad(self.accepted), pad(self.blocks)
    self.forwards = {k: pad(v) for k, v in self.forwards.items()}

  def _grow_history(self, width: int) -> None:
    new = max(width, 2 * self.accepted.shape[1], 64)
    widen = lambda a: np.concatenate([a, np.zeros((len(a), new - a.shape[1]), a.dtype)], axis=1)
    self.accepted, self.blocks = widen(self.accepted), widen(self.blocks)

  def record(self, rows: np.ndarray, block: np.ndarray, accepted: np.ndarray, rounds: int,
             row_forwards: Mapping[str, np.ndarray], speculative: np.ndarray) -> None:
    """One applied round output for the table rows `rows` (distinct): each ran `rounds` rounds at `block` with
    `accepted` tokens each (`speculative`: its rounds verified drafts), and `row_forwards[kind]` forwards."""
    if not len(rows):
      return
    if int(rows.max()) >= len(self.history_len):
      self._grow_rows(int(rows.max()) + 1)
    start = self.history_len[rows]
    end = start + rounds
    if int(end.max()) > self.accepted.shape[1]:
      self._grow_history(int(end.max()))
    for kind, counts in row_forwards.items():
      if kind not in self.forwards:
        self.forwards[kind] = np.zeros_like(self.history_len)
      self.forwards[kind][rows] += counts
    if speculative.any():
      self.draft_tokens[rows] += np.where(speculative, block - 1, 0)
      self.accepted_draft_tokens[rows] += np.where(speculative, accepted - 1, 0)
    if rounds == 1:
      self.accepted[rows, start] = accepted
      self.blocks[rows, start] = block
    else:
      cols = start[:, None] + np.arange(rounds)
      self.accepted[rows[:, None], cols] = accepted[:, None]
      self.blocks[rows[:, None], cols] = block[:, None]
    self.history_len[rows] = end

  def close(self, row: int, stats: RequestStats) -> None:
    """Adds row `row`'s books to `stats` and clears them (its request finished)."""
    if row >= len(self.history_len):
      return
    n = int(self.history_len[row])
    stats.rounds += n
    stats.accepted_lengths.extend(self.accepted[row, :n].tolist())
    stats.block_sizes.extend(self.blocks[row, :n].tolist())
    stats.draft_tokens += int(self.draft_tokens[row])
    stats.accepted_draft_tokens += int(self.accepted_draft_tokens[row])
    for kind, counts in self.forwards.items():
      if counts[row]:
        stats.forwards[kind] = stats.forwards.get(kind, 0) + int(counts[row])
        counts[row] = 0
    for a in (self.draft_tokens, self.accepted_draft_tokens, self.history_len):
      a[row] = 0
