"""The RecGuide controller end to end: lossless at every load and regime, bucketing on and off, fitted tables in
the loop, and the load/hardware-aware switch choosing AR where speculation would lose."""

import collections

import numpy as np
import pytest

from recguide_jax import SamplingParams

from recguide_jax.decoding.builtin import ARStrategy
from recguide_jax.decoding.strategy import StepPlan
from recguide_jax.recguide.controller import RecGuideStrategy
from recguide_jax.recguide.profile import HardwareProfile

PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in np.tile(rng.integers(4, 128, int(rng.integers(1, 4))), 20)[:int(rng.integers(2, 30))]]
          for _ in range(n)]


def flat_profile(ar_ms=None):
  # speculation is cheap here: a B=32 round costs barely more than B=8 at every load
  rows = {c: {8: 10.0 + c, 16: 10.5 + c, 32: 11.0 + c} for c in (1, 2, 4, 8)}
  return HardwareProfile(draft_verify_ms=rows, name="flat", ar_step_ms=None if ar_ms is None else
                         {c: ar_ms for c in (1, 2, 4, 8)})


def clocked_strategy(t: list[float], ar_ms: float = 9.0) -> RecGuideStrategy:
  """A calibrated RecGuide without overlap on `flat_profile(ar_ms)`, its clock reading t[0], every B accepting 4."""
  pol = RecGuideStrategy(16, profile=flat_profile(ar_ms=ar_ms), overlap=False)
  pol.calibrated.clock.now = lambda: t[0]
  pol.stats.accepted = {8: 4.0, 16: 4.0, 32: 4.0}
  return pol


def measure(pol, kind, blk, ms, rows=1, n=3):
  """`n` rounds of `ms` each on `pol`'s clock."""
  for _ in range(n):
    pol.observe_round(kind, blk, rows, ms / 1e3)


@pytest.fixture(scope="module")
def ar_reference(tiny_llm):
  ps = prompts(8, 11)
  tiny_llm.set_policy(ARStrategy())
  return ps, [o.outputs[0].token_ids for o in tiny_llm.generate(ps, PARAMS)]


def run_with_concurrency(llm, ps, concurrency):
  from recguide_jax import benchmarks as bench
  reqs, _ = bench.run_concurrent(llm.engine, ps, PARAMS, concurrency)
  assert llm.engine.allocator.num_used == 0
  assert llm.engine.strategy.histories.in_use == 0  # every finished request gave its history row back
  return reqs


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_recguide_switch_is_lossless(tiny_llm, ar_reference, concurrency):
  ps, ar = ar_reference
  pol = RecGuideStrategy(16, delta=0.6, profile=flat_profile())
  tiny_llm.set_policy(pol)
  reqs = run_with_concurrency(tiny_llm, ps, concurrency)
  assert [r.output_ids for r in reqs] == ar
  assert sum(pol.regime_counts.values()) > 0


@pytest.mark.parametrize("bucketing", [True, False])
def test_adaptive_blocks_lossless_with_and_without_bucketing(tiny_llm, ar_reference, bucketing):
  ps, ar = ar_reference
  pol = RecGuideStrategy(16, fixed_regime="adaptive", profile=flat_profile())
  pol.stats.accepted = {8: 2.0, 16: 2.05, 32: 2.1}  # nearly tied values: every round re-decides per request
  tiny_llm.set_policy(pol)
  tiny_llm.engine.bucketing = bucketing
  try:
    reqs = run_with_concurrency(tiny_llm, ps, 8)
  finally:
    tiny_llm.engine.bucketing = True
  assert [r.output_ids for r in reqs] == ar
  for r in reqs:  # a padded mixed batch never lets a request accept past its own planned block
    assert all(a <= b for a, b in zip(r.stats.accepted_lengths, r.stats.block_sizes))


def test_switch_prefers_ar_when_speculation_loses():
  cheap_ar = flat_profile(ar_ms=1.0)
  pol = RecGuideStrategy(16, profile=cheap_ar)
  pol.stats.accepted = {8: 1.5, 16: 1.6, 32: 1.7}
  assert pol.regime(8) == "ar"
  costly_ar = flat_profile(ar_ms=9.0)
  pol = RecGuideStrategy(16, profile=costly_ar)
  pol.stats.accepted = {8: 6.0, 16: 9.0, 32: 12.0}
  pol.stats.overlap_hit = {8: 0.6, 16: 0.6, 32: 0.6}
  assert pol.regime(1) in ("overlap", "adaptive")
  rates = pol.expected_rates(1)
  assert rates["ar"] < max(rates.values())


def test_fitted_tables_drive_the_block_choice(tiny_llm, ar_reference, tmp_path):
  from recguide_jax.recguide import adaptive
  from recguide_jax.recguide.fit import rho_search, value_fit
  rng = np.random.default_rng(0)
  rows = []
  for req in range(40):  # synthetic traces: confident history (high s) means long acceptance
    for t in range(6):
      s = -float(rng.uniform(0.1, 3.0))
      good = s > -1.0
      a8, a16, a32 = (8, 16, 30) if good else (2, 2, 2)
      rows.append({"dataset": "syn", "request_id": req, "round": t, "s": s if t else None,
                   "z": "b16_partial" if t else None, "A": {"8": a8, "16": a16, "32": a32}})
  model = value_fit.fit_value_model(rows, bins=4)
  assert model.value(32, -0.5, "b16_partial") > model.value(32, -2.5, "b16_partial")
  ps, ar = ar_reference
  prof = flat_profile()
  groups = rho_search.group_rows(rows)
  levels = []
  for c in (1, 8):
    costs = prof.costs(c)
    sol = rho_search.solve_rho(groups, model, costs)
    levels.append(adaptive.LevelTable(concurrency=c, rho=sol.rho, cold_start_block=adaptive.cold_start_block(c),
                                       costs_ms=costs))
  tables = adaptive.RecGuideTables(value_model=model, levels=tuple(levels), profile="flat")
  tables.save(tmp_path)
  loaded = adaptive.load_tables(tmp_path)
  pol = RecGuideStrategy(16, fixed_regime="adaptive", tables=loaded, profile=prof)
  tiny_llm.set_policy(pol)
  reqs = run_with_concurrency(tiny_llm, ps, 8)
  assert [r.output_ids for r in reqs] == ar
  assert {b for r in reqs for b in r.stats.block_sizes} <= {8, 16, 32}


class _AlternatingRegimes(RecGuideStrategy):
  """Per request: overlap (its draft), overlap, overlap (a branch reused), AR, overlap (a draft), LinearSS, ... A
  prefetched draft must not outlive the round right after the one that made it."""
  SCHEDULE = ("overlap", "overlap", "overlap", "ar", "overlap", "linear")

  def plan_step(self, view):
    plans = []
    for req in view.requests:
      done = self.planned_rounds[req.request_id]
      self.planned_rounds[req.request_id] += 1
      k = done % len(self.SCHEDULE)
      if done and k in (4, 0):  # the previous round of this request was AR / LinearSS
        self.stale += self.state(req).prefetched is not None
      kind = self.SCHEDULE[k]
      self.regime_counts[kind] += 1
      plans.append(self._plans[kind])
    return StepPlan(tuple(plans))


def test_prefetched_branches_do_not_survive_a_regime_switch(tiny_llm):
  ps = prompts(16, 5)
  params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
  tiny_llm.set_policy(ARStrategy())
  ar = [o.outputs[0].token_ids for o in tiny_llm.generate(ps, params)]
  pol = _AlternatingRegimes(8, delta=1.0, planner="expected_hit")
  pol.stale = 0
  pol.planned_rounds = collections.Counter()
  tiny_llm.set_policy(pol)
  assert [o.outputs[0].token_ids for o in tiny_llm.generate(ps, params)] == ar
  assert {"overlap", "ar", "linear"} <= set(pol.regime_counts)
  assert pol.saved_drafts > 0 and pol.stale == 0
  assert tiny_llm.engine.allocator.num_used == 0


def test_round_clock_keeps_a_robust_recent_median():
  from recguide_jax.recguide.calibration import RoundClock
  clock = RoundClock(window=4, min_samples=3)
  clock.observe("ar", 1, 2, 0.001)
  clock.observe("ar", 1, 2, 0.001)
  assert clock.median("ar", 1, 2) is None  # too few rounds to trust
  clock.observe("ar", 1, 2, 0.500)  # one stall (a GC pause) does not move the median
  assert clock.median("ar", 1, 2) == pytest.approx(1.0)
  for _ in range(3):  # the window forgets old rounds
    clock.observe("ar", 1, 2, 0.004)
  assert clock.median("ar", 1, 2) == pytest.approx(4.0)
  assert clock.median("ar", 1, 4) is None and clock.median("linear", 1, 2) is None
  with pytest.raises(ValueError):
    RoundClock(window=2, min_samples=3)


def test_round_clock_starts_a_stale_key_afresh():
  from recguide_jax.recguide.calibration import RoundClock
  t = [0.0]
  clock = RoundClock(window=8, min_samples=3, stale_after_s=2.0, now=lambda: t[0])
  assert clock.age("linear", 8, 1) == float("inf") and not clock.is_fresh("linear", 8, 1)
  for _ in range(3):
    clock.observe("linear", 8, 1, 0.009)  # a slow spell
  assert clock.median("linear", 8, 1) == pytest.approx(9.0) and clock.is_fresh("linear", 8, 1)
  t[0] = 1.5
  clock.observe("linear", 8, 1, 0.005)  # within stale_after_s: joins the window
  assert clock.median("linear", 8, 1) == pytest.approx(9.0) and clock.age("linear", 8, 1) == 0.0
  t[0] = 4.0
  assert clock.age("linear", 8, 1) == pytest.approx(2.5) and not clock.is_fresh("linear", 8, 1)
  assert clock.median("linear", 8, 1) == pytest.approx(9.0)  # kept until the key runs again
  clock.observe("linear", 8, 1, 0.005)
  assert clock.median("linear", 8, 1) is None  # the old spell's rounds are gone; too few new ones yet
  clock.observe("linear", 8, 1, 0.005)
  clock.observe("linear", 8, 1, 0.005)
  assert clock.median("linear", 8, 1) == pytest.approx(5.0)
  with pytest.raises(ValueError):
    RoundClock(stale_after_s=0.0)


def test_switch_re_measures_a_stale_runner_up():
  """A regime measured in a slow spell of the machine would look slow forever once it stops running; the switch
  re-runs the runner-up for a few steps when its measurement is stale and the best's is fresh."""
  t = [0.0]
  pol = clocked_strategy(t)
  measure(pol, "ar", 1, 2.0)  # 0.5 tokens/ms
  for b in (8, 16, 32):
    measure(pol, "linear", b, 9.0)  # 4 tokens in 9 ms: 0.44 tokens/ms, within the probe margin of AR
  assert [pol.regime(1) for _ in range(3)] == ["ar"] * 3 and pol.probes == 0  # both fresh: no probe
  t[0] = 3.0
  measure(pol, "ar", 1, 2.0)  # AR keeps running; the LinearSS rounds of the slow spell are now stale
  assert [pol.regime(1) for _ in range(3)] == ["adaptive"] * 3 and pol.probes == 1  # min_samples steps
  measure(pol, "linear", 8, 5.0)  # the probe's rounds, in today's state of the machine: 0.8 tokens/ms
  assert pol.regime(1) == "adaptive" and pol.calibrated.clock.median("linear", 8, 1) == pytest.approx(5.0)
  assert pol.probes == 1
  # probes take at most probe_budget of the engine's busy time (a long runner-up round is probed rarely), and idle
  # time is not busy: a short burst after a pause does not buy a probe
  t[0] = 6.0
  measure(pol, "linear", 8, 6.0)  # LinearSS is now the best (0.67 tokens/ms), AR (0.5) is stale
  pol.probe_budget = 0.001  # 3 AR rounds of 2 ms: one probe per 6 s of work at most
  assert pol.regime(1) == "adaptive" and pol.probes == 1  # 6 s of wall clock since the last probe, little work
  t[0] = 100.0
  measure(pol, "linear", 8, 6.0)
  assert pol.regime(1) == "adaptive" and pol.probes == 1  # an idle minute later: still not
  for _ in range(9):  # 5.4 s of LinearSS rounds
    t[0] += 1.0
    measure(pol, "linear", 8, 6.0, n=100)
  assert pol.regime(1) == "adaptive" and pol.probes == 1
  t[0] += 1.0
  measure(pol, "linear", 8, 6.0, n=100)  # 6 s of work since the last probe
  assert pol.regime(1) == "ar" and pol.probes == 2
  # a runner-up estimated far below the best is not worth a probe
  t[0] = 0.0
  slow = clocked_strategy(t)
  for b in (8, 16, 32):
    measure(slow, "linear", b, 40.0)
  t[0] = 3.0
  measure(slow, "ar", 1, 2.0)
  assert slow.regime(1) == "ar" and slow.probes == 0
  # priced for a foreign device (no calibration): never probes
  fixed = RecGuideStrategy(16, profile=flat_profile(ar_ms=9.0), overlap=False, calibrate=False)
  assert len({fixed.regime(1) for _ in range(5)}) == 1 and fixed.probes == 0


def test_a_probe_runs_the_block_whose_measurement_it_refreshes():
  """A probe of adaptive B runs every row at the block its rate stands on (the stale clock key): the rule's own
  blocks would measure other keys, and cost more than the probe was budgeted at where they are longer."""
  from recguide_jax.decoding.strategy import StepView
  t = [0.0]
  pol = clocked_strategy(t)
  measure(pol, "ar", 1, 2.0, rows=4)
  for b in (8, 16, 32):
    measure(pol, "linear", b, 9.0 if b == 8 else 30.0, rows=4)  # B = 8 is adaptive's best: the probe's basis
  t[0] = 3.0
  measure(pol, "ar", 1, 2.0, rows=4)
  reqs = tuple(_history_requests(4, 1))
  pol._rule_blocks = lambda *args: [8, 32, 16, 32]  # what the per-request rule would plan
  blocks = []
  for step in range(4):
    plan = pol.plan_step(StepView(step + 1, reqs, 4, 1024, 32, frozenset())).plans
    blocks.append(([p.block_size for p in plan], pol.probing))
  assert blocks[:3] == [([8] * 4, True)] * 3 and not blocks[3][1] and pol.probes == 1, blocks


def test_switch_measures_a_regime_it_never_ran_whatever_the_profile_says():
  """A regime none of whose rounds ever ran here is priced by the profile's ratio to the kinds that did, which a
  profile of other hardware (or none) can get several-fold wrong: it is measured once, for as many steps as its
  kind needs to get a median (up to `explore_rounds`), when estimated within `explore_margin` of the best, spaced
  from the first decision by `explore_budget`; after that the `probe_margin` rules again."""
  t = [0.0]
  pol = clocked_strategy(t)
  for b in (8, 16, 32):
    measure(pol, "linear", b, 11.0)  # as profiled: 0.36 tokens/ms; AR, never run, is priced at its profiled 9 ms
  rates = pol.expected_rates(1)
  assert pol.probe_margin * rates["linear8"] > rates["ar"] > pol.explore_margin * rates["linear8"]
  # the first decision: 3 AR rounds of 9 ms wait for 0.27 s of work (LinearSS rounds here), not of wall clock
  assert pol.regime(1) == "adaptive" and pol.probes == 0
  t[0] = 1.0
  measure(pol, "linear", 8, 11.0, n=20)
  assert pol.regime(1) == "adaptive" and pol.probes == 0
  measure(pol, "linear", 8, 11.0, n=5)
  assert pol.regime(1) == "ar" and pol.probing and pol.probes == 1
  # the live rows change between the probe's steps, so no clock key has its median yet: the probe goes on
  for rows in (2, 3, 2):
    measure(pol, "ar", 1, 2.0, rows=rows, n=1)
    assert pol.regime(1) == "ar" and pol.probing
  measure(pol, "ar", 1, 2.0, rows=2, n=1)  # (ar, 1, 2) has its median: AR is measured, at a fifth of the profile's cost
  assert pol.calibrated.clock.ever_measured("ar")
  assert pol.regime(1) == "ar" and not pol.probing and pol.probes == 1  # decided as usual, now on AR's own ratio
  # a probe that never gets a median ends after explore_rounds steps
  t[0] = 0.0
  again = clocked_strategy(t)
  for b in (8, 16, 32):
    measure(again, "linear", b, 11.0)
  again.regime(1)
  measure(again, "linear", 8, 11.0, n=25)
  assert [again.regime(1) for _ in range(again.explore_rounds + 1)] == ["ar"] * again.explore_rounds + ["adaptive"]
  # estimated beyond explore_margin of the best: not worth even a first measurement
  far = clocked_strategy(t, ar_ms=60.0)
  for b in (8, 16, 32):
    measure(far, "linear", b, 11.0)
  assert far.regime(1) == "adaptive"
  measure(far, "linear", 8, 11.0, n=200)
  assert far.regime(1) == "adaptive" and far.probes == 0


def test_switch_judges_a_stale_runner_up_by_fresh_rounds_of_its_kind():
  """A runner-up whose only measurement at this load is a stale cold start looks hopeless by that median; when
  rounds of its kind at another load say it is close today, it is re-measured (and not without them)."""
  def setup(fresh_linear_elsewhere):
    t = [0.0]
    pol = clocked_strategy(t)
    for _ in range(3):
      pol.observe_round("linear", 8, 2, 0.040)  # a cold start: 0.1 tokens/ms at 2 rows
    t[0] = 3.0
    for _ in range(3):
      pol.observe_round("ar", 1, 2, 0.002)  # AR: 0.5 tokens/ms, fresh
      if fresh_linear_elsewhere:  # today's LinearSS rounds at 1 row: half the profile's cost
        pol.observe_round("linear", 8, 1, 0.0055)
    return pol

  pol = setup(fresh_linear_elsewhere=True)
  cal = pol.calibrated
  assert cal.cost("linear", 8, 2) == pytest.approx(40.0)  # the decision still rests on the measured median
  assert cal.fresh_cost("linear", 8, 2) == pytest.approx(12.0 * 0.5)  # today's ratio of its kind
  assert cal.fresh_cost("ar", 1, 2) == pytest.approx(2.0) and cal.fresh_cost("overlap", 16, 2) is None
  assert pol.regime(2) == "adaptive" and pol.probes == 1
  stale_only = setup(fresh_linear_elsewhere=False)
  assert stale_only.calibrated.fresh_cost("linear", 8, 2) is None
  assert stale_only.regime(2) == "ar" and stale_only.probes == 0


def test_calibrated_costs_measure_then_scale_the_profile():
  from recguide_jax.recguide.calibration import CalibratedCosts
  costs = CalibratedCosts(lambda kind, blk, rows: {"ar": 1.0, "linear": 4.0}[kind] * rows, refresh_every=1)
  assert costs.cost("linear", 8, 2) == 8.0  # nothing measured: the profile
  for _ in range(3):
    costs.clock.observe("linear", 8, 2, 0.024)  # 3x the profile
  assert costs.cost("linear", 8, 2) == pytest.approx(24.0)  # measured wins
  assert costs.cost("linear", 8, 4) == pytest.approx(48.0)  # same kind elsewhere: the profile x its ratio
  assert costs.cost("ar", 1, 4) == pytest.approx(12.0)  # a kind never run: the ratio over all kinds
  for _ in range(3):
    costs.clock.observe("ar", 1, 4, 0.006)
  assert costs.cost("ar", 1, 2) == pytest.approx(3.0)  # its own ratio (1.5x) once measured


def test_switch_drops_a_regime_the_profile_flatters_once_measured():
  pol = RecGuideStrategy(16, profile=flat_profile(ar_ms=9.0))
  pol.stats.accepted = {8: 4.0, 16: 4.5, 32: 5.0}
  pol.stats.overlap_hit = {8: 0.3, 16: 0.3, 32: 0.3}
  assert pol.regime(2) != "ar"  # device times alone: speculation looks 3-4x better
  for _ in range(3):  # on this machine's clock every speculative round is slow and AR steps are fast
    pol.observe_round("ar", 1, 2, 0.002)
    for b in (8, 16, 32):
      pol.observe_round("linear", b, 2, 0.100)
    pol.observe_round("overlap", 16, 2, 0.120)
    pol.observe_round("overlap_draft", 16, 2, 0.150)
  assert pol.regime(2) == "ar"
  assert pol.regime(4) == "ar"  # other loads: the profile scaled by what each kind measured
  uncalibrated = RecGuideStrategy(16, profile=flat_profile(ar_ms=9.0), calibrate=False)
  uncalibrated.stats.accepted = dict(pol.stats.accepted)
  for _ in range(3):
    uncalibrated.observe_round("linear", 16, 2, 0.100)
  assert uncalibrated.regime(2) != "ar"  # priced for a foreign device: this machine's clock is ignored


def test_engine_reports_every_round_to_the_strategy(tiny_llm, ar_reference):
  ps, ar = ar_reference
  pol = RecGuideStrategy(16, delta=0.6, profile=flat_profile())
  tiny_llm.set_policy(pol)
  reqs = run_with_concurrency(tiny_llm, ps, 2)
  assert [r.output_ids for r in reqs] == ar
  measured = pol.calibrated.clock.measured()
  assert measured and all(ms > 0 for ms in measured.values())
  assert {kind for kind, _, _ in measured} <= {"ar", "linear", "overlap", "overlap_draft"}
  # every round of every request was timed (a round of a batch serves several requests at once)
  assert pol.calibrated.clock.observations >= max(len(r.stats.accepted_lengths) for r in reqs)


def test_tables_priced_for_other_hardware_keep_their_values_but_not_their_prices():
  from recguide_jax.recguide import adaptive, signals as sig
  from recguide_jax.recguide.fit import value_fit
  from recguide_jax.recguide.config import RecGuideState
  from recguide_jax.recguide.signals import RoundRecord
  rows = [{"dataset": "syn", "request_id": r, "round": t, "s": -0.5 if t else None, "z": "b16_partial" if t else None,
           "A": {"8": 6, "16": 10, "32": 14}} for r in range(30) for t in range(4)]
  model = value_fit.fit_value_model(rows, bins=2)
  flat = flat_profile()  # named "flat": B=32 costs barely more than B=8
  levels = tuple(adaptive.LevelTable(c, 0.0, flat.costs(c), 32) for c in (1, 8))  # rho 0: the longest block
  tables = adaptive.RecGuideTables(value_model=model, levels=levels, profile="flat")

  class Req:
    strategy_state = RecGuideState([RoundRecord(16, 5, 0.5)])
    params, output_ids = SamplingParams(max_tokens=64), []

  same = RecGuideStrategy(16, fixed_regime="adaptive", tables=tables, profile=flat, calibrate=False)
  assert same._adaptive_block(Req(), 1) == 32  # priced where they were fitted: the tables' rule
  steep = HardwareProfile(draft_verify_ms={c: {8: 10.0, 16: 40.0, 32: 160.0} for c in (1, 8)}, name="cpu-here")
  other = RecGuideStrategy(16, fixed_regime="adaptive", tables=tables, profile=steep, calibrate=False)
  values = model.values(sig.signal_s(Req.strategy_state.history, model.window), "b16_partial")
  # the fitted rule keeps its form on this machine's costs (rho carried into their time unit), not argmax V / T
  from recguide_jax.recguide.pricing import decide_rescaled
  local_ratio = max((8, 16, 32), key=lambda b: (values[b] / steep.cost(1, b), -b))
  want = decide_rescaled(values, 0.0, flat.costs(1), steep.costs(1))
  assert other._adaptive_block(Req(), 1) == want == 32 and local_ratio == 8


def _history_requests(n: int, seed: int) -> list:
  """Requests with random RecGuide histories (some none, some AR only) and budgets (some near their end)."""
  import types

  from recguide_jax.recguide.config import RecGuideState
  from recguide_jax.recguide.signals import RoundRecord
  rng = np.random.default_rng(seed)
  reqs = []
  for _ in range(n):
    hist = []
    for _ in range(int(rng.integers(0, 4))):
      blk = int(rng.choice([1, 8, 16, 32]))
      acc = int(rng.integers(1, blk + 1))
      hist.append(RoundRecord(blk, acc, None if blk == 1 else float(rng.choice([0.1, 0.5, 1.5, 3.0]))))
    max_tokens = int(rng.choice([64, 512]))
    reqs.append(types.SimpleNamespace(strategy_state=RecGuideState(hist), output_ids=[0] * int(rng.integers(0, 60)),
                                      params=SamplingParams(max_tokens=max_tokens), finished=False))
  return reqs


def _fitted_tables(profile_name: str):
  from recguide_jax.recguide import adaptive
  from recguide_jax.recguide.fit import value_fit
  rng = np.random.default_rng(3)
  strata = [None, "b8_partial", "b8_full", "b16_partial", "b32_full"]
  rows = [{"dataset": "syn", "request_id": r, "round": t, "s": None if t == 0 else -float(rng.random() * 3),
           "z": None if t == 0 else strata[int(rng.integers(1, 5))],
           "A": {"8": int(rng.integers(1, 9)), "16": int(rng.integers(1, 17)), "32": int(rng.integers(1, 33))}}
          for r in range(60) for t in range(4)]
  model = value_fit.fit_value_model(rows, bins=4)
  flat = flat_profile()
  levels = tuple(adaptive.LevelTable(c, rho, flat.costs(c), cold)
                 for c, rho, cold in ((1, 10.0, 32), (8, 8.0, 16)))
  return adaptive.RecGuideTables(value_model=model, levels=levels, profile=profile_name)


@pytest.mark.parametrize("tables", [None, "flat", "elsewhere"])
def test_a_steps_rule_and_verifications_taken_together_equal_one_request_at_a_time(tables):
  """`price_step` decides the rule once per distinct input and `observe` takes a step's verifications together:
  the same blocks, histories and running estimates as one request at a time, with no tables, tables priced on this
  profile and tables of another."""
  import copy
  import types

  from recguide_jax.recguide.pricing import decide_rescaled
  tables = None if tables is None else _fitted_tables(tables)
  for c in (1, 8, 32):
    pol = RecGuideStrategy(16, profile=flat_profile(), tables=tables, overlap=False)
    reqs = _history_requests(48, c)
    costs, values = pol._linear_costs(c), pol._value_rows(reqs)
    assert values.tolist() == [[pol._values(r)[b] for b in (8, 16, 32)] for r in reqs]
    assert pol._rule_blocks(reqs, c, costs, values) == [pol._adaptive_block(r, c) for r in reqs]

    def reference(r, v):  # the rule written out, one request at a time
      hist = r.strategy_state.history
      if tables is None:
        return max((8, 16, 32), key=lambda b: (v[b] / costs[b], -b))
      if pol._tables_priced_here or not hist:
        return tables.next_block(c, hist)
      return decide_rescaled(v, tables.rho_for(c), tables.costs_for(c), costs)
    assert pol._rule_blocks(reqs, c, costs, values) == [reference(r, pol._values(r)) for r in reqs]
    assert len(set(pol._rule_blocks(reqs, c, costs, values))) > 1 or tables is None

  rng = np.random.default_rng(7)
  reqs = _history_requests(24, 1)
  blocks = rng.choice([1, 8, 16, 32], len(reqs))
  accepted = np.array([rng.integers(1, b + 1) for b in blocks])
  result = types.SimpleNamespace(tokens=rng.integers(0, 6, (len(reqs), 32)),
                                 entropy=rng.random((len(reqs), 32)).astype(np.float32))
  lefts = np.array([r.params.max_tokens - len(r.output_ids) for r in reqs])
  together, alone = (RecGuideStrategy(16, profile=flat_profile(), tables=tables) for _ in range(2))
  together._eos = alone._eos = frozenset({2, 5})
  reqs_alone = copy.deepcopy(reqs)
  together.observe_verifications(reqs, blocks, accepted, result, lefts)
  for i, r in enumerate(reqs_alone):
    alone.observe_verification(r, int(blocks[i]), int(accepted[i]), result, i, int(lefts[i]))
  assert [r.strategy_state.history for r in reqs] == [r.strategy_state.history for r in reqs_alone]
  assert any(rec.entropy is not None for r in reqs for rec in r.strategy_state.history)
  assert together.stats == alone.stats
  assert together.value_calibration == alone.value_calibration
  if tables is not None:  # the grid rows of the moved histories, computed together, are those each gives alone
    from recguide_jax.recguide import signals
    model = tables.value_model
    at = together._rows(reqs)
    moved = (together.histories.grid_row[at] < 0).tolist()
    kept = together.histories.grid_rows(at, model).tolist()
    fresh = [model.grid_row(*((signals.signal_s(h, model.window), signals.stratum(h)) if h else (None, None)))
             for h in (r.strategy_state.history for r in reqs)]
    assert [k for k, m in zip(kept, moved) if m] == [f for f, m in zip(fresh, moved) if m]
    assert all(moved) and (blocks > 1).any()  # every history moved (or was never read): all computed together


@pytest.mark.parametrize("fixed_regime", [None, "overlap"])
def test_overlap_draft_shares_follow_each_requests_own_overlap_test(fixed_regime):
  """The switch's per-request draft shares (computed inline for speed) skip exactly the requests
  `_overlap_remaining` rules out (sampled, or ending within a round without a draft of overlap's block) and price
  the rest by their own budget and branch."""
  import dataclasses

  from recguide_jax.recguide import overlap as ov
  reqs = _history_requests(40, 5)
  rng = np.random.default_rng(5)
  for i, r in enumerate(reqs):
    r.params = dataclasses.replace(r.params, temperature=float(rng.choice([0.0, 0.2, 0.3, 0.4, 0.7])),
                                   max_tokens=int(rng.choice([len(r.output_ids) + 2, 300])))
    if i % 3 == 0:
      r.strategy_state.prefetched = ov.Prefetched(np.zeros(16, np.int32), np.zeros((3, 16), np.float32), "p1")
  pol = RecGuideStrategy(16, profile=flat_profile(), fixed_regime=fixed_regime)
  pol.stats.overlap_hit[16] = 0.4
  hit, accepted = pol.stats.overlap_hit[16], max(pol.stats.accepted[16], 1.0)
  floor = 0.0 if fixed_regime else pol.stats.accepted[16]  # where the switch decides, the last round is not overlap's
  want = []
  for r in reqs:
    remaining = pol._overlap_remaining(r)
    if remaining is not None:
      left = max(1.0, (remaining - floor) / accepted)
      first = 0.0 if pol.state(r).prefetched is not None else 1.0
      want.append((first + (left - 1.0) * (1.0 - hit)) / left)
  shares = pol.overlap_draft_shares(reqs)
  assert len(shares) == len(want) and np.allclose(shares, want, rtol=1e-12) and 0 < len(want) < len(reqs)
  if not fixed_regime:  # one a round is expected to finish overlaps only to verify the draft it holds (share 0)
    ending = [r for r in reqs if r.params.temperature <= 0.3 and pol._remaining(r) <= pol.stats.accepted[16]]
    holds = [pol.state(r).prefetched is not None for r in ending]
    assert set(holds) == {True, False}
    assert [pol._overlap_remaining(r) is not None for r in ending] == holds


@pytest.mark.parametrize("calibrate", [False, True])
def test_switch_skips_overlaps_draft_shares_only_where_they_cannot_change_its_decision(calibrate):
  """Where overlap's best case (its fused round alone) cannot change the switch's decision, the switch skips the pass
  over every request that overlap's draft shares take: its decisions, probes included, are those it makes with the
  shares, over random loads, requests and (calibrated) measured round times, fresh and stale."""
  from recguide_jax.llm import BUNDLED_CHECKPOINT, recguide_defaults
  from recguide_jax.recguide.profile import load_profile
  from recguide_jax.recguide.signals import RoundRecord
  rng = np.random.default_rng(3)
  t = [0.0]
  kwargs = dict(recguide_defaults(BUNDLED_CHECKPOINT), profile=load_profile("b200_nld8b"), calibrate=calibrate)
  fast, exact = (RecGuideStrategy(16, **kwargs) for _ in range(2))
  exact._overlap_out_of_reach = lambda *args: False
  skipped, decided = [], collections.Counter()
  out_of_reach = fast._overlap_out_of_reach
  fast._overlap_out_of_reach = lambda *args: skipped.append(out_of_reach(*args)) or skipped[-1]
  for pol in (fast, exact):
    pol.calibrated.clock.now = lambda: t[0]
  for step in range(400):
    c = int(rng.choice([1, 2, 4, 8, 16, 32, 64, 128]))
    reqs = _history_requests(c, step)
    if rng.random() < 0.5:  # greedy requests whose drafts were all accepted lately, far from their end: overlap's load
      for r in reqs:
        r.strategy_state.history = [RoundRecord(16, 16, 0.05)] * 3
        r.params = SamplingParams(temperature=0.0, max_tokens=1000)
    if calibrate:  # both clocks measure the same rounds (random kinds and costs; overlap only in the second half)
      kind, blk = rng.choice([("linear", 16), ("linear", 8), ("ar", 1)] + [("overlap_draft", 16)] * (step > 200))
      ms = {"ar": 1.0, "linear": 4.0, "overlap_draft": 9.0}[kind] * rng.uniform(0.3, 3.0) + rng.uniform(0, 0.05) * c
      for pol in (fast, exact):
        for _ in range(3):
          pol.observe_round(kind, int(blk), c, ms / 1e3)
    values = fast._value_rows(reqs)
    got, want = fast.regime(c, reqs, values), exact.regime(c, reqs, values)
    assert (got, fast.probing) == (want, exact.probing), (step, c, got, want)
    decided[got, fast.probing] += 1
    t[0] += float(rng.choice([0.1, 0.5, 3.0]))
  assert sum(skipped) > 40 and len(decided) >= (5 if calibrate else 2), (sum(skipped), decided)


def test_a_steps_verified_rounds_move_the_running_estimates_as_one_round_at_a_time():
  """`OnlineStats.observe_verified_rounds` (a step's rows at once) leaves the estimates an exponential moving
  average leaves round by round in row order, blocks outside 8 / 16 / 32 skipped."""
  from recguide_jax.recguide.estimates import OnlineStats
  rng = np.random.default_rng(5)
  blocks = rng.choice([1, 8, 16, 32, 48], 40).tolist()
  accepted = [int(rng.integers(1, b + 1)) for b in blocks]
  for rounds in (1, 3):
    together, alone = OnlineStats(), OnlineStats()
    together.observe_verified_rounds(blocks, accepted, rounds)
    for blk, got in zip(blocks, accepted):
      for _ in range(rounds):
        if blk in (8, 16, 32):
          alone.accepted[blk] = alone.decay * alone.accepted[blk] + (1 - alone.decay) * got
    assert together.accepted == alone.accepted and set(together.accepted) == {8, 16, 32}
    assert together.accepted != OnlineStats().accepted


def test_value_calibration_scales_predictions_by_what_verification_returned():
  from recguide_jax.recguide.estimates import ValueCalibration
  cal = ValueCalibration(min_rounds=4)
  for _ in range(3):
    cal.observe(8, 4.0, 2)
  assert cal.scale(8) == 1.0  # too few rounds to say
  cal.observe(16, 6.0, 3)
  assert cal.scale(8) == pytest.approx(0.5) and cal.scale(32) == pytest.approx(0.5)  # pooled over every B so far
  cal.observe(8, 4.0, 2)
  for _ in range(8):
    cal.observe(32, 2.0, 2)
  assert cal.scale(32) == pytest.approx(1.0) and cal.scale(8) == pytest.approx(0.5)  # each B by its own rounds
  assert 0.5 < cal.scale(16) < 1.0  # still pooled
  for _ in range(200):
    cal.observe(16, 1.0, 9)
  assert cal.scale(16) == cal.hi  # clamped: a prediction is corrected, never replaced


def test_recguide_corrects_fitted_values_that_over_promise_on_this_workload():
  """Tables fitted where B = 8 rounds accept 6 tokens, served where they accept 2: a calibrating switch scales the
  fitted values by what its verifications returned; one pricing for a foreign device keeps the tables' values."""
  import types

  from recguide_jax.recguide import adaptive
  from recguide_jax.recguide.fit import value_fit
  from recguide_jax.recguide.config import RecGuideState
  rows = [{"dataset": "syn", "request_id": r, "round": t, "s": None, "z": None, "A": {"8": 6, "16": 8, "32": 9}}
          for r in range(30) for t in range(4)]
  model = value_fit.fit_value_model(rows, bins=2)
  prof = flat_profile(ar_ms=4.0)
  tables = adaptive.RecGuideTables(value_model=model, levels=(adaptive.LevelTable(1, 0.0, prof.costs(1), 8),),
                                   profile="elsewhere")

  def request():
    req = types.SimpleNamespace(strategy_state=RecGuideState(), params=SamplingParams(max_tokens=512), output_ids=[])
    return req

  result = types.SimpleNamespace(tokens=np.full((1, 8), 7), entropy=np.full((1, 8), 0.5, np.float32))
  here = RecGuideStrategy(16, tables=tables, profile=prof, overlap=False)
  foreign = RecGuideStrategy(16, tables=tables, profile=prof, overlap=False, calibrate=False)
  for pol in (here, foreign):
    before = pol._values(request())
    assert before[8] == pytest.approx(6.0, rel=0.05)
    for _ in range(20):
      pol.observe_verification(request(), 8, 2, result, 0)
  assert here._values(request())[8] == pytest.approx(2.0, rel=0.05)
  assert here._values(request())[16] == pytest.approx(8.0 / 3, rel=0.05)  # not run here yet: the pooled scale
  assert foreign._values(request())[8] == pytest.approx(6.0, rel=0.05)


def test_metrics_and_clone_are_the_strategys_own():
  """The server reads RecGuide's series through `metrics()` (no private state), and a data-parallel group gets a
  `clone()`: the same configuration and read-only tables, none of the mutable state."""
  from recguide_jax.llm import BUNDLED_CHECKPOINT, recguide_defaults
  pol = RecGuideStrategy(16, **recguide_defaults(BUNDLED_CHECKPOINT))
  pol.regime_counts["ar"] += 3
  pol.overlap_outcomes["correction_hit"] += 2
  pol.overlap_outcomes["no_hit"] += 1
  pol.current_regime = "ar"
  series = {m.name: m for m in pol.metrics()}
  assert dict(series["regime_decisions"].value)["ar"] == 3
  assert dict(series["regime"].value) == {"overlap": 0.0, "adaptive": 0.0, "linear": 0.0, "ar": 1.0}
  assert series["overlap_hits"].value == 2 and series["overlap_misses"].value == 1
  twin = pol.clone()
  assert type(twin) is RecGuideStrategy and twin.tables is pol.tables and twin.profile is pol.profile
  assert twin.delta == pol.delta and twin.overlap_slots == pol.overlap_slots and twin.planner == pol.planner
  assert not twin.regime_counts and twin.stats is not pol.stats and twin.calibrated is not pol.calibrated


@pytest.mark.parametrize("regime", ["ar", "linear", "adaptive", "overlap"])
def test_ar_linear_and_adaptive_steps_run_ahead(tiny_llm, ar_reference, regime):
  """A step whose regime is AR, fixed-B LinearSS or adaptive at the block the step before it ran is decided one step
  late and dispatched while the call before it runs, with the same tokens; an overlap step never is (its draft is
  what its predecessor's verification confirms)."""
  ps, ar = ar_reference
  pol = RecGuideStrategy(16, fixed_regime=regime, profile=flat_profile())
  said = []
  plans_ahead = pol.plans_ahead
  pol.plans_ahead = lambda batch: said.append(plans_ahead(batch)) or said[-1]
  tiny_llm.set_policy(pol)
  reqs = run_with_concurrency(tiny_llm, ps, 8)
  assert [r.output_ids for r in reqs] == ar
  assert any(said) == (regime != "overlap")


def test_adaptive_ragged_steps_run_ahead_at_the_blocks_priced_one_round_late(tiny_llm, ar_reference):
  """On ragged steps an adaptive step runs ahead whatever blocks its batch pricing gives the rows, one round late
  (any block is lossless): AR's tokens, and some call dispatched ahead at other blocks than the call before it."""
  ps, ar = ar_reference
  pol = RecGuideStrategy(16, fixed_regime="adaptive", profile=flat_profile())
  pol.stats.accepted = {8: 2.0, 16: 2.05, 32: 2.1}  # nearly tied values: the blocks move with every estimate
  said = []
  plans_ahead = pol.plans_ahead
  pol.plans_ahead = lambda batch: said.append((batch.planned, plans_ahead(batch))) or said[-1][1]
  tiny_llm.set_policy(pol)
  tiny_llm.engine.bucketing = "ragged"
  try:
    reqs = run_with_concurrency(tiny_llm, ps, 8)
  finally:
    tiny_llm.engine.bucketing = "auto"
  assert [r.output_ids for r in reqs] == ar
  assert any(ahead is not None and not np.array_equal(ahead.planned, planned) for planned, ahead in said)


def test_a_decision_made_ahead_is_the_next_steps_own():
  """`plans_ahead` decides the next step; when that decision is another regime the step is planned by the engine as
  usual, and plan_step takes the decision made (the switch runs once per step: its probes count steps)."""
  from types import SimpleNamespace

  from recguide_jax.decoding import rounds
  from recguide_jax.decoding.strategy import StepView
  t = [0.0]
  pol = clocked_strategy(t, ar_ms=1.0)  # AR at 1 ms against 11+ ms LinearSS rounds accepting 4: AR wins
  pol.calibrate = False
  pol.current_regime = "ar"
  batch = SimpleNamespace(round=rounds.AR, block=1, n=4, reqs=[object()] * 4, planned=np.ones(4, np.int64),
                          verify_price=None)
  assert pol.plans_ahead(batch) and pol.regime_counts["ar"] == 4 and pol._decided_ahead is None
  pol.stats.accepted = {8: 40.0, 16: 40.0, 32: 40.0}  # now speculation wins
  assert not pol.plans_ahead(batch) and pol._decided_ahead == (4, "adaptive")
  pol.regime = lambda *a, **k: pytest.fail("the step's regime was decided twice")
  pol.price_step = lambda reqs, c, values: ("rule", [8] * len(reqs))
  plans = pol.plan_step(StepView(2, tuple(batch.reqs), 64, 4096, 32, frozenset())).plans
  assert [p.block_size for p in plans] == [8] * 4 and pol.current_regime == "adaptive"
  assert pol._decided_ahead is None
  del pol.regime  # (the switch decides the steps after this one again)
  # adaptive: ahead while the batch pricing gives every row the block the step ran at, one step late
  linear8 = SimpleNamespace(round=rounds.LINEAR, block=8, n=4, reqs=batch.reqs, planned=np.full(4, 8),
                            verify_price=None)
  assert pol.plans_ahead(linear8) and pol._decided_ahead is None and pol.regime_counts["adaptive"] == 8
  pol.price_step = lambda reqs, c, values: ("rule", [8, 8, 16, 8])
  assert not pol.plans_ahead(linear8) and pol._decided_ahead == (4, "adaptive")  # its blocks: on the fresh histories
  pol._decided_ahead = None
  # a ragged step of mixed blocks: ahead while every row keeps its own
  ragged = SimpleNamespace(round=rounds.RAGGED, block=16, n=4, reqs=batch.reqs, planned=np.array([8, 8, 16, 8]),
                           verify_price=None)
  assert pol.plans_ahead(ragged) and pol._decided_ahead is None
  # on a ragged step each row may take another block: the blocks priced now, on the histories one round late
  pol.price_step = lambda reqs, c, values: ("rule", [8, 8, 16, 16])
  ahead = pol.plans_ahead(ragged)
  assert ahead.planned.tolist() == [8, 8, 16, 16] and ahead.verify_price is None and pol._decided_ahead is None
  pol.price_step = lambda reqs, c, values: ("ar", [1, 1, 1, 1])  # no row drafts: planned after the outcome
  assert pol.plans_ahead(ragged) is None and pol._decided_ahead == (4, "adaptive")


def test_an_ar_round_of_settled_requests_changes_nothing_and_a_verification_unsettles_them():
  """`_observe_ar` skips a batch list whose states its last AR round left all-AR with no branch; a drafted block's
  verification of one of them makes the next AR round write its history again, as with no skip at all."""
  import types

  from recguide_jax.recguide.config import HISTORY, RecGuideState
  result = types.SimpleNamespace(tokens=np.full((1, 8), 7), entropy=np.full((1, 8), 0.5, np.float32))
  histories = {}
  for skip in (True, False):
    pol = RecGuideStrategy(16)
    reqs = [types.SimpleNamespace(strategy_state=RecGuideState(), params=SamplingParams(max_tokens=512),
                                  output_ids=[]) for _ in range(3)]

    def ar_round(rounds, pol=pol, reqs=reqs, skip=skip):
      if not skip:
        pol._ar_settled = None  # (forgets what it found settled: every AR round reads every state)
      pol._observe_ar(reqs, rounds)
    for rounds in (1, 2, 1):  # settled at the fourth AR record
      assert pol._ar_settled is None
      ar_round(rounds)
    assert (pol.histories.ar_tail[pol._rows(reqs)] >= HISTORY).all() and pol._ar_settled is reqs
    ar_round(2)
    pol.observe_verification(reqs[1], 8, 3, result, 0)  # a drafted block: reqs[1]'s history moves
    assert pol.histories.ar_tail[reqs[1].strategy_state.row] == 0 and pol._ar_settled is None
    ar_round(1)
    assert pol.histories.ar_tail[reqs[1].strategy_state.row] == 1
    histories[skip] = [[(rec.block_size, rec.accepted) for rec in r.strategy_state.history] for r in reqs]
  assert histories[True] == histories[False]
  assert histories[True][1][-2:] == [(8, 3), (1, 1)]
