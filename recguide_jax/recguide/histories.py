"""RecGuide's per-request verification histories as arrays, a row per request (`RecGuideState.row`): a step reads its
requests' value-grid rows and cold-start flags as gathers over their rows, and a round writes its verifications as
one scatter, not as a Python loop over requests (vLLM's persistent batch, for the strategy's own per-request state).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide.config import HISTORY
from recguide_jax.recguide.signals import RoundRecord


class Histories:
  """The last `HISTORY` verification rounds of each row's request, the latest in the last column (block 0: none),
  and what is derived from them: the value model's grid row (-1 until read since the history last changed) and
  the tail of AR rounds. Rows are handed out and taken back as requests join and leave (`RecGuideState`)."""

  def __init__(self, capacity: int = 64):
    self.block = np.zeros((capacity, HISTORY), np.int64)
    self.accepted = np.zeros((capacity, HISTORY), np.int64)
    self.entropy = np.full((capacity, HISTORY), np.nan)  # NaN: the round had no entropy (an AR round, or none valid)
    self.count = np.zeros(capacity, np.int64)  # rounds held (at most HISTORY)
    # trailing AR rounds (at HISTORY the history is all AR records, and more AR rounds leave it as it is)
    self.ar_tail = np.zeros(capacity, np.int64)
    self.grid_row = np.full(capacity, -1, np.int64)
    self.grid_model: Any = None  # the value model `grid_row` indexes the grid of
    # a branch block a request's last overlap round confirmed: its next overlap round's draft (for that round only)
    self.prefetched: dict[int, Any] = {}
    self._free = list(range(capacity - 1, -1, -1))

  @property
  def capacity(self) -> int:
    return len(self.count)

  @property
  def in_use(self) -> int:
    """Rows held by requests."""
    return self.capacity - len(self._free)

  def allocate(self, records: Sequence[RoundRecord] = ()) -> int:
    """A free row holding `records` (the last HISTORY of them)."""
    if not self._free:
      self._grow()
    row = self._free.pop()
    self.set_records(row, records)
    return row

  def release(self, row: int) -> None:
    self.prefetched.pop(row, None)
    self._free.append(row)

  def drop_prefetched(self, rows: np.ndarray) -> None:
    """Drops the branches `rows` hold (a verification moves a request past its branch's round)."""
    if self.prefetched:
      for row in np.intersect1d(rows, np.fromiter(self.prefetched, np.int64, len(self.prefetched))).tolist():
        del self.prefetched[row]

  def held_lengths(self, rows: np.ndarray) -> np.ndarray:
    """The length of the branch each of `rows` holds (0: none)."""
    lengths = np.zeros(self.capacity, np.int64)
    for row, branch in self.prefetched.items():
      lengths[row] = len(branch.tokens)
    return lengths[rows]

  def _grow(self) -> None:
    old = self.capacity
    for name in ("block", "accepted", "entropy", "count", "ar_tail", "grid_row"):
      a = getattr(self, name)
      fill = np.nan if name == "entropy" else -1 if name == "grid_row" else 0
      setattr(self, name, np.concatenate([a, np.full_like(a, fill)]))
    self._free.extend(range(2 * old - 1, old - 1, -1))

  def set_records(self, row: int, records: Sequence[RoundRecord]) -> None:
    """Row `row` holds `records` (the last HISTORY of them) from now on."""
    records = [RoundRecord(*r) for r in records][-HISTORY:]
    k = len(records)
    self.block[row], self.accepted[row], self.entropy[row] = 0, 0, np.nan
    if k:
      self.block[row, HISTORY - k:] = [r.block_size for r in records]
      self.accepted[row, HISTORY - k:] = [r.accepted for r in records]
      self.entropy[row, HISTORY - k:] = [np.nan if r.entropy is None else r.entropy for r in records]
    self.count[row] = k
    tail = 0
    while tail < k and records[k - 1 - tail].block_size <= 1:
      tail += 1
    self.ar_tail[row], self.grid_row[row] = tail, -1

  def records(self, row: int) -> list[RoundRecord]:
    """Row `row`'s history, oldest first."""
    k = int(self.count[row])
    if not k:
      return []
    return [RoundRecord(b, a, None if e != e else e) for b, a, e in  # (e != e: NaN)
            zip(self.block[row, -k:].tolist(), self.accepted[row, -k:].tolist(), self.entropy[row, -k:].tolist())]

  def append(self, rows: np.ndarray, blocks, accepted, entropy, times: int = 1) -> None:
    """`times` rounds of (`blocks`, `accepted`, `entropy`: one each per row, or one for all) for each of `rows`
    (distinct rows)."""
    t = min(times, HISTORY)
    if not len(rows) or t <= 0:
      return
    for name, value in (("block", blocks), ("accepted", accepted), ("entropy", entropy)):
      a = getattr(self, name)
      if t < HISTORY:
        a[rows, :HISTORY - t] = a[rows, t:]
      a[rows, HISTORY - t:] = np.asarray(value)[..., None] if np.ndim(value) else value
    self.count[rows] = np.minimum(self.count[rows] + t, HISTORY)
    self.ar_tail[rows] = np.where(np.asarray(blocks) <= 1, self.ar_tail[rows] + t, 0)
    self.grid_row[rows] = -1

  def grid_rows(self, rows: np.ndarray, model) -> np.ndarray:
    """Each of `rows`' row of `model.grid` (`ValueModel.grid_rows`): s from its last `model.window` entropies
    (`signals.signal_s`), z from its last round (`signals.stratum`); neither before its first round. Kept until
    the row's history next changes; the rows that changed are computed together."""
    if model is not self.grid_model:
      self.grid_row[:] = -1
      self.grid_model = model
    at = self.grid_row[rows]
    stale = np.flatnonzero(at < 0)
    if len(stale):
      moved = rows[stale]
      at[stale] = self.grid_row[moved] = self._grid_rows(moved, model)
    return at

  def _grid_rows(self, rows: np.ndarray, model) -> np.ndarray:
    entropies = self.entropy[rows, HISTORY - min(model.window, HISTORY):]
    present = ~np.isnan(entropies)
    counts = present.sum(axis=1)
    # `signal_s`: minus the mean of the entropies there are (summed in order: a missing one's zero adds nothing)
    s = np.where(counts > 0, -(np.where(present, entropies, 0.0).sum(axis=1) / np.maximum(counts, 1)), np.nan)
    blocks, accepted = self.block[rows, -1], self.accepted[rows, -1]  # the last round (block 0: none yet)
    sizes = np.asarray(BLOCK_SIZES)
    known = (blocks[:, None] == sizes[None, :]).any(axis=1)
    strata = np.where(known, 2 * np.searchsorted(sizes, blocks) + (accepted >= blocks), -1)  # `signals.STRATA`
    return model.grid_rows(s, strata)
