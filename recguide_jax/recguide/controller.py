"""RecGuide's strategy: per step, overlap (light load), adaptive block size (heavier load) or plain AR decoding,
whichever gives the most tokens per unit of (profiled) time at the load (docs/spec/recguide.md). This module is the
thin strategy: it plans a step as data (`plan_step`: the regime once, then each request's round), observes each
round's outcome (verification histories, overlap branches, calibration) and exports its metrics. The concerns live
beside it: `config` (what it is built with, resolved against the fitted tables), `costs` (the cost model and its
online calibration), `switch` (the regime switch and its probes), `rule` (the adaptive block size and the batch
pricing), `overlap` / `overlap_round` (the overlap planner and round).
"""

from __future__ import annotations

import collections
import dataclasses
import operator

import numpy as np

from recguide_jax.decoding import rounds
from recguide_jax.decoding.strategy import (AheadPlan, RoundOutcome, RoundPlan, StepPlan, StepView, Strategy,
                                            StrategyMetric)
from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide import calibration, overlap as ov, pricing, signals
from recguide_jax.recguide.config import HISTORY, RecGuideConfig, RecGuideState, Regime
from recguide_jax.recguide.costs import CostModel
from recguide_jax.recguide.estimates import OnlineStats, ValueCalibration
from recguide_jax.recguide.histories import Histories
from recguide_jax.recguide.overlap_round import OverlapResult, OverlapRound
from recguide_jax.recguide.rule import AdaptiveRule, block_columns
from recguide_jax.recguide.switch import RegimeSwitch


_STATE, _HISTORIES, _ROW = (operator.attrgetter(a) for a in ("strategy_state", "histories", "row"))


class RecGuideStrategy(AdaptiveRule, RegimeSwitch, CostModel, Strategy):
  name = "recguide"
  plans_ar = True
  ragged_steps = False  # the last step's `StepView.ragged_steps`: a plan is priced as the engine will run it

  def __init__(self, block_size: int = 16, **options):
    """`options`: the other `RecGuideConfig` fields (delta, planner, overlap_slots, profile, tables, calibrate, ...)."""
    self.config = RecGuideConfig(block_size, **options)
    for field in dataclasses.fields(self.config):  # the resolved configuration, read as the strategy's attributes
      setattr(self, field.name, getattr(self.config, field.name))
    self.step_plans = collections.Counter()  # which plan the batch pricing chose, per step ("rule", "linear8", ...)
    self.stats = OnlineStats()
    # True: the profile's costs are corrected online by the engine's measured round times (this machine's wall
    # clock); False: decide by the profile alone (pricing a run for the hardware a foreign profile describes)
    self.calibrated = calibration.CalibratedCosts(self._profiled_round_cost)
    # with calibration on, the fitted values are corrected online too: by what verification returns here
    self.value_calibration = ValueCalibration()
    tables = self.tables
    if tables is not None:  # start the online estimates from the fitted model's unconditional values
      self.stats.accepted = {b: tables.value_model.value(b, None) for b in BLOCK_SIZES}
      # and overlap's branch reuse rate from what the fitted planner measured, where the tables carry it: a prior
      # that flatters overlap buys rounds of it at loads where it loses before the running average corrects it
      # (fitted at one block, the prior of every block: at B = 8 the bundled model reuses more, 0.55 vs 0.49)
      if tables.overlap_hit_rate is not None:
        self.stats.overlap_hit = {b: tables.overlap_hit_rate for b in BLOCK_SIZES}
    self.histories = Histories()  # each request's verification history, a row per request (`RecGuideState.row`)
    self._lent: dict[RecGuideState, int] = {}  # rows lent to finished requests while a round of them is observed
    self.regime_counts = collections.Counter()
    self.current_regime: Regime | None = None  # the regime of the latest step
    # (load, regime): the switch's decision for the next step, made in `plans_ahead`, that plan_step takes
    self._decided_ahead: tuple[int, Regime] | None = None
    self.overlap_outcomes = collections.Counter()  # overlap rounds' branch outcomes ("no_branch", hits, misses)
    self.saved_drafts = 0  # draft forwards a prefetched branch replaced
    # re-measuring a stale runner-up regime (calibrated switch only): how close it must be, how much of the time
    # probes may take, probes run, the one in progress
    self.probe_margin = 0.7
    self.probe_budget = 0.02  # probes take at most this share of the engine's busy time
    # a first measurement of a regime's kinds (`_probe_or_best`): at most this share of the busy time, for a regime
    # estimated within this factor of the best (the profile's ratios between kinds may be off that much)
    self.explore_budget = 0.1
    self.explore_margin = 0.25
    self.explore_rounds = 2 * self.calibrated.clock.min_samples
    self.probes = 0
    self._probe: tuple[str, int, str | None] | None = None  # (regime, steps left, rate key it first measures)
    self.probing = False  # this step's regime is a probe (then it runs as chosen, not re-priced as a batch)
    self._probe_basis: str | None = None  # the rate key the probe in progress measures ("ar", "linear<B>", ...)
    self._last_probe_at = -float("inf")  # wall clock
    self._last_probe_busy = -float("inf")  # the clock's busy seconds then
    self._first_decision_busy: float | None = None  # busy seconds when the switch first chose (spaces first probes)
    # the request list of the last AR round that left every state of it settled (no prefetched branch, a history
    # all AR records): a pipelined AR call's successor is the same list, and its round changes no state
    self._ar_settled: list | None = None
    self.overlap_round = OverlapRound(self)  # this strategy's own round kind
    self.overlap_log: list | None = None  # set to [] to record every overlap round (overlap_fit.OverlapTrace)
    self._overlap_plans = {b: RoundPlan(self.overlap_round, b) for b in BLOCK_SIZES}
    self._plans = {Regime.AR: RoundPlan(rounds.AR, 1), Regime.LINEAR: RoundPlan(rounds.LINEAR, self.block_size),
                   Regime.OVERLAP: self._overlap_plans[self.block_size]}
    # the block overlap runs at: the switch's best priced one as of its latest decision
    self.overlap_block = self.block_size
    self._linear_plans = {b: RoundPlan(rounds.LINEAR, b) for b in BLOCK_SIZES}  # the adaptive rule's

  def block_sizes(self):
    return BLOCK_SIZES

  def step_kinds(self):
    from recguide_jax.runtime.step_key import fused_kind
    return ("prefill", "draft", "verify", fused_kind(self.overlap_slots), "gverify")

  _eos: frozenset = frozenset()  # the engine's EOS ids, refreshed by each step's plan

  def on_admit(self, req) -> None:
    self.on_finish(req)  # (a preempted request is admitted again: its old state gives its row back)
    req.strategy_state = RecGuideState()
    req.strategy_state.join(self.histories)

  def on_finish(self, req) -> None:
    state = req.strategy_state
    if type(state) is RecGuideState and state.histories is self.histories:
      state.leave()

  def state(self, req) -> RecGuideState:
    """`req`'s RecGuide state, a row of this strategy's `histories` (a fresh state for a request admitted under
    another strategy before a switch; one of another RecGuide strategy's, or made with a history, joins them)."""
    state = req.strategy_state
    if type(state) is not RecGuideState:
      state = req.strategy_state = RecGuideState()
    if state.histories is not self.histories and not state.left:
      state.join(self.histories)
    return state

  def _rows(self, reqs) -> np.ndarray:
    """Each of `reqs`' row of `histories` (`state`). A request that finished before a round of it is observed (its
    last round, or a pipelined call's row after that) is lent a row holding its history for the observation
    (`_give_back_lent`): it is observed as it was while running."""
    h = self.histories
    try:  # every state already in `histories` (the steady state): read at C speed
      states = list(map(_STATE, reqs))
      if states and states[0].histories is h and len(set(map(_HISTORIES, states))) == 1:
        return np.fromiter(map(_ROW, states), np.int64, len(states))
    except AttributeError:  # a request with another strategy's state
      pass
    rows = np.empty(len(reqs), np.int64)
    for i, req in enumerate(reqs):
      state = self.state(req)
      if state.left:
        if state not in self._lent:
          self._lent[state] = h.allocate(state.history)
        rows[i] = self._lent[state]
      else:
        rows[i] = state.row
    return rows

  def _give_back_lent(self) -> None:
    """The rows `_rows` lent to finished requests, back, each one's history kept in its state."""
    h = self.histories
    for state, row in self._lent.items():
      state.history, state.prefetched = h.records(row), None
      h.release(row)
    self._lent.clear()

  def plan_step(self, view: StepView) -> StepPlan:
    """The step's regime (once, for the load in flight), then each request's round: overlap, AR or fixed-B
    LinearSS as the regime says, the adaptive requests' blocks priced together as the batch they run as
    (`price_step`)."""
    reqs = view.requests
    concurrency = len(reqs)
    # chosen for the load in flight, not this step's decoding rows: the regime outlasts the step, and a step where
    # some requests still prefill is no lighter load (docs/recguide.md, "Priced as a batch" (4))
    load = max(concurrency, view.running)
    self._eos = view.eos_token_ids
    self.ragged_steps = view.ragged_steps
    # the requests' values, once per step: the switch and the batch pricing share them
    values = self._value_rows(reqs) if self._switch_on_values else None
    ahead, self._decided_ahead = self._decided_ahead, None
    # a decision is made once per step: the one `plans_ahead` made for this load stands
    regime = ahead[1] if ahead is not None and ahead[0] == load else self.regime(load, reqs, values)
    self.current_regime = regime
    if regime != Regime.OVERLAP and regime in self._plans:  # ar, linear (the fixed B): every row alike
      self.regime_counts[regime] += concurrency
      return StepPlan.uniform(self._plans[regime], concurrency)
    plans: list[RoundPlan | None] = [None] * concurrency
    adaptive = []  # rows planned by the adaptive rule (and priced as a batch)
    overlap_plan = self._overlap_plans[self.overlap_block]
    for i, r in enumerate(reqs):
      if regime == Regime.OVERLAP and self._overlaps(r):
        self.regime_counts[Regime.OVERLAP] += 1
        plans[i] = overlap_plan
      else:
        adaptive.append(i)
    if adaptive:
      mine = [reqs[i] for i in adaptive]
      truncates = self.verify_truncation and view.ragged_steps and self.profile is not None
      # their values, once: the batch pricing and the verify price share them
      mine_values = (values[adaptive] if values is not None
                     else self._value_rows(mine) if truncates else None)
      name, blocks = self.price_step(mine, concurrency, mine_values)
      self.step_plans[name] += 1
      linear = self._linear_plans
      if truncates:
        price = self._verify_price(blocks, mine_values)
        if price > 0:
          linear = {b: dataclasses.replace(p, verify_price=price) for b, p in linear.items()}
      for i, blk in zip(adaptive, blocks):
        plans[i] = self._plans[Regime.AR] if blk == 1 else linear.get(blk) or RoundPlan(rounds.LINEAR, blk)
        self.regime_counts[Regime.AR if blk == 1 else Regime.ADAPTIVE] += 1
    return StepPlan(tuple(plans))

  def _verify_price(self, blocks, values) -> float:
    """The verify price of a ragged step's rows planned at `blocks` (`values`: their requests' `_value_rows`), on the
    scale of the draft's running confidence: its expected tokens (the values at their blocks, 1 per AR row) over
    its profiled cost, times the cost of its verify's last query token (`pricing.verify_token_price`), through the
    fitted calibration P(accepted) ~ confidence^gamma (`verify_confidence_exponent`)."""
    blocks = np.asarray(blocks)
    drafted = np.flatnonzero(blocks > 1)  # AR rows: one token each
    tokens = float(values[drafted, block_columns(blocks[drafted])].sum()) + float(len(blocks) - len(drafted))
    price = pricing.verify_token_price(blocks, tokens, self.profile)
    return min(price, 1.0) ** (1.0 / self.verify_confidence_exponent)

  def plans_ahead(self, batch) -> AheadPlan | None:
    """The switch decides the step after `batch`'s now, one step late (on what was observed before `batch`'s round),
    and that step runs `batch`'s round again when the decision is the same AR or fixed-B LinearSS regime, or the
    adaptive regime whose batch pricing plans some row a drafted block: its rule reads the histories one round late
    (any block is lossless). The rows keep their blocks in `batch` unless the round runs each row at its own
    (`Round.replans_rows`, a ragged step): then they take the blocks planned now, with the verify prices those
    blocks set. Overlap steps are not planned ahead (an overlap round's draft is the branch its predecessor's
    verification confirms), nor adaptive steps whose blocks change in a padded round (planned after `batch`'s
    outcome, on the fresh histories)."""
    regime = self.current_regime
    if regime == Regime.ADAPTIVE:
      if batch.round is not rounds.LINEAR and batch.round is not rounds.RAGGED:
        return None
    else:
      plan = self._plans.get(regime) if regime in (Regime.AR, Regime.LINEAR) else None
      if (plan is None or batch.round not in (plan.round, plan.round.ragged_round)
          or not (batch.planned == plan.block_size).all()):
        return None
    load = batch.n  # the engine asks only when the batch is the whole decoding set and nothing waits
    # the requests' values, once: the switch, the batch pricing and a ragged step's verify prices share them
    truncates = batch.round.replans_rows and self.verify_truncation and self.profile is not None
    values = self._value_rows(batch.reqs) if self._switch_on_values or truncates else None
    decided = self.regime(load, batch.reqs, values if self._switch_on_values else None)
    if decided != regime:
      self._decided_ahead = (load, decided)
      return None
    if regime != Regime.ADAPTIVE:
      self.regime_counts[regime] += load
      return AheadPlan.again(batch)
    name, blocks = self.price_step(batch.reqs, load, values)
    if blocks == batch.planned.tolist():
      ahead = AheadPlan.again(batch)
    elif batch.round.replans_rows and max(blocks) > 1:
      planned = np.asarray(blocks, np.int64)
      verify_price = None
      if truncates:  # as `plan_step` prices them
        price = self._verify_price(planned, values)
        verify_price = np.where(planned > 1, price, 0.0) if price > 0 else None
      ahead = AheadPlan(planned, verify_price)
    else:
      self._decided_ahead = (load, decided)  # the regime stands; the blocks are planned on the fresh histories
      return None
    self.step_plans[name] += 1
    ar_rows = int((ahead.planned <= 1).sum())
    self.regime_counts[Regime.AR] += ar_rows
    self.regime_counts[Regime.ADAPTIVE] += load - ar_rows
    return ahead

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
      block = np.asarray(out.block)
      if (block <= 1).all():  # AR rows only (a decode call): nothing but their histories to move
        self._observe_ar(batch.reqs, out.rounds)
      else:
        # each row's budget before this round emitted (the engine's per-request rows hold max_tokens)
        lefts = batch.request_rows.max_tokens - np.asarray(outcome.generated_before)
        accepted = np.asarray(out.accepted)
        if out.verified is not None:  # a truncated verify that accepted all it ran says no more than its length
          block = np.where((out.verified < block) & (accepted >= out.verified), out.verified, block)
        reqs, rows = batch.reqs, None
        if out.drafting is not None:  # rows that drafted verified nothing
          rows = np.flatnonzero(~out.drafting)
          reqs, block, accepted, lefts = [reqs[i] for i in rows.tolist()], block[rows], accepted[rows], lefts[rows]
        self.observe_verifications(reqs, block, accepted, res, lefts, out.rounds, rows=rows)
    if isinstance(out.extra, OverlapResult):
      self._observe_overlap(batch, out, out.extra)
    self.observe_round(out.label, batch.block, batch.n, outcome.seconds / out.rounds, out.rounds)

  def observe_verification(self, req, block_size: int, accepted: int, result, row: int, left: int | None = None,
                           rounds: int = 1) -> None:
    """`rounds` verifications of `req` (`result` row `row`) of `block_size` that accepted `accepted` each (a
    multi-step AR call's steps); `left`: the tokens it could still emit before them (default: what it can emit
    now)."""
    self.observe_verifications([req], [block_size], [accepted], result, [left], rounds, rows=[row])

  def observe_verifications(self, reqs, blocks, accepted, result, lefts, rounds: int = 1, rows=None) -> None:
    """`observe_verification` of each of `reqs` at once (`result` rows `rows`, default 0..len - 1), their rounds'
    signals (entropies, EOS) computed together and written into their `histories` rows as one scatter. The running
    estimates move as they did one request at a time, in order."""
    rows = np.arange(len(reqs)) if rows is None else np.asarray(rows, np.int64)
    blocks, accepted = np.asarray(blocks, np.int64), np.asarray(accepted, np.int64)
    at = self._rows(reqs)
    # a prefetched overlap branch is a draft for the round right after the one that made it: any verification, of
    # whatever kind, moves the committed state past it (an overlap round's new one is stored after this)
    self.histories.drop_prefetched(at)
    drafted = np.flatnonzero(blocks > 1)
    self.stats.observe_verified_rounds(blocks, accepted, rounds)
    if len(drafted):
      self._observe_drafted(reqs, drafted, at[drafted], blocks[drafted], accepted[drafted], rows[drafted], result,
                            lefts, rounds)
    ar = np.flatnonzero(blocks <= 1)
    if len(ar):  # AR rows: their histories move as `_observe_ar` moves them
      self._observe_ar([reqs[i] for i in ar.tolist()], rounds, at[ar])
    self._ar_settled = None
    self._give_back_lent()

  def _observe_drafted(self, reqs, drafted, at, blocks, accepted, rows, result, lefts, rounds: int) -> None:
    """`observe_verifications` of its drafted rows (`reqs[drafted]`, `histories` rows `at`, `result` rows `rows`)."""
    # EOS among each round's accepted tokens (its entropy then averages one position less)
    tokens = result.tokens[rows]
    eos = (tokens[:, :, None] == np.fromiter(self._eos, np.int64, len(self._eos))).any(axis=2)
    eos &= np.arange(tokens.shape[1])[None, :] < accepted[:, None]
    cap = self.tables.head_cap if self.tables is not None else self.entropy_head_cap
    entropy = signals.round_entropies(result.entropy[rows], accepted, blocks, eos.any(axis=1), cap)  # NaN: none
    h = self.histories
    # `ValueCalibration`: what the value model predicted for each round (from the history before it) against what
    # verification returned; a multi-round call's later rounds each from the history before them
    predicts = ((blocks[:, None] == np.asarray(BLOCK_SIZES)[None, :]).any(axis=1)
                if self.calibrate and self.tables is not None else np.zeros(len(blocks), bool))
    known = np.flatnonzero(predicts)
    if len(known):
      left = (lefts[drafted[known]] if isinstance(lefts, np.ndarray) else
              np.fromiter((self._remaining(reqs[i]) if lefts[i] is None else lefts[i]
                           for i in drafted[known].tolist()), np.int64, len(known)))
      columns = block_columns(blocks[known])
      predicted = []
      for k in range(rounds):
        if k:
          h.append(at[known], blocks[known], accepted[known], entropy[known])
        predicted.append(self._model_value_rows(at[known], left)[np.arange(len(known)), columns])
      h.append(at[known], blocks[known], accepted[known], entropy[known])
      # in request order, each request's rounds in turn: as one request at a time moved the running sums
      self.value_calibration.observe_rounds(np.repeat(blocks[known], rounds).tolist(),
                                            np.stack(predicted, axis=1).ravel().tolist(),
                                            np.repeat(accepted[known], rounds).tolist())
    rest = np.flatnonzero(~predicts)
    if len(rest):
      h.append(at[rest], blocks[rest], accepted[rest], entropy[rest], times=rounds)

  def _observe_ar(self, reqs, rounds: int, at: np.ndarray | None = None) -> None:
    """`rounds` AR verifications of each of `reqs` (`at`: their `histories` rows, when read already). They drop a
    prefetched branch, as any verification does. An AR round carries no signal, so two in a row return a request
    to the value model's prior: otherwise a request that looked unsure once would be priced out of speculation
    for good."""
    if reqs is self._ar_settled:
      return  # none of their states changed since (`observe_verifications` and `_observe_overlap` clear it)
    h = self.histories
    at = self._rows(reqs) if at is None else at
    h.drop_prefetched(at)
    if self.batch_priced:
      h.append(at[h.ar_tail[at] < HISTORY], 1, 1, np.nan, times=rounds)
    settled = not self.batch_priced or rounds >= HISTORY or (h.ar_tail[at] >= HISTORY).all()
    self._ar_settled = reqs if settled and not self._lent else None
    self._give_back_lent()

  def _observe_overlap(self, batch, out, ovr: "OverlapResult") -> None:
    self.saved_drafts += ovr.saved_drafts
    if self.overlap_log is not None:
      self.overlap_log.extend(ovr.traces)
    drafting = out.drafting
    for i, r in enumerate(batch.reqs):
      state = self.state(r)
      outcome = ovr.outcomes[i]
      if drafting is None or not drafting[i]:  # a verification: its branches' outcome
        label = "no_branch" if outcome is None else outcome.label
        self.overlap_outcomes[label] += 1
        state.overlap[label] = state.overlap.get(label, 0) + 1
        if outcome is not None:
          self.stats.observe_overlap(batch.block, outcome.branch is not None)
      if ovr.prefetch[i] is not None and not r.finished:  # a confirmed branch, or the request's own new draft
        state.prefetched = ovr.prefetch[i]
        self._ar_settled = None

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
                       sum(outcomes.get(k, 0) for k in ov.HIT_OUTCOMES)),
        StrategyMetric("overlap_misses", "Fused rounds whose branches were all discarded (RecGuide).", "counter",
                       sum(outcomes.get(k, 0) for k in ov.MISS_OUTCOMES)),
        StrategyMetric("overlap_saved_drafts", "Draft forwards skipped because a reused branch was the draft.",
                       "counter", self.saved_drafts),
    ]

  def clone(self) -> "RecGuideStrategy":
    """A fresh strategy of the same configuration (the fitted tables and the profile are read-only and shared)."""
    return type(self)(**{f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)})

