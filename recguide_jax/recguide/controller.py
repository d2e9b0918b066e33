"""The RecGuide controller: per request and round, overlap (light load), adaptive block size (heavier load) or
plain AR decoding, whichever gives the most tokens per unit of (profiled) time at the current concurrency.

- Overlap (docs/spec/recguide.md §4) runs for greedy requests; its branch plan comes from `overlap.plan_branches`.
- Adaptive B (§5) picks B in {8, 16, 32} per request from its verification history: with fitted value
  tables (`RecGuideTables`) by argmax_B V_B(s, z) - rho_C T_C(B); without tables, from online estimates of
  the accepted length per B and the profile's cost.
- Priced as a batch (ours): a step's requests share their rounds, and a batch of mixed blocks costs its largest
  block (padded) or one round per block (split), not each request's share of T_C(B_i). So the per-request choices
  are priced together, as the engine will batch them (`decoding.grouping`), against the plans that give every
  request the same block (each fixed B, and AR), and the step runs the plan with the most expected tokens per unit
  of (profiled) time: RecGuide never runs a step it prices below a fixed alternative.
- The switch (§6, ours): compares the expected rate of each regime, E[tokens]/E[time], using the hardware
  profile (measured here or loaded) and the engine's observed acceptance and overlap hit rates. AR (B = 1) is a
  candidate too, so speculation never runs where it loses to plain decoding. By default the profile's device times
  are calibrated online with the engine's measured round times (`calibration.py`), so host work the profile does
  not see cannot make a losing regime look like a winner, a stale runner-up is re-measured now and then so that
  machine drift cannot freeze a wrong choice, and a regime never run here is measured once so that a profile's
  wrong ratio between kinds cannot keep it out for good; pricing for another device turns all three off.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from typing import Callable, Sequence

import numpy as np

from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.decoding import grouping, rounds
from recguide_jax.decoding.strategy import (RoundKind, RoundOutcome, RoundPlan, StepPlan, StepView, Strategy,
                                            StrategyMetric)
from recguide_jax.recguide import calibration, overlap as ov, pricing, signals
from recguide_jax.recguide.estimates import OnlineStats, ValueCalibration  # noqa: F401  (OnlineStats: re-exported)
from recguide_jax.recguide.kinds import OverlapKind
from recguide_jax.recguide.overlap_round import OverlapResult, OverlapRound



class Regime(enum.StrEnum):
  """What the switch decides per step (str-valued: metrics label them so)."""
  OVERLAP = "overlap"  # verification-overlapped drafting (greedy requests)
  ADAPTIVE = "adaptive"  # LinearSS with B chosen per request
  LINEAR = "linear"  # LinearSS at the fixed block size (ablations)
  AR = "ar"


HISTORY = 4  # verification rounds a request's history keeps (the signals read the last two)
# how much more tokens per unit time a plan must be priced at to replace a cheaper one (`plan_step`): its values are
# estimates, and a gain below their error is a coin flip that can only add variance against the fixed plan. The
# bundled value model's per-B mean error on GSM8K test prompts was -4% to +3% (docs/bench_recguide_priced.md), so a
# priced gain under 1% is no gain; giving it up costs at most 1% on the steps where it applies.
TIE_MARGIN = 0.01
PAPER_DELTA = 0.5  # risky-position margin threshold of the paper (NLD-8B)


@dataclasses.dataclass(frozen=True)
class StepEstimates:
  """What one step's regime rates rest on, per request: the expected tokens of a LinearSS round per B (an overlap
  round verifies a block of the strategy's B: that block's value), the share of overlapping requests that draft in
  a round, and the rows of the step that would not overlap (they run a LinearSS round of their own)."""
  accepted: dict[int, float]
  draft_share: float
  rows_left_out: int = 0
  # the overlapping rows' own draft probabilities (1 - h_i), when the step's requests are known: the draft forward
  # is then priced by the chance that some row needs it (`pricing.expected_draft_cost`), not by their mean
  draft_shares: tuple[float, ...] = ()


@dataclasses.dataclass
class RecGuideState:
  """What RecGuide remembers of one request (`Request.strategy_state`)."""
  history: list[signals.RoundRecord] = dataclasses.field(default_factory=list)  # its last HISTORY verifications
  # a branch block its last overlap round confirmed: the next overlap round's draft (valid for that round only)
  prefetched: ov.Prefetched | None = None
  overlap: dict[str, int] = dataclasses.field(default_factory=dict)  # its overlap rounds by branch outcome


class RecGuideStrategy(Strategy):
  name = "recguide"
  plans_ar = True
  ragged_steps = False  # the last step's `StepView.ragged_steps`: a plan is priced as the engine will run it

  def __init__(self, block_size: int = 16, *, delta: float | None = None, planner: str | None = None,
               components=("p1", "p2", "continuation"),
               overlap: bool = True, adaptive: bool = True, switch: bool = True, profile=None, tables=None,
               fixed_regime: str | None = None, entropy_head_cap: int | None = None, calibrate: bool = True,
               overlap_slots: int | None = None, prefix_exponent: float | None = None, batch_priced: bool = True,
               tie_margin: float = TIE_MARGIN):
    # what `clone` builds another one from
    self._config = dict(block_size=block_size, delta=delta, planner=planner, components=components, overlap=overlap,
                        adaptive=adaptive, switch=switch, profile=profile, tables=tables, fixed_regime=fixed_regime,
                        entropy_head_cap=entropy_head_cap, calibrate=calibrate, overlap_slots=overlap_slots,
                        prefix_exponent=prefix_exponent, batch_priced=batch_priced, tie_margin=tie_margin)
    if block_size not in BLOCK_SIZES:
      raise ValueError(f"recguide block_size must be one of {BLOCK_SIZES}, got {block_size}")
    self.block_size = block_size
    if delta is None:  # the threshold fitted with the tables (launch/fit_delta.py), else the paper's
      delta = tables.overlap_delta if tables is not None and tables.overlap_delta is not None else PAPER_DELTA
    self.delta = delta
    if planner is None:  # the branch planner fitted with the tables, else the paper's no-P3 rule
      planner = tables.overlap_planner if tables is not None and tables.overlap_planner else ov.PLANNERS[0]
    if planner not in ov.PLANNERS:
      raise ValueError(f"planner must be one of {ov.PLANNERS}, got {planner!r}")
    self.planner = planner
    if overlap_slots is None:  # the tree width fitted for the expected-hit planner, else the paper's 3 branches
      fitted = tables.overlap_slots if tables is not None and planner == "expected_hit" else None
      overlap_slots = fitted or ov.MAX_BRANCHES
    if not 1 <= overlap_slots <= ov.MAX_SLOTS:
      raise ValueError(f"overlap_slots must lie in [1, {ov.MAX_SLOTS}], got {overlap_slots}")
    if planner == "no_p3" and overlap_slots < ov.MAX_BRANCHES:
      raise ValueError(f"the paper's no-P3 rule plans up to {ov.MAX_BRANCHES} branches; overlap_slots is "
                       f"{overlap_slots}")
    self.overlap_slots = overlap_slots  # branch slots of the fused forward (its width: (1 + slots) B tokens)
    if prefix_exponent is None:  # the expected-hit planner's fitted prefix exponent, else the plain product
      fitted = tables.overlap_prefix_exponent if tables is not None and planner == "expected_hit" else None
      prefix_exponent = fitted or 1.0
    if not 0.0 < prefix_exponent <= 2.0:
      raise ValueError(f"prefix_exponent must lie in (0, 2], got {prefix_exponent}")
    self.prefix_exponent = prefix_exponent
    self.components = tuple(components)
    self.overlap = overlap
    self.adaptive = adaptive
    self.switch = switch
    self.profile = profile
    self.tables = tables
    # a Regime (or its name): bypasses the switch (ablations)
    if fixed_regime and fixed_regime not in tuple(Regime):
      raise ValueError(f"fixed_regime must be one of {[r.value for r in Regime]}, got {fixed_regime!r}")
    self.fixed_regime = Regime(fixed_regime) if fixed_regime else None
    self.entropy_head_cap = entropy_head_cap
    # True: a step's adaptive plan is priced as the batch it runs as, against every fixed-B plan and AR; False: the
    # paper's per-request rule alone (the Table 6 ablation rows)
    self.batch_priced = batch_priced
    if not 0.0 <= tie_margin < 1.0:
      raise ValueError(f"tie_margin must lie in [0, 1), got {tie_margin}")
    self.tie_margin = tie_margin  # a plan replaces a cheaper one only when priced this much (relative) above it
    self.step_plans = collections.Counter()  # which plan the batch pricing chose, per step ("rule", "linear8", ...)
    self.stats = OnlineStats()
    # True: the profile's costs are corrected online by the engine's measured round times (this machine's wall
    # clock); False: decide by the profile alone (pricing a run for the hardware a foreign profile describes)
    self.calibrate = calibrate
    self.calibrated = calibration.CalibratedCosts(self._profiled_round_cost)
    # with calibration on, the fitted values are corrected online too: by what verification returns here
    self.value_calibration = ValueCalibration()
    if tables is not None:  # start the online estimates from the fitted model's unconditional values
      self.stats.accepted = {b: tables.value_model.value(b, None) for b in BLOCK_SIZES}
      # and overlap's branch reuse rate from what the fitted planner measured, where the tables carry it: a prior
      # that flatters overlap buys rounds of it at loads where it loses before the running average corrects it
      if tables.overlap_hit_rate is not None:
        self.stats.overlap_hit = tables.overlap_hit_rate
    # per (B, rows): the binomial weights of k drafting rows times the draft forward's cost at k rows relative to c
    self._draft_weights: dict[tuple[int, int], tuple[float, ...]] = {}
    self.regime_counts = collections.Counter()
    self.current_regime: Regime | None = None  # the regime of the latest step
    self.overlap_outcomes = collections.Counter()  # overlap rounds' branch outcomes ("no_branch", hits, misses)
    self.saved_drafts = 0  # draft forwards a prefetched branch replaced
    # re-measuring a stale runner-up regime (calibrated switch only): how close it must be, how much of the time
    # probes may take, probes run, the one in progress
    self.probe_margin = 0.7
    self.probe_budget = 0.02  # probes take at most this share of the time
    # a first measurement of a regime's kinds (`_probe_or_best`): at most this share of the time, for a regime
    # estimated within this factor of the best (the profile's ratios between kinds may be off that much)
    self.explore_budget = 0.1
    self.explore_margin = 0.25
    self.explore_rounds = 2 * self.calibrated.clock.min_samples
    self.probes = 0
    self._probe: tuple[str, int, str | None] | None = None  # (regime, steps left, rate key it first measures)
    self.probing = False  # this step's regime is a probe (then it runs as chosen, not re-priced as a batch)
    self._last_probe_at = -float("inf")
    self._first_decision_at: float | None = None  # when the calibrated switch first chose (spaces the first probes)
    self.overlap_round = OverlapRound(self)  # this strategy's own round kind
    self.overlap_log: list | None = None  # set to [] to record every overlap round (overlap_fit.OverlapTrace)
    self._plans = {Regime.AR: RoundPlan(rounds.AR, 1), Regime.LINEAR: RoundPlan(rounds.LINEAR, block_size),
                   Regime.OVERLAP: RoundPlan(self.overlap_round, block_size)}

  def block_sizes(self):
    return BLOCK_SIZES

  def step_kinds(self):
    from recguide_jax.runtime.runner import fused_kind
    return ("prefill", "draft", "verify", fused_kind(self.overlap_slots), "gverify")

  # ---- costs ---------------------------------------------------------------------------------------------------------
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
      prof = self.profile
      draft = (lambda k: prof.forward_costs(k, blk)[0]) if prof is not None else (lambda k: 1.0)
      return pricing.expected_draft_cost(shares, draft) / draft(c)
    if c <= 1 or share <= 0.0 or share >= 1.0:
      return min(max(share, 0.0), 1.0)
    weights = self._draft_weights.get((blk, c))
    if weights is None:  # the profile's draft forward per row count (static): once per (B, rows)
      prof = self.profile
      draft = (lambda k: prof.forward_costs(k, blk)[0]) if prof is not None else (lambda k: 1.0)
      full = draft(c)
      weights = (0.0, *(math.comb(c, k) * draft(k) / full for k in range(1, c + 1)))
      self._draft_weights[(blk, c)] = weights
    odds, total, term = share / (1.0 - share), 0.0, (1.0 - share) ** c
    for w in weights:  # term = share^k (1 - share)^(c - k), k = 0..c
      total += w * term
      term *= odds
    return total

  # ---- regime switch -------------------------------------------------------------------------------------------------
  def expected_rates(self, concurrency: int, batch=None, values=None) -> dict[str, float]:
    """Tokens per unit time per request for each regime at this concurrency, keyed "ar", "linear<B>" (adaptive
    B stands on its best block) and "overlap", priced on `step_estimates(batch, values)`."""
    return self._rates(max(concurrency, 1), self.step_estimates(batch, values))

  def _rates(self, c: int, estimates: StepEstimates) -> dict[str, float]:
    return {key: self._rate(key, c, self._round_cost, estimates)
            for key in ("ar", *(f"linear{b}" for b in BLOCK_SIZES), "overlap")}

  def step_estimates(self, batch=None, values=None) -> StepEstimates:
    """What the regime rates rest on. `batch`: the step's requests, when known (overlap's draft share is then theirs,
    `overlap_draft_share`, else the steady state's 1 - hit rate); `values`: their expected tokens per B
    (`_values`, in `batch` order), when known, else the engine-wide running estimates.

    Every regime's tokens come from one estimate of the same thing, so that only costs and the branch reuse rate
    tell overlap from LinearSS at its B: priced on a running accepted length of its own that only its rounds moved,
    overlap froze low after a hard spell and stayed off on prompts unlike the fitting set where it paid
    (docs/recguide.md, "Priced as a batch" (2)).

    The regimes are compared over the same requests: overlap's value is the mean V_B over the whole batch too (a
    request that would not overlap runs LinearSS and is worth about its V_B either way), and the requests that
    would not overlap (sampled, or finishing this round) cost overlap a LinearSS round of their own beside the
    fused one; left out, drain steps of a closed loop took overlap for the few requests not near their end."""
    blk = self.block_size
    shares = tuple(self.overlap_draft_shares(batch)) if batch and self.overlap else ()
    share = sum(shares) / len(shares) if shares else 1.0 - self.stats.overlap_hit
    left_out = sum(not self._overlaps(r) for r in batch) if batch and self.overlap else 0
    if values is None:
      return StepEstimates(self.stats.accepted, share, left_out, shares)
    return StepEstimates({b: sum(v[b] for v in values) / len(values) for b in BLOCK_SIZES}, share, left_out, shares)

  def overlap_draft_share(self, batch) -> float | None:
    """The mean of `overlap_draft_shares` (None: no request of `batch` would overlap)."""
    shares = self.overlap_draft_shares(batch)
    return sum(shares) / len(shares) if shares else None

  def overlap_draft_shares(self, batch) -> list[float]:
    """Per request of `batch` that would run overlap rounds, the share of them that pay a draft forward, from this
    step to its end.

    In its steady state an overlap round drafts only on a miss (1 - hit rate: a hit's branch is the next round's
    draft). A request that holds no prefetched branch (entering overlap, or after a miss) drafts in this round for
    sure, and a branch pays off only in a round that follows: over its R = left / accepted remaining rounds it
    drafts 1 + (R - 1)(1 - hit) times, so entering is worth it only when enough rounds are left to recover the
    draft. Priced in the steady state alone, a request with a round or two left entered overlap at the end of a
    run (B200 table, C = 32: the last request's one overlap round cost a draft and a 5-block fused forward for
    the tokens a B = 8 round gave). A request holding a branch drafts 1 - hit per round less than that."""
    hit, accepted = self.stats.overlap_hit, max(self.stats.accepted[self.block_size], 1.0)
    shares = []
    for req in batch:
      if not self._overlaps(req):
        continue
      left = max(1.0, self._remaining(req) / accepted)
      first = 0.0 if self.state(req).prefetched is not None else 1.0
      shares.append((first + (left - 1.0) * (1.0 - hit)) / left)
    return shares

  def _rate(self, rate_key: str, c: int, cost: Callable[[str, int, int], float], estimates: StepEstimates) -> float:
    """One regime's expected tokens per unit time per request, with round costs from `cost(kind, B, rows)`."""
    if rate_key == Regime.AR:
      return 1.0 / cost(RoundKind.AR, 1, c)
    if rate_key.startswith(Regime.LINEAR):
      blk = int(rate_key[len(Regime.LINEAR):])
      return estimates.accepted[blk] / cost(RoundKind.LINEAR, blk, c)
    blk = self.block_size
    fused = cost(OverlapKind.OVERLAP, blk, c)
    draft = max(cost(OverlapKind.OVERLAP_DRAFT, blk, c) - fused, 0.0)
    round_ms = fused + draft * self._draft_forward_share(blk, c, estimates.draft_share, estimates.draft_shares)
    if estimates.rows_left_out:  # their LinearSS round, at its cheapest block
      round_ms += cost(RoundKind.LINEAR, BLOCK_SIZES[0], estimates.rows_left_out)
    return estimates.accepted[blk] / round_ms

  def regime(self, concurrency: int, batch=None, values=None) -> Regime:
    """The step's regime at this load; `batch`: the step's requests, when known, `values`: their expected tokens
    per B (`step_estimates`)."""
    self.probing = False
    if self.fixed_regime:
      return self.fixed_regime
    if not self.switch:
      return Regime.OVERLAP if (self.overlap and concurrency <= 1) else Regime.ADAPTIVE
    c = max(concurrency, 1)
    estimates = self.step_estimates(batch, values)
    rates = self._rates(c, estimates)
    if not self.overlap:
      rates.pop(Regime.OVERLAP)
    # one rate per regime: adaptive B is as good as its best block size
    basis: dict[Regime, str] = {}  # regime -> the rate it stands on
    for key, rate in rates.items():
      name = Regime.ADAPTIVE if key.startswith(Regime.LINEAR) else Regime(key)
      if name not in basis or rate > rates[basis[name]]:
        basis[name] = key
    ranked = sorted(basis, key=lambda name: -rates[basis[name]])
    if ranked[0] == Regime.AR and self._ar_per_step and Regime.ADAPTIVE in basis:
      # AR is priced per step against the requests' own values (`plan_step`), which AR rounds return to the prior
      # (`observe`); here AR would rest on engine-wide acceptance estimates that only speculative rounds update, and
      # with nothing to re-measure them (no calibration probes) one unlucky spell would keep every later step in AR
      return Regime.ADAPTIVE
    if not self.calibrate or len(ranked) < 2:
      return ranked[0]
    return self._probe_or_best(ranked, basis, rates, c, estimates)

  def _clock_key(self, rate_key: str, concurrency: int) -> tuple[str, int, int]:
    """The measured round a regime's rate rests on."""
    if rate_key == Regime.AR:
      return (RoundKind.AR, 1, concurrency)
    if rate_key == Regime.OVERLAP:
      return (OverlapKind.OVERLAP, self.block_size, concurrency)
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
    machine. Without this a regime measured in a slow spell of a shared machine can lose the switch for good.
    Probes are spaced so that they take at most `probe_budget` of the time (under high load a round of the
    runner-up is long, so it is probed rarely). The margin test prices the runner-up also from fresh rounds only
    (`CalibratedCosts.fresh_cost`) and takes the more promising price: a stale median from a cold start or a slow
    spell must not keep a close regime from being re-measured.

    A regime none of whose round kinds has ever run here, ranked anywhere below the best, is probed when its
    estimate is within `explore_margin` of the best's: that estimate is the profile's cost ratio between kinds,
    and a profile of other hardware, or none, can be off several-fold. Without a profile on this CPU the generic
    costs priced an AR step at 3x what it took, the `probe_margin` never let AR run, and RecGuide held 0.67x AR's
    throughput at C = 16. Such a first measurement, one per kind, has its own budget (`explore_budget`) and is
    spaced from the first decision too, not only from the last probe, so that a long one is no large share of a
    short run either."""
    if self._probe is not None:
      regime, left, first_of = self._probe
      if first_of is None or self._never_measured(first_of):
        self._probe = (regime, left - 1, first_of) if left > 1 else None
        self.probing = True
        return regime
      self._probe = None  # a first measurement that has its median: decide as usual
    best = ranked[0]
    clock = self.calibrated.clock
    now = clock.now()
    if self._first_decision_at is None:
      self._first_decision_at = now
    if not clock.is_fresh(*self._clock_key(basis[best], c)):
      return best
    for rank, name in enumerate(ranked[1:]):
      unmeasured = self._never_measured(basis[name])
      key = self._clock_key(basis[name], c)
      if not (rank == 0 or unmeasured) or clock.is_fresh(*key):
        continue  # only the runner-up, or a regime never measured, is worth a probe
      probe_s = clock.min_samples * self._round_cost(key[0], key[1], c) / 1e3
      if unmeasured:  # a first measurement: its own budget, counted from the first decision too
        since = now - max(self._last_probe_at, self._first_decision_at)
        wait, margin = probe_s / self.explore_budget, self.explore_margin
      else:  # and never sooner than the last probe's rounds go stale
        since = now - self._last_probe_at
        wait, margin = max(clock.stale_after_s, probe_s / self.probe_budget), self.probe_margin
      if since < wait:
        continue  # checked first: it is cheap, and most steps stop here
      if self._rate(basis[name], c, self._current_cost, estimates) < margin * rates[basis[best]]:
        continue
      self._last_probe_at = now
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

  # ---- per request ---------------------------------------------------------------------------------------------------
  _eos: frozenset = frozenset()  # the engine's EOS ids, refreshed by each step's plan

  def on_admit(self, req) -> None:
    req.strategy_state = RecGuideState()

  @staticmethod
  def state(req) -> RecGuideState:
    """`req`'s RecGuide state (a fresh one for a request admitted under another strategy before a switch)."""
    if not isinstance(req.strategy_state, RecGuideState):
      req.strategy_state = RecGuideState()
    return req.strategy_state

  @staticmethod
  def _remaining(req) -> int:
    """Tokens `req` may still emit (its max_tokens budget)."""
    return req.params.max_tokens - len(req.output_ids)

  def _values(self, req) -> dict[int, float]:
    """Expected tokens of `req`'s next LinearSS round per B: the fitted value model V_B(s, z) from its history
    (unconditional before its first verification), scaled by how it has matched verification on this workload when
    calibrating (`ValueCalibration`), else the engine-wide online estimate; near the end of its budget, of the
    tokens it may still emit (a longer block buys nothing past max_tokens)."""
    left = self._remaining(req)
    if self.tables is None:
      return self.stats.accepted if left >= BLOCK_SIZES[-1] else {b: min(v, left) for b, v in self.stats.accepted.items()}
    values = self._model_values(req, left)
    if not self.calibrate:
      return values
    return {b: v * self.value_calibration.scale(b) for b, v in values.items()}

  def _model_values(self, req, left: int) -> dict[int, float]:
    """The fitted value model's V_B(s, z) of `req`'s next round (capped at `left` tokens)."""
    hist = self.state(req).history
    model = self.tables.value_model
    s, z = (signals.signal_s(hist, model.window), signals.stratum(hist)) if hist else (None, None)
    return model.values(s, z) if left >= BLOCK_SIZES[-1] else model.values_capped(s, z, left)

  def _adaptive_block(self, req, concurrency: int, costs: dict[int, float] | None = None) -> int:
    """The per-request rule. `costs`: the LinearSS round cost per B at this concurrency when the caller has them
    (one step's requests share them)."""
    if not self.adaptive:
      return self.block_size
    c = max(concurrency, 1)
    if self.tables is not None and self._tables_priced_here:
      # the paper's rule: rho is a price against the costs it was solved with, so the tables' own costs
      return self.tables.next_block(c, self.state(req).history)
    values = self._values(req)
    if costs is None:
      costs = self._linear_costs(c)
    if self.tables is not None:
      # tables priced for other hardware (the bundled ones: the B200 table) keep the rule's fitted form V - rho T on
      # this policy's own (calibrated) costs, rho carried into their time unit (`pricing.rescaled_rho`): the ratio
      # V / T, a different rule, is what the paper's own search rejected
      if not self.state(req).history:
        return self.tables.level(c).cold_start_block
      return pricing.decide_rescaled(values, self.tables.rho_for(c), self.tables.costs_for(c), costs)
    scores = {b: values[b] / costs[b] for b in BLOCK_SIZES}
    return max(BLOCK_SIZES, key=lambda b: (scores[b], -b))

  def price_step(self, reqs, concurrency: int, values=None) -> tuple[str, list[int]]:
    """The plan for a step's adaptive requests, priced as a batch: (name, block per request, 1 for AR). `values`:
    their `_values`, when the caller has them.

    Candidates: the per-request rule's blocks and the plans that give every request the same block (each B, and
    AR unless the regime is pinned). A plan's expected tokens are the sum of its requests' values (`_values`; 1
    per AR step), its cost the rounds the engine will run for it, mixed blocks batched the cheapest way
    (`grouping.plan_cost`, as the engine's "auto" grouping does), every round priced by this strategy's cost model
    (`round_cost`). The step runs the plan with the most tokens per unit time; a near-tie keeps the plan listed
    first (AR, then B ascending, then the rule: the cheaper round, and a fixed plan before the mixed one): a later
    plan replaces the best so far only when priced more than `tie_margin` above it. In a closed loop of 32 on the
    B200 table, a step of 3 drain requests priced B = 16 0.2% above B = 8 on the value model's estimates; the
    round gave the tokens B = 8 would have for 6.7% more time, and left RecGuide behind fixed B = 8 for the run."""
    c = max(concurrency, 1)
    costs = self._linear_costs(c)
    rule = [self._adaptive_block(r, c, costs) for r in reqs]
    if not self.batch_priced or self.probing or not reqs:
      return "rule", rule
    values = [self._values(r) for r in reqs] if values is None else values
    n = len(reqs)
    best_name, best_blocks, best_rate = None, rule, -1.0
    if self.switch and not self.fixed_regime:  # AR is the switch's candidate (a pinned regime stays LinearSS)
      best_name, best_blocks, best_rate = Regime.AR.value, [1] * n, n / self._round_cost(RoundKind.AR, 1, n)
    for name, blocks in [*((f"linear{b}", [b] * n) for b in BLOCK_SIZES), ("rule", rule)]:
      cost = self.plan_cost(blocks)
      rate = sum(v[b] for v, b in zip(values, blocks)) / cost
      if rate > best_rate * (1 + max(self.tie_margin, 1e-9)):
        best_name, best_blocks, best_rate = name, blocks, rate
    return best_name, best_blocks

  def plan_cost(self, blocks: Sequence[int]) -> float:
    """The cost of one step whose rows are planned at `blocks` as the engine will run it: on ragged steps
    (`ragged_steps`, set by the engine) one ragged draft + verify forward whatever the mix, priced by the profile
    (`pricing.ragged_step_cost`); else the cheapest split into padded batches (`grouping.plan_cost`)."""
    if self.ragged_steps and self.profile is not None and not self.calibrate:
      return pricing.ragged_step_cost(blocks, self.profile)
    return grouping.plan_cost(blocks, self.round_cost)

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

  @property
  def _tables_priced_here(self) -> bool:
    """True when the tables' rho was solved against this policy's profile (same profile name)."""
    return self.profile is not None and bool(self.profile.name) and self.tables.profile == self.profile.name

  def _overlaps(self, req) -> bool:
    """Whether `req` runs an overlap round when the regime is overlap: greedy requests only (the reuse rules compare
    argmaxes), and, where the switch decides, not one this round is expected to finish (no next round for a
    prefetched branch to save a draft in)."""
    if req.params.temperature > 0:
      return False
    return bool(self.fixed_regime) or self._remaining(req) > self.stats.accepted[self.block_size]

  def plan_step(self, view: StepView) -> StepPlan:
    """The step's regime (once, for the load in flight), then each request's round: overlap, AR or fixed-B
    LinearSS as the regime says, the adaptive requests' blocks priced together as the batch they run as
    (`price_step`)."""
    reqs = view.requests
    concurrency = len(reqs)
    # the regime lasts beyond this step (overlap pays a draft to enter, its branches pay off in later rounds), so
    # it is chosen for the load in flight: a step where some requests still prefill is not a lighter load (in a
    # closed loop of 8 such steps ran overlap at 3-7 decoding rows and paid a fresh draft each time)
    load = max(concurrency, view.running)
    self._eos = view.eos_token_ids
    self.ragged_steps = view.ragged_steps
    # the requests' values, once per step: the switch and the batch pricing share them
    values = [self._values(r) for r in reqs] if self._switch_on_values else None
    regime = self.current_regime = self.regime(load, reqs, values)
    plans: list[RoundPlan | None] = [None] * concurrency
    adaptive = []  # rows planned by the adaptive rule (and priced as a batch)
    for i, r in enumerate(reqs):
      mine = Regime.ADAPTIVE if regime == Regime.OVERLAP and not self._overlaps(r) else regime
      if mine in self._plans:  # overlap, ar, linear (the fixed B)
        self.regime_counts[mine] += 1
        plans[i] = self._plans[mine]
      else:
        adaptive.append(i)
    if adaptive:
      name, blocks = self.price_step([reqs[i] for i in adaptive], concurrency,
                                     None if values is None else [values[i] for i in adaptive])
      self.step_plans[name] += 1
      for i, blk in zip(adaptive, blocks):
        plans[i] = self._plans[Regime.AR] if blk == 1 else RoundPlan(rounds.LINEAR, blk)
        self.regime_counts[Regime.AR if blk == 1 else Regime.ADAPTIVE] += 1
    return StepPlan(tuple(plans))

  def plan_branches(self, draft_signals: np.ndarray, blk: int, bounds: dict) -> list:
    """One request's branches from its draft signals [3, B]; `bounds` (generated, committed, max_new, max_len) are
    what limits them this round (`OverlapRound.bounds`)."""
    if self.planner == "expected_hit":
      return ov.plan_expected_hit(draft_signals, blk, max_branches=self.overlap_slots,
                                  prefix_exponent=self.prefix_exponent, **bounds)
    return ov.plan_branches(ov.analyze(draft_signals, self.delta), blk, components=self.components, **bounds)

  def observe(self, outcome: RoundOutcome) -> None:
    """After each round: its wall time (calibration: a multi-step AR call at each step's share), each row's
    verification, and an overlap round's branch outcomes (a confirmed branch becomes the request's next draft)."""
    batch, out = outcome.batch, outcome.output
    res = out.verify
    if res is not None:
      for i, r in enumerate(batch.reqs):
        left = r.params.max_tokens - int(outcome.generated_before[i])  # its budget before this round emitted
        for _ in range(out.rounds):
          self.observe_verification(r, int(out.block[i]), int(out.accepted[i]), res, i, left)
    if isinstance(out.extra, OverlapResult):
      self._observe_overlap(batch, out, out.extra)
    self.observe_round(out.label, batch.block, batch.n, outcome.seconds / out.rounds)

  def observe_round(self, kind: str, block_size: int, rows: int, seconds: float) -> None:
    """One round's wall seconds (a multi-step call: each step's share), for the calibrated costs."""
    if self.calibrate:
      self.calibrated.clock.observe(kind, block_size, rows, seconds)

  def observe_verification(self, req, block_size: int, accepted: int, result, row: int, left: int | None = None
                           ) -> None:
    """One verification of `req` (`result` row `row`) of `block_size` that accepted `accepted`; `left`: the tokens
    it could still emit before it (default: what it can emit now)."""
    state = self.state(req)
    # a prefetched overlap branch is a draft for the round right after the one that made it: any verification,
    # of whatever kind, moves the committed state past it (an overlap round's new one is stored after this)
    state.prefetched = None
    if block_size <= 1:
      # an AR round is a round without a speculative verification: it carries no signal (s averages the entropies
      # of the last rounds that have one, z is unknown after it), so two AR rounds in a row return the request to
      # the value model's unconditional values, its prior. Without this a request that looked unsure once would be
      # priced out of speculation for good (AR rounds would leave its history as it was).
      if self.batch_priced:
        state.history.append(signals.RoundRecord(1, 1, None))
        if len(state.history) > HISTORY:
          del state.history[0]
      return
    if self.calibrate and self.tables is not None and block_size in BLOCK_SIZES:
      # what the value model predicted for this round (the history before it) against what it returned
      predicted = self._model_values(req, self._remaining(req) if left is None else left)[block_size]
      self.value_calibration.observe(block_size, predicted, accepted)
    cap = self.tables.head_cap if self.tables is not None else self.entropy_head_cap
    # a set test on a short list: np.isin took ~0.1 ms per request and round, ~2% of a C = 1 round on a CPU
    eos = not self._eos.isdisjoint(result.tokens[row, :accepted].tolist())
    state.history.append(signals.make_record(result.entropy[row], accepted, block_size, eos=eos, head_cap=cap))
    if len(state.history) > HISTORY:
      del state.history[0]
    if block_size in BLOCK_SIZES:  # an overlap round's too: it verifies a block of its B as LinearSS does
      self.stats.observe_verified(block_size, accepted)

  def _observe_overlap(self, batch, out, ovr: "OverlapResult") -> None:
    self.saved_drafts += ovr.saved_drafts
    for i, r in enumerate(batch.reqs):
      outcome = ovr.outcomes[i]
      label = "no_branch" if outcome is None else outcome.label
      self.overlap_outcomes[label] += 1
      state = self.state(r)
      state.overlap[label] = state.overlap.get(label, 0) + 1
      if outcome is not None:
        self.stats.observe_overlap(outcome.branch is not None)
      if self.overlap_log is not None and ovr.traces:
        self.overlap_log.append(ovr.traces[i])
      if outcome is not None and outcome.branch is not None and not r.finished:
        state.prefetched = ovr.prefetch[i]

  def metrics(self) -> list[StrategyMetric]:
    counts = dict(self.regime_counts)
    outcomes = dict(self.overlap_outcomes)
    known = [*ov.HIT_OUTCOMES, *ov.MISS_OUTCOMES, "no_branch"]
    return [
        StrategyMetric("regime_decisions", "RecGuide switch decisions: request rounds planned by regime.", "counter",
                       [(r.value, counts.get(r, 0)) for r in Regime]
                       + sorted((str(k), v) for k, v in counts.items() if k not in tuple(Regime)), "regime"),
        StrategyMetric("regime_probes", "RecGuide re-measurements of a close runner-up regime.", "counter",
                       self.probes),
        StrategyMetric("regime", "1 for the regime the switch chose at the latest step.", "gauge",
                       [(r.value, 1.0 if self.current_regime == r else 0.0) for r in Regime], "regime"),
        StrategyMetric("overlap_rounds", "RecGuide overlap rounds by branch outcome (hits: a branch became the "
                       "next draft).", "counter", [(k, outcomes.get(k, 0)) for k in known]
                       + sorted((k, v) for k, v in outcomes.items() if k not in known), "outcome"),
        StrategyMetric("overlap_hits", "Fused rounds whose branch became the next draft (RecGuide).", "counter",
                       sum(outcomes.get(k, 0) for k in ov.HIT_OUTCOMES), legacy=True),
        StrategyMetric("overlap_misses", "Fused rounds whose branches were all discarded (RecGuide).", "counter",
                       sum(outcomes.get(k, 0) for k in ov.MISS_OUTCOMES), legacy=True),
        StrategyMetric("overlap_saved_drafts", "Draft forwards skipped because a reused branch was the draft.",
                       "counter", self.saved_drafts),
    ]

  def clone(self) -> "RecGuideStrategy":
    """A fresh strategy of the same configuration (the fitted tables and the profile are read-only and shared)."""
    return type(self)(**self._config)

