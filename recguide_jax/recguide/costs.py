"""RecGuide's cost model: the price of a round of each kind at a load, from the hardware profile (or generic relative
costs without one), calibrated online with this machine's measured round times (`calibration.py`) unless pricing
for another device."""

from __future__ import annotations



from recguide_jax.decoding.strategy import RoundKind
from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide.kinds import OverlapKind


class CostModel:
  """Mixin of `RecGuideStrategy`: reads `profile`, `overlap_slots`, `calibrate` and `calibrated`."""

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
    if kind == OverlapKind.OVERLAP:
      slots = self.overlap_slots
      return forward((1 + slots) * blk) if prof is None else prof.fused_cost(c, blk, slots)
    if kind == OverlapKind.OVERLAP_DRAFT:  # the step where no request holds a draft: a draft forward alone
      return forward(blk) if prof is None else prof.forward_costs(c, blk)[0]
    raise ValueError(f"no cost for round kind {kind!r}")

  def _round_cost(self, kind: str, blk: int, concurrency: int) -> float:
    if self.calibrate:
      return self.calibrated.cost(kind, blk, concurrency)
    return self._profiled_round_cost(kind, blk, concurrency)

  def _linear_costs(self, concurrency: int) -> dict[int, float]:
    return {b: self._round_cost(RoundKind.LINEAR, b, concurrency) for b in BLOCK_SIZES}

  def round_cost(self, batch: int, block_size: int) -> float:
    return self._round_cost(RoundKind.LINEAR, block_size, batch)

  def observe_round(self, kind: str, block_size: int, rows: int, seconds: float, rounds: int = 1) -> None:
    """One round's wall seconds (a multi-step call: each of its `rounds` steps' share), for the calibrated costs."""
    if self.calibrate:
      self.calibrated.clock.observe(kind, block_size, rows, seconds, rounds)
