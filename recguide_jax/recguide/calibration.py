"""Online calibration of the switch's cost model with the engine's own wall clock.

A hardware profile (`profile.py`) holds device times of single forwards measured in isolation. What a user feels
is the whole round: batch assembly, dispatch, the forwards, acceptance and token emission, and on a given machine
the host part can weigh differently for an AR step than for a draft + verify round. The engine reports every decode
round it runs (`RecGuideStrategy.observe`); `RoundClock` keeps the recent wall times per (round kind, block size, live
rows), and `CalibratedCosts` answers cost queries with

- the median measured round time where that (kind, B, rows) ran recently (at least `min_samples` rounds);
- else the profile's cost scaled by how far measurements of the same kind ran from the profile elsewhere (the
  median measured/profiled ratio), or by the ratio over every kind when that kind has not run yet;
- else the profile's cost as it is.

So a regime the profile flatters gets tried, measured and dropped if it really loses, and the comparison with
regimes not run lately stays in one unit.

A shared machine drifts, and a median measured in a slow spell would keep a regime that stopped running looking
slow forever (docs/recguide.md, "Drift"). So a key whose last round is older than `stale_after_s` starts afresh
when it runs again, and `age` lets the switch see which comparisons are stale and re-measure the runner-up.

Prices on a foreign profile (what a run would cost on a B200) must not be calibrated with this machine's clock:
policies that price for another device turn calibration off.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Callable

from recguide_jax.decoding.strategy import RoundKind
from recguide_jax.recguide.kinds import OverlapKind

# the round kinds the regime switch prices
KINDS = (RoundKind.AR, RoundKind.LINEAR, OverlapKind.OVERLAP, OverlapKind.OVERLAP_DRAFT)


class RoundClock:
  """Recent wall-clock milliseconds of decode rounds, per (kind, block size, live rows)."""

  def __init__(self, window: int = 16, min_samples: int = 3, stale_after_s: float = 2.0,
               now: Callable[[], float] = time.monotonic):
    if window < 1 or not 1 <= min_samples <= window:
      raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
    if stale_after_s <= 0:
      raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
    self.window = window
    self.min_samples = min_samples
    self.stale_after_s = stale_after_s
    self.now = now
    self._samples: dict[tuple[str, int, int], collections.deque] = {}
    self._median: dict[tuple[str, int, int], float] = {}  # only keys with >= min_samples samples
    self._last: dict[tuple[str, int, int], float] = {}  # when each key last ran
    self.measured_kinds: frozenset[str] = frozenset()  # kinds that have had a median at some (B, rows), ever
    self.observations = 0
    # seconds of rounds observed, ever: the engine's busy time (what probes are budgeted against; idle time is not)
    self.busy_s = 0.0

  def observe(self, kind: str, block_size: int, rows: int, seconds: float, rounds: int = 1) -> None:
    """One call's rounds of `kind`, `seconds` each (a multi-step AR call: `rounds` steps at their share)."""
    self.busy_s += float(seconds) * rounds
    key = (kind, int(block_size), int(rows))
    t = self.now()
    buf = self._samples.get(key)
    if buf is None:
      buf = self._samples[key] = collections.deque(maxlen=self.window)
    elif t - self._last[key] > self.stale_after_s:  # measured in another state of the machine: start afresh
      buf.clear()
      self._median.pop(key, None)
    self._last[key] = t
    buf.append(1e3 * float(seconds))
    if len(buf) >= self.min_samples:
      # the median: a GC pause or a neighbour's burst in one round must not flip the switch
      self._median[key] = statistics.median(buf)
      if key[0] not in self.measured_kinds:  # a new set only when a kind is first measured (it only grows)
        self.measured_kinds = self.measured_kinds | {key[0]}
    self.observations += 1

  def median(self, kind: str, block_size: int, rows: int) -> float | None:
    return self._median.get((kind, block_size, rows))

  def age(self, kind: str, block_size: int, rows: int) -> float:
    """Seconds since that key's last measured round (inf: never measured to `min_samples`)."""
    key = (kind, block_size, rows)
    return self.now() - self._last[key] if key in self._median else math.inf

  def is_fresh(self, kind: str, block_size: int, rows: int) -> bool:
    return self.age(kind, block_size, rows) <= self.stale_after_s

  def measured(self) -> dict[tuple[str, int, int], float]:
    return dict(self._median)

  def ever_measured(self, kind: str) -> bool:
    """Whether rounds of `kind` were ever measured on this machine (at any block size and row count); until then
    its cost is the profile's, scaled by other kinds' measurements (`CalibratedCosts.cost`)."""
    return kind in self.measured_kinds


class CalibratedCosts:
  """Round costs in profile units, corrected by a `RoundClock`. `profile_cost(kind, B, rows)` gives the
  uncalibrated cost of one round of that kind."""

  def __init__(self, profile_cost: Callable[[str, int, int], float], clock: RoundClock | None = None,
               refresh_every: int = 8):
    self.profile_cost = profile_cost
    self.clock = clock if clock is not None else RoundClock()
    self.refresh_every = refresh_every  # re-derive the ratios every few rounds, not every step (host time)
    self._profiled: dict[tuple[str, int, int], float] = {}
    # fresh-only? -> (observations then, kinds measured then, ratios)
    self._ratios: dict[bool, tuple[int, frozenset[str], dict[str, float]]] = {}

  def _profiled_cost(self, kind: str, blk: int, rows: int) -> float:
    key = (kind, blk, rows)
    cost = self._profiled.get(key)
    if cost is None:
      cost = self._profiled[key] = float(self.profile_cost(kind, blk, rows))
    return cost

  def ratios(self, fresh: bool = False) -> dict[str, float]:
    """Measured / profiled, per kind (median over its measured keys) and over all ("*"); `fresh`: over the keys
    measured lately (`RoundClock.is_fresh`) only."""
    at, kinds, cached = self._ratios.get(fresh, (-1, frozenset(), {}))
    # a kind measured for the first time re-derives them at once: until then it was priced by the others' ratio
    if at < 0 or self.clock.observations - at >= self.refresh_every or kinds is not self.clock.measured_kinds:
      per_kind: dict[str, list[float]] = collections.defaultdict(list)
      for (kind, blk, rows), ms in self.clock.measured().items():
        if kind in KINDS and (not fresh or self.clock.is_fresh(kind, blk, rows)):
          per_kind[kind].append(ms / self._profiled_cost(kind, blk, rows))
      cached = {k: statistics.median(v) for k, v in per_kind.items()}
      if per_kind:
        cached["*"] = statistics.median([r for v in per_kind.values() for r in v])
      self._ratios[fresh] = (self.clock.observations, self.clock.measured_kinds, cached)
    return cached

  def refresh(self) -> None:
    """Re-derives the ratios where they are due, as the next `cost` or `fresh_cost` asking for them would."""
    self.ratios()
    self.ratios(fresh=True)

  def cost(self, kind: str, blk: int, rows: int) -> float:
    measured = self.clock.median(kind, blk, rows)
    if measured is not None:
      return measured
    ratios = self.ratios()
    return self._profiled_cost(kind, blk, rows) * ratios.get(kind, ratios.get("*", 1.0))

  def fresh_cost(self, kind: str, blk: int, rows: int) -> float | None:
    """The cost from measurements of the machine's current state only: the key's median when fresh, else the
    profile scaled by the median measured/profiled ratio of the fresh keys of the same kind; None when no key of
    that kind ran lately. A stale median may come from a slow spell; this is what today's rounds of the same kind
    at other loads say about it."""
    if self.clock.is_fresh(kind, blk, rows):
      return self.clock.median(kind, blk, rows)
    ratio = self.ratios(fresh=True).get(kind)
    return None if ratio is None else self._profiled_cost(kind, blk, rows) * ratio
