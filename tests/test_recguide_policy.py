"""The RecGuide controller end to end: lossless at every load and regime, bucketing on and off, fitted tables in
the loop, and the load/hardware-aware switch choosing AR where speculation would lose."""

import numpy as np
import pytest

from recguide_jax import SamplingParams, policies
from recguide_jax.orchestrator.policy import RecGuidePolicy
from recguide_jax.orchestrator.profile import HardwareProfile

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


@pytest.fixture(scope="module")
def ar_reference(tiny_llm):
  ps = prompts(8, 11)
  tiny_llm.set_policy(policies.ARPolicy())
  return ps, [o.token_ids for o in tiny_llm.generate(ps, PARAMS)]


def run_with_concurrency(llm, ps, concurrency):
  from recguide_jax import bench
  reqs, _ = bench.run_concurrent(llm.engine, ps, PARAMS, concurrency)
  assert llm.engine.allocator.num_used == 0
  return reqs


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_recguide_switch_is_lossless(tiny_llm, ar_reference, concurrency):
  ps, ar = ar_reference
  pol = RecGuidePolicy(16, delta=0.6, profile=flat_profile())
  tiny_llm.set_policy(pol)
  reqs = run_with_concurrency(tiny_llm, ps, concurrency)
  assert [r.output_ids for r in reqs] == ar
  assert sum(pol.regime_counts.values()) > 0


@pytest.mark.parametrize("bucketing", [True, False])
def test_adaptive_blocks_lossless_with_and_without_bucketing(tiny_llm, ar_reference, bucketing):
  ps, ar = ar_reference
  pol = RecGuidePolicy(16, fixed_regime="adaptive", profile=flat_profile())
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
  pol = RecGuidePolicy(16, profile=cheap_ar)
  pol.stats.accepted = {8: 1.5, 16: 1.6, 32: 1.7}
  pol.stats.overlap_accepted = 1.6
  assert pol.regime(8) == "ar"
  costly_ar = flat_profile(ar_ms=9.0)
  pol = RecGuidePolicy(16, profile=costly_ar)
  pol.stats.accepted = {8: 6.0, 16: 9.0, 32: 12.0}
  pol.stats.overlap_accepted, pol.stats.overlap_hit = 12.0, 0.6
  assert pol.regime(1) in ("overlap", "adaptive")
  rates = pol.expected_rates(1)
  assert rates["ar"] < max(rates.values())


def test_fitted_tables_drive_the_block_choice(tiny_llm, ar_reference, tmp_path):
  from recguide_jax.orchestrator import adaptive, value_model as vm
  rng = np.random.default_rng(0)
  rows = []
  for req in range(40):  # synthetic traces: confident history (high s) means long acceptance
    for t in range(6):
      s = -float(rng.uniform(0.1, 3.0))
      good = s > -1.0
      a8, a16, a32 = (8, 16, 30) if good else (2, 2, 2)
      rows.append({"dataset": "syn", "request_id": req, "round": t, "s": s if t else None,
                   "z": "b16_partial" if t else None, "A": {"8": a8, "16": a16, "32": a32}})
  model = vm.fit_value_model(rows, bins=4)
  assert model.value(32, -0.5, "b16_partial") > model.value(32, -2.5, "b16_partial")
  ps, ar = ar_reference
  prof = flat_profile()
  groups = adaptive.group_rows(rows)
  levels = []
  for c in (1, 8):
    costs = prof.costs(c)
    sol = adaptive.solve_rho(groups, model, costs)
    levels.append(adaptive.LevelPolicy(concurrency=c, rho=sol.rho, cold_start_block=adaptive.cold_start_block(c),
                                       costs_ms=costs))
  tables = adaptive.AdaptivePolicyTables(value_model=model, levels=tuple(levels), profile="flat")
  tables.save(tmp_path)
  loaded = adaptive.load_policy(tmp_path)
  pol = RecGuidePolicy(16, fixed_regime="adaptive", tables=loaded, profile=prof)
  tiny_llm.set_policy(pol)
  reqs = run_with_concurrency(tiny_llm, ps, 8)
  assert [r.output_ids for r in reqs] == ar
  assert {b for r in reqs for b in r.stats.block_sizes} <= {8, 16, 32}


class _AlternatingRegimes(RecGuidePolicy):
  """Per request: overlap, overlap, AR, overlap, LinearSS, ... A prefetched branch must not outlive the round
  right after the one that made it."""
  SCHEDULE = ("overlap", "overlap", "ar", "overlap", "linear")

  def plan(self, req, engine):
    from recguide_jax.policies import RoundPlan
    k = req.stats.rounds % len(self.SCHEDULE)
    if req.stats.rounds and k in (3, 0):  # the previous round of this request was AR / LinearSS
      self.stale += "prefetched" in req.policy_state
    kind = self.SCHEDULE[k]
    self.regime_counts[kind] += 1
    return RoundPlan(kind, 1 if kind == "ar" else self.block_size)


def test_prefetched_branches_do_not_survive_a_regime_switch(tiny_llm):
  ps = prompts(16, 5)
  params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
  tiny_llm.set_policy(policies.ARPolicy())
  ar = [o.token_ids for o in tiny_llm.generate(ps, params)]
  pol = _AlternatingRegimes(8, delta=1.0, planner="expected_hit")
  pol.stale = 0
  tiny_llm.set_policy(pol)
  saved = tiny_llm.engine.totals["overlap_saved_drafts"]
  assert [o.token_ids for o in tiny_llm.generate(ps, params)] == ar
  assert {"overlap", "ar", "linear"} <= set(pol.regime_counts)
  assert tiny_llm.engine.totals["overlap_saved_drafts"] > saved and pol.stale == 0
  assert tiny_llm.engine.allocator.num_used == 0
