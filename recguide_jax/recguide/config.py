"""RecGuide's configuration and per-request state: the regimes, the frozen `RecGuideConfig` a strategy is built
with (resolved against the fitted tables: the overlap threshold, branch planner, tree width and prefix exponent
fitted for the model, else the paper's; every value checked), and `RecGuideState`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide import overlap as ov, signals


class Regime(enum.StrEnum):
  """What the switch decides per step (str-valued: metrics label them so)."""
  OVERLAP = "overlap"  # verification-overlapped drafting (requests up to `overlap_max_temperature`)
  ADAPTIVE = "adaptive"  # LinearSS with B chosen per request
  LINEAR = "linear"  # LinearSS at the fixed block size (ablations)
  AR = "ar"


HISTORY = 4  # verification rounds a request's history keeps (the signals read the last two)
# how much more tokens per unit time a plan must be priced at to replace a cheaper one (`price_step`): a gain
# below the values' estimation error is a coin flip (docs/recguide.md, "Priced as a batch" (5))
TIE_MARGIN = 0.01
# how much more another overlap block must be priced at to replace the one overlap runs at: a change drops every
# request's draft of the old block, and per-step values move by more than 1% (at C = 1 on the B200 table B = 8 and
# 16 traded places every few steps and gave back 0.7 points of the gain)
OVERLAP_BLOCK_MARGIN = 0.05
PAPER_DELTA = 0.5  # risky-position margin threshold of the paper (NLD-8B)


class RecGuideState:
  """What RecGuide remembers of one request (`Request.strategy_state`): its row of its strategy's `Histories` (its
  last HISTORY verifications and what the adaptive rule reads of them), a prefetched overlap branch and its overlap
  rounds by branch outcome. Made with a history (or none), it joins a strategy's `Histories` when that strategy
  first reads it (`RecGuideStrategy.state`), and leaves with its history when the request finishes."""

  def __init__(self, history: Sequence[signals.RoundRecord] = (), prefetched: ov.Prefetched | None = None):
    self.histories: Any = None  # the `histories.Histories` it is a row of (None: not in one)
    self.row = -1
    self.left = False  # it left (its request finished): a round observed after that writes no history row of it
    self._history = list(history)
    self._prefetched = prefetched
    self.overlap: dict[str, int] = {}  # its overlap rounds by branch outcome

  def join(self, histories) -> None:
    """Moves this state into `histories` (out of another strategy's, if it was in one)."""
    records, prefetched = self.history, self.prefetched
    if self.histories is not None:
      self.histories.release(self.row)
    self.histories, self.row, self.left = histories, histories.allocate(records), False
    self._history, self._prefetched = None, None
    self.prefetched = prefetched

  def leave(self) -> None:
    """Gives its row back (its request finished), keeping its history and branch."""
    if self.histories is not None:
      self._history, self._prefetched = self.history, self.prefetched
      self.histories.release(self.row)
    self.histories, self.row, self.left = None, -1, True

  @property
  def history(self) -> list[signals.RoundRecord]:
    """Its last HISTORY verification rounds, oldest first."""
    return self.histories.records(self.row) if self.histories is not None else list(self._history)

  @history.setter
  def history(self, records: Sequence[signals.RoundRecord]) -> None:
    if self.histories is not None:
      self.histories.set_records(self.row, records)
    else:
      self._history = list(records)

  @property
  def prefetched(self) -> ov.Prefetched | None:
    """A branch block its last overlap round confirmed: its next overlap round's draft (for that round only)."""
    return self.histories.prefetched.get(self.row) if self.histories is not None else self._prefetched

  @prefetched.setter
  def prefetched(self, branch: ov.Prefetched | None) -> None:
    if self.histories is None:
      self._prefetched = branch
    elif branch is None:
      self.histories.prefetched.pop(self.row, None)
    else:
      self.histories.prefetched[self.row] = branch


@dataclasses.dataclass(frozen=True, eq=False)
class RecGuideConfig:
  """What a RecGuide strategy is built with; None fields are resolved from the tables (or the paper's values)."""
  block_size: int = 16
  delta: float | None = None  # risky-position margin threshold of the overlap planner
  planner: str | None = None  # overlap branch planner (`overlap.PLANNERS`)
  components: tuple = ("p1", "p2", "continuation")
  overlap: bool = True
  adaptive: bool = True
  switch: bool = True
  profile: Any = None  # HardwareProfile
  tables: Any = None  # RecGuideTables
  fixed_regime: Regime | None = None  # bypasses the switch (ablations)
  entropy_head_cap: int | None = None
  calibrate: bool = True  # correct the profile's costs (and the fitted values) online with this machine's clock
  overlap_slots: int | None = None  # branch slots of the fused forward (its width: (1 + slots) B tokens)
  # the blocks overlap may run at, the switch pricing each per step (a fixed regime or no switch: `block_size`)
  overlap_block_sizes: tuple = BLOCK_SIZES
  prefix_exponent: float | None = None  # the expected-hit planner's prefix exponent
  # True: a step's adaptive plan is priced as the batch it runs as, against every fixed-B plan and AR; False: the
  # paper's per-request rule alone (the Table 6 ablation rows)
  batch_priced: bool = True
  tie_margin: float = TIE_MARGIN  # a plan replaces a cheaper one only when priced this much (relative) above it
  # requests of at most this temperature run overlap rounds (0: greedy only). Lossless at any temperature; sampled
  # rows accept a point-mass draft with probability p(draft) instead of LinearSS's sum(min(p, q)), which loses at
  # higher temperatures (docs/recguide.md, "Sampling")
  overlap_max_temperature: float = 0.3
  # True: on ragged steps, each LinearSS row verifies only the head of its draft whose running confidence still
  # pays for the verify tokens at this load (`pricing.verify_token_price`; lossless at any temperature)
  verify_truncation: bool = False
  # gamma of P(accepted through a draft token) ~ (running confidence)^gamma, what truncation prices a token by: the
  # tables' fitted one, else the plain product (1.0)
  verify_confidence_exponent: float | None = None

  def __post_init__(self):
    tables, set_ = self.tables, lambda name, value: object.__setattr__(self, name, value)
    if self.block_size not in BLOCK_SIZES:
      raise ValueError(f"recguide block_size must be one of {BLOCK_SIZES}, got {self.block_size}")
    if self.delta is None:  # the threshold fitted with the tables (launch/fit_delta.py), else the paper's
      set_("delta", tables.overlap_delta if tables is not None and tables.overlap_delta is not None else PAPER_DELTA)
    if self.planner is None:  # the branch planner fitted with the tables, else the paper's no-P3 rule
      set_("planner", tables.overlap_planner if tables is not None and tables.overlap_planner else ov.PLANNERS[0])
    if self.planner not in ov.PLANNERS:
      raise ValueError(f"planner must be one of {ov.PLANNERS}, got {self.planner!r}")
    if self.overlap_slots is None:  # the tree width fitted for the expected-hit planner, else the paper's 3 branches
      fitted = tables.overlap_slots if tables is not None and self.planner == "expected_hit" else None
      set_("overlap_slots", fitted or ov.MAX_BRANCHES)
    if not 1 <= self.overlap_slots <= ov.MAX_SLOTS:
      raise ValueError(f"overlap_slots must lie in [1, {ov.MAX_SLOTS}], got {self.overlap_slots}")
    if self.planner == "no_p3" and self.overlap_slots < ov.MAX_BRANCHES:
      raise ValueError(f"the paper's no-P3 rule plans up to {ov.MAX_BRANCHES} branches; overlap_slots is "
                       f"{self.overlap_slots}")
    if self.prefix_exponent is None:  # the expected-hit planner's fitted prefix exponent, else the plain product
      fitted = tables.overlap_prefix_exponent if tables is not None and self.planner == "expected_hit" else None
      set_("prefix_exponent", fitted or 1.0)
    if not 0.0 < self.prefix_exponent <= 2.0:
      raise ValueError(f"prefix_exponent must lie in (0, 2], got {self.prefix_exponent}")
    set_("components", tuple(self.components))
    set_("overlap_block_sizes", tuple(sorted(set(self.overlap_block_sizes))))
    if not self.overlap_block_sizes or not set(self.overlap_block_sizes) <= set(BLOCK_SIZES):
      raise ValueError(f"overlap_block_sizes must be a non-empty subset of {BLOCK_SIZES}, got "
                       f"{list(self.overlap_block_sizes)}")
    if self.fixed_regime and self.fixed_regime not in tuple(Regime):
      raise ValueError(f"fixed_regime must be one of {[r.value for r in Regime]}, got {self.fixed_regime!r}")
    set_("fixed_regime", Regime(self.fixed_regime) if self.fixed_regime else None)
    if self.verify_confidence_exponent is None:
      fitted = tables.verify_confidence_exponent if tables is not None else None
      set_("verify_confidence_exponent", fitted or 1.0)
    if not 0.0 < self.verify_confidence_exponent <= 2.0:
      raise ValueError(f"verify_confidence_exponent must lie in (0, 2], got {self.verify_confidence_exponent}")
    if not self.overlap_max_temperature >= 0.0:
      raise ValueError(f"overlap_max_temperature must be >= 0, got {self.overlap_max_temperature}")
    if not 0.0 <= self.tie_margin < 1.0:
      raise ValueError(f"tie_margin must lie in [0, 1), got {self.tie_margin}")
