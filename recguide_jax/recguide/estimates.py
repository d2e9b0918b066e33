"""The running estimates RecGuide's switch prices with, kept engine-wide: accepted lengths per block size and the
overlap branch reuse rate (`OnlineStats`), and how far the fitted value model's predictions sit from what
verification returns on the workload being served (`ValueCalibration`)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from recguide_jax.model.config import BLOCK_SIZES


@dataclasses.dataclass
class OnlineStats:
  """Engine-wide running estimates the switch needs (exponential moving averages).

  An overlap round verifies a block as a LinearSS round of that B does, so it feeds the same accepted-length
  estimate (`observe_verified`): kept apart, each froze while the other regime ran, and a spell of short acceptance
  in the last overlap rounds kept overlap out for the rest of a run. Overlap's own is the share of its rounds whose
  branch was reused, per block size (`observe_overlap`)."""
  decay: float = 0.98
  accepted: dict = dataclasses.field(default_factory=lambda: {8: 4.0, 16: 5.0, 32: 6.0})
  overlap_hit: dict = dataclasses.field(default_factory=lambda: {8: 0.5, 16: 0.5, 32: 0.5})
  overlap_rounds: int = 0

  def observe_verified(self, blk: int, accepted: int) -> None:
    """One verification of a block of `blk` that accepted `accepted` tokens (`observe_verified_rounds`)."""
    self.observe_verified_rounds((blk,), (accepted,))

  def observe_verified_rounds(self, blocks, accepted, rounds: int = 1) -> None:
    """`observe_verified` of each (block, accepted) pair in order, `rounds` times each; blocks outside
    `BLOCK_SIZES` (AR rows, wider trees) are skipped."""
    decay, estimates = self.decay, self.accepted
    blocks, accepted = np.asarray(blocks), np.asarray(accepted)
    for blk in BLOCK_SIZES:  # each block's estimate moves only with its own rounds: one running value per block
      got = accepted[blocks == blk].tolist()
      if not got:
        continue
      value = estimates.get(blk, got[0])
      for g in got:
        for _ in range(rounds):
          value = decay * value + (1 - decay) * g
      estimates[blk] = value

  def observe_overlap(self, blk: int, hit: bool) -> None:
    self.overlap_hit[blk] = self.decay * self.overlap_hit.get(blk, float(hit)) + (1 - self.decay) * float(hit)
    self.overlap_rounds += 1


@dataclasses.dataclass
class ValueCalibration:
  """How far the fitted value model's predictions sit from what verification returns on this workload, per B.

  The tables are fitted on one prompt set (the bundled ones: GSM8K answers that stop at EOS); served prompts can
  accept far less (on GSM8K question windows decoded past EOS the model predicted 4.1 tokens per B = 8 round where
  2.6 came back) and a switch that trusts the prediction keeps running rounds that lose to AR. Each LinearSS
  verification adds its predicted and realized accepted length to decayed sums; `scale(B)` = realized / predicted
  once `min_rounds` rounds of B (or, until then, of all B together) were seen, clamped to [`lo`, `hi`]."""
  decay: float = 0.98
  min_rounds: int = 8
  lo: float = 0.2
  hi: float = 1.5
  predicted: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
  realized: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
  rounds: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def observe(self, blk: int, predicted: float, realized: int) -> None:
    self.observe_rounds((blk,), (predicted,), (realized,))

  def observe_rounds(self, blocks, predicted, realized) -> None:
    """`observe` of each (block, predicted, realized) triple in order."""
    decay = self.decay
    for blk in dict.fromkeys(blocks):  # each block's sums move only with its own rounds: running values per block
      pred_sum, real_sum, n = self.predicted[blk], self.realized[blk], 0
      for b, pred, real in zip(blocks, predicted, realized):
        if b == blk:
          pred_sum, real_sum, n = decay * pred_sum + pred, decay * real_sum + real, n + 1
      self.predicted[blk], self.realized[blk] = pred_sum, real_sum
      self.rounds[blk] += n

  def scale(self, blk: int) -> float:
    if self.rounds[blk] >= self.min_rounds:
      pred, real = self.predicted[blk], self.realized[blk]
    elif sum(self.rounds.values()) >= self.min_rounds:
      pred, real = sum(self.predicted.values()), sum(self.realized.values())
    else:
      return 1.0
    return min(max(real / pred, self.lo), self.hi) if pred > 0 else 1.0
