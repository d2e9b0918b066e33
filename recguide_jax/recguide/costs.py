"""RecGuide's cost model: the price of a round of each kind at a load, from the hardware profile (or generic relative
costs without one), calibrated online with this machine's measured round times (`calibration.py`) unless pricing
for another device; and the expected cost of an overlap round's draft forward when only some rows draft."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from recguide_jax.decoding.strategy import RoundKind
from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide import pricing
from recguide_jax.recguide.kinds import OverlapKind


class CostModel:
  """Mixin of `RecGuideStrategy`: reads `profile`, `overlap_slots`, `calibrate`, `calibrated`, `_draft_weights` and
  `_draft_costs`."""

  def _profiled_round_cost(self, kind: str, blk: int, concurrency: int) -> float:
    """One round of `kind` for `concurrency` requests by the profile alone (device time of its forwards). Without
    a profile: relative costs of a compute-bound device, a forward of n query tokens per request costing
    (1 + n/32) / 2."""
    prof, c = self.profile, concurrency
    forward = lambda n: 0.5 * (1.0 + n / 32.0)  # noqa: E731
    if kind == RoundKind.AR:
      return forward(8) if prof is None else prof.ar_cost(c)
    if kind == RoundKind.LINEAR:
      return 2 * forward(blk) if prof is None else prof.cost(c, blk)
    if kind in (OverlapKind.OVERLAP, OverlapKind.OVERLAP_DRAFT):
      slots = self.overlap_slots
      fused = forward((1 + slots) * blk) if prof is None else prof.fused_cost(c, blk, slots)
      if kind == OverlapKind.OVERLAP:
        return fused
      # the fused forward after a draft forward (no prefetched block to reuse)
      return fused + (forward(blk) if prof is None else prof.forward_costs(c, blk)[0])
    raise ValueError(f"no cost for round kind {kind!r}")

  def _round_cost(self, kind: str, blk: int, concurrency: int) -> float:
    if self.calibrate:
      return self.calibrated.cost(kind, blk, concurrency)
    return self._profiled_round_cost(kind, blk, concurrency)

  def _linear_costs(self, concurrency: int) -> dict[int, float]:
    return {b: self._round_cost(RoundKind.LINEAR, b, concurrency) for b in BLOCK_SIZES}

  def round_cost(self, batch: int, block_size: int) -> float:
    return self._round_cost(RoundKind.LINEAR, block_size, batch)

  def _draft_forward_share(self, blk: int, c: int, share: float, shares: Sequence[float] | None = None) -> float:
    """E[cost of an overlap round's draft forward] / its cost at all `c` rows, when each row drafts with probability
    `share`: the forward runs only when some row drafts, for those K ~ Binomial(c, share) rows. `share` times the
    full forward is exact at one row only: on a weight-bound device a forward for few rows costs nearly the full
    one, so it under-priced overlap's drafts at C >= 2 (docs/recguide.md, "Priced as a batch" (2))."""
    if shares:  # the step's own rows, each at its own miss probability: the forward is skipped when none misses
      rows = max(c, len(shares))
      by_rows = self._draft_costs_by_rows(blk, rows)
      return pricing.expected_draft_cost(shares, by_rows, self._draft_affine[(blk, rows)]) / by_rows[c]
    if c <= 1 or share <= 0.0 or share >= 1.0:
      return min(max(share, 0.0), 1.0)
    weights = self._draft_weights.get((blk, c))
    if weights is None:  # static, once per (B, rows): log C(c, k), and the draft forward at k rows relative to c's
      by_rows = self._draft_costs_by_rows(blk, c)
      log_comb = np.array([math.lgamma(c + 1) - math.lgamma(k + 1) - math.lgamma(c - k + 1) for k in range(c + 1)])
      weights = self._draft_weights[(blk, c)] = (log_comb, by_rows / by_rows[c])
    log_comb, relative = weights
    k = np.arange(c + 1)
    # K ~ Binomial(c, share) in log space: C(c, k) overflows a float past c ~ 1030
    return float(np.exp(log_comb + k * math.log(share) + (c - k) * math.log1p(-share)) @ relative)

  def _draft_costs_by_rows(self, blk: int, rows: int) -> np.ndarray:
    """The profile's draft forward of block `blk` at k = 0..`rows` rows (static: built once per (B, rows)); without
    a profile, a forward costs the same for any number of rows."""
    costs = self._draft_costs.get((blk, rows))
    if costs is None:
      prof = self.profile
      costs = np.array([0.0] + [1.0 if prof is None else prof.forward_costs(k, blk)[0] for k in range(1, rows + 1)])
      self._draft_costs[(blk, rows)] = costs
      self._draft_affine[(blk, rows)] = pricing.affine_costs(costs)
    return costs

  def observe_round(self, kind: str, block_size: int, rows: int, seconds: float, rounds: int = 1) -> None:
    """One round's wall seconds (a multi-step call: each of its `rounds` steps' share), for the calibrated costs."""
    if self.calibrate:
      self.calibrated.clock.observe(kind, block_size, rows, seconds, rounds)
