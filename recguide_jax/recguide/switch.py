"""RecGuide's regime switch (docs/spec/recguide.md §6, ours): the expected rate of each regime, E[tokens]/E[time],
at the load from the cost model and the engine's observed acceptance and overlap hit rates; AR is a candidate too,
so speculation never runs where it loses to plain decoding. With calibration a stale runner-up is re-measured now
and then (a probe) so machine drift cannot freeze a wrong choice, and a regime never run here is measured once."""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import numpy as np

from recguide_jax.decoding.strategy import RoundKind
from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide.config import OVERLAP_BLOCK_MARGIN, RecGuideState, Regime
from recguide_jax.recguide.kinds import OverlapKind
from recguide_jax.recguide.rule import remaining_tokens

_TEMPERATURE = operator.attrgetter("params.temperature")


@dataclasses.dataclass(frozen=True)
class OverlapShares:
  """What overlap's rate at one block rests on besides its value: the share of the overlapping requests' rounds
  that draft, and the rows of the step that would not overlap (they run a LinearSS round of their own)."""
  draft_share: float
  rows_left_out: int = 0
  # the overlapping rows' own draft probabilities (1 - h_i), when the step's requests are known: a step drafts
  # alone only when every one of them drafts (`_overlap_steps_per_token`)
  draft_shares: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,)))


@dataclasses.dataclass(frozen=True)
class StepEstimates:
  """What one step's regime rates rest on, per request: the expected tokens of a LinearSS round per B (an overlap
  round verifies a block of its B: that block's value) and overlap's shares per block it may run at (a block
  without them: the steady state's, 1 - its hit rate)."""
  accepted: dict[int, float]
  overlap: dict[int, OverlapShares] = dataclasses.field(default_factory=dict)


class RegimeSwitch:
  """Mixin of `RecGuideStrategy` (with `CostModel` and `AdaptiveRule`): the switch's state is the strategy's (probes,
  the probe in progress, `probing`)."""

  def expected_rates(self, concurrency: int, batch=None, values=None) -> dict[str, float]:
    """Tokens per unit time per request for each regime at this concurrency, keyed "ar", "linear<B>" (adaptive
    B stands on its best block) and "overlap<B>" (overlap stands on its best block), priced on
    `step_estimates(batch, values)`."""
    estimates = self.step_estimates(batch, values)
    return {key: self._rate(key, max(concurrency, 1), self._round_cost, estimates)
            for key in ("ar", *(f"linear{b}" for b in BLOCK_SIZES), *self._overlap_keys())}

  def _overlap_keys(self) -> tuple[str, ...]:
    """The rate keys of the blocks overlap may run at (`overlap_block_sizes`)."""
    return tuple(f"{Regime.OVERLAP}{b}" for b in self.overlap_block_sizes)

  def step_estimates(self, batch=None, values=None) -> StepEstimates:
    """What the regime rates rest on. `batch`: the step's requests, when known (overlap's draft share is then theirs,
    `overlap_draft_shares`, else the steady state's 1 - hit rate); `values`: their expected tokens per B
    (`_value_rows`, in `batch` order), when known, else the engine-wide running estimates.

    Every regime's tokens come from one estimate of the same thing, so that only costs and the branch reuse rate
    tell overlap from LinearSS at its B. The regimes are compared over the same requests: overlap's value is the
    mean V_B over the whole batch too, and the requests that would not overlap (sampled, or finishing this round)
    cost overlap a LinearSS round of their own beside the fused one (why: docs/recguide.md, "Priced as a batch"
    (2))."""
    return self._with_overlap(self._accepted(values), batch)

  def _accepted(self, values) -> dict[int, float]:
    """The step's expected tokens per B: its requests' mean `values`, or the engine-wide estimates."""
    return (self.stats.accepted if values is None
            else dict(zip(BLOCK_SIZES, values.mean(axis=0).tolist())))

  def _with_overlap(self, accepted: dict[int, float], batch) -> StepEstimates:
    """The estimates of expected tokens `accepted` with overlap's shares of `batch` at each of its blocks."""
    rows = self._overlap_rows(batch) if batch and self.overlap else None  # one pass over the requests for all blocks
    return StepEstimates(accepted, {b: self._overlap_shares(batch, b, rows) for b in self.overlap_block_sizes})

  def _overlap_shares(self, batch, blk: int, rows=None) -> OverlapShares:
    """Overlap's shares at block `blk` for the step's requests `batch` (None: the steady state's); `rows`: their
    `_overlap_rows`, when read already."""
    if not (batch and self.overlap):
      return OverlapShares(1.0 - self.stats.overlap_hit[blk])
    shares = self.overlap_draft_shares(batch, blk, rows)
    share = float(shares.mean()) if len(shares) else 1.0 - self.stats.overlap_hit[blk]
    return OverlapShares(share, len(batch) - len(shares), shares)  # a share per overlapping request

  def _overlap_rows(self, batch) -> tuple[np.ndarray, np.ndarray]:
    """Per request of `batch` that samples at a temperature overlap runs (`overlap_max_temperature`): its remaining
    budget, and the length of the branch it holds (0: none)."""
    # read as arrays (`_overlaps` of each, in effect): this runs over every request of every step the switch prices
    n = len(batch)
    cool = np.fromiter(map(_TEMPERATURE, batch), np.float64, n) <= self.overlap_max_temperature
    reqs = batch if cool.all() else [batch[i] for i in np.flatnonzero(cool).tolist()]
    at = self._rows(reqs)  # (a state joining the strategy's histories brings its branch with it)
    return remaining_tokens(reqs).astype(np.float64), self.histories.held_lengths(at)

  def overlap_draft_shares(self, batch, blk: int | None = None, rows=None) -> np.ndarray:
    """Per request of `batch` that would run overlap rounds, the share of them that pay a draft forward, from this
    step to its end (`rows`: the requests' `_overlap_rows`, when read already).

    In its steady state an overlap round drafts only on a miss (1 - hit rate: a hit's branch is the next round's
    draft). A request that holds no prefetched branch (entering overlap, or after a miss) drafts in this round for
    sure, and a branch pays off only in a round that follows: over the R rounds it has left in overlap it drafts
    1 + (R - 1)(1 - hit) times, so entering is worth it only when enough rounds are left to recover the draft
    (docs/recguide.md, "Priced as a batch" (6)). Where the switch decides, a request leaves overlap once a round is
    expected to finish it (`_overlaps`), so R = (left - accepted) / accepted, not left / accepted; one that holds a
    draft of this block stays for that last round (R = 1, no draft to pay). A request holding a draft of this block
    drafts 1 - hit per round less. `blk`: overlap's block (default: the one it runs at)."""
    blk = self.overlap_block if blk is None else blk
    remaining, held = self._overlap_rows(batch) if rows is None else rows
    hit, accepted = self.stats.overlap_hit[blk], max(self.stats.accepted[blk], 1.0)
    if not self.fixed_regime:  # the requests a round is expected to finish do not overlap, unless they hold a draft
      keep = (remaining > self.stats.accepted[blk]) | (held == blk)
      remaining, held = remaining[keep] - self.stats.accepted[blk], held[keep]
    left = np.maximum(remaining / accepted, 1.0)  # rounds until it leaves overlap
    first = (held != blk).astype(np.float64)
    return (first + (left - 1.0) * (1.0 - hit)) / left

  def _rate(self, rate_key: str, c: int, cost: Callable[[str, int, int], float], estimates: StepEstimates) -> float:
    """One regime's expected tokens per unit time per request, with round costs from `cost(kind, B, rows)`."""
    if rate_key == Regime.AR:
      return 1.0 / cost(RoundKind.AR, 1, c)
    if rate_key.startswith(Regime.LINEAR):
      blk = int(rate_key[len(Regime.LINEAR):])
      return estimates.accepted[blk] / cost(RoundKind.LINEAR, blk, c)
    blk = int(rate_key[len(Regime.OVERLAP):])
    shares = estimates.overlap.get(blk) or OverlapShares(1.0 - self.stats.overlap_hit[blk])
    return estimates.accepted[blk] * self._overlap_steps_per_token(c, blk, cost, shares)

  def _overlap_steps_per_token(self, c: int, blk: int, cost: Callable[[str, int, int], float],
                               overlap: OverlapShares) -> float:
    """Overlap's tokens per unit time per request over its value V_B: one forward per step, in which a request
    verifies, or drafts for its next step when it holds no draft (`overlap_round`). A request that drafts a share
    d of its rounds takes 1 + d steps a round; a step costs the fused forward unless every request drafts in it
    (a draft forward alone: each request is in a drafting step with probability d / (1 + d)). The requests left out
    run a LinearSS round of their own beside each step."""
    shares = np.asarray(overlap.draft_shares, np.float64)
    if len(shares):
      overlapping = len(shares)
      verifying = float((1.0 / (1.0 + shares)).sum())  # verifications per step
      all_draft = float(np.prod(shares / (1.0 + shares)))
    else:
      overlapping = c if not overlap.rows_left_out else 0
      d = overlap.draft_share
      verifying, all_draft = overlapping / (1.0 + d), (d / (1.0 + d)) ** c
    if not overlapping:  # no request would overlap: the regime is adaptive B's
      return 0.0
    fused, draft = cost(OverlapKind.OVERLAP, blk, c), cost(OverlapKind.OVERLAP_DRAFT, blk, c)
    step_ms = fused - (fused - draft) * all_draft
    left_out = overlap.rows_left_out
    if left_out:  # their LinearSS round, at its cheapest block
      step_ms += cost(RoundKind.LINEAR, BLOCK_SIZES[0], left_out)
    return (verifying + left_out) / ((overlapping + left_out) * step_ms)

  def regime(self, concurrency: int, batch=None, values=None) -> Regime:
    """The step's regime at this load; `batch`: the step's requests, when known, `values`: their expected tokens
    per B (`step_estimates`)."""
    self.probing = False
    if self.fixed_regime:
      self.overlap_block = self.block_size
      return self.fixed_regime
    if not self.switch:
      self.overlap_block = self.block_size
      return Regime.OVERLAP if (self.overlap and concurrency <= 1) else Regime.ADAPTIVE
    c = max(concurrency, 1)
    if self.calibrate:  # the cost ratios as of this decision, whichever costs it asks for (overlap's, or not)
      self.calibrated.refresh()
    accepted = self._accepted(values)
    estimates = StepEstimates(accepted)  # AR and LinearSS need no draft shares
    rates = {key: self._rate(key, c, self._round_cost, estimates)
             for key in (Regime.AR.value, *(f"linear{b}" for b in BLOCK_SIZES))}
    # overlap's rates need a pass over every request per block (its draft shares): skipped where they cannot change
    # the decision
    if self.overlap and not self._overlap_out_of_reach(c, accepted, rates, batch):
      estimates = self._with_overlap(accepted, batch)
      rates.update((key, self._rate(key, c, self._round_cost, estimates)) for key in self._overlap_keys())
    # one rate per regime: adaptive B and overlap are each as good as their best block size
    basis: dict[Regime, str] = {}  # regime -> the rate it stands on
    for key, rate in rates.items():
      name = (Regime.ADAPTIVE if key.startswith(Regime.LINEAR)
              else Regime.OVERLAP if key.startswith(Regime.OVERLAP) else Regime(key))
      if name not in basis or rate > rates[basis[name]]:
        basis[name] = key
    if Regime.OVERLAP in basis:  # the block an overlap step runs at, whichever regime this step takes
      current = f"{Regime.OVERLAP}{self.overlap_block}"
      if current in rates and rates[current] * (1.0 + OVERLAP_BLOCK_MARGIN) >= rates[basis[Regime.OVERLAP]]:
        basis[Regime.OVERLAP] = current
      self.overlap_block = int(basis[Regime.OVERLAP][len(Regime.OVERLAP):])
    ranked = sorted(basis, key=lambda name: -rates[basis[name]])
    if ranked[0] == Regime.AR and self._ar_per_step and Regime.ADAPTIVE in basis:
      # AR is priced per step against the requests' own values (`plan_step`); here it would rest on engine-wide
      # estimates only speculative rounds update, and one unlucky spell would keep every later step in AR
      return Regime.ADAPTIVE
    if not self.calibrate or len(ranked) < 2:
      return ranked[0]
    return self._probe_or_best(ranked, basis, rates, c, estimates)

  def _overlap_out_of_reach(self, c: int, accepted: dict[int, float], rates: dict[str, float], batch) -> bool:
    """Whether overlap cannot change the switch's decision at this load whatever its rows' draft shares (`accepted`:
    the step's expected tokens per B; `rates`: AR's and each LinearSS block's): its rate is at most its fused round's
    alone (no row drafting, none left out), and that best case is below the best of AR and adaptive B. Calibrated, a
    probe also looks past the best (`_probe_or_best`): overlap must be below the margin it would be probed at
    (`explore_margin` while never measured, else `probe_margin`) at the costs a probe judges by (`_current_cost`),
    and where it might rank above the other regime, that regime's probe must not hang on its being the runner-up
    (measured, and fresh or below `probe_margin`)."""
    if not batch:
      return False
    adaptive = max((key for key in rates if key != Regime.AR), key=rates.get)  # `regime`'s basis for adaptive B
    best, other = sorted((Regime.AR.value, adaptive), key=lambda key: -rates[key])
    blocks = self.overlap_block_sizes
    best_case = max(accepted[b] / self._round_cost(OverlapKind.OVERLAP, b, c) for b in blocks)
    if best_case >= rates[best]:
      return False
    if not self.calibrate:
      return True
    margin = self.explore_margin if self._never_measured(self._overlap_keys()[0]) else self.probe_margin
    if max(accepted[b] / self._current_cost(OverlapKind.OVERLAP, b, c) for b in blocks) >= margin * rates[best]:
      return False
    if best_case < rates[other] or self._never_measured(other):
      return True  # last either way, or `other` is probed (or not) at any rank
    current = self._rate(other, c, self._current_cost, StepEstimates(accepted))
    return self.calibrated.clock.is_fresh(*self._clock_key(other, c)) or current < self.probe_margin * rates[best]

  def _clock_key(self, rate_key: str, concurrency: int) -> tuple[str, int, int]:
    """The measured round a regime's rate rests on."""
    if rate_key == Regime.AR:
      return (RoundKind.AR, 1, concurrency)
    if rate_key.startswith(Regime.OVERLAP):
      return (OverlapKind.OVERLAP, int(rate_key[len(Regime.OVERLAP):]), concurrency)
    return (RoundKind.LINEAR, int(rate_key[len(Regime.LINEAR):]), concurrency)

  def _never_measured(self, rate_key: str) -> bool:
    """Whether no round of the kinds a regime's rate rests on has been measured on this machine yet (at any block
    size or load): its cost is then the profile's, scaled by how far the other kinds ran from theirs. Overlap's
    rate rests on its rounds with and without a draft forward (`_rate`), the others' on their clock key's kind."""
    kind = self._clock_key(rate_key, 1)[0]
    kinds = (kind, OverlapKind.OVERLAP_DRAFT) if kind == OverlapKind.OVERLAP else (kind,)
    return not any(self.calibrated.clock.ever_measured(k) for k in kinds)

  def _probe_or_best(self, ranked: list[Regime], basis: dict, rates: dict, c: int, estimates: StepEstimates) -> str:
    """Re-measures a stale runner-up: when the best regime's cost was measured just now but the runner-up's is
    stale (or was never measured) and the runner-up is estimated close enough to matter (>= `probe_margin` of the
    best's rate), the runner-up runs for `min_samples` steps, so the two are compared in one state of the
    machine: a regime measured in a slow spell of a shared machine must not lose the switch for good. Probes take
    at most `probe_budget` of the engine's busy time (the rounds it observed: idle time between requests would let
    a probe land in every short burst) and come no sooner than the last probe's rounds go stale. The margin test
    prices the runner-up also from fresh rounds only (`CalibratedCosts.fresh_cost`) and takes the more promising
    price.

    A regime none of whose round kinds has ever run here, ranked anywhere below the best, is probed when its
    estimate is within `explore_margin` of the best's: that estimate is the profile's cost ratio between kinds, and
    a profile of other hardware, or none, can be off several-fold. Such a first measurement, one per kind, has its
    own budget (`explore_budget`) and is spaced from the first decision too (docs/recguide.md, "Drift")."""
    if self._probe is not None:
      regime, left, first_of = self._probe
      if first_of is None or self._never_measured(first_of):
        self._probe = (regime, left - 1, first_of) if left > 1 else None
        self.probing = True
        return regime
      self._probe = None  # a first measurement that has its median: decide as usual
    best = ranked[0]
    clock = self.calibrated.clock
    now, busy = clock.now(), clock.busy_s
    if self._first_decision_busy is None:
      self._first_decision_busy = busy
    if not clock.is_fresh(*self._clock_key(basis[best], c)):
      return best
    for rank, name in enumerate(ranked[1:]):
      unmeasured = self._never_measured(basis[name])
      key = self._clock_key(basis[name], c)
      if not (rank == 0 or unmeasured) or clock.is_fresh(*key):
        continue  # only the runner-up, or a regime never measured, is worth a probe
      probe_s = clock.min_samples * self._round_cost(key[0], key[1], c) / 1e3
      if unmeasured:  # a first measurement: its own budget, counted from the first decision too
        due = busy - max(self._last_probe_busy, self._first_decision_busy) >= probe_s / self.explore_budget
        margin = self.explore_margin
      else:  # and never sooner than the last probe's rounds go stale
        due = (now - self._last_probe_at >= clock.stale_after_s
               and busy - self._last_probe_busy >= probe_s / self.probe_budget)
        margin = self.probe_margin
      if not due:
        continue  # checked first: it is cheap, and most steps stop here
      if self._rate(basis[name], c, self._current_cost, estimates) < margin * rates[basis[best]]:
        continue
      self._last_probe_at, self._last_probe_busy = now, busy
      self._probe_basis = basis[name]
      self.probes += 1
      # a first measurement runs until its kind has a median (the live rows can change between steps, and each row
      # count is its own clock key), for up to explore_rounds steps
      left = (self.explore_rounds if unmeasured else clock.min_samples) - 1
      self._probe = (name, left, basis[name] if unmeasured else None) if left > 0 else None
      self.probing = True
      return name
    return best

  def _current_cost(self, kind: str, blk: int, rows: int) -> float:
    """A probe candidate's round cost as the machine's current state says: its kind's fresh rounds where they
    are cheaper (a median from a cold start or a slow spell must not keep it from being re-measured)."""
    cost, fresh = self._round_cost(kind, blk, rows), self.calibrated.fresh_cost(kind, blk, rows)
    return cost if fresh is None else min(cost, fresh)

  @property
  def _switch_on_values(self) -> bool:
    """True when the switch prices a step on its requests' own values (`step_estimates`): it decides (no pinned
    regime), the batch pricing is on and fitted tables give every request V_B(s, z) for every B from its own
    latest history, which any round of any regime moves."""
    return self.switch and not self.fixed_regime and self.batch_priced and self.tables is not None

  @property
  def _ar_per_step(self) -> bool:
    """True when AR is decided per step in `plan_step` rather than by the regime switch: the batch pricing is on,
    per-request values come from fitted tables (after AR rounds, their prior), and the costs are the profile's
    alone (a calibrated switch instead re-measures a stale runner-up with probes)."""
    return self.batch_priced and self.tables is not None and not self.calibrate and self.adaptive

  def _overlaps(self, req) -> bool:
    """Whether `req` runs an overlap round when the regime is overlap: a temperature of at most
    `overlap_max_temperature` (0.3 by default), and, where the switch decides, not one this round is expected
    to finish (no next round for a prefetched branch to save a draft in) unless it holds a draft of overlap's
    block (verified in the fused forward, it costs no draft forward)."""
    return self._overlap_remaining(req) is not None

  def _overlap_remaining(self, req) -> int | None:
    """`req`'s remaining budget (`_remaining`) if it `_overlaps`, else None."""
    if req.params.temperature > self.overlap_max_temperature:
      return None
    remaining = self._remaining(req)
    if self.fixed_regime or remaining > self.stats.accepted[self.overlap_block]:
      return remaining
    # one that holds a draft of overlap's block verifies it in the fused forward: no draft forward to pay for
    state = req.strategy_state
    branch = state.prefetched if isinstance(state, RecGuideState) else None
    return remaining if branch is not None and len(branch.tokens) == self.overlap_block else None
