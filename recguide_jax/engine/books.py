"""Each running request's decode books, kept as arrays by its page-table row and written to its `RequestStats` when
it finishes.

A decode round adds to every row of its batch: rounds, forwards per kind, drafted and accepted tokens, and one entry
per round to the accepted-length and block-size histories. Kept in `Request.stats` that is a dozen Python objects
touched per request per step (a 4-step AR call extends two lists by four entries each); here it is a few array
updates per batch, and a request's lists are built once, at its end.

The engine-wide draft counters (`RoundTally`) are kept the same way: a round's row arrays, folded when read.
"""

from __future__ import annotations

import collections
import threading
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

  def count_forwards(self, rows: np.ndarray, row_forwards: Mapping[str, np.ndarray]) -> None:
    """`row_forwards[kind]` more forwards of each of the table rows `rows` (distinct)."""
    if not len(rows):
      return
    if int(rows.max()) >= len(self.history_len):
      self._grow_rows(int(rows.max()) + 1)
    for kind, counts in row_forwards.items():
      if kind not in self.forwards:
        self.forwards[kind] = np.zeros_like(self.history_len)
      self.forwards[kind][rows] += counts

  def _grow_history(self, width: int) -> None:
    new = max(width, 2 * self.accepted.shape[1], 64)
    widen = lambda a: np.concatenate([a, np.zeros((len(a), new - a.shape[1]), a.dtype)], axis=1)
    self.accepted, self.blocks = widen(self.accepted), widen(self.blocks)

  def record(self, rows: np.ndarray, block: np.ndarray, accepted: np.ndarray, rounds: int,
             row_forwards: Mapping[str, np.ndarray], speculative: np.ndarray | None,
             verified: np.ndarray | None = None) -> None:
    """One applied round output for the table rows `rows` (distinct): each ran `rounds` rounds at `block` with
    `accepted` tokens each (`speculative`: the rows whose rounds verified drafts; None: none did; `verified`: the
    tokens their verifies ran, the drafts offered + 1, where a verify was truncated), and `row_forwards[kind]`
    forwards."""
    if not len(rows):
      return
    if int(rows.max()) >= len(self.history_len):
      self._grow_rows(int(rows.max()) + 1)
    start = self.history_len[rows]
    end = start + rounds
    if int(end.max()) > self.accepted.shape[1]:
      self._grow_history(int(end.max()))
    self.count_forwards(rows, row_forwards)
    if speculative is not None and speculative.any():
      self.draft_tokens[rows] += np.where(speculative, (block if verified is None else verified) - 1, 0)
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


class RoundTally:
  """The engine-wide round counters: verified drafts, draft and accepted draft tokens (vLLM's spec_decode_num_*),
  accepted tokens per block position and the block sizes run. A step keeps its rounds' row arrays; they are folded
  into the counters when these are read, or every `fold_every` rounds, over all of them at once (per step, a list
  append instead of a dozen small array operations)."""

  def __init__(self, totals: collections.Counter, fold_every: int = 64):
    self.totals = totals  # the engine's counters: "drafts", "draft_tokens", "accepted_draft_tokens" are added here
    self.per_position = collections.Counter()  # block position -> drafts accepted at least that far
    self.block_sizes = collections.Counter()  # block size -> request rounds run at it
    self.fold_every = fold_every
    self._runs: list[tuple[np.ndarray, int]] = []  # (each row's block, rounds)
    self._verified: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (block, accepted, which rows verified)
    self._folding = threading.Lock()  # a metrics scrape folds on its own thread, beside the engine's

  def add(self, block: np.ndarray, accepted: np.ndarray, rounds: int, speculative: np.ndarray | None,
          verified: np.ndarray | None = None) -> None:
    """One applied round output's rows (arrays the caller no longer changes): each ran `rounds` rounds at `block`,
    and the `speculative` ones verified `verified` tokens (default `block`: a truncated verify offers fewer
    drafts) and accepted `accepted` of them."""
    self._runs.append((block, rounds))
    if speculative is not None:
      self._verified.append((block if verified is None else verified, accepted, speculative))
    if len(self._runs) >= self.fold_every:
      self.fold()

  def fold(self) -> None:
    """Adds the rounds kept since the last fold to the counters."""
    if not self._runs:
      return
    with self._folding:
      runs, verified, self._runs, self._verified = self._runs, self._verified, [], []
      if runs:
        self._fold(runs, verified)

  def _fold(self, runs: list, verified: list) -> None:
    block = np.concatenate([b for b, _ in runs])
    rounds = np.repeat([r for _, r in runs], [len(b) for b, _ in runs])
    choices = np.bincount(block, weights=rounds)
    for blk in np.flatnonzero(choices).tolist():
      self.block_sizes[blk] += int(choices[blk])
    if not verified:
      return
    block, accepted, speculative = (np.concatenate(a) for a in zip(*verified))
    block, accepted = block[speculative], accepted[speculative]
    if not len(block):
      return
    self.totals["drafts"] += len(block)  # verified drafts (vLLM's spec_decode_num_drafts)
    self.totals["draft_tokens"] += int(block.sum()) - len(block)
    self.totals["accepted_draft_tokens"] += int(accepted.sum()) - len(accepted)
    per_pos = np.bincount(accepted - 1)  # rows that accepted exactly k draft tokens
    reach = np.cumsum(per_pos[::-1])[::-1]  # rows that accepted at least k
    for pos, count in enumerate(reach[1:].tolist(), 1):
      self.per_position[pos] += count
